"""Host-side cost of a call, measured without a GPU: kernel launches and wrapper time.

A call's cost on a GPU is its kernels plus everything around them: every extra aten op is
another launch (~3-5 us of host time and a GPU bubble on a small batch). These tools make
that cost visible on any machine:

* :func:`stub_kernels` replaces every Triton launch by a no-op that only records the kernel's
  name, so the Python wrapper can be timed on CPU with the kernels costing nothing (their
  outputs are then left unwritten: use it for timing and counting, never for values);
* :class:`LaunchCounter` counts the device-kernel-equivalent ops of a region: aten ops that
  would launch a kernel on a GPU (views, metadata and allocations excluded) plus Triton
  launches.

Example:
    >>> import torch, fused_rl
    >>> from fused_rl.profiling import LaunchCounter
    >>> x = torch.randn(4, 8)
    >>> with LaunchCounter() as c:
    ...     y = (x * 2).sum()
    >>> c.total, c.ops
    (2, ['aten.mul.Tensor', 'aten.sum.default'])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

# ops that never launch a kernel: allocation without a fill, metadata, host scalars
_NO_LAUNCH = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_local_scalar_dense",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
}


def _launches(func) -> bool:
    if func.namespace != "aten":
        return False
    if getattr(func, "is_view", False):
        return False
    return func._opname not in _NO_LAUNCH


def _triton_kernel_classes() -> list[type]:
    """The classes whose ``run`` launches a Triton kernel (compiled and interpreted)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing to stub
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


@contextlib.contextmanager
def stub_kernels(record: list[str] | None = None) -> Iterator[list[str]]:
    """Within the block, Triton launches do nothing but append the kernel's name to
    ``record`` (a fresh list if None), which the context yields."""
    record = [] if record is None else record
    saved = []

    def fake_run(self, *args, grid=None, warmup=False, **kwargs):
        if not warmup:
            fn = getattr(self, "fn", None)
            record.append(getattr(fn, "__name__", repr(self)))

    for cls in _triton_kernel_classes():
        saved.append((cls, cls.__dict__["run"]))
        cls.run = fake_run
    try:
        yield record
    finally:
        for cls, run in saved:
            cls.run = run


class LaunchCounter(TorchDispatchMode):
    """Count device-kernel-equivalent ops: kernel-launching aten ops and Triton launches.

    Triton kernels are stubbed (:func:`stub_kernels`) while the counter is active, so the
    region's numeric outputs are meaningless; only ``ops``, ``kernels`` and ``total`` are.
    Ops inside ``torch.library`` custom ops are counted too.
    """

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.kernels: list[str] = []
        self._stub = None
        self._depth = 0

    @property
    def total(self) -> int:
        return len(self.ops) + len(self.kernels)

    def __enter__(self):
        if self._depth == 0:
            self._stub = stub_kernels(self.kernels)
            self._stub.__enter__()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._stub.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prim"):
            opdef = _maybe_get_opdef(func)
            if opdef is not None:  # a torch.library custom op: count what its body runs
                with self:
                    return opdef._init_fn(*args, **kwargs)
            return func(*args, **kwargs)
        if _launches(func):
            self.ops.append(str(func))
        return func(*args, **kwargs)


class AllocationTracker(TorchDispatchMode):
    """Record the size in bytes of every fresh storage an aten op returns in the region
    (outputs that alias an input are views, not allocations). With :func:`stub_kernels`
    (entered automatically) it runs on any machine: ``sizes`` is what a GPU would allocate.

    Example:
        >>> import torch
        >>> from fused_rl.profiling import AllocationTracker
        >>> x = torch.randn(1000)
        >>> with AllocationTracker() as a:
        ...     y = x[:10] * 2
        >>> a.sizes
        [40]
    """

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []
        self._stub = None

    def count_at_least(self, nbytes: int) -> int:
        return sum(size >= nbytes for size in self.sizes)

    def __enter__(self):
        self._stub = stub_kernels()
        self._stub.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stub.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out
