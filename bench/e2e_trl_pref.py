"""One training step of TRL's ``SFTTrainer`` and ``DPOTrainer``: TRL's fused head against
fused_rl's.

TRL 1.16's SFT and DPO trainers compute their log-probs with its chunked fused head and ask
it for the statistics they log (``is_top1`` for ``mean_token_accuracy``, ``mean_logits``
for DPO's ``logits/*``); ``fused_rl.integrations.trl.SFTTrainer`` / ``DPOTrainer`` compute
them with fused_rl's head (``fused_rl.linear_token_stats``: one read of each chunk's
logits), TRL's loss unchanged. Variants (``--variants``), each built fresh from a randomly
initialised Qwen2-shaped model (a config, a tokenizer built in code, no download):

- ``sft_trl`` / ``sft_fused_rl``: ``trl.SFTTrainer`` / fused_rl's, prompt-completion
  examples (the loss on the completion);
- ``dpo_trl`` / ``dpo_fused_rl``: ``trl.DPOTrainer`` / fused_rl's, preference pairs (the
  policy's forward and the reference model's, as TRL runs them in a step).

Each times one optimizer step on the same collated batch (``compute_loss``, backward,
``optimizer.step``, from the same weights every repeat): the median over ``--repeats``
after a warm-up, on CUDA the peak memory and the memory held before it; the loss and
gradient norm of each fused_rl variant against TRL's (parity). On a CPU that parity is all
this measures.

    python -m bench.e2e_trl_pref --device cuda --out bench/results/<gpu>/e2e_trl_pref.json
    python -m bench.e2e_trl_pref --device cpu --tiny        # parity only, about a minute

Needs TRL >= 1.16 and transformers.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from bench.e2e_trl import (
    _model_dir,
    _tokenizer,
    add_common_arguments,
    add_model_arguments,
    run_variants,
    timed_step,
    tiny,
    write_results,
)

VARIANTS = ("sft_trl", "sft_fused_rl", "dpo_trl", "dpo_fused_rl")


def _words(rng: torch.Generator, n: int, vocab: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(0, vocab - 2, (n,), generator=rng).tolist())


def _dataset(kind: str, args):
    """``args.batch`` examples of ``args.prompt`` prompt words and ``args.completion``
    completion words (a rejected one too for DPO), drawn from the whole vocabulary."""
    from datasets import Dataset

    rng = torch.Generator().manual_seed(2)
    words = lambda n: [_words(rng, n, args.vocab) for _ in range(args.batch)]  # noqa: E731
    rows = {"prompt": words(args.prompt)}
    if kind == "sft":
        rows["completion"] = words(args.completion)
    else:
        rows["chosen"], rows["rejected"] = words(args.completion), words(args.completion)
    return Dataset.from_dict(rows)


def _trainer(variant: str, path: str, args):
    import trl

    import fused_rl.integrations.trl as fused_trl

    kind, head = variant.split("_", 1)
    name = "SFTTrainer" if kind == "sft" else "DPOTrainer"
    cuda = args.device == "cuda"
    config = getattr(trl, name.replace("Trainer", "Config"))(
        output_dir=tempfile.mkdtemp(prefix="e2e_trl_pref_out_"),
        per_device_train_batch_size=args.batch, max_length=args.prompt + args.completion + 2,
        learning_rate=1e-6, report_to=[], use_cpu=not cuda, bf16=cuda, save_strategy="no",
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, disable_tqdm=True,
    )  # fmt: skip
    kwargs = dict(model=path, args=config, train_dataset=_dataset(kind, args),
                  processing_class=_tokenizer(args.vocab))  # fmt: skip
    if head == "trl":
        trainer = getattr(trl, name)(**kwargs)
    else:
        trainer = getattr(fused_trl, name)(**kwargs, fused_rl_backend=args.backend)
    trainer.model.train()
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    return trainer


def run_variant(variant: str, path: str, args) -> dict:
    trainer = _trainer(variant, path, args)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    out = {"variant": variant, "tokens": int(batch["input_ids"].numel())}
    out.update(timed_step(trainer, lambda model, _: trainer.compute_loss(model, dict(batch)),
                          args))  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, VARIANTS)
    add_model_arguments(parser, batch=4, completion=1792)
    args = parser.parse_args(argv)
    tiny(args)
    path = _model_dir(args)
    results = run_variants(lambda variant: run_variant(variant, path, args), args)
    baseline = {r["variant"].split("_")[0]: r for r in results if r["variant"].endswith("_trl")}
    print(f"device {args.device}; vocab {args.vocab}, hidden {args.hidden}, layers "
          f"{args.layers}, {args.batch} x ({args.prompt} + {args.completion}) words")  # fmt: skip
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    for r in results:
        s, base = r["step"], baseline.get(r["variant"].split("_")[0], r)
        print(
            f"{r['variant']:>14}: step {s['median_s'] * 1e3:9.1f} ms, peak "
            f"{gib(s['peak_bytes'])} (held {gib(s['held_bytes'])}); loss {r['loss']:.6g} "
            f"({r['loss'] - base['loss']:+.2g} vs TRL), grad norm {r['grad_norm']:.6g} "
            f"({r['grad_norm'] - base['grad_norm']:+.2g})"
        )
    write_results(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
