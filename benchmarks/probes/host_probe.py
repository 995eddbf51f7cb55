"""Where a forward's host time goes: cProfile over repeated megakernel forwards.

    PYTHONPATH=src python3 benchmarks/probes/host_probe.py [--shape deepseek-v4-pro] [--calls 50]

Asked because `timing_probe.py` measured a DeepSeek-slice forward at 4.96 ms with a sync around each call against
3.94 ms of kernels. This prints the functions the host time is spent in (cumulative, then own time) and the wall
time a call. On the H200: 0.64 ms of host time a DeepSeek call, no sync inside it (the gap was the power cap's
clock, docs/performance.md "Method").
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

# the benchmark scripts live one directory up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fwd_round import forward_slice  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v4-pro")
    ap.add_argument("--tokens", type=int, default=0, help="0: the slice's own count")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sl = forward_slice(args.shape, args.ep, args.tokens, dev)
    fn = sl.run

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    # host time alone: the GPU is kept far behind by a long sleep kernel, so no call waits on it
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(args.calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.calls
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    pr.enable()
    for _ in range(args.calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    print(f"host time a forward call (no profiler, GPU not waited on): {host_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
