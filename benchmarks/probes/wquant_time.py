"""Time the fused FP8 weight quantiser (q, scales, q^T) on one EP8 slice's routed weights, beside torch's.

    PYTHONPATH=src python3 benchmarks/probes/wquant_time.py [--shape kimi-k2.7] [--ep 8]

What the layer pays every step when it quantises bf16 master weights (docs/design.md, "FP8 experts"). On the H200 (Kimi
slice, 48 experts): the chunked form 3.13 ms against the one-pass form's 10.82 and torch's 58.2 (bf16 weights), the
same bits; the chunked form is the library's.
"""

from __future__ import annotations

import argparse

import torch
import triton

from kittenmoe.config import SEED_SHAPES
from kittenmoe.fp8 import FP8Config, launch_weight_quant, quantize_weights_and_transpose


def _ms(fn, reps):
    """Median ms of ``fn`` (triton's do_bench, as the other benchmarks time)."""
    return triton.testing.do_bench(fn, warmup=2, rep=reps * 60, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    s = SEED_SHAPES[args.shape]
    L = s.e // args.ep
    g = torch.Generator(device="cuda").manual_seed(0)
    for dt, sb, pow2 in ((torch.bfloat16, 128, False), (torch.bfloat16, 32, True), (torch.float32, 128, False)):
        w13 = torch.randn(L, 2 * s.i, s.h, device="cuda", generator=g, dtype=dt)
        w2 = torch.randn(L, s.h, s.i, device="cuda", generator=g, dtype=dt)
        numel = w13.numel() + w2.numel()
        cfg = FP8Config(scale_block=sb, pow2_scales=pow2)
        res = {}
        for impl in ("triton", "torch"):
            res[impl] = _ms(lambda: (quantize_weights_and_transpose(w13, cfg, impl=impl),
                                     quantize_weights_and_transpose(w2, cfg, impl=impl)), args.reps)
        moved = (w13.element_size() + 2) * numel  # read w, write q and q^T (1 B each); scales are ~0.01%
        line = (f"{args.shape} L={L} {dt} scale_block={sb}: triton {res['triton']:.3f} ms "
                f"({moved / res['triton'] / 1e6:.0f} GB/s), torch {res['torch']:.3f} ms")
        if sb == 128:  # the kernel's one-pass form (the whole block at once), checked bit for bit against the default
            ms = _ms(lambda: (launch_weight_quant(w13, sb, pow2, sb), launch_weight_quant(w2, sb, pow2, sb)),
                     args.reps)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for w in (w13, w2)
                       for a, b in zip(launch_weight_quant(w, sb, pow2), launch_weight_quant(w, sb, pow2, sb)))
            line += f"; one pass (128 rows) {ms:.3f} ms ({moved / ms / 1e6:.0f} GB/s), bitwise equal {same}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
