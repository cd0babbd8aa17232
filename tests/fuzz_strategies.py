"""Hypothesis building blocks for ``tests/test_fuzz.py``: tensors with awkward layouts and
planted special values, masks, targets, and the ``Case`` every fuzz test runs on both backends.

A tensor argument is an :class:`Arg`: a *base* tensor (the autograd leaf, the storage) and a
*layout* that views it as the logical input the op receives (transposed, strided slice, offset
slice, stride-0 expand). Values come from a seeded ``torch.Generator`` (cheap to draw, easy
to reproduce) plus a short hypothesis-drawn list of *plants*: single elements overwritten with
NaN, +-inf, +-1e30, +-1e-30 or 0. Unused storage of a layout (the gaps of a strided slice, the
row before an offset slice) holds NaN / invalid indices, so a kernel that reads outside the
view shows up as a disagreement with the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

NAN, INF = float("nan"), float("inf")
SPECIAL_VALUES = (NAN, NAN, INF, -INF, 1e30, -1e30, 1e-30, -1e-30, 0.0)
# A policy's own log-prob is never > 0 and a sampling policy's never -inf (the token was drawn
# from it): without those, ``exp(logp - old)`` cannot overflow. An infinite ratio on a clipped
# branch has a gradient of 0 (the kernels) or 0 * inf = NaN (autograd, the reference): which
# is right is debatable, so the fuzzer does not go there.
NEW_LOGPROB_SPECIALS = (NAN, NAN, -INF, -1e30, -1e-30, 0.0)
OLD_LOGPROB_SPECIALS = (NAN, NAN, INF, 1e30, -1e-30, 0.0)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded")
# V below the kernels' smallest vocab block (16), odd, and just above powers of two
VOCAB_SIZES = (1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 65, 70)
IGNORE_INDICES = (-100, -1, 0, 7777)
GAP_INDEX = -987654  # what the gaps of an index tensor hold: out of range for every op

# ----------------------------------------------------------------------------- one tensor


def _view_fn(layout: str, shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    if layout == "transposed":
        return lambda b: b.transpose(-1, -2)
    if layout == "sliced":
        return lambda b: b[..., ::2]
    if layout == "offset":
        return lambda b: b[1:]
    if layout == "expanded":
        return lambda b: b.expand(shape)
    return lambda b: b


def _base_from_logical(logical: torch.Tensor, layout: str, fill) -> torch.Tensor:
    """Storage whose ``layout`` view equals ``logical`` (``fill`` in the unused storage)."""
    if layout == "transposed":
        return logical.transpose(-1, -2).contiguous()
    if layout == "sliced":
        shape = (*logical.shape[:-1], 2 * logical.shape[-1])
        base = torch.full(shape, fill, dtype=logical.dtype)
        base[..., ::2] = logical
        return base
    if layout == "offset":
        base = torch.full((logical.shape[0] + 1, *logical.shape[1:]), fill, dtype=logical.dtype)
        base[1:] = logical
        return base
    return logical.clone()  # contiguous; "expanded" bases are built compact


def usable_layouts(shape: tuple[int, ...]) -> tuple[str, ...]:
    out = ["contiguous"]
    if len(shape) >= 2:
        out.append("transposed")
    if len(shape) >= 1:
        out += ["sliced", "offset", "expanded"]
    return tuple(out)


def _compact_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Shape of the values drawn: an expanded tensor is constant along dim 0."""
    if layout == "expanded":
        return (1, *shape[1:])
    return shape


@dataclass
class Arg:
    """One tensor argument: ``view(base)`` is what the op receives."""

    base: torch.Tensor
    layout: str
    shape: tuple[int, ...]  # logical shape
    planted: torch.Tensor | None = None  # bool, base-shaped: elements overwritten by plants
    plants: tuple = ()  # (compact flat index, value) as drawn, for the repr
    origin: str = ""  # how the values were drawn, for the repr

    def view(self, base: torch.Tensor | None = None) -> torch.Tensor:
        return _view_fn(self.layout, self.shape)(self.base if base is None else base)

    def value(self) -> torch.Tensor:
        return self.view()

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def planted_value(self) -> torch.Tensor:
        """Logical bool tensor: where a planted special value is."""
        if self.planted is None:
            return torch.zeros(self.shape, dtype=torch.bool)
        return self.view(self.planted)

    def base_counted(self, counted: torch.Tensor) -> torch.Tensor:
        """Base-shaped bool: True where some logical image of the element is counted (the
        adjoint of the view applied to ``counted``, so expands and slices need no special
        case)."""
        probe = torch.zeros(self.base.shape, dtype=torch.float64, requires_grad=True)
        images = self.view(probe)
        weight = counted.expand(images.shape).to(torch.float64)
        (grad,) = torch.autograd.grad((images * weight).sum(), probe, allow_unused=True)
        return torch.zeros(self.base.shape, dtype=torch.bool) if grad is None else grad > 0

    def cleaned(self, counted: torch.Tensor) -> Arg:
        """A copy with every planted element that is nowhere counted set to 0."""
        if self.planted is None:
            return self
        drop = self.planted & ~self.base_counted(counted)
        base = self.base.masked_fill(drop, 0)
        return Arg(base, self.layout, self.shape, self.planted & ~drop, self.plants, self.origin)

    def converted(self, dtype: torch.dtype) -> Arg:
        return Arg(
            self.base.to(dtype), self.layout, self.shape, self.planted, self.plants, self.origin
        )

    def _repr_pretty_(self, printer, cycle):  # hypothesis' "Falsifying example" printer
        printer.text(repr(self))

    def __repr__(self) -> str:
        dt = str(self.base.dtype).replace("torch.", "")
        text = f"{dt}{list(self.shape)}"
        if self.layout != "contiguous":
            text += f"/{self.layout}"
        if self.origin:
            text += f"({self.origin})"
        if self.plants:
            text += f" plants={list(self.plants)}"
        return text


def _values(kind: str, shape, seed: int, scale: float) -> torch.Tensor:
    """fp64 values of one kind: ``normal`` (mean 0), ``logprob`` (< 0), ``positive``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "logprob":
        return -(x.abs() * scale) - 0.05
    if kind == "positive":
        return torch.exp(x * min(scale, 3.0))
    return x * scale


SCALES = {
    "normal": (1.0, 0.1, 3.0, 30.0),
    "logits": (2.0, 0.5, 10.0, 1000.0),
    "logprob": (2.0, 0.5, 8.0),
    "positive": (1.0, 0.3, 3.0),
}


@st.composite
def float_args(
    draw,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    kind: str = "normal",
    specials: tuple[float, ...] | None = SPECIAL_VALUES,
    max_plants: int = 2,
    layouts: tuple[str, ...] | None = None,
) -> Arg:
    """A float :class:`Arg` of logical ``shape``: seeded values of ``kind`` and up to
    ``max_plants`` planted ``specials`` (None: none)."""
    shape = tuple(shape)
    layout = draw(st.sampled_from(layouts or usable_layouts(shape)))
    compact = _compact_shape(shape, layout)
    if layout == "expanded":
        shape_ok = all(n >= 0 for n in shape)
        assert shape_ok
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from(SCALES["logits" if kind == "logits" else kind]))
    values = _values("normal" if kind == "logits" else kind, compact, seed, scale)
    numel = math.prod(compact)
    plants: tuple = ()
    if specials and numel > 0 and max_plants > 0:
        plants = tuple(
            draw(
                st.lists(
                    st.tuples(st.integers(0, numel - 1), st.sampled_from(specials)),
                    max_size=max_plants,
                )
            )
        )
    planted = torch.zeros(compact, dtype=torch.bool)
    flat, flat_planted = values.view(-1), planted.view(-1)
    for index, value in plants:
        flat[index] = value
        flat_planted[index] = True
    values = values.to(dtype)
    base = _base_from_logical(values, layout, NAN)
    planted_base = _base_from_logical(planted, layout, False)
    origin = f"{kind} seed={seed} scale={scale:g}"
    return Arg(base, layout, shape, planted_base if plants else None, plants, origin)


@st.composite
def logits_args(draw, shape: tuple[int, ...], dtype: torch.dtype, *, row_specials=True) -> Arg:
    """Logits ``(..., V)``: :func:`float_args` plus, sometimes, whole rows set to -inf (an
    all-masked vocabulary), +inf or NaN."""
    arg = draw(float_args(shape, dtype, kind="logits"))
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if not row_specials or rows == 0 or shape[-1] == 0 or arg.layout == "expanded":
        return arg
    whole = draw(
        st.lists(
            st.tuples(st.integers(0, rows - 1), st.sampled_from((-INF, -INF, INF, NAN))),
            max_size=1,
        )
    )
    if not whole:
        return arg
    logical = arg.value().clone(memory_format=torch.contiguous_format)
    planted = arg.planted_value().clone(memory_format=torch.contiguous_format)
    for row, value in whole:
        logical.view(-1, shape[-1])[row] = value
        planted.view(-1, shape[-1])[row] = True
    base = _base_from_logical(logical, arg.layout, NAN)
    planted_base = _base_from_logical(planted, arg.layout, False)
    plants = arg.plants + tuple((f"row{r}", v) for r, v in whole)
    return Arg(base, arg.layout, tuple(shape), planted_base, plants, arg.origin)


# ----------------------------------------------------------------------------- masks, indices


# "signed": weights with a negative entry: every op that takes weights raises ValueError in
# eager mode with value checks on (one host read of the mask), and turns it into NaN unchecked
# (check_values=False, torch.compile)
MASK_KINDS = ("none", "bool", "bool", "int", "float", "weights", "signed")
MASK_PATTERNS = ("random", "random", "random", "all_false", "all_true", "empty_rows")


@st.composite
def mask_args(draw, shape: tuple[int, ...], *, kinds=MASK_KINDS, patterns=MASK_PATTERNS):
    """``None`` or a mask :class:`Arg` (bool / int64 0-1 / float 0-1 / float non-negative
    weights / weights with a negative entry), with all-False, all-True or empty-row
    patterns."""
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return None
    shape = tuple(shape)
    pattern = draw(st.sampled_from(patterns))
    layout = draw(st.sampled_from(usable_layouts(shape)))
    compact = _compact_shape(shape, layout)
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(compact, generator=gen) > 0.35
    if pattern == "all_false":
        keep[...] = False
    elif pattern == "all_true":
        keep[...] = True
    elif pattern == "empty_rows" and len(compact) >= 2 and compact[0] > 0:
        keep[torch.randint(0, compact[0], (1,), generator=gen)] = False
    if kind == "bool":
        values, fill = keep, True
    elif kind == "int":
        values, fill = keep.to(torch.int64), 1
    elif kind == "float":
        values, fill = keep.to(torch.float32), NAN
    else:  # non-negative weights, some tiny and some large (one negative if "signed")
        weights = torch.rand(compact, generator=gen, dtype=torch.float64) * 3
        weights[weights > 2.7] = 1e-30
        if kind == "signed" and weights.numel() > 0:
            weights.view(-1)[torch.randint(0, weights.numel(), (), generator=gen)] = -0.5
            keep.view(-1)[weights.view(-1) < 0] = True
        values, fill = torch.where(keep, weights, 0.0).to(torch.float32), NAN
    origin = f"{pattern} seed={seed}" + (f" {kind}" if kind in ("weights", "signed") else "")
    return Arg(_base_from_logical(values, layout, fill), layout, shape, origin=origin)


@st.composite
def target_args(draw, shape: tuple[int, ...], vocab: int, ignore_index: int | None):
    """Class indices in ``[0, V)`` with some (or all) equal to ``ignore_index``; int64 or
    int32; any layout (the gaps of a strided layout hold an invalid index)."""
    shape = tuple(shape)
    layout = draw(st.sampled_from(usable_layouts(shape)))
    compact = _compact_shape(shape, layout)
    dtype = draw(st.sampled_from((torch.int64, torch.int64, torch.int32)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, vocab, compact, generator=gen)
    if ignore_index is not None:
        share = draw(st.sampled_from((0.0, 0.0, 0.3, 1.0)))
        ignored = torch.rand(compact, generator=gen) < share
        values = torch.where(ignored, torch.full_like(values, ignore_index), values)
    values = values.to(dtype)
    origin = f"seed={seed}" + (f" ignored={share}" if ignore_index is not None else "")
    return Arg(_base_from_logical(values, layout, GAP_INDEX), layout, shape, origin=origin)


# ----------------------------------------------------------------------------- the case


@dataclass
class Case:
    """One fuzz example: ``call(inputs, backend)`` on the logical tensors of ``args``.

    ``counted[name]`` (logical bool, broadcastable) marks the elements of a float argument
    that the result may depend on; planted values elsewhere must not change any output
    (``invariant_skip`` names outputs exempt from that, e.g. an unmasked statistic).
    ``grad`` names the arguments differentiated under a random upstream gradient.
    ``nan_rule(inputs)`` -> ``{output name: bool tensor | bool}``: where NaN is required.
    ``local_outputs`` maps an output to the counted mask of its own positions: outputs at
    uncounted positions may depend on the input there (``masked_whiten``).
    ``linear``: the outputs are sums of the inputs (GAE, masked sums), so a summation order
    may cost rounding relative to the largest input, not just to the output.
    """

    op: str
    call: Callable[[dict[str, torch.Tensor | None], str], Any]
    args: dict[str, Arg | None]
    hyper: dict[str, Any] = field(default_factory=dict)
    grad: tuple[str, ...] = ()
    counted: dict[str, torch.Tensor] = field(default_factory=dict)
    nan_rule: Callable[[dict[str, torch.Tensor | None]], dict[str, Any]] | None = None
    invariant_skip: tuple[str, ...] = ()
    local_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    linear: bool = False
    upstream_seed: int = 0

    def inputs(self) -> dict[str, torch.Tensor | None]:
        return {k: (None if a is None else a.value()) for k, a in self.args.items()}

    def float_args(self) -> dict[str, Arg]:
        return {k: a for k, a in self.args.items() if a is not None and a.base.is_floating_point()}

    def input_scale(self) -> float:
        """The largest finite magnitude among the float arguments (0 if none)."""
        scale = 0.0
        for a in self.float_args().values():
            x = a.value().double()
            finite = x[torch.isfinite(x)]
            if finite.numel():
                scale = max(scale, finite.abs().max().item())
        return scale

    def has(self, predicate) -> bool:
        return any(bool(predicate(a.value()).any()) for a in self.float_args().values())

    def uncounted_plants(self) -> bool:
        """Some planted value sits where nothing is counted."""
        for name, a in self.float_args().items():
            if a.planted is not None and name in self.counted:
                if bool((a.planted & ~a.base_counted(self.counted[name])).any()):
                    return True
        return False

    def cleaned(self) -> Case:
        args = dict(self.args)
        for name, a in self.float_args().items():
            if name in self.counted:
                args[name] = a.cleaned(self.counted[name])
        return Case(**{**self.__dict__, "args": args})

    def upcast(self, perturb: int | None = None) -> Case:
        """The same case with every float argument (masks included) in fp64; with ``perturb``
        (a seed) each element moved by one rounding of its computation dtype (2^-24 relative,
        2^-53 for fp64), in a random direction: how much that moves an output is what
        rounding alone may cost there (its condition)."""
        args = dict(self.args)
        gen = None if perturb is None else torch.Generator().manual_seed(perturb)
        for name, a in self.float_args().items():
            a = a.converted(torch.float64)
            if gen is not None:
                rel = 2.0**-53 if self.args[name].dtype == torch.float64 else 2.0**-24
                sign = torch.randint(0, 2, a.base.shape, generator=gen) * 2.0 - 1.0
                a = Arg(a.base * (1 + rel * sign), a.layout, a.shape, a.planted, a.plants)
            args[name] = a
        return Case(**{**self.__dict__, "args": args})

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if v is not None)
        hyper = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"Case({self.op}: {args}; {hyper}; upstream_seed={self.upstream_seed})"
