"""The public path's own host time on a CPU, without a GPU: ``kittenmoe.moe`` under autograd with every kernel's
body skipped.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/probes/cpu_host_probe.py [--shape 512,256,128,16,4]
        [--profile]

Asked because the public path is host-bound at Qwen3-30B-A3B's widths on the GPU (``public_host_probe.py``) and
GPU time is scarce: this measures the part of the host time that is the library's Python and torch ops, on any
machine, so a change to it can be judged before a GPU run.

How: under the Triton interpreter every launch goes through ``InterpretedFunction.run``; the probe makes it return
at once, so a launch costs only the launcher's work up to it. The schedule is built as on CUDA (the Triton
implementation, three launches) and then filled with the real tables for this routing, which the real kernels
compute on its first build (one small copy a call more than the library does): launchers that read the
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
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("cpu_host_probe: run with TRITON_INTERPRET=1 (the probe stubs the interpreter's launches)")

import torch
import triton.runtime.interpreter as interpreter

import kittenmoe.launch_backward as launch_backward
import kittenmoe.launch_common as launch_common
import kittenmoe.launch_forward as launch_forward
import kittenmoe.schedule as schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_probe import public_path_calls


def stub_kernels() -> None:
    """Make every interpreter launch return at once, with the schedule (built as on CUDA) filled with the real
    tables for the probe's one routing (the real kernels compute them on the first build), and device error
    flags (stale memory) left unread."""
    real = {}
    build = schedule.build_schedule
    run = interpreter.InterpretedFunction.run

    def skip(self, *args, grid, warmup, **kwargs):
        return None

    def build_as_on_cuda(ids_RTK, rank, experts_per_rank, block_m, impl=None):
        sched = build(ids_RTK, rank, experts_per_rank, block_m, impl="triton")
        key = (tuple(ids_RTK.shape), rank, experts_per_rank, block_m)  # (the probe runs one routing)
        if key not in real:  # the real kernels, once
            interpreter.InterpretedFunction.run = run
            try:
                real[key] = build(ids_RTK, rank, experts_per_rank, block_m, impl="triton").table.clone()
            finally:
                interpreter.InterpretedFunction.run = skip
        sched.table.copy_(real[key])
        return sched

    interpreter.InterpretedFunction.run = skip
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
    forward, forward_backward, _, _ = public_path_calls(args.shape, torch.device("cpu"))
    stub_kernels()

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
