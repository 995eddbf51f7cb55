"""FP8 block quantisation: scale rules exactly, round trips, Triton kernel vs torch bitwise.

CPU only; the Triton kernel runs under the interpreter (conftest sets TRITON_INTERPRET=1 without CUDA).
"""

import pytest
import torch

from kittenmoe.fp8 import (E4M3_MAX, FP8_DTYPE, MIN_SCALE, FP8Config, FP8ExpertWeights, dequantize_activations,
                           dequantize_weights, launch_weight_quant, quantize_activations, quantize_weights,
                           quantize_weights_and_transpose)
from kittenmoe.testing import assert_bitwise_equal, rel_l1, tolerance_for

# The Triton quantiser runs where the tests can: compiled on a GPU, else under the interpreter on the CPU.
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

CFGS = [
    FP8Config(),  # DeepSeek-V3 default: 128, fp32 scales
    FP8Config(128, pow2_scales=True),  # 128 with E8M0-representable scales
    FP8Config(32, pow2_scales=True),  # MXFP8 family: 32 with power-of-two scales
]
CFG_IDS = ["b128", "b128-pow2", "b32-pow2"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, sorted."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    return v[torch.isfinite(v)].unique()


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs,match", [
    (dict(scale_block=64), "32 or 128"),  # unsupported block size
    (dict(scale_block=128.0), "32 or 128"),  # float, not int
    (dict(scale_block=True), "32 or 128"),  # bool is not an int here
    (dict(scale_block=32), "pow2_scales=True"),  # MXFP8 block without E8M0 scales
    (dict(scale_block=32, pow2_scales=False), "pow2_scales=True"),  # same, explicit
    (dict(pow2_scales=1), "bool"),  # truthy int is not a bool
    (dict(dx_high=1), "dx_high must be a bool"),  # the precision flags likewise
    (dict(down_high="yes"), "down_high must be a bool"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Config(**kwargs)


def test_config_frozen_and_defaults():
    cfg = FP8Config()
    assert (cfg.scale_block, cfg.pow2_scales, cfg.dx_high, cfg.down_high) == (128, False, False, False)
    with pytest.raises(Exception):
        cfg.scale_block = 32  # frozen dataclass


# ---------------------------------------------------------------- scale rules, exactly

def _ref_scale(amax: float, pow2: bool) -> float:
    """The rule written independently: max(amax/448 (fp32), 2^-126), then 2^ceil(log2) in float64."""
    s = max(float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(E4M3_MAX)), MIN_SCALE)
    if pow2:
        import math
        m, e = math.frexp(s)  # s = m * 2^e, m in [0.5, 1)
        s = 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e
    return s


@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_activation_scale_rules(cfg):
    """Row by row: a chosen amax (first element), negative amax, exactly 448, zero row, tiny and huge amax."""
    b = cfg.scale_block
    amaxes = [1.0, -3.0, 448.0, -448.0, 0.0, 0.1, 1e-3, 7.0, 2.0 ** -130, 1e30, 448.0 * 2 ** 5, 900.0]
    x = torch.zeros(len(amaxes), 2 * b)
    for i, a in enumerate(amaxes):
        x[i, 0] = a  # block 0: amax |a| at the first column, smaller values after it
        x[i, 1:b] = a * torch.linspace(-0.9, 0.9, b - 1)
        x[i, b:] = a / 7  # block 1: constant block
    q, s = quantize_activations(x, cfg)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (len(amaxes), 2)
    for i, a in enumerate(amaxes):
        assert s[i, 0].item() == _ref_scale(abs(a), cfg.pow2_scales), (i, a)
        assert s[i, 1].item() == _ref_scale(float(torch.tensor(abs(a) / 7, dtype=torch.float32)), cfg.pow2_scales)
    # zero row: smallest normal fp32 scale, all-zero q
    assert s[4, 0].item() == MIN_SCALE and s[4, 1].item() == MIN_SCALE
    assert (q[4].float() == 0).all()  # (0 * negative gives -0.0, kept as e4m3 -0)
    if not cfg.pow2_scales:
        # amax 448 -> scale exactly 1, and +-448 stays +-448 exactly (no overflow at the edge)
        assert s[2, 0].item() == 1.0 and q[2, 0].float().item() == 448.0 and q[3, 0].float().item() == -448.0
    else:
        assert s[2, 0].item() == 1.0  # 448/448 = 1 is already a power of two
        # 0.1/448 lies strictly between 2^-13 and 2^-12: rounded up, never down
        assert s[5, 0].item() == 2.0 ** -12
        assert torch.log2(s).frac().eq(0).all()  # every scale is an exact power of two
    # the block's amax element maps to +-448 (non-pow2) or into [224, 448] (pow2): full range, no overflow
    big = q.float().abs().amax(dim=1)
    assert (big <= E4M3_MAX).all() and torch.isfinite(q.float()).all()
    for i, a in enumerate(amaxes):
        if a != 0 and abs(a) >= 1e-3:
            lo = 224.0 if cfg.pow2_scales else 448.0
            assert lo <= q[i, 0].float().abs().item() <= 448.0, (i, a, q[i, 0])
            assert (q[i, 0].float().item() < 0) == (a < 0)  # sign kept


@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_pow2_scale_never_overflows(cfg):
    """pow2 rounds up, so x/scale <= 448 for amax just above a power-of-two boundary (448 * 2^e * (1 + ulp))."""
    a = torch.tensor([448.0 * 2.0 ** e for e in range(-20, 20)])
    a = torch.cat([a, torch.nextafter(a, torch.tensor(float("inf"))), torch.nextafter(a, torch.tensor(0.0))])
    x = torch.zeros(a.numel(), cfg.scale_block)
    x[:, 0] = a
    q, s = quantize_activations(x, cfg)
    assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()
    assert (x[:, 0] / s[:, 0] <= 448).all()


@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_zero_and_tiny_blocks(cfg):
    """All-zero block: scale 2^-126, q zeros, dequant zeros; an fp32-subnormal block never gets scale 0."""
    x = torch.zeros(3, cfg.scale_block * 2)
    x[1, :cfg.scale_block] = 1e-40  # subnormal fp32
    x[2, cfg.scale_block:] = -0.0
    q, s = quantize_activations(x, cfg)
    assert (s == MIN_SCALE).all()
    assert torch.equal(dequantize_activations(q, s, cfg)[0], torch.zeros(cfg.scale_block * 2))
    assert (q[0].float() == 0).all() and (q[2].float() == 0).all()
    # the subnormal block is still represented: 1e-40 / 2^-126 ~ 0.0085, an e4m3 subnormal (4 * 2^-9)
    assert (q[1, :cfg.scale_block].float() == 4 * 2.0 ** -9).all()


@pytest.mark.parametrize("k", [1, 5, 127, 129, 200, 300])  # K below, just below/above and between blocks
@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_partial_last_block(cfg, k):
    """The last block is scaled over the columns it has: its scale equals the scale of that slice alone."""
    b = cfg.scale_block
    x = torch.randn(4, k, generator=_gen(k)) * 3
    q, s = quantize_activations(x, cfg)
    kb = -(-k // b)
    assert s.shape == (4, kb) and q.shape == x.shape
    for j in range(kb):
        sl = x[:, j * b:(j + 1) * b]
        q_j, s_j = quantize_activations(sl.contiguous(), cfg)  # one (possibly short) block on its own
        assert torch.equal(s[:, j:j + 1], s_j)
        assert_bitwise_equal(q[:, j * b:(j + 1) * b], q_j, f"block {j}")


@pytest.mark.parametrize("impl", ["torch", "triton"])  # the reference and the Triton quantiser, same rule
def test_rule_multiplies_by_the_reciprocal_scale(impl):
    """q = e4m3(x * RN(1 / scale)), not e4m3(x / scale): written independently in float64 with one rounding
    to fp32 for each of the reciprocal and the product; the problem is large enough that the two rules
    differ somewhere (checked), so a quantiser that divides fails."""
    import numpy as np

    g = _gen(11)
    # bf16 values, as activations arrive: their short mantissas put x / scale on e4m3 rounding midpoints
    # often (1 value in ~2,000 differs between the rules), where random fp32 values almost never are.
    x = (torch.randn(512, 1024, generator=g) * torch.logspace(-2, 2, 1024)).bfloat16().float()
    q, s = quantize_activations(x.to(DEV), impl=impl)
    q, s = q.cpu(), s.cpu()
    s_el = s.repeat_interleave(128, -1)
    inv = (1.0 / s_el.double()).float()  # correctly rounded: float64 quotient, one rounding to fp32
    prod = (x.double() * inv.double()).float()  # exact product in float64, one rounding
    assert_bitwise_equal(q, prod.to(FP8_DTYPE), "q vs e4m3(x * (1 / scale))")
    divided = (x.double() / s_el.double()).float().to(FP8_DTYPE)
    assert not torch.equal(q.view(torch.uint8), divided.view(torch.uint8)), "problem too small to tell the rules apart"
    assert np.isfinite(q.float().numpy()).all()


def test_reciprocal_never_overflows_e4m3():
    """amax * RN(1 / RN(amax / 448)) may exceed 448 by an ulp; it must still round to +-448, never to NaN."""
    g = _gen(12)
    a = torch.rand(20000, generator=g, dtype=torch.float64).mul(40).sub(20).exp2().float()  # 2^-20 .. 2^20
    x = torch.zeros(a.numel(), 128)
    x[:, 0], x[:, 1] = a, -a
    q, _ = quantize_activations(x)
    assert (q[:, 0].float() == 448).all() and (q[:, 1].float() == -448).all()


def test_quantised_values_are_e4m3_of_x_over_scale():
    """With scale 1, q is exactly torch's e4m3 rounding of x, incl. every e4m3 value and midpoint."""
    v = _e4m3_values()
    mid = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))])
    x = torch.cat([x, torch.zeros((-x.numel()) % 127)]).reshape(-1, 127)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)  # amax 448 -> scale 1 -> q = e4m3(x)
    q, s = quantize_activations(x)
    assert (s == 1).all()
    assert_bitwise_equal(q, x.to(FP8_DTYPE), "q vs e4m3(x)")


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("shape", [(64, 256), (7, 300), (2, 3, 128), (1, 1)])  # aligned, partial, 3-D, one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])  # input dtypes
@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_activation_round_trip(cfg, dtype, shape):
    """|dq - x| <= 2^-4 |x| (half an e4m3 step, normal range) + 2^-10 * scale (half the e4m3 subnormal step)."""
    x = (torch.randn(*shape, generator=_gen(1)) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    q, s = quantize_activations(x, cfg)
    assert s.shape == (*shape[:-1], -(-shape[-1] // cfg.scale_block))
    dq = dequantize_activations(q, s, cfg)
    xf = x.float()
    s_el = s.repeat_interleave(cfg.scale_block, -1)[..., :shape[-1]]
    bound = 2.0 ** -4 * xf.abs() + 2.0 ** -10 * s_el
    assert ((dq - xf).abs() <= bound).all()
    assert rel_l1(dq, xf) <= tolerance_for("fp8").rel_l1


@pytest.mark.parametrize("shape", [
    (256, 384),  # [N, K], aligned to both block sizes
    (200, 130),  # [N, K], partial last blocks along both dims
    (3, 130, 260),  # [E, N, K] with an expert dim, partial blocks
    (2, 1, 1),  # [E, N, K] degenerate: one element per expert
])
@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_weight_round_trip_and_scales(cfg, shape):
    b = cfg.scale_block
    w = torch.randn(*shape, generator=_gen(2)) / 30
    q, s = quantize_weights(w, cfg)
    n, k = shape[-2:]
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.shape == (*shape[:-2], -(-n // b), -(-k // b))
    # scales exactly: each B x B (possibly partial) block on its own
    w3 = w.reshape(-1, n, k)
    s3 = s.reshape(-1, *s.shape[-2:])
    for e in range(w3.shape[0]):
        for i in range(s3.shape[1]):
            for j in range(s3.shape[2]):
                amax = w3[e, i * b:(i + 1) * b, j * b:(j + 1) * b].abs().max().item()
                assert s3[e, i, j].item() == _ref_scale(amax, cfg.pow2_scales), (e, i, j)
    dq = dequantize_weights(q, s, cfg)
    s_el = s.repeat_interleave(b, -1)[..., :k].repeat_interleave(b, -2)[..., :n, :]
    assert ((dq - w).abs() <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * s_el).all()
    assert rel_l1(dq, w) <= tolerance_for("fp8").rel_l1


def test_weights_expert_dim_is_per_expert():
    """[E, N, K] gives the same bits as quantising each expert's [N, K] alone (no block crosses experts)."""
    w = torch.randn(4, 130, 140, generator=_gen(3)) * torch.tensor([1e-3, 1.0, 1e3, 0.0])[:, None, None]
    q, s = quantize_weights(w)
    for e in range(4):
        qe, se = quantize_weights(w[e])
        assert_bitwise_equal(q[e], qe, f"expert {e}")
        assert torch.equal(s[e], se)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])  # each non-finite kind
@pytest.mark.parametrize("fn", ["act", "act-triton", "weights"])
def test_non_finite_raises(fn, bad):
    x = torch.ones(4, 160)
    x[2, 150] = bad
    with pytest.raises(ValueError, match="non-finite"):
        if fn == "weights":
            quantize_weights(x)
        else:
            quantize_activations(x, impl="torch" if fn == "act" else "triton")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: quantize_activations(torch.ones(4, 8, dtype=torch.float64)), ValueError, "dtype"),  # fp64 input
    (lambda: quantize_activations(torch.ones(4, 8, dtype=torch.int32)), ValueError, "dtype"),  # int input
    (lambda: quantize_activations(torch.tensor(1.0)), ValueError, "dims"),  # 0-d
    (lambda: quantize_activations(torch.ones(2, 8), impl="cuda"), ValueError, "impl"),  # unknown impl
    (lambda: quantize_weights(torch.ones(8)), ValueError, "dims"),  # 1-D weight
    (lambda: quantize_weights(torch.ones(2, 2, 8, 8)), ValueError, "dims"),  # 4-D weight
    (lambda: dequantize_activations(torch.ones(2, 8), torch.ones(2, 1)), ValueError, "float8"),  # q not fp8
    (lambda: dequantize_activations(torch.ones(2, 8).to(FP8_DTYPE), torch.ones(2, 2)), ValueError, "scale shape"),
    (lambda: dequantize_weights(torch.ones(2, 8).to(FP8_DTYPE), torch.ones(1, 1, dtype=torch.float64)),
     ValueError, "fp32"),  # scale not fp32
    (lambda: dequantize_weights(torch.ones(130, 8).to(FP8_DTYPE), torch.ones(1, 1)), ValueError, "scale shape"),
])
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------- Triton kernel vs torch, bitwise

@pytest.mark.parametrize("shape", [
    (37, 300),  # M not a multiple of BLOCK_M, K with a partial last block for both block sizes
    (16, 256),  # aligned
    (3, 1),  # K = 1: one-element blocks
    (2, 5, 64),  # 3-D input (leading dims flattened), K smaller than a 128 block
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_triton_matches_torch_bitwise(cfg, dtype, shape):
    # values over 60 decades (fp16 limits them to its range); zero rows; negative values
    spread = torch.logspace(-30, 30, shape[-1]) if dtype != torch.float16 else torch.logspace(-4, 4, shape[-1])
    x = (torch.randn(*shape, generator=_gen(4)) * spread).to(dtype)
    x.view(-1, shape[-1])[0] = 0.0
    x = x.to(DEV)
    q_ref, s_ref = quantize_activations(x, cfg)
    q, s = quantize_activations(x, cfg, impl="triton")
    assert_bitwise_equal(s, s_ref, "scale")
    assert_bitwise_equal(q, q_ref, "q")


@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_triton_rounding_edges_bitwise(cfg):
    """The kernel's integer e4m3 rounding vs torch's: every e4m3 value, every midpoint and its fp32 neighbours,
    the subnormal range, signed zeros, fp32 subnormals, at scale 1 (a 448 in every block) and at random scales."""
    v = _e4m3_values()
    mid = (v[1:] + v[:-1]) / 2
    sub = torch.linspace(-2.0 ** -6, 2.0 ** -6, 4001)
    x = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9)), sub,
                   torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -11])])
    b = cfg.scale_block
    x = torch.cat([x, torch.zeros((-x.numel()) % (b - 1))]).reshape(-1, b - 1)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)
    x = torch.cat([x, x * torch.rand(x.shape[0], 1, generator=_gen(5)) * 1e3])  # second half: other scales
    x = x.to(DEV)
    q_ref, s_ref = quantize_activations(x, cfg)
    q, s = quantize_activations(x, cfg, impl="triton")
    assert_bitwise_equal(s, s_ref, "scale")
    assert_bitwise_equal(q, q_ref, "q")


def test_triton_empty_input():
    """M = 0: no launch, empty outputs of the right shapes."""
    q, s = quantize_activations(torch.empty(0, 300, device=DEV), impl="triton")
    assert q.shape == (0, 300) and s.shape == (0, 3) and q.dtype == FP8_DTYPE


# ---------------------------------------------------------------- weights with their transposes (the FP8 backward's B)

@pytest.mark.parametrize("shape", [
    (256, 384),  # [N, K], aligned to both block sizes
    (3, 200, 260),  # [E, N, K], partial last blocks along both dims
    (2, 1, 1),  # one element per expert
    (0, 128),  # no rows
    (2, 0, 5),  # experts with no rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])  # input dtypes
@pytest.mark.parametrize("cfg", CFGS, ids=CFG_IDS)
def test_weights_and_transpose_triton_matches_torch_bitwise(cfg, dtype, shape):
    """The fused kernel gives quantize_weights' q and scale bit for bit, and q_t is exactly q transposed."""
    w = (torch.randn(*shape, generator=_gen(13)) * torch.logspace(-3, 3, shape[-1])).to(dtype).to(DEV)
    q_ref, s_ref = quantize_weights(w, cfg)
    q, s, q_t = quantize_weights_and_transpose(w, cfg, impl="triton")
    assert_bitwise_equal(s, s_ref, "scale")
    assert_bitwise_equal(q, q_ref, "q")
    assert q_t.is_contiguous() and q_t.dtype == FP8_DTYPE
    assert_bitwise_equal(q_t, q_ref.transpose(-1, -2), "q_t")
    q2, s2, q2_t = quantize_weights_and_transpose(w, cfg, impl="torch")
    assert_bitwise_equal(q2_t, q_t, "torch q_t")


@pytest.mark.parametrize("rows_per_chunk", [16, 32, 64])  # chunks of a 128-block: 8, 4 and 2 of them
@pytest.mark.parametrize("shape", [
    (256, 384),  # aligned to the block
    (2, 200, 260),  # partial last blocks: the last chunk of a block is partly or wholly past N
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2"])
def test_weight_quant_chunked_form_equals_one_pass(rows_per_chunk, shape, dtype, pow2):
    """The weight quantiser streaming each 128 x 128 block in row chunks (an amax pass, then a quantise pass)
    gives the one-pass form's q, scales and q^T bit for bit."""
    w = (torch.randn(*shape, generator=_gen(15)) * torch.logspace(-3, 3, shape[-1])).to(dtype).to(DEV)
    want = launch_weight_quant(w, 128, pow2, 128)
    got = launch_weight_quant(w, 128, pow2, rows_per_chunk)
    for name, a, b in zip(("q", "scale", "q_t"), got, want):
        assert_bitwise_equal(a, b, name)


def test_weight_quant_chunk_rows_checked():
    w = torch.randn(128, 128, generator=_gen(16)).to(DEV)
    with pytest.raises(ValueError, match="rows_per_chunk must be a power of two"):
        launch_weight_quant(w, 128, False, 48)


def test_expert_weights_carry_transposes():
    """quantize() makes the transposes, experts() slices them, transposed() returns them (or makes them when
    absent), and a transpose of the wrong shape is refused."""
    g = _gen(14)
    w13 = torch.randn(4, 256, 128, generator=g).to(DEV)
    w2 = torch.randn(4, 128, 128, generator=g).to(DEV)
    fw = FP8ExpertWeights.quantize(w13, w2)
    assert_bitwise_equal(fw.w13_qt, fw.w13_q.transpose(1, 2), "w13_qt")
    assert_bitwise_equal(fw.w2_qt, fw.w2_q.transpose(1, 2), "w2_qt")
    part = fw.experts(1, 3)
    assert_bitwise_equal(part.w13_qt, fw.w13_qt[1:3], "sliced w13_qt")
    bare = FP8ExpertWeights(fw.w13_q, fw.w13_scale, fw.w2_q, fw.w2_scale, fw.cfg)
    for got, want in zip(bare.transposed(), fw.transposed()):
        assert_bitwise_equal(got, want, "transposed() without copies")
    with pytest.raises(ValueError, match="w13_qt must be"):
        FP8ExpertWeights(fw.w13_q, fw.w13_scale, fw.w2_q, fw.w2_scale, fw.cfg, fw.w13_q, fw.w2_qt)


@pytest.mark.parametrize("shape", [(130, 260), (2, 128, 256)])  # 2-D with partial blocks; 3-D aligned
def test_quantize_weights_op_opcheck(shape):
    """kittenmoe::quantize_weights_fp8 (what torch.compile traces): schema, fake impl and real impl agree."""
    w = torch.randn(*shape, generator=_gen(15)).to(DEV)
    torch.library.opcheck(torch.ops.kittenmoe.quantize_weights_fp8, (w, 128, False))
