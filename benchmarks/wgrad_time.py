"""Time the backward with the weight gradients from one program per tile against KernelConfig.wgrad_persistent.

    PYTHONPATH=src python3 benchmarks/wgrad_time.py [--shapes kimi-k2.7] [--reps 10]

A quick check for a short device call: the forward (kept activations) and backward of each EP8 slice, each
config timed in the same run (do_bench medians), the gradients compared bit for bit. bwd_round.py --config
wgrad_persistent=True gives the full row (reference check, baseline, JSON).
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
from kittenmoe.ops import megakernel_backward_multirank, megakernel_forward_multirank  # noqa: E402
from kittenmoe.peers import LocalPeers  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name in args.shapes.split(","):
        shape = SEED_SHAPES[name].with_(e=SEED_SHAPES[name].e // 8)
        T = SLICES[name]
        w, xs, ids, ws, gos = case(shape, 1, T, dev)
        peers = LocalPeers(1, dev)
        a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
        base = default_config(T, shape.h, shape.i, shape.e, shape.k, device=dev)
        grads, ms = {}, {}
        for label, cfg in (("per tile", base), ("persistent", base.with_(wgrad_persistent=True))):
            fwd = megakernel_forward_multirank(*a, config=cfg, peers=peers, save_for_backward=True)

            def run(c=cfg, f=fwd):
                return megakernel_backward_multirank(gos, *a, config=c, peers=peers, saved=f.saved())

            res = run()
            res.check_errors()
            grads[label] = [t.clone() for t in (res.d_w13, res.d_w2, res.d_shared_w13, res.d_shared_w2)
                             if t is not None]
            ms[label] = triton.testing.do_bench(run, warmup=20, rep=args.reps * 20, return_mode="median")
            print(f"  {name} {label}: backward {ms[label]:.3f} ms", flush=True)
        same = all(torch.equal(p, q) for p, q in zip(grads["per tile"], grads["persistent"]))
        print(f"{name}: backward per tile {ms['per tile']:.3f} ms, persistent {ms['persistent']:.3f} ms "
              f"({ms['per tile'] / ms['persistent']:.2f}x), every weight gradient the same bits: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
