"""Hardware counters of one forward+backward on a seed slice (or ``T,H,I,E,K`` without a shared expert), for
Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight -o $OUT/ncu-kimi \
        python3 benchmarks/probes/ncu_probe.py --shape kimi-k2.7

(`bash scripts/gpu.sh ncu` runs it with the sections and metrics docs/performance.md quotes.) The slice is
built as in ``bwd_round.py`` (R=1, the heuristic config, the forward keeping its activations as autograd
runs it). Our forward+backward and the grouped_mm baseline's run three times each to compile and warm the
caches, then once each between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that with
``--profile-from-start off`` ncu profiles just those kernels. ncu replays each kernel once per pass and
restores the memory it wrote, so the megakernels' signal counters start from the same state every pass.
``--clock-control none``: clocks are left as the GPU runs them (not locked to base), as in the timed rows.
"""

from __future__ import annotations

import argparse

import torch

from kittenmoe.baselines import grouped_mm_forward
from kittenmoe.bench import parse_config_overrides
from kittenmoe.bench.problems import parse_shape
from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS, ModelShape, default_config
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.testing import make_weights, routing_uniform


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="kimi-k2.7",
                    help=f"a seed slice ({', '.join(sorted(SLICE_TOKENS))}) or T,H,I,E,K (no shared expert)")
    ap.add_argument("--forward-only", action="store_true", help="profile the forwards alone")
    ap.add_argument("--config", default="", help="KernelConfig overrides on the heuristic (k=v,k=v)")
    args = ap.parse_args()

    dev = torch.device("cuda")
    if args.shape in SLICE_TOKENS:
        base = SEED_SHAPES[args.shape]
        shape, T, shared = base.with_(e=base.e // 8), SLICE_TOKENS[args.shape], True
    else:
        T, h, i, e, k = parse_shape(args.shape)
        shape, shared = ModelShape(args.shape, e=e, h=h, i=i, k=k), False
    cfg = default_config(T, shape.h, shape.i, shape.e, shape.k, device=dev,
                         s=shape.shared_width if shared else 0)
    if args.config:
        cfg = cfg.with_(**parse_config_overrides(args.config))
    print(f"{args.shape}: {cfg}", flush=True)
    g = torch.Generator().manual_seed(0)
    w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g, shared=shared)
    x = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
    ids, wts = routing_uniform(T, shape.e, shape.k, generator=g, device=dev)
    d_out = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
    peers = LocalPeers(1, dev)
    a = ([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)

    def ours():
        f = megakernel_forward_multirank(*a, config=cfg, peers=peers, save_for_backward=not args.forward_only)
        if not args.forward_only:
            megakernel_backward_multirank([d_out], *a, config=cfg, peers=peers, saved=f.saved()).check_errors()

    leaves = [t.detach().requires_grad_(not args.forward_only) for t in [x, wts] + w.tensors()]

    def baseline():
        out = grouped_mm_forward(leaves[0], ids, leaves[1], *leaves[2:], shape.swiglu_limit)
        if not args.forward_only:
            torch.autograd.grad(out, leaves, d_out)

    for _ in range(3):
        ours()
        baseline()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    torch.cuda.synchronize()
    baseline()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled one call of each", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
