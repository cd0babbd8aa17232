"""``policy_loss(grad_in_forward=True)``: two passes over the logits instead of three. The
forward's one kernel writes each row's gradient (times its ``loss_agg`` weight and
``loss_scale``) into a new buffer or, with ``inplace=True``, into the logits; the backward
multiplies it by the upstream gradient, deciding on the device to do nothing when that is 1.

* upstream gradient 1 (``loss_scale`` or not): loss, metrics and gradient are the default
  call's bit for bit (``torch.equal``), every ``loss_agg`` mode, with / without the
  reference log-probs and KL, the entropy bonus (``entropy_agg`` too), IS weights,
  ``num_items`` (number and tensor), soft-capping, windows, fp32 and bf16, both backends;
* another upstream factor: within one unit in the last place of the default's gradient
  (the gradient is rounded to the logits' dtype, then scaled and rounded again);
* the backward with an upstream gradient of 1 makes one launch that reads the 0-dim
  upstream gradient only (no byte of the ``(N, V)`` gradient), and no host sync;
* launches, allocations (``inplace=True``: no ``(N, V)`` tensor anywhere in forward and
  backward), and every option it cannot do raises naming ``grad_in_forward``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fused_rl
from fused_rl._backend import interpreter_enabled
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
DTYPES = (torch.float32, torch.bfloat16)


def _inputs(B=3, T=5, V=37, extra=1, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    buf = (2 * torch.randn(B, T + extra, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[1, 0] = -100
    r = dict(
        buf=buf,
        targets=targets,
        advantages=torch.randn(B, generator=g),
        old_logprobs=torch.randn(B, T, generator=g) - 3,
        ref_logprobs=torch.randn(B, T, generator=g) - 3,
        mask=torch.rand(B, T, generator=g) > 0.2,
        is_weights=0.5 + torch.rand(B, T, generator=g),
        float_mask=torch.rand(B, T, generator=g).round(decimals=1),
    )
    return {k: v.to(device) for k, v in r.items()}


# per case: the policy options and which per-token tensors the call passes
CASES = {
    "token_mean_kl_entropy": (dict(beta=0.04, entropy_coef=0.01, eps_high=0.28), ("ref",)),
    "token_mean_no_ref": (dict(), ()),
    "seq_mean_token_mean": (dict(loss_agg="seq-mean-token-mean", beta=0.1), ("ref",)),
    "seq_mean_token_sum_is": (dict(loss_agg="seq-mean-token-sum"), ("is",)),
    "seq_mean_token_sum_norm_cispo": (
        dict(loss_agg="seq-mean-token-sum-norm", max_length=7, surrogate="cispo", eps_low=1.0),
        (),
    ),
    "entropy_agg_token_mean": (
        dict(entropy_coef=0.02, entropy_agg="token-mean", loss_agg="seq-mean-token-mean"),
        ("ref",),
    ),
    "num_items_softcap": (dict(num_items=11.0, softcap=2.0, temperature=0.7), ()),
    "num_items_tensor_float_mask": (dict(num_items="tensor", dual_clip=3.0), ("float_mask",)),
    "sapo_with_entropy_metric": (dict(surrogate="sapo", with_entropy=True), ("ref", "is")),
}


def _call(r, x, backend, options, tensors, **extra):
    options = dict(options)
    if options.get("num_items") == "tensor":
        options["num_items"] = torch.tensor(13.0, device=x.device)
    return fused_rl.policy_loss(
        x, r["targets"], r["advantages"], old_logprobs=r["old_logprobs"],
        ref_logprobs=r["ref_logprobs"] if "ref" in tensors else None,
        mask=r["float_mask"] if "float_mask" in tensors else r["mask"],
        is_weights=r["is_weights"] if "is" in tensors else None, backend=backend,
        **options, **extra,
    )  # fmt: skip


def _run(r, backend, case, mode, up=1.0, loss_scale=None):
    """``(loss, metrics, gradient)``: ``mode`` "default" (the user's ``loss * loss_scale``),
    "new" (grad_in_forward, a buffer of its own) or "inplace"."""
    options, tensors = CASES[case]
    x = r["buf"].clone().requires_grad_()
    if mode == "default":
        loss, metrics = _call(r, x, backend, options, tensors)
        if loss_scale is not None:
            loss = loss * loss_scale
    else:
        loss, metrics = _call(r, x, backend, options, tensors, grad_in_forward=True,
                              inplace=mode == "inplace", loss_scale=loss_scale)  # fmt: skip
    loss.backward(torch.tensor(up, device=x.device))
    return loss.detach(), metrics, x.grad, x


def _assert_equal(a, b, what=""):
    assert torch.equal(a[0], b[0]), (what, a[0], b[0])
    assert a[1].keys() == b[1].keys(), what
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), (what, k)
    assert torch.equal(a[2], b[2]), f"gradient {what}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_equal_with_upstream_one(case, dtype, backend, device):
    """Both modes (a buffer of its own, in place) against one default call."""
    r = _inputs(dtype=dtype, extra=len(case) % 3, seed=len(case), device=device)
    want = _run(r, backend, case, "default")
    for mode in ("new", "inplace"):
        got = _run(r, backend, case, mode)
        _assert_equal(want, got, mode)
        x = got[3]
        if mode == "inplace":  # the logits are the gradient, the leaf's .grad their memory
            assert torch.equal(x.detach(), got[2]) and x.grad.data_ptr() == x.data_ptr()
        else:
            assert torch.equal(x.detach(), r["buf"]), "the logits are left as they were"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_scale", (0.25, 1.0 / 3.0, 7.0))
def test_loss_scale_is_loss_times_k(loss_scale, dtype, backend, device):
    """``loss_scale=k`` with ``loss.backward()`` is ``(loss * k).backward()`` of the default
    call, bit for bit: the kernel multiplies ``k`` in where layer 3 multiplies the upstream
    gradient. Without ``grad_in_forward`` it scales the returned loss."""
    r = _inputs(dtype=dtype, seed=11, device=device)
    for case in ("token_mean_kl_entropy", "seq_mean_token_mean"):
        want = _run(r, backend, case, "default", loss_scale=loss_scale)
        for mode in ("new", "inplace"):
            _assert_equal(want, _run(r, backend, case, mode, loss_scale=loss_scale),
                          f"{case} {mode}")  # fmt: skip
    options, tensors = CASES["seq_mean_token_mean"]
    x = r["buf"].clone().requires_grad_()
    loss, _ = _call(r, x, backend, options, tensors, loss_scale=loss_scale)
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.equal(loss.detach(), want[0]) and torch.equal(grad, want[2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ("new", "inplace"))
@pytest.mark.parametrize("seed", (5, 6))
def test_other_upstream_factor_within_rounding(seed, mode, dtype, backend, device):
    """An upstream factor other than 1 (a random scalar): the device decides to scale, and
    the gradient is the default's up to rounding: the gradient formed in the forward is
    rounded to the logits' dtype, then scaled and rounded again, where the default folds
    the factor in before its one rounding. RMS difference within 2 eps of the dtype
    (measured: up to 1.4 eps); each element within 4 eps of the largest element of its row
    (bf16: about one unit in its own last place; fp32 differs by more units of a target
    column's own last place where ``g (1 - p)`` cancels, never more than eps of the row)."""
    g = torch.Generator().manual_seed(seed)
    up = float(torch.empty(()).uniform_(0.3, 3.0, generator=g))
    r = _inputs(dtype=dtype, seed=seed, device=device)
    eps = torch.finfo(dtype).eps
    for case in ("token_mean_kl_entropy", "seq_mean_token_sum_is", "num_items_softcap"):
        want = _run(r, backend, case, "default", up=up)
        got = _run(r, backend, case, mode, up=up)
        assert torch.equal(want[0], got[0])
        a, b = want[2].double(), got[2].double()
        assert (a - b).norm() <= 2 * eps * a.norm(), ((a - b).norm() / a.norm() / eps, case)
        row = a.abs().amax(-1, keepdim=True)
        assert ((a - b).abs() <= 4 * eps * row).all(), case
        assert a.norm() > 0  # a real gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_is_the_ordinary_forward(backend, device):
    r = _inputs(device=device)
    options, tensors = CASES["token_mean_kl_entropy"]
    want, _ = _call(r, r["buf"], backend, options, tensors)
    got, _ = _call(r, r["buf"], backend, options, tensors, grad_in_forward=True)
    with torch.no_grad():
        got2, _ = _call(r, r["buf"].clone().requires_grad_(), backend, options, tensors,
                        grad_in_forward=True, loss_scale=0.5)  # fmt: skip
    assert torch.equal(want, got) and torch.equal(want * 0.5, got2)


def test_gradient_accumulation_over_micro_batches(device):
    """``loss_scale=1/k``, ``loss.backward()`` per micro-batch into one leaf: the
    accumulated ``.grad`` is the default's ``(loss / k).backward()`` (k = 4, exact)."""
    r = _inputs(device=device)
    options, tensors = CASES["seq_mean_token_mean"]
    grads = {}
    for mode in ("default", "new"):
        x = r["buf"].clone().requires_grad_()
        for _ in range(3):
            if mode == "default":
                (_call(r, x, "triton", options, tensors)[0] / 4).backward()
            else:
                _call(r, x, "triton", options, tensors, grad_in_forward=True,
                      loss_scale=0.25)[0].backward()  # fmt: skip
        grads[mode] = x.grad
    assert torch.equal(grads["default"], grads["new"])


# ----------------------------------------------------------------------------- the backward


@contextlib.contextmanager
def _elements_accessed():
    """Elements loaded / stored by interpreted Triton kernels in the block (the interpreter's
    masked load and store, every access of a kernel goes through them)."""
    from triton.runtime import interpreter as I

    count = {"load": 0, "store": 0}
    load, store = I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store

    def counted_load(self, ptrs, mask, *args):
        count["load"] += int(mask.data.sum())
        return load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        count["store"] += int(mask.data.sum())
        return store(self, ptrs, value, mask, *args)

    I.InterpreterBuilder.create_masked_load = counted_load
    I.InterpreterBuilder.create_masked_store = counted_store
    try:
        yield count
    finally:
        I.InterpreterBuilder.create_masked_load = load
        I.InterpreterBuilder.create_masked_store = store


@pytest.mark.skipif(not interpreter_enabled(), reason="counts the Triton interpreter's accesses")
@pytest.mark.parametrize("inplace", (False, True))
def test_upstream_one_touches_no_gradient_byte(inplace):
    """The backward's one launch reads the 0-dim upstream gradient in each program and, when
    it is exactly 1, nothing else: no element of the ``(N, V)`` gradient is read or written.
    With another factor every element is read and written once. The default backward reads
    and writes every element of the buffer (layer 3)."""
    r = _inputs(B=2, T=4, V=300, extra=1)
    options, tensors = CASES["token_mean_kl_entropy"]
    n_elements = r["buf"].numel()
    n_rows = n_elements // 300
    seen = {}
    for up in (1.0, 2.5):
        x = r["buf"].clone().requires_grad_()
        loss, _ = _call(r, x, "triton", options, tensors, grad_in_forward=True, inplace=inplace)
        with _elements_accessed() as count:
            loss.backward(torch.tensor(up))
        seen[up] = dict(count)
    assert seen[1.0] == {"load": n_rows, "store": 0}, seen  # one program per row here
    assert seen[2.5] == {"load": n_rows + n_elements, "store": n_elements}, seen
    x = r["buf"].clone().requires_grad_()
    loss, _ = _call(r, x, "triton", options, tensors)
    with _elements_accessed() as count:
        loss.backward()
    counted = int((r["mask"] & (r["targets"] != -100)).sum())  # the rows layer 3 reads
    assert count["store"] == n_elements and count["load"] >= counted * 300


@pytest.mark.parametrize("up", (1.0, 1.7))
def test_the_backward_decides_on_the_device(up, device):
    """No host sync in the backward: no op that reads a tensor on the host
    (``.item()``, ``bool()``) runs, whatever the upstream gradient; its only launch is the
    scaling kernel (plus autograd's seed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._opname in ("_local_scalar_dense", "is_nonzero", "equal", "item"):
                self.reads.append(str(func))
            return func(*args, **(kwargs or {}))

    r = _inputs(device=device)
    options, tensors = CASES["seq_mean_token_mean"]
    x = r["buf"].clone().requires_grad_()
    loss, _ = _call(r, x, "triton", options, tensors, grad_in_forward=True)
    with HostReads() as reads:
        loss.backward(torch.tensor(up, device=device))
    assert reads.reads == []
    x = r["buf"].clone().requires_grad_()
    loss, _ = _call(r, x, "triton", options, tensors, grad_in_forward=True)
    with LaunchCounter() as c:
        loss.backward()
    assert c.kernels == ["_scale_rows_unless_one_kernel"] and c.ops == ["aten.ones_like.default"]


def test_scaling_kernel_rounds_once(device):
    """The scaling launch on its own: ``grad * factor`` computed in fp32 / fp64 and rounded
    once, on strided rows too, NaN and inf included; exactly 1 leaves every bit."""
    from fused_rl._policy_ops import scale_rows_unless_one_launch as scale_rows_unless_one

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        full = torch.randn(3, 5, 70, generator=g).to(dtype).to(device)
        full[0, 1, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
        for factor in (1.0, 0.37, float("nan"), 0.0):
            buf = full.clone()
            view = buf[:, 1:]  # strided rows
            # in fp32 (fp64) with the exact factor, rounded once: torch's own bf16 / fp16
            # product rounds a 0-dim factor to the buffer's dtype first on a GPU
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            scale = torch.tensor(factor, device=device)  # fp32, as the kernel reads it
            want = (view.to(acc) * scale.to(acc)).to(dtype)
            scale_rows_unless_one(view, scale)
            got, want = view.nan_to_num(7.0), want.nan_to_num(7.0)
            if dtype == torch.bfloat16 and interpreter_enabled():
                # the interpreter rounds fp32 -> bf16 toward zero (a GPU, as torch, to
                # nearest even): within one unit in the last place there
                err = (got.double() - want.double()).abs()
                assert (err <= torch.finfo(dtype).eps * want.double().abs()).all()
            else:
                assert torch.equal(got, want), (dtype, factor)
            assert torch.equal(buf[:, 0], full[:, 0])  # outside the view: untouched
            if factor == 1.0:  # every bit, NaN's and -0's included
                bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
                assert torch.equal(buf.view(bits), full.view(bits))


# ----------------------------------------------------------------------------- cost


@pytest.fixture
def no_value_checks(monkeypatch):
    # the eager value checks are the default call's too (tests/test_call_cost.py)
    monkeypatch.setattr(fused_rl.config, "check_values", False)


@pytest.mark.no_poison
@pytest.mark.usefixtures("no_value_checks")
def test_launches(device):
    """Forward: the mask's weights (3 small ops), the finalize kernel on them (the
    aggregation's normaliser, before the pass), the fused kernel that writes the gradient,
    the zeros of the buffer's position that predicts no target, the finalize. Backward:
    autograd's seed and the one scaling launch. The default: 2 forward, 2 backward."""
    r = _inputs(device=device)
    options, tensors = CASES["token_mean_kl_entropy"]
    counts = {}
    for extra in ({}, dict(grad_in_forward=True), dict(grad_in_forward=True, inplace=True)):
        x = r["buf"].clone().requires_grad_()
        with LaunchCounter() as fwd:
            loss, _ = _call(r, x, "triton", options, tensors, **extra)
        with LaunchCounter() as bwd:
            loss.backward()
        counts[tuple(extra)] = (fwd.total, bwd.total, fwd.kernels, bwd.kernels)
    assert counts[()][:2] == (2, 2)
    for key in (("grad_in_forward",), ("grad_in_forward", "inplace")):
        fwd, bwd, fwd_kernels, bwd_kernels = counts[key]
        assert (fwd, bwd) == (7, 2), counts[key]
        assert fwd_kernels == ["_policy_finalize_kernel", "_policy_loss_fwd_kernel",
                               "_policy_finalize_kernel"]  # fmt: skip
        assert bwd_kernels == ["_scale_rows_unless_one_kernel"]


@pytest.mark.no_poison
@pytest.mark.usefixtures("no_value_checks")
@pytest.mark.parametrize("extra", (0, 1))
def test_allocations(extra, device):
    """``inplace=True``: no tensor of ``N * V`` elements in forward or backward. Without it,
    one, in the forward (the gradient, held to the backward, which allocates none). The
    default: one, in the backward."""
    r = _inputs(T=6, V=500, extra=extra, device=device)
    B, T = r["targets"].shape
    nv_bytes = B * T * 500 * 4
    options, tensors = CASES["token_mean_kl_entropy"]
    counts = {}
    for key, opts in {"default": {}, "new": dict(grad_in_forward=True),
                      "inplace": dict(grad_in_forward=True, inplace=True)}.items():  # fmt: skip
        x = r["buf"].clone().requires_grad_()
        with AllocationTracker() as fwd:
            loss, _ = _call(r, x, "triton", options, tensors, **opts)
        with AllocationTracker() as bwd:
            loss.backward()
        counts[key] = (fwd.count_at_least(nv_bytes), bwd.count_at_least(nv_bytes))
    assert counts == {"default": (0, 1), "new": (1, 0), "inplace": (0, 0)}, counts


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options, named",
    [
        (dict(importance_sampling="sequence"), "importance_sampling='sequence'"),
        (dict(importance_sampling="sequence-token"), "importance_sampling='sequence-token'"),
        (dict(importance_sampling="sequence-sum"), "importance_sampling='sequence-sum'"),
        (dict(surrogate="vespo"), "surrogate='vespo'"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
    ],
)
def test_sequence_level_options_raise(options, named, backend):
    r = _inputs()
    x = r["buf"].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"grad_in_forward=True.*" + named.replace("(", r"\(")):
        fused_rl.policy_loss(x, r["targets"], r["advantages"], grad_in_forward=True,
                             backend=backend, **options)  # fmt: skip


def test_bad_arguments_raise():
    r = _inputs()
    x = r["buf"].clone().requires_grad_()
    call = lambda **kw: fused_rl.policy_loss(x, r["targets"], r["advantages"], **kw)  # noqa: E731
    with pytest.raises(TypeError, match="grad_in_forward must be a bool"):
        call(grad_in_forward="yes")
    with pytest.raises(TypeError, match="loss_scale must be a Python number"):
        call(grad_in_forward=True, loss_scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="loss_scale must be finite"):
        call(loss_scale=float("inf"))
    with pytest.raises(NotImplementedError, match="grad_in_forward=True"):
        call(grad_in_forward=True, process_group=object())


@pytest.mark.parametrize("inplace", (False, True))
def test_second_backward_raises(inplace, device):
    r = _inputs(device=device)
    x = r["buf"].clone().requires_grad_()
    loss, _ = fused_rl.policy_loss(x, r["targets"], r["advantages"], grad_in_forward=True,
                                   inplace=inplace)  # fmt: skip
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=True: the gradient was formed"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_logits_modified_before_the_backward(backend, device):
    r = _inputs(device=device)
    x = r["buf"].clone().requires_grad_()
    loss, _ = fused_rl.policy_loss(x, r["targets"], r["advantages"], grad_in_forward=True,
                                   inplace=True, backend=backend)  # fmt: skip
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace=True: the logits were modified"):
        loss.backward()


def test_compile_raises_at_trace_time():
    r = _inputs()

    def step(x):
        return fused_rl.policy_loss(x, r["targets"], r["advantages"], grad_in_forward=True,
                                    backend="triton")[0]  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"policy_loss\(grad_in_forward=True\) is eager-only"):
        compiled(r["buf"].clone().requires_grad_())


def test_policy_loss_module_takes_the_options(device):
    from fused_rl.nn import PolicyLoss

    r = _inputs(device=device)
    want = _run(r, "triton", "token_mean_no_ref", "default", loss_scale=0.5)
    x = r["buf"].clone().requires_grad_()
    module = PolicyLoss(grad_in_forward=True, inplace=True, loss_scale=0.5)
    loss, _ = module(x, r["targets"], r["advantages"], old_logprobs=r["old_logprobs"],
                     mask=r["mask"])  # fmt: skip
    loss.backward()
    assert torch.equal(loss.detach(), want[0]) and torch.equal(x.grad, want[2])
    with pytest.raises(TypeError, match="grad_in_forward must be a bool"):
        PolicyLoss(grad_in_forward=1)
    with pytest.raises(ValueError, match="loss_scale must be finite"):
        PolicyLoss(loss_scale=float("nan"))


# ----------------------------------------------------------------------------- benchmark


def test_bench_providers_meet_the_oracle_and_model_their_memory(device):
    """``bench`` providers ``fused_rl_2pass`` / ``fused_rl_2pass_inplace``: within fused_rl's
    tolerance of the float64 oracle, token-level variants only (GSPO is not theirs), and
    modelled (``bench/memory_profile.py``, fake tensors) with the gradient held from the
    forward (one ``(N, V)`` buffer) / no ``(N, V)`` buffer at all. The ``inplace`` suite
    lists them beside Liger's ``inplace=True``."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import accuracy as A
    from bench import providers as P
    from bench.cases import INPLACE_PROVIDERS, SUITES, Case, make_inputs
    from bench.memory_profile import model_peak
    from bench.oracle import Oracle

    for variant in ("grpo+entropy", "grpo+is"):
        case = Case("policy_loss", variant, "fwd_bwd", 2, 8, 1000, "bf16")
        inp = make_inputs(case, device)
        oracle = Oracle(case, inp)
        for provider in ("fused_rl_2pass", "fused_rl_2pass_inplace"):
            out = P.build(provider, case, inp)()
            verdict = A.judge(provider, case.dtype, oracle.compare_all(P.output_names(case),
                                                                       out))["verdict"]  # fmt: skip
            assert verdict == "ok", (variant, provider, verdict)
    gspo = Case("policy_loss", "gspo", "fwd_bwd", 2, 8, 1000, "bf16")
    assert not P.applies("fused_rl_2pass", gspo) and P.applies("fused_rl_inplace", gspo)
    big = Case("policy_loss", "grpo", "fwd_bwd", 4, 512, 32000, "bf16")
    grad_bytes = 4 * 513 * 32000 * 2
    held, how = model_peak("fused_rl_2pass", big)
    assert how == "modelled" and grad_bytes <= held <= 1.01 * grad_bytes
    none, how = model_peak("fused_rl_2pass_inplace", big)
    assert how == "modelled" and none < grad_bytes / 100
    assert set(INPLACE_PROVIDERS) <= set(P.PROVIDERS)
    assert {c.op for c in SUITES["inplace"]()} == {"policy_loss"}
