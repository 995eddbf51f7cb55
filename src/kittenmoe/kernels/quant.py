"""FP8 (e4m3fn) block quantisation of activations (Triton only).

``quantize_act_1xb_kernel``: one program per (BLOCK_M rows) x (one scale
block of SB columns along K). Per row of the tile: amax over the block,
``scale = max(amax / 448, 2^-126)``, optionally rounded up to a power of two,
then ``q = e4m3(x * (1 / scale))`` (one correctly rounded reciprocal a block; the rule and why are in
``kittenmoe.fp8``). This is the standalone form of what the pull
fuses (``quantize_rows_1xb``); it must match ``kittenmoe.fp8``'s torch
reference bit for bit.

The fp32 -> e4m3fn rounding is done here in integer arithmetic on the fp32
bits (round to nearest, ties to even, e4m3 subnormals included) and the
kernel stores the e4m3 *bits* into a uint8 view of the output. Reason: the
Triton 3.9 interpreter's ``.to(tl.float8e4nv)`` is not round-to-nearest-even
(ties round away from zero, subnormals flush to 0, 464 becomes NaN where
torch gives 448), so it cannot match torch. The integer path is exact on
every backend. The fused quantiser ``quantize_rows_1xb`` uses the GPU's
``cvt.rn.satfinite.e4m3x2.f32`` when compiled (``HW_E4M3_CVT``; same bits for
|v| <= 448, checked against torch by the FP8 megakernel tests on the H200).
The standalone activation quantiser keeps the integer path everywhere; the weight quantiser uses the GPU's
conversion for bf16 / fp16 weights and the integer path for fp32 ones (``_weight_bits`` says why).
"""

import os

import triton
import triton.language as tl

# constexpr globals: compiled kernels may read only those (the interpreter reads any global).
E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.1754943508222875e-38)  # 2^-126, the smallest normal fp32 (and an E8M0 power of two)
# The fused quantisers (``quantize_rows_1xb``) round with the GPU's cvt.rn.satfinite.e4m3x2.f32 when compiled
# and with ``_e4m3_bits_rne`` under the interpreter (read when this module is imported, as Triton reads
# TRITON_INTERPRET when it decorates). Same bits for |v| <= 448; the integer path costs ~30 operations an
# element, and in the FP8 forward's pull (32 x 512 chunks on 12 SMs) that made the pull alone 5.5 ms on the
# Kimi slice where the BF16 pull takes 0.8 ms (H200, benchmarks/fp8_round.py --breakdown).
HW_E4M3_CVT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _e4m3_bits_rne(v):
    """e4m3fn bit pattern (int32 in [0, 255]) of fp32 ``v``, round to nearest even; needs |v| < 464."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80  # arithmetic shift: keep the top bit only, moved to bit 7
    a = b & 0x7FFFFFFF
    bexp = a >> 23  # biased fp32 exponent
    # Normal e4m3 (|v| >= 2^-6, biased exponent >= 121): keep 3 of 23 mantissa bits, RNE; a carry rolls
    # into the exponent. Re-bias 127 -> 7: subtract (127 - 7) << 3 = 960.
    lsb = (a >> 20) & 1
    normal = ((a + 0x7FFFF + lsb) >> 20) - 960
    # Subnormal e4m3 (|v| < 2^-6): m = RNE(|v| * 2^9), 0..8 (8 is the smallest normal, bits 0x08).
    # |v| = mant * 2^(bexp - 150), so m = RNE(mant >> s) with s = 141 - bexp (fp32 subnormals: mant
    # has no implicit bit and bexp counts as 1; they round to 0 anyway).
    mant = tl.where(bexp > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    s = tl.minimum(141 - tl.maximum(bexp, 1), 31)
    s = tl.maximum(s, 1)  # only reached for normal |v|, where this branch is not used
    q = mant >> s
    rem = mant - (q << s)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.where(bexp >= 121, normal, q)
    return sign | mag


@triton.jit
def scale_from_amax(amax, POW2: tl.constexpr):
    """The block scale (``kittenmoe.fp8.scale_from_amax``): max(amax / 448, 2^-126), rounded up to a power of
    two when POW2 (a nonzero mantissa bumps the exponent: exact, no log2/exp2)."""
    scale = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_SCALE)
    if POW2:
        sb = scale.to(tl.int32, bitcast=True)
        sb = (sb + 0x7FFFFF) & -8388608  # & 0xFF800000
        scale = sb.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _e4m3_bits(v):
    """uint8 e4m3fn bits of fp32 ``v`` (|v| < 464), round to nearest even: the GPU's conversion when compiled,
    the integer path under the interpreter (see the module docstring)."""
    if HW_E4M3_CVT:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_bits_rne(v).to(tl.uint8)


@triton.jit
def _reciprocal(scale):
    """1 / scale, correctly rounded (div.rn), as torch's tensor division computes it."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def quantize_rows_1xb(v, R: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, POW2: tl.constexpr):
    """fp32 ``v`` [R, C] (C a multiple of SB) -> (e4m3 bits uint8 [R, C], scales fp32 [R, C // SB]): one scale per
    1 x SB block of each row, the rule of ``quantize_act_1xb_kernel`` (bit for bit the torch reference's).
    What the pull dispatch and the gate|up epilogue quantise with, on the data they already hold."""
    vb = tl.reshape(v, (R, C // SB, SB))
    scale = scale_from_amax(tl.max(tl.abs(vb), axis=2), POW2)  # [R, C // SB]
    bits = _e4m3_bits(vb * _reciprocal(scale)[:, :, None])
    return tl.reshape(bits, (R, C)), scale


@triton.jit
def e4m3_to_f32(bits):
    """fp32 value of e4m3fn bit patterns (any int tensor holding 0..255; NaN patterns 0x7f/0xff never occur:
    the quantiser saturates). The interpreter's float8 conversions are not exact (see above), so the
    emulated FP8 GEMMs decode bits themselves: normal (1 + m/8) 2^(e-7), subnormal m 2^-9."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23) | (m << 20)  # fp32 exponent e - 7 + 127, mantissa m in its top 3 bits
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def quantize_act_1xb_kernel(
    x_ptr,  # [M, K] fp32 / bf16 / fp16, row-major contiguous
    q_ptr,  # [M, K] uint8: e4m3fn bits (a uint8 view of the float8_e4m3fn output)
    scale_ptr,  # [M, KB] fp32, KB = cdiv(K, SB)
    M, K, KB,
    SB: tl.constexpr, BLOCK_M: tl.constexpr, POW2: tl.constexpr,
):
    """q[m, k] = e4m3(x[m, k] * (1 / scale[m, k // SB])); scale = max(amax / 448, 2^-126), pow2-rounded up if POW2."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    rk = kb * SB + tl.arange(0, SB)
    m_ok = rm < M
    msk = m_ok[:, None] & (rk < K)[None, :]  # partial last block: missing columns read as 0
    rm64 = rm.to(tl.int64)
    offs = rm64[:, None] * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=msk, other=0.0).to(tl.float32)
    scale = scale_from_amax(tl.max(tl.abs(x), axis=1), POW2)  # [BLOCK_M]
    v = x * _reciprocal(scale)[:, None]
    bits = _e4m3_bits_rne(v)
    tl.store(q_ptr + offs, bits.to(tl.uint8), mask=msk)
    tl.store(scale_ptr + rm64 * KB + kb, scale, mask=m_ok)


@triton.jit
def _weight_bits(w, scale, FP32_IN: tl.constexpr):
    """e4m3 bits (uint8) of a weight tile at its block's scale. fp32 weights round in integers, not with the
    GPU's cvt (``_e4m3_bits``): with the cvt, Triton 3.6 on the H200 wrote wrong q^T bytes (NaN patterns among
    them) for fp32 weights whose N and K are multiples of 16, through tl.trans(bits) and through transposed
    addresses alike, while q was right (tests/test_fp8.py::test_weights_and_transpose_triton_matches_torch_
    bitwise; root cause not found). bf16 / fp16 weights are right with the cvt, which is cheaper."""
    if FP32_IN:
        return _e4m3_bits_rne(w * _reciprocal(scale)).to(tl.uint8)
    return _e4m3_bits(w * _reciprocal(scale))


@triton.jit
def quantize_weights_bxb_kernel(
    w_ptr,  # [E, N, K] fp32 / bf16 / fp16, contiguous
    q_ptr,  # [E, N, K] uint8: e4m3fn bits
    qt_ptr,  # [E, K, N] uint8: the same bits transposed (TRANSPOSED; else a placeholder, never touched)
    s_ptr,  # [E, NB, KB] fp32 block scales, NB = cdiv(N, SB), KB = cdiv(K, SB)
    N, K, NB, KB,
    SB: tl.constexpr, RC: tl.constexpr, POW2: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """One program per SB x SB block (kb, nb, e): amax over the block (a partial block over what it has), the
    scale rule, q = e4m3(w * (1 / scale)); with TRANSPOSED also q^T, which the FP8 backward's data-gradient
    GEMMs read (e4m3 wgmma takes B K-major only): written here, where the rows are already in registers,
    instead of by a transpose of the e4m3 weights per backward.

    The block streams through in chunks of RC rows, twice: an amax pass, then a quantise pass that reads
    the same rows again (from L2: the block was read a moment before). Holding the whole 128 x 128 block
    in registers took 255 registers and a 280-byte stack a thread at 4 warps (bf16, Triton 3.6), each
    loading, reducing and storing in series: 11.2 ms for the Kimi EP8 slice's weights, 18% of HBM
    bandwidth (H200, benchmarks/probes/wquant_time.py); 32-row chunks take 55 and no stack. RC = SB keeps the
    one-pass form (small blocks, and the launch default until the chunked form has run on a GPU)."""
    kb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rk = kb * SB + tl.arange(0, SB)
    k_ok = (rk < K)[None, :]
    base = e * N * K
    FP32_IN: tl.constexpr = w_ptr.dtype.element_ty == tl.float32
    if RC == SB:
        rn = nb * SB + tl.arange(0, SB)
        msk = (rn < N)[:, None] & k_ok
        offs = base + rn[:, None].to(tl.int64) * K + rk[None, :]
        w = tl.load(w_ptr + offs, mask=msk, other=0.0).to(tl.float32)
        scale = scale_from_amax(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
        bits = _weight_bits(w, scale, FP32_IN)
        tl.store(q_ptr + offs, bits, mask=msk)
        if TRANSPOSED:
            tl.store(qt_ptr + base + rk[:, None].to(tl.int64) * N + rn[None, :], tl.trans(bits), mask=tl.trans(msk))
    else:
        amax = tl.zeros((RC,), tl.float32)
        for r in range(0, SB, RC):
            rn = nb * SB + r + tl.arange(0, RC)
            msk = (rn < N)[:, None] & k_ok
            w = tl.load(w_ptr + base + rn[:, None].to(tl.int64) * K + rk[None, :], mask=msk, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(w.to(tl.float32)), axis=1))
        scale = scale_from_amax(tl.max(amax, axis=0), POW2)
        for r in range(0, SB, RC):
            rn = nb * SB + r + tl.arange(0, RC)
            msk = (rn < N)[:, None] & k_ok
            offs = base + rn[:, None].to(tl.int64) * K + rk[None, :]
            w = tl.load(w_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            bits = _weight_bits(w, scale, FP32_IN)
            tl.store(q_ptr + offs, bits, mask=msk)
            if TRANSPOSED:  # RC bytes a row of q^T: 32 is one 32-byte sector
                tl.store(qt_ptr + base + rk[:, None].to(tl.int64) * N + rn[None, :], tl.trans(bits),
                         mask=tl.trans(msk))
    tl.store(s_ptr + e * NB * KB + nb * KB + kb, scale)
