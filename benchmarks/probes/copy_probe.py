"""How fast do the megakernels' communication programs copy rows? A probe, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/probes/copy_probe.py [--shape kimi-k2.7] [--copy 32x512,32x1024,16x2048]
                                                    [--comm 8,12,16]

For each copy chunk (rows x columns per load; ``launch_common.COPY_ROWS`` x ``launch_common.COPY_BLOCK_H``) and each number of
communication programs: the forward's pull phase alone, the whole forward, the backward's pull phase alone
and the whole backward (R=1, the seed shape sliced to one EP8 rank). The pull alone gives the bytes per
second a communication SM sustains; if larger chunks raise it, fewer communication programs keep up and
the freed SMs do GEMM work. Prints one table row per (chunk, comm).
"""

from __future__ import annotations

import argparse

import torch
import triton

from kittenmoe import launch_common
from kittenmoe.config import KernelConfig, SEED_SHAPES, SLICE_TOKENS
from kittenmoe.kernels import megakernel_bwd as mb
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.testing import make_weights, routing_uniform

SLICES = SLICE_TOKENS  # kittenmoe.config: the seed slices' tokens at EP8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--copy", default="32x512,32x1024,16x2048")
    ap.add_argument("--comm", default="8,12,16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    base = SEED_SHAPES[args.shape]
    shape = base.with_(e=base.e // 8)
    T = SLICES[args.shape]
    g = torch.Generator().manual_seed(0)
    w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g)
    x = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
    d_out = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
    ids, wts = routing_uniform(T, shape.e, shape.k, generator=g, device=dev)
    peers = LocalPeers(1, dev)
    a = ([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
    # Bytes the pull moves (read + write): forward x rows; backward x and d_out rows. Routed rows = T*K.
    row_bytes = shape.h * 2
    fwd_pull_bytes = 2 * T * shape.k * row_bytes
    bwd_pull_bytes = 4 * T * shape.k * row_bytes
    print(f"{args.shape}: T {T} H {shape.h} I {shape.i} E_local {shape.e} K {shape.k}; pull bytes fwd "
          f"{fwd_pull_bytes / 1e6:.0f} MB, bwd {bwd_pull_bytes / 1e6:.0f} MB", flush=True)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=args.reps * 10, return_mode="median")

    rows = []
    for chunk in args.copy.split(","):
        r_, c_ = (int(v) for v in chunk.split("x"))
        launch_common.COPY_ROWS, launch_common.COPY_BLOCK_H = r_, c_
        for comm in (int(v) for v in args.comm.split(",")):
            cfg = KernelConfig(num_comm_programs_fwd=comm, num_comm_programs_bwd=comm)
            fp = bench(lambda: megakernel_forward_multirank(*a, config=cfg, peers=peers, phases=mk.PH_PULL))
            fa = bench(lambda: megakernel_forward_multirank(*a, config=cfg, peers=peers))
            bp = bench(lambda: megakernel_backward_multirank([d_out], *a, config=cfg, peers=peers,
                                                             phases=mb.PB_PULL))
            ba = bench(lambda: megakernel_backward_multirank([d_out], *a, config=cfg, peers=peers))
            row = (chunk, comm, fp, fwd_pull_bytes / fp / 1e6 / comm, fa, bp, bwd_pull_bytes / bp / 1e6 / comm, ba)
            rows.append(row)
            print("  %-8s comm %2d  fwd pull %.3f ms (%.0f GB/s/SM)  fwd %.3f ms  bwd pull %.3f ms (%.0f GB/s/SM)  "
                  "bwd %.3f ms" % row, flush=True)
    print("\nchunk    comm  fwd_pull_ms  GB/s/SM  fwd_ms  bwd_pull_ms  GB/s/SM  bwd_ms")
    for row in rows:
        print("%-8s %4d  %11.3f  %7.0f  %6.3f  %11.3f  %7.0f  %6.3f" % row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
