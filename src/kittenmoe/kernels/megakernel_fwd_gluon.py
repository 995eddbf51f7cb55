"""The forward megakernel on Hopper in Gluon (``KernelConfig.forward_kernel="gluon"``): one rank, 2-byte operands.

The same schedule, buffers, tile sequence, counters and bits as ``megakernel_fwd.dispatch_mlp_swiglu_combine_kernel``
run with no communication programs and ``combine_gather`` (the one-rank default): every program first pulls its
share of every minibatch into ``x_routed`` and bumps ``x_ready``, then walks the global tile sequence (the shared
expert's gate|up tiles, rounds of [gate|up of minibatch j, down of minibatch j - LAG], the shared expert's down
tiles) round-robin. What differs is who waits, as in ``wgrad_gluon``:

- a producer warp walks the program's tiles ahead of the math: it polls the tile's counter (``x_ready`` before a
  gate|up tile, ``hid_ready`` before a down tile, ``shared_ready`` before a shared down tile), then keeps a
  STAGES-deep TMA ring of [A rows, two weight tiles] full *across tile boundaries*, so the next tile's first K
  steps load while this tile's last wgmmas and its epilogue run. Triton 3.6 pipelines loads only within one K
  loop, so the Triton megakernel pays a pipeline fill and drain every tile: at I = 512 a down tile is 8 K steps;
- two 4-warp math groups each own 64 of the tile's 128 rows, with two 64 x 128 fp32 accumulators: a gate|up tile
  multiplies its rows by 128 gate and 128 up weight rows, a down tile by 256 weight rows as two halves, so every
  tile kind runs one loop over one ring of 48 KB stages. The down tiles' rows leave through shared memory and TMA
  stores that drain under the next tile, and so do a gate|up tile's hidden rows and kept gate|up (x's dtype),
  after which the group bumps the tile's counter (each math group once: the targets count 2 a tile).

Only what the one-rank default needs: no communication programs, nothing pushed (the epilogue gathers from
``y_routed``), a resident ring, no FP8, widths multiples of the tiles. The launcher checks each
(``launch_forward``) and says which failed. Gluon kernels do not run under the Triton interpreter; the CPU suite
runs the Triton kernel, the GPU tests hold this one to its bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

from kittenmoe.kernels.gluon_api import barrier, tma_load, tma_store, cp_async_load
from kittenmoe.kernels.megakernel_fwd import _mb_rows, _tile_rc

HALF = gl.constexpr(64)  # rows of a tile one math group owns (one m64 wgmma); a tile is 2 * HALF = 128 rows
BM, BN, BK = gl.constexpr(128), gl.constexpr(128), gl.constexpr(64)  # the tile: 128 rows x (128 gate + 128 up) or x 256 down columns, 64-deep K steps

# tile kinds, as _decode returns them
NONE = gl.constexpr(0)  # past the last minibatch, or a minibatch with no rows: nothing to do
SH_GU = gl.constexpr(1)  # the shared expert's gate|up
GU = gl.constexpr(2)  # a routed gate|up tile
GU_EMPTY = gl.constexpr(3)  # a routed gate|up tile past the routed rows: no math, still counted in hid_ready
DN = gl.constexpr(4)  # a routed down tile
SH_DN = gl.constexpr(5)  # the shared expert's down

# trace event codes (kittenmoe.trace.KINDS), recorded with TRACE: a tile's event (kinds 0-3, math group 0) runs from
# when the group took it through the first K step's operands (ready) to its last wgmma; its epilogue (code 6) from
# there to the stores issued and the counter bumped; the producer's counter poll before it (code 7, all wait).
# Slots: tile, total + tile, 2 * total + tile, then a pull a (minibatch, program) at 3 * total + p * nprog + pid.
TR_SH_GU = gl.constexpr(0)
TR_GU = gl.constexpr(1)
TR_DN = gl.constexpr(2)
TR_SH_DN = gl.constexpr(3)
TR_PULL = gl.constexpr(4)
TR_EPILOGUE = gl.constexpr(6)
TR_WAIT = gl.constexpr(7)


@gluon.jit
def _now():
    """The GPU's global nanosecond timer (``%globaltimer``), as ``megakernel_fwd._now`` reads it."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _zero64():
    """An int64 0, the untraced stand-in for a timestamp (a variable keeps one type on every path)."""
    return gl.to_tensor(0).to(gl.int64)


@gluon.jit
def _trace_event(trace_ptr, slot, kind: gl.constexpr, t_start, t_ready, t_end):
    """One event into row ``slot`` of trace_ptr [MAXE, 5] int64: kind, program, start, when its wait returned,
    end (``megakernel_fwd._trace_event``'s row; every thread of the partition stores the same values). The
    launcher sizes the buffer for every slot the kernel names."""
    row = trace_ptr + slot.to(gl.int64) * 5
    gl.store(row, gl.to_tensor(kind).to(gl.int64))
    gl.store(row + 1, gl.to_tensor(gl.program_id(0)).to(gl.int64))
    gl.store(row + 2, t_start)
    gl.store(row + 3, t_ready)
    gl.store(row + 4, t_end)


@gluon.jit
def _proxy_fence():
    """``fence.proxy.async.global``: rows written by ordinary stores are read by other programs' TMA loads
    (megakernel_fwd._proxy_fence says why both the writer and the reader fence)."""
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _bulk_stores_done():
    """``cp.async.bulk.wait_group 0``: this thread's TMA stores have written global memory. ``tma.store_wait``
    is the ``.read`` form, which returns once a store has only read its shared-memory source: enough to reuse
    the buffer, not to tell another program the rows are there (the release could overtake the rows, and a
    down tile's TMA load read the stale hidden row). Threads that issued no store return at once."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _signal(cnt_ptr):
    """Bump a counter once this partition's stores are done: its TMA stores written (``_bulk_stores_done``; the
    hidden rows a gate|up tile stores that way), then the proxy fence, the partition barrier and the release."""
    _bulk_stores_done()
    _proxy_fence()
    barrier()
    gl.atomic_add(cnt_ptr, 1, sem="release")


@gluon.jit
def _wait_geq(cnt_ptr, target, err_ptr, max_spin):
    """megakernel_fwd._wait_geq for the producer warp: poll until ``cnt >= target``, bounded by ``max_spin``
    polls or another program's timeout flag; a timeout sets the flag (the launcher raises)."""
    v = gl.atomic_add(cnt_ptr, 0, sem="acquire")
    e = gl.atomic_add(err_ptr, 0, sem="relaxed")
    n = 0
    while (v < target) & (n < max_spin) & ((e & 1) == 0):
        v = gl.atomic_add(cnt_ptr, 0, sem="acquire")
        e = gl.atomic_add(err_ptr, 0, sem="relaxed")
        n += 1
    if v < target:
        gl.atomic_or(err_ptr, 1)  # megakernel_fwd.ERR_TIMEOUT
    _proxy_fence()  # the rows released are read next through TMA


@gluon.jit
def _decode(tile, T, H, I, S, NMB, NSLOT, num_rows, tile_expert_ptr, expert_offsets_ptr,
            LAG: gl.constexpr, MAC: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, HAS_SHARED: gl.constexpr):
    """What tile ``tile`` of the global sequence is: (kind, minibatch p, A row, first weight row, second weight
    row, K steps, output column). The order is megakernel_fwd's (``PH_ALL`` over every minibatch)."""
    n_sh_rt = (T + BM - 1) // BM
    n_sh_gu = 0
    if HAS_SHARED:
        n_sh_gu = n_sh_rt * (S // BN)
    per_mb_gu = (MB // BM) * (I // BN)
    per_mb = per_mb_gu + (MB // BM) * (H // (2 * BN))
    r_hi = n_sh_gu + (NMB + LAG) * per_mb
    kind = NONE
    p = 0
    a_row = 0
    b0 = 0
    b1 = 0
    ks = 0
    col = 0
    if tile < n_sh_gu:
        nt = tile // n_sh_rt
        kind = SH_GU
        a_row = (tile % n_sh_rt) * BM
        b0 = nt * BN
        b1 = S + nt * BN
        ks = H // BK
        col = nt * BN
    elif tile < r_hi:
        rnd = (tile - n_sh_gu) // per_mb
        i = (tile - n_sh_gu) % per_mb
        if i < per_mb_gu:
            p = rnd
            if p < NMB:
                row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                if live:
                    rt, nt = _tile_rc(i, I // BN, MB // BM, TGM, row0 // BM, tile_expert_ptr, expert_offsets_ptr,
                                      num_rows // BM, BM)
                    e = gl.load(tile_expert_ptr + (row0 + rt * BM) // BM, mask=row0 + rt * BM < num_rows,
                                other=-1)
                    kind = GU_EMPTY
                    if e >= 0:
                        kind = GU
                        a_row = (p % NSLOT) * MB + rt * BM
                        b0 = e * (2 * I) + nt * BN
                        b1 = b0 + I
                        ks = H // BK
                        col = nt * BN
        else:
            p = rnd - LAG
            if (p >= 0) & (p < NMB):
                row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                if live:
                    rt, nt = _tile_rc(i - per_mb_gu, H // (2 * BN), MB // BM, TGM, row0 // BM, tile_expert_ptr,
                                      expert_offsets_ptr, num_rows // BM, BM)
                    e = gl.load(tile_expert_ptr + (row0 + rt * BM) // BM, mask=row0 + rt * BM < num_rows,
                                other=-1)
                    if e >= 0:
                        kind = DN
                        a_row = (p % NSLOT) * MB + rt * BM
                        b0 = e * H + nt * (2 * BN)
                        b1 = b0 + BN
                        ks = I // BK
                        col = nt * (2 * BN)
    else:
        j = tile - r_hi
        nt = j // n_sh_rt
        kind = SH_DN
        a_row = (j % n_sh_rt) * BM
        b0 = nt * (2 * BN)
        b1 = b0 + BN
        ks = S // BK
        col = nt * (2 * BN)
    return kind, p, a_row, b0, b1, ks, col


@gluon.jit
def _load_tile(a_desc, b_desc, a_row, b0, b1, ks, it, a_s, b0_s, b1_s, ready, empty, GATHER: gl.constexpr):
    """Producer: the tile's K steps into the ring, ``it`` counting ring uses over the whole launch. With GATHER
    the ring's ``ready`` barriers count two arrivals (the TMA bytes' and the gathered rows'): a tile loaded
    whole through TMA gives the second at once."""
    STAGES: gl.constexpr = a_s.shape[0]
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(st), a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
        tma_load(a_desc, [a_row, k * BK], ready.index(st), a_s.index(st))
        tma_load(b_desc, [b0, k * BK], ready.index(st), b0_s.index(st))
        tma_load(b_desc, [b1, k * BK], ready.index(st), b1_s.index(st))
        if GATHER:
            mbarrier.arrive(ready.index(st), count=1)
        it += 1
    return it


@gluon.jit
def _copy_rows(a_st, src, ok, ready_st):
    """A producer's share of one stage's gathered A rows: cp.async of ``src`` (rows where ``ok``, zeros
    elsewhere) into ``a_st``, and the stage's second ``ready`` arrival once every producer thread's copies have
    landed. Each thread has the barrier track its copies (``cp.async.mbarrier.arrive`` without ``.noinc``: the
    pending count goes up now and down when they complete), so after a partition barrier one arrival completes
    the phase only when all of them have; the producer never waits for its copies and keeps every stage of the
    ring in flight. The math groups fence for the async proxy after their wait (``_mma_tile``)."""
    cp_async_load(a_st, src, mask=ok)
    async_copy.mbarrier_arrive(ready_st)
    barrier()  # every thread's tracking is registered before the one arrival
    mbarrier.arrive(ready_st, count=1)


@gluon.jit
def _gather_tile(x_ptr, peer_rank_ptr, peer_tok_ptr, num_rows, K, H, b_desc, a_row, b0, b1, ks, it,
                 a_s, b0_s, b1_s, ready, empty):
    """Producer (4 warps), a routed gate|up tile with GATHER: its A rows straight from x (row t of route
    t*K + j; padding rows zero) by cp.async, 16-byte vectors (``_copy_rows``); the weight tiles through TMA."""
    STAGES: gl.constexpr = a_s.shape[0]
    # [32, 32] a pass with 4 warps, 8 vectors a thread. (The warps are the context's: the 1-warp producer of the
    # pull form traces this too, never running it.)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows = a_row + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    pr = gl.load(peer_rank_ptr + rows, mask=rows < num_rows, other=-1)
    pt = gl.load(peer_tok_ptr + rows, mask=rows < num_rows, other=0)
    ok = (pr >= 0)[:, None]
    base = x_ptr + ((pt // K).to(gl.int64) * H)[:, None] + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))[None, :]
    for k in range(ks):
        st = it % STAGES
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * b_desc.block_type.nbytes)
        tma_load(b_desc, [b0, k * BK], ready.index(st), b0_s.index(st))
        tma_load(b_desc, [b1, k * BK], ready.index(st), b1_s.index(st))
        _copy_rows(a_s.index(st), base + k * BK, ok, ready.index(st))
        it += 1
    return it


@gluon.jit
def _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0: gl.constexpr, layout: gl.constexpr,
              store_a=False, xr_desc=None, a_row=0, TRACE: gl.constexpr = False):
    """One math group's two accumulators over the tile's K steps: rows ROWS0.. of A against both weight tiles,
    one step's wgmmas in flight; a stage goes back to the producer (``empty``, count 2: both groups read it) once
    the wgmmas that read it are done. ``xr_desc`` given: a gathered tile (GATHER), whose A rows cp.async wrote,
    so each step fences for the async proxy (wgmma and TMA read shared memory through it) after its wait;
    ``store_a`` (kept activations, the row tile's first column tile): each step's whole A block also goes to
    x_routed by a TMA store, which must have read the stage before it goes back. Returns the accumulators, the
    ring position and (TRACE) when the first step's operands had arrived."""
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
        if xr_desc is not None:
            fence_async_shared()
            if store_a:
                tma_store(xr_desc, [a_row, k * BK], a_s.index(st))
        a = a_s.index(st).slice(ROWS0, HALF)
        acc0 = warpgroup_mma(a, b0_s.index(st).permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(a, b1_s.index(st).permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        if xr_desc is not None:
            if store_a:
                tma.store_wait(pendings=1)  # the previous step's A store has read its stage
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
        it += 1
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    if xr_desc is not None:
        if store_a:
            tma.store_wait(pendings=0)
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ks > 0)
    return acc0, acc1, it, t_ready


@gluon.jit
def _gateup_epilogue(acc_g, acc_u, hid_desc, gu_desc, c0_s, c1_s, row0, col0, width, swiglu_limit,
                     HAS_LIMIT: gl.constexpr, SAVE_GU, ONE_BUF: gl.constexpr):
    """hidden[row0 + m, col0 + n] = silu(g) * u (clamped with HAS_LIMIT), as megakernel_fwd._swiglu_store
    computes it; SAVE_GU (nonzero): the gate and up, rounded to x's dtype, into the kept [*, 2 * width] rows
    too. Every block leaves through the group's store buffers and TMA stores, which drain under the next tile
    (plain stores from the accumulator's layout, 4 bytes a thread and 8 rows a warp instruction, held the math
    group here while no wgmma ran); rows past the tensor (the shared expert's last row tile past T) are dropped
    by TMA. SAVE_GU is a runtime flag: as a constexpr, the build without the stores failed in Triton 3.6's LLVM
    lowering (an assertion in the warp-specialized partitions, whose arguments were then unused). ONE_BUF: c0_s
    is c1_s, each store waits for the one before it to have read the buffer."""
    tma.store_wait(pendings=0)
    barrier()  # the previous tile's stores have read both buffers before any thread writes them
    if SAVE_GU != 0:
        c0_s.store(acc_g.to(gu_desc.dtype))
        fence_async_shared()
        tma_store(gu_desc, [row0, col0], c0_s)
        if ONE_BUF:
            tma.store_wait(pendings=0)
            barrier()
        c1_s.store(acc_u.to(gu_desc.dtype))
        fence_async_shared()
        tma_store(gu_desc, [row0, width + col0], c1_s)
    if HAS_LIMIT:
        acc_g = gl.minimum(acc_g, swiglu_limit)
        acc_u = gl.minimum(gl.maximum(acc_u, -swiglu_limit), swiglu_limit)
    hid = acc_g * (1 / (1 + gl.exp(-acc_g))) * acc_u
    if SAVE_GU != 0:
        # the gate's store (the older one) has read c0_s; with ONE_BUF the up's too (it is the same buffer)
        if ONE_BUF:
            tma.store_wait(pendings=0)
        else:
            tma.store_wait(pendings=1)
        barrier()
    c0_s.store(hid.to(hid_desc.dtype))
    fence_async_shared()
    tma_store(hid_desc, [row0, col0], c0_s)


@gluon.jit
def _down_epilogue(acc0, acc1, out_desc, c0_s, c1_s, row0, col0, ONE_BUF: gl.constexpr):
    """A down tile's rows through shared memory and two TMA stores, which drain under the next tile; the previous
    tile's stores must have read the buffers first. ONE_BUF: c0_s is c1_s, so the second half waits for the
    first half's store to have read it."""
    tma.store_wait(pendings=0)
    barrier()  # every thread past the wait before any writes the buffers
    c0_s.store(acc0.to(out_desc.dtype))
    if ONE_BUF:
        fence_async_shared()
        tma_store(out_desc, [row0, col0], c0_s)
        tma.store_wait(pendings=0)
        barrier()
    c1_s.store(acc1.to(out_desc.dtype))
    fence_async_shared()
    if not ONE_BUF:
        tma_store(out_desc, [row0, col0], c0_s)
    tma_store(out_desc, [row0, col0 + BN], c1_s)


@gluon.jit
def _record_tile(trace_ptr, tile, total, kind: gl.constexpr, t_start, t_ready, t_done):
    """A traced tile's two events (math group 0): its K loop, then its epilogue up to now."""
    _trace_event(trace_ptr, tile, kind, t_start, t_ready, t_done)
    _trace_event(trace_ptr, total + tile, TR_EPILOGUE, t_done, t_done, _now())


@gluon.jit
def _math(ROWS0: gl.constexpr, a_s, b0_s, b1_s, c0_s, c1_s, ready, empty,
          tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr,
          hid_st, gu_st, shid_st, sgu_st, xr_desc, yr_desc, ys_desc, trace_ptr,
          T, H, I, S, NMB, NSLOT, swiglu_limit, total,
          LAG: gl.constexpr, MAC: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr,
          HAS_LIMIT: gl.constexpr, HAS_SHARED: gl.constexpr, SAVE_GU, ONE_BUF: gl.constexpr, GATHER: gl.constexpr,
          REC: gl.constexpr):
    """A math group: rows ROWS0 .. ROWS0 + 63 of every tile of this program. REC (group 0 of a TRACE build):
    each tile's K loop and epilogue recorded."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    num_rows = gl.load(num_rows_ptr)
    hid_ready = cnt_ptr + NMB
    shared_ready = cnt_ptr + 4 * NMB
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        kind, p, a_row, b0, b1, ks, col = _decode(tile, T, H, I, S, NMB, NSLOT, num_rows, tile_expert_ptr,
                                                  expert_offsets_ptr, LAG, MAC, MB, TGM, HAS_SHARED)
        t_start = _now() if REC else _zero64()
        if kind == SH_GU:
            acc0, acc1, it, t_ready = _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout, TRACE=REC)
            t_done = _now() if REC else _zero64()
            _gateup_epilogue(acc0, acc1, shid_st, sgu_st, c0_s, c1_s, a_row + ROWS0, col, S, swiglu_limit,
                             HAS_LIMIT, SAVE_GU, ONE_BUF)
            _signal(shared_ready)
            if REC:
                _record_tile(trace_ptr, tile, total, TR_SH_GU, t_start, t_ready, t_done)
        elif kind == GU:
            if GATHER:  # math group 0 keeps the gathered rows (x_routed) from the row tile's first column tile
                acc0, acc1, it, t_ready = _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout,
                                                    (ROWS0 == 0) & (SAVE_GU != 0) & (col == 0), xr_desc, a_row,
                                                    TRACE=REC)
            else:
                acc0, acc1, it, t_ready = _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout,
                                                    TRACE=REC)
            t_done = _now() if REC else _zero64()
            _gateup_epilogue(acc0, acc1, hid_st, gu_st, c0_s, c1_s, a_row + ROWS0, col, I, swiglu_limit,
                             HAS_LIMIT, SAVE_GU, ONE_BUF)
            _signal(hid_ready + p)
            if REC:
                _record_tile(trace_ptr, tile, total, TR_GU, t_start, t_ready, t_done)
        elif kind == GU_EMPTY:
            _signal(hid_ready + p)
        elif kind == DN:
            acc0, acc1, it, t_ready = _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout, TRACE=REC)
            t_done = _now() if REC else _zero64()
            _down_epilogue(acc0, acc1, yr_desc, c0_s, c1_s, a_row + ROWS0, col, ONE_BUF)
            if REC:
                _record_tile(trace_ptr, tile, total, TR_DN, t_start, t_ready, t_done)
        elif kind == SH_DN:
            acc0, acc1, it, t_ready = _mma_tile(a_s, b0_s, b1_s, ready, empty, ks, it, ROWS0, layout, TRACE=REC)
            t_done = _now() if REC else _zero64()
            _down_epilogue(acc0, acc1, ys_desc, c0_s, c1_s, a_row + ROWS0, col, ONE_BUF)
            if REC:
                _record_tile(trace_ptr, tile, total, TR_SH_DN, t_start, t_ready, t_done)
    tma.store_wait(pendings=0)


@gluon.jit
def _record_wait(trace_ptr, slot, t_start):
    """A traced counter poll (the producer): from ``t_start`` to now, all wait."""
    t = _now()
    _trace_event(trace_ptr, slot, TR_WAIT, t_start, t, t)


@gluon.jit
def _load(a_s, b0_s, b1_s, ready, empty, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr,
          peer_rank_ptr, peer_tok_ptr, x_ptr,
          xl_desc, xr_desc, hid_desc, shid_desc, w13_desc, w2_desc, sw13_desc, sw2_desc,
          trace_ptr, T, H, I, S, K, NMB, NSLOT, total, max_spin,
          LAG: gl.constexpr, MAC: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr, HAS_SHARED: gl.constexpr,
          GATHER: gl.constexpr, TRACE: gl.constexpr):
    """The producer: every tile's wait, then its K steps into the ring. With TRACE each counter poll is
    recorded."""
    num_rows = gl.load(num_rows_ptr)
    nprog = gl.num_programs(0)
    n_sh_gu = 0
    if HAS_SHARED:
        n_sh_gu = ((T + BM - 1) // BM) * (S // BN)
    per_mb_gu = (MB // BM) * (I // BN)
    it = 0
    for tile in range(gl.program_id(0), total, nprog):
        kind, p, a_row, b0, b1, ks, col = _decode(tile, T, H, I, S, NMB, NSLOT, num_rows, tile_expert_ptr,
                                                  expert_offsets_ptr, LAG, MAC, MB, TGM, HAS_SHARED)
        if kind == SH_GU:
            it = _load_tile(xl_desc, sw13_desc, a_row, b0, b1, ks, it, a_s, b0_s, b1_s, ready, empty, GATHER)
        elif kind == GU:
            if GATHER:  # a_row is the schedule row: the Gluon forward's ring is resident
                it = _gather_tile(x_ptr, peer_rank_ptr, peer_tok_ptr, num_rows, K, H, w13_desc, a_row, b0, b1, ks,
                                  it, a_s, b0_s, b1_s, ready, empty)
            else:
                t_start = _now() if TRACE else _zero64()
                _wait_geq(cnt_ptr + p, nprog, err_ptr, max_spin)  # x_ready: every program pulled its share
                if TRACE:
                    _record_wait(trace_ptr, 2 * total + tile, t_start)
                it = _load_tile(xr_desc, w13_desc, a_row, b0, b1, ks, it, a_s, b0_s, b1_s, ready, empty, GATHER)
        elif kind == DN:
            t_start = _now() if TRACE else _zero64()
            _wait_geq(cnt_ptr + NMB + p, 2 * per_mb_gu, err_ptr, max_spin)  # hid_ready: both groups of each tile
            if TRACE:
                _record_wait(trace_ptr, 2 * total + tile, t_start)
            it = _load_tile(hid_desc, w2_desc, a_row, b0, b1, ks, it, a_s, b0_s, b1_s, ready, empty, GATHER)
        elif kind == SH_DN:
            t_start = _now() if TRACE else _zero64()
            _wait_geq(cnt_ptr + 4 * NMB, 2 * n_sh_gu, err_ptr, max_spin)  # shared_ready
            if TRACE:
                _record_wait(trace_ptr, 2 * total + tile, t_start)
            it = _load_tile(shid_desc, sw2_desc, a_row, b0, b1, ks, it, a_s, b0_s, b1_s, ready, empty, GATHER)


@gluon.jit
def _partition(ROLE: gl.constexpr, LAG: gl.constexpr, MAC: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr,
               HAS_LIMIT: gl.constexpr, HAS_SHARED: gl.constexpr, ONE_BUF: gl.constexpr, GATHER: gl.constexpr,
               TRACE: gl.constexpr, a_s, b0_s, b1_s, c00_s, c01_s, c10_s, c11_s, ready, empty,
               tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr, peer_rank_ptr, peer_tok_ptr,
               x_ptr, hid_st, gu_st, shid_st, sgu_st,
               xl_desc, xr_desc, hid_desc, shid_desc, w13_desc, w2_desc, sw13_desc, sw2_desc, yr_desc, ys_desc,
               trace_ptr, T, H, I, S, K, NMB, NSLOT, swiglu_limit, total, max_spin, SAVE_GU):
    """ROLE 0 / 1: the math groups of each tile's rows 0-63 / 64-127; ROLE 2: the producer (one warp, or four
    with GATHER). The constexprs come first, beside ROLE in each partition's literal tuple: passed inside the
    shared argument tuple, warp_specialize hands them to the partitions as runtime values."""
    if ROLE == 2:
        _load(a_s, b0_s, b1_s, ready, empty, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr,
              peer_rank_ptr, peer_tok_ptr, x_ptr,
              xl_desc, xr_desc, hid_desc, shid_desc, w13_desc, w2_desc, sw13_desc, sw2_desc,
              trace_ptr, T, H, I, S, K, NMB, NSLOT, total, max_spin, LAG, MAC, MB, TGM, HAS_SHARED, GATHER, TRACE)
    elif ROLE == 0:  # (math group 0 records the trace's tile events)
        _math(0, a_s, b0_s, b1_s, c00_s, c01_s, ready, empty, tile_expert_ptr, expert_offsets_ptr, num_rows_ptr,
              cnt_ptr, hid_st, gu_st, shid_st, sgu_st, xr_desc, yr_desc, ys_desc, trace_ptr, T, H, I, S, NMB, NSLOT,
              swiglu_limit, total, LAG, MAC, MB, TGM, HAS_LIMIT, HAS_SHARED, SAVE_GU, ONE_BUF, GATHER, TRACE)
    else:
        _math(HALF, a_s, b0_s, b1_s, c10_s, c11_s, ready, empty, tile_expert_ptr, expert_offsets_ptr,
              num_rows_ptr, cnt_ptr, hid_st, gu_st, shid_st, sgu_st, xr_desc, yr_desc, ys_desc, trace_ptr, T, H, I,
              S, NMB, NSLOT, swiglu_limit, total, LAG, MAC, MB, TGM, HAS_LIMIT, HAS_SHARED, SAVE_GU, ONE_BUF, GATHER,
              False)


@gluon.jit
def _pull_share(peer_rank_ptr, peer_tok_ptr, x_ptr, xr_ptr, row0, brow0, num_rows, K, H,
                MB: gl.constexpr, ROWS: gl.constexpr, BLOCK_H: gl.constexpr, ZERO_PADDING: gl.constexpr):
    """This program's ROWS-row chunks of the minibatch at schedule row ``row0`` (chunks pid, pid + nprog, ...):
    x[t] of each routed row into ring row ``brow0 + ..``, 16-byte vectors (megakernel_fwd._pull_chunks with one
    rank). ZERO_PADDING: padding rows written as zeros (kept for the backward, whose weight gradients sum them)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rl: gl.constexpr = gl.SliceLayout(1, layout)
    cl: gl.constexpr = gl.SliceLayout(0, layout)
    for ch in range(gl.program_id(0), MB // ROWS, gl.num_programs(0)):
        r = row0 + ch * ROWS + gl.arange(0, ROWS, layout=rl)
        pr = gl.load(peer_rank_ptr + r, mask=r < num_rows, other=-1)
        pt = gl.load(peer_tok_ptr + r, mask=r < num_rows, other=0)
        ok = pr >= 0
        src = (pt // K).to(gl.int64) * H
        dst = (brow0 + ch * ROWS + gl.arange(0, ROWS, layout=rl)).to(gl.int64) * H
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + gl.arange(0, BLOCK_H, layout=cl)
            v = gl.load(x_ptr + src[:, None] + cols[None, :], mask=ok[:, None] & (cols < H)[None, :], other=0.0)
            if ZERO_PADDING:
                gl.store(xr_ptr + dst[:, None] + cols[None, :], v, mask=(cols < H)[None, :] & (dst >= 0)[:, None])
            else:
                gl.store(xr_ptr + dst[:, None] + cols[None, :], v, mask=ok[:, None] & (cols < H)[None, :])


@gluon.jit
def forward_kernel(
    peer_rank_ptr,  # [C] int32, -1 = padding (the schedule's)
    peer_tok_ptr,  # [C] int32, t*K + j
    tile_expert_ptr,  # [C // BM] int32, local expert per row tile, -1 past num_rows
    expert_offsets_ptr,  # [L + 1] int32, first row of each expert's padded segment
    num_rows_ptr,  # [1] int32
    num_invalid_ptr,  # [1] int32, out-of-range expert ids in the routing
    x_ptr,  # [T, H] this rank's x
    xr_ptr,  # [MAC, H] routed x rows
    hid_st,  # hidden [MAC, I], blocks [HALF, BN] (stores: the routed hidden rows)
    gu_st,  # kept gate|up [MAC, 2I], x's dtype, blocks [HALF, BN] (stores; SAVE_GU, else a stand-in)
    shid_st,  # shared hidden [T, S], blocks [HALF, BN] (stores; a stand-in without a shared expert)
    sgu_st,  # the shared expert's kept gate|up [T, 2S], blocks [HALF, BN] (stores; SAVE_GU with HAS_SHARED)
    xl_desc,  # x [T, H], blocks [BM, BK]
    xr_desc,  # x_routed [MAC, H], blocks [BM, BK]
    hid_desc,  # hidden [MAC, I], blocks [BM, BK]
    shid_desc,  # shared hidden [T, S], blocks [BM, BK] (a stand-in without a shared expert)
    w13_desc,  # w13 viewed [L*2I, H], blocks [BN, BK]
    w2_desc,  # w2 viewed [L*H, I], blocks [BN, BK]
    sw13_desc,  # shared w13 [2S, H], blocks [BN, BK] (a stand-in without a shared expert)
    sw2_desc,  # shared w2 [H, S], blocks [BN, BK] (a stand-in without a shared expert)
    yr_desc,  # y_routed [MAC, H], blocks [HALF, BN] (stores)
    ys_desc,  # y_shared [T, H], blocks [HALF, BN] (stores; rows past T are dropped by TMA)
    cnt_ptr,  # [4 * NMB + 1] int32 counters, zeroed before launch (megakernel_fwd's layout)
    err_ptr,  # [1] int32 error flag
    trace_ptr,  # [3 * total + NMB * programs, 5] int64 events (TRACE; else a placeholder, never touched)
    T, H, I, S, K, NMB, NSLOT, swiglu_limit, max_spin,
    SAVE_GU,  # 1: keep the gate|up in x's dtype (gu_st, sgu_st) and write padding rows of x_routed as zeros
    LAG: gl.constexpr, MAC: gl.constexpr, MB: gl.constexpr, TGM: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_H: gl.constexpr,
    HAS_LIMIT: gl.constexpr, HAS_SHARED: gl.constexpr, ZERO_PADDING: gl.constexpr,
    STAGES: gl.constexpr = 3, ONE_BUF: gl.constexpr = False, GATHER: gl.constexpr = False,
    TRACE: gl.constexpr = False,
):
    """Launched with num_warps=4 (the default partition is math group 0; the pull runs on it first) and
    maxnreg=168, as wgrad_gluon.gluon_wgrad_kernel: the partitions then take 256 / 224 / 24 registers.
    Shared memory: STAGES x 48 KB of operands and 4 x 16 KB of store buffers (3 stages: 208 KB of the 227 KB),
    or with ONE_BUF one 16 KB buffer a math group (4 stages: 224 KB)."""
    num_rows = gl.load(num_rows_ptr)
    if gl.program_id(0) == 0:
        if gl.load(num_invalid_ptr) > 0:
            gl.atomic_or(err_ptr, 2)  # megakernel_fwd.ERR_BAD_EXPERT_ID
    n_sh_rt = (T + BM - 1) // BM
    n_sh = 0
    if HAS_SHARED:
        n_sh = n_sh_rt * (S // BN) + n_sh_rt * (H // (2 * BN))
    total = n_sh + (NMB + LAG) * ((MB // BM) * (I // BN + H // (2 * BN)))
    # the pull: this program's share of every minibatch, then x_ready[p] (GATHER: none, the producer gathers)
    if not GATHER:
        for p in range(0, NMB):
            row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
            if live:
                t_start = _now() if TRACE else _zero64()
                _pull_share(peer_rank_ptr, peer_tok_ptr, x_ptr, xr_ptr, row0, (p % NSLOT) * MB, num_rows, K, H,
                            MB, ROWS, BLOCK_H, ZERO_PADDING)
                _signal(cnt_ptr + p)
                if TRACE:
                    _trace_event(trace_ptr, 3 * total + p * gl.num_programs(0) + gl.program_id(0), TR_PULL, t_start,
                                 t_start, _now())

    a_s = gl.allocate_shared_memory(xr_desc.dtype, [STAGES, BM, BK], xr_desc.layout)
    b0_s = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, BN, BK], w13_desc.layout)
    b1_s = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, BN, BK], w13_desc.layout)
    c00_s = gl.allocate_shared_memory(yr_desc.dtype, [HALF, BN], yr_desc.layout)
    c10_s = gl.allocate_shared_memory(yr_desc.dtype, [HALF, BN], yr_desc.layout)
    if ONE_BUF:
        c01_s = c00_s
        c11_s = c10_s
    else:
        c01_s = gl.allocate_shared_memory(yr_desc.dtype, [HALF, BN], yr_desc.layout)
        c11_s = gl.allocate_shared_memory(yr_desc.dtype, [HALF, BN], yr_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2 if GATHER else 1)
        mbarrier.init(empty.index(i), count=2)
    args = (a_s, b0_s, b1_s, c00_s, c01_s, c10_s, c11_s, ready, empty,
            tile_expert_ptr, expert_offsets_ptr, num_rows_ptr, cnt_ptr, err_ptr, peer_rank_ptr, peer_tok_ptr,
            x_ptr, hid_st, gu_st, shid_st, sgu_st,
            xl_desc, xr_desc, hid_desc, shid_desc, w13_desc, w2_desc, sw13_desc, sw2_desc, yr_desc, ys_desc,
            trace_ptr, T, H, I, S, K, NMB, NSLOT, swiglu_limit, total, max_spin, SAVE_GU)
    # the producer: 4 warps with GATHER (its gather holds 8 row pointers a thread), else 1; registers to match
    PRODUCER_WARPS: gl.constexpr = 4 if GATHER else 1
    MATH_REGS: gl.constexpr = 208 if GATHER else 224
    PRODUCER_REGS: gl.constexpr = 48 if GATHER else 24
    gl.warp_specialize([(_partition, (0, LAG, MAC, MB, TGM, HAS_LIMIT, HAS_SHARED, ONE_BUF, GATHER, TRACE) + args),
                        (_partition, (1, LAG, MAC, MB, TGM, HAS_LIMIT, HAS_SHARED, ONE_BUF, GATHER, TRACE) + args),
                        (_partition, (2, LAG, MAC, MB, TGM, HAS_LIMIT, HAS_SHARED, ONE_BUF, GATHER, TRACE) + args)],
                       [4, PRODUCER_WARPS], [MATH_REGS, PRODUCER_REGS])
