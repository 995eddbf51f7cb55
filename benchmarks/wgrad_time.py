"""Time the backward's weight-gradient launch variants against the default (one 128 x 256 program per tile).

    PYTHONPATH=src python3 benchmarks/wgrad_time.py [--shapes kimi-k2.7] [--reps 10]

A quick check for a short device call: for each EP8 slice the forward (kept activations) once, then per
variant (KernelConfig.wgrad_persistent, wgrad_two_per_sm, both) the whole backward and the weight-gradient
launch alone (``phases`` = its two bits; the schedule and an empty megakernel launch, ~0.1 ms, included;
operands as the allocator hands them over, which a GEMM's time does not depend on), do_bench medians in the
same run, and the weight gradients compared bit for bit with the default's. bwd_round.py --config
wgrad_two_per_sm=True gives the full row (reference check, baseline, JSON).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bwd_round import SLICES, case  # noqa: E402

from kittenmoe.config import SEED_SHAPES, default_config  # noqa: E402
from kittenmoe.kernels import megakernel_bwd as mb  # noqa: E402
from kittenmoe.ops import megakernel_backward_multirank, megakernel_forward_multirank  # noqa: E402
from kittenmoe.peers import LocalPeers  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    for name in args.shapes.split(","):
        shape = SEED_SHAPES[name].with_(e=SEED_SHAPES[name].e // 8)
        T = SLICES[name]
        w, xs, ids, ws, gos = case(shape, 1, T, dev)
        peers = LocalPeers(1, dev)
        a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
        base = default_config(T, shape.h, shape.i, shape.e, shape.k, device=dev)
        variants = {"per tile": {}, "persistent": dict(wgrad_persistent=True),
                    "two per SM": dict(wgrad_two_per_sm=True),
                    "two per SM, persistent": dict(wgrad_two_per_sm=True, wgrad_persistent=True)}
        fwd = megakernel_forward_multirank(*a, config=base, peers=peers, save_for_backward=True)
        wg_only = mb.PB_WGRAD | mb.PB_SHARED_WGRAD
        grads, ms, ms_wg = {}, {}, {}
        for label, knobs in variants.items():
            cfg = base.with_(**knobs)

            def run(c=cfg, phases=None):
                return megakernel_backward_multirank(gos, *a, config=c, peers=peers, saved=fwd.saved(),
                                                     phases=phases)

            res = run()
            res.check_errors()
            grads[label] = [t.clone() for t in (res.d_w13, res.d_w2, res.d_shared_w13, res.d_shared_w2)
                            if t is not None]
            ms[label] = triton.testing.do_bench(run, warmup=20, rep=args.reps * 20, return_mode="median")
            ms_wg[label] = triton.testing.do_bench(lambda r=run: r(phases=wg_only), warmup=20,
                                                   rep=args.reps * 20, return_mode="median")
            same = all(torch.equal(p, q) for p, q in zip(grads["per tile"], grads[label], strict=True))
            print(f"  {name} {label:<24} backward {ms[label]:7.3f} ms ({ms['per tile'] / ms[label]:.2f}x), "
                  f"weight-gradient launch alone {ms_wg[label]:7.3f} ms "
                  f"({ms_wg['per tile'] / ms_wg[label]:.2f}x); same bits as per tile: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
