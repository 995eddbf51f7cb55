"""Where a forward's measured time goes beyond its kernels' own time (issue 3).

    PYTHONPATH=src python3 benchmarks/timing_probe.py [--shapes deepseek-v4-pro,kimi-k2.7]

2026-12-01 (6): on the DeepSeek slice `do_bench` said 4.58 ms a forward and CUDA-graph replay 4.54 ms, while
the profiler's kernels summed to 3.95 ms (megakernel 3.835 ms) and the kernel's own trace spanned 3.91 ms. This
probe times the same forward five ways in one process, so the gap can be attributed:

  do_bench        triton.testing.do_bench (L2 flushed before each call), median
  events          back-to-back calls, CUDA events around each, no flush, median
  events+flush    as events, a 256 MB zero between calls (what do_bench does), median
  kernels         the profiler's device time of every kernel in one call, back to back (sum, and the megakernel's)
  kernels+flush   the same with the 256 MB zero between calls

A gap between do_bench and kernels+flush is host time the GPU waits on; between kernels and kernels+flush,
cache or clock effects on the kernel itself.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from kittenmoe.config import SEED_SHAPES, default_config
from kittenmoe.ops import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.testing import make_weights, routing_uniform

SLICES = {"kimi-k2.7": 2048, "deepseek-v4-pro": 2048, "qwen3.5-397b-a17b": 4096, "glm-5.2": 2048}


def event_median(fn, flush: torch.Tensor | None, n: int = 30) -> float:
    ts = []
    for _ in range(n):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernel_times(fn, flush: torch.Tensor | None, n: int = 5) -> tuple[float, float, list[tuple[str, float]]]:
    """(sum of kernel ms a call, the megakernel's ms a call, the top kernels) from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            if flush is not None:
                flush.zero_()
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / n) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    # the flush's own kernel is not the forward's
    flush_ms = sum(ms for k, ms in rows if "fill" in k or "FillFunctor" in k) if flush is not None else 0.0
    total = sum(ms for _, ms in rows) - flush_ms
    mk = sum(ms for k, ms in rows if "dispatch_mlp" in k)
    return total, mk, rows[:6]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v4-pro,kimi-k2.7")
    ap.add_argument("--ep", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    table = []
    for name in args.shapes.split(","):
        base = SEED_SHAPES[name]
        L = base.e // args.ep
        shape = base.with_(e=L, k=base.k)
        T = SLICES[name]
        cfg = default_config(T, shape.h, shape.i, L, shape.k, device=dev)
        g = torch.Generator().manual_seed(0)
        w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g)
        x = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
        ids, wts = routing_uniform(T, L, shape.k, generator=g, device=dev)
        peers = LocalPeers(1, dev)
        args_k = ([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)

        def fn():
            return megakernel_forward_multirank(*args_k, config=cfg, peers=peers).outputs[0]

        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        r = {"do_bench": triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"),
             "events": event_median(fn, None), "events+flush": event_median(fn, flush)}
        for label, fl in (("kernels", None), ("kernels+flush", flush)):
            total, mk, top = kernel_times(fn, fl)
            r[label] = total
            r[label + " (megakernel)"] = mk
            print(f"  {name} {label}: " + ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in top), flush=True)
        for k, v in r.items():
            print(f"  {name:<18} {k:<28} {v:8.3f} ms", flush=True)
        table.append((name, r))
    print()
    keys = list(table[0][1])
    print("shape              " + "  ".join(f"{k[:14]:>14}" for k in keys))
    for name, r in table:
        print(f"{name:<18} " + "  ".join(f"{r[k]:14.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
