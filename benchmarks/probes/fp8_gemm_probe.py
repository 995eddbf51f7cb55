"""Can a Triton block-scaled e4m3 GEMM overlap its MMAs with the per-block promotion? A probe, not a benchmark
of record.

    PYTHONPATH=src python3 benchmarks/probes/fp8_gemm_probe.py [--m 4096 --n 4096 --k 7168] [--reps 10]
    PYTHONPATH=src python  benchmarks/probes/fp8_gemm_probe.py --ttgir     # no GPU: compile for sm_90, print the waits

The FP8 megakernels multiply e4m3 rows (1 x 128 scales) by e4m3 weights (128 x 128 scales) one 128-deep K
step at a time and add each step's fp32 product, times the two scales, into an fp32 accumulator (DeepSeek-V3's
promotion). On the H200 they run at about BF16's speed, not the ~1.6x of the e4m3 ceiling: in the sm_90 TTGIR
every step waits for its own wgmma (``warp_group_dot_wait {pendings = 0}``) before promoting, so no MMA runs
while the previous product is scaled. This probe times one dense GEMM C = A B^T with those scales in variants:

- ``promote``: as the megakernels do today;
- ``lagged``: step k's wgmma is issued before step k-1's product is promoted (one product kept a step);
- ``split``: the tile's N in two halves, two products a step, so one half's promotion can run under the
  other half's MMA;
- ``bf16``: the same tiles and loop on bf16 operands with the accumulator in the dot (the reference speed);

each with 4 or 8 warps and 1 or 2 programs per SM (two resident programs can hide one's promotion under the
other's MMAs, if registers and shared memory allow two). Offline (``--ttgir``):
``lagged`` and ``split`` still wait for every wgmma at once (``pendings = 0``); only the bf16 loop, whose
accumulator is the dot's, gets ``pendings = 1``. So the overlap has to come from occupancy or warp
specialisation, not from reordering the loop.

beside torch._scaled_mm (per-tensor scales, cuBLAS) and checks each against a float64 reference. Prints ms,
TFLOP/s and relative L1 per variant and tile.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
import triton.language as tl

MODES = {"promote": 0, "lagged": 1, "split": 2, "bf16": 3, "promote-ws": 4, "bf16-ws": 5}
# The -ws modes are modes 0 and 3 with the persistent tile loop warp-specialized (tl.range(warp_specialize=True),
# launched with 4 warps): Triton 3.6 builds that for sm_90 as a producer warp group and two consumer warp
# groups of 232 registers each, 384 threads, data-partitioned (offline TTGIR), so one consumer's
# promotion can run under the other's MMAs. On the H200 these modes hit an illegal memory access (Triton 3.6).
WS_MODES = {"promote-ws": "promote", "bf16-ws": "bf16"}


@triton.jit
def _fp8_gemm_kernel(
    a_desc,  # A [M, K] e4m3 (bf16 in mode 3), blocks [BM, SB]
    b_desc,  # B [N, K] e4m3 (bf16 in mode 3), blocks [BN, SB] (modes 0, 1, 3) or [BN // 2, SB] (mode 2)
    as_ptr,  # [M, K // SB] fp32 row-block scales of A
    bs_ptr,  # [N // SB, K // SB] fp32 block scales of B
    c_ptr,  # [M, N] fp32
    M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, MODE: tl.constexpr, WS: tl.constexpr,
):
    """Persistent over BM x BN tiles; every K step is one scale block (SB deep). M, N, K multiples of the tiles.
    The weight scale is looked up per column (column // SB), so a tile wider than SB is right too (one scale a
    tile gave rel L1 4.6e-2 at 64 x 256 on the H200)."""
    KB = K // SB
    n_tiles_n = N // BN
    for tile in tl.range(tl.program_id(0), (M // BM) * n_tiles_n, tl.num_programs(0), warp_specialize=WS):
        m0 = (tile // n_tiles_n) * BM
        n0 = (tile % n_tiles_n) * BN
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        c_lo = n0 + tl.arange(0, BN // 2)
        if MODE == 0:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, KB):
                a = a_desc.load([m0, kb * SB])
                b = b_desc.load([n0, kb * SB])
                s = tl.load(as_ptr + rows * KB + kb)[:, None] * tl.load(bs_ptr + (cols // SB) * KB + kb)[None, :]
                acc += tl.dot(a, b.T) * s
        elif MODE == 1:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            p_prev = tl.dot(a_desc.load([m0, 0]), b_desc.load([n0, 0]).T)
            s_prev = tl.load(as_ptr + rows * KB)[:, None] * tl.load(bs_ptr + (cols // SB) * KB)[None, :]
            for kb in range(1, KB):
                p = tl.dot(a_desc.load([m0, kb * SB]), b_desc.load([n0, kb * SB]).T)
                acc += p_prev * s_prev
                p_prev = p
                s_prev = tl.load(as_ptr + rows * KB + kb)[:, None] * tl.load(bs_ptr + (cols // SB) * KB + kb)[None, :]
            acc += p_prev * s_prev
        elif MODE == 2:
            acc_lo = tl.zeros((BM, BN // 2), dtype=tl.float32)
            acc_hi = tl.zeros((BM, BN // 2), dtype=tl.float32)
            for kb in range(0, KB):
                a = a_desc.load([m0, kb * SB])
                b_lo = b_desc.load([n0, kb * SB])
                b_hi = b_desc.load([n0 + BN // 2, kb * SB])
                sa = tl.load(as_ptr + rows * KB + kb)[:, None]
                p_lo = tl.dot(a, b_lo.T)
                p_hi = tl.dot(a, b_hi.T)
                acc_lo += p_lo * (sa * tl.load(bs_ptr + (c_lo // SB) * KB + kb)[None, :])
                acc_hi += p_hi * (sa * tl.load(bs_ptr + ((c_lo + BN // 2) // SB) * KB + kb)[None, :])
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, KB):
                acc = tl.dot(a_desc.load([m0, kb * SB]), b_desc.load([n0, kb * SB]).T, acc)
        if MODE == 2:
            tl.store(c_ptr + rows[:, None].to(tl.int64) * N + c_lo[None, :], acc_lo)
            tl.store(c_ptr + rows[:, None].to(tl.int64) * N + (c_lo + BN // 2)[None, :], acc_hi)
        else:
            tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc)


def _quantize(m: torch.Tensor, block_rows: int, sb: int = 128):
    """e4m3 of ``m`` [R, K] with one scale per block_rows x sb block (the library's rule), and the scales."""
    from kittenmoe.fp8 import FP8Config, quantize_activations, quantize_weights

    if block_rows == 1:
        return quantize_activations(m, FP8Config(sb))
    return quantize_weights(m, FP8Config(sb))


def _launch(mode, a, b, a_s, b_s, c, bm, bn, stages, warps, programs, sb=128):
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    bn_load = bn // 2 if mode == "split" else bn
    a_desc = TD.from_tensor(a, [bm, sb])
    b_desc = TD.from_tensor(b, [bn_load, sb])
    M, K = a.shape
    N = b.shape[0]
    ws = mode in WS_MODES
    return _fp8_gemm_kernel[(programs,)](a_desc, b_desc, a_s, b_s, c, M, N, K, BM=bm, BN=bn, SB=sb,
                                        MODE=MODES[WS_MODES.get(mode, mode)], WS=ws,
                                        num_warps=4 if ws else warps, num_stages=stages)


def ttgir_report(tiles) -> int:
    """Compile every variant for sm_90 without a GPU; print registers, spills and the wgmma waits' pendings."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    from sm90_build import compile_only_sm90

    M, N, K = 256, 256, 512
    for bm, bn in tiles:
        for mode in MODES:
            dt = torch.bfloat16 if mode.startswith("bf16") else torch.float8_e4m3fn
            a = torch.zeros(M, K).to(dt)
            b = torch.zeros(N, K).to(dt)
            with compile_only_sm90() as built:
                _launch(mode, a, b, torch.zeros(M, K // 128), torch.zeros(N // 128, K // 128),
                        torch.zeros(M, N), bm, bn, 3, 8, 132)
            ttgir = built[-1].kernel.asm["ttgir"]
            waits = re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", ttgir)
            ws = "ttg.warp_specialize" in ttgir
            print(f"{mode:<10} {bm}x{bn}: {built[-1].line()}  wgmma waits pendings={waits}  warp-specialized {ws}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--tiles", default="128x128,64x128,64x256")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--occupancy", default="1,2",
                    help="programs per SM: 2 lets one program's promotion run under another's MMAs (if both fit)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ttgir", action="store_true", help="compile for sm_90 only (no GPU) and print the waits")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    if args.ttgir:
        return ttgir_report(tiles)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    a32 = torch.randn(args.m, args.k, generator=g).to(dev)
    b32 = (torch.randn(args.n, args.k, generator=g) / 30).to(dev)
    a, a_s = _quantize(a32, 1)
    b, b_s = _quantize(b32, 128)
    kb = args.k // 128
    # The reference: the dequantised operands multiplied in float64 (what every fp8 variant should give up to
    # fp32 accumulation order).
    ref = (a.double() * a_s.double().repeat_interleave(128, 1)) @ (
        b.double() * b_s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)).T
    ab, bb = a32.bfloat16(), b32.bfloat16()
    ones_a = torch.ones(args.m, kb, device=dev)
    ones_b = torch.ones(args.n // 128, kb, device=dev)
    flop = 2 * args.m * args.n * args.k
    progs = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    one = torch.ones((), device=dev)
    ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                 warmup=20, rep=args.reps * 10, return_mode="median")
    rows.append(("torch._scaled_mm", "-", "-", ms, flop / ms / 1e9, float("nan")))
    ms = triton.testing.do_bench(lambda: ab @ bb.T, warmup=20, rep=args.reps * 10, return_mode="median")
    rows.append(("torch bf16 matmul", "-", "-", ms, flop / ms / 1e9, float("nan")))
    combos = [(bm, bn, st, w, oc) for bm, bn in tiles for st in (int(v) for v in args.stages.split(","))
              for w in (int(v) for v in args.warps.split(",")) for oc in (int(v) for v in args.occupancy.split(","))]
    ws_ = [int(v) for v in args.warps.split(",")]
    for bm, bn, stages, warps, occ in combos:
        if True:
            for mode in MODES:
                if mode in WS_MODES and (warps != max(ws_) or occ != 1):
                    continue  # the -ws modes launch 4 warps whatever --warps says (the pass adds its groups): once
                c = torch.full((args.m, args.n), float("nan"), device=dev)
                opnds = (ab, bb, ones_a, ones_b) if mode.startswith("bf16") else (a, b, a_s, b_s)
                try:
                    _launch(mode, *opnds, c, bm, bn, stages, warps, progs * occ)
                except Exception as exc:  # e.g. out of shared memory for this tile and stage count
                    rows.append((mode, f"{bm}x{bn}", f"{stages}/{warps}/{occ}", float("nan"), float("nan"),
                                 float("nan")))
                    print(f"  {mode} {bm}x{bn} s{stages} w{warps} x{occ}: {type(exc).__name__}: {str(exc)[:100]}",
                          flush=True)
                    continue
                want = (ab.double() @ bb.double().T) if mode.startswith("bf16") else ref
                err = ((c.double() - want).abs().sum() / want.abs().sum()).item()
                ms = triton.testing.do_bench(lambda: _launch(mode, *opnds, c, bm, bn, stages, warps, progs * occ),
                                             warmup=10, rep=args.reps * 10, return_mode="median")
                rows.append((mode, f"{bm}x{bn}", f"{stages}/{warps}/{occ}", ms, flop / ms / 1e9, err))
                print("  %-18s %-8s %s  %.3f ms  %5.0f TF/s  rel L1 %.1e" % rows[-1], flush=True)
    print(f"\nM {args.m} N {args.n} K {args.k}, 128-blocks; {torch.cuda.get_device_name()}")
    print("variant            tile     st/w/occ     ms   TF/s  rel L1")
    for r in rows:
        print("%-18s %-8s %8s %6.3f %6.0f  %.1e" % r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
