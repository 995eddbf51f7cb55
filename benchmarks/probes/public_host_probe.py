"""Host time of the public path (``kittenmoe.moe`` under autograd), forward and forward+backward, beside its GPU time.

    PYTHONPATH=src python3 benchmarks/probes/public_host_probe.py [--shape 8192,2048,768,128,8] [--calls 30]

Asked because ``kittenmoe bench --baseline sonicmoe`` timed Qwen3-30B-A3B's layer (no shared expert) at 6.29 ms a
forward+backward through ``kittenmoe.moe`` where the same call's kernels take ~4.45 ms of GPU time
(``kernel_times.py``): a call whose host work outlasts its kernels leaves the GPU idle between them, and
``do_bench`` times that. For each mode this prints the host time a call (two calls at a time behind a sleep
kernel, so no call waits on the GPU: ``host_probe.calls_ms``), the wall time a call with the GPU free (what a
benchmark sees), cProfile's heaviest functions (cumulative, then own time), and the host time each Triton / Gluon
kernel's launch takes (``launch_breakdown``) against the rest. On an H100 (torch 2.11, Triton
3.6) a forward took 2.2-3.1 ms of host time against ~1.4 ms of kernels and a forward+backward 4.9-6.8 against
~4.3: the public path is host-bound at these widths (docs/performance.md, "Against SonicMoE").
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

from kittenmoe.bench.timing import sync_warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_probe import calls_ms, profile_calls, public_path_calls


def launch_breakdown(fn, calls: int) -> None:
    """Host microseconds a call spent in each Triton / Gluon kernel's ``run`` (its argument specialisation, cache
    lookup, descriptor encoding and the driver launch), and in the rest, over ``calls`` calls with the GPU free."""
    from triton.runtime.jit import JITFunction

    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    original = JITFunction.run

    def timed_run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            rec = spent[self.fn.__name__]
            rec[0] += 1
            rec[1] += time.perf_counter() - t0

    JITFunction.run = timed_run
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        JITFunction.run = original
    in_launches = sum(v[1] for v in spent.values())
    print(f"host us a call: total {1e6 * total / calls:.0f}, Triton/Gluon launches {1e6 * in_launches / calls:.0f}, "
          f"the rest {1e6 * (total - in_launches) / calls:.0f}")
    for name, (n, sec) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<44} {n / calls:5.1f} launches a call  {1e6 * sec / n:7.1f} us each")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,2048,768,128,8", help="T,H,I,E,K (no shared expert)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    forward, forward_backward, _, _ = public_path_calls(args.shape, torch.device("cuda"))

    for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
        for _ in range(5):  # compile, tune-cache lookups, allocator warm
            fn()
        syncs = sync_warnings(fn)
        print(f"\n{name}: {len(syncs)} synchronizing torch call(s) a call (torch.cuda.set_sync_debug_mode)")
        for w in syncs[:3]:
            print(f"{w.filename}:{w.lineno}: {w.message}")
        host = calls_ms(fn, args.calls, hold_gpu=True)
        wall = calls_ms(fn, args.calls, hold_gpu=False)
        st = profile_calls(fn, args.calls)
        print(f"\n==== {name} {args.shape}: host {host:.3f} ms a call (GPU held back), wall {wall:.3f} ms a call")
        launch_breakdown(fn, args.calls)
        st.sort_stats("cumulative").print_stats(args.top)
        st.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
