"""Where a forward's measured time goes beyond its kernels' own time.

    PYTHONPATH=src python3 benchmarks/probes/timing_probe.py [--shapes deepseek-v4-pro,kimi-k2.7]

Asked because on the DeepSeek slice `do_bench` said 4.58 ms a forward and CUDA-graph replay 4.54 ms, while
the profiler's kernels summed to 3.95 ms (megakernel 3.835 ms) and the kernel's own trace spanned 3.91 ms. This
probe times the same forward five ways in one process, so the gap can be attributed:

  do_bench        triton.testing.do_bench (L2 flushed before each call), median
  events          back-to-back calls, CUDA events around each, no flush, median
  events+flush    as events, a 256 MB zero between calls (what do_bench does), median
  kernels         the profiler's device time of every kernel in one call, back to back (sum, and the megakernel's)
  kernels+flush   the same with the 256 MB zero between calls (30 calls: each call's megakernel duration and
                  start-to-start time are printed, so clocks falling under sustained load would show)

A gap between do_bench and kernels+flush is host time the GPU waits on, or idle gaps between the call's
kernels; between kernels and kernels+flush, cache or clock effects on the kernel itself. The last call of the
flushed profile is printed as a GPU timeline (each activity's start, duration and the gap before it).

H200, ms: DeepSeek do_bench 4.587, events 4.958, events+flush 4.793, kernels 3.937 (megakernel 3.828),
kernels+flush 4.018 (3.905); Kimi 3.584 / 3.955 / 3.823 / 3.277 (3.137) / 3.334 (3.193). `host_probe.py`: 0.64 ms of
host time a DeepSeek call, with no wait on the GPU in it. The 30 flushed calls answered it: the megakernel took
3.02 ms (Kimi) for the first ten calls and 3.34-3.41 for the last fourteen, the SM clock falling under the
board's 700 W power cap (docs/performance.md, "Method").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

# the benchmark scripts live one directory up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fwd_round import forward_slice  # noqa: E402


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


def gpu_timeline(prof, path: str) -> None:
    """Print the last call's GPU activities in order: start (us from the first), duration and the idle gap
    before each, from the profiler's Chrome trace: gaps inside a call are GPU time no kernel accounts for."""
    import json

    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = [e for e in json.load(f)["traceEvents"]
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    evs.sort(key=lambda e: e["ts"])
    mk = [i for i, e in enumerate(evs) if "dispatch_mlp" in e["name"]]
    # each call's megakernel in order: a rising duration over a sustained run is the clock coming down
    print("  megakernel us, call by call: " + " ".join(f"{evs[i]['dur']:.0f}" for i in mk), flush=True)
    starts = [evs[i]["ts"] for i in mk]
    if len(starts) > 1:
        print("  megakernel start to start us: " + " ".join(f"{b - a:.0f}" for a, b in zip(starts, starts[1:])),
              flush=True)
    if len(mk) < 2:
        print("  timeline: fewer than two megakernels in the trace", flush=True)
        return
    lo, hi = mk[-2] + 1, len(evs)  # from just after the previous call's megakernel to the end
    t0 = evs[lo]["ts"]
    prev_end = evs[lo - 1]["ts"] + evs[lo - 1]["dur"]
    print(f"  {'activity':<44} {'start us':>9} {'dur us':>9} {'gap us':>8}", flush=True)
    for e in evs[lo:hi]:
        print(f"  {e['name'][:44]:<44} {e['ts'] - t0:9.1f} {e['dur']:9.1f} {e['ts'] - prev_end:8.1f}", flush=True)
        prev_end = e["ts"] + e["dur"]


def kernel_times(fn, flush: torch.Tensor | None, n: int = 5,
                 timeline: str | None = None) -> tuple[float, float, list[tuple[str, float]]]:
    """(sum of kernel ms a call, the megakernel's ms a call, the top kernels) from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            if flush is not None:
                flush.zero_()
            fn()
        torch.cuda.synchronize()
    if timeline is not None:
        gpu_timeline(prof, timeline)
    # GPU activities only: a CPU op's row (with the CPU activity on, for the timeline) also totals its kernels
    rows = [(e.key, e.device_time_total / 1e3 / n) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
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
    ap.add_argument("--out", default="/tmp", help="where the profiler's Chrome traces go")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    table = []
    for name in args.shapes.split(","):
        sl = forward_slice(name, args.ep, 0, dev)
        fn = sl.run

        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        r = {"do_bench": triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"),
             "events": event_median(fn, None), "events+flush": event_median(fn, flush)}
        for label, fl in (("kernels", None), ("kernels+flush", flush)):
            total, mk, top = kernel_times(fn, fl, n=30 if fl is not None else 5,
                                          timeline=f"{args.out}/timeline-{name}.json" if fl is not None else None)
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
