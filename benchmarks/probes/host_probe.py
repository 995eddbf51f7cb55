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


def calls_ms(fn, calls: int, hold_gpu: bool, batch: int = 2) -> float:
    """ms a call of ``fn`` over ``calls`` calls. ``hold_gpu``: the host's time alone, ``batch`` calls at a time
    behind a sleep kernel (~0.5 s) that keeps the GPU from them, so no call waits on it. Only a few calls a hold:
    twenty forward+backwards queued behind one long sleep filled the launch queue, and every launch after that
    waited for the GPU (76 ms a call read as host time, on an H100). Else the wall time to the last kernel's end
    with the GPU free (what a benchmark's loop sees)."""
    torch.cuda.synchronize()
    if hold_gpu:
        host = 0.0
        for first in range(0, calls, batch):
            torch.cuda._sleep(int(1e9))
            t0 = time.perf_counter()
            for _ in range(min(batch, calls - first)):
                fn()
            host += time.perf_counter() - t0
            torch.cuda.synchronize()
        return host * 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / calls


def profile_calls(fn, calls: int) -> pstats.Stats:
    """cProfile over ``calls`` calls of ``fn`` with the GPU free (one long hold fills the launch queue:
    ``calls_ms``). Where the kernels outlast the host's work, the waits of a full queue show up too."""
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    return pstats.Stats(pr)


def public_path_calls(shape: str, device: torch.device, config=None):
    """``(forward, forward_backward, topk_ids, E)`` for a ``T,H,I,E,K`` shape (no shared expert): closures calling
    ``kittenmoe.moe`` (the megakernel backend) on fresh bf16 inputs on ``device``, the forward under no_grad, the
    forward+backward through ``torch.autograd.grad`` to x, the routing weights and both expert weights.
    ``config``: the KernelConfig to pass (None: the public path's own choice)."""
    import kittenmoe
    from kittenmoe.config import ModelShape
    from kittenmoe.testing import make_weights, routing_uniform

    t, h, i, e, k = (int(v) for v in shape.split(","))
    g = torch.Generator().manual_seed(0)
    w = make_weights(ModelShape("p", e=e, h=h, i=i, k=k), dtype=torch.float32, generator=g, shared=False)
    w13, w2 = (p.to(device, torch.bfloat16).requires_grad_() for p in (w.w13_E2IH, w.w2_EHI))
    x = torch.randn(t, h, generator=g).to(device, torch.bfloat16).requires_grad_()
    ids, tw = routing_uniform(t, e, k, generator=g, device=device)
    tw = tw.float().requires_grad_()
    d_out = torch.randn(t, h, generator=g).to(device, torch.bfloat16)
    leaves = [x, tw, w13, w2]

    def forward():
        with torch.no_grad():
            return kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel", config=config)

    def forward_backward():
        out = kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel", config=config)
        return torch.autograd.grad(out, leaves, d_out)

    return forward, forward_backward, ids, e


def main() -> int:
    from fwd_round import forward_slice

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
    host_ms = calls_ms(fn, args.calls, hold_gpu=True)
    st = profile_calls(fn, args.calls)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    print(f"host time a forward call (no profiler, GPU not waited on): {host_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
