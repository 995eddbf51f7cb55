"""Train a Hugging Face MoE model for N steps with each experts implementation and print tokens/s.

    python examples/train_hf_moe.py                                              # Qwen3-30B-A3B, 4 layers, H200
    python examples/train_hf_moe.py --model moonlight-16b-a3b --impls grouped_mm,kittenmoe --steps 30
    python examples/train_hf_moe.py --model tiny-qwen3-moe --device cpu --seq 64 --steps 5   # any machine

The model is a published configuration at full width, a few layers deep, randomly initialised (no download;
``kittenmoe.bench.train_models``). Switching a transformers model to kittenmoe is one line,
``model.set_experts_implementation("kittenmoe")`` (or ``experts_implementation="kittenmoe"`` in
``from_pretrained``) after ``import kittenmoe.integrations.transformers``. Every implementation starts from the
same weights and sees the same batches, so the printed losses must agree. For the measured comparison (peak
memory, host syncs, torch.compile, the floor, JSON rows) run ``benchmarks/train_step.py``.
"""

from __future__ import annotations

import argparse

import torch

import kittenmoe.integrations.transformers  # noqa: F401  (registers experts_implementation="kittenmoe")
from kittenmoe.bench.train_models import MODELS, build_hf, hf_loss, train_timed, zipf_batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impls", default="grouped_mm,kittenmoe", help="experts implementations, comma-separated")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = MODELS[args.model]
    batches = zipf_batches(args.steps, args.batch, args.seq, spec.vocab)
    print(f"{args.model}: {args.layers} layers, {args.batch} x {args.seq} tokens a step, {dtype}")
    for impl in args.impls.split(","):
        model = build_hf(spec, args.layers, device, dtype)  # the same seed: the same weights for each
        model.set_experts_implementation(impl)
        tokens_per_s, losses = train_timed(model, batches, hf_loss, device, args.warmup)
        print(f"{impl:<12} {tokens_per_s:10.0f} tokens/s   loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
