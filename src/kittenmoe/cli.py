"""``kittenmoe`` command line: ``demo``, ``bench``, ``tune``. (The training demo is ``examples/train_lm.py``.)"""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    import torch

    from kittenmoe.config import get_shape
    from kittenmoe.reference import moe_reference_multirank, route
    from kittenmoe.testing import make_weights, rel_l1
    from kittenmoe.torch_backend import moe_forward_multirank

    shape = get_shape(args.shape)
    R, T = args.ranks, args.tokens
    shape.experts_per_rank(R)  # validates E % R
    g = torch.Generator().manual_seed(args.seed)
    w = make_weights(shape, generator=g).requires_grad_()
    router_EH = (torch.randn(shape.e, shape.h, generator=g) / shape.h ** 0.5).requires_grad_()
    xs = [torch.randn(T, shape.h, generator=g).requires_grad_() for _ in range(R)]

    def run(forward, dtype):
        routes = [route(x.to(dtype) @ router_EH.to(dtype).t(), shape.k, shape.score_func, shape.renormalize,
                        shape.routed_scaling_factor, compute_dtype=dtype) for x in xs]
        ids = [r[0] for r in routes]
        ws = [r[1] for r in routes]
        outs = forward(ids, ws, dtype)
        loss = sum((o.to(dtype) * go).sum() for o, go in zip(outs, grads_out))
        params = xs + [router_EH] + w.tensors()
        return [o.detach() for o in outs], torch.autograd.grad(loss, params), ids

    grads_out = [torch.randn(T, shape.h, generator=g) for _ in range(R)]
    t0 = time.perf_counter()
    out_k, grads_k, ids = run(lambda ids, ws, dt: moe_forward_multirank(
        xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit,
        block_m=args.block_m), torch.float32)
    dt_k = time.perf_counter() - t0
    t0 = time.perf_counter()
    out_r, grads_r, _ = run(lambda ids, ws, dt: moe_reference_multirank(
        xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit,
        compute_dtype=dt), torch.float64)
    dt_r = time.perf_counter() - t0

    names = [f"d_x[{r}]" for r in range(R)] + ["d_router", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2"]
    load = torch.bincount(torch.cat([i.flatten() for i in ids]), minlength=shape.e).view(R, -1).sum(1)
    print(f"kittenmoe demo: shape {shape.name} (E={shape.e} H={shape.h} I={shape.i} K={shape.k}), "
          f"R={R} virtual ranks x T={T} tokens, torch backend vs fp64 reference, forward + backward")
    print(f"routed rows per rank: {load.tolist()}")
    print(f"{'tensor':<14}{'rel L1 vs ref':>15}")
    rows = [(f"out[{r}]", rel_l1(out_k[r], out_r[r])) for r in range(R)]
    rows += [(n, rel_l1(a, b)) for n, a, b in zip(names, grads_k, grads_r)]
    worst = 0.0
    for n, err in rows:
        worst = max(worst, err)
        print(f"{n:<14}{err:>15.2e}")
    print(f"time: torch backend {dt_k * 1e3:.1f} ms, reference {dt_r * 1e3:.1f} ms")
    ok = worst <= 1e-5
    print("PASS" if ok else f"FAIL: worst relative L1 error {worst:.2e} > 1e-5")
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from kittenmoe.bench.main import run_bench

    return run_bench(args, args.argv)


def _tune(args: argparse.Namespace) -> int:
    from kittenmoe.tune import run_tune

    return run_tune(args, args.argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kittenmoe", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="small MoE layer over several virtual ranks, forward + backward vs the reference")
    d.add_argument("--shape", default="small", help="a name from kittenmoe.config.SHAPES (default: small)")
    d.add_argument("--ranks", type=int, default=4, help="virtual EP ranks (default 4)")
    d.add_argument("--tokens", type=int, default=37, help="tokens per rank (default 37)")
    d.add_argument("--block-m", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=_demo)
    from kittenmoe.bench.main import add_bench_args
    from kittenmoe.tune import add_tune_args

    b = sub.add_parser("bench", help="time the megakernel layer against the grouped_mm baseline (table, JSON, plot)")
    add_bench_args(b)
    b.set_defaults(fn=_bench, argv=argv)
    tu = sub.add_parser("tune", help="sweep the megakernel's knobs for one shape and cache the fastest config")
    add_tune_args(tu)
    tu.set_defaults(fn=_tune, argv=argv)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # bad arguments: one clear line, not a traceback
        print(f"kittenmoe {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
