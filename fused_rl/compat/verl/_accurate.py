"""verl's op sequences under the half-precision mode (:mod:`fused_rl.compat._precision`).

Many verl adapters are verl's own PyTorch op sequence, transcribed op for op (the order fixes
every rounding and every output dtype). :func:`_run` runs such a sequence:

* in ``"accurate"`` mode (the default) with an fp16 / bf16 input: on fp32 copies of the
  half-precision tensors, each output then rounded once to the dtype verl's sequence returns
  for the real inputs (found once by running it on meta tensors, cached by dtype and rank);
* otherwise (``"original"`` mode, or no half-precision input): as is, so in ``"original"``
  mode an fp16 / bf16 input gets verl's own roundings bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import half_precision_mode

_HALF = (torch.float16, torch.bfloat16)


def _describe(x):
    """What decides the dtype an op sequence returns: a tensor's dtype and rank, a Python
    scalar's type, a mode string's (or flag's) value."""
    if isinstance(x, Tensor):
        return ("tensor", x.dtype, x.dim())
    if x is None or isinstance(x, (bool, str)):
        return x
    return type(x)


def _meta(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Tensor) else x


def _fp32(x):
    return x.float() if isinstance(x, Tensor) and x.dtype in _HALF else x


_OUT_DTYPES: dict = {}


def _out_dtypes(impl, args, kwargs):
    """The dtype(s) ``impl`` returns for these inputs: run once on meta tensors, cached."""
    key = (impl, tuple(map(_describe, args)), tuple((k, _describe(v)) for k, v in kwargs.items()))
    dtypes = _OUT_DTYPES.get(key)
    if dtypes is None:
        with torch.no_grad():
            probe = impl(*map(_meta, args), **{k: _meta(v) for k, v in kwargs.items()})
        dtypes = tuple(t.dtype for t in probe) if isinstance(probe, tuple) else probe.dtype
        _OUT_DTYPES[key] = dtypes
    return dtypes


def _run(impl, *args, **kwargs):
    """Run ``impl``, a plain-PyTorch op sequence written as verl computes, under the
    half-precision mode: with an fp16 / bf16 input in ``"accurate"`` mode, on fp32 copies of
    the half-precision tensors, each output cast to the dtype verl returns; otherwise as is."""
    floating = [x for x in (*args, *kwargs.values()) if isinstance(x, Tensor)]
    if half_precision_mode() == "original" or not any(t.dtype in _HALF for t in floating):
        return impl(*args, **kwargs)
    dtypes = _out_dtypes(impl, args, kwargs)
    out = impl(*map(_fp32, args), **{k: _fp32(v) for k, v in kwargs.items()})
    if isinstance(out, tuple):
        return tuple(o.to(d) for o, d in zip(out, dtypes))
    return out.to(dtypes)
