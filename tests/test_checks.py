"""Bad input gets a clear error before any work (docs/design.md "Invariants and errors").

Every malformed input of ``moe_forward_multirank`` raises the documented
error type (TypeError for types and dtypes, ValueError for shapes, contiguity
and values) with a message naming the problem; likewise ``KernelConfig``,
``ModelShape`` and ``get_shape``.
"""

from __future__ import annotations

import pytest
import torch

from kittenmoe.config import TEST_SHAPES, KernelConfig, ModelShape, default_config, get_shape
from kittenmoe.testing import make_weights, routing_uniform
from kittenmoe.torch_backend import moe_forward_multirank

SHAPE = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
R, T = 2, 5
E, H, I, K = SHAPE.e, SHAPE.h, SHAPE.i, SHAPE.k


def make_inputs(r: int = R, t: int = T, k: int = K, seed: int = 0) -> dict:
    """Valid keyword arguments of moe_forward_multirank (with a shared expert)."""
    g = torch.Generator().manual_seed(seed)
    w = make_weights(SHAPE, generator=g)
    xs, ids, tw = [], [], []
    for _ in range(r):
        xs.append(torch.randn(t, H, generator=g))
        i_, w_ = routing_uniform(t, E, k, generator=g)
        ids.append(i_)
        tw.append(w_)
    return dict(x_RTH=xs, topk_ids_RTK=ids, topk_weights_RTK=tw, w13_E2IH=w.w13_E2IH, w2_EHI=w.w2_EHI,
                shared_w13_2SH=w.shared_w13_2SH, shared_w2_HS=w.shared_w2_HS)


def test_valid_inputs_run():
    # the baseline every bad case below perturbs is accepted
    kw = make_inputs()
    out = moe_forward_multirank(**kw)
    assert len(out) == R and all(o.shape == (T, H) and torch.isfinite(o).all() for o in out)


def _set(key, rank, fn):
    """Mutation: replace kw[key][rank] with fn(old)."""
    def mut(kw):
        kw[key][rank] = fn(kw[key][rank])
    return mut


def _put(key, fn):
    """Mutation: replace kw[key] with fn(old)."""
    def mut(kw):
        kw[key] = fn(kw[key])
    return mut


def _ids_and_weights(rank, fn_ids, fn_w=None):
    def mut(kw):
        kw["topk_ids_RTK"][rank] = fn_ids(kw["topk_ids_RTK"][rank])
        if fn_w is not None:
            kw["topk_weights_RTK"][rank] = fn_w(kw["topk_weights_RTK"][rank])
    return mut


def _poke_id(rank, value, dtype=torch.int64):
    """Set one expert id of ``rank`` to ``value`` (ids converted to ``dtype``)."""
    def fn(ids):
        ids = ids.to(dtype).clone()
        ids[T // 2, K - 1] = value
        return ids
    return _set("topk_ids_RTK", rank, fn)


def _noncontig(v):
    """Same values, transposed storage: not contiguous."""
    return v.t().contiguous().t() if v.dim() == 2 else v.transpose(-1, -2).contiguous().transpose(-1, -2)


BAD_INPUTS = [
    # ---- wrong number of dimensions
    # x[0] [1, T, H] instead of [T, H]
    pytest.param(_set("x_RTH", 0, lambda v: v[None]), ValueError, r"x\[0\] must have 2 dimensions", id="x-3d"),
    # x[1] flattened to 1-D
    pytest.param(_set("x_RTH", 1, lambda v: v.reshape(-1)), ValueError, r"x\[1\] must have 2 dimensions",
                 id="x-1d"),
    # topk_ids[1] flattened to [T*K]
    pytest.param(_set("topk_ids_RTK", 1, lambda v: v.reshape(-1)), ValueError,
                 r"topk_ids\[1\] must have 2 dimensions", id="ids-1d"),
    # topk_ids[0] with an extra leading dim
    pytest.param(_set("topk_ids_RTK", 0, lambda v: v[None]), ValueError, r"topk_ids\[0\] must have 2 dimensions",
                 id="ids-3d"),
    # topk_weights[0] with an extra trailing dim
    pytest.param(_set("topk_weights_RTK", 0, lambda v: v[..., None]), ValueError,
                 r"topk_weights\[0\] must have 2 dimensions", id="weights-3d"),
    # w13 missing the expert dim
    pytest.param(_put("w13_E2IH", lambda v: v[0]), ValueError, r"w13 must have 3 dimensions", id="w13-2d"),
    # w2 missing the expert dim
    pytest.param(_put("w2_EHI", lambda v: v[0]), ValueError, r"w2 must have 3 dimensions", id="w2-2d"),
    # w2 with an extra dim
    pytest.param(_put("w2_EHI", lambda v: v[None]), ValueError, r"w2 must have 3 dimensions", id="w2-4d"),
    # shared_w13 with an expert dim it should not have
    pytest.param(_put("shared_w13_2SH", lambda v: v[None]), ValueError, r"shared_w13 must have 2 dimensions",
                 id="shared-w13-3d"),
    # shared_w2 flattened
    pytest.param(_put("shared_w2_HS", lambda v: v.reshape(-1)), ValueError, r"shared_w2 must have 2 dimensions",
                 id="shared-w2-1d"),
    # ---- shapes of the weights
    # w13 dim 1 odd: cannot split into gate and up halves
    pytest.param(_put("w13_E2IH", lambda v: v[:, :-1].contiguous()), ValueError, r"dim 1 = 31 is odd",
                 id="w13-odd-dim1"),
    # w2 inner dim I-1 instead of I
    pytest.param(_put("w2_EHI", lambda v: v[:, :, :-1].contiguous()), ValueError, r"w2 must be \[E, H, I\]",
                 id="w2-wrong-I"),
    # w2 with fewer experts than w13
    pytest.param(_put("w2_EHI", lambda v: v[:-2].contiguous()), ValueError, r"w2 must be \[E, H, I\]",
                 id="w2-wrong-E"),
    # w2 laid out [E, I, H] (transposed) instead of [E, H, I]
    pytest.param(_put("w2_EHI", lambda v: v.transpose(1, 2).contiguous()), ValueError, r"w2 must be \[E, H, I\]",
                 id="w2-transposed"),
    # shared_w13 with the wrong hidden size
    pytest.param(_put("shared_w13_2SH", lambda v: v[:, :-1].contiguous()), ValueError,
                 r"shared_w13 must be \[2\*S, H=32\]", id="shared-w13-wrong-H"),
    # shared_w13 with an odd row count
    pytest.param(_put("shared_w13_2SH", lambda v: v[:-1].contiguous()), ValueError, r"shared_w13 must be \[2\*S",
                 id="shared-w13-odd"),
    # shared_w2 width not matching shared_w13
    pytest.param(_put("shared_w2_HS", lambda v: v[:, :-1].contiguous()), ValueError, r"shared_w2 must be \[H, S\]",
                 id="shared-w2-wrong-S"),
    # ---- dtypes
    # x float64 while the expert weights are float32
    pytest.param(_set("x_RTH", 1, lambda v: v.double()), TypeError,
                 r"x\[1\] has dtype torch.float64 but the expert weights are torch.float32", id="x-vs-weights"),
    # x bfloat16 while the expert weights are float32
    pytest.param(_set("x_RTH", 0, lambda v: v.bfloat16()), TypeError, r"x\[0\] has dtype torch.bfloat16",
                 id="x-bf16-vs-weights"),
    # w2 float64, w13 float32
    pytest.param(_put("w2_EHI", lambda v: v.double()), TypeError, r"w13 .*and w2 .*must share a dtype",
                 id="w13-vs-w2"),
    # shared_w13 bf16, routed float32
    pytest.param(_put("shared_w13_2SH", lambda v: v.bfloat16()), TypeError,
                 r"shared expert weights must have the routed weights' dtype", id="shared-w13-vs-routed"),
    # shared_w2 float64, routed float32
    pytest.param(_put("shared_w2_HS", lambda v: v.double()), TypeError,
                 r"shared expert weights must have the routed weights' dtype", id="shared-w2-vs-routed"),
    # float expert ids
    pytest.param(_set("topk_ids_RTK", 0, lambda v: v.float()), TypeError, r"topk_ids\[0\] has dtype torch.float32",
                 id="ids-float"),
    # int16 expert ids (only int32/int64 supported)
    pytest.param(_set("topk_ids_RTK", 1, lambda v: v.to(torch.int16)), TypeError,
                 r"topk_ids\[1\] has dtype torch.int16", id="ids-int16"),
    # integer router weights
    pytest.param(_set("topk_weights_RTK", 0, lambda v: v.to(torch.int32)), TypeError,
                 r"topk_weights\[0\] has dtype torch.int32", id="weights-int"),
    # integer expert weights
    pytest.param(_put("w13_E2IH", lambda v: v.to(torch.int32)), TypeError, r"w13 has dtype torch.int32",
                 id="w13-int"),
    # ---- contiguity
    # x[0] transposed storage
    pytest.param(_set("x_RTH", 0, _noncontig), ValueError, r"x\[0\] must be contiguous", id="x-noncontig"),
    # x[1] a strided slice of a wider tensor
    pytest.param(_set("x_RTH", 1, lambda v: torch.cat([v, v], 1)[:, ::2]), ValueError,
                 r"x\[1\] must be contiguous", id="x-strided"),
    # topk_weights[1] transposed storage
    pytest.param(_set("topk_weights_RTK", 1, _noncontig), ValueError, r"topk_weights\[1\] must be contiguous",
                 id="weights-noncontig"),
    # topk_ids[0] transposed storage
    pytest.param(_set("topk_ids_RTK", 0, _noncontig), ValueError, r"topk_ids\[0\] must be contiguous",
                 id="ids-noncontig"),
    # w13 transposed storage
    pytest.param(_put("w13_E2IH", _noncontig), ValueError, r"w13 must be contiguous", id="w13-noncontig"),
    # w2 transposed storage
    pytest.param(_put("w2_EHI", _noncontig), ValueError, r"w2 must be contiguous", id="w2-noncontig"),
    # shared_w2 transposed storage
    pytest.param(_put("shared_w2_HS", _noncontig), ValueError, r"shared_w2 must be contiguous",
                 id="shared-w2-noncontig"),
    # ---- token / hidden / top-k consistency
    # rank 1 has T-1 tokens (x, ids and weights all consistent with each other)
    pytest.param(lambda kw: [_set(k_, 1, lambda v: v[:-1].contiguous())(kw)
                             for k_ in ("x_RTH", "topk_ids_RTK", "topk_weights_RTK")],
                 ValueError, r"x\[1\] has 4 tokens but x\[0\] has 5; every rank needs the same T", id="T-differs"),
    # ids with T-1 rows while x has T
    pytest.param(_set("topk_ids_RTK", 0, lambda v: v[:-1].contiguous()), ValueError,
                 r"topk_ids\[0\] .* must both be \[T, K\]", id="ids-T-vs-x"),
    # weights with K-1 columns while ids have K
    pytest.param(_set("topk_weights_RTK", 1, lambda v: v[:, :-1].contiguous()), ValueError,
                 r"topk_weights\[1\] .* must both be \[T, K\]", id="weights-K-vs-ids"),
    # rank 1 uses a different K (ids and weights agree with each other)
    pytest.param(_ids_and_weights(1, lambda v: v[:, :1].contiguous(), lambda v: v[:, :1].contiguous()),
                 ValueError, r"must both be \[T, K\] = \(5, 2\)", id="K-differs"),
    # x hidden size H+1 vs weights' H
    pytest.param(_set("x_RTH", 1, lambda v: torch.cat([v, v[:, :1]], 1)), ValueError,
                 r"x\[1\] has hidden size 33, the weights expect H=32", id="H-mismatch"),
    # K = E+1 ids per token
    pytest.param(lambda kw: [_ids_and_weights(r, lambda v: torch.zeros(T, E + 1, dtype=torch.int64),
                                              lambda v: torch.full((T, E + 1), 1.0 / (E + 1)))(kw)
                             for r in range(R)],
                 ValueError, r"top-k K=9 exceeds the number of experts E=8", id="K>E"),
    # T=0 on every rank
    pytest.param(lambda kw: [_ids_and_weights(r, lambda v: v[:0], lambda v: v[:0])(kw) or
                             _set("x_RTH", r, lambda v: v[:0])(kw) for r in range(R)],
                 ValueError, r"no tokens \(T=0\)", id="T=0"),
    # K=0 on every rank
    pytest.param(lambda kw: [_ids_and_weights(r, lambda v: v[:, :0].contiguous(), lambda v: v[:, :0].contiguous())(kw)
                             for r in range(R)],
                 ValueError, r"K=0", id="K=0"),
    # ---- shared expert pairing
    # shared_w13 given, shared_w2 missing
    pytest.param(_put("shared_w2_HS", lambda v: None), ValueError, r"shared_w13 and shared_w2 must be given together",
                 id="shared-w13-only"),
    # shared_w2 given, shared_w13 missing
    pytest.param(_put("shared_w13_2SH", lambda v: None), ValueError,
                 r"shared_w13 and shared_w2 must be given together", id="shared-w2-only"),
    # ---- the per-rank lists
    # x an empty list
    pytest.param(_put("x_RTH", lambda v: []), TypeError, r"x must be a non-empty list", id="x-empty"),
    # topk_ids an empty list
    pytest.param(_put("topk_ids_RTK", lambda v: []), TypeError, r"topk_ids must be a non-empty list",
                 id="ids-empty"),
    # topk_weights an empty list
    pytest.param(_put("topk_weights_RTK", lambda v: []), TypeError, r"topk_weights must be a non-empty list",
                 id="weights-empty"),
    # x a stacked tensor instead of a list per rank
    pytest.param(_put("x_RTH", torch.stack), TypeError, r"x must be a non-empty list", id="x-tensor-not-list"),
    # one fewer topk_ids than x
    pytest.param(_put("topk_ids_RTK", lambda v: v[:1]), ValueError,
                 r"one tensor per rank expected: got 2 x, 1 topk_ids", id="ids-list-short"),
    # one more topk_weights than x
    pytest.param(_put("topk_weights_RTK", lambda v: v + v[:1]), ValueError,
                 r"one tensor per rank expected: got 2 x, 2 topk_ids, 3 topk_weights", id="weights-list-long"),
    # a rank's x not a tensor
    pytest.param(_set("x_RTH", 1, lambda v: v.tolist()), TypeError, r"x\[1\] must be a torch.Tensor",
                 id="x-elem-list"),
    # w13 not a tensor
    pytest.param(_put("w13_E2IH", lambda v: v.numpy()), TypeError, r"w13 must be a torch.Tensor", id="w13-numpy"),
    # ---- devices: one rank's x on another device than the rest (the meta device needs no GPU)
    # rank 1's x on meta while the weights and rank 0 are on CPU
    pytest.param(_set("x_RTH", 1, lambda v: v.to("meta")), ValueError, r"x\[1\] is on meta but the inputs are on cpu",
                 id="x-other-device"),
    # w2 on meta
    pytest.param(_put("w2_EHI", lambda v: v.to("meta")), ValueError, r"w2 is on meta but the inputs are on cpu",
                 id="w2-other-device"),
    # ---- expert ids: E not divisible by R, out of range
    # R=3 ranks cannot split E=8 experts
    pytest.param(lambda kw: kw.update(make_inputs(r=3)), ValueError,
                 r"E=8 experts cannot be split evenly over R=3 ranks", id="E%R"),
    # id == E on rank 1
    pytest.param(_poke_id(1, E), ValueError, r"1 routes name an expert id outside \[0, E=8\)", id="id=E"),
    # id far past E on rank 0
    pytest.param(_poke_id(0, 1000), ValueError, r"outside \[0, E=8\)", id="id>>E"),
    # id -1 on rank 0
    pytest.param(_poke_id(0, -1), ValueError, r"outside \[0, E=8\)", id="id=-1"),
    # very negative int32 id on rank 1
    pytest.param(_poke_id(1, -2**31, torch.int32), ValueError, r"outside \[0, E=8\)", id="id-int32-min"),
]


@pytest.mark.parametrize("mutate, exc, match", BAD_INPUTS)
def test_bad_input_raises(mutate, exc, match):
    kw = make_inputs()
    mutate(kw)
    with pytest.raises(exc, match=match):
        moe_forward_multirank(**kw)


# Expert-id values are the one check the megakernel leaves to the device (flagged there, the valid routes still
# computed: test_megakernel_fwd's bad-id tests); every other malformed input is refused before any launch.
_DEVICE_CHECKED = ("id=E", "id>>E", "id=-1", "id-int32-min")


@pytest.mark.parametrize("mutate, exc, match",
                         [p for p in BAD_INPUTS if p.id not in _DEVICE_CHECKED])
def test_bad_input_raises_in_the_megakernel_launcher(mutate, exc, match):
    """The megakernel launcher refuses the same malformed inputs with the same errors (one checker,
    kittenmoe.checks, behind both backends)."""
    from kittenmoe.launch_forward import megakernel_forward_multirank

    kw = make_inputs()
    mutate(kw)
    with pytest.raises(exc, match=match):
        megakernel_forward_multirank(**kw)


def test_top_k_bound_counts_every_process_experts():
    """One process's share of the experts (kittenmoe.ep): K may exceed the local count, not the global one."""
    from kittenmoe.checks import check_moe_inputs

    kw = make_inputs(r=1, k=3)
    local = dict(kw, w13_E2IH=kw["w13_E2IH"][:2], w2_EHI=kw["w2_EHI"][:2])  # 2 of the E experts held here
    with pytest.raises(ValueError, match=r"top-k K=3 exceeds the number of experts E=2"):
        check_moe_inputs(**local)
    assert check_moe_inputs(**local, expert_parallel=2).k == 3  # 4 experts over 2 processes: fine
    with pytest.raises(ValueError, match=r"top-k K=3 exceeds the number of experts E=2"):
        check_moe_inputs(**local, expert_parallel=1)


def test_invalid_ids_counted_across_ranks():
    # the message reports how many routes are invalid, summed over every rank
    kw = make_inputs()
    kw["topk_ids_RTK"][0] = kw["topk_ids_RTK"][0].clone()
    kw["topk_ids_RTK"][1] = kw["topk_ids_RTK"][1].clone()
    kw["topk_ids_RTK"][0][0, 0] = -3
    kw["topk_ids_RTK"][1][2, 1] = E
    kw["topk_ids_RTK"][1][4, 0] = E + 5
    with pytest.raises(ValueError, match=r"^3 routes name an expert id outside \[0, E=8\)"):
        moe_forward_multirank(**kw)


@pytest.mark.parametrize("block_m", [0, -4])  # non-positive row tile of the torch backend
def test_bad_block_m(block_m):
    with pytest.raises(ValueError, match=r"block_m must be >= 1"):
        moe_forward_multirank(**make_inputs(), block_m=block_m)


def test_inputs_not_modified_by_failed_call():
    # a rejected call leaves the caller's tensors untouched
    kw = make_inputs()
    kw["topk_ids_RTK"][1] = kw["topk_ids_RTK"][1].clone()
    kw["topk_ids_RTK"][1][0, 0] = E
    before = [t.clone() for t in kw["x_RTH"] + kw["topk_ids_RTK"] + kw["topk_weights_RTK"]]
    with pytest.raises(ValueError):
        moe_forward_multirank(**kw)
    after = kw["x_RTH"] + kw["topk_ids_RTK"] + kw["topk_weights_RTK"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ---------------------------------------------------------------- KernelConfig

def test_kernel_config_default_valid():
    # the defaults and a few legal variations construct
    KernelConfig()
    KernelConfig(block_m=16, block_n=16, block_k=16, minibatch_size=16, macrobatch_size=64, num_warps=1)
    KernelConfig(block_m=256, minibatch_size=256, macrobatch_size=256, num_comm_programs_fwd=1,
                 num_comm_programs_bwd=1, num_stages=1)
    assert KernelConfig().with_(macrobatch_size=4096).macrobatch_size == 4096


BAD_CONFIGS = [
    # ---- non-int knobs
    # float block_m
    pytest.param(dict(block_m=128.0), TypeError, r"KernelConfig.block_m must be an int, got float", id="block_m-float"),
    # bool passed for an int knob
    pytest.param(dict(num_comm_programs_fwd=True), TypeError, r"num_comm_programs_fwd must be an int, got bool",
                 id="comm-bool"),
    # string minibatch
    pytest.param(dict(minibatch_size="512"), TypeError, r"minibatch_size must be an int, got str", id="minibatch-str"),
    # float macrobatch (None is the only non-int allowed)
    pytest.param(dict(macrobatch_size=1024.0), TypeError, r"macrobatch_size must be an int, got float",
                 id="macrobatch-float"),
    # float num_warps
    pytest.param(dict(num_warps=4.0), TypeError, r"num_warps must be an int", id="warps-float"),
    # None for a knob that has no None meaning
    pytest.param(dict(num_stages=None), TypeError, r"num_stages must be an int, got NoneType", id="stages-none"),
    # ---- block sizes
    # block_m not a power of two
    pytest.param(dict(block_m=96, minibatch_size=96 * 4), ValueError, r"block_m must be a power of two >= 16",
                 id="block_m-not-pow2"),
    # block_n not a power of two
    pytest.param(dict(block_n=48), ValueError, r"block_n must be a power of two", id="block_n-not-pow2"),
    # block_k power of two but below tl.dot's 16
    pytest.param(dict(block_k=8), ValueError, r"block_k must be a power of two >= 16", id="block_k-8"),
    # block_m zero
    pytest.param(dict(block_m=0), ValueError, r"block_m must be a power of two", id="block_m-0"),
    # block_n negative
    pytest.param(dict(block_n=-64), ValueError, r"block_n must be a power of two", id="block_n-negative"),
    # block_m past the shared-memory cap
    pytest.param(dict(block_m=512, minibatch_size=512), ValueError, r"block sizes above 256", id="block_m-512"),
    # ---- minibatch / macrobatch
    # minibatch not a multiple of block_m
    pytest.param(dict(minibatch_size=200), ValueError, r"minibatch_size=200 must be a positive multiple of block_m=128",
                 id="minibatch-not-multiple"),
    # minibatch smaller than block_m
    pytest.param(dict(minibatch_size=64), ValueError, r"minibatch_size=64 must be a positive multiple",
                 id="minibatch<block_m"),
    # minibatch zero
    pytest.param(dict(minibatch_size=0), ValueError, r"minibatch_size=0 must be a positive multiple",
                 id="minibatch-0"),
    # macrobatch not a multiple of minibatch
    pytest.param(dict(minibatch_size=512, macrobatch_size=768), ValueError,
                 r"macrobatch_size=768 must be a positive multiple of minibatch_size=512",
                 id="macrobatch-not-multiple"),
    # macrobatch smaller than minibatch
    pytest.param(dict(macrobatch_size=256), ValueError, r"macrobatch_size=256 must be a positive multiple",
                 id="macrobatch<minibatch"),
    # macrobatch zero
    pytest.param(dict(macrobatch_size=0), ValueError, r"macrobatch_size=0 must be a positive multiple",
                 id="macrobatch-0"),
    # ---- programs, stages, warps
    # no forward communication program and no gathering epilogue: nothing would push finished rows
    pytest.param(dict(num_comm_programs_fwd=0), ValueError, r"num_comm_programs_fwd=0 .* needs combine_gather",
                 id="comm-fwd-0-no-gather"),
    # negative forward communication programs
    pytest.param(dict(num_comm_programs_fwd=-1, combine_gather=True), ValueError,
                 r"num_comm_programs_fwd must be >= 0", id="comm-fwd-negative"),
    # no backward communication program and a push to do: nothing would push the d_x rows
    pytest.param(dict(num_comm_programs_bwd=0), ValueError, r"num_comm_programs_bwd=0 .* needs combine_gather",
                 id="comm-bwd-0-no-gather"),
    # negative backward communication programs
    pytest.param(dict(num_comm_programs_bwd=-1), ValueError, r"num_comm_programs_bwd must be >= 0",
                 id="comm-bwd-negative"),
    # zero pipeline stages
    pytest.param(dict(num_stages=0), ValueError, r"num_stages must be >= 1", id="stages-0"),
    # negative backward stages (0 is the default: follow num_stages up to 3)
    pytest.param(dict(bwd_num_stages=-1), ValueError, r"bwd_num_stages must be >= 0", id="bwd-stages-negative"),
    # the Gluon weight gradients' tile is 128 x 256 of 64-row steps: block_n 64, 32-row steps
    pytest.param(dict(wgrad="gluon", block_n=64), ValueError, r"wgrad='gluon' builds 128 x 256", id="gluon-bn64"),
    pytest.param(dict(wgrad="gluon", block_k=32), ValueError, r"min\(block_k, block_m\)=64", id="gluon-bk32"),
    # a knob that is not a bool
    pytest.param(dict(tma=1), TypeError, r"tma must be a bool", id="tma-int"),
    # the weight-gradient kernel is one of three names; an unknown one (or not a string) names them
    pytest.param(dict(wgrad="cutlass"), ValueError, r"wgrad must be one of 'triton', 'persistent', 'gluon', "
                 r"got 'cutlass'", id="wgrad-unknown"),
    pytest.param(dict(wgrad=True), ValueError, r"wgrad must be one of", id="wgrad-bool"),
    # num_warps not a power of two
    pytest.param(dict(num_warps=3), ValueError, r"num_warps must be one of 1, 2, 4, 8, 16, got 3", id="warps-3"),
    # num_warps too many
    pytest.param(dict(num_warps=32), ValueError, r"num_warps must be one of", id="warps-32"),
    # num_warps zero
    pytest.param(dict(num_warps=0), ValueError, r"num_warps must be one of", id="warps-0"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD_CONFIGS)
def test_kernel_config_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KernelConfig(**kwargs)


def test_kernel_config_with_validates():
    # with_() re-validates: a bad change is rejected, the original is untouched
    cfg = KernelConfig()
    with pytest.raises(ValueError, match=r"minibatch_size=100"):
        cfg.with_(minibatch_size=100)
    assert cfg.minibatch_size == KernelConfig().minibatch_size


# ---------------------------------------------------------------- ModelShape, get_shape

BAD_SHAPES = [
    # K > E
    pytest.param(dict(e=4, h=8, i=8, k=5), r"top-k K=5 exceeds the number of experts E=4", id="K>E"),
    # unknown score function
    pytest.param(dict(e=4, h=8, i=8, k=2, score_func="relu"), r"score_func must be 'softmax' or 'sigmoid'",
                 id="score-func"),
    # zero experts
    pytest.param(dict(e=0, h=8, i=8, k=1), r"ModelShape.e must be a positive int, got 0", id="e-0"),
    # negative hidden
    pytest.param(dict(e=4, h=-8, i=8, k=1), r"ModelShape.h must be a positive int, got -8", id="h-negative"),
    # zero expert width
    pytest.param(dict(e=4, h=8, i=0, k=1), r"ModelShape.i must be a positive int, got 0", id="i-0"),
    # zero top-k
    pytest.param(dict(e=4, h=8, i=8, k=0), r"ModelShape.k must be a positive int, got 0", id="k-0"),
    # float dimension
    pytest.param(dict(e=4, h=8.0, i=8, k=1), r"ModelShape.h must be a positive int, got 8.0", id="h-float"),
    # negative shared width
    pytest.param(dict(e=4, h=8, i=8, k=1, shared_i=-1), r"shared_i must be >= 0", id="shared_i-negative"),
    # non-positive SwiGLU clamp
    pytest.param(dict(e=4, h=8, i=8, k=1, swiglu_limit=0.0), r"ModelShape.swiglu_limit must be a positive number",
                 id="swiglu-limit-0"),
    # True is not a clamp (it would run as a limit of 1.0)
    pytest.param(dict(e=4, h=8, i=8, k=1, swiglu_limit=True), r"ModelShape.swiglu_limit must be a positive number",
                 id="swiglu-limit-bool"),
    # a limit as text (from a config file), not a number
    pytest.param(dict(e=4, h=8, i=8, k=1, swiglu_limit="7"), r"ModelShape.swiglu_limit must be a positive number",
                 id="swiglu-limit-str"),
    # a scaling factor as text: the router would fail deep in its multiply
    pytest.param(dict(e=4, h=8, i=8, k=1, routed_scaling_factor="2.5"),
                 r"ModelShape.routed_scaling_factor must be a finite number > 0, got '2.5'", id="rsf-str"),
    # a NaN scaling factor: every output NaN
    pytest.param(dict(e=4, h=8, i=8, k=1, routed_scaling_factor=float("nan")),
                 r"ModelShape.routed_scaling_factor must be a finite number > 0", id="rsf-nan"),
    # a zero scaling factor: the routed experts silently contribute nothing
    pytest.param(dict(e=4, h=8, i=8, k=1, routed_scaling_factor=0), r"routed_scaling_factor must be a finite number",
                 id="rsf-0"),
    # renormalize as text: any non-empty string is truthy, so "false" would renormalize
    pytest.param(dict(e=4, h=8, i=8, k=1, renormalize="false"), r"ModelShape.renormalize must be a bool, got 'false'",
                 id="renormalize-str"),
]


@pytest.mark.parametrize("kwargs, match", BAD_SHAPES)
def test_model_shape_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelShape("bad", **kwargs)


def test_model_shape_valid_and_split():
    # a valid shape constructs; experts_per_rank rejects uneven splits and EP <= 0
    s = ModelShape("ok", e=8, h=8, i=8, k=8, shared_i=0)
    assert s.shared_width == 0 and s.experts_per_rank(4) == 2
    with pytest.raises(ValueError, match=r"E=8 experts cannot be split evenly over EP=3"):
        s.experts_per_rank(3)
    with pytest.raises(ValueError, match=r"EP=0"):
        s.experts_per_rank(0)


def test_get_shape():
    # known names resolve; unknown names list the known ones
    assert get_shape("tiny") is TEST_SHAPES["tiny"]
    with pytest.raises(ValueError, match=r"unknown model shape 'nope'; known: .*tiny"):
        get_shape("nope")


@pytest.mark.parametrize("kwargs", [
    dict(e=True),  # a bool is not a dimension
    dict(shared_i=1.5),  # shared width must be an int
    dict(shared_i=True),  # ... and not a bool
])
def test_model_shape_rejects_non_int_dims(kwargs):
    base = dict(name="b", e=8, h=8, i=8, k=1)
    with pytest.raises(ValueError, match="ModelShape"):
        ModelShape(**{**base, **kwargs})


from kittenmoe.config import SHARED_MEMORY_LIMIT, bwd_phase_a_smem_bytes, check_shared_memory, gate_up_smem_bytes  # noqa: E402


@pytest.mark.parametrize("cfg, elem, backward, fits", [
    (KernelConfig(), 2, False, True),  # the bf16 default forward tile: 4 x 48 KB
    (KernelConfig(), 2, True, True),  # the bf16 default backward phase A: 3 x 56 KB
    (KernelConfig(), 4, False, False),  # fp32 operands double every tile: the forward no longer fits
    (KernelConfig(), 4, True, False),  # ... nor the backward
    (KernelConfig(block_k=32, num_stages=3), 4, False, True),  # fp32 with narrower K tiles and 3 stages fits
])
def test_shared_memory_check(cfg, elem, backward, fits):
    need = bwd_phase_a_smem_bytes(cfg, elem) if backward else gate_up_smem_bytes(cfg, elem)
    assert (need <= SHARED_MEMORY_LIMIT) == fits
    if fits:
        check_shared_memory(cfg, elem, backward)
    else:
        with pytest.raises(ValueError, match="shared memory"):
            check_shared_memory(cfg, elem, backward)


# KernelConfig.bwd_stages: what the backward megakernel is built with, and the shared-memory estimate follows it
@pytest.mark.parametrize("kwargs, stages", [
    (dict(), 3),  # default: num_stages 4 capped at 3, the build timed so far
    (dict(num_stages=2), 2),  # small configs follow num_stages down
    (dict(bwd_num_stages=4), 4),  # explicit: one stage deeper than the forward's cap allows
    (dict(num_stages=2, bwd_num_stages=4), 4),  # explicit wins over num_stages
])
def test_kernel_config_bwd_stages(kwargs, stages):
    from kittenmoe.config import bwd_phase_a_smem_bytes

    cfg = KernelConfig(**kwargs)
    assert cfg.bwd_stages == stages
    one = bwd_phase_a_smem_bytes(cfg.with_(num_stages=1, bwd_num_stages=1))
    # the megakernel's loops scale with bwd_stages (the weight-gradient launch's term with num_stages)
    assert bwd_phase_a_smem_bytes(cfg) >= stages * one


# ---------------------------------------------------------------- default_config: the heuristic and pinned knobs

KIMI = (2048, 7168, 2048, 48, 8)  # the Kimi slice at one EP8 rank: t, h, i, e, k


@pytest.mark.parametrize("major, dtype, wgrad", [
    (9, torch.bfloat16, "gluon"),  # Hopper, 2-byte operands, widths of whole 128-row tiles: the Gluon kernel
    (10, torch.bfloat16, "persistent"),  # no wgmma off Hopper: the Triton kernel, one program an SM
    (9, torch.float32, "triton"),  # fp32 operands (the persistent launch was timed with 2-byte ones only)
])
def test_default_config_weight_gradient_kernel(fake_gpu, major, dtype, wgrad):
    fake_gpu(major=major)
    assert default_config(*KIMI, device="cuda", dtype=dtype, s=2048).wgrad == wgrad


@pytest.mark.parametrize("dtype, kernel", [
    (torch.bfloat16, "auto"),  # 2-byte operands: the Gluon gathering forward wherever a launch can run it
    (torch.float32, "triton"),  # fp32 operands: the Gluon forward loads 2-byte ones only
])
def test_default_config_forward_kernel(fake_gpu, dtype, kernel):
    fake_gpu(major=9)
    assert default_config(*KIMI, device="cuda", dtype=dtype, s=2048).forward_kernel == kernel
    assert default_config(*KIMI, device="cpu", dtype=dtype, s=2048).forward_kernel == "triton"  # the interpreter


@pytest.mark.parametrize("dtype, kernel", [
    (torch.bfloat16, "auto"),  # 2-byte operands: the Gluon backward wherever a launch can run it
    (torch.float32, "triton"),  # fp32 operands: the Gluon backward loads 2-byte ones only
])
def test_default_config_backward_kernel(fake_gpu, dtype, kernel):
    fake_gpu(major=9)
    assert default_config(*KIMI, device="cuda", dtype=dtype, s=2048).backward_kernel == kernel
    assert default_config(*KIMI, device="cpu", dtype=dtype, s=2048).backward_kernel == "triton"  # the interpreter


@pytest.mark.parametrize("pins, want", [
    # knobs that derive nothing: honoured, the rest is the heuristic's
    (dict(tile_group_m=0, keep_activations=False), dict(tile_group_m=0, keep_activations=False)),
    # a tile off the Gluon kernel's 128 x 256: the Triton weight gradients, one program an SM
    (dict(block_n=64), dict(block_n=64, wgrad="persistent", num_stages=4, bwd_num_stages=4)),
    # a deeper K step: the stages that fit 227 KB follow (2), the backward's 4 stages no longer fit (0)
    (dict(block_k=128), dict(block_k=128, num_stages=2, bwd_num_stages=0, wgrad="persistent")),
    # a ring: the one-rank gather goes (its rows would be overwritten) and the comm programs come back
    (dict(macrobatch_size=8192), dict(macrobatch_size=8192, combine_gather=False, num_comm_programs_fwd=12,
                                       num_comm_programs_bwd=12)),
    # no gather: comm programs to push, at the heuristic's counts for I = 2048
    (dict(combine_gather=False), dict(combine_gather=False, num_comm_programs_fwd=12, num_comm_programs_bwd=12)),
    # no TMA: the Gluon kernel cannot load, the Triton one runs
    (dict(tma=False), dict(tma=False, wgrad="persistent")),
    # a smaller row tile: the minibatch stays a multiple of it
    (dict(block_m=64), dict(block_m=64, minibatch_size=2048, bwd_num_stages=0)),
])
def test_default_config_honours_pinned_knobs(fake_gpu, pins, want):
    """The pinned knobs as given; the knobs the heuristic derives from them follow; the rest is unchanged."""
    fake_gpu()
    base = default_config(*KIMI, device="cuda", s=2048)
    assert base.wgrad == "gluon" and base.combine_gather and base.num_comm_programs_fwd == 0
    cfg = default_config(*KIMI, device="cuda", s=2048, overrides=pins)
    assert cfg == base.with_(**want), cfg
    assert gate_up_smem_bytes(cfg) <= SHARED_MEMORY_LIMIT and bwd_phase_a_smem_bytes(cfg) <= SHARED_MEMORY_LIMIT


def test_default_config_pinned_zero_comm_programs_take_the_gather(fake_gpu):
    # fp32 operands: the heuristic pushes through comm programs; pinning none on one rank turns the gather on
    fake_gpu()
    assert not default_config(*KIMI, device="cuda", dtype=torch.float32).combine_gather
    cfg = default_config(*KIMI, device="cuda", dtype=torch.float32, overrides=dict(num_comm_programs_fwd=0))
    assert cfg.combine_gather and cfg.num_comm_programs_fwd == 0
    # and on CPU (the interpreter's config) likewise
    cfg = default_config(24, 32, 16, 8, 2, device="cpu", overrides=dict(num_comm_programs_fwd=0))
    assert cfg.combine_gather and cfg.num_comm_programs_fwd == 0 and cfg.block_m == 16


@pytest.mark.parametrize("kwargs, pins, match", [
    # not a knob
    (dict(), dict(block_q=64), r"no KernelConfig field: block_q"),
    # a value KernelConfig refuses, named
    (dict(), dict(wgrad="cutlass"), r"pinned wgrad='cutlass' conflict: .*one of 'triton', 'persistent', 'gluon'"),
    # the Gluon kernel with a tile it does not build
    (dict(), dict(wgrad="gluon", block_n=64), r"pinned wgrad='gluon', block_n=64 conflict: .*128 x 256"),
    # ... off Hopper, or off its widths (2S = 192 rows would split a 128-row tile)
    (dict(major=10), dict(wgrad="gluon"), r"pinned wgrad='gluon' cannot run here: .*Hopper's wgmma"),
    (dict(s=96), dict(wgrad="gluon"), r"pinned wgrad='gluon' cannot run here: .*128-row tile"),
    # stages that overflow shared memory at the pinned tiles
    (dict(), dict(block_k=128, num_stages=4), r"pinned num_stages=4, block_k=128 do not fit: .*shared memory"),
    (dict(), dict(bwd_num_stages=6), r"pinned bwd_num_stages=6 do not fit: .*backward phase-A"),
    # the gather reads one rank's rows, and needs every row in the ring
    (dict(ranks=8, e=384), dict(combine_gather=True), r"pinned combine_gather=True runs one rank"),
    (dict(), dict(combine_gather=True, macrobatch_size=2048), r"combine_gather=True .* ring must hold all"),
    # no comm programs where no gather is possible (several ranks): nothing would push
    (dict(ranks=8, e=384), dict(num_comm_programs_fwd=0), r"pinned num_comm_programs_fwd=0 conflict: .*needs "
                                                          r"combine_gather"),
    # comm programs that leave no SM to compute
    (dict(), dict(combine_gather=False, num_comm_programs_bwd=132), r"num_comm_programs_bwd=132 leaves no compute"),
])
def test_default_config_refuses_pins_it_cannot_run(fake_gpu, kwargs, pins, match):
    kwargs = dict(kwargs)
    fake_gpu(major=kwargs.pop("major", 9))
    t, h, i, e, k = KIMI
    e = kwargs.pop("e", e)
    with pytest.raises(ValueError, match=match):
        default_config(t, h, i, e, k, device="cuda", **{"s": 2048, **kwargs}, overrides=pins)


@pytest.mark.parametrize("launcher", ["forward", "backward"])  # both multirank launchers, before any launch
@pytest.mark.parametrize("limit", [-1.0, float("nan"), "7"])  # a clamp below zero, NaN, a string from a config
def test_multirank_launchers_refuse_a_bad_swiglu_limit(launcher, limit):
    from kittenmoe.launch_backward import megakernel_backward_multirank
    from kittenmoe.launch_forward import megakernel_forward_multirank

    g = torch.Generator().manual_seed(4)
    w = make_weights(SHAPE, generator=g)
    x = [torch.randn(6, SHAPE.h, generator=g)]
    ids, wts = routing_uniform(6, SHAPE.e, SHAPE.k, generator=g)
    args = (x, [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, limit)
    with pytest.raises(ValueError, match="swiglu_limit must be a positive number"):
        if launcher == "forward":
            megakernel_forward_multirank(*args)
        else:
            megakernel_backward_multirank([torch.randn(6, SHAPE.h, generator=g)], *args)


def test_routes_past_int32_are_refused_before_any_work():
    """Routes and routed rows are indexed in int32: a batch with 2**31 routes (or fewer routes whose padding
    crosses the bound) is refused with the count, from shapes alone (meta tensors: nothing is allocated)."""
    from kittenmoe.checks import check_moe_inputs
    from kittenmoe.schedule import build_schedule

    meta = dict(device="meta")
    h, i, e, k = 8, 8, 8, 8
    w13, w2 = torch.empty(e, 2 * i, h, **meta), torch.empty(e, h, i, **meta)
    t = 2**28  # x 8 routes = 2**31
    x, ids, wts = torch.empty(t, h, **meta), torch.empty(t, k, dtype=torch.int64, **meta), torch.empty(t, k, **meta)
    with pytest.raises(ValueError, match="2147483648 routes; routes and routed rows are indexed in int32"):
        check_moe_inputs([x], [ids], [wts], w13, w2, None, None)
    # one route fewer than the bound passes the entry's check; its padding to 128-row tiles crosses it
    t, k = 2**30 - 1, 2
    ids = torch.empty(1, t, k, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match="routed rows a rank at worst; routes and rows are indexed in int32"):
        build_schedule(ids, 0, 4, 128)
