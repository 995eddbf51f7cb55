"""Train a torchtitan MoE model for N steps with torchtitan's own experts and with kittenmoe; print tokens/s.

    python examples/train_titan_moe.py                                        # Qwen3-30B-A3B, 4 layers, a GPU
    python examples/train_titan_moe.py --model tiny-qwen3-moe --device cpu --seq 64 --steps 5   # any machine

The model is torchtitan 0.3's published Qwen3-30B-A3B configuration at full width, a few layers deep, randomly
initialised (no download; ``kittenmoe.bench.train_models.build_titan``), attending by causal SDPA. Switching its
routed experts to kittenmoe is two calls before the optimizer is built (and before torchtitan's ``parallelize``):

    apply_kittenmoe(model)         # every RoutedExperts: dispatch, grouped experts and combine in kittenmoe.moe
    fuse_gate_up_storage(model)    # w1 and w3 as one dense parameter kittenmoe reads in place (no FSDP / TP / EP)

Both runs start from the same weights and see the same batches, so the printed losses agree within bf16 noise.
For the measured comparison (the floor, peak memory, host syncs, JSON rows) run ``benchmarks/train_step.py
--stack torchtitan``.
"""

from __future__ import annotations

import argparse

import torch

from kittenmoe.bench.train_models import MODELS, build_titan, titan_loss, train_timed, zipf_batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    titan_models = sorted(n for n, m in MODELS.items() if m.titan_flavor)
    ap.add_argument("--model", choices=titan_models, default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    from kittenmoe.integrations.torchtitan import apply_kittenmoe, fuse_gate_up_storage

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = MODELS[args.model]
    batches = zipf_batches(args.steps, args.batch, args.seq, spec.vocab)
    print(f"{args.model}: {args.layers} layers, {args.batch} x {args.seq} tokens a step, {dtype}")
    for impl in ("torchtitan", "kittenmoe"):
        model = build_titan(spec, args.layers, device, dtype, attention="sdpa")  # one seed: the same weights
        if impl == "kittenmoe":
            apply_kittenmoe(model)
            fuse_gate_up_storage(model)
        tokens_per_s, losses = train_timed(model, batches, lambda m, ids: titan_loss(m, ids, flex=False), device,
                                           args.warmup)
        print(f"{impl:<12} {tokens_per_s:10.0f} tokens/s   loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
