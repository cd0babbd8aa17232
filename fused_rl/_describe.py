"""``fused_rl.describe()``: which backend each device gets here, and why.

``backend="auto"`` picks Triton or the plain-PyTorch reference silently, per call, from the
tensors' device and the Triton interpreter setting. This module reports that choice before
any call (``describe()``, or ``python -m fused_rl``) and, through the ``fused_rl`` logger,
the first time each choice is made (``logging.getLogger("fused_rl").setLevel("INFO")``).
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass, field

import torch

from . import _backend, config
from ._version import __version__


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class Description:
    """What :func:`describe` found. ``devices`` maps a device to ``(auto_backend, reason)``;
    ``reason`` says why ``"auto"`` cannot run Triton there (None when it can)."""

    versions: dict[str, str | None]
    interpreter_requested: bool
    interpreter_enabled: bool
    check_values: bool
    devices: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fused_rl {self.versions['fused_rl']}"]
        lines.append(
            "  "
            + ", ".join(
                f"{k} {v or 'not installed'}" for k, v in self.versions.items() if k != "fused_rl"
            )
        )
        lines.append(
            "  Triton interpreter (TRITON_INTERPRET=1): "
            + (
                "on"
                if self.interpreter_enabled
                else "requested but inactive"
                if self.interpreter_requested
                else "off"
            )
        )
        lines.append(
            f"  value checks (fused_rl.config.check_values): {'on' if self.check_values else 'off'}"
        )
        lines.append("  backend='auto' runs:")
        for device, (which, reason) in self.devices.items():
            how = "Triton (interpreted)" if which == "triton" and device == "cpu" else which
            how = "Triton" if how == "triton" else how
            lines.append(f"    {device:<8} {how}" + (f": {reason}" if reason else ""))
        lines.append(
            "  (logging.getLogger('fused_rl').setLevel('INFO') logs each call's first choice)"
        )
        return "\n".join(lines)

    __repr__ = __str__


def describe() -> Description:
    """Report the versions, the Triton interpreter state and, for each device present, the
    backend ``backend="auto"`` runs there with the reason when it is not Triton. Prints
    nicely (``print(fused_rl.describe())``, or ``python -m fused_rl``); its fields are there
    for code. Makes no launch and no host sync.

    Example:
        >>> import fused_rl
        >>> d = fused_rl.describe()
        >>> d.devices["cpu"][0] in ("triton", "reference")
        True
    """
    versions = {
        "fused_rl": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
    devices: dict[str, tuple[str, str | None]] = {}
    for index in range(-1, torch.cuda.device_count()):
        device = torch.device("cpu") if index < 0 else torch.device("cuda", index)
        name = str(device) if index < 0 else f"{device} ({torch.cuda.get_device_name(index)})"
        problem = _backend._triton_problem(device)
        devices[name] = ("reference", problem) if problem else ("triton", None)
    return Description(
        versions=versions,
        interpreter_requested=_backend.interpreter_requested(),
        interpreter_enabled=_backend.interpreter_enabled(),
        check_values=config.check_values,
        devices=devices,
    )
