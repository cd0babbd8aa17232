"""``python -m fused_rl``: versions, the Triton interpreter state and the backend that
``backend="auto"`` runs on each device here (see :func:`fused_rl.describe`)."""

import fused_rl

print(fused_rl.describe())
