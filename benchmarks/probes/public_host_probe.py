"""Host time of the public path (``kittenmoe.moe`` under autograd), forward and forward+backward, beside its GPU time.

    PYTHONPATH=src python3 benchmarks/probes/public_host_probe.py [--shape 8192,2048,768,128,8] [--calls 30]

Asked because ``kittenmoe bench --baseline sonicmoe`` timed Qwen3-30B-A3B's layer (no shared expert) at 6.29 ms a
forward+backward through ``kittenmoe.moe`` where the same call's kernels take ~4.45 ms of GPU time
(``kernel_times.py``): a call whose host work outlasts its kernels leaves the GPU idle between them, and
``do_bench`` times that. For each mode this prints the host time a call (two calls at a time behind a sleep
kernel, so no call waits on the GPU: ``host_probe.calls_ms``), the wall time a call with the GPU free (what a
benchmark sees), and cProfile's heaviest functions (cumulative, then own time). On an H100 (torch 2.11, Triton
3.6) a forward took 2.2-3.1 ms of host time against ~1.4 ms of kernels and a forward+backward 4.9-6.8 against
~4.3: the public path is host-bound at these widths (docs/performance.md, "Against SonicMoE").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import kittenmoe
from kittenmoe.bench.timing import sync_warnings
from kittenmoe.config import ModelShape
from kittenmoe.testing import make_weights, routing_uniform

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_probe import calls_ms, profile_calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,2048,768,128,8", help="T,H,I,E,K (no shared expert)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    t, h, i, e, k = (int(v) for v in args.shape.split(","))
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    w = make_weights(ModelShape("p", e=e, h=h, i=i, k=k), dtype=torch.float32, generator=g, shared=False)
    w13, w2 = (p.to(dev, torch.bfloat16).requires_grad_() for p in (w.w13_E2IH, w.w2_EHI))
    x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16).requires_grad_()
    ids, tw = routing_uniform(t, e, k, generator=g, device=dev)
    tw = tw.float().requires_grad_()
    d_out = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    leaves = [x, tw, w13, w2]

    def forward():
        with torch.no_grad():
            return kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel")

    def forward_backward():
        out = kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel")
        return torch.autograd.grad(out, leaves, d_out)

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
        st.sort_stats("cumulative").print_stats(args.top)
        st.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
