"""Backward megakernel ``combine_mlp_swiglu_dispatch_bwd``, the weight-gradient kernel and the epilogue.

Mirrors the forward (docs/design.md "The backward"). One persistent launch per
rank for dispatch, data gradients and combine; programs [0, C) communicate,
the rest compute. The weight gradients follow as a second launch.

Per routed row n (expert e, origin token t, slot j, router weight w):
    g, u = x_n W13[e]^T (the forward's, kept; or replayed from the pulled x row)
    h = silu(gc) * uc            gc = min(g, L), uc = clamp(u, -L, L)
    dh_u = dO[t] W2[e]           unscaled down dgrad
    d_w[t, j] = <dh_u, h>        router-weight gradient; y is never stored
    dh = w * dh_u -> dg, du      SwiGLU backward with the clamp's masks
    d_x_n = [dg, du] W13[e]      gate|up dgrad, pushed to the origin at t*K + j
    dW13[e] = sum_n [dg, du]^T x_n, dW2[e] = sum_n (w dO[t])^T h_n (fixed row order)

- comm: pull x row, d_out row and router weight of every routed row from its
  origin (peer pointer tables) a minibatch at a time, bump ``pull_ready[p]``;
  later wait ``b_ready[p]`` and push d_x rows (and the reduced d_w) back.
  Padding rows of the schedule are written as zeros.
- compute, one topological tile sequence walked round-robin: shared-expert
  phase A; rounds of [A(p), B(p - LAG)] per minibatch (A: down dgrad + gate|up
  replay + SwiGLU backward, B: gate|up dgrad); shared phase B.
- the weight gradients (launched after it, once per weight), 128 x 256 tiles
  of dW13[e], dW2[e] and the shared expert's, TMA operands on Hopper, in the
  kernel ``KernelConfig.wgrad`` names: ``weight_grad_kernel`` (one program a
  tile), ``weight_grad_persistent_kernel`` (one program an SM) or
  ``kernels/wgrad_gluon.py``.

Why two launches: inside the megakernel the weight-gradient tiles ran
as 64 x 128 tiles behind a row mask that kept Triton from pipelining them
(17.4 of 28.2 ms on the Kimi slice, ~93 TF/s;
docs/experiments/wgrad-in-megakernel.md). Pipelined 128 x 256 tiles
there need 147 KB of shared memory, and Triton 3.6/3.9 then stopped
overlapping the buffers of the kernel's other loops: 576 KB asked of 227 KB
(scripts/sm90_compile.py shows it without a GPU). A launch of its own gives
them the whole shared memory and register file; what is lost is the overlap
of the weight gradients with the last minibatches' phase B and push.

Weight-gradient tiles loop over an expert's rows in row order: each output
element is summed by one program in a fixed order, so gradients are bitwise
reproducible; no atomics touch data. The d_w row-sum over I is split across
phase-A tiles into ``dw_part[row, n_tile]`` and reduced in n-tile order by the
push.

No ring in the backward yet (every routed row resident). Ring-aware replay
(``KernelConfig.keep_activations``; GU_MODE): 1, the forward's ring did not wrap
and kept every routed row's x (padding zeroed) and gate|up: phase A is the
down dgrad alone, reading g and u, and the pull skips x; 2, the ring wrapped:
the forward, running its macrobatches last to first, left macrobatch 0 (routed
rows [0, gu_rows)) in the ring, so those tiles read g and u and the others
replay the gate|up GEMM from the pulled x rows; 0, replay everything. With
GU_MODE > 0 the forward also kept the shared expert's gate|up (SHARED_KEPT):
the shared phase A is its down dgrad alone, on BM x BNS tiles (2 BN when S
allows, as the routed kept tiles), its SwiGLU backward BN columns at a time.
"""

import triton
import triton.language as tl

TR_A_EPILOGUE = tl.constexpr(6)  # backward only: the SwiGLU-backward epilogue inside a wide kept phase-A tile

from kittenmoe.kernels.megakernel_fwd import (TR_DOWN, TR_GATEUP, TR_PULL, TR_PUSH, TR_SHARED_DOWN, TR_SHARED_GU,
                                              _copy_rows, _fp8_operand, _gateup_acc_fp8, _gateup_acc_fp8_tma,
                                              _now, _peer_rows, _route_src, _signal, _tile_rc, _trace_event,
                                              _wait_geq, store_chunk_fp8)
from kittenmoe.kernels.quant import quantize_rows_1xb

# phase bits
PB_SHARED_A = 1
PB_PULL = 2
PB_A = 4
PB_B = 8
PB_PUSH = 16
PB_SHARED_B = 32
PB_WGRAD = 64  # the weight-gradient launch's routed tiles
PB_SHARED_WGRAD = 128  # and its shared-expert tiles
PB_ALL = 255


@triton.jit
def _bwd_a_acc(do_ptr, x_ptr, a_row0, a_rows, w2_ptr, w13_ptr, n0, H, I,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """dh_u = dO W2[:, n-tile], g|u = x W13[n-tile]^T for one BM x BN tile, one K loop over H.

    do_ptr, x_ptr: [*, H] rows; w2_ptr: one expert's [H, I]; w13_ptr: its [2I, H].
    """
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < a_rows
    rows = (a_row0 + rm).to(tl.int64)
    n_ok = rn < I
    acc_dh = tl.zeros((BM, BN), dtype=tl.float32)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + rk
        k_ok = kk < H
        am = row_ok[:, None] & k_ok[None, :]
        do = tl.load(do_ptr + rows[:, None] * H + kk[None, :], mask=am, other=0.0)
        xa = tl.load(x_ptr + rows[:, None] * H + kk[None, :], mask=am, other=0.0)
        wm = k_ok[:, None] & n_ok[None, :]
        w2t = tl.load(w2_ptr + kk[:, None].to(tl.int64) * I + rn[None, :], mask=wm, other=0.0)
        wg = tl.load(w13_ptr + rn[None, :].to(tl.int64) * H + kk[:, None], mask=wm, other=0.0)
        wu = tl.load(w13_ptr + (rn + I)[None, :].to(tl.int64) * H + kk[:, None], mask=wm, other=0.0)
        if DOT_FP32:
            do = do.to(tl.float32)
            xa = xa.to(tl.float32)
            w2t = w2t.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_dh = tl.dot(do, w2t, acc_dh, input_precision=PRECISION)
        acc_g = tl.dot(xa, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xa, wu, acc_u, input_precision=PRECISION)
    return acc_dh, acc_g, acc_u


@triton.jit
def _bwd_a_acc_tma(do_desc, x_desc, a_row0, w2_desc, w2_row0, w13_desc, wg_row0, wu_row0, n0, H,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """As ``_bwd_a_acc`` through TMA descriptors: do_desc/x_desc blocks [BM, BK] of row operands; w2_desc blocks
    [BK, BN] of the [L*H, I] view (rows w2_row0 + k); w13_desc blocks [BN, BK] of the [L*2I, H] view (gate rows
    wg_row0.., up rows wu_row0..; the launcher requires I % BN == 0 so a gate tile never reaches up rows)."""
    acc_dh = tl.zeros((BM, BN), dtype=tl.float32)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        do = do_desc.load([a_row0, k0])
        xa = x_desc.load([a_row0, k0])
        w2t = w2_desc.load([w2_row0 + k0, n0])
        wg = w13_desc.load([wg_row0, k0])
        wu = w13_desc.load([wu_row0, k0])
        acc_dh = tl.dot(do, w2t, acc_dh)
        acc_g = tl.dot(xa, wg.T, acc_g)
        acc_u = tl.dot(xa, wu.T, acc_u)
    return acc_dh, acc_g, acc_u


@triton.jit
def _bwd_a_epilogue(acc_dh, acc_g, acc_u, w_row, dgu_ptr, hw_ptr, dwp_ptr, row0, n_rows, n0, nt, I, NI,
                    swiglu_limit, HAS_LIMIT: tl.constexpr, HAS_DW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, DW_IN_ORDER: tl.constexpr = False):
    """SwiGLU backward of one tile: d_gu[rows, n] = dg, d_gu[rows, I + n] = du; hw = w * h;
    dw_part[rows, nt] = sum_n dh_u * h. dgu: [*, 2I], hw: [*, I], dw_part: [*, NI] fp32; w_row: [BM] fp32.
    DW_IN_ORDER (the FP8 backward): that sum added left to right (``_row_sum_in_order``), so a kept 2 BN-wide
    tile's half and a replayed BN tile give the same bits; else tl.sum in the layout's order (deterministic;
    the in-order form costs the bf16 kept build 56 more bytes of stack a thread on sm_90, and BF16's kept and
    replayed rows differ anyway, by their gate|up GEMMs)."""
    g = acc_g
    u = acc_u
    if HAS_LIMIT:
        gc = tl.minimum(g, swiglu_limit)
        uc = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
    else:
        gc = g
        uc = u
    s = tl.sigmoid(gc)
    h = gc * s * uc
    dh = acc_dh * w_row[:, None]
    dgc = dh * uc * s * (1.0 + gc * (1.0 - s))
    duc = dh * gc * s
    if HAS_LIMIT:
        dgc = tl.where(g <= swiglu_limit, dgc, 0.0)
        duc = tl.where((u >= -swiglu_limit) & (u <= swiglu_limit), duc, 0.0)
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rows = (row0 + rm).to(tl.int64)
    m = (rm < n_rows)[:, None] & (rn < I)[None, :]
    dt = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + rows[:, None] * (2 * I) + rn[None, :], dgc.to(dt), mask=m)
    tl.store(dgu_ptr + rows[:, None] * (2 * I) + (rn + I)[None, :], duc.to(dt), mask=m)
    tl.store(hw_ptr + rows[:, None] * I + rn[None, :], (h * w_row[:, None]).to(dt), mask=m)
    if HAS_DW:
        if DW_IN_ORDER:
            part = _row_sum_in_order(tl.where(m, acc_dh * h, 0.0), BN)
        else:
            part = tl.sum(tl.where(m, acc_dh * h, 0.0), axis=1)
        tl.store(dwp_ptr + rows * NI + nt, part, mask=rm < n_rows)
    return dgc, duc


@triton.jit
def _row_sum_in_order(p, BN: tl.constexpr):
    """sum(p, axis=1) of a [BM, BN] fp32 tile added left to right, whatever p's register layout: an fp32 "ieee"
    dot against ones, which Triton lowers to FMAs in k order (no tensor cores take fp32 unrounded). tl.sum's
    order follows the layout: on the H200 a BN-wide half split from a 2 BN-wide accumulator and a BN-wide
    accumulator of the same bits gave different d_w partials in 134 of 256 rows (benchmarks/probes/split_sum_probe.py),
    which broke the FP8 backward's kept == replayed promise once kept tiles went 2 BN wide. The 16 columns are
    tl.dot's least N; column 0 is kept."""
    s = tl.dot(p, tl.full((BN, 16), 1.0, tl.float32), input_precision="ieee")
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, s, 0.0), axis=1)


@triton.jit
def _mm_acc(a_ptr, a_stride, a_row0, a_rows, b_ptr, b_stride, n0, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 A[a_row0 : a_row0 + BM, :K] @ B[:K, n0 : n0 + BN]; A and B row-major with the given row strides."""
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    row_ok = rm < a_rows
    rows = (a_row0 + rm).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc = _mm_step(acc, a_ptr, a_stride, rows, row_ok, b_ptr, b_stride, rn, N, k0, K, BK, DOT_FP32, PRECISION)
    return acc


@triton.jit
def _mm_step(acc, a_ptr, a_stride, rows, row_ok, b_ptr, b_stride, rn, N, k0, K, BK: tl.constexpr,
             DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + A[rows, k0 : k0 + BK] @ B[k0 : k0 + BK, rn]: one K step of ``_mm_acc`` (columns past K as 0)."""
    kk = k0 + tl.arange(0, BK)
    k_ok = kk < K
    a = tl.load(a_ptr + rows[:, None] * a_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_ptr + kk[:, None].to(tl.int64) * b_stride + rn[None, :],
                mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mm_acc_tma(a_desc, a_row0, b_desc, b_row0, n0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """As ``_mm_acc`` through TMA descriptors: a_desc blocks [BM, BK] (rows a_row0..), b_desc blocks [BK, BN]
    (rows b_row0 + k, columns n0..). Columns of A past its width load as zeros, so a K loop that runs past
    one expert's 2I rows of B adds nothing."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        a = a_desc.load([a_row0, k0])
        b = b_desc.load([b_row0 + k0, n0])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _wgrad_step(acc, p_op, q_op, r0, row_end, n0, N, m0, M, p_stride, q_stride, WN: tl.constexpr, WM: tl.constexpr,
                WK: tl.constexpr, USE_TMA: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + P[r0 : r0 + WK, n0 : n0 + WN]^T Q[r0 : r0 + WK, m0 : m0 + WM]: one row step of a weight-gradient
    tile. TMA (USE_TMA): p_op / q_op descriptors with blocks [WK, WN] / [WK, WM]; rows past the tensor's end (the
    shared expert's T) load as zeros, routed segments are WK-row aligned. Pointers: P [*, N], Q [*, M] with
    the given row strides, rows from row_end on masked to zeros."""
    if USE_TMA:
        p = p_op.load([r0, n0])
        q = q_op.load([r0, m0])
        acc = tl.dot(p.T, q, acc)
    else:
        rr = r0 + tl.arange(0, WK)
        ok = rr < row_end
        rr64 = rr.to(tl.int64)
        ra = n0 + tl.arange(0, WN)
        rb = m0 + tl.arange(0, WM)
        p = tl.load(p_op + rr64[:, None] * p_stride + ra[None, :], mask=ok[:, None] & (ra < N)[None, :], other=0.0)
        q = tl.load(q_op + rr64[:, None] * q_stride + rb[None, :], mask=ok[:, None] & (rb < M)[None, :], other=0.0)
        if DOT_FP32:
            p = p.to(tl.float32)
            q = q.to(tl.float32)
        acc = tl.dot(tl.trans(p), q, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _wgrad_tile(p_op, p_stride, q_op, q_stride, row0, row_end, out_ptr, out_stride, n0, N, m0, M,
                WN: tl.constexpr, WM: tl.constexpr, WK: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """out[n0 + a, m0 + b] = sum_{r in [row0, row_end)} P[r, n0 + a] * Q[r, m0 + b], WK rows a step, in order
    (``_wgrad_step``); out: [N, M] row-major (stride out_stride). Schedule padding rows need no mask: the pull
    writes them as zeros, so they add exact zeros."""
    acc = _wgrad_acc(p_op, p_stride, q_op, q_stride, row0, row_end, n0, N, m0, M, WN, WM, WK, USE_TMA, DOT_FP32,
                     PRECISION)
    _store_wgrad(acc, out_ptr, out_stride, n0, N, m0, M, WN, WM)


@triton.jit
def _wgrad_acc(p_op, p_stride, q_op, q_stride, row0, row_end, n0, N, m0, M, WN: tl.constexpr, WM: tl.constexpr,
               WK: tl.constexpr, USE_TMA: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """A weight-gradient tile's fp32 sum over rows [row0, row_end), WK rows a step in order (``_wgrad_tile``)."""
    acc = tl.zeros((WN, WM), dtype=tl.float32)
    for r0 in range(row0, row_end, WK):
        acc = _wgrad_step(acc, p_op, q_op, r0, row_end, n0, N, m0, M, p_stride, q_stride, WN, WM, WK, USE_TMA,
                          DOT_FP32, PRECISION)
    return acc


@triton.jit
def _store_wgrad(acc, out_ptr, out_stride, n0, N, m0, M, WN: tl.constexpr, WM: tl.constexpr):
    ra = n0 + tl.arange(0, WN)
    rb = m0 + tl.arange(0, WM)
    tl.store(out_ptr + ra[:, None].to(tl.int64) * out_stride + rb[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(ra < N)[:, None] & (rb < M)[None, :])


@triton.jit
def _as_kept(acc_g, acc_u, gu_ptr):
    """A replayed tile's fp32 g and u rounded as the forward keeps them (gu_ptr's dtype, x's), so that a replay
    and a kept tile give the same gradients bit for bit (a no-op on kept values)."""
    return acc_g.to(gu_ptr.dtype.element_ty).to(tl.float32), acc_u.to(gu_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _kept_gate_up(gu_ptr, row0, nt, I, BM: tl.constexpr, BN: tl.constexpr, n_rows=None):
    """g, u of one tile as the forward kept them, in fp32 (gu_ptr: [*, 2I] in x's dtype, routed-row order;
    columns past I, in a last tile wider than what is left, read as 0). n_rows: the rows that exist (the shared
    expert's last row tile of T; the others read as 0); None: all BM (routed row tiles are padded whole)."""
    rn = nt * BN + tl.arange(0, BN)
    g_rows = gu_ptr + (row0 + tl.arange(0, BM)).to(tl.int64)[:, None] * (2 * I)
    n_ok = (rn < I)[None, :]
    if n_rows is not None:
        n_ok = n_ok & (tl.arange(0, BM) < n_rows)[:, None]
    return (tl.load(g_rows + rn[None, :], mask=n_ok, other=0.0).to(tl.float32),
            tl.load(g_rows + I + rn[None, :], mask=n_ok, other=0.0).to(tl.float32))


@triton.jit
def _phase_a_saved(dor_ptr, dor_desc, row0, w2_ptr, w2_desc, gu_ptr, e, nt, H, I,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA_A: tl.constexpr,
                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Phase A of one tile when the forward kept gate|up: the down dgrad alone, then g and u as the forward kept
    them (gu_ptr: [*, 2I] in x's dtype, rows indexed as the routed rows)."""
    if USE_TMA_A:
        acc_dh = _mm_acc_tma(dor_desc, row0, w2_desc, e * H, nt * BN, H, BM, BN, BK)
    else:
        acc_dh = _mm_acc(dor_ptr, H, row0, BM, w2_ptr + e.to(tl.int64) * (H * I), I, nt * BN, I, H, BM, BN, BK,
                         DOT_FP32, PRECISION)
    acc_g, acc_u = _kept_gate_up(gu_ptr, row0, nt, I, BM, BN)
    return acc_dh, acc_g, acc_u


@triton.jit
def _kept_wide_gemm(dor_ptr, dor_desc, row0, w2_ptr, w2_desc, e, nta, H, I, BM: tl.constexpr, BNA: tl.constexpr,
                    BK: tl.constexpr, USE_TMA_A: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Routed phase A's down dgrad over a BM x BNA tile (BNA = 2 BN) when every row is kept (bf16; FP8 calls
    ``_down_dgrad_fp8_any`` at BNA): one accumulator at 2 BN columns reads each d_out row tile from L2 half as
    often as two BN tiles do. ``_kept_wide_epilogue`` finishes the tile."""
    if USE_TMA_A:
        acc = _mm_acc_tma(dor_desc, row0, w2_desc, e * H, nta * BNA, H, BM, BNA, BK)
    else:
        acc = _mm_acc(dor_ptr, H, row0, BM, w2_ptr + e.to(tl.int64) * (H * I), I, nta * BNA, I, H, BM, BNA, BK,
                      DOT_FP32, PRECISION)
    return acc


@triton.jit
def _kept_wide_epilogue(acc, row0, nta, gu_ptr, wr_ptr, dgu_ptr, hw_ptr, dwp_ptr, dguq_ptr, dgus_ptr, I, NI, GB,
                        swiglu_limit, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        FP8_B: tl.constexpr, POW2: tl.constexpr, DGB: tl.constexpr, DW_IN_ORDER: tl.constexpr):
    """The SwiGLU backward of a BM x 2 BN kept phase-A tile one BN-wide half at a time, each half exactly as a
    BN tile's own (its g and u loaded, d(gate|up), w h, the d_w partial of column tile 2 nta + half, and with
    phase B on e4m3 (FP8_B) d(gate|up)'s 1 x DGB quantisation): the same bits as two BN tiles. Halves keep the
    live fp32 tiles at three of BM x BN (the whole 2 BN at once spilled 1,736 bytes a thread on sm_90)."""
    acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    w_row = tl.load(wr_ptr + row0 + tl.arange(0, BM))
    nt = 2 * nta
    _kept_half(acc_lo, w_row, row0, nt, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, dguq_ptr, dgus_ptr, I, NI, GB,
               swiglu_limit, HAS_LIMIT, BM, BN, FP8_B, POW2, DGB, DW_IN_ORDER)
    # The launcher requires I % (2 BN) == 0, so this always holds; as a branch it leaves the bf16 sm_90 build
    # (Triton 3.6) 8 bytes of stack a thread, straight-line code 48 (the form timed on the H200 is the branch).
    if (nt + 1) * BN < I:
        _kept_half(acc_hi, w_row, row0, nt + 1, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, dguq_ptr, dgus_ptr, I, NI, GB,
                   swiglu_limit, HAS_LIMIT, BM, BN, FP8_B, POW2, DGB, DW_IN_ORDER)


@triton.jit
def _kept_half(acc_dh, w_row, row0, nt, gu_ptr, dgu_ptr, hw_ptr, dwp_ptr, dguq_ptr, dgus_ptr, I, NI, GB, swiglu_limit,
               HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FP8_B: tl.constexpr, POW2: tl.constexpr,
               DGB: tl.constexpr, DW_IN_ORDER: tl.constexpr):
    """One BN-wide half of ``_kept_wide_epilogue``: column tile nt's g and u, its SwiGLU backward, and with FP8_B
    its d(gate|up) quantisation."""
    acc_g, acc_u = _kept_gate_up(gu_ptr, row0, nt, I, BM, BN)
    dgc, duc = _bwd_a_epilogue(acc_dh, acc_g, acc_u, w_row, dgu_ptr, hw_ptr, dwp_ptr, row0, BM, nt * BN, nt, I, NI,
                               swiglu_limit, HAS_LIMIT, True, BM, BN, DW_IN_ORDER)
    if FP8_B:
        _quantize_dgu(dgc, duc, dguq_ptr, dgus_ptr, row0, nt, I, GB, POW2, BM, BN, DGB)


@triton.jit
def _shared_kept_epilogue(acc, row0, n_rows, nts, sgu_ptr, sdgu_ptr, sh_ptr, dummy_ptr, S, swiglu_limit,
                          HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr):
    """The SwiGLU backward of a BM x BNS shared phase-A tile (column tile nts) whose gate|up the forward kept
    (sgu_ptr: [T, 2S] in x's dtype), BN columns at a time as the routed kept tiles (``_kept_wide_epilogue``): d(gate|up)
    into sdgu, the hidden into sh (w = 1), no d_w. BNS is BN or 2 BN."""
    ones = tl.full((BM,), 1.0, dtype=tl.float32)
    if BNS == BN:
        acc_g, acc_u = _kept_gate_up(sgu_ptr, row0, nts, S, BM, BN, n_rows)
        _bwd_a_epilogue(acc, acc_g, acc_u, ones, sdgu_ptr, sh_ptr, dummy_ptr, row0, n_rows, nts * BN, nts, S, 1,
                        swiglu_limit, HAS_LIMIT, False, BM, BN)
    else:
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        nt = 2 * nts
        acc_g, acc_u = _kept_gate_up(sgu_ptr, row0, nt, S, BM, BN, n_rows)
        _bwd_a_epilogue(acc_lo, acc_g, acc_u, ones, sdgu_ptr, sh_ptr, dummy_ptr, row0, n_rows, nt * BN, nt, S, 1,
                        swiglu_limit, HAS_LIMIT, False, BM, BN)
        if (nt + 1) * BN < S:  # (the launcher picks BNS = 2 BN only when S % (2 BN) == 0: always true)
            acc_g, acc_u = _kept_gate_up(sgu_ptr, row0, nt + 1, S, BM, BN, n_rows)
            _bwd_a_epilogue(acc_hi, acc_g, acc_u, ones, sdgu_ptr, sh_ptr, dummy_ptr, row0, n_rows, (nt + 1) * BN,
                            nt + 1, S, 1, swiglu_limit, HAS_LIMIT, False, BM, BN)


@triton.jit
def _phase_a_replay(dor_ptr, dor_desc, xr_ptr, xr_desc, row0, w2_ptr, w2_desc, w13_ptr, w13a_desc, e, nt, H, I,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA_A: tl.constexpr,
                    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Phase A of one tile replaying the gate|up GEMM from the pulled x rows beside the down dgrad."""
    if USE_TMA_A:
        acc_dh, acc_g, acc_u = _bwd_a_acc_tma(dor_desc, xr_desc, row0, w2_desc, e * H, w13a_desc,
                                              e * (2 * I) + nt * BN, e * (2 * I) + I + nt * BN, nt * BN, H, BM, BN, BK)
    else:
        acc_dh, acc_g, acc_u = _bwd_a_acc(dor_ptr, xr_ptr, row0, BM, w2_ptr + e.to(tl.int64) * (H * I),
                                          w13_ptr + e.to(tl.int64) * (2 * I * H), nt * BN, H, I, BM, BN, BK,
                                          DOT_FP32, PRECISION)
    return acc_dh, acc_g, acc_u


@triton.jit
def _down_dgrad_fp8(dq_ptr, ds_ptr, row0, w2t_ptr, w2s_ptr, nt, H, I, HB, IB,
                    BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr):
    """FP8 phase A's down dgrad of one tile: dh_u = dO W2[e][:, n-tile] on e4m3 operands, K steps of SB along H,
    each step's product scaled by the d_out row's 1 x SB scale and the weight block's.

    dq_ptr: uint8 [*, H] e4m3 d_out rows, ds_ptr: fp32 [*, HB]; w2t_ptr: one expert's W2 transposed, uint8
    [I, H] = [N, K] (K-major, as e4m3 wgmma takes B), w2s_ptr: W2's fp32 [HB, IB] block scales."""
    rm = tl.arange(0, BM)
    rn = nt * BN + tl.arange(0, BN)
    rk = tl.arange(0, SB)
    rows = (row0 + rm).to(tl.int64)
    nb = (nt * BN + tl.arange(0, BN)) // SB  # each column's weight-scale column (one per tile when BN <= SB)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, SB):
        kb = k0 // SB
        kk = k0 + rk
        a = _fp8_operand(tl.load(dq_ptr + rows[:, None] * H + kk[None, :]), EMULATE)
        b = _fp8_operand(tl.load(w2t_ptr + rn[:, None].to(tl.int64) * H + kk[None, :]), EMULATE).T
        sa = tl.load(ds_ptr + rows * HB + kb)
        sw = tl.load(w2s_ptr + kb * IB + nb)[None, :]
        if EMULATE:
            p = tl.dot(a, b, input_precision="ieee")
        else:
            p = tl.dot(a, b)
        acc += p * (sa[:, None] * sw)
    return acc


@triton.jit
def _down_dgrad_fp8_tma(dq_desc, ds_ptr, row0, w2t_desc, w2t_row0, w2s_ptr, nt, H, HB, IB,
                        BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr):
    """As ``_down_dgrad_fp8`` through float8e4nv TMA descriptors: dq_desc blocks [BM, SB] of the e4m3 d_out rows,
    w2t_desc blocks [BN, SB] of W2^T viewed [L * I, H] (this expert's rows from w2t_row0)."""
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    nb = (nt * BN + tl.arange(0, BN)) // SB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, SB):
        kb = k0 // SB
        a = dq_desc.load([row0, k0])
        b = w2t_desc.load([w2t_row0 + nt * BN, k0])
        sa = tl.load(ds_ptr + rows * HB + kb)
        sw = tl.load(w2s_ptr + kb * IB + nb)[None, :]
        acc += tl.dot(a, b.T) * (sa[:, None] * sw)
    return acc


@triton.jit
def _down_dgrad_fp8_any(dq_desc, dq_ptr, ds_ptr, row0, w2t_desc, w2t_ptr, w2s_ptr, e, nt, H, I, HB, IB,
                        BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, USE_TMA_A: tl.constexpr,
                        EMULATE: tl.constexpr):
    """Phase A's e4m3 down dgrad of expert e's tile, through TMA (USE_TMA_A) or pointer loads."""
    if USE_TMA_A:
        return _down_dgrad_fp8_tma(dq_desc, ds_ptr, row0, w2t_desc, e * I, w2s_ptr + e * (HB * IB), nt, H, HB, IB,
                                   BM, BN, SB)
    return _down_dgrad_fp8(dq_ptr, ds_ptr, row0, w2t_ptr + e.to(tl.int64) * (H * I), w2s_ptr + e * (HB * IB), nt, H,
                           I, HB, IB, BM, BN, SB, EMULATE)


@triton.jit
def _phase_b_fp8_tma(gq_desc, gs_ptr, row0, w13t_desc, w13t_row0, w13s_ptr, n0, H, I, HB, GB,
                     BM: tl.constexpr, BN2: tl.constexpr, KS: tl.constexpr, SB: tl.constexpr):
    """As ``_phase_b_fp8`` through float8e4nv TMA descriptors: gq_desc blocks [BM, KS] of the e4m3 d(gate|up)
    rows, w13t_desc blocks [BN2, KS] of W13^T viewed [L * H, 2I] (this expert's rows from w13t_row0). When BN2
    does not divide H the last tile's rows past H are the next expert's (or TMA's zero fill past the last):
    those columns are computed and never stored, and their scale index is clamped inside this expert's."""
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    sw_cols = tl.minimum(n0 + tl.arange(0, BN2), H - 1) // SB
    acc = tl.zeros((BM, BN2), dtype=tl.float32)
    for k0 in range(0, 2 * I, KS):
        a = gq_desc.load([row0, k0])
        b = w13t_desc.load([w13t_row0 + n0, k0])
        sa = tl.load(gs_ptr + rows * GB + k0 // KS)
        sw = tl.load(w13s_ptr + (k0 // SB) * HB + sw_cols)
        acc += tl.dot(a, b.T) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _phase_b_fp8(gq_ptr, gs_ptr, row0, w13t_ptr, w13s_ptr, n0, H, I, HB, GB,
                 BM: tl.constexpr, BN2: tl.constexpr, KS: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr):
    """FP8 phase B of one tile: d_x rows = d(gate|up) W13[e] on e4m3 operands, K steps of KS (the 1 x KS scale
    block of d(gate|up): min(phase A's tile width, SB), ``launch_common.fp8_dgu_block``) along 2I. gq_ptr: uint8
    [*, 2I], gs_ptr: fp32 [*, GB]; w13t_ptr: one expert's W13 transposed, uint8 [H, 2I] = [N, K] (K-major),
    w13s_ptr: W13's fp32 [2I / SB, HB]."""
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN2)
    rk = tl.arange(0, KS)
    rows = (row0 + rm).to(tl.int64)
    n_ok = rn < H  # the last BN2-wide tile may pass H (H a multiple of SB, not of BN2): masked, never read
    sw_cols = tl.minimum(rn, H - 1) // SB
    acc = tl.zeros((BM, BN2), dtype=tl.float32)
    for k0 in range(0, 2 * I, KS):
        kk = k0 + rk
        a = _fp8_operand(tl.load(gq_ptr + rows[:, None] * (2 * I) + kk[None, :]), EMULATE)
        b = _fp8_operand(tl.load(w13t_ptr + rn[:, None].to(tl.int64) * (2 * I) + kk[None, :], mask=n_ok[:, None],
                                 other=0), EMULATE).T
        sa = tl.load(gs_ptr + rows * GB + k0 // KS)
        sw = tl.load(w13s_ptr + (k0 // SB) * HB + sw_cols)
        if EMULATE:
            p = tl.dot(a, b, input_precision="ieee")
        else:
            p = tl.dot(a, b)
        acc += p * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _quantize_dgu(dgc, duc, gq_ptr, gs_ptr, row0, nt, I, GB, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  KS: tl.constexpr):
    """d(gate) and d(up) of one phase-A tile quantised per row in 1 x KS blocks (KS = min(BN, SB), phase B's K
    step): gq_ptr uint8 [*, 2I] at columns nt*BN.. and I + nt*BN.., gs_ptr fp32 [*, GB] (GB = 2I / KS) at
    nt*BN/KS.. and (I + nt*BN)/KS.."""
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    rn = nt * BN + tl.arange(0, BN)
    gb, gsc = quantize_rows_1xb(dgc, BM, BN, KS, POW2)
    ub, usc = quantize_rows_1xb(duc, BM, BN, KS, POW2)
    tl.store(gq_ptr + rows[:, None] * (2 * I) + rn[None, :], gb)
    tl.store(gq_ptr + rows[:, None] * (2 * I) + I + rn[None, :], ub)
    sc = (nt * BN) // KS + tl.arange(0, BN // KS)
    tl.store(gs_ptr + rows[:, None] * GB + sc[None, :], gsc)
    tl.store(gs_ptr + rows[:, None] * GB + I // KS + sc[None, :], usc)


@triton.jit
def _bwd_pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, dout_ptrs_ptr, w_ptrs_ptr, xr_ptr, dor_ptr, wr_ptr,
                     xrq_ptr, xrs_ptr, dorq_ptr, dors_ptr, row0, num_rows, gu_rows, puller, n_pullers, K, H, HB,
                     DT: tl.constexpr, MB: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                     GU_MODE: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, POW2: tl.constexpr):
    """Program ``puller`` of ``n_pullers`` pulls its ROWS-row chunks of the minibatch at routed row ``row0``: the
    d_out rows (FP8: also quantised), the router weights and, unless the forward kept them (GU_MODE 1), the x
    rows (FP8: the replayed rows' e4m3 bits too), from the source ranks into the backward's row buffers."""
    for ch in range(puller, MB // ROWS, n_pullers):
        r = row0 + ch * ROWS + tl.arange(0, ROWS)
        pr = tl.load(peer_rank_ptr + r, mask=r < num_rows, other=-1)
        pt = tl.load(peer_tok_ptr + r, mask=r < num_rows, other=0)
        ok = pr >= 0
        tok = (pt // K).to(tl.int64) * H
        dst = r.to(tl.int64) * H
        xb = _peer_rows(x_ptrs_ptr, pr, ok, DT) + tok
        db = _peer_rows(dout_ptrs_ptr, pr, ok, DT) + tok
        # Padding rows are written as zeros: their d(gate|up) and w*h come out exactly zero
        # and the weight-gradient sums need no row mask.
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = ok[:, None] & (cols < H)[None, :]
            mc = (cols < H)[None, :]
            if GU_MODE != 1:  # else the forward's x_routed holds these rows, padding zeroed
                xv = tl.load(xb[:, None] + cols[None, :], mask=m, other=0.0)
                tl.store(xr_ptr + dst[:, None] + cols[None, :], xv, mask=mc)
                # The replay's e4m3 rows (the forward's pull quantised the same bits), for the rows
                # phase A replays: from gu_rows on (a wrapped ring kept the rows before it).
                if FP8 and (row0 + ch * ROWS + ROWS > gu_rows):
                    store_chunk_fp8(xv, xrq_ptr + dst, xrs_ptr + r.to(tl.int64) * HB, h0, H, HB,
                                    ROWS, BLOCK_H, SB, POW2)
            dv = tl.load(db[:, None] + cols[None, :], mask=m, other=0.0)
            tl.store(dor_ptr + dst[:, None] + cols[None, :], dv, mask=mc)
            if FP8:  # quantised on the way in (1 x SB along H), for phase A's e4m3 GEMM
                store_chunk_fp8(dv, dorq_ptr + dst, dors_ptr + r.to(tl.int64) * HB, h0, H, HB,
                                ROWS, BLOCK_H, SB, POW2)
        wb = tl.load(w_ptrs_ptr + pr, mask=ok, other=0).to(tl.pointer_type(tl.float32))
        tl.store(wr_ptr + r, tl.load(wb + pt, mask=ok, other=0.0), mask=ok)


@triton.jit
def combine_mlp_swiglu_dispatch_bwd_kernel(
    # schedule of this rank
    peer_rank_ptr,  # [C] int32, source rank per routed row, -1 = padding
    peer_tok_ptr,  # [C] int32, t*K + j on the source rank
    tile_expert_ptr,  # [C // BM] int32
    expert_offsets_ptr,  # [L + 1] int32, first row of each expert's padded segment (tile_group_m = -1)
    num_rows_ptr,  # [1] int32
    # peers
    x_ptrs_ptr,  # [R] int64 -> x [T, H] of every rank
    dout_ptrs_ptr,  # [R] int64 -> d_out [T, H]
    w_ptrs_ptr,  # [R] int64 -> router weights [T*K] fp32
    dxc_ptrs_ptr,  # [R] int64 -> d_x combine [T*K, H]
    dwc_ptrs_ptr,  # [R] int64 -> d_w combine [T*K] fp32
    # local buffers
    x_local_ptr,  # [T, H] this rank's x
    dout_local_ptr,  # [T, H] this rank's d_out
    xr_ptr,  # [NR, H] pulled x rows (GU_MODE 1: the forward's x_routed, not pulled again)
    dor_ptr,  # [NR, H] pulled d_out rows (unscaled)
    wr_ptr,  # [NR] fp32 pulled router weights
    dgu_ptr,  # [NR, 2I] d(gate|up)
    hw_ptr,  # [NR, I] w * hidden
    dwp_ptr,  # [NR, NI] fp32 partial d_w per I tile
    dxr_ptr,  # [NR, H] d_x rows to push
    sdgu_ptr,  # [T, 2S] shared d(gate|up)
    sh_ptr,  # [T, S] shared hidden
    sdx_ptr,  # [T, H] shared d_x
    gu_ptr,  # [gu_rows, 2I] the forward's gate|up pre-activations (x's dtype) of the leading routed rows
    # (GU_MODE > 0; else a placeholder in x's dtype, which a replay rounds g and u to)
    sgu_ptr,  # [T, 2S] the forward's shared-expert gate|up pre-activations (SHARED_KEPT; else a placeholder), x's dtype
    dorq_ptr,  # [NR, H] uint8 e4m3 d_out rows (FP8; else a placeholder)
    dors_ptr,  # [NR, H // SB] fp32 their 1 x SB scales (FP8)
    dguq_ptr,  # [NR, 2I] uint8 e4m3 d(gate|up) (FP8_B: phase B on e4m3)
    dgus_ptr,  # [NR, 2I // DGB] fp32 their 1 x DGB scales (FP8_B)
    xrq_ptr,  # [NR, H] uint8 e4m3 x rows, quantised in the pull for the gate|up replay (FP8 with GU_MODE != 1)
    xrs_ptr,  # [NR, H // SB] fp32 their 1 x SB scales (same; else placeholders)
    # weights of this rank (their gradients come from weight_grad_kernel)
    w13_ptr,  # [L, 2I, H]
    w2_ptr,  # [L, H, I]
    w13q_ptr,  # [L, 2I, H] uint8 e4m3 W13: the gate|up replay's B (FP8; else a placeholder)
    w13t_ptr,  # [L, H, 2I] uint8 e4m3 W13 transposed: phase B's K-major B (FP8_B; else a placeholder)
    w2t_ptr,  # [L, I, H] uint8 e4m3 W2 transposed: phase A's K-major B (FP8)
    w13s_ptr,  # [L, 2I // SB, H // SB] fp32 (FP8)
    w2s_ptr,  # [L, H // SB, I // SB] fp32 (FP8)
    sw13_ptr,  # [2S, H]
    sw2_ptr,  # [H, S]
    # TMA descriptors for phase B (USE_TMA; otherwise placeholders)
    dgu_desc,  # dgu [NR, 2I], blocks [BM, BK] (FP8_B: dguq as float8e4nv, blocks [BM, DGB])
    w13_desc,  # w13 viewed [L * 2I, H], blocks [BK, BN2] (FP8_B: W13^T viewed [L * H, 2I], blocks [BN2, DGB])
    sdgu_desc,  # sdgu [T, 2S], blocks [BM, BK]
    sw13_desc,  # sw13 [2S, H], blocks [BK, BN2]
    # and for phase A (USE_TMA_A)
    dor_desc,  # dor [NR, H], blocks [BM, BK] (FP8: dorq as float8e4nv, blocks [BM, SB])
    xr_desc,  # xr [NR, H], blocks [BM, BK] (FP8: xrq as float8e4nv, blocks [BM, SB])
    w2_desc,  # w2 viewed [L * H, I], blocks [BK, BNA] (FP8: W2^T viewed [L * I, H], blocks [BNA, SB])
    w13a_desc,  # w13 viewed [L * 2I, H], blocks [BN, BK] (FP8: its e4m3 copy, blocks [BN, SB])
    dol_desc,  # dout_local [T, H], blocks [BM, BK]
    xl_desc,  # x_local [T, H], blocks [BM, BK]
    sw2_desc,  # sw2 [H, S], blocks [BK, BNS]
    sw13a_desc,  # sw13 [2S, H], blocks [BN, BK]
    cnt_ptr,  # [3 * NMB + 1] int32 counters, zeroed before launch
    err_ptr,  # [1] int32
    trace_ptr,  # [MAXE, 5] int64 events (TRACE; kinds as the forward's: shared A, A, B, shared B, pull, push)
    T, H, I, S, K, L, NMB,
    swiglu_limit,
    phase, p_lo, p_hi, pull_ahead, num_comm, max_spin, gu_rows,
    LAG: tl.constexpr, MB: tl.constexpr, TGM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BNA: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_SHARED: tl.constexpr, USE_TMA: tl.constexpr, USE_TMA_A: tl.constexpr,
    GU_MODE: tl.constexpr, FP8: tl.constexpr, FP8_B: tl.constexpr, SB: tl.constexpr, DGB: tl.constexpr,
    POW2: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, TRACE: tl.constexpr = False,
    MAXE: tl.constexpr = 1, SHARED_KEPT: tl.constexpr = False,
    BNS: tl.constexpr = 16, SELF_PULL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_rows = tl.load(num_rows_ptr)
    DT = xr_ptr.dtype.element_ty
    HB = H // SB
    IB = I // SB
    GB = (2 * I) // DGB
    pull_ready = cnt_ptr
    a_ready = cnt_ptr + NMB
    b_ready = cnt_ptr + 2 * NMB
    sa_ready = cnt_ptr + 3 * NMB
    NI = tl.cdiv(I, BN)  # d_w partials: one column per BN-wide slice of I
    n_b_h = tl.cdiv(H, BN2)
    NIA = tl.cdiv(I, BNA)  # routed phase-A column tiles
    per_a = (MB // BM) * NIA  # routed phase-A tiles a minibatch
    per_b = (MB // BM) * n_b_h
    if TRACE:  # launch-independent slots (as the forward's): GEMM tiles of the whole backward, then comm
        n_srt_t = tl.cdiv(T, BM)
        trace_sb0 = (n_srt_t * tl.cdiv(S, BNS) if HAS_SHARED else 0) + (NMB + LAG) * (per_a + per_b)
        trace_comm0 = trace_sb0 + (n_srt_t * n_b_h if HAS_SHARED else 0)
        # the wide kept phase A's epilogues after the copies' slots (SELF_PULL: every program's pulls)
        trace_epi0 = trace_comm0 + 2 * (2 * NMB + 1) * (nprog if SELF_PULL else num_comm)

    if pid < num_comm:
        for it in range(p_lo, p_hi + pull_ahead):
            p = it
            if ((phase & 2) != 0) & (p < p_hi):  # PB_PULL
                row0 = p * MB
                if row0 < num_rows:
                    if TRACE:
                        t_start = _now()
                    _bwd_pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, dout_ptrs_ptr, w_ptrs_ptr, xr_ptr,
                                     dor_ptr, wr_ptr, xrq_ptr, xrs_ptr, dorq_ptr, dors_ptr, row0, num_rows, gu_rows,
                                     pid, num_comm, K, H, HB, DT, MB, ROWS, BLOCK_H, GU_MODE, FP8, SB, POW2)
                    _signal(pull_ready + p)
                    if TRACE:
                        _trace_event(trace_ptr, trace_comm0 + (2 * it) * num_comm + pid, MAXE, TR_PULL, t_start,
                                     t_start, _now())
            pp = it - pull_ahead
            if ((phase & 16) != 0) & (pp >= p_lo):  # PB_PUSH
                row0 = pp * MB
                if row0 < num_rows:
                    if TRACE:
                        t_start = _now()
                    _wait_geq(b_ready + pp, per_b, err_ptr, max_spin)
                    if TRACE:
                        t_ready = _now()
                    for ch in range(pid, MB // ROWS, num_comm):
                        r = row0 + ch * ROWS + tl.arange(0, ROWS)
                        pr = tl.load(peer_rank_ptr + r, mask=r < num_rows, other=-1)
                        pt = tl.load(peer_tok_ptr + r, mask=r < num_rows, other=0)
                        ok = pr >= 0
                        src = r.to(tl.int64) * H
                        db = _peer_rows(dxc_ptrs_ptr, pr, ok, DT) + \
                            pt.to(tl.int64) * H
                        _copy_rows(dxr_ptr + src, db, ok, H, BLOCK_H, False)
                        # d_w: the I-tile partial sums, reduced in tile order
                        dw = tl.zeros((ROWS,), dtype=tl.float32)
                        for q in range(0, NI):
                            dw += tl.load(dwp_ptr + r.to(tl.int64) * NI + q, mask=ok, other=0.0)
                        wb = tl.load(dwc_ptrs_ptr + pr, mask=ok, other=0).to(tl.pointer_type(tl.float32))
                        tl.store(wb + pt, dw, mask=ok)
                    if TRACE:
                        _trace_event(trace_ptr, trace_comm0 + (2 * it + 1) * num_comm + pid, MAXE, TR_PUSH,
                                     t_start, t_ready, _now())
    else:
        cid = pid - num_comm
        ncomp = nprog - num_comm
        n_pull = num_comm
        if SELF_PULL:
            # KernelConfig.num_comm_programs_bwd = 0 (with combine_gather: nothing to push): every program pulls
            # its chunks of every minibatch first (no ring in the backward, so nothing is waited on), then runs
            # tiles; the shared expert's tiles read d_out in place and need no pull.
            n_pull = ncomp
            if (phase & 2) != 0:  # PB_PULL
                for p in range(p_lo, p_hi):
                    row0 = p * MB
                    if row0 < num_rows:
                        if TRACE:
                            t_start = _now()
                        _bwd_pull_chunks(peer_rank_ptr, peer_tok_ptr, x_ptrs_ptr, dout_ptrs_ptr, w_ptrs_ptr, xr_ptr,
                                         dor_ptr, wr_ptr, xrq_ptr, xrs_ptr, dorq_ptr, dors_ptr, row0, num_rows,
                                         gu_rows, cid, ncomp, K, H, HB, DT, MB, ROWS, BLOCK_H, GU_MODE, FP8, SB, POW2)
                        _signal(pull_ready + p)
                        if TRACE:
                            _trace_event(trace_ptr, trace_comm0 + p * nprog + pid, MAXE, TR_PULL, t_start, t_start,
                                         _now())
        n_srt = tl.cdiv(T, BM)
        n_sa = 0
        n_sb = 0
        if HAS_SHARED:
            n_sa = n_srt * tl.cdiv(S, BNS)  # shared phase-A tiles BM x BNS
            n_sb = n_srt * n_b_h
        per_mb = per_a + per_b
        r_lo = n_sa + p_lo * per_mb
        r_hi = n_sa + (p_hi + LAG) * per_mb
        total = r_hi + n_sb
        for tile in range(cid, total, ncomp):
            if tile < n_sa:
                if (phase & 1) != 0:  # PB_SHARED_A: dense over this rank's T tokens, w = 1
                    if TRACE:
                        t_start = _now()
                    nt = tile // n_srt
                    rt = tile % n_srt
                    if SHARED_KEPT:  # the down dgrad alone, BNS wide; g and u as the forward kept them
                        if USE_TMA_A:
                            acc = _mm_acc_tma(dol_desc, rt * BM, sw2_desc, 0, nt * BNS, H, BM, BNS, BK)
                        else:
                            acc = _mm_acc(dout_local_ptr, H, rt * BM, T - rt * BM, sw2_ptr, S, nt * BNS, S, H, BM,
                                          BNS, BK, DOT_FP32, PRECISION)
                        _shared_kept_epilogue(acc, rt * BM, T - rt * BM, nt, sgu_ptr, sdgu_ptr, sh_ptr, wr_ptr, S,
                                              swiglu_limit, HAS_LIMIT, BM, BN, BNS)
                    else:
                        if USE_TMA_A:
                            acc_dh, acc_g, acc_u = _bwd_a_acc_tma(dol_desc, xl_desc, rt * BM, sw2_desc, 0,
                                                                  sw13a_desc, nt * BN, S + nt * BN, nt * BN, H, BM,
                                                                  BN, BK)
                        else:
                            acc_dh, acc_g, acc_u = _bwd_a_acc(dout_local_ptr, x_local_ptr, rt * BM, T - rt * BM,
                                                              sw2_ptr, sw13_ptr, nt * BN, H, S, BM, BN, BK,
                                                              DOT_FP32, PRECISION)
                        acc_g, acc_u = _as_kept(acc_g, acc_u, sgu_ptr)
                        ones = tl.full((BM,), 1.0, dtype=tl.float32)
                        _bwd_a_epilogue(acc_dh, acc_g, acc_u, ones, sdgu_ptr, sh_ptr, wr_ptr, rt * BM,
                                        T - rt * BM, nt * BN, nt, S, 1, swiglu_limit, HAS_LIMIT, False, BM, BN)
                    _signal(sa_ready)
                    if TRACE:
                        _trace_event(trace_ptr, tile, MAXE, TR_SHARED_GU, t_start, t_start, _now())
            elif tile < r_hi:
                if tile >= r_lo:
                    rnd = (tile - n_sa) // per_mb
                    i = (tile - n_sa) % per_mb
                    if i < per_a:
                        p = rnd
                        if ((phase & 4) != 0) & (p < p_hi) & (p * MB < num_rows):  # PB_A
                            if TRACE:
                                t_start = _now()
                            rt, nt = _tile_rc(i, NIA, MB // BM, TGM, p * (MB // BM), tile_expert_ptr,
                                              expert_offsets_ptr, num_rows // BM, BM)
                            row0 = p * MB + rt * BM
                            _wait_geq(pull_ready + p, n_pull, err_ptr, max_spin)
                            if TRACE:
                                t_ready = _now()
                            e = tl.load(tile_expert_ptr + row0 // BM, mask=row0 < num_rows, other=-1)
                            if BNA != BN:  # every row kept: 2 BN wide (the launcher sets it only then)
                                if e >= 0:
                                    if FP8:
                                        acc = _down_dgrad_fp8_any(
                                            dor_desc, dorq_ptr, dors_ptr, row0, w2_desc, w2t_ptr, w2s_ptr, e, nt, H,
                                            I, HB, IB, BM, BNA, SB, USE_TMA_A, DOT_FP32)
                                    else:
                                        acc = _kept_wide_gemm(dor_ptr, dor_desc, row0, w2_ptr, w2_desc, e, nt, H, I,
                                                              BM, BNA, BK, USE_TMA_A, DOT_FP32, PRECISION)
                                    if TRACE:
                                        t_gemm = _now()
                                    _kept_wide_epilogue(acc, row0, nt, gu_ptr, wr_ptr, dgu_ptr, hw_ptr, dwp_ptr,
                                                        dguq_ptr, dgus_ptr, I, NI, GB, swiglu_limit, HAS_LIMIT, BM,
                                                        BN, FP8_B, POW2, DGB, FP8)
                                    if TRACE:  # the epilogue's share of the tile, in a slot of its own
                                        _trace_event(trace_ptr, trace_epi0 + rnd * per_a + i, MAXE, TR_A_EPILOGUE,
                                                     t_gemm, t_gemm, _now())
                            elif e >= 0:
                                if FP8:
                                    # gu_rows: NR when every row was kept, MAC for a ring that wrapped, 0 for none
                                    if row0 < gu_rows:
                                        acc_dh = _down_dgrad_fp8_any(
                                            dor_desc, dorq_ptr, dors_ptr, row0, w2_desc, w2t_ptr, w2s_ptr, e, nt, H,
                                            I, HB, IB, BM, BN, SB, USE_TMA_A, DOT_FP32)
                                        acc_g, acc_u = _kept_gate_up(gu_ptr, row0, nt, I, BM, BN)
                                    else:
                                        # The replay first (the forward's gate|up tile code, same bits), then the
                                        # down dgrad: its accumulator is not live beside gate, up and their
                                        # products, four tiles at most instead of five.
                                        if USE_TMA_A:
                                            acc_g, acc_u = _gateup_acc_fp8_tma(
                                                xr_desc, xrs_ptr, row0, w13a_desc, w13s_ptr + e * (2 * IB * HB),
                                                e * (2 * I) + nt * BN, e * (2 * I) + I + nt * BN, nt, H, I, HB, BM,
                                                BN, SB)
                                        else:
                                            acc_g, acc_u = _gateup_acc_fp8(
                                                xrq_ptr, xrs_ptr, row0, w13q_ptr + e.to(tl.int64) * (2 * I * H),
                                                w13s_ptr + e * (2 * IB * HB), nt, H, I, HB, BM, BN, SB, DOT_FP32)
                                        acc_dh = _down_dgrad_fp8_any(
                                            dor_desc, dorq_ptr, dors_ptr, row0, w2_desc, w2t_ptr, w2s_ptr, e, nt, H,
                                            I, HB, IB, BM, BN, SB, USE_TMA_A, DOT_FP32)
                                elif GU_MODE == 1:
                                    acc_dh, acc_g, acc_u = _phase_a_saved(
                                        dor_ptr, dor_desc, row0, w2_ptr, w2_desc, gu_ptr, e, nt, H, I, BM, BN, BK,
                                        USE_TMA_A, DOT_FP32, PRECISION)
                                elif GU_MODE == 2:
                                    if row0 < gu_rows:  # macrobatch 0, left in the forward's ring
                                        acc_dh, acc_g, acc_u = _phase_a_saved(
                                            dor_ptr, dor_desc, row0, w2_ptr, w2_desc, gu_ptr, e, nt, H, I, BM, BN,
                                            BK, USE_TMA_A, DOT_FP32, PRECISION)
                                    else:
                                        acc_dh, acc_g, acc_u = _phase_a_replay(
                                            dor_ptr, dor_desc, xr_ptr, xr_desc, row0, w2_ptr, w2_desc, w13_ptr,
                                            w13a_desc, e, nt, H, I, BM, BN, BK, USE_TMA_A, DOT_FP32, PRECISION)
                                else:
                                    acc_dh, acc_g, acc_u = _phase_a_replay(
                                        dor_ptr, dor_desc, xr_ptr, xr_desc, row0, w2_ptr, w2_desc, w13_ptr, w13a_desc,
                                        e, nt, H, I, BM, BN, BK, USE_TMA_A, DOT_FP32, PRECISION)
                                acc_g, acc_u = _as_kept(acc_g, acc_u, gu_ptr)
                                w_row = tl.load(wr_ptr + row0 + tl.arange(0, BM))
                                dgc, duc = _bwd_a_epilogue(acc_dh, acc_g, acc_u, w_row, dgu_ptr, hw_ptr, dwp_ptr,
                                                           row0, BM, nt * BN, nt, I, NI, swiglu_limit, HAS_LIMIT,
                                                           True, BM, BN, FP8)
                                if FP8_B:  # phase B on e4m3 (FP8 without FP8Config.dx_high)
                                    _quantize_dgu(dgc, duc, dguq_ptr, dgus_ptr, row0, nt, I, GB, POW2, BM, BN, DGB)
                            _signal(a_ready + p)
                            if TRACE:
                                _trace_event(trace_ptr, tile, MAXE, TR_GATEUP, t_start, t_ready, _now())
                    else:
                        p = rnd - LAG
                        if ((phase & 8) != 0) & (p >= p_lo) & (p < p_hi) & (p * MB < num_rows):  # PB_B
                            if TRACE:
                                t_start = _now()
                            j = i - per_a
                            rt, nt = _tile_rc(j, n_b_h, MB // BM, TGM, p * (MB // BM), tile_expert_ptr,
                                              expert_offsets_ptr, num_rows // BM, BM)
                            row0 = p * MB + rt * BM
                            _wait_geq(a_ready + p, per_a, err_ptr, max_spin)
                            if TRACE:
                                t_ready = _now()
                            e = tl.load(tile_expert_ptr + row0 // BM, mask=row0 < num_rows, other=-1)
                            if e >= 0:
                                if FP8_B and USE_TMA:
                                    acc = _phase_b_fp8_tma(dgu_desc, dgus_ptr, row0, w13_desc, e * H,
                                                           w13s_ptr + e * (2 * IB * HB), nt * BN2, H, I, HB, GB,
                                                           BM, BN2, DGB, SB)
                                elif FP8_B:
                                    acc = _phase_b_fp8(dguq_ptr, dgus_ptr, row0,
                                                       w13t_ptr + e.to(tl.int64) * (2 * I * H),
                                                       w13s_ptr + e * (2 * IB * HB), nt * BN2, H, I, HB, GB, BM,
                                                       BN2, DGB, SB, DOT_FP32)
                                elif USE_TMA:
                                    acc = _mm_acc_tma(dgu_desc, row0, w13_desc, e * (2 * I), nt * BN2, 2 * I,
                                                      BM, BN2, BK)
                                else:
                                    acc = _mm_acc(dgu_ptr, 2 * I, row0, BM,
                                                  w13_ptr + e.to(tl.int64) * (2 * I * H), H, nt * BN2, H, 2 * I,
                                                  BM, BN2, BK, DOT_FP32, PRECISION)
                                rows = row0 + tl.arange(0, BM)
                                rn = nt * BN2 + tl.arange(0, BN2)
                                tl.store(dxr_ptr + rows[:, None].to(tl.int64) * H + rn[None, :], acc.to(DT),
                                         mask=(rn < H)[None, :])
                            _signal(b_ready + p)
                            if TRACE:
                                _trace_event(trace_ptr, tile, MAXE, TR_DOWN, t_start, t_ready, _now())
            else:
                if (phase & 32) != 0:  # PB_SHARED_B
                    if TRACE:
                        t_start = _now()
                    j = tile - r_hi
                    nt = j // n_srt
                    rt = j % n_srt
                    _wait_geq(sa_ready, n_sa, err_ptr, max_spin)
                    if TRACE:
                        t_ready = _now()
                    if USE_TMA:
                        acc = _mm_acc_tma(sdgu_desc, rt * BM, sw13_desc, 0, nt * BN2, 2 * S, BM, BN2, BK)
                    else:
                        acc = _mm_acc(sdgu_ptr, 2 * S, rt * BM, T - rt * BM, sw13_ptr, H, nt * BN2, H, 2 * S,
                                      BM, BN2, BK, DOT_FP32, PRECISION)
                    rows = rt * BM + tl.arange(0, BM)
                    rn = nt * BN2 + tl.arange(0, BN2)
                    tl.store(sdx_ptr + rows[:, None].to(tl.int64) * H + rn[None, :], acc.to(DT),
                             mask=(rows < T)[:, None] & (rn < H)[None, :])
                    if TRACE:
                        _trace_event(trace_ptr, trace_sb0 + j, MAXE, TR_SHARED_DOWN, t_start, t_ready, _now())


@triton.jit
def _wgrad_tile_at(tile, order_ptr, offsets_ptr, counts_ptr, N, M, WN: tl.constexpr, WM: tl.constexpr,
                   WK: tl.constexpr):
    """Weight-gradient tile ``tile`` (groups one after another in ``order_ptr``'s order, each WN x WM output
    tiles row by row): its group g, output origin (n0, m0) and the rows it sums, [seg0, seg1): seg0 from
    offsets_ptr ([G + 1]); seg1 the group's real rows (counts_ptr, [G]) rounded up to WK, at most its segment's
    end. An expert's segment is padded to BM rows, a multiple of WK, with rows of zeros (the pull writes them
    so): the whole zero steps past are skipped (DeepSeek's slice: ~10% of the rows). The shared expert's one
    group [0, T) ends at T."""
    n_n = tl.cdiv(N, WN)
    n_m = tl.cdiv(M, WM)
    g = tl.load(order_ptr + tile // (n_n * n_m))
    q = tile % (n_n * n_m)
    n0 = (q // n_m) * WN
    m0 = (q % n_m) * WM
    seg0 = tl.load(offsets_ptr + g)
    seg1 = tl.minimum(seg0 + (tl.load(counts_ptr + g) + WK - 1) // WK * WK, tl.load(offsets_ptr + g + 1))
    return g, n0, m0, seg0, seg1


@triton.jit
def _wgrad_slot_tile(s, nprog, tiles):
    """The tile a persistent program takes at its slot s (s = pid, pid + nprog, ...). Slots fill waves of nprog
    tiles; every odd wave that is full is taken in reverse (a snake), so that over tiles ordered by descending
    work the program that took one wave's largest tile takes the next wave's smallest. The last, partial wave
    keeps slot order, so every tile is taken once and no slot maps past ``tiles``. Under skewed routing (Zipf
    1.0 over 128 experts, Qwen3-30B-A3B's widths) round-robin over expert order left the busiest program
    11% (d_W13) and 24% (d_W2) above the mean; descending order with the snake, 1.5% and 4.4% (a model of
    the tiles' steps, benchmarks/probes/kernel_times.py --routing measures the kernel)."""
    w = s // nprog
    lane = s - w * nprog
    flip = ((w % 2) == 1) & ((w + 1) * nprog <= tiles)
    return s + flip.to(tl.int32) * (nprog - 1 - 2 * lane)


@triton.jit
def weight_grad_kernel(
    order_ptr,  # [G] int32, the groups in the order their tiles are taken (the schedule's: most rows first)
    offsets_ptr,  # [G + 1] int32, first row of each group's segment (an expert's padded rows; [0, T] shared)
    counts_ptr,  # [G] int32, real rows of each group (T for the shared one): the rows summed (_wgrad_tile_at)
    p_op,  # [rows, N] left operand (pointer, or TMA descriptor with blocks [WK, WN] when USE_TMA)
    q_op,  # [rows, M] right operand (pointer, or descriptor with blocks [WK, WM])
    out_ptr,  # [G, N, M] gradient, row-major
    N, M, p_stride, q_stride,
    WN: tl.constexpr, WM: tl.constexpr, WK: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[g] = P[seg_g]^T Q[seg_g], one program per WN x WM output tile, group after group.

    Launched once per weight (dW13 = d_gu^T x, dW2 = dO^T (w h), and the shared expert's two): one call site
    per compiled kernel, because Triton gives each pipelined loop its own shared memory and four of them
    (4 stages x 48 KB) would not fit. Output sums run over rows in order inside one program: bitwise
    reproducible.
    """
    g, n0, m0, seg0, seg1 = _wgrad_tile_at(tl.program_id(0), order_ptr, offsets_ptr, counts_ptr, N, M, WN, WM,
                                             WK)
    out = out_ptr + g.to(tl.int64) * N * M
    _wgrad_tile(p_op, p_stride, q_op, q_stride, seg0, seg1, out, M, n0, N, m0, M, WN, WM, WK, USE_TMA, DOT_FP32,
                PRECISION)


@triton.jit
def weight_grad_persistent_kernel(
    order_ptr,  # [G] int32, the groups in the order their tiles are taken (as weight_grad_kernel's)
    offsets_ptr,  # [G + 1] int32, first row of each group's segment (as weight_grad_kernel's)
    counts_ptr,  # [G] int32, real rows of each group (as weight_grad_kernel's)
    p_op,  # [rows, N] left operand (pointer, or TMA descriptor with blocks [WK, WN] when USE_TMA)
    q_op,  # [rows, M] right operand (pointer, or descriptor with blocks [WK, WM])
    out_ptr,  # [G, N, M] gradient, row-major
    out_desc,  # [G * N, M] TMA descriptor of out_ptr, blocks [WN, WM] (used when TMA_STORE; N % WN == 0)
    N, M, p_stride, q_stride, tiles,
    WN: tl.constexpr, WM: tl.constexpr, WK: tl.constexpr,
    USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """weight_grad_kernel's tiles, each program walking slots pid, pid + nprog, ... (``_wgrad_slot_tile``). With
    TMA_STORE a tile's output goes out through one shared-memory buffer and a TMA bulk store: Triton 3.6 allocates
    the buffer once, outside the tile loop, and waits for the previous tile's store only before refilling it, so
    the store drains under the next tile's K loop. One program per tile paid its 64 KB store alone (Kimi d_W13:
    2.44 ms for the launch, 1.85 without the store; this form 2.26, benchmarks/probes/wgrad_floor.py).

    Each tile sums its rows in order, WK rows a step, as weight_grad_kernel does: the same bits. A group with
    no rows stores zeros."""
    for s in range(tl.program_id(0), tiles, tl.num_programs(0)):
        t = _wgrad_slot_tile(s, tl.num_programs(0), tiles)
        g, n0, m0, seg0, seg1 = _wgrad_tile_at(t, order_ptr, offsets_ptr, counts_ptr, N, M, WN, WM, WK)
        acc = _wgrad_acc(p_op, p_stride, q_op, q_stride, seg0, seg1, n0, N, m0, M, WN, WM, WK, USE_TMA, DOT_FP32,
                         PRECISION)
        if TMA_STORE:
            out_desc.store([g * N + n0, m0], acc.to(out_desc.dtype))
        else:
            _store_wgrad(acc, out_ptr + g.to(tl.int64) * N * M, M, n0, N, m0, M, WN, WM)


@triton.jit
def bwd_epilogue_kernel(
    sdx_ptr,  # [T, H] shared-expert d_x (ignored without a shared expert)
    dxc_ptr,  # [T*K, H] d_x rows pushed back by the expert owners (GATHER: the routed d_x rows [NR, H])
    dwc_ptr,  # [T*K] fp32 router-weight gradients pushed back (GATHER: the d_w partials [NR, NI])
    route_row_ptr,  # [T*K] int32 (GATHER): the routed row of each route, -1 where none; else a placeholder
    ids_ptr,  # [T, K] global expert ids
    dx_ptr,  # [T, H] out
    dw_ptr,  # [T, K] fp32 out
    T, H, E, NI,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, GATHER: tl.constexpr = False,
):
    """d_x = shared d_x + sum_j d_x_routed[t*K + j] in fp32, j in order; d_w[t, j] = pushed value
    (0 for routes whose id is outside [0, E): they were never computed). GATHER (``KernelConfig.combine_gather``,
    one rank; nothing was pushed): route t*K + j's d_x row and its NI d_w partials are read at its routed row
    route_row[t*K + j], the partials summed in the push's order, so the same bits."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = rt < T
    m = tm[:, None] & (rh < H)[None, :]
    rt64 = rt.to(tl.int64)
    if HAS_SHARED:
        acc = tl.load(sdx_ptr + rt64[:, None] * H + rh[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(K):
        src, ok = _route_src(ids_ptr, route_row_ptr, rt64, j, tm, E, K, GATHER)
        c = tl.load(dxc_ptr + src[:, None] * H + rh[None, :], mask=m & ok[:, None], other=0.0)
        acc = acc + c.to(tl.float32)
        if tl.program_id(1) == 0:
            if GATHER:  # the push's sum: fp32 from zero, partials in column order
                dw = tl.zeros((BT,), dtype=tl.float32)
                for q in range(0, NI):
                    dw += tl.load(dwc_ptr + src * NI + q, mask=tm & ok, other=0.0)
            else:
                dw = tl.load(dwc_ptr + src, mask=tm & ok, other=0.0)
            tl.store(dw_ptr + rt64 * K + j, dw, mask=tm)
    tl.store(dx_ptr + rt64[:, None] * H + rh[None, :], acc.to(dx_ptr.dtype.element_ty), mask=m)
