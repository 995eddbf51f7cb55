"""Forward megakernel ``dispatch_mlp_swiglu_combine`` and its epilogue (Triton only).

One persistent launch per rank. Programs [0, C) are communication programs,
the rest compute programs (docs/design.md "The pipeline, per rank (forward)"):

- comm, per minibatch p in processing order: pull the routed rows from the
  source ranks' ``x`` (peer pointer table) into the ring slot, bump
  ``x_ready[p]``; D minibatches later, wait ``y_ready[p]`` and push the
  finished rows into the origin ranks' combine buffers, bump ``done[p]``.
- compute, over one global tile sequence (a topological order, so a
  round-robin walk cannot deadlock): shared-expert gate|up tiles, then per
  minibatch its gate|up+SwiGLU tiles (wait ``x_ready``) and its down tiles
  (wait ``hid_ready``), then the shared-expert down tiles. Round j holds
  gu(j) then dn(j - LAG) so down work overlaps the next gate|up work; inside
  a minibatch tiles go n-tile-major, so the row tiles of one expert load the
  same weight tile at about the same time and share it through L2.

Ring: buffers hold ``MAC`` rows = ``NSLOT`` minibatch slots. Processing index
p maps to macrobatch ``nmac - 1 - p // NSLOT`` (reverse order, so macrobatch 0
stays resident for the backward) and slot ``p % NSLOT``. Pulling into a slot
waits until its previous occupant was pushed (``done[p - NSLOT]``).

Every wait is bounded: after ``max_spin`` polls, or once another program has
flagged an error, it sets ``err`` and gives up, so a broken launch ends with
an error flag instead of a hang.

Under the Triton interpreter programs run one after another, so the launcher
runs one role (``phase``) over one minibatch range per launch; on a GPU one
launch runs every phase concurrently.

Counters are int32, bumped with ``sem="release"`` after a CTA barrier and
polled with ``sem="acquire"``; atomics never touch data.
"""

import triton
import triton.language as tl

from kittenmoe.kernels.quant import HW_E4M3_CVT as COMPILED  # True unless the interpreter runs the kernels
from kittenmoe.kernels.quant import e4m3_to_f32, quantize_rows_1xb

# phase bits
PH_SHARED_GU = 1
PH_PULL = 2
PH_GATEUP = 4
PH_DOWN = 8
PH_PUSH = 16
PH_SHARED_DOWN = 32
PH_ALL = 63

# error flag bits
ERR_TIMEOUT = 1
ERR_BAD_EXPERT_ID = 2

# counter layout: [x_ready | hid_ready | y_ready | done] each NMB long, then shared_ready
CNT_X, CNT_HID, CNT_Y, CNT_DONE = 0, 1, 2, 3


@triton.jit
def _proxy_fence():
    """``fence.proxy.async.global`` (compiled only; the interpreter has no proxies).

    Rows one program writes with ordinary stores (the generic proxy) are read by other programs through TMA
    (the async proxy), and the PTX memory model orders accesses to one location across proxies only
    through a proxy fence. So a signal fences after the writer's stores, and a wait fences after its acquire,
    before the reader's TMA loads. Without the fences every GPU test passed (H200), so
    this is the memory model's requirement, not a fix of an observed failure."""
    if COMPILED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _wait_geq(cnt_ptr, target, err_ptr, max_spin):
    v = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    e = tl.atomic_add(err_ptr, 0, sem="relaxed")
    n = 0
    # Give up early only once some wait has timed out (bit 1); a bad-expert-id
    # flag (bit 2) must not abandon the valid routes.
    while (v < target) & (n < max_spin) & ((e & 1) == 0):
        v = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        e = tl.atomic_add(err_ptr, 0, sem="relaxed")
        n += 1
    if v < target:
        tl.atomic_or(err_ptr, 1)  # ERR_TIMEOUT
    tl.debug_barrier()
    _proxy_fence()  # what the writer released is read next, possibly through TMA


@triton.jit
def _signal(cnt_ptr):
    _proxy_fence()  # this thread's stores may be read through TMA by the programs that wait on cnt_ptr
    tl.debug_barrier()  # every thread's stores happen before the release
    tl.atomic_add(cnt_ptr, 1, sem="release")


# Trace event kinds (``kittenmoe.trace.KINDS`` in this order): what a program did between two timestamps.
TR_SHARED_GU = tl.constexpr(0)
TR_GATEUP = tl.constexpr(1)
TR_DOWN = tl.constexpr(2)
TR_SHARED_DOWN = tl.constexpr(3)
TR_PULL = tl.constexpr(4)
TR_PUSH = tl.constexpr(5)


@triton.jit
def _now():
    """The GPU's global nanosecond timer (``%globaltimer``, one clock for every SM); 0 under the interpreter."""
    if COMPILED:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return tl.full((), 0, tl.int64)


@triton.jit
def _trace_event(trace_ptr, slot, MAXE: tl.constexpr, kind: tl.constexpr, t_start, t_ready, t_end):
    """Record one event: trace_ptr [MAXE, 5] int64 rows (kind, program, start, when its wait returned, end).
    ``slot`` names the unit of work, not the program, so no two events of a launch share one, whether every
    role runs in one launch or (the interpreter) one launch per role: a GEMM tile's index over the whole
    forward, then one slot per (comm program, processing index, pull or push). A push's processing index is
    its minibatch plus the launch's pull_ahead, so push slots differ between the two launch modes; nothing
    reads slot positions. Slots past MAXE are dropped (the launcher sizes MAXE so none is)."""
    if slot < MAXE:
        c = tl.arange(0, 8)
        v = tl.where(c == 0, kind, tl.where(c == 1, tl.program_id(0),
                     tl.where(c == 2, t_start, tl.where(c == 3, t_ready, t_end)))).to(tl.int64)
        tl.store(trace_ptr + slot * 5 + c, v, mask=c < 5)  # slot * 5 < MAXE * 5: a few 100 k at most


@triton.jit
def _peer_rows(ptrs_ptr, pr, ok, DT: tl.constexpr):
    """Typed base pointer of each row's peer buffer (``ptrs_ptr[pr]``; rank -1 rows read 0, masked later).

    Every peer buffer is 16-byte aligned (checked where the tables are built: ``peers.PEER_ALIGN_BYTES``).
    Saying so lets rows move as 16-byte vectors: without it Triton cannot see through the loaded
    address and issues 2-byte loads and stores (64 per thread per 32 x 512 chunk, ~32 GB/s per SM)."""
    return tl.multiple_of(tl.load(ptrs_ptr + pr, mask=ok, other=0).to(tl.pointer_type(DT)), 16)


@triton.jit
def _tile_rc(i, NT, RT: tl.constexpr, G: tl.constexpr, mb_tile0, tile_expert_ptr, expert_offsets_ptr, n_tiles,
             BM: tl.constexpr):
    """(row tile, column tile) of a minibatch's i-th GEMM tile, i < RT * NT (RT row tiles, NT column tiles):
    groups of G row tiles, each walked column tile by column tile (G = 0 or >= RT: the whole minibatch is one
    group, KernelConfig.tile_group_m's default; a smaller last group when G does not divide RT). G = -1: each
    expert's run of row tiles in the minibatch is a group, so a wave of programs reads few experts' rows many
    times while they are in L2 and every weight tile still serves all its expert's row tiles at once. A run of
    n row tiles takes n * NT consecutive indices, so the run holding index i holds row tile i // NT; mb_tile0 is
    the minibatch's first schedule row tile, n_tiles the schedule's row tiles in use, expert_offsets_ptr [L + 1]
    the padded segments' first rows (the schedule's)."""
    if G == -1:
        q = i // NT
        e = tl.load(tile_expert_ptr + mb_tile0 + q, mask=mb_tile0 + q < n_tiles, other=-1)
        s = q
        n = 1
        if e >= 0:
            s = tl.maximum(tl.load(expert_offsets_ptr + e) // BM, mb_tile0) - mb_tile0
            n = tl.minimum(tl.load(expert_offsets_ptr + e + 1) // BM, mb_tile0 + RT) - mb_tile0 - s
        w = i - NT * s
        rt = s + w % n
        nt = w // n
    elif (G == 0) or (G >= RT):
        rt = i % RT
        nt = i // RT
    else:
        grp = i // (G * NT)
        w = i % (G * NT)
        gsz = tl.minimum(RT - grp * G, G)
        rt = grp * G + w % gsz
        nt = w // gsz
    return rt, nt


@triton.jit
def _mb_rows(p, num_rows, NSLOT, MAC: tl.constexpr, MB: tl.constexpr):
    """First routed row of processing index p (reverse macrobatch order) and whether it holds rows."""
    nmac = (num_rows + MAC - 1) // MAC
    q = p // NSLOT
    m = nmac - 1 - q
    row0 = m * MAC + (p % NSLOT) * MB
    live = (m >= 0) & (row0 < num_rows)
    return row0, live


@triton.jit
def _copy_rows(src_base, dst_base, valid, H, BLOCK_H: tl.constexpr, ZERO_INVALID: tl.constexpr):
    """dst_base[r, :H] = src_base[r, :H] for valid rows; bases are [ROWS] pointer vectors. ZERO_INVALID:
    invalid rows are written as zeros (every dst row must then be writable)."""
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        _store_chunk(dst_base, cols, _load_chunk(src_base, cols, valid, H), valid, H, ZERO_INVALID)


@triton.jit
def _load_chunk(src_base, cols, valid, H):
    """src_base[r, cols] for valid rows (0 elsewhere and past H); src_base a [ROWS] pointer vector."""
    return tl.load(src_base[:, None] + cols[None, :], mask=valid[:, None] & (cols < H)[None, :], other=0.0)


@triton.jit
def _store_chunk(dst_base, cols, v, valid, H, ZERO_INVALID: tl.constexpr):
    """dst_base[r, cols] = v for valid rows, or for every row (the zeros loaded for invalid ones) with
    ZERO_INVALID; nothing past H."""
    if ZERO_INVALID:
        tl.store(dst_base[:, None] + cols[None, :], v, mask=(cols < H)[None, :])
    else:
        tl.store(dst_base[:, None] + cols[None, :], v, mask=valid[:, None] & (cols < H)[None, :])


@triton.jit
def _gateup_acc(a_ptr, a_row0, a_rows, w_ptr, n0, H, I,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (A W_gate^T, A W_up^T) for one BM x BN tile through pointer loads.

    a_ptr: [*, H] rows; w_ptr: one expert's [2I, H] (gate rows then up rows).
    Rows >= a_rows read as 0.
    """
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < a_rows
    rows = (a_row0 + rm).to(tl.int64)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + rk
        k_ok = kk < H
        a = tl.load(a_ptr + rows[:, None] * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wm = (rn < I)[None, :] & k_ok[:, None]
        wg = tl.load(w_ptr + rn[None, :].to(tl.int64) * H + kk[:, None], mask=wm, other=0.0)
        wu = tl.load(w_ptr + (rn + I)[None, :].to(tl.int64) * H + kk[:, None], mask=wm, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.jit
def _gateup_acc_tma(a_desc, a_row0, w_desc, wg_row0, wu_row0, H,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """As ``_gateup_acc`` through TMA descriptors: a_desc blocks [BM, BK], w_desc blocks [BN, BK]
    of the [L*2I, H] weight view; out-of-bounds rows of A arrive as 0."""
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, H, BK):
        a = a_desc.load([a_row0, k0])
        wg = w_desc.load([wg_row0, k0])
        wu = w_desc.load([wu_row0, k0])
        acc_g = tl.dot(a, wg.T, acc_g)
        acc_u = tl.dot(a, wu.T, acc_u)
    return acc_g, acc_u


@triton.jit
def _swiglu_store(acc_g, acc_u, out_ptr, out_row0, n_rows, n0, I, swiglu_limit,
                  HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out[out_row0 + m, n0 + n] = silu(g) * u (clamped when HAS_LIMIT) for rows m < n_rows; out: [*, I]."""
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, swiglu_limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
    hid = acc_g * tl.sigmoid(acc_g) * acc_u
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rows = (out_row0 + rm).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * I + rn[None, :], hid.to(out_ptr.dtype.element_ty),
             mask=(rm < n_rows)[:, None] & (rn < I)[None, :])


@triton.jit
def _down_acc(a_ptr, a_row0, a_rows, w_ptr, n0, H, I,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (A W^T)[a_row0 + m, n0 + n] for one BM x BN tile; a_ptr: [*, I] hidden, w_ptr: [H, I]."""
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < a_rows
    rows = (a_row0 + rm).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + rk
        k_ok = kk < I
        a = tl.load(a_ptr + rows[:, None] * I + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * I + kk[:, None], mask=(rn < H)[None, :] & k_ok[:, None],
                    other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _down_acc_tma(a_desc, a_row0, w_desc, w_row0, I,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """As ``_down_acc`` through TMA descriptors: a_desc blocks [BM, BK] of hidden, w_desc blocks [BN, BK]."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        a = a_desc.load([a_row0, k0])
        w = w_desc.load([w_row0, k0])
        acc = tl.dot(a, w.T, acc)
    return acc


@triton.jit
def _store_rows(row_base, row_ok, acc, n0, H, BN: tl.constexpr):
    """row_base[m][n0 + n] = acc[m, n] for rows with row_ok; row_base is a [BM] pointer vector."""
    rn = n0 + tl.arange(0, BN)
    tl.store(row_base[:, None] + rn[None, :], acc.to(row_base.dtype.element_ty),
             mask=row_ok[:, None] & (rn < H)[None, :])


@triton.jit
def _store_gate_up(gu_ptr, brow, acc_g, acc_u, n0, I, BM: tl.constexpr, BN: tl.constexpr, n_rows=None):
    """SAVE_GU: a tile's gate and up pre-activations into the kept [*, 2I] buffer in x's dtype (gate columns n0..,
    up columns I + n0..), rows brow.. of the ring; the backward reads them instead of replaying the GEMM.
    n_rows: the tile's rows that exist (the shared expert's last row tile of T); None: all BM (routed row
    tiles are padded whole)."""
    rows = gu_ptr + (brow + tl.arange(0, BM)).to(tl.int64) * (2 * I)
    if n_rows is None:
        row_ok = tl.arange(0, BM) >= 0
    else:
        row_ok = tl.arange(0, BM) < n_rows
    _store_rows(rows, row_ok, acc_g, n0, I, BN)
    _store_rows(rows + I, row_ok, acc_u, n0, I, BN)


# ----------------------------------------------------------------------------- FP8 (e4m3, 1 x SB / SB x SB scales)
# Routed GEMMs on e4m3 operands, one K step per scale block (SB: 128, or MXFP8's 32): each step's fp32 product
# is scaled by the row's activation scale and the weight block's scale and added to the fp32 accumulator
# (DeepSeek-V3's promotion). Operands are uint8 buffers of e4m3 bits; EMULATE (the interpreter) decodes them to
# fp32 and multiplies in fp32, a GPU reinterprets them as float8e4nv for the tensor cores.


@triton.jit
def _fp8_operand(bits, EMULATE: tl.constexpr):
    if EMULATE:
        return e4m3_to_f32(bits)
    return bits.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _pull_rows_fp8(src_base, dst_q, dst_s, dst_keep, valid, H, HB, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                   SB: tl.constexpr, POW2: tl.constexpr, KEEP: tl.constexpr):
    """Quantise rows on their way in: dst_q[r, :H] = e4m3 bits of src[r, :H] * (1 / scale), dst_s[r, :HB] = the
    1 x SB scales. dst_q / dst_s: [ROWS] pointer vectors into x_routed (uint8 [*, H]) and its scales (fp32 [*, HB]).
    With KEEP the rows also go unquantised to dst_keep ([ROWS] pointers into [*, H] of x's dtype).
    Invalid rows (padding) are written as zeros with the minimum scale: every ring row holds finite values."""
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(src_base[:, None] + cols[None, :], mask=valid[:, None] & (cols < H)[None, :], other=0.0)
        if KEEP:  # padding rows as zeros: the backward's weight-gradient sums need no row mask
            tl.store(dst_keep[:, None] + cols[None, :], v, mask=(cols < H)[None, :])
        store_chunk_fp8(v, dst_q, dst_s, h0, H, HB, ROWS, BLOCK_H, SB, POW2)


@triton.jit
def store_chunk_fp8(v, dst_q, dst_s, h0, H, HB, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, SB: tl.constexpr,
                    POW2: tl.constexpr):
    """One [ROWS, BLOCK_H] chunk of rows (columns h0..) quantised 1 x SB: e4m3 bits to dst_q[r, h0..] and the
    scales to dst_s[r, h0 / SB..]; dst_q / dst_s are [ROWS] pointer vectors (uint8 [*, H], fp32 [*, HB])."""
    cols = h0 + tl.arange(0, BLOCK_H)
    bits, scale = quantize_rows_1xb(v.to(tl.float32), ROWS, BLOCK_H, SB, POW2)
    tl.store(dst_q[:, None] + cols[None, :], bits, mask=(cols < H)[None, :])
    sb = h0 // SB + tl.arange(0, BLOCK_H // SB)
    tl.store(dst_s[:, None] + sb[None, :], scale, mask=(sb < HB)[None, :])


@triton.jit
def _gateup_acc_fp8(a_ptr, as_ptr, a_row0, w_ptr, ws_ptr, nt, H, I, HB,
                    BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 (A W_gate^T, A W_up^T) of one BM x BN tile through pointer loads, K steps of one scale block (SB);
    a tile narrower than SB sits in one weight-scale row, a wider one (MXFP8's SB = 32) spans BN / SB of them.

    a_ptr: uint8 [*, H] e4m3 rows, as_ptr: fp32 [*, HB] their scales; w_ptr: one expert's uint8 [2I, H],
    ws_ptr: its fp32 [2I / SB, HB] block scales (gate blocks then up blocks). H and I are multiples of SB."""
    rm = tl.arange(0, BM)
    rn = nt * BN + tl.arange(0, BN)
    rk = tl.arange(0, SB)
    rows = (a_row0 + rm).to(tl.int64)
    sn = (nt * BN + tl.arange(0, BN)) // SB  # each column's weight-scale row (one per tile when BN <= SB)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, SB):
        kb = k0 // SB
        kk = k0 + rk
        a = _fp8_operand(tl.load(a_ptr + rows[:, None] * H + kk[None, :]), EMULATE)
        wg = _fp8_operand(tl.load(w_ptr + rn[None, :].to(tl.int64) * H + kk[:, None]), EMULATE)
        wu = _fp8_operand(tl.load(w_ptr + (rn + I)[None, :].to(tl.int64) * H + kk[:, None]), EMULATE)
        sa = tl.load(as_ptr + rows * HB + kb)
        sg = tl.load(ws_ptr + sn * HB + kb)
        su = tl.load(ws_ptr + (I // SB + sn) * HB + kb)
        if EMULATE:
            pg = tl.dot(a, wg, input_precision="ieee")
            pu = tl.dot(a, wu, input_precision="ieee")
        else:
            pg = tl.dot(a, wg)
            pu = tl.dot(a, wu)
        acc_g += pg * (sa[:, None] * sg[None, :])
        acc_u += pu * (sa[:, None] * su[None, :])
    return acc_g, acc_u


@triton.jit
def _gateup_acc_fp8_tma(a_desc, as_ptr, a_row0, w_desc, ws_ptr, wg_row0, wu_row0, nt, H, I, HB,
                        BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr):
    """As ``_gateup_acc_fp8`` with float8e4nv TMA descriptors: a_desc blocks [BM, SB] of x_routed, w_desc
    blocks [BN, SB] of the [L*2I, H] weight view (gate rows wg_row0.., up rows wu_row0..)."""
    rows = (a_row0 + tl.arange(0, BM)).to(tl.int64)
    sn = (nt * BN + tl.arange(0, BN)) // SB  # each column's weight-scale row
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, SB):
        kb = k0 // SB
        a = a_desc.load([a_row0, k0])
        wg = w_desc.load([wg_row0, k0])
        wu = w_desc.load([wu_row0, k0])
        sa = tl.load(as_ptr + rows * HB + kb)
        sg = tl.load(ws_ptr + sn * HB + kb)
        su = tl.load(ws_ptr + (I // SB + sn) * HB + kb)
        acc_g += tl.dot(a, wg.T) * (sa[:, None] * sg[None, :])
        acc_u += tl.dot(a, wu.T) * (sa[:, None] * su[None, :])
    return acc_g, acc_u


@triton.jit
def _swiglu_store_fp8(acc_g, acc_u, q_ptr, s_ptr, row0, nt, I, IB, swiglu_limit,
                      HAS_LIMIT: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      SB: tl.constexpr):
    """hidden = silu(g) * u (clamped when HAS_LIMIT), quantised 1 x SB (BN a multiple of SB: BN / SB scales a
    row): q_ptr uint8 [*, I] e4m3 bits, s_ptr fp32 [*, IB] (columns nt * BN / SB..)."""
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, swiglu_limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
    hid = acc_g * tl.sigmoid(acc_g) * acc_u
    bits, scale = quantize_rows_1xb(hid, BM, BN, SB, POW2)
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    rn = nt * BN + tl.arange(0, BN)
    tl.store(q_ptr + rows[:, None] * I + rn[None, :], bits)
    sc = (nt * BN) // SB + tl.arange(0, BN // SB)
    tl.store(s_ptr + rows[:, None] * IB + sc[None, :], scale)


@triton.jit
def _down_acc_fp8(a_ptr, as_ptr, a_row0, w_ptr, ws_ptr, n0, H, I, IB,
                  BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 (A W^T) of one BM x BN tile, A = hidden e4m3 (uint8 [*, I], scales fp32 [*, IB]); w_ptr: one expert's
    uint8 [H, I], ws_ptr: its fp32 [H / SB, IB]. A BN-wide tile spans BN / SB weight-scale rows."""
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, SB)
    rows = (a_row0 + rm).to(tl.int64)
    n_ok = rn < H  # the last BN-wide tile may pass H (H a multiple of SB, not of BN): masked, never read
    sw_rows = (tl.minimum(rn, H - 1) // SB) * IB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, SB):
        kb = k0 // SB
        kk = k0 + rk
        a = _fp8_operand(tl.load(a_ptr + rows[:, None] * I + kk[None, :]), EMULATE)
        w = _fp8_operand(tl.load(w_ptr + rn[None, :].to(tl.int64) * I + kk[:, None], mask=n_ok[None, :], other=0),
                         EMULATE)
        sa = tl.load(as_ptr + rows * IB + kb)
        sw = tl.load(ws_ptr + sw_rows + kb)
        if EMULATE:
            p = tl.dot(a, w, input_precision="ieee")
        else:
            p = tl.dot(a, w)
        acc += p * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _down_acc_fp8_tma(a_desc, as_ptr, a_row0, w_desc, ws_ptr, w_row0, n0, I, IB,
                      BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr):
    """As ``_down_acc_fp8`` with float8e4nv TMA descriptors: a_desc blocks [BM, SB] of hidden, w_desc blocks
    [BN, SB] of the [L*H, I] view (rows w_row0.., this expert's n0..)."""
    rows = (a_row0 + tl.arange(0, BM)).to(tl.int64)
    sw_rows = ((n0 + tl.arange(0, BN)) // SB) * IB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, SB):
        kb = k0 // SB
        a = a_desc.load([a_row0, k0])
        w = w_desc.load([w_row0, k0])
        sa = tl.load(as_ptr + rows * IB + kb)
        sw = tl.load(ws_ptr + sw_rows + kb)
        acc += tl.dot(a, w.T) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, xr_ptr, xs_ptr, xk_ptr, row0, brow0, num_rows, puller,
                 n_pullers, K, H, HB, DT: tl.constexpr, MB: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                 SB: tl.constexpr, POW2: tl.constexpr, FP8: tl.constexpr, SAVE_GU: tl.constexpr):
    """Program ``puller`` of ``n_pullers`` pulls its ROWS-row chunks of the minibatch at schedule row ``row0``
    (chunks puller, puller + n_pullers, ...) from the source ranks' x into ring rows ``brow0``.. (FP8: quantised
    on the way in, e4m3 bits into xr_ptr, scales into xs_ptr, the rows unquantised into xk_ptr with SAVE_GU)."""
    for ch in range(puller, MB // ROWS, n_pullers):
        r = row0 + ch * ROWS + tl.arange(0, ROWS)
        pr = tl.load(peer_rank_ptr + r, mask=r < num_rows, other=-1)
        pt = tl.load(peer_tok_ptr + r, mask=r < num_rows, other=0)
        ok = pr >= 0
        src = _peer_rows(x_ptrs_ptr, pr, ok, DT) + (pt // K).to(tl.int64) * H
        drow = (brow0 + ch * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        if FP8:  # quantised on the way in: no separate pass over x
            _pull_rows_fp8(src, xr_ptr + drow * H, xs_ptr + drow * HB, xk_ptr + drow * H, ok, H, HB,
                           ROWS, BLOCK_H, SB, POW2, SAVE_GU)
        else:
            # Saved for the backward, padding rows must be zeros (its weight gradients sum them).
            _copy_rows(src, xr_ptr + drow * H, ok, H, BLOCK_H, SAVE_GU)


@triton.jit
def dispatch_mlp_swiglu_combine_kernel(
    # schedule of this rank
    peer_rank_ptr,  # [C] int32, source rank per routed row, -1 = padding
    peer_tok_ptr,  # [C] int32, t*K + j on the source rank
    tile_expert_ptr,  # [C // BM] int32, local expert per row tile, -1 past num_rows
    expert_offsets_ptr,  # [L + 1] int32, first row of each expert's padded segment (tile_group_m = -1)
    num_rows_ptr,  # [1] int32, padded routed rows on this rank
    num_invalid_ptr,  # [1] int32, out-of-range expert ids seen in the routing
    # peers
    x_ptrs_ptr,  # [R] int64, base of every rank's x [T, H]
    combine_ptrs_ptr,  # [R] int64, base of every rank's combine [T*K, H]
    # local buffers
    x_local_ptr,  # [T, H] this rank's x (shared-expert input)
    xr_ptr,  # [MAC, H] routed x ring
    hid_ptr,  # [MAC, I] routed hidden ring
    yr_ptr,  # [MAC, H] routed y ring
    gu_ptr,  # [MAC, 2I] gate|up pre-activations (x's dtype) kept for the backward (SAVE_GU; else a placeholder)
    sgu_ptr,  # [T, 2S] fp32 the shared expert's, kept too (SAVE_GU with HAS_SHARED; else a placeholder)
    xk_ptr,  # [MAC, H] x's dtype: the routed rows unquantised, kept for the backward (FP8 and SAVE_GU; else a
    #          placeholder): its weight gradients read them, and pulling x again cost it 1.5 ms (Kimi, H200)
    xs_ptr,  # [MAC, H // SB] fp32 row-block scales of x_routed (FP8; x_routed is then uint8 e4m3 bits)
    hs_ptr,  # [MAC, I // SB] fp32 row-block scales of hidden (FP8_DOWN; hidden is then uint8 e4m3 bits)
    sh_hid_ptr,  # [T, S] shared-expert hidden
    y_shared_ptr,  # [T, H] shared-expert output
    # weights of this rank
    w13_ptr,  # [L, 2I, H] (FP8: uint8 e4m3 bits)
    w2_ptr,  # [L, H, I] (FP8_DOWN: uint8 e4m3 bits; FP8 with FP8Config.down_high: the master weights)
    w13s_ptr,  # [L, 2I // SB, H // SB] fp32 block scales of w13 (FP8; else a placeholder)
    w2s_ptr,  # [L, H // SB, I // SB] fp32 block scales of w2 (FP8; else a placeholder)
    sw13_ptr,  # [2S, H]
    sw2_ptr,  # [H, S]
    # TMA descriptors of the same tensors (USE_TMA; otherwise placeholders)
    xl_desc,  # x_local, blocks [BM, BK]
    xr_desc,  # x_routed, blocks [BM, BK]
    hid_desc,  # hidden, blocks [BM, BK] (FP8_DOWN: e4m3, blocks [BM, SB])
    shid_desc,  # shared hidden, blocks [BM, BK]
    w13_desc,  # w13 viewed [L*2I, H], blocks [BN, BK]
    w2_desc,  # w2 viewed [L*H, I], blocks [BN2, BK] (FP8_DOWN: e4m3, blocks [BN2, SB])
    sw13_desc,  # shared w13 [2S, H], blocks [BN, BK]
    sw2_desc,  # shared w2 [H, S], blocks [BN2, BK]
    # sync
    cnt_ptr,  # [4 * NMB + 1] int32 counters, zeroed before launch
    err_ptr,  # [1] int32 error flag
    trace_ptr,  # [MAXE, 5] int64 events (TRACE; else a placeholder, never touched)
    # sizes
    T, H, I, S, K, NMB, NSLOT,
    swiglu_limit,
    phase, p_lo, p_hi, pull_ahead, num_comm, max_spin,
    LAG: tl.constexpr, MAC: tl.constexpr, MB: tl.constexpr, TGM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_SHARED: tl.constexpr, USE_TMA: tl.constexpr,
    SAVE_GU: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, POW2: tl.constexpr, FP8_DOWN: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TRACE: tl.constexpr = False, MAXE: tl.constexpr = 1,
    SELF_PULL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_rows = tl.load(num_rows_ptr)
    if pid == 0:
        if tl.load(num_invalid_ptr) > 0:
            tl.atomic_or(err_ptr, 2)  # ERR_BAD_EXPERT_ID
    DT = x_local_ptr.dtype.element_ty  # the rows' dtype (x_routed holds e4m3 bits under FP8)
    HB = H // SB
    IB = I // SB
    x_ready = cnt_ptr
    hid_ready = cnt_ptr + NMB
    y_ready = cnt_ptr + 2 * NMB
    done = cnt_ptr + 3 * NMB
    shared_ready = cnt_ptr + 4 * NMB
    n_gu_tiles_i = tl.cdiv(I, BN)
    n_dn_tiles_h = tl.cdiv(H, BN2)
    per_mb_gu = (MB // BM) * n_gu_tiles_i
    per_mb_dn = (MB // BM) * n_dn_tiles_h
    if TRACE:  # launch-independent trace slots: GEMM tiles of the whole forward in one launch's order, then comm
        n_sh_rt = tl.cdiv(T, BM)
        trace_sdn0 = (n_sh_rt * tl.cdiv(S, BN) if HAS_SHARED else 0) + (NMB + LAG) * (per_mb_gu + per_mb_dn)
        trace_comm0 = trace_sdn0 + (n_sh_rt * n_dn_tiles_h if HAS_SHARED else 0)

    if pid < num_comm:
        # ------------------------------------------------ communication program
        for it in range(p_lo, p_hi + pull_ahead):
            p = it
            if ((phase & 2) != 0) & (p < p_hi):  # PH_PULL
                row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                if live:
                    if TRACE:
                        t_start = _now()
                    if p >= NSLOT:
                        _, prev_live = _mb_rows(p - NSLOT, num_rows, NSLOT, MAC, MB)
                        if prev_live:
                            _wait_geq(done + p - NSLOT, num_comm, err_ptr, max_spin)
                    if TRACE:
                        t_ready = _now()
                    _pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, xr_ptr, xs_ptr, xk_ptr, row0,
                                 (p % NSLOT) * MB, num_rows, pid, num_comm, K, H, HB, DT, MB, ROWS, BLOCK_H, SB, POW2,
                                 FP8, SAVE_GU)
                    _signal(x_ready + p)
                    if TRACE:
                        _trace_event(trace_ptr, trace_comm0 + (2 * it) * num_comm + pid, MAXE, TR_PULL, t_start,
                                     t_ready, _now())
            pp = it - pull_ahead
            if ((phase & 16) != 0) & (pp >= p_lo):  # PH_PUSH
                row0, live = _mb_rows(pp, num_rows, NSLOT, MAC, MB)
                if live:
                    if TRACE:
                        t_start = _now()
                    _wait_geq(y_ready + pp, per_mb_dn, err_ptr, max_spin)
                    if TRACE:
                        t_ready = _now()
                    brow0 = (pp % NSLOT) * MB
                    for ch in range(pid, MB // ROWS, num_comm):
                        r = row0 + ch * ROWS + tl.arange(0, ROWS)
                        pr = tl.load(peer_rank_ptr + r, mask=r < num_rows, other=-1)
                        pt = tl.load(peer_tok_ptr + r, mask=r < num_rows, other=0)
                        ok = pr >= 0
                        dst = _peer_rows(combine_ptrs_ptr, pr, ok, DT) + pt.to(tl.int64) * H
                        src = yr_ptr + (brow0 + ch * ROWS + tl.arange(0, ROWS)).to(tl.int64) * H
                        _copy_rows(src, dst, ok, H, BLOCK_H, False)
                    _signal(done + pp)
                    if TRACE:
                        _trace_event(trace_ptr, trace_comm0 + (2 * it + 1) * num_comm + pid, MAXE, TR_PUSH,
                                     t_start, t_ready, _now())
    else:
        # ------------------------------------------------ compute program
        cid = pid - num_comm
        ncomp = nprog - num_comm
        n_pull = num_comm
        if SELF_PULL:
            # KernelConfig.num_comm_programs_fwd = 0: every program pulls its share of every minibatch first (the
            # launcher refuses a wrapping ring, so no slot is waited on), then runs tiles; nothing is pushed
            # (KernelConfig.combine_gather: the epilogue reads y_routed). A pull spread over all SMs runs at HBM speed (~0.1 ms for Kimi's 235 MB of rows) where
            # dedicated programs would sit idle most of the launch.
            n_pull = ncomp
            if (phase & 2) != 0:  # PH_PULL
                for p in range(p_lo, p_hi):
                    row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                    if live:
                        if TRACE:
                            t_start = _now()
                        _pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, xr_ptr, xs_ptr, xk_ptr, row0,
                                     (p % NSLOT) * MB, num_rows, cid, ncomp, K, H, HB, DT, MB, ROWS, BLOCK_H, SB,
                                     POW2, FP8, SAVE_GU)
                        _signal(x_ready + p)
                        if TRACE:
                            _trace_event(trace_ptr, trace_comm0 + p * nprog + pid, MAXE, TR_PULL, t_start, t_start,
                                         _now())
        n_sh_row_tiles = tl.cdiv(T, BM)
        n_sh_gu = 0
        n_sh_dn = 0
        if HAS_SHARED:
            n_sh_gu = n_sh_row_tiles * tl.cdiv(S, BN)
            n_sh_dn = n_sh_row_tiles * n_dn_tiles_h
        # Rounds: round j runs gu(j) then dn(j - LAG). With LAG = 1 the down
        # tiles of a minibatch overlap the next one's gate|up tiles; LAG must
        # be 0 with one slot (a pull of j waits on the push of j - 1).
        per_mb = per_mb_gu + per_mb_dn
        r_lo = n_sh_gu + p_lo * per_mb
        r_hi = n_sh_gu + (p_hi + LAG) * per_mb
        total = r_hi + n_sh_dn
        for tile in range(cid, total, ncomp):
            if tile < n_sh_gu:
                if (phase & 1) != 0:  # PH_SHARED_GU; n-major so row tiles share weight tiles in L2
                    if TRACE:
                        t_start = _now()
                    nt = tile // n_sh_row_tiles
                    rt = tile % n_sh_row_tiles
                    if USE_TMA:
                        acc_g, acc_u = _gateup_acc_tma(xl_desc, rt * BM, sw13_desc, nt * BN, S + nt * BN, H,
                                                       BM, BN, BK)
                    else:
                        acc_g, acc_u = _gateup_acc(x_local_ptr, rt * BM, T - rt * BM, sw13_ptr, nt * BN, H, S,
                                                   BM, BN, BK, DOT_FP32, PRECISION)
                    _swiglu_store(acc_g, acc_u, sh_hid_ptr, rt * BM, T - rt * BM, nt * BN, S, swiglu_limit,
                                  HAS_LIMIT, BM, BN)
                    if SAVE_GU:  # the backward's shared phase A then runs its down dgrad alone
                        _store_gate_up(sgu_ptr, rt * BM, acc_g, acc_u, nt * BN, S, BM, BN, T - rt * BM)
                    _signal(shared_ready)
                    if TRACE:
                        _trace_event(trace_ptr, tile, MAXE, TR_SHARED_GU, t_start, t_start, _now())
            elif tile < r_hi:
                if tile >= r_lo:
                    rnd = (tile - n_sh_gu) // per_mb
                    i = (tile - n_sh_gu) % per_mb
                    if i < per_mb_gu:
                        p = rnd
                        if ((phase & 4) != 0) & (p < p_hi):  # PH_GATEUP
                            row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                            if live:
                                if TRACE:
                                    t_start = _now()
                                rt, nt = _tile_rc(i, n_gu_tiles_i, MB // BM, TGM, row0 // BM, tile_expert_ptr,
                                                  expert_offsets_ptr, num_rows // BM, BM)
                                _wait_geq(x_ready + p, n_pull, err_ptr, max_spin)
                                if TRACE:
                                    t_ready = _now()
                                e = tl.load(tile_expert_ptr + (row0 + rt * BM) // BM,
                                            mask=row0 + rt * BM < num_rows, other=-1)
                                if e >= 0:
                                    brow = (p % NSLOT) * MB + rt * BM
                                    if FP8:
                                        if USE_TMA:
                                            acc_g, acc_u = _gateup_acc_fp8_tma(
                                                xr_desc, xs_ptr, brow, w13_desc, w13s_ptr + e * (2 * IB * HB),
                                                e * (2 * I) + nt * BN, e * (2 * I) + I + nt * BN, nt, H, I, HB,
                                                BM, BN, SB)
                                        else:
                                            acc_g, acc_u = _gateup_acc_fp8(
                                                xr_ptr, xs_ptr, brow, w13_ptr + e.to(tl.int64) * (2 * I * H),
                                                w13s_ptr + e * (2 * IB * HB), nt, H, I, HB, BM, BN, SB, DOT_FP32)
                                        if FP8_DOWN:  # hidden quantised for the e4m3 down GEMM
                                            _swiglu_store_fp8(acc_g, acc_u, hid_ptr, hs_ptr, brow, nt, I, IB,
                                                              swiglu_limit, HAS_LIMIT, POW2, BM, BN, SB)
                                        else:  # FP8Config.down_high: hidden in x's dtype
                                            _swiglu_store(acc_g, acc_u, hid_ptr, brow, BM, nt * BN, I, swiglu_limit,
                                                          HAS_LIMIT, BM, BN)
                                        if SAVE_GU:  # the backward reads these instead of replaying the GEMM
                                            _store_gate_up(gu_ptr, brow, acc_g, acc_u, nt * BN, I, BM, BN)
                                    else:
                                        if USE_TMA:
                                            acc_g, acc_u = _gateup_acc_tma(xr_desc, brow, w13_desc,
                                                                           e * (2 * I) + nt * BN,
                                                                           e * (2 * I) + I + nt * BN, H, BM, BN,
                                                                           BK)
                                        else:
                                            acc_g, acc_u = _gateup_acc(xr_ptr, brow, BM,
                                                                       w13_ptr + e.to(tl.int64) * (2 * I * H),
                                                                       nt * BN, H, I, BM, BN, BK, DOT_FP32,
                                                                       PRECISION)
                                        _swiglu_store(acc_g, acc_u, hid_ptr, brow, BM, nt * BN, I, swiglu_limit,
                                                      HAS_LIMIT, BM, BN)
                                        if SAVE_GU:
                                            _store_gate_up(gu_ptr, brow, acc_g, acc_u, nt * BN, I, BM, BN)
                                _signal(hid_ready + p)
                                if TRACE:
                                    _trace_event(trace_ptr, tile, MAXE, TR_GATEUP, t_start, t_ready, _now())
                    else:
                        p = rnd - LAG
                        if ((phase & 8) != 0) & (p >= p_lo) & (p < p_hi):  # PH_DOWN
                            row0, live = _mb_rows(p, num_rows, NSLOT, MAC, MB)
                            if live:
                                if TRACE:
                                    t_start = _now()
                                j = i - per_mb_gu
                                rt, nt = _tile_rc(j, n_dn_tiles_h, MB // BM, TGM, row0 // BM, tile_expert_ptr,
                                                  expert_offsets_ptr, num_rows // BM, BM)
                                _wait_geq(hid_ready + p, per_mb_gu, err_ptr, max_spin)
                                if TRACE:
                                    t_ready = _now()
                                e = tl.load(tile_expert_ptr + (row0 + rt * BM) // BM,
                                            mask=row0 + rt * BM < num_rows, other=-1)
                                if e >= 0:
                                    arow = (p % NSLOT) * MB + rt * BM
                                    if FP8_DOWN:
                                        if USE_TMA:
                                            acc = _down_acc_fp8_tma(hid_desc, hs_ptr, arow, w2_desc,
                                                                    w2s_ptr + e * (HB * IB), e * H + nt * BN2,
                                                                    nt * BN2, I, IB, BM, BN2, SB)
                                        else:
                                            acc = _down_acc_fp8(hid_ptr, hs_ptr, arow,
                                                                w2_ptr + e.to(tl.int64) * (H * I),
                                                                w2s_ptr + e * (HB * IB), nt * BN2, H, I, IB, BM,
                                                                BN2, SB, DOT_FP32)
                                    elif USE_TMA:
                                        acc = _down_acc_tma(hid_desc, arow, w2_desc, e * H + nt * BN2, I, BM, BN2,
                                                            BK)
                                    else:
                                        acc = _down_acc(hid_ptr, arow, BM, w2_ptr + e.to(tl.int64) * (H * I),
                                                        nt * BN2, H, I, BM, BN2, BK, DOT_FP32, PRECISION)
                                    rows = arow + tl.arange(0, BM)
                                    _store_rows(yr_ptr + rows.to(tl.int64) * H, rows >= 0, acc, nt * BN2, H, BN2)
                                _signal(y_ready + p)
                                if TRACE:
                                    _trace_event(trace_ptr, tile, MAXE, TR_DOWN, t_start, t_ready, _now())
            else:
                if (phase & 32) != 0:  # PH_SHARED_DOWN
                    if TRACE:
                        t_start = _now()
                    j = tile - r_hi
                    nt = j // n_sh_row_tiles
                    rt = j % n_sh_row_tiles
                    _wait_geq(shared_ready, n_sh_gu, err_ptr, max_spin)
                    if TRACE:
                        t_ready = _now()
                    if USE_TMA:
                        acc = _down_acc_tma(shid_desc, rt * BM, sw2_desc, nt * BN2, S, BM, BN2, BK)
                    else:
                        acc = _down_acc(sh_hid_ptr, rt * BM, T - rt * BM, sw2_ptr, nt * BN2, H, S,
                                        BM, BN2, BK, DOT_FP32, PRECISION)
                    rows = rt * BM + tl.arange(0, BM)
                    _store_rows(y_shared_ptr + rows.to(tl.int64) * H, rows < T, acc, nt * BN2, H, BN2)
                    if TRACE:
                        _trace_event(trace_ptr, trace_sdn0 + j, MAXE, TR_SHARED_DOWN, t_start, t_ready, _now())


@triton.jit
def _route_src(ids_ptr, route_row_ptr, rt64, j, tm, E, K: tl.constexpr, GATHER: tl.constexpr):
    """Where the epilogues read route t*K + j of tokens rt64 (mask tm): its row in the [T*K, ...] combine buffers,
    or with GATHER (``KernelConfig.combine_gather``) its routed row route_row[t*K + j]. Returns (row [BT] int64,
    ok [BT]); ok is False for ids outside [0, E) and, with GATHER, for routes with no row."""
    ej = tl.load(ids_ptr + rt64 * K + j, mask=tm, other=-1)
    ok = (ej >= 0) & (ej < E)
    if GATHER:
        src = tl.load(route_row_ptr + rt64 * K + j, mask=tm, other=-1)
        ok = ok & (src >= 0)
        src = src.to(tl.int64)
    else:
        src = rt64 * K + j
    return src, ok


@triton.jit
def combine_epilogue_kernel(
    y_shared_ptr,  # [T, H] shared-expert output (ignored without a shared expert)
    combine_ptr,  # [T*K, H] routed rows pushed here by the expert owners (GATHER: y_routed [MAC, H])
    route_row_ptr,  # [T*K] int32 (GATHER): the y_routed row of each route, -1 where none; else a placeholder
    w_ptr,  # [T, K] fp32 router weights
    ids_ptr,  # [T, K] global expert ids (routes with ids outside [0, E) contribute nothing)
    out_ptr,  # [T, H]
    T, H, E,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, GATHER: tl.constexpr = False,
):
    """out = y_shared + sum_j w[t, j] * combine[t*K + j], in fp32, j = 0..K-1 in order. GATHER
    (``KernelConfig.combine_gather``, one rank): route t*K + j's row is read from y_routed at
    route_row[t*K + j] instead (nothing was pushed), the same values in the same order."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = rt < T
    m = tm[:, None] & (rh < H)[None, :]
    rt64 = rt.to(tl.int64)
    if HAS_SHARED:
        acc = tl.load(y_shared_ptr + rt64[:, None] * H + rh[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + rt64 * K + j, mask=tm, other=0.0).to(tl.float32)
        src, ok = _route_src(ids_ptr, route_row_ptr, rt64, j, tm, E, K, GATHER)
        c = tl.load(combine_ptr + src[:, None] * H + rh[None, :], mask=m & ok[:, None], other=0.0)
        acc = acc + wj[:, None] * c.to(tl.float32)
    tl.store(out_ptr + rt64[:, None] * H + rh[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)
