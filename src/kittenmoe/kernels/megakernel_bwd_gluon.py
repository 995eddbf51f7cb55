"""The backward megakernel on Hopper in Gluon (``KernelConfig.backward_kernel="gluon"``): one rank, kept activations.

The same schedule, tile sequence, counters and bits as ``megakernel_bwd.combine_mlp_swiglu_dispatch_bwd_kernel`` run
as the one-rank default runs it (no communication programs, ``combine_gather``, every routed row's gate|up kept by
the forward, 128 x 128 x 64 tiles, no shared expert): rounds of [phase A of minibatch p, phase B of minibatch
p - 1] walked round-robin, where

- phase A (d_out rows x W2[e], K over H) is a 128 x 128 tile of d_hidden whose epilogue is the SwiGLU backward:
  g and u as the forward kept them (x's dtype), d(gate|up) and w * h out as bf16 rows, the router-weight gradient's
  partial sums one per 64 columns, each 64-column half exactly as the Triton kernel's kept tile computes it;
- phase B (d(gate|up) rows x W13[e], K over 2I) is a 128 x 256 tile of the routed d_x rows, stored through
  shared memory and TMA.

What differs is who waits, as in ``megakernel_fwd_gluon``: a 4-warp producer walks the program's tiles ahead of the
math, keeps a 3-stage ring of [A rows, two weight tiles] full across tile boundaries, and gathers each phase-A
tile's d_out rows straight from d_out (row t of route t*K + j, padding rows zero) by cp.async, so no pull runs
first; the first column tile of each row tile also leaves its gathered rows in ``dor`` (TMA stores), where the
weight gradients read them. Before a phase-B tile it polls ``a_ready`` of the tile's minibatch. Two 4-warp math
groups own 64 of a tile's 128 rows each. The weights are read as they are stored (W2 [H, I], W13 [2I, H]): the K
dimension of both GEMMs is the weights' row dimension, so B is N-major in shared memory, which wgmma takes for
2-byte operands.

A phase-A tile's SwiGLU backward runs in a fourth partition (4 warps), not in the math groups: each group hands
its fp32 accumulator over through shared memory (32 KB a group, two 64-column halves) and goes on to its next
tile's K loop, so the epilogue (on the Triton kernel's trace at Qwen3-30B-A3B's widths ~12 us a tile against ~16
us of K loop, with no wgmma in flight) runs under the next tiles' wgmmas. The same 32 KB hold the group's phase-B
d_x halves on their way to TMA. A fourth ring stage does not fit beside them.

Gluon kernels do not run under the Triton interpreter; the CPU suite runs the Triton kernel, and the GPU tests
hold this one to its bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

from kittenmoe.kernels.gluon_api import barrier, tma_load, tma_store, cp_async_load, reinterpret
from kittenmoe.kernels.megakernel_fwd import _tile_rc
from kittenmoe.kernels.megakernel_fwd_gluon import (BK, BM, BN, HALF, _copy_rows, _down_epilogue, _now, _signal,
                                                    _trace_event, _wait_geq, _zero64)

QN = gl.constexpr(64)  # columns of a d_w partial: the Triton kernel's phase-A half tile (block_n / 2)

# tile kinds, as _decode returns them
NONE = gl.constexpr(0)  # past the last minibatch, a minibatch with no rows, or a phase-B tile past the rows
A = gl.constexpr(1)  # a phase-A tile (down dgrad + SwiGLU backward)
A_EMPTY = gl.constexpr(2)  # a phase-A tile past the routed rows: no math, still counted in a_ready
B = gl.constexpr(3)  # a phase-B tile (gate|up dgrad)

# trace event codes (kittenmoe.trace.BWD_KINDS), recorded with TRACE; each unit of work has a slot
# family * total + tile, so no two events share one (the launcher allocates 4 x total rows)
TR_A = gl.constexpr(1)  # math group 0, a phase-A tile: start, first K step's operands in, K loop done
TR_B = gl.constexpr(2)  # the same for a phase-B tile
TR_A_EPILOGUE = gl.constexpr(6)  # the epilogue partition: waiting for group 0's accumulator, got it, signalled
TR_A_HANDOVER = gl.constexpr(7)  # math group 0: K loop done, the hand-over buffer free, accumulator handed over
TR_B_STORE = gl.constexpr(8)  # math group 0: K loop done, the buffer free, d_x stores issued
TR_A_READY_WAIT = gl.constexpr(9)  # the producer, before a phase-B tile: polling a_ready, done (no work)


@gluon.jit
def _decode(tile, H, I, NMB, num_rows, tile_expert_ptr, expert_offsets_ptr, LAG: gl.constexpr, MB: gl.constexpr,
            TGM: gl.constexpr):
    """What tile ``tile`` of the global sequence is: (kind, minibatch p, schedule row, first weight row, output
    column, K steps). The order is the Triton backward's over every minibatch (no shared expert)."""
    per_a = (MB // BM) * (I // BN)
    per_b = (MB // BM) * (H // (2 * BN))
    per_mb = per_a + per_b
    rnd = tile // per_mb
    i = tile % per_mb
    kind = NONE
    p = 0
    a_row = 0
    b_row = 0
    col = 0
    ks = 0
    if i < per_a:
        p = rnd
        if (p < NMB) & (p * MB < num_rows):
            rt, nt = _tile_rc(i, I // BN, MB // BM, TGM, p * (MB // BM), tile_expert_ptr, expert_offsets_ptr,
                              num_rows // BM, BM)
            a_row = p * MB + rt * BM
            e = gl.load(tile_expert_ptr + a_row // BM, mask=a_row < num_rows, other=-1)
            kind = A_EMPTY
            if e >= 0:
                kind = A
                b_row = e * H
                col = nt * BN
                ks = H // BK
    else:
        p = rnd - LAG
        if (p >= 0) & (p < NMB):
            if p * MB < num_rows:
                rt, nt = _tile_rc(i - per_a, H // (2 * BN), MB // BM, TGM, p * (MB // BM), tile_expert_ptr,
                                  expert_offsets_ptr, num_rows // BM, BM)
                a_row = p * MB + rt * BM
                e = gl.load(tile_expert_ptr + a_row // BM, mask=a_row < num_rows, other=-1)
                if e >= 0:
                    kind = B
                    b_row = e * (2 * I)
                    col = nt * (2 * BN)
                    ks = (2 * I) // BK
    return kind, p, a_row, b_row, col, ks


@gluon.jit
def _gather_a(dout_ptr, peer_rank_ptr, peer_tok_ptr, num_rows, K, H, w2_desc, a_row, b_row, col, ks, it,
              a_s, b0_s, ready, empty, TRACKED: gl.constexpr):
    """Producer, a phase-A tile: its A rows straight from d_out (row t of route t*K + j; padding rows zero) by
    cp.async, 16-byte vectors; the W2 tile [BK, BN] (rows of H, columns of I) through TMA. Each stage's
    ``ready`` takes two arrivals: the TMA bytes', and the producer's. Without TRACKED the producer arrives once
    every producer thread's copies of the stage are complete and fenced for the async proxy, one K step behind
    the one issued (two steps of rows in flight); with TRACKED the barrier tracks the copies
    (``megakernel_fwd_gluon._copy_rows``: every ring stage in flight) and the math groups fence after their
    wait."""
    STAGES: gl.constexpr = a_s.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])  # [32, 32] a pass
    rows = a_row + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    pr = gl.load(peer_rank_ptr + rows, mask=rows < num_rows, other=-1)
    pt = gl.load(peer_tok_ptr + rows, mask=rows < num_rows, other=0)
    ok = (pr >= 0)[:, None]
    base = (dout_ptr + ((pt // K).to(gl.int64) * H)[:, None]
            + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))[None, :])
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(st), w2_desc.block_type.nbytes)
        tma_load(w2_desc, [b_row + k * BK, col], ready.index(st), b0_s.index(st))
        if TRACKED:
            _copy_rows(a_s.index(st), base + k * BK, ok, ready.index(st))
        else:
            cp_async_load(a_s.index(st), base + k * BK, mask=ok)
            async_copy.commit_group()
            if k > 0:
                async_copy.wait_group(1)  # this thread's copies of the previous step are in shared memory
                fence_async_shared()
                barrier()  # ... and every producer thread's
                mbarrier.arrive(ready.index((it + STAGES - 1) % STAGES), count=1)
        it += 1
    if not TRACKED:
        async_copy.wait_group(0)
        fence_async_shared()
        barrier()
        mbarrier.arrive(ready.index((it + STAGES - 1) % STAGES), count=1, pred=ks > 0)
    return it


@gluon.jit
def _load_b(dgu_desc, w13_desc, a_row, b_row, col, ks, it, a_s, b0_s, b1_s, ready, empty):
    """Producer, a phase-B tile: d(gate|up) rows [BM, BK] and two W13 tiles [BK, BN] (rows of 2I, columns of H)
    a K step through TMA; the second ``ready`` arrival at once."""
    STAGES: gl.constexpr = a_s.shape[0]
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), dgu_desc.block_type.nbytes + 2 * w13_desc.block_type.nbytes)
        tma_load(dgu_desc, [a_row, k * BK], ready.index(st), a_s.index(st))
        tma_load(w13_desc, [b_row + k * BK, col], ready.index(st), b0_s.index(st))
        tma_load(w13_desc, [b_row + k * BK, col + BN], ready.index(st), b1_s.index(st))
        mbarrier.arrive(ready.index(st), count=1)
        it += 1
    return it


@gluon.jit
def _mma_a(a_s, b0_s, ready, empty, ks, it, ROWS0: gl.constexpr, layout: gl.constexpr, store_a, dor_desc, a_row,
           TRACKED: gl.constexpr, TRACE: gl.constexpr):
    """A math group's phase-A accumulator (rows ROWS0.. x BN columns of I) over the tile's K steps, one step's
    wgmma in flight; a stage goes back to the producer (``empty``, count 2) once the wgmma that read it is done.
    ``store_a`` (math group 0 of a row tile's first column tile): each step's whole A block also goes to ``dor`` by
    a TMA store, which must have read the stage before it goes back. Returns the accumulator, the ring position
    and (TRACE) when the first step's operands had arrived."""
    STAGES: gl.constexpr = a_s.shape[0]
    acc = gl.zeros((HALF, BN), dtype=gl.float32, layout=layout)
    t_ready = _now() if TRACE else _zero64()
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if TRACE:
            if k == 0:
                t_ready = _now()
        if TRACKED:
            fence_async_shared()  # the rows cp.async wrote, before wgmma and TMA read them (async proxy)
        if store_a:
            tma_store(dor_desc, [a_row, k * BK], a_s.index(st))
        acc = warpgroup_mma(a_s.index(st).slice(ROWS0, HALF), b0_s.index(st), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if store_a:
            tma.store_wait(pendings=1)  # the previous step's store has read its stage
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if store_a:
        tma.store_wait(pendings=0)
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ks > 0)
    return acc, it, t_ready


@gluon.jit
def _mma_b(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0: gl.constexpr, layout: gl.constexpr, TRACE: gl.constexpr):
    """A math group's two phase-B accumulators (rows ROWS0.. x 2 BN columns of H), as ``_mma_a`` without the
    store."""
    STAGES: gl.constexpr = a_s.shape[0]
    acc0 = gl.zeros((HALF, BN), dtype=gl.float32, layout=layout)
    acc1 = gl.zeros((HALF, BN), dtype=gl.float32, layout=layout)
    t_ready = _now() if TRACE else _zero64()
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if TRACE:
            if k == 0:
                t_ready = _now()
        a = a_s.index(st).slice(ROWS0, HALF)
        acc0 = warpgroup_mma(a, b0_s.index(st), acc0, is_async=True)
        acc1 = warpgroup_mma(a, b1_s.index(st), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
        it += 1
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ks > 0)
    return acc0, acc1, it, t_ready


@gluon.jit
def _swiglu_bwd_half(acc_dh, w_row, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, row0, col0, q, I, NI, swiglu_limit,
                     HAS_LIMIT: gl.constexpr):
    """One HALF x QN quarter of a phase-A tile, as ``megakernel_bwd._bwd_a_epilogue`` computes a kept tile's half:
    g and u of columns col0.. from the forward's kept gate|up (x's dtype), d(gate|up) and w * h into their rows,
    and
    the d_w partial sum(d_hidden * h) of the row over these QN columns into dw_part[row, q]. ``w_row``: the
    rows' router weights, in the row slice of ``acc_dh``'s layout."""
    layout: gl.constexpr = acc_dh.type.layout
    rows = (row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))).to(gl.int64)
    cols = col0 + gl.arange(0, QN, layout=gl.SliceLayout(0, layout))
    g_at = gu_ptr + rows[:, None] * (2 * I) + cols[None, :]
    g = gl.load(g_at).to(gl.float32)
    u = gl.load(g_at + I).to(gl.float32)
    if HAS_LIMIT:
        gc = gl.minimum(g, swiglu_limit)
        uc = gl.minimum(gl.maximum(u, -swiglu_limit), swiglu_limit)
    else:
        gc = g
        uc = u
    s = 1 / (1 + gl.exp(-gc))  # tl.sigmoid's expression: the same bits
    h = gc * s * uc
    dh = acc_dh * w_row[:, None]
    dgc = dh * uc * s * (1.0 + gc * (1.0 - s))
    duc = dh * gc * s
    if HAS_LIMIT:
        dgc = gl.where(g <= swiglu_limit, dgc, 0.0)
        duc = gl.where((u >= -swiglu_limit) & (u <= swiglu_limit), duc, 0.0)
    d_at = dgu_ptr + rows[:, None] * (2 * I) + cols[None, :]
    gl.store(d_at, dgc.to(dgu_ptr.dtype.element_ty))
    gl.store(d_at + I, duc.to(dgu_ptr.dtype.element_ty))
    gl.store(hw_ptr + rows[:, None] * I + cols[None, :], (h * w_row[:, None]).to(hw_ptr.dtype.element_ty))
    # the Triton epilogue's select (columns < I, always true here) kept, so that the products are summed as there
    gl.store(dwp_ptr + rows * NI + q, gl.sum(gl.where((cols < I)[None, :], acc_dh * h, 0.0), axis=1))


@gluon.jit
def _a_epilogue(dh_s, g, w_ptr, peer_rank_ptr, peer_tok_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, row0, col0, I, NI,
                swiglu_limit, HAS_LIMIT: gl.constexpr):
    """The SwiGLU backward of math group ``g``'s phase-A accumulator, handed over as its two QN-column halves
    (``dh_s[2g]``, ``dh_s[2g + 1]``, HALF x QN fp32), one half at a time as the Triton kernel splits its kept
    tile, each exactly as there. A half is read in an m64n64 wgmma accumulator's layout, which puts every element
    in the thread that held it in the math group's m64n128 one."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QN, 16])
    rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    pr = gl.load(peer_rank_ptr + rows)
    pt = gl.load(peer_tok_ptr + rows)
    w_row = gl.load(w_ptr + pt, mask=pr >= 0, other=0.0)  # padding rows: 0, as the Triton kernel's pulled rows
    q = col0 // QN
    for c in range(BN // QN):  # (a loop, not unrolled: both halves' loads in flight spill at 128 registers)
        _swiglu_bwd_half(dh_s.index(2 * g + c).load(layout), w_row, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, row0,
                         col0 + c * QN, q + c, I, NI, swiglu_limit, HAS_LIMIT)


@gluon.jit
def _math(ROWS0: gl.constexpr, a_s, b0_s, b1_s, dh_s, ready, empty, dh_full, dh_free, tile_expert_ptr,
          expert_offsets_ptr, num_rows_ptr, dor_desc, dxr_desc, trace_ptr, H, I, NMB, total,
          LAG: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, TRACKED: gl.constexpr, REC: gl.constexpr):
    """A math group: rows ROWS0 .. ROWS0 + 63 of every tile of this program. A phase-A accumulator goes to the
    epilogue partition through ``dh_s[G]`` (fp32, so the SwiGLU backward sees the bits the Triton kernel's
    does); the same 32 KB hold a phase-B tile's two d_x halves on their way to TMA. Every write into it waits
    until the epilogue has taken the last accumulator handed over (``dh_free``), and a phase-A write also until
    this group's d_x stores have read it. With REC (group 0 of a TRACE build) it records each tile's K loop and
    its hand-over."""
    G: gl.constexpr = ROWS0 // HALF
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    c0_s = reinterpret(dh_s.index(2 * G), dxr_desc.dtype, [HALF, BN], dxr_desc.layout)
    c1_s = reinterpret(dh_s.index(2 * G + 1), dxr_desc.dtype, [HALF, BN], dxr_desc.layout)
    num_rows = gl.load(num_rows_ptr)
    it = 0
    nh = 0  # accumulators handed over so far
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        kind, p, a_row, b_row, col, ks = _decode(tile, H, I, NMB, num_rows, tile_expert_ptr, expert_offsets_ptr,
                                                 LAG, MB, TGM)
        t_start = _now() if REC else _zero64()
        if kind == A:
            acc, it, t_ready = _mma_a(a_s, b0_s, ready, empty, ks, it, ROWS0, layout, (ROWS0 == 0) & (col == 0),
                                      dor_desc, a_row, TRACKED, REC)
            t_done = _now() if REC else _zero64()
            tma.store_wait(pendings=0)  # the last d_x stores out of the buffer have read it
            barrier()
            mbarrier.wait(dh_free.index(G), (nh & 1) ^ 1)  # a fresh barrier passes parity 1
            t_free = _now() if REC else _zero64()
            lo, hi = acc.reshape([HALF, 2, QN]).permute((0, 2, 1)).split()  # (no data moves)
            dh_s.index(2 * G).store(lo)
            dh_s.index(2 * G + 1).store(hi)
            barrier()  # every thread's part is in shared memory before the one arrival
            mbarrier.arrive(dh_full.index(G), count=1)
            nh += 1
            if REC:
                _trace_event(trace_ptr, tile, TR_A, t_start, t_ready, t_done)
                _trace_event(trace_ptr, total + tile, TR_A_HANDOVER, t_done, t_free, _now())
        elif kind == B:
            acc0, acc1, it, t_ready = _mma_b(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout, REC)
            t_done = _now() if REC else _zero64()
            mbarrier.wait(dh_free.index(G), (nh & 1) ^ 1)
            t_free = _now() if REC else _zero64()
            _down_epilogue(acc0, acc1, dxr_desc, c0_s, c1_s, a_row + ROWS0, col, False)
            if REC:
                _trace_event(trace_ptr, tile, TR_B, t_start, t_ready, t_done)
                _trace_event(trace_ptr, total + tile, TR_B_STORE, t_done, t_free, _now())
    tma.store_wait(pendings=0)


@gluon.jit
def _epilogue(dh_s, dh_full, dh_free, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, peer_rank_ptr,
              peer_tok_ptr, w_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, trace_ptr, H, I, NMB, NI, swiglu_limit, total,
              LAG: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, HAS_LIMIT: gl.constexpr,
              TRACE: gl.constexpr):
    """The epilogue partition: each phase-A tile's SwiGLU backward, math group 0's rows then group 1's, while the
    math groups run the next tiles' K loops (on the Triton kernel's tile the epilogue was ~40% of a phase-A
    tile with no wgmma in flight). Each half is read back in an m64n64 accumulator layout (``_a_epilogue``), so
    every element is computed as there; a group's buffer goes back once both its halves are done (the math
    group's next write into it is a tile later), then one a_ready signal a tile (empty tiles included). With
    TRACE each phase-A tile records its wait for group 0's accumulator and the work up to the signal."""
    num_rows = gl.load(num_rows_ptr)
    nh = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        kind, p, a_row, b_row, col, ks = _decode(tile, H, I, NMB, num_rows, tile_expert_ptr, expert_offsets_ptr,
                                                 LAG, MB, TGM)
        if kind == A:
            t_start = _now() if TRACE else _zero64()
            t_ready = t_start
            for g in range(2):
                mbarrier.wait(dh_full.index(g), nh & 1)
                if TRACE:
                    if g == 0:
                        t_ready = _now()
                _a_epilogue(dh_s, g, w_ptr, peer_rank_ptr, peer_tok_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr,
                            a_row + g * HALF, col, I, NI, swiglu_limit, HAS_LIMIT)
                barrier()  # every thread has read its part before the buffer goes back
                mbarrier.arrive(dh_free.index(g), count=1)
            nh += 1
            _signal(cnt_ptr + p)  # a_ready[p]; phase B reads d(gate|up) through TMA (the signal fences for it)
            if TRACE:
                _trace_event(trace_ptr, 2 * total + tile, TR_A_EPILOGUE, t_start, t_ready, _now())
        elif kind == A_EMPTY:
            _signal(cnt_ptr + p)


@gluon.jit
def _load(a_s, b0_s, b1_s, ready, empty, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr,
          peer_rank_ptr, peer_tok_ptr, dout_ptr, dgu_desc, w13_desc, w2_desc, trace_ptr, H, I, K, NMB, total,
          max_spin, LAG: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, TRACKED: gl.constexpr,
          TRACE: gl.constexpr):
    """The producer: every tile's wait (phase B: its minibatch's a_ready), then its K steps into the ring. With
    TRACE each phase-B tile records its a_ready poll."""
    num_rows = gl.load(num_rows_ptr)
    per_a = (MB // BM) * (I // BN)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        kind, p, a_row, b_row, col, ks = _decode(tile, H, I, NMB, num_rows, tile_expert_ptr, expert_offsets_ptr,
                                                 LAG, MB, TGM)
        if kind == A:
            it = _gather_a(dout_ptr, peer_rank_ptr, peer_tok_ptr, num_rows, K, H, w2_desc, a_row, b_row, col, ks,
                           it, a_s, b0_s, ready, empty, TRACKED)
        elif kind == B:
            t_start = _now() if TRACE else _zero64()
            _wait_geq(cnt_ptr + p, per_a, err_ptr, max_spin)  # a_ready: every phase-A tile's epilogue
            if TRACE:
                t_ready = _now()
                _trace_event(trace_ptr, 3 * total + tile, TR_A_READY_WAIT, t_start, t_ready, t_ready)
            it = _load_b(dgu_desc, w13_desc, a_row, b_row, col, ks, it, a_s, b0_s, b1_s, ready, empty)


@gluon.jit
def _partition(ROLE: gl.constexpr, LAG: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, HAS_LIMIT: gl.constexpr,
               TRACKED: gl.constexpr, TRACE: gl.constexpr, a_s, b0_s, b1_s, dh_s, ready, empty, dh_full, dh_free,
               tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr, peer_rank_ptr, peer_tok_ptr,
               dout_ptr, w_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, dor_desc, dgu_desc, w13_desc, w2_desc, dxr_desc,
               trace_ptr, H, I, K, NMB, NI, swiglu_limit, total, max_spin):
    """ROLE 0 / 1: the math groups of each tile's rows 0-63 / 64-127; ROLE 2: the producer; ROLE 3: the phase-A
    epilogue (four warps each). The constexprs come first, beside ROLE in each partition's literal tuple: passed
    inside the shared argument tuple, warp_specialize hands them to the partitions as runtime values."""
    if ROLE == 2:
        _load(a_s, b0_s, b1_s, ready, empty, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr,
              peer_rank_ptr, peer_tok_ptr, dout_ptr, dgu_desc, w13_desc, w2_desc, trace_ptr, H, I, K, NMB, total,
              max_spin, LAG, MB, TGM, TRACKED, TRACE)
    elif ROLE == 3:
        _epilogue(dh_s, dh_full, dh_free, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, peer_rank_ptr,
                  peer_tok_ptr, w_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, trace_ptr, H, I, NMB, NI, swiglu_limit,
                  total, LAG, MB, TGM, HAS_LIMIT, TRACE)
    elif ROLE == 0:  # (math group 0 records the trace's math events)
        _math(0, a_s, b0_s, b1_s, dh_s, ready, empty, dh_full, dh_free, tile_expert_ptr,
              expert_offsets_ptr, num_rows_ptr, dor_desc, dxr_desc, trace_ptr, H, I, NMB, total, LAG, MB, TGM,
              TRACKED, TRACE)
    else:
        _math(HALF, a_s, b0_s, b1_s, dh_s, ready, empty, dh_full, dh_free, tile_expert_ptr,
              expert_offsets_ptr, num_rows_ptr, dor_desc, dxr_desc, trace_ptr, H, I, NMB, total, LAG, MB, TGM,
              TRACKED, False)


@gluon.jit
def backward_kernel(
    peer_rank_ptr,  # [C] int32, -1 = padding (the schedule's)
    peer_tok_ptr,  # [C] int32, t*K + j
    tile_expert_ptr,  # [C // BM] int32, local expert per row tile, -1 past num_rows
    expert_offsets_ptr,  # [L + 1] int32, first row of each expert's padded segment
    num_rows_ptr,  # [1] int32
    dout_ptr,  # [T, H] this rank's d_out
    w_ptr,  # [T * K] fp32 router weights
    gu_ptr,  # [NR, 2I] the forward's kept gate|up pre-activations, x's dtype
    dgu_ptr,  # [NR, 2I] d(gate|up) rows (written)
    hw_ptr,  # [NR, I] w * hidden rows (written)
    dwp_ptr,  # [NR, NI] fp32 d_w partials, one per QN columns of I (written)
    dor_desc,  # dor [NR, H], blocks [BM, BK] (stores: the gathered d_out rows, for the weight gradients)
    dgu_desc,  # dgu [NR, 2I], blocks [BM, BK] (phase B's A)
    w13_desc,  # w13 viewed [L * 2I, H], blocks [BK, BN] (phase B's B, N-major)
    w2_desc,  # w2 viewed [L * H, I], blocks [BK, BN] (phase A's B, N-major)
    dxr_desc,  # d_x rows [NR, H], blocks [HALF, BN] (stores)
    cnt_ptr,  # [NMB] int32 a_ready counters, zeroed before launch
    err_ptr,  # [1] int32 error flag
    trace_ptr,  # [4 * total, 5] int64 events (TRACE; else a placeholder, never touched)
    H, I, K, NMB, NI, swiglu_limit, max_spin,
    LAG: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, HAS_LIMIT: gl.constexpr,
    STAGES: gl.constexpr = 3, TRACKED: gl.constexpr = False, TRACE: gl.constexpr = False,
):
    """Launched with num_warps=4 (the default partition is math group 0) and maxnreg=168. Shared memory: STAGES x
    48 KB of operands (phase A fills 32 KB of a stage) and a 32 KB fp32 hand-over buffer a math group (3 stages:
    208 KB of the 227 KB; a fourth stage does not fit beside the buffers). Registers: 168 a thread for each math
    group (a phase-B accumulator pair is 128), 40 for the producer, 136 for the epilogue (at 128 it spilled a
    few scalars): 64 K, the SM's whole file, so the launch's maxnreg is 128 (512 threads)."""
    total = (NMB + LAG) * ((MB // BM) * (I // BN + H // (2 * BN)))
    a_s = gl.allocate_shared_memory(dgu_desc.dtype, [STAGES, BM, BK], dgu_desc.layout)
    b0_s = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, BK, BN], w13_desc.layout)
    b1_s = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, BK, BN], w13_desc.layout)
    dh_s = gl.allocate_shared_memory(gl.float32, [4, HALF, QN],
                                     gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dh_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dh_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(dh_full.index(i), count=1)
        mbarrier.init(dh_free.index(i), count=1)
    args = (a_s, b0_s, b1_s, dh_s, ready, empty, dh_full, dh_free,
            tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr, peer_rank_ptr, peer_tok_ptr,
            dout_ptr, w_ptr, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, dor_desc, dgu_desc, w13_desc, w2_desc, dxr_desc,
            trace_ptr, H, I, K, NMB, NI, swiglu_limit, total, max_spin)
    gl.warp_specialize([(_partition, (0, LAG, MB, TGM, HAS_LIMIT, TRACKED, TRACE) + args),
                        (_partition, (1, LAG, MB, TGM, HAS_LIMIT, TRACKED, TRACE) + args),
                        (_partition, (2, LAG, MB, TGM, HAS_LIMIT, TRACKED, TRACE) + args),
                        (_partition, (3, LAG, MB, TGM, HAS_LIMIT, TRACKED, TRACE) + args)], [4, 4, 4], [168, 40, 136])
