"""One definition per fused op: a ``torch.library`` custom op for tracing, a direct path for eager.

``torch.compile(fullgraph=True)`` needs every Triton launcher registered as a custom op with
a fake (meta) implementation and an autograd formula. In eager mode that registration costs
tens of microseconds per call (argument normalisation, dispatch through several keys, the
generated autograd wrapper), more than a small batch's kernels. :class:`FusedOp` keeps the
one launcher and the one autograd formula, and dispatches:

* under ``torch.compile`` tracing: the custom op;
* in eager mode with a tensor that requires grad: a plain ``torch.autograd.Function`` built
  from the same ``setup_context`` / ``backward``;
* otherwise: the launcher itself.

A launcher's ``hyper: list[float]`` (a policy loss's table of hyper-parameters,
``PolicyConfig.kernel_params``) may change every step (an adaptive KL coefficient, an entropy
schedule). A custom op's ``float`` arguments are constants of the graph, so each new value
recompiles. With ``fused_rl.config.scheduled_hyperparameters`` on, a call being compiled
goes to a twin op, ``fused_rl::<name>_scheduled``, that takes the values as one float64 CPU
tensor (built by arithmetic on Dynamo's unspecialised floats, which keeps them symbolic) and
``hyper`` as its pattern of zeros (the fake and the autograd setup decide output shapes and
kernel switches on ``!= 0`` alone; the launcher gets the values). A new zero pattern
compiles again, as it launches other kernels. (Dynamo reports a symbolic float as a
``float``, not a ``torch.SymFloat``, so the route cannot be taken for symbolic values only.)

Example:
    >>> import torch
    >>> from fused_rl._ops import FusedOp
    >>> def scale2(x: torch.Tensor) -> torch.Tensor:
    ...     return x * 2
    >>> op = FusedOp("doc_scale2", scale2)
    >>> op.register_fake(lambda x: torch.empty_like(x))
    >>> def setup(ctx, inputs, output):
    ...     pass
    >>> op.register_autograd(lambda ctx, g: (g * 2,), setup_context=setup)
    >>> x = torch.ones(3, requires_grad=True)
    >>> op(x).sum().backward(); x.grad.tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections.abc import Callable

import torch

from . import config
from ._backend import interpreter_requested
from .reference.logprobs import differentiable_once

# The Triton interpreter patches ``triton.language`` process-wide while a kernel runs, so two
# threads interpreting at once corrupt each other (InterpreterError, or silently wrong
# values). Interpreted launches therefore hold this lock; compiled (CUDA) launches never take
# it. Re-entrant: a launcher may call another op.
_INTERPRETER_LOCK = threading.RLock()


def _serialised_when_interpreting(launcher: Callable) -> Callable:
    @functools.wraps(launcher)
    def run(*args):
        if not interpreter_requested():
            return launcher(*args)
        # The interpreter evaluates masked-out lanes too (log(0), 0 * inf, an all-NaN max) in
        # NumPy, whose warnings would leak into the caller's code although the kernel never
        # uses those lanes: floating-point errors (errstate) and RuntimeWarnings such as
        # "All-NaN slice encountered". Interpreted launches are serialised by the lock.
        import numpy

        with _INTERPRETER_LOCK, numpy.errstate(all="ignore"), warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", category=RuntimeWarning, module=r"(triton\.runtime\.interpreter|numpy)"
            )
            return launcher(*args)

    return run


def _needs_grad(args: tuple) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _differentiable_once(backward: Callable) -> Callable:
    """``backward`` whose gradients raise on a second backward. The kernels compute them from
    saved statistics taken as constants, so a Hessian-vector product through them would be
    silently wrong; ``create_graph=True`` (the only time grad mode is on in a backward) ties
    each gradient to the saved inputs and incoming gradients so that it raises instead."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        out = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # an ordinary backward: nothing to do
            return out
        sources = (*ctx.saved_tensors, *grads)
        return tuple(differentiable_once(g, *sources) for g in out)

    return run


def _tracing() -> bool:
    """A functorch transform, or ``make_fx`` recording the call (``torch.export``; the AOT
    autograd trace of a compiled backward, where ``is_compiling()`` is False in torch 2.11):
    the launcher cannot run on the tracer's fake tensors, the op records itself instead.
    A bare ``FakeTensorMode`` (no proxy mode) still runs the launcher: memory models use it."""
    return (
        torch._C._are_functorch_transforms_active()
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    )


def _zero_pattern(hyper) -> list[float]:
    """``hyper`` with each value replaced by 0.0 or 1.0, as it is zero or not (compiling: a
    guard on that alone, not on the value)."""
    return [0.0 if v == 0.0 else 1.0 for v in hyper]


def _packed(hyper) -> torch.Tensor:
    """``hyper`` as a float64 CPU tensor, by arithmetic on the values (``torch.tensor`` of a
    symbolic float would guard on its value; ``0 * inf`` rules out a sum of basis vectors)."""
    zero = torch.zeros((), dtype=torch.float64, device="cpu")
    return torch.stack([zero + v for v in hyper])


class FusedOp:
    """``fused_rl::<name>`` around ``launcher`` (positional arguments only, annotated)."""

    def __init__(self, name: str, launcher: Callable):
        schema = torch.library.infer_schema(launcher, mutates_args=())
        params = list(inspect.signature(launcher).parameters)
        self.launcher = launcher = _serialised_when_interpreting(launcher)
        self.op = torch.library.custom_op(
            f"fused_rl::{name}", launcher, mutates_args=(), schema=schema
        )
        self.function: type[torch.autograd.Function] | None = None
        self.__doc__ = launcher.__doc__
        self.__name__ = name
        self.scheduled = None  # the twin taking ``hyper``'s values as a tensor
        if "hyper" in params:
            self._hyper_at = at = params.index("hyper")

            def scheduled(*args):
                *args, values = args
                args[at] = values.tolist()  # a CPU tensor: no device sync
                return launcher(*args)

            head, tail = schema.split(") -> ", 1)
            self.scheduled = torch.library.custom_op(
                f"fused_rl::{name}_scheduled", scheduled, mutates_args=(),
                schema=f"{head}, Tensor hyper_values) -> {tail}",
            )  # fmt: skip

    def register_fake(self, fake: Callable) -> None:
        self.op.register_fake(fake)
        if self.scheduled is not None:
            self.scheduled.register_fake(lambda *args: fake(*args[:-1]))

    def register_autograd(
        self, backward: Callable, *, setup_context: Callable, once: bool = True
    ) -> None:
        """``setup_context(ctx, inputs, output)`` / ``backward(ctx, *grads)`` as for
        ``torch.library.register_autograd``; ``backward`` returns one entry per input. Its
        gradients raise on a second backward (``once``) unless it marks them itself."""
        if once:  # off only for a backward that marks its own gradients (masked reductions)
            backward = _differentiable_once(backward)
        self.op.register_autograd(backward, setup_context=setup_context)
        if self.scheduled is not None:

            def scheduled_backward(ctx, *grads):  # one more input: the values, no gradient
                out = tuple(backward(ctx, *grads))
                return out + (None,) * (len(ctx.needs_input_grad) - len(out))

            self.scheduled.register_autograd(
                scheduled_backward,
                setup_context=lambda ctx, inputs, output: setup_context(ctx, inputs[:-1], output),
            )
        launcher = self.launcher

        def forward(ctx, *args):
            # the classic (ctx-first) form: Function.apply then skips binding the arguments
            # to forward's signature with inspect, which costs more than the rest of a call
            output = launcher(*args)
            setup_context(ctx, args, output)
            return output

        self.function = type(
            f"{self.__name__}_function",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )

    def __call__(self, *args):
        if (
            self.scheduled is not None
            and config.scheduled_hyperparameters
            and torch.compiler.is_compiling()
        ):
            at = self._hyper_at
            hyper = args[at]
            pattern = (*args[:at], _zero_pattern(hyper), *args[at + 1 :])
            return self.scheduled(*pattern, _packed(hyper))
        if torch.compiler.is_compiling() or _tracing():
            return self.op(*args)
        if self.function is not None and _needs_grad(args):
            return self.function.apply(*args)
        return self.launcher(*args)
