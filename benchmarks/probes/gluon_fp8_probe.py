"""Can Gluon, the lower-level language inside the device's Triton 3.6, hide the FP8 GEMM's per-block promotion?
A probe, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/probes/gluon_fp8_probe.py [--m 4096 --n 4096 --k 7168] [--reps 10]
    PYTHONPATH=.triton-device:src python benchmarks/probes/gluon_fp8_probe.py --build   # no GPU: sm_90 build, SASS waits

Why: the FP8 megakernels multiply 1 x 128-scaled e4m3 rows by 128 x 128-scaled e4m3 weights one 128-deep K step
at a time and add each step's fp32 product, times its two scales, into an fp32 accumulator. In Triton's
``tl.dot`` every such step waits for its own wgmma before the promotion (``probes/fp8_gemm_probe.py``: TTGIR
``pendings = 0`` in every loop order), so no MMA runs while a product is scaled, and the e4m3 tiles reach
1.03-1.07x the BF16 rate instead of the ~1.7x of the ceilings. Gluon exposes the wgmma wait itself
(``warpgroup_mma_wait(num_outstanding=1)``): step k's wgmma can be issued before step k-1's product is promoted,
which is the overlap the megakernels lack.

The kernel: C = A B^T (A [M, K], B [N, K]), 128 x 128 tiles of 8 warps (two warp groups of 64 rows), one
program a tile in grouped order, a STAGES-deep TMA ring of 128-deep K steps with one mbarrier a stage. Modes:

- ``lag``: e4m3, step k's wgmma issued into a second product before step k-1's is waited on and promoted
  (two products and the accumulator live: 3 x 64 fp32 registers a thread);
- ``nolag``: e4m3, each step waited on before its promotion (what ``tl.dot`` builds);
- ``bf16``: bf16 operands, 64-deep steps, the accumulator in the wgmma (no promotion), one wgmma in flight;
- ``chunkN`` (also ``pair``, ``quad``): ``lag`` within chunks of N steps, drained at each chunk's end;
- ``wsN``: ``chunkN`` split over warp-specialized partitions (a producer warp for the TMA ring, two 4-warp math
  groups of 64 rows that give each stage back on their own), DeepGEMM's form.

``--experts E`` makes it a grouped GEMM: B is [E * N, K] and expert e's rows multiply its N rows of B.

Beside them in the same run: the library-style Triton loop (``probes/fp8_gemm_probe.py``'s ``promote`` and ``bf16``,
128 x 128, 3 stages, 8 warps, persistent), ``torch._scaled_mm`` (cuBLAS, per-tensor scales) and the bf16
matmul, each checked against a float64 reference of the dequantised operands.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

MODES = {"lag": 0, "nolag": 1, "bf16": 2, "pair": 3, "quad": 4, "chunk": 5, "ws": 6}


@gluon.jit
def _load_step(a_desc, b_desc, a_s, b_s, bars, step, off_m, off_n, STAGES: gl.constexpr, pred=True):
    """TMA loads of K step ``step`` into ring stage step % STAGES, completing on that stage's barrier (none
    where ``pred`` is false: a predicate, not a branch, so no control flow sits between a wgmma and its
    wait)."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    st = step % STAGES
    mbarrier.expect(bars.index(st), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, step * BK], bars.index(st), a_s.index(st), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, step * BK], bars.index(st), b_s.index(st), pred=pred)


@gluon.jit
def _tile_of(M, N, MPE, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, EXPERTS: gl.constexpr):
    """This program's tile: (A's first row, B's first row, the weight scales' block row). Grouped order: GROUP_M
    row tiles share each column tile's B steps in L2. With several experts (the megakernels' grouped GEMM: each
    expert's rows against its own weights) the programs walk one expert's tiles after another, and within it
    GROUP_M row tiles together; C's column is then B's row less expert * N. One expert builds the plain GEMM's
    code (a scalar more live across the K loop costs chunk8 an 8-byte stack at 255 registers)."""
    pid = gl.program_id(0)
    n_m = MPE // BM
    n_n = N // BN
    if EXPERTS > 1:
        pid = pid % (n_m * n_n)
    width = GROUP_M * n_n
    first_m = (pid // width) * GROUP_M
    gsz = gl.minimum(n_m - first_m, GROUP_M)
    pm = first_m + (pid % width) % gsz
    pn = (pid % width) // gsz
    off_m = pm * BM
    off_n = pn * BN
    if EXPERTS > 1:
        expert = gl.program_id(0) // (n_m * n_n)
        off_m += expert * MPE
        off_n += expert * N
        pn += expert * n_n
    return off_m, off_n, pn


@gluon.jit
def _c_column(off_n, N, MPE, BM: gl.constexpr, BN: gl.constexpr, EXPERTS: gl.constexpr):
    """C's first column for B's first row ``off_n`` (recomputed after the K loop rather than kept live)."""
    if EXPERTS > 1:
        off_n -= gl.program_id(0) // ((MPE // BM) * (N // BN)) * N
    return off_n


@gluon.jit
def _gluon_gemm_kernel(
    a_desc,  # A [M, K] e4m3 (bf16 in mode bf16), blocks [BM, BK]
    b_desc,  # B [N, K] e4m3 (bf16 in mode bf16), blocks [BN, BK]
    as_ptr,  # [M, K // BK] fp32 row-block scales of A (fp8 modes)
    bs_ptr,  # [N // BK, K // BK] fp32 block scales of B (fp8 modes; BN == BK, so one a tile and step)
    c_desc,  # C [M, N] fp32, blocks [BM, BN]
    M, N, K,
    MPE,  # rows per expert (--experts): expert e's rows e*MPE.. multiply B's rows e*N..; M with one expert
    STAGES: gl.constexpr, MODE: gl.constexpr, GROUP_M: gl.constexpr, KSC: gl.constexpr, EXPERTS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    KS = K // BK
    off_m, off_n, pn = _tile_of(M, N, MPE, BM, BN, GROUP_M, EXPERTS)

    # 8 warps along M: warp w holds rows 16w..16w+15, so warps 0-3 and 4-7 are two warp groups of 64 rows,
    # each issuing m64nBNk(32 for e4m3, 16 for bf16) wgmmas.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 256 // a_desc.dtype.primitive_bitwidth])
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    # Every stage filled first; step j's stage is refilled with step j + STAGES once step j's wgmma is done.
    # (The first device run loaded STAGES - 1 here and never loaded step STAGES - 1: every mode hung.)
    for i in gl.static_range(STAGES):  # the host asserts K // BK >= STAGES
        _load_step(a_desc, b_desc, a_s, b_s, bars, i, off_m, off_n, STAGES)

    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    if MODE == 2:  # bf16: the accumulator in the wgmma, one in flight
        for k in range(KS):
            st = k % STAGES
            mbarrier.wait(bars.index(st), (k // STAGES) & 1)
            acc = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), acc, is_async=True)
            # At most this step's wgmma in flight: step k-1's stage is free for step k - 1 + STAGES.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if (k >= 1) & (k - 1 + STAGES < KS):
                _load_step(a_desc, b_desc, a_s, b_s, bars, k - 1 + STAGES, off_m, off_n, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    elif MODE == 1:  # e4m3, each step's product waited on, then promoted
        for k in range(KS):
            st = k % STAGES
            sa = gl.load(as_ptr + rows * KS + k)
            sb = gl.load(bs_ptr + pn * KS + k)
            mbarrier.wait(bars.index(st), (k // STAGES) & 1)
            p = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), acc, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
            if k - 1 + STAGES < KS:  # stage (k - 1) % STAGES was read by step k - 1, done
                if k >= 1:
                    _load_step(a_desc, b_desc, a_s, b_s, bars, k - 1 + STAGES, off_m, off_n, STAGES)
            acc = acc + p * (sa * sb)[:, None]
    elif MODE == 0:  # e4m3, lagged: step k's wgmma runs while step k-1's product is promoted
        # Two products, p0 for even steps and p1 for odd ones, each wgmma written in place over its own
        # product's registers (use_acc=False zeroes it): a loop-carried copy of an in-flight product would
        # make ptxas serialize every wgmma (C7514). Unrolled by two so the roles never swap; K // 128 even.
        p0 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        p1 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        mbarrier.wait(bars.index(0), 0)
        p0 = warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), p0, use_acc=False, is_async=True)
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))  # no wait: a tensor, as at the loop's back edge
        for k in range(1, KS - 1, 2):
            st = k % STAGES
            sa = gl.load(as_ptr + rows * KS + (k - 1))
            sb = gl.load(bs_ptr + pn * KS + (k - 1))
            mbarrier.wait(bars.index(st), (k // STAGES) & 1)
            p1 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p1, use_acc=False, is_async=True)
            p0, p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, p1))
            # step k-1's stage is free once its wgmma is done
            _load_step(a_desc, b_desc, a_s, b_s, bars, k - 1 + STAGES, off_m, off_n, STAGES, k - 1 + STAGES < KS)
            acc = acc + p0 * (sa * sb)[:, None]
            # A no-op wait (one group in flight) through which p0 and acc pass: the promotion above has to land
            # before the next wgmma writes over p0, so p0's registers are reused in place (else LLVM sinks
            # the promotion, copies p0, and the loop's back edge copies an in-flight product: C7514)
            p0, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p0, acc))
            st = (k + 1) % STAGES
            sa = gl.load(as_ptr + rows * KS + k)
            sb = gl.load(bs_ptr + pn * KS + k)
            mbarrier.wait(bars.index(st), ((k + 1) // STAGES) & 1)
            p0 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p0, use_acc=False, is_async=True)
            p1, p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p1, p0))
            _load_step(a_desc, b_desc, a_s, b_s, bars, k + STAGES, off_m, off_n, STAGES, k + STAGES < KS)
            acc = acc + p1 * (sa * sb)[:, None]
            p1, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p1, acc))
        st = (KS - 1) % STAGES  # the last (odd) step
        sa = gl.load(as_ptr + rows * KS + (KS - 2))
        sb = gl.load(bs_ptr + pn * KS + (KS - 2))
        mbarrier.wait(bars.index(st), ((KS - 1) // STAGES) & 1)
        p1 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p1, use_acc=False, is_async=True)
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
        acc = acc + p0 * (sa * sb)[:, None]
        sa = gl.load(as_ptr + rows * KS + (KS - 1))
        sb = gl.load(bs_ptr + pn * KS + (KS - 1))
        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
        acc = acc + p1 * (sa * sb)[:, None]
    if MODE == 5:  # e4m3, "lag" within chunks of KSC steps (unrolled), drained between chunks (no loop-carried
        # product: a copy of an in-flight one serializes every wgmma, C7514)
        for k0 in range(0, KS, KSC):
            p0 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            p1 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            mbarrier.wait(bars.index(k0 % STAGES), (k0 // STAGES) & 1)
            p0 = warpgroup_mma(a_s.index(k0 % STAGES), b_s.index(k0 % STAGES).permute((1, 0)), p0, use_acc=False,
                               is_async=True)
            for j in gl.static_range(1, KSC + 1):
                k = k0 + j
                sa = gl.load(as_ptr + rows * KS + (k - 1))
                sb = gl.load(bs_ptr + pn * KS + (k - 1))
                if j < KSC:
                    st = k % STAGES
                    mbarrier.wait(bars.index(st), (k // STAGES) & 1)
                    if j % 2 == 1:
                        p1 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p1, use_acc=False,
                                           is_async=True)
                        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                    else:
                        p0 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p0, use_acc=False,
                                           is_async=True)
                        p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
                else:
                    if j % 2 == 1:
                        p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
                    else:
                        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                _load_step(a_desc, b_desc, a_s, b_s, bars, k - 1 + STAGES, off_m, off_n, STAGES, k - 1 + STAGES < KS)
                # Each promotion then passes its product and acc through a no-op wait (one group in flight): it
                # lands before the next wgmma writes over that product, whose registers are reused in place
                # (else LLVM sinks it past the wgmma and four products are live: 255 registers and a stack).
                if j % 2 == 1:
                    acc = acc + p0 * (sa * sb)[:, None]
                    if j < KSC:
                        p0, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p0, acc))
                else:
                    acc = acc + p1 * (sa * sb)[:, None]
                    if j < KSC:
                        p1, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p1, acc))
    if (MODE == 3) | (MODE == 4):  # e4m3, G = 2 (pair) or 4 (quad) steps an iteration, nothing in flight across iterations
        G: gl.constexpr = 2 if MODE == 3 else 4
        for k0 in range(0, KS, G):
            p0 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            p1 = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            mbarrier.wait(bars.index(k0 % STAGES), (k0 // STAGES) & 1)
            p0 = warpgroup_mma(a_s.index(k0 % STAGES), b_s.index(k0 % STAGES).permute((1, 0)), p0, use_acc=False,
                               is_async=True)
            for j in gl.static_range(G):
                k = k0 + j
                sa = gl.load(as_ptr + rows * KS + k)
                sb = gl.load(bs_ptr + pn * KS + k)
                if j + 1 < G:  # issue step k+1 into the other product before promoting step k
                    st = (k + 1) % STAGES
                    mbarrier.wait(bars.index(st), ((k + 1) // STAGES) & 1)
                    if j % 2 == 0:
                        p1 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p1, use_acc=False,
                                           is_async=True)
                        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                    else:
                        p0 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p0, use_acc=False,
                                           is_async=True)
                        p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
                else:
                    if j % 2 == 0:
                        p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
                    else:
                        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                _load_step(a_desc, b_desc, a_s, b_s, bars, k + STAGES, off_m, off_n, STAGES, k + STAGES < KS)
                if j % 2 == 0:
                    acc = acc + p0 * (sa * sb)[:, None]
                else:
                    acc = acc + p1 * (sa * sb)[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    c_s = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_s.store(acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, _c_column(off_n, N, MPE, BM, BN, EXPERTS)], c_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_consume(a_s, b_s, ready, empty, as_ptr, bs_row, c_desc, c_s, row0, c_col, KS, STAGES: gl.constexpr,
                KSC: gl.constexpr):
    """One math warp group of the ``ws`` mode: 64 rows x BN of the tile, the chunk loop's promotion order (step
    k's wgmma issued before step k-1's product is waited on and promoted, chunks of KSC steps drained at their
    end), each stage given back to the producer (``empty``) as soon as this group's wgmma that read it is done.
    The two math groups wait on no barrier but the ring's: while one promotes, the other's wgmmas can run."""
    HM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows = row0 + gl.arange(0, HM, layout=gl.SliceLayout(1, layout))
    acc = gl.zeros((HM, BN), dtype=gl.float32, layout=layout)
    for k0 in range(0, KS, KSC):
        p0 = gl.zeros((HM, BN), dtype=gl.float32, layout=layout)
        p1 = gl.zeros((HM, BN), dtype=gl.float32, layout=layout)
        mbarrier.wait(ready.index(k0 % STAGES), (k0 // STAGES) & 1)
        p0 = warpgroup_mma(a_s.index(k0 % STAGES), b_s.index(k0 % STAGES).permute((1, 0)), p0, use_acc=False,
                           is_async=True)
        for j in gl.static_range(1, KSC + 1):
            k = k0 + j
            sa = gl.load(as_ptr + rows * KS + (k - 1))
            sb = gl.load(bs_row + (k - 1))
            if j < KSC:
                st = k % STAGES
                mbarrier.wait(ready.index(st), (k // STAGES) & 1)
                if j % 2 == 1:
                    p1 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p1, use_acc=False,
                                       is_async=True)
                    p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                else:
                    p0 = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), p0, use_acc=False,
                                       is_async=True)
                    p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
            else:
                if j % 2 == 1:
                    p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
                else:
                    p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
            mbarrier.arrive(empty.index((k - 1) % STAGES), count=1)  # one thread of the group: count 2 a stage
            if j % 2 == 1:
                acc = acc + p0 * (sa * sb)[:, None]
                if j < KSC:
                    p0, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p0, acc))
            else:
                acc = acc + p1 * (sa * sb)[:, None]
                if j < KSC:
                    p1, acc = warpgroup_mma_wait(num_outstanding=1, deps=(p1, acc))
    c_s.store(acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [row0, c_col], c_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_partition(ROLE: gl.constexpr, a_desc, b_desc, c_desc, a0_s, a1_s, b_s, c0_s, c1_s, ready, empty, as_ptr,
                  bs_row, off_m, off_n, c_col, KS, STAGES: gl.constexpr, KSC: gl.constexpr):
    """The ``ws`` mode's partitions, one function (Gluon wants the workers' signatures equal): ROLE 0 and 1 are
    the math warp groups of rows 0-63 and 64-127, ROLE 2 the producer warp that keeps the TMA ring full."""
    HM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if ROLE == 2:
        for k in range(KS):
            st = k % STAGES
            # a stage is free once both math groups arrived (barriers start as if phase 1 completed)
            mbarrier.wait(empty.index(st), ((k // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k * BK], ready.index(st), a0_s.index(st))
            tma.async_copy_global_to_shared(a_desc, [off_m + HM, k * BK], ready.index(st), a1_s.index(st))
            tma.async_copy_global_to_shared(b_desc, [off_n, k * BK], ready.index(st), b_s.index(st))
    elif ROLE == 0:
        _ws_consume(a0_s, b_s, ready, empty, as_ptr, bs_row, c_desc, c0_s, off_m, c_col, KS, STAGES, KSC)
    else:
        _ws_consume(a1_s, b_s, ready, empty, as_ptr, bs_row, c_desc, c1_s, off_m + HM, c_col, KS, STAGES, KSC)


@gluon.jit
def _gluon_ws_kernel(
    a_desc,  # A [M, K] e4m3, blocks [64, BK] (each math group loads its own half of the tile's rows)
    b_desc,  # B [N, K] e4m3, blocks [BN, BK]
    as_ptr,  # [M, K // BK] fp32 row-block scales of A
    bs_ptr,  # [N // BK, K // BK] fp32 block scales of B (BN == BK)
    c_desc,  # C [M, N] fp32, blocks [64, BN]
    M, N, K,
    MPE,  # rows per expert, as _gluon_gemm_kernel's
    STAGES: gl.constexpr, GROUP_M: gl.constexpr, KSC: gl.constexpr, EXPERTS: gl.constexpr,
):
    """Mode ``ws``: the chunk loop split over warp-specialized partitions (DeepGEMM's form): a producer warp
    issues the TMA ring (so no CTA-wide barrier precedes each refill, which in the other modes keeps the two warp
    groups in step) and two 4-warp math groups each run 64 rows. Launched with num_warps=4 (the default
    partition is math group 0)."""
    BM: gl.constexpr = 2 * c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    KS = K // BK
    off_m, off_n, pn = _tile_of(M, N, MPE, BM, BN, GROUP_M, EXPERTS)
    c_col = _c_column(off_n, N, MPE, BM, BN, EXPERTS)
    a0_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    a1_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c0_s = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c1_s = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    bs_row = bs_ptr + pn * KS
    gl.warp_specialize([
        (_ws_partition, (0, a_desc, b_desc, c_desc, a0_s, a1_s, b_s, c0_s, c1_s, ready, empty, as_ptr, bs_row, off_m,
                         off_n, c_col, KS, STAGES, KSC)),
        (_ws_partition, (1, a_desc, b_desc, c_desc, a0_s, a1_s, b_s, c0_s, c1_s, ready, empty, as_ptr, bs_row, off_m,
                         off_n, c_col, KS, STAGES, KSC)),
        (_ws_partition, (2, a_desc, b_desc, c_desc, a0_s, a1_s, b_s, c0_s, c1_s, ready, empty, as_ptr, bs_row, off_m,
                         off_n, c_col, KS, STAGES, KSC)),
    ], [4, 1], [232, 24])


def launch(mode: str, a, b, a_s, b_s, c, stages: int = 4, bm: int = 128, bn: int = 128, group_m: int = 8,
           chunk: int = 8, experts: int = 1):
    """One C = A B^T through the Gluon kernel. Operands as fp8_gemm_probe's: A [M, K], B [N, K] (e4m3 with
    1 x 128 / 128 x 128 scales, or bf16 for mode bf16), C [M, N] fp32. With ``experts`` E > 1, B is [E * N, K]
    and expert e's M / E rows multiply its N rows of B (a grouped GEMM with equal groups)."""
    bk = 64 if mode == "bf16" else 128
    M, K = a.shape
    N = c.shape[1]
    mpe = M // experts
    if (M % experts or mpe % bm or b.shape[0] != experts * N or N % bn or K % bk or K // bk < stages
            or (mode != "bf16" and bn != bk)
            or (mode in ("lag", "pair") and (K // bk) % 2) or (mode == "quad" and (K // bk) % 4)
            or (mode in ("chunk", "ws") and (K // bk) % chunk)):
        raise ValueError(f"gluon probe: M={M} (split evenly over {experts} experts, each a multiple of {bm}), "
                         f"N={N} and K={K} must be multiples of {bn} / {bk}; B must have experts * N rows; "
                         f"K // {bk} >= stages={stages}; BN == 128 for e4m3 (one weight scale a tile); K // 128 "
                         f"even for modes lag and pair, a multiple of 4 for quad and of the chunk for chunk / ws")
    gdt = gl.bfloat16 if mode == "bf16" else gl.float8e4nv
    if mode == "ws":  # each math group's 64 rows load and store on their own
        if bm != 128 or stages < 2:
            raise ValueError(f"gluon probe: mode ws runs two 64-row math groups (bm=128, got {bm}) over a ring of "
                             f"at least 2 stages (got {stages})")
        hm = bm // 2
        a_desc = TensorDescriptor.from_tensor(a, [hm, bk], gl.NVMMASharedLayout.get_default_for([hm, bk], gdt))
        b_desc = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gdt))
        c_desc = TensorDescriptor.from_tensor(c, [hm, bn],
                                              gl.NVMMASharedLayout.get_default_for([hm, bn], gl.float32))
        return _gluon_ws_kernel[((M // bm) * (N // bn),)](a_desc, b_desc, a_s, b_s, c_desc, M, N, K, mpe,
                                                          STAGES=stages, GROUP_M=group_m, KSC=chunk,
                                                          EXPERTS=experts, num_warps=4, maxnreg=168)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gdt))
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gl.float32))
    return _gluon_gemm_kernel[((M // bm) * (N // bn),)](a_desc, b_desc, a_s, b_s, c_desc, M, N, K, mpe,
                                                         STAGES=stages, EXPERTS=experts,
                                                         MODE=MODES[mode], GROUP_M=group_m,
                                                         KSC=chunk if mode == "chunk" else 0, num_warps=8)


def build_report(names: list[str], stages: int, k: int, as_json: bool = False) -> int:
    """Build each mode for sm_90 without a GPU (M = N = 256; K is the loop length that matters); print, or with
    ``as_json`` write one JSON line of, registers, stack, shared memory and the SASS wgmma waits by groups left
    in flight (``WARPGROUP.DEPBAR.LE gsb0, N``). When ptxas serializes the wgmmas (its C7511-C7514 notes) every
    wait leaves 0; an overlapped loop has waits that leave 1 (the no-op waits that order a promotion count too)."""
    import json

    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    from sm90_build import compile_only_sm90, sass

    M, N = 256, 256
    rows = []
    for name in names:
        mode, chunk = _mode_of(name, 4)
        dt = torch.bfloat16 if mode == "bf16" else torch.float8_e4m3fn
        a = torch.zeros(M, k).to(dt)
        b = torch.zeros(N, k).to(dt)
        with compile_only_sm90() as built:
            launch(mode, a, b, torch.zeros(M, k // 128), torch.zeros(N // 128, k // 128), torch.zeros(M, N), stages,
                   chunk=chunk)
        kb = built[-1]
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+|\d+)", sass(kb.kernel.asm["cubin"]))
        left = {int(w, 0): waits.count(w) for w in sorted(set(waits))}
        rows.append(dict(mode=name, regs=kb.regs, stack=kb.stack, shared=kb.shared, waits_by_groups_left=left))
        if not as_json:
            print(f"{name:<7} {kb.line()}  wgmma waits by groups left in flight {left}")
    if as_json:
        print(json.dumps(dict(triton=triton.__version__, k=k, stages=stages, builds=rows)))
    return 0


def _mode_of(name: str, default_chunk: int) -> tuple[str, int]:
    """``chunkN`` is mode chunk at N steps a chunk; any other name is its mode with ``default_chunk``."""
    if re.fullmatch(r"chunk\d+", name):
        return "chunk", int(name[5:])
    if re.fullmatch(r"ws\d+", name):  # the warp-specialized chunk loop at N steps a chunk
        return "ws", int(name[2:])
    if name not in MODES:
        raise ValueError(f"gluon probe: unknown mode {name!r}; modes: {sorted(MODES)}, chunkN or wsN")
    return name, default_chunk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096, help="rows (per expert with --experts)")
    ap.add_argument("--n", type=int, default=4096, help="columns (per expert with --experts)")
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=1,
                    help="E > 1: a grouped GEMM, each expert's --m rows against its own --n x --k weights "
                         "(the Kimi slice's gate|up: --experts 48 --m 384 --n 4096 --k 7168)")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--modes", default="nolag,pair,chunk4,chunk8,bf16",
                    help="comma-separated; chunkN is mode chunk at N steps a chunk, wsN mode ws likewise")
    ap.add_argument("--chunk", type=int, default=4, help="steps a chunk for a plain 'chunk'")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--build", action="store_true", help="build for sm_90 only (no GPU) and print the waits")
    ap.add_argument("--json", action="store_true", help="with --build: one JSON line (tests/test_sm90_build.py)")
    args = ap.parse_args()
    stage_list = [int(v) for v in args.stages.split(",")]
    if args.build:
        return build_report(args.modes.split(","), max(stage_list), args.k, args.json)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fp8_gemm_probe as tp  # the Triton loops and the quantiser, timed beside

    dev = torch.device("cuda")
    E, M, N, K = args.experts, args.m * args.experts, args.n, args.k
    g = torch.Generator().manual_seed(0)
    a32 = torch.randn(M, K, generator=g).to(dev)
    b32 = (torch.randn(E * N, K, generator=g) / 30).to(dev)
    a, a_s = tp._quantize(a32, 1)
    b, b_s = tp._quantize(b32, 128)
    ab, bb = a32.bfloat16(), b32.bfloat16()
    # float64 references, one expert at a time (the Kimi gate|up's dequantised B alone is 11 GB in float64)
    ref = torch.empty(M, N, dtype=torch.float64, device=dev)
    ref_bf16 = torch.empty_like(ref)
    for e in range(E):
        r, c_ = slice(e * args.m, (e + 1) * args.m), slice(e * N, (e + 1) * N)
        ref[r] = (a[r].double() * a_s[r].double().repeat_interleave(128, 1)) @ (
            b[c_].double() * b_s[e * N // 128:(e + 1) * N // 128].double().repeat_interleave(128, 0)
            .repeat_interleave(128, 1)).T
        ref_bf16[r] = ab[r].double() @ bb[c_].double().T
    kb = K // 128
    ones_a = torch.ones(M, kb, device=dev)
    ones_b = torch.ones(E * N // 128, kb, device=dev)
    flop = 2 * M * N * K
    progs = torch.cuda.get_device_properties(dev).multi_processor_count
    one = torch.ones((), device=dev)
    rows = []

    def timed(name, tile, fn, c=None, want=None):
        if c is not None:
            c.fill_(float("nan"))  # unwritten tiles show as NaN in the error
        try:
            fn()
        except Exception as exc:  # a variant that does not build or launch is reported, the others still run
            print(f"  {name} {tile}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append((name, tile, float("nan"), float("nan"), float("nan")))
            return
        torch.cuda.synchronize()
        err = float("nan") if c is None else ((c.double() - want).abs().sum() / want.abs().sum()).item()
        ms = triton.testing.do_bench(fn, warmup=20, rep=args.reps * 10, return_mode="median")
        rows.append((name, tile, ms, flop / ms / 1e9, err))
        print("  %-22s %-10s %.3f ms  %5.0f TF/s  rel L1 %.1e" % rows[-1], flush=True)

    c = torch.empty(M, N, device=dev)
    if E == 1:
        timed("torch._scaled_mm", "-", lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16))
        timed("torch bf16 matmul", "-", lambda: ab @ bb.T)
        for mode in ("promote", "bf16"):
            opnds = (ab, bb, ones_a, ones_b) if mode == "bf16" else (a, b, a_s, b_s)
            timed(f"triton {mode}", "128x128 s3", lambda: tp._launch(mode, *opnds, c, 128, 128, 3, 8, progs), c,
                  ref_bf16 if mode == "bf16" else ref)
    else:  # the baseline's grouped bf16 GEMM (cuBLAS / cutlass through torch), same groups
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * args.m
        bb3 = bb.view(E, N, K)
        timed("torch._grouped_mm bf16", "-", lambda: torch._grouped_mm(ab, bb3.transpose(1, 2), offs=offs))
    for stages in stage_list:
        for name in args.modes.split(","):
            mode, chunk = _mode_of(name, args.chunk)
            opnds = (ab, bb, ones_a, ones_b) if mode == "bf16" else (a, b, a_s, b_s)
            timed(f"gluon {name}", f"128x128 s{stages}",
                  lambda: launch(mode, *opnds, c, stages, chunk=chunk, experts=E), c,
                  ref_bf16 if mode == "bf16" else ref)
    print(f"\nE {E} x (M {args.m} N {N}) K {K}, 128-blocks; {torch.cuda.get_device_name()}, "
          f"triton {triton.__version__}")
    print("variant                tile           ms   TF/s  rel L1")
    for r in rows:
        print("%-22s %-10s %7.3f %6.0f  %.1e" % r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
