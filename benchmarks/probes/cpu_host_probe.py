"""The public path's own host time on a CPU, without a GPU: ``kittenmoe.moe`` under autograd with every kernel's
body skipped.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/probes/cpu_host_probe.py [--shape 512,256,128,16,4]
        [--profile]

Asked because the public path is host-bound at Qwen3-30B-A3B's widths on the GPU (``public_host_probe.py``) and
GPU time is scarce: this measures the part of the host time that is the library's Python and torch ops, on any
machine, so a change to it can be judged before a GPU run.

How: under the Triton interpreter every launch goes through ``InterpretedFunction.run``; the probe makes it return
at once, so a launch costs only the launcher's work up to it. The schedule is built as on CUDA (the Triton
implementation, three launches) and then filled with the tables the real kernels compute for this routing, which
the probe computes once beforehand (one small copy a call more than the library does): launchers that read the
schedule on the host under the interpreter (the number of live minibatches) then see real values, not the
stubbed launches' uninitialised memory. What it leaves out is what only a GPU has: Triton's launch path
(argument specialisation, TMA descriptors, the driver), the Gluon kernels (the interpreter runs the Triton ones),
and CUDA's per-op cost. Prints, per mode, the fastest and median ms a call over blocks of 20 calls (the fastest
is the steadiest figure on a shared machine), and with ``--profile`` cProfile's heaviest functions.

On this repository's 2-core CPU machine at the default shape (fastest block, three runs each, the tree before
and after memoising the heuristic config, host integer helpers instead of Triton's constexpr functions, and two
small device-op cuts): forward 0.41 -> 0.34 ms, forward+backward 1.05-1.08 -> 0.93-1.00 ms. Under the
interpreter the forward launches one role a minibatch (the CPU config has several), which a GPU launch does not.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("cpu_host_probe: run with TRITON_INTERPRET=1 (the probe stubs the interpreter's launches)")

import torch
import triton.runtime.interpreter as interpreter

import kittenmoe
import kittenmoe.launch_backward as launch_backward
import kittenmoe.launch_common as launch_common
import kittenmoe.launch_forward as launch_forward
import kittenmoe.schedule as schedule
from kittenmoe.config import ModelShape
from kittenmoe.testing import make_weights, routing_uniform


def stub_kernels(ids_TK: torch.Tensor, experts: int) -> None:
    """Make every interpreter launch return at once, with the schedule (built as on CUDA) filled with the real
    tables for ``ids_TK``'s routing, and device error flags (stale memory) left unread."""
    real = {}
    build = schedule.build_schedule

    def build_as_on_cuda(ids_RTK, rank, experts_per_rank, block_m, impl=None):
        sched = build(ids_RTK, rank, experts_per_rank, block_m, impl="triton")
        key = (tuple(ids_RTK.shape), rank, experts_per_rank, block_m)
        if key not in real:
            raise AssertionError(f"cpu_host_probe: no real schedule for {key}; the probe computes one a shape")
        sched.table.copy_(real[key])
        return sched

    # one real build a block_m the launchers may ask for (forward and backward use the config's)
    ids_RTK = schedule.stack_ids([ids_TK])
    for bm in (16, 32, 64, 128):
        real[(tuple(ids_RTK.shape), 0, experts, bm)] = build(ids_RTK, 0, experts, bm, impl="triton").table.clone()
    interpreter.InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    launch_common.check_errors = lambda *flags_and_detail: None
    for module in (schedule, launch_forward, launch_backward):
        if hasattr(module, "build_schedule"):
            module.build_schedule = build_as_on_cuda


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="512,256,128,16,4", help="T,H,I,E,K (no shared expert)")
    ap.add_argument("--blocks", type=int, default=15, help="blocks of 20 calls a mode")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's heaviest functions")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    t, h, i, e, k = (int(v) for v in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    w = make_weights(ModelShape("p", e=e, h=h, i=i, k=k), dtype=torch.float32, generator=g, shared=False)
    w13, w2 = (p.to(torch.bfloat16).requires_grad_() for p in (w.w13_E2IH, w.w2_EHI))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).requires_grad_()
    ids, tw = routing_uniform(t, e, k, generator=g)
    tw = tw.float().requires_grad_()
    d_out = torch.randn(t, h, generator=g).to(torch.bfloat16)
    leaves = [x, tw, w13, w2]
    stub_kernels(ids, e)

    def forward():
        with torch.no_grad():
            return kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel")

    def forward_backward():
        out = kittenmoe.moe(x, ids, tw, w13, w2, backend="megakernel")
        return torch.autograd.grad(out, leaves, d_out)

    for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
        for _ in range(3):  # config lookups, workspaces, caches
            fn()
        blocks = []
        for _ in range(args.blocks):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            blocks.append((time.perf_counter() - t0) / 20)
        blocks.sort()
        print(f"==== {name} {args.shape}: {1e3 * blocks[0]:.3f} ms a call fastest block, "
              f"{1e3 * blocks[len(blocks) // 2]:.3f} median (kernels skipped)")
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                fn()
            pr.disable()
            st = pstats.Stats(pr)
            st.sort_stats("cumulative").print_stats(args.top)
            st.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
