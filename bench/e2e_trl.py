"""One GRPO training step of TRL's ``GRPOTrainer``: TRL's own fused head against fused_rl's.

The figure an RLHF engineer looks for: the same trainer, the same model, the same
micro-batch, with one import changed. Four variants, each built fresh (a randomly
initialised Qwen2-shaped model from a config, a tokenizer built in code, no download):

- ``trl``: ``trl.GRPOTrainer`` (TRL >= 1.15 computes every log-prob with its chunked head);
- ``fused_rl``: ``fused_rl.integrations.trl.GRPOTrainer``: fused_rl's head, TRL's loss;
- ``fused_rl_loss``: the same with ``fused_rl_loss=True``: the training loss and its
  metrics from one ``fused_rl.linear_policy_loss`` call;
- ``fused_rl_full_kl``: the same with ``fused_rl_kl_estimator="full"``: the exact KL to the
  reference model in place of k3. Its step also runs the reference model's backbone (TRL's
  variants run the reference's log-prob forward at generation, once per sample, timed as
  ``logprob_forward`` is), and its loss is another function (the exact KL, not k3): it is
  left out of the parity comparison.

Each variant times, on one micro-batch as TRL holds it after generation (off-policy old
log-probs, ``beta > 0`` reference log-probs), the old-policy log-prob forward
(``_get_per_token_logps_and_entropies`` under ``no_grad``) and one optimizer step
(``_compute_loss``, backward, ``optimizer.step``): medians over ``--repeats`` after a
warm-up, and on CUDA the peak memory of each (``max_memory_allocated``) with the memory
held before it (weights, gradients, optimizer state). The losses and gradient norms of the
variants are compared (parity): on a CPU that is all this measures (its times are CPU
times through the Triton interpreter or the reference backend, not a benchmark).

    python -m bench.e2e_trl --device cuda --out bench/results/<gpu>/e2e_trl.json
    python -m bench.e2e_trl --device cpu --tiny        # parity only, about a minute

Needs TRL >= 1.15 and transformers (the GPU image has transformers; carry TRL's wheel).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time

import torch

VARIANTS = ("trl", "fused_rl", "fused_rl_loss", "fused_rl_full_kl")
# the variants whose loss is TRL's (the parity comparison); fused_rl_full_kl's KL is exact
SAME_LOSS = ("trl", "fused_rl", "fused_rl_loss")
EOS = 1


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": EOS, **{f"w{i}": i + 2 for i in range(vocab - 2)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model_dir(args) -> str:
    """A random Qwen2-shaped model and its tokenizer, saved once for every variant."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.completion,
        pad_token_id=0, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="e2e_trl_")
    Qwen2ForCausalLM(config).save_pretrained(path)
    _tokenizer(args.vocab).save_pretrained(path)
    return path


def _trainer(variant: str, path: str, args):
    import trl
    from datasets import Dataset

    import fused_rl.integrations.trl as fused_trl

    cuda = args.device == "cuda"
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="e2e_trl_out_"), per_device_train_batch_size=args.batch,
        num_generations=args.batch, max_completion_length=args.completion, loss_type=args.loss_type,
        beta=args.beta, learning_rate=1e-6, report_to=[], use_cpu=not cuda, bf16=cuda,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    kwargs = dict(model=path, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                  args=config, train_dataset=Dataset.from_dict({"prompt": ["w1"] * args.batch}),
                  processing_class=_tokenizer(args.vocab))  # fmt: skip
    if variant == "trl":
        trainer = trl.GRPOTrainer(**kwargs)
    else:
        trainer = fused_trl.GRPOTrainer(
            **kwargs, fused_rl_loss=variant != "fused_rl", fused_rl_backend=args.backend,
            fused_rl_kl_estimator="full" if variant == "fused_rl_full_kl" else "k3",
        )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    return trainer


def _inputs(trainer, args, device):
    """A micro-batch after generation: random prompt and completion ids, every third
    completion padded after half its length, advantages of both signs, old and reference
    log-probs near the model's (from its own forward, so ratios sit near 1)."""
    gen = torch.Generator().manual_seed(1)
    batch, prompt, length = args.batch, args.prompt, args.completion
    prompt_ids = torch.randint(2, args.vocab, (batch, prompt), generator=gen)
    ids = torch.randint(2, args.vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[::3, length // 2 :] = 0
    adv = torch.randn(batch, generator=gen)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": ids, "completion_mask": mask, "advantages": adv,
        "num_items_in_batch": mask.sum().float(),
    }  # fmt: skip
    inputs = {k: v.to(device) for k, v in inputs.items()}
    logp = _old_logprobs(trainer, inputs)
    noise = 0.02 * torch.randn(batch, length, generator=gen).to(device)
    inputs["old_per_token_logps"] = logp + noise
    inputs["ref_per_token_logps"] = logp - noise
    return inputs


def _old_logprobs(trainer, inputs):
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, inputs["completion_ids"].size(1)
        )
    return logp


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats):
    """Median seconds of ``fn`` over ``repeats`` after one warm-up; on CUDA the peak bytes
    allocated during the timed calls and the bytes held before them."""
    fn()
    _sync(device)
    held = peak = None
    if device == "cuda":
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    return {"median_s": statistics.median(times), "times_s": times, "held_bytes": held,
            "peak_bytes": peak}  # fmt: skip


def run_variant(variant: str, path: str, args) -> dict:
    trainer = _trainer(variant, path, args)
    device = args.device
    inputs = _inputs(trainer, args, device)
    out = {"variant": variant, "logprob_forward": _timed(
        lambda: _old_logprobs(trainer, inputs), device, args.repeats)}  # fmt: skip
    out.update(timed_step(trainer, lambda model, _: trainer._compute_loss(model, dict(inputs)),
                          args))  # fmt: skip
    return out


def timed_step(trainer, loss_of, args) -> dict:
    """``{"step": timings, "loss", "grad_norm", ...}``: one optimizer step (``loss_of(model,
    record)``, its backward, ``optimizer.step``) timed by :func:`_timed`, every repeat from
    the same weights; the loss and gradient norm of the last (and what ``loss_of`` put in
    ``record``)."""
    model, optimizer = trainer.model, trainer.optimizer
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record = {}

    def step():
        model.load_state_dict(state)  # every repeat steps from the same weights
        optimizer.zero_grad(set_to_none=False)
        loss = loss_of(model, record)
        loss.backward()
        record["loss"] = float(loss)
        record["grad_norm"] = float(torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]))  # fmt: skip
        optimizer.step()

    return {"step": _timed(step, args.device, args.repeats), **record}


def add_common_arguments(parser, variants) -> None:
    """The options every trainer bench takes: device, backend, repeats, variants, output."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(variants))
    parser.add_argument("--out", help="write the results as JSON here")


def add_model_arguments(parser, *, batch: int, completion: int) -> None:
    """The random Qwen2-shaped model (Qwen2.5-1.5B by default) and the batch of ``batch``
    sequences of ``--prompt`` + ``completion`` tokens; ``--tiny``: :func:`tiny`."""
    parser.add_argument("--tiny", action="store_true", help="a tiny model: parity on a CPU")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1536)  # Qwen2.5-1.5B
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=completion)


def tiny(args) -> None:
    """With ``--tiny``: a two-layer model of vocabulary 509 on 3 short sequences, one repeat
    (the parity check a CPU runs)."""
    if args.tiny:
        args.vocab, args.hidden, args.intermediate, args.layers = 509, 64, 128, 2
        args.heads, args.kv_heads, args.batch, args.prompt, args.completion = 4, 2, 3, 5, 9
        args.repeats = 1


def run_variants(run_variant, args) -> list[dict]:
    """``run_variant(variant)`` for each of ``args.variants``, each trainer freed before the
    next is built."""
    results = []
    for variant in args.variants.split(","):
        results.append(run_variant(variant))
        gc.collect()  # the variant's trainer, model(s) and optimizer state, before the next
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def write_results(args, results, **extra) -> None:
    """``args.out`` (if given): the arguments, versions, device and results as JSON."""
    if not args.out:
        return
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), **extra, "torch": torch.__version__,
                   "device_name": device, "results": results}, fh, indent=1)  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, VARIANTS)
    add_model_arguments(parser, batch=2, completion=4096)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.04)
    args = parser.parse_args(argv)
    tiny(args)
    path = _model_dir(args)
    results = run_variants(lambda variant: run_variant(variant, path, args), args)
    base = results[0]
    print(f"device {args.device}; vocab {args.vocab}, hidden {args.hidden}, layers "
          f"{args.layers}, {args.batch} x ({args.prompt} + {args.completion}) tokens")  # fmt: skip
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    for r in results:
        s, f = r["step"], r["logprob_forward"]
        print(
            f"{r['variant']:>16}: step {s['median_s'] * 1e3:9.1f} ms, peak {gib(s['peak_bytes'])}"
            f" (held {gib(s['held_bytes'])}); log-prob forward {f['median_s'] * 1e3:8.1f} ms, "
            f"peak {gib(f['peak_bytes'])}; loss {r['loss']:.6g} (vs {base['variant']} "
            f"{r['loss'] - base['loss']:+.2g}), grad norm {r['grad_norm']:.6g} "
            f"({r['grad_norm'] - base['grad_norm']:+.2g})"
        )
    write_results(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
