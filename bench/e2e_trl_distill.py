"""One on-policy distillation step of TRL's ``DistillationTrainer``: TRL's loss against fused_rl's.

The same trainer, the same student and teacher, the same micro-batch, with one import
changed. Two variants, each built fresh (random Qwen2-shaped models from configs, a
tokenizer built in code, no download):

- ``trl``: ``trl.DistillationTrainer`` (TRL >= 1.16: its chunked divergence,
  ``trl.kernels.chunked_divergence``, projects both models' hidden states tile by tile
  and recomputes both GEMMs in its backward);
- ``fused_rl``: ``fused_rl.integrations.trl.DistillationTrainer``: the same trainer, its
  divergence from one ``fused_rl.linear_distill_loss`` call (fp32 chunk logits, as TRL's
  tiles; the gradients formed in the forward, no GEMM recomputed).

Each variant times one optimizer step on one micro-batch as the trainer holds it after
generation (``_compute_loss``, called directly as ``bench/e2e_trl.py`` does: both
backbones, the teacher's under ``no_grad``, and the loss, with no accelerate autocast
around it (the models are bf16 on CUDA, fp32 on CPU); then the backward and
``optimizer.step``): medians over ``--repeats`` after a warm-up,
and on CUDA the peak memory (``max_memory_allocated``) with the memory held before it
(both models, the student's gradients and optimizer state). The losses and gradient norms
of the two are compared (parity): on a CPU that is all this measures (its times are CPU
times through the Triton interpreter or the reference backend, not a benchmark).

    python -m bench.e2e_trl_distill --device cuda --out bench/results/<gpu>/e2e_trl_distill.json
    python -m bench.e2e_trl_distill --device cpu --tiny        # parity only, about a minute

Needs TRL >= 1.16 and transformers (the GPU image has transformers; carry TRL's wheel).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from bench.e2e_trl import (
    _model_dir,
    _tokenizer,
    add_common_arguments,
    run_variants,
    timed_step,
    write_results,
)

VARIANTS = ("trl", "fused_rl")
# the two models' shapes: Qwen2.5-0.5B (student) and Qwen2.5-1.5B (teacher), vocabulary 151936
SHAPES = {
    "student": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2),
    "teacher": dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2),
}
TINY = {
    "student": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2),
    "teacher": dict(hidden=96, intermediate=192, layers=2, heads=4, kv_heads=2),
}


def _trainer(variant: str, paths: tuple[str, str], args):
    import trl
    from datasets import Dataset

    import fused_rl.integrations.trl as fused_trl

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    config = trl.DistillationConfig(
        output_dir=tempfile.mkdtemp(prefix="e2e_distill_out_"),
        per_device_train_batch_size=args.batch, max_completion_length=args.completion,
        beta=args.beta, temperature=args.temperature, learning_rate=1e-6, report_to=[],
        use_cpu=not cuda, bf16=cuda, model_init_kwargs={"dtype": dtype},
        teacher_model_init_kwargs={"dtype": dtype}, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    kwargs = dict(model=paths[0], teacher_model=paths[1], args=config,
                  train_dataset=Dataset.from_dict({"prompt": ["w1"] * args.batch}),
                  processing_class=_tokenizer(args.vocab))  # fmt: skip
    if variant == "trl":
        trainer = trl.DistillationTrainer(**kwargs)
    else:
        trainer = fused_trl.DistillationTrainer(**kwargs, fused_rl_backend=args.backend)
    trainer.model.train()
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    return trainer


def _inputs(args, device) -> dict:
    """A micro-batch after generation: random prompt and completion ids, every third
    completion padded after half its length."""
    gen = torch.Generator().manual_seed(1)
    batch, length = args.batch, args.completion
    prompt_ids = torch.randint(2, args.vocab, (batch, args.prompt), generator=gen)
    ids = torch.randint(2, args.vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[::3, length // 2 :] = 0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
              "completion_ids": ids, "completion_mask": mask}  # fmt: skip
    return {k: v.to(device) for k, v in inputs.items()}


def run_variant(variant: str, paths: tuple[str, str], args) -> dict:
    trainer = _trainer(variant, paths, args)
    inputs = _inputs(args, args.device)
    num_items = inputs["completion_mask"].sum().float()

    def loss_of(model, record):
        loss, entropy_sum, n_valid = trainer._compute_loss(model, dict(inputs), num_items)
        record["entropy"] = float(entropy_sum / n_valid)
        return loss

    return {"variant": variant, **timed_step(trainer, loss_of, args)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, VARIANTS)
    parser.add_argument("--tiny", action="store_true", help="tiny models: parity on a CPU")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=2048)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.9)
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.tiny:
        shapes = TINY
        args.vocab, args.batch, args.prompt, args.completion, args.repeats = 509, 3, 5, 9, 1
    # _model_dir reads one model's shape (and the sequence length) off an args namespace
    paths = tuple(_model_dir(argparse.Namespace(**{**vars(args), **shapes[who]}))
                  for who in ("student", "teacher"))  # fmt: skip
    results = run_variants(lambda variant: run_variant(variant, paths, args), args)
    base = results[0]
    print(f"device {args.device}; vocab {args.vocab}, student {shapes['student']}, teacher "
          f"{shapes['teacher']}, {args.batch} x ({args.prompt} + {args.completion}) tokens, "
          f"beta {args.beta}")  # fmt: skip
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    for r in results:
        s = r["step"]
        print(
            f"{r['variant']:>9}: step {s['median_s'] * 1e3:9.1f} ms, peak {gib(s['peak_bytes'])}"
            f" (held {gib(s['held_bytes'])}); loss {r['loss']:.6g} (vs {base['variant']} "
            f"{r['loss'] - base['loss']:+.2g}), grad norm {r['grad_norm']:.6g} "
            f"({r['grad_norm'] - base['grad_norm']:+.2g}), entropy {r['entropy']:.6g}"
        )
    write_results(args, results, shapes=shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
