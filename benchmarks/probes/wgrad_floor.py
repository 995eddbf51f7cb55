"""The Triton weight-gradient tile loop's floors, measured: what bounds d_W13 = d(gate|up)^T x per expert.

    PYTHONPATH=src python3 benchmarks/probes/wgrad_floor.py [--shapes kimi-k2.7,deepseek-v4-pro] [--reps 20]

The backward's d_W13 launch as one program per 128 x 256 output tile (64-row steps over the expert's ~384 padded
rows, 8 warps, 4 stages) ran at ~415 TFLOP/s on the Kimi slice against a dense matmul's ~795, and two programs an
SM did not move it (docs/experiments/two-wgrad-programs-per-sm.md). This times, on one expert layout like the slice's
(E_local experts of `rows` padded rows each), the library's Triton kernel and variants of the same tile loop, so
the launch's limiter shows as the variant that keeps its time:

  library      kittenmoe's weight_grad_persistent_kernel with its TMA store, as the backward launches it where
               the Gluon kernel does not run
  copy         this file's copy of the loop, one program a tile
  no store     the copy without its 64 KB store (skipped by a runtime flag)
  MMA only     one load of each operand, then the same number of wgmmas: the tensor-core floor
  store only   zeros stored per tile: the HBM write floor
  3 stages, WK 128 (2 stages): the copy at other pipeline depths and row steps
  persistent TMA st  one program an SM walking its tiles, each stored through a TMA bulk store that drains
               under the next tile's K loop (3 and 2 stages)
  TMA store    the copy storing its tile through shared memory and a TMA bulk store, at 3 and 4 stages (the
               sm_90 build reuses the pipeline's shared memory for it: 147,480 / 196,640 B), instead of
               256 threads' scattered stores

If "MMA only" is near "copy", the launch is tensor-core bound; if "no store" is well under it, the store is not
hidden; if neither, it waits on its operand loads (the L2 -> SM traffic below, or their latency).

H200, d_W13, ms (TFLOP/s), one program a tile: Kimi copy 2.437 (444), no store 1.870 (579), MMA only 2.242 (483),
store only 0.624 (4.52 TB/s); DeepSeek 2.888 (375), 2.037 (531), 2.884 (375), 0.936. So the 64 KB store of each
tile is a quarter to a third of the launch, and DeepSeek's tiles (four row steps) are bound by per-tile fixed
costs (fill, epilogue, store), not operand loads; persistent with the TMA store at 3 stages hid 0.17 / 0.12 ms of
the store. The warp-specialized Gluon kernel (kittenmoe/kernels/wgrad_gluon.py) then took the fill off each tile
too (docs/performance.md, "Backward: phase A, phase B, weight gradients").

Needs a Hopper GPU (TMA descriptors). Prints one table a slice: ms, TFLOP/s of the tile work, operand bytes
read into SMs and stored bytes, and each as a rate.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS as SLICES
from kittenmoe.kernels import megakernel_bwd as mb
# label: (MODE, WK, num_stages). A loads-only variant is left out: without a dot consuming them Triton 3.6 does not
# pipeline the loads (49 KB of shared memory against 196 KB), so it would time load latency, not L2 bandwidth.
VARIANTS = {"copy": (0, 64, 4), "no store": (1, 64, 4), "MMA only": (3, 64, 4), "store only": (4, 64, 4),
            "3 stages": (0, 64, 3), "WK 128, 2 st": (0, 128, 2),
            "TMA store, 3 st": (5, 64, 3), "TMA store, 4 st": (5, 64, 4),  # 5 stages: 245,800 B, over the 232,448
            # one program an SM walking tiles pid, pid + 132, ...; Triton 3.6 hoists the 64 KB store buffer out of
            # the tile loop and waits for the last tile's TMA store only before refilling it, so a tile's store
            # drains under the next tile's K loop (213,016 B at 3 stages; 2 stages 164 KB)
            "persistent TMA st, 3": (6, 64, 3), "persistent TMA st, 2": (6, 64, 2)}


@triton.jit
def wgrad_variant_kernel(
    order_ptr,  # [G] int32, the groups in the order tiles are taken (identity here)
    offsets_ptr,  # [G + 1] int32, each expert's row segment
    counts_ptr,  # [G] int32, the rows of each group (here the segment's length: every row real)
    p_desc,  # [rows, N] TMA descriptor, blocks [WK, WN]
    q_desc,  # [rows, M] TMA descriptor, blocks [WK, WM]
    out_ptr,  # [G, N, M]
    out_desc,  # [G * N, M] TMA descriptor, blocks [WN, WM] (MODE 5: the store through shared memory and TMA)
    N, M, do_store,
    WN: tl.constexpr, WM: tl.constexpr, WK: tl.constexpr, MODE: tl.constexpr,
):
    # the library's tile mapping
    g, n0, m0, seg0, seg1 = mb._wgrad_tile_at(tl.program_id(0), order_ptr, offsets_ptr, counts_ptr, N, M, WN, WM, WK)
    acc = tl.zeros((WN, WM), dtype=tl.float32)
    if MODE == 3:
        p = p_desc.load([seg0, n0])
        qq = q_desc.load([seg0, m0])
        for r0 in range(seg0, seg1, WK):
            acc = tl.dot(p.T, qq, acc)
    elif MODE == 0 or MODE == 1 or MODE == 5:
        for r0 in range(seg0, seg1, WK):
            p = p_desc.load([r0, n0])
            qq = q_desc.load([r0, m0])
            acc = tl.dot(p.T, qq, acc)
    if MODE == 5:  # N is a multiple of WN here, so a tile never crosses into the next expert's rows
        out_desc.store([g * N + n0, m0], acc.to(out_desc.dtype))
    elif MODE != 1 or do_store != 0:
        ra = n0 + tl.arange(0, WN)
        rb = m0 + tl.arange(0, WM)
        out = out_ptr + g.to(tl.int64) * N * M
        tl.store(out + ra[:, None].to(tl.int64) * M + rb[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(ra < N)[:, None] & (rb < M)[None, :])


@triton.jit
def wgrad_persistent_store_kernel(
    order_ptr,  # [G] int32, the groups in the order tiles are taken (identity here)
    offsets_ptr,  # [G + 1] int32, each expert's row segment
    counts_ptr,  # [G] int32, the rows of each group
    p_desc,  # [rows, N] TMA descriptor, blocks [WK, WN]
    q_desc,  # [rows, M] TMA descriptor, blocks [WK, WM]
    out_desc,  # [G * N, M] TMA descriptor, blocks [WN, WM]
    N, M, tiles,
    WN: tl.constexpr, WM: tl.constexpr, WK: tl.constexpr,
):
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        g, n0, m0, seg0, seg1 = mb._wgrad_tile_at(t, order_ptr, offsets_ptr, counts_ptr, N, M, WN, WM, WK)
        acc = tl.zeros((WN, WM), dtype=tl.float32)
        for r0 in range(seg0, seg1, WK):
            p = p_desc.load([r0, n0])
            qq = q_desc.load([r0, m0])
            acc = tl.dot(p.T, qq, acc)
        out_desc.store([g * N + n0, m0], acc.to(out_desc.dtype))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,deepseek-v4-pro")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--jobs", default="dw13", help="dw13 (N 2I x M H), dw2 (N H x M I), or both: dw13,dw2")
    ap.add_argument("--rows", type=int, default=0, help="padded rows an expert (0: T*K/E_local up to 128s)")
    args = ap.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    dev = torch.device("cuda")
    WN, WM, WK = 128, 256, 64  # the default config's block_n, 2 block_n, min(block_k, block_m)
    for name, job in [(n, j) for n in args.shapes.split(",") for j in args.jobs.split(",")]:
        base = SEED_SHAPES[name]
        L = base.e // args.ep
        T = SLICES[name]
        rows = args.rows or triton.cdiv(T * base.k // L, 128) * 128
        N, M = (2 * base.i, base.h) if job == "dw13" else (base.h, base.i)
        g = torch.Generator(device=dev).manual_seed(0)
        p_op = torch.randn(L * rows, N, device=dev, generator=g).to(torch.bfloat16)
        q_op = torch.randn(L * rows, M, device=dev, generator=g).to(torch.bfloat16)
        offsets = (torch.arange(L + 1, device=dev, dtype=torch.int32) * rows)
        order = torch.arange(L, device=dev, dtype=torch.int32)  # equal groups: the schedule's order is this one
        counts = torch.full((L,), rows, device=dev, dtype=torch.int32)
        out = torch.empty(L, N, M, device=dev, dtype=torch.bfloat16)
        pd, qd = TD.from_tensor(p_op, [WK, WN]), TD.from_tensor(q_op, [WK, WM])
        tiles = L * triton.cdiv(N, WN) * triton.cdiv(M, WM)
        steps = rows // WK
        flop = 2.0 * L * rows * N * M
        read = tiles * steps * (WK * WN + WK * WM) * 2.0
        stored = float(L * N * M * 2)

        out_desc = TD.from_tensor(out.view(L * N, M), [WN, WM])
        sms = torch.cuda.get_device_properties(dev).multi_processor_count

        def lib():  # as launch_backward.launch_rank_backward launches it with the TMA store (3 stages beside its 64 KB buffer)
            mb.weight_grad_persistent_kernel[(min(tiles, sms),)](
                order, offsets, counts, pd, qd, out, out_desc, N, M, N, M, tiles, WN=WN, WM=WM, WK=WK,
                USE_TMA=True, TMA_STORE=True, DOT_FP32=False, PRECISION="tf32", num_warps=8, num_stages=3)

        ref = None
        times = {}
        descs = {wk: (TD.from_tensor(p_op, [wk, WN]), TD.from_tensor(q_op, [wk, WM])) for wk in (64, 128)}
        for label in ["library", *VARIANTS]:
            if label == "library":
                fn = lib
            else:
                mode, wk, st = VARIANTS[label]
                fn = (lambda st=st: wgrad_persistent_store_kernel[(min(tiles, sms),)](
                    order, offsets, counts, *descs[64], out_desc, N, M, tiles, WN=WN, WM=WM, WK=64, num_warps=8,
                    num_stages=st)) if mode == 6 else (lambda m=mode, wk=wk, st=st: wgrad_variant_kernel[(tiles,)](
                    order, offsets, counts, *descs[wk], out, out_desc, N, M, 0, WN=WN, WM=WM, WK=wk, MODE=m,
                    num_warps=8, num_stages=st))
            out.fill_(float("nan"))  # tiles this variant leaves unwritten show in its bit check
            fn()
            torch.cuda.synchronize()
            if label == "library":
                ref = out.clone()
            elif VARIANTS[label][0] in (0, 5, 6):  # the variants that compute the gradient: the library's bits?
                print(f"  {name} {label}: the output equals the library's bit for bit: {torch.equal(out, ref)}",
                      flush=True)
            times[label] = triton.testing.do_bench(fn, warmup=10, rep=args.reps * 10, return_mode="median")
        print(f"\n{name} {job}: {L} experts x {rows} rows, N {N} x M {M}; {tiles} tiles of {WN} x {WM}, "
              f"{steps} steps of {WK}; {flop / 1e12:.3f} TFLOP, {read / 1e9:.1f} GB operand reads, "
              f"{stored / 1e9:.2f} GB stored")
        print(f"{'variant':<20} {'ms':>8} {'TFLOP/s':>8} {'read TB/s':>10} {'store TB/s':>11}")
        for label, ms in times.items():
            print(f"{label:<20} {ms:8.3f} {flop / ms / 1e9:8.0f} {read / ms / 1e9:10.2f} {stored / ms / 1e9:11.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
