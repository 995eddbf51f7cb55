"""The FP8 megakernels (``megakernel_forward_multirank`` / ``megakernel_backward_multirank`` with
``fp8=FP8ExpertWeights``).

Routed GEMMs on e4m3 operands with 1 x 128 activation scales (x quantised in the pull, hidden rows in the gate|up
epilogue) and 128 x 128 weight scales; the shared expert in x's dtype. Checked against two references:
``moe_reference_fp8`` (the same quantisation steps in fp64: the kernel differs from it only by fp32 summation
order, bf16 output rounding and the rare e4m3 rounding flip of a hidden value computed slightly differently), and
the unquantised fp64 ``moe_reference`` at the FP8 tolerance (rel L1 <= 0.1, the bar of MoK's own tests).

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1), which decodes the
e4m3 bits and multiplies in fp32; the float8 tensor-core path runs on a GPU only (the ``gpu`` tests).
"""

from __future__ import annotations

import time

import pytest
import torch

from kittenmoe import launch_common
from kittenmoe.config import SEED_SHAPES, KernelConfig, ModelShape
from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
from kittenmoe.kernels import megakernel_bwd as mb
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_common import MegakernelError, fp8_dgu_block
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_backward_reference_fp8, moe_reference_fp8, moe_reference_multirank
from kittenmoe.testing import (assert_bitwise_equal, assert_close, make_weights, nan_scratch, routing_uniform,
                               ROUTINGS)

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

# H and I multiples of the 128 scale block; four experts of which each rank of R=2 holds two.
FP8_TINY = ModelShape(name="fp8-tiny", e=4, h=256, i=128, k=2)
# Interpreter-sized knobs, block_n = the scale block (one hidden scale per gate|up tile row).
CFG = KernelConfig(num_comm_programs_fwd=2, minibatch_size=16, block_m=16, block_n=128, block_k=32, num_stages=1,
                   num_warps=4)
GPU_CFG = KernelConfig(minibatch_size=256, block_m=64)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

CASES = {
    # one rank, shared expert, fp32 scales: the plain path
    "r1": dict(r=1, t=20),
    # two ranks: rows pulled across ranks are quantised by the puller, not the owner
    "r2": dict(r=2, t=12),
    # the SwiGLU clamp before the hidden quantisation
    "limit": dict(r=1, t=20, swiglu_limit=0.5),
    # power-of-two (E8M0-representable) scales
    "pow2": dict(r=1, t=20, pow2=True),
    # no shared expert; every route to one expert (one long segment, three idle experts)
    "no-shared-one-hot": dict(r=1, t=24, shared=False, routing="one_hot"),
    # a ring that wraps (macrobatch of 16 rows): FP8 row and scale buffers reused across macrobatches
    "ring": dict(r=1, t=24, macrobatch=16),
    # H = 384, a multiple of the scale block but not of the down GEMM's 256-wide tile: the last tile's
    # columns past H are masked (neither read nor written)
    "h384": dict(r=2, t=12, shape=ModelShape(name="fp8-h384", e=4, h=384, i=128, k=2)),
    # MXFP8 blocks (1 x 32 / 32 x 32, power-of-two scales), two ranks: four scale blocks per 128-wide tile
    # (per-column weight scales, four hidden scales a tile row), K steps of 32
    "mx32": dict(r=2, t=12, sb=32),
    # FP8Config.down_high: hidden kept in x's dtype, the down projection from the master W2; two ranks
    "down-high-r2": dict(r=2, t=12, down_high=True),
    # the same with MXFP8 blocks and a ring that wraps
    "down-high-mx32-ring": dict(r=2, t=24, sb=32, macrobatch=16, down_high=True),
}


def _problem(r, t, shape=FP8_TINY, seed=0, shared=True, routing="uniform", pow2=False, device=DEV, sb=128,
             dx_high=False, down_high=False):
    g = torch.Generator().manual_seed(seed)
    w = make_weights(shape, dtype=torch.bfloat16, device=device, generator=g, shared=shared)
    xs = [torch.randn(t, shape.h, generator=g).to(device, torch.bfloat16) for _ in range(r)]
    ids, ws = [], []
    for _ in range(r):
        if routing == "one_hot":
            i, wt = ROUTINGS["one_hot"](t, shape.e, shape.k, hot=1, generator=g)
        elif routing == "few_experts":  # experts 0..2 only: the last expert (at R=E, the last rank) gets no row
            i, wt = ROUTINGS["few_experts"](t, shape.e, shape.k, [0, 1, 2], generator=g)
        else:
            i, wt = routing_uniform(t, shape.e, shape.k, generator=g)
        ids.append(i.to(device))
        ws.append(wt.float().to(device))
    if sb == 32:
        # Each 32 x 32 weight block times its own power of two (exact in bf16): without it every block of the
        # tiny problem gets nearly the same scale, and a kernel reading one scale per tile instead of per
        # block column passes (found by mutation in review).
        for t in (w.w13_E2IH, w.w2_EHI):
            e, n, k = t.shape
            pw = torch.randint(-3, 4, (e, n // 32, k // 32), generator=g).float().exp2()
            t.mul_(pw.repeat_interleave(32, 1).repeat_interleave(32, 2).to(t.device, t.dtype))
    fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI, FP8Config(sb, pow2_scales=pow2 or sb == 32,
                                                                    dx_high=dx_high, down_high=down_high))
    return w, xs, ids, ws, fp8


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_forward_matches_emulation_and_reference(name):
    c = dict(CASES[name])
    r, t = c["r"], c["t"]
    limit = c.get("swiglu_limit")
    w, xs, ids, ws, fp8 = _problem(r, t, shape=c.get("shape", FP8_TINY), shared=c.get("shared", True),
                                   routing=c.get("routing", "uniform"), pow2=c.get("pow2", False),
                                   sb=c.get("sb", 128), down_high=c.get("down_high", False))
    cfg = CFG.with_(macrobatch_size=c.get("macrobatch"))
    res = megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, limit,
                                       config=cfg, fp8=fp8)
    res.check_errors()
    ref = moe_reference_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, limit,
                                  compute_dtype=torch.float64)
    for k in range(r):
        out = res.outputs[k]
        assert out.dtype == torch.bfloat16 and out.shape == xs[k].shape
        emu = moe_reference_fp8(xs[k], ids[k], ws[k], fp8, w.shared_w13_2SH, w.shared_w2_HS, limit,
                                down_w2_EHI=w.w2_EHI if fp8.cfg.down_high else None)
        assert_close(out.double(), emu, "bf16", f"rank {k} vs the fp8 emulation")
        assert_close(out.double(), ref[k], "fp8", f"rank {k} vs the unquantised reference")


# Forward knobs that must leave the FP8 output's bits unchanged; each differs from CFG (minibatch 16, two comm
# programs, no ring wrap, push by the comm programs).
FP8_FWD_KNOBS = {
    # two row tiles per handoff, one comm program pulling (and quantising) every chunk
    "minibatch-32-comm-1": dict(minibatch_size=32, num_comm_programs_fwd=1),
    # a one-slot ring that wraps: the e4m3 x / hidden rows and their scales are overwritten every minibatch
    "macrobatch-16": dict(macrobatch_size=16),
}
_FP8_ONE_RANK_KNOBS = {
    # one rank: nothing pushed, the epilogue reads y_routed rows (KernelConfig.combine_gather), no comm programs
    "gather-comm-0": dict(num_comm_programs_fwd=0, combine_gather=True),
    # and no backward comm programs: every program pulls (and quantises) its d_out chunks first
    "gather-comm-0-bwd-0": dict(num_comm_programs_fwd=0, num_comm_programs_bwd=0, combine_gather=True),
}


def test_fp8_forward_bitwise_repeatable_and_across_knobs():
    """Same inputs, same bits: twice, and with each of FP8_FWD_KNOBS (each row's arithmetic, its quantisation
    included, does not depend on how rows are handed over or pushed back)."""
    w, xs, ids, ws, fp8 = _problem(2, 12, seed=3)
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    base = megakernel_forward_multirank(*a, config=CFG, fp8=fp8).outputs
    assert all(torch.isfinite(o).all() for o in base)
    again = megakernel_forward_multirank(*a, config=CFG, fp8=fp8, trace=True).outputs  # the traced build too
    for k in range(2):
        assert_bitwise_equal(again[k], base[k], f"rank {k} repeat (traced)")
    for name, kw in FP8_FWD_KNOBS.items():
        res = megakernel_forward_multirank(*a, config=CFG.with_(**kw), fp8=fp8)
        res.check_errors()
        for k in range(2):
            assert_bitwise_equal(res.outputs[k], base[k], f"rank {k} with {name}")


def test_fp8_routed_rows_and_scales_are_the_quantiser_s():
    """The pulled x_routed rows (e4m3 bits) and their scales are exactly kittenmoe.fp8.quantize_activations of the
    source token rows; padding rows are zeros."""
    from kittenmoe.fp8 import quantize_activations

    w, xs, ids, ws, fp8 = _problem(1, 20, seed=4)
    res = megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                       config=CFG, fp8=fp8)
    st = res.states[0]
    q, scale = quantize_activations(xs[0].float(), fp8.cfg)
    n = int(st.schedule.num_rows.item())
    rank, tok = st.schedule.peer_rank[:n], st.schedule.peer_token_idx[:n]
    real = rank >= 0
    t = tok[real].long() // FP8_TINY.k
    assert torch.equal(st.x_routed[:n][real], q.view(torch.uint8)[t])
    assert torch.equal(st.x_scale[:n][real], scale[t])
    assert (st.x_routed[:n][~real] == 0).all()


def test_fp8_forward_keeps_unquantised_rows_for_the_backward():
    """With save_for_backward the FP8 forward also keeps the routed rows in x's dtype (the backward's weight
    gradients read them instead of pulling x again): exactly the source rows, padding rows zero."""
    w, xs, ids, ws, fp8 = _problem(1, 20, seed=5)
    res = megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                       config=CFG, fp8=fp8, save_for_backward=True)
    st = res.states[0]
    kept, gate_up, shared_gu = res.saved()[0]
    assert kept.dtype == xs[0].dtype and kept.shape == (st.ring.macrobatch, xs[0].shape[1])
    assert st.x_routed.dtype == torch.uint8  # the GEMMs' ring stays e4m3
    n = int(st.schedule.num_rows.item())
    rank, tok = st.schedule.peer_rank[:n], st.schedule.peer_token_idx[:n]
    real = rank >= 0
    assert_bitwise_equal(kept[:n][real], xs[0][tok[real].long() // FP8_TINY.k], "kept rows")
    assert (kept[:n][~real] == 0).all()


@pytest.mark.parametrize("change,exc,match", [
    # block_n must hold whole scale blocks: a 64-wide gate|up tile would split a 128-block's hidden scale
    (dict(config=CFG.with_(block_n=64)), ValueError, "block_n must be a multiple of the scale block"),
    # not an FP8ExpertWeights
    (dict(fp8="e4m3"), TypeError, "FP8ExpertWeights"),
])
def test_fp8_forward_refuses(change, exc, match):
    w, xs, ids, ws, fp8 = _problem(1, 8, seed=5)
    kw = dict(config=change.get("config", CFG), fp8=change.get("fp8", fp8),
              save_for_backward=change.get("save_for_backward", False))
    with pytest.raises(exc, match=match):
        megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                     **kw)


def test_fp8_refuses_d_gate_up_blocks_under_32():
    """MXFP8 blocks with block_n = 32 would quantise d(gate|up) 1 x 16, a 16-deep e4m3 dot that a GPU cannot
    compile (the interpreter would run it): refused on every backend."""
    w, xs, ids, ws, fp8 = _problem(1, 8, seed=6, sb=32)
    with pytest.raises(ValueError, match="use block_n >= 64"):
        megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                     config=CFG.with_(block_n=32), fp8=fp8)


def test_fp8_refuses_i_off_the_gate_up_tile():
    """MXFP8 blocks with I = 96 (a multiple of 32, not of the 128-wide gate|up tile): a clear error, not gate
    tiles reading up rows."""
    shape = ModelShape(name="fp8-i96", e=4, h=256, i=96, k=2)
    w, xs, ids, ws, fp8 = _problem(1, 8, shape=shape, seed=6, sb=32)
    with pytest.raises(ValueError, match="must be a multiple of block_n=128"):
        megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                     config=CFG, fp8=fp8)


def test_fp8_forward_refuses_widths_off_the_scale_block():
    """H or I not a multiple of 128: a clear error, not a partial scale block read past the row."""
    shape = ModelShape(name="fp8-odd", e=4, h=192, i=128, k=2)
    w, xs, ids, ws, fp8 = _problem(1, 8, shape=shape, seed=6)
    with pytest.raises(ValueError, match="multiples of the scale block"):
        megakernel_forward_multirank(xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None,
                                     config=CFG, fp8=fp8)


# ----------------------------------------------------------------------------- backward

BWD_CASES = {
    # one rank with a shared expert
    "r1": dict(r=1, t=20),
    # two ranks: d_out rows pulled across ranks are quantised by the puller; d_x rows pushed back
    "r2": dict(r=2, t=12),
    # the SwiGLU clamp: its masks (g <= L, |u| <= L) flip under the e4m3 rounding of g and u, a discontinuity
    # that moves gradients past the unquantised bar (d_x 16% at L = 0.5, d_w13 cosine 0.995 at L = 1.5) while
    # the emulation, which rounds the same way, still matches: compared with the emulation only
    "limit": dict(r=1, t=20, swiglu_limit=0.5, emulation_only=True),
    # power-of-two scales, no shared expert
    "pow2-no-shared": dict(r=1, t=20, pow2=True, shared=False),
    # H = 384: the gate|up dgrad's last 256-wide tile passes H (masked)
    "h384": dict(r=1, t=16, shape=ModelShape(name="fp8-h384", e=4, h=384, i=128, k=2)),
    # MXFP8 blocks, two ranks: d_out 1 x 32, d(gate|up) 1 x 32 (narrower than phase A's 64-wide tile), K steps
    # of 32 in both data-gradient GEMMs, per-column weight scales
    "mx32": dict(r=2, t=12, sb=32),
    # FP8Config.dx_high: d_x from the bf16 d(gate|up) rows and master W13 (no e4m3 phase B), two ranks
    "dx-high-r2": dict(r=2, t=12, dx_high=True),
    # the same with MXFP8 blocks and the clamp (phase A still e4m3 and clamped)
    "dx-high-mx32-limit": dict(r=1, t=20, sb=32, swiglu_limit=0.5, dx_high=True, emulation_only=True),
    # both high-precision knobs: the forward's down in bf16 leaves the backward's data gradients unchanged
    "dx-high-down-high": dict(r=2, t=12, dx_high=True, down_high=True),
}


def _grads_of_unquantised(w, xs, ids, ws, d_outs, limit):
    """fp64 autograd gradients of sum <out, d_out> through the unquantised reference."""
    leaves = [x.double().requires_grad_() for x in xs] + [v.double().requires_grad_() for v in ws]
    wts = [t.double().requires_grad_() if t is not None else None for t in w.tensors()]
    r = len(xs)
    outs = moe_reference_multirank(leaves[:r], ids, leaves[r:], *wts, limit, compute_dtype=torch.float64)
    loss = sum((o * g.double()).sum() for o, g in zip(outs, d_outs, strict=True))
    got = torch.autograd.grad(loss, leaves + [t for t in wts if t is not None])
    return got


def _check_grads_vs_emulation(bwd, d_outs, w, xs, ids, ws, fp8, limit, config=CFG):
    """Every gradient of ``bwd`` against moe_backward_reference_fp8 (routes with ids outside [0, E) contribute
    nothing there) at bf16 tolerance on the reference's RMS scale; returns (got, want) by name."""
    r = len(xs)
    dx_w13 = w.w13_E2IH if fp8.cfg.dx_high else None
    emu = [moe_backward_reference_fp8(d_outs[k], xs[k], ids[k], ws[k], fp8, w.shared_w13_2SH, w.shared_w2_HS,
                                      limit, dgu_block=fp8_dgu_block(config, fp8.cfg.scale_block),
                                      dx_w13_E2IH=dx_w13) for k in range(r)]
    got = {f"d_x[{k}]": bwd.d_x[k] for k in range(r)}
    got.update({f"d_w[{k}]": bwd.d_topk_weights[k] for k in range(r)})
    want = {f"d_x[{k}]": emu[k]["d_x"] for k in range(r)}
    want.update({f"d_w[{k}]": emu[k]["d_topk_weights"] for k in range(r)})
    # each rank's routes land on every rank's experts: the expert gradients are the sum over origin ranks
    got["d_w13"], want["d_w13"] = bwd.d_w13, sum(m["d_w13"] for m in emu)
    got["d_w2"], want["d_w2"] = bwd.d_w2, sum(m["d_w2"] for m in emu)
    if w.shared_w13_2SH is not None:
        got["d_sw13"], want["d_sw13"] = bwd.d_shared_w13, sum(m["d_shared_w13"] for m in emu)
        got["d_sw2"], want["d_sw2"] = bwd.d_shared_w2, sum(m["d_shared_w2"] for m in emu)
    for n, v in got.items():
        # bf16 tolerances on the reference's RMS scale (gradients are sums of many rows, see test_megakernel_bwd)
        scale = want[n].pow(2).mean().sqrt().clamp_min(1e-30)
        tol = "fp8-clamp-emulated" if limit is not None else "bf16"
        assert_close(v.double() / scale, want[n] / scale, tol, f"{n} vs the fp8 emulation")
    return got, want


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_fp8_backward_matches_emulation_and_reference(name):
    """FP8 forward (keeping gate|up) then the FP8 backward: down dgrad and gate|up dgrad on e4m3 operands (d_out
    quantised in the pull, d(gate|up) in the SwiGLU backward), weight gradients in bf16. Against
    moe_backward_reference_fp8 (the same quantisation in fp64) at bf16 tolerance, and against the unquantised
    fp64 gradients at the fp8 tolerance (rel L1 <= 0.1, cosine >= 0.996)."""
    from kittenmoe.testing import cosine, rel_l1

    c = BWD_CASES[name]
    r, t, limit = c["r"], c["t"], c.get("swiglu_limit")
    shape = c.get("shape", FP8_TINY)
    w, xs, ids, ws, fp8 = _problem(r, t, shape=shape, seed=9, shared=c.get("shared", True), pow2=c.get("pow2", False),
                                   sb=c.get("sb", 128), dx_high=c.get("dx_high", False),
                                   down_high=c.get("down_high", False))
    g = torch.Generator().manual_seed(10)
    d_outs = [torch.randn(t, shape.h, generator=g).to(DEV, torch.bfloat16) for _ in range(r)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, limit)
    peers = LocalPeers(r, DEV)
    fwd = megakernel_forward_multirank(*a, config=CFG, peers=peers, fp8=fp8, save_for_backward=True)
    bwd = megakernel_backward_multirank(d_outs, *a, config=CFG, peers=peers, saved=fwd.saved(), fp8=fp8)
    bwd.check_errors()
    got, _ = _check_grads_vs_emulation(bwd, d_outs, w, xs, ids, ws, fp8, limit)
    if c.get("emulation_only"):
        return
    plain = _grads_of_unquantised(w, xs, ids, ws, d_outs, limit)
    names = [f"d_x[{k}]" for k in range(r)] + [f"d_w[{k}]" for k in range(r)] + ["d_w13", "d_w2"] + \
        (["d_sw13", "d_sw2"] if w.shared_w13_2SH is not None else [])
    for n, ref in zip(names, plain, strict=True):
        assert rel_l1(got[n].double(), ref) <= 0.1 and cosine(got[n].double(), ref) >= 0.996, \
            f"{n} vs unquantised: rel L1 {rel_l1(got[n].double(), ref):.3e}, cosine {cosine(got[n].double(), ref):.5f}"


@pytest.mark.parametrize("dx_high", [False, True])  # phase B on e4m3 (reads W13^T) or in bf16 (reads none)
def test_fp8_backward_without_given_transposes_equals_with(dx_high):
    """FP8ExpertWeights built without w13_qt / w2_qt: the backward makes what it reads (only W2^T when phase B
    runs in bf16) and gives the same bits as with the transposes given."""
    w, xs, ids, ws, fp8 = _problem(1, 16, seed=19, dx_high=dx_high)
    bare = FP8ExpertWeights(fp8.w13_q, fp8.w13_scale, fp8.w2_q, fp8.w2_scale, fp8.cfg)
    d_out = [torch.randn(16, FP8_TINY.h, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    got = [megakernel_backward_multirank(d_out, *a, config=CFG, fp8=f) for f in (fp8, bare)]
    for name in ("d_w13", "d_w2"):
        assert_bitwise_equal(getattr(got[1], name), getattr(got[0], name), name)
    assert_bitwise_equal(got[1].d_x[0], got[0].d_x[0], "d_x")


def test_fp8_refuses_non_contiguous_transposes():
    """Transposed e4m3 weights given as strided views (not contiguous copies) are refused, not misread."""
    w, xs, ids, ws, fp8 = _problem(1, 16, seed=18)
    views = FP8ExpertWeights(fp8.w13_q, fp8.w13_scale, fp8.w2_q, fp8.w2_scale, fp8.cfg,
                             fp8.w13_q.transpose(1, 2), fp8.w2_q.transpose(1, 2))
    d_out = [torch.randn(16, FP8_TINY.h, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    with pytest.raises(ValueError, match="must be contiguous"):
        megakernel_backward_multirank(d_out, *a, config=CFG, fp8=views)


@pytest.mark.parametrize("r,t,ring,sb,shape", [
    (1, 20, None, 128, FP8_TINY),  # one rank, nothing kept: the backward replays every row
    (2, 24, 16, 128, FP8_TINY),  # two ranks, a ring of one minibatch that wraps: macrobatch 0 kept, rest replayed
    (1, 20, None, 32, FP8_TINY),  # MXFP8 blocks (power-of-two scales, 32-deep K steps) replayed
    (2, 24, 16, 32, FP8_TINY),  # MXFP8 with a wrapping ring
    # H = 384: the forward's down GEMM leaves TMA for pointer loads on a GPU (H not a multiple of 256) while
    # the backward keeps TMA, and the replay must still give the forward's bits
    (1, 20, None, 128, ModelShape(name="fp8-h384", e=4, h=384, i=128, k=2)),
])
def test_fp8_backward_replay_equals_kept_gate_up(r, t, ring, sb, shape):
    """Rows whose gate|up the FP8 forward did not keep are replayed in e4m3 (x re-quantised in the pull, the
    forward's gate|up tile code): every gradient equals the backward that read the kept gate|up, bit for bit."""
    w, xs, ids, ws, fp8 = _problem(r, t, shape=shape, seed=11, sb=sb)
    g = torch.Generator().manual_seed(1)
    d_out = [torch.randn(t, shape.h, generator=g).to(DEV, torch.bfloat16) for _ in range(r)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    kept = megakernel_forward_multirank(*a, config=CFG, fp8=fp8, save_for_backward=True)
    want = megakernel_backward_multirank(d_out, *a, config=CFG, saved=kept.saved(), fp8=fp8)
    if ring is None:
        got = megakernel_backward_multirank(d_out, *a, config=CFG, fp8=fp8)
    else:
        cfg = CFG.with_(macrobatch_size=ring)
        fwd = megakernel_forward_multirank(*a, config=cfg, fp8=fp8, save_for_backward=True)
        assert fwd.saved()[0][1].shape[0] == ring  # the ring wrapped: only macrobatch 0 kept
        got = megakernel_backward_multirank(d_out, *a, config=cfg, saved=fwd.saved(), fp8=fp8)
    got.check_errors()
    for k in range(r):
        assert_bitwise_equal(got.d_x[k], want.d_x[k], f"d_x[{k}]")
        assert_bitwise_equal(got.d_topk_weights[k], want.d_topk_weights[k], f"d_w[{k}]")
    for n in ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2"):
        assert_bitwise_equal(getattr(got, n), getattr(want, n), n)


# ----------------------------------------------------------------------------- no dropped routes (NaN-poisoned buffers)


def _poisoned_peers(r, t, shape=FP8_TINY):
    """NaN in every rank's forward combine and backward d_x / d_w combine buffers: a route never pushed stays NaN."""
    peers = LocalPeers(r, DEV)
    peers.alloc("combine", (t * shape.k, shape.h), torch.bfloat16, fill=float("nan"))
    peers.alloc("dx_comb", (t * shape.k, shape.h), torch.bfloat16, fill=float("nan"))
    peers.alloc("dw_comb", (t * shape.k,), torch.float32, fill=float("nan"))
    return peers


def _route_rows_fp8(x, ids, fp8, limit=None):
    """[T*K, H] fp64: route t*K + j through expert ids[t, j] alone, unweighted, as the FP8 emulation computes it
    (zero for ids outside [0, E))."""
    t, k = ids.shape
    one = torch.ones(t, 1, dtype=torch.float32, device=x.device)
    return torch.stack([moe_reference_fp8(x, ids[:, j:j + 1], one, fp8, None, None, limit) for j in range(k)],
                       dim=1).reshape(t * k, -1)


def _check_combine_rows(peers, xs, ids, fp8, limit=None):
    """Every valid route's forward combine row written (finite) with its own expert's output; the routes with ids
    outside [0, E) never written (still NaN)."""
    for k in range(len(xs)):
        comb = peers.buffer("combine", k)
        flat = ids[k].reshape(-1)
        valid = (flat >= 0) & (flat < FP8_TINY.e)
        unwritten = (~torch.isfinite(comb[valid])).any(dim=1)
        assert not unwritten.any(), \
            f"rank {k}: combine rows (t*K+j) never pushed: {valid.nonzero().flatten()[unwritten].tolist()}"
        assert torch.isnan(comb[~valid]).all(), f"rank {k}: a route with an out-of-range expert id was written"
        want = _route_rows_fp8(xs[k], ids[k], fp8, limit)
        assert_close(comb[valid].double(), want[valid], "bf16", f"combine[{k}] vs the fp8 emulation")


def _check_pushed_grads(peers, bwd, ids):
    """Every valid route's d_x row and d_w pushed back (finite), the bad routes' never (NaN), and the epilogue's
    d_topk_weights equal to the pushed d_w (exactly 0 for the bad routes)."""
    for k in range(len(ids)):
        dxc, dwc = peers.buffer("dx_comb", k), peers.buffer("dw_comb", k)
        flat = ids[k].reshape(-1)
        valid = (flat >= 0) & (flat < FP8_TINY.e)
        unwritten = (~torch.isfinite(dxc[valid])).any(dim=1) | ~torch.isfinite(dwc[valid])
        assert not unwritten.any(), \
            f"rank {k}: routes (t*K+j) never pushed back: {valid.nonzero().flatten()[unwritten].tolist()}"
        assert torch.isnan(dxc[~valid]).all() and torch.isnan(dwc[~valid]).all(), \
            f"rank {k}: a route with an out-of-range expert id was pushed back"
        dtw = bwd.d_topk_weights[k].reshape(-1)
        assert_bitwise_equal(dtw[valid], dwc[valid], f"d_topk_weights[{k}] vs pushed d_w")
        assert torch.all(dtw[~valid] == 0), f"d_topk_weights[{k}]: nonzero gradient for an out-of-range id"


DROP_CASES = {
    # T=7: 14 routes a rank, every expert segment one partial row tile, the shared expert's row tile partial
    "R2-T7": dict(r=2, t=7),
    # one token a rank: two routes each, every segment almost all padding; experts 0 and 1 get none (seed 20),
    # so rank 0 receives no row
    "R2-T1": dict(r=2, t=1),
    # four ranks of one expert each (E=4), routes to experts 0..2 only: rank 3 receives no row at all (its
    # forward and backward run the shared expert only, its expert gradients must be exactly 0)
    "R4-E4-rank-without-rows": dict(r=4, t=6, routing="few_experts"),
}


@pytest.mark.parametrize("name", list(DROP_CASES))
def test_fp8_no_dropped_routes_nan_poisoned(name, monkeypatch):
    """FP8 forward (keeping gate|up) then backward with every float scratch buffer and the peers' combine,
    d_x-combine and d_w-combine buffers NaN: every route's combine row is pushed, holding its expert's output
    (the emulation's); outputs match moe_reference_fp8 and gradients moe_backward_reference_fp8 at bf16
    tolerance; every route's d_x row and d_w are pushed back."""
    c = DROP_CASES[name]
    r, t = c["r"], c["t"]
    w, xs, ids, ws, fp8 = _problem(r, t, seed=20, routing=c.get("routing", "uniform"))
    d_outs = [torch.randn(t, FP8_TINY.h, generator=torch.Generator().manual_seed(21)).to(DEV, torch.bfloat16)
              for _ in range(r)]
    if c.get("routing") == "few_experts":
        assert not any((i == FP8_TINY.e - 1).any() for i in ids), "the last rank must receive no row"
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    peers = _poisoned_peers(r, t)
    nan_scratch(monkeypatch)
    fwd = megakernel_forward_multirank(*a, config=CFG, peers=peers, fp8=fp8, save_for_backward=True)
    fwd.check_errors()
    bwd = megakernel_backward_multirank(d_outs, *a, config=CFG, peers=peers, saved=fwd.saved(), fp8=fp8)
    bwd.check_errors()
    monkeypatch.undo()
    _check_combine_rows(peers, xs, ids, fp8)
    for k in range(r):
        emu = moe_reference_fp8(xs[k], ids[k], ws[k], fp8, w.shared_w13_2SH, w.shared_w2_HS, None)
        assert_close(fwd.outputs[k].double(), emu, "bf16", f"out[{k}] vs the fp8 emulation")
    _check_pushed_grads(peers, bwd, ids)
    _check_grads_vs_emulation(bwd, d_outs, w, xs, ids, ws, fp8, None)
    if c.get("routing") == "few_experts":
        for n in ("d_w13", "d_w2"):
            assert torch.all(getattr(bwd, n)[FP8_TINY.e - 1] == 0), f"{n}: nonzero gradient on an expert without rows"


# ----------------------------------------------------------------------------- out-of-range expert ids


@pytest.fixture(scope="module")
def fp8_bad_id_run():
    """R=2, T=8: id E (one past the last expert) on rank 0 and -1 on rank 1, the rest valid; FP8 forward (keeping
    gate|up) and backward over NaN-poisoned combine buffers, run without raising."""
    w, xs, ids, ws, fp8 = _problem(2, 8, seed=22)
    ids[0][3, 1] = FP8_TINY.e
    ids[1][5, 0] = -1
    d_outs = [torch.randn(8, FP8_TINY.h, generator=torch.Generator().manual_seed(23)).to(DEV, torch.bfloat16)
              for _ in range(2)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    peers = _poisoned_peers(2, 8)
    fwd = megakernel_forward_multirank(*a, config=CFG, peers=peers, fp8=fp8, save_for_backward=True)
    comb = [peers.buffer("combine", k).clone() for k in range(2)]
    bwd = megakernel_backward_multirank(d_outs, *a, config=CFG, peers=peers, saved=fwd.saved(), fp8=fp8)
    return w, xs, ids, ws, fp8, d_outs, peers, fwd, comb, bwd


def test_fp8_out_of_range_expert_ids_flagged(fp8_bad_id_run):
    """Both FP8 kernels report the bad ids through every rank's error flag (not as a timeout), and
    check_errors raises."""
    *_, fwd, _, bwd = fp8_bad_id_run
    for what, errs in (("forward", [st.err for st in fwd.states]), ("backward", bwd.errs)):
        for r, err in enumerate(errs):
            code = int(err.max())
            assert code & mk.ERR_BAD_EXPERT_ID, f"{what} rank {r}: err={code}"
            assert not code & mk.ERR_TIMEOUT, f"{what} rank {r}: a bad id must not cause a timeout (err={code})"
            with pytest.raises(MegakernelError, match="outside"):
                launch_common.check_errors(err)
    with pytest.raises(MegakernelError, match="expert ids"):
        fwd.check_errors()
    with pytest.raises(MegakernelError, match="expert ids"):
        bwd.check_errors()


def test_fp8_out_of_range_expert_ids_leave_valid_routes_intact(fp8_bad_id_run):
    """Only the two bad routes are dropped: their combine rows and pushed gradients never written (still NaN),
    their router-weight gradient exactly 0; every output and gradient equals the FP8 emulation's, in which a
    route with an id outside [0, E) contributes nothing."""
    w, xs, ids, ws, fp8, d_outs, peers, fwd, comb, bwd = fp8_bad_id_run
    assert bwd.d_topk_weights[0][3, 1] == 0 and bwd.d_topk_weights[1][5, 0] == 0
    for k in range(2):  # the forward's combine rows, as they were before the backward ran
        peers.buffer("combine", k).copy_(comb[k])
    _check_combine_rows(peers, xs, ids, fp8)
    for k in range(2):
        emu = moe_reference_fp8(xs[k], ids[k], ws[k], fp8, w.shared_w13_2SH, w.shared_w2_HS, None)
        assert_close(fwd.outputs[k].double(), emu, "bf16", f"out[{k}] vs the fp8 emulation")
    _check_pushed_grads(peers, bwd, ids)
    _, want = _check_grads_vs_emulation(bwd, d_outs, w, xs, ids, ws, fp8, None)
    assert want["d_w[0]"][3, 1] == 0 and want["d_w[1]"][5, 0] == 0  # the emulation drops them too


# ----------------------------------------------------------------------------- spin-wait timeout

# Each leaves one producer role out of one FP8 kernel, so a bounded wait never sees its counter reach the target.
FP8_TIMEOUT_CASES = {
    # forward without the pull (x rows quantised on the way in): gate|up waits on x_ready
    "forward-no-pull": ("forward", mk.PH_ALL & ~mk.PH_PULL),
    # backward without the pull (d_out rows quantised on the way in): phase A waits on pull_ready
    "backward-no-pull": ("backward", mb.PB_ALL & ~mb.PB_PULL),
    # backward without phase A (the e4m3 d(gate|up) never quantised): the e4m3 phase B waits on a_ready
    "backward-no-phase-a": ("backward", mb.PB_ALL & ~mb.PB_A),
}


@pytest.mark.parametrize("name", list(FP8_TIMEOUT_CASES))
def test_fp8_spin_wait_timeout_flagged_without_hang(name):
    """FP8, 128-blocks, two ranks, max_spin = 50 polls, one producer left out: every rank's flag says timeout
    (not a bad id), check_errors raises "timed out", and the call returns (bounded waits, no hang). Under the
    interpreter the same max_spin with every phase reports nothing: the timeout comes from the missing
    producer."""
    kind, phases = FP8_TIMEOUT_CASES[name]
    w, xs, ids, ws, fp8 = _problem(2, 6, seed=24)
    d_outs = [torch.randn(6, FP8_TINY.h, generator=torch.Generator().manual_seed(25)).to(DEV, torch.bfloat16)
              for _ in range(2)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)

    def run(**kw):
        if kind == "forward":
            res = megakernel_forward_multirank(*a, config=CFG, fp8=fp8, max_spin=50, **kw)
            return res, [st.err for st in res.states]
        res = megakernel_backward_multirank(d_outs, *a, config=CFG, fp8=fp8, max_spin=50, **kw)
        return res, res.errs

    if not HAS_CUDA:  # (on a GPU the roles run concurrently and a legitimate wait may need more than 50 polls)
        run()[0].check_errors()
    t0 = time.monotonic()
    res, errs = run(phases=phases)
    codes = [int(e.max()) for e in errs]  # syncs on CUDA: the launches have returned
    assert time.monotonic() - t0 < 120, "the bounded wait took far too long"
    for r, code in enumerate(codes):
        assert code & mk.ERR_TIMEOUT, f"rank {r}: err={code}"
        assert not code & mk.ERR_BAD_EXPERT_ID, f"rank {r}: a timeout reported as a bad id (err={code})"
        with pytest.raises(MegakernelError, match="timed out"):
            launch_common.check_errors(errs[r])
    with pytest.raises(MegakernelError, match="spin-wait timed out"):
        res.check_errors()


# ----------------------------------------------------------------------------- backward bitwise across knobs

# Backward knobs that must leave every FP8 gradient's bits unchanged (each d_x row and d_w one row's arithmetic,
# each weight-gradient element summed by one program in row order); each differs from CFG (16 bwd comm programs,
# minibatch 16). The forward runs with the same config (its kept activations are sized by the minibatch).
FP8_BWD_KNOBS = {
    # one communication program pulls (and quantises) every d_out chunk and pushes every d_x row
    "comm-1": dict(num_comm_programs_bwd=1),
    # three communication programs
    "comm-3": dict(num_comm_programs_bwd=3),
    # minibatch 32: two row tiles per handoff
    "minibatch-32": dict(minibatch_size=32),
}


def test_fp8_one_rank_gather_same_bits():
    """One rank with KernelConfig.combine_gather and no forward comm programs: the FP8 forward's output and every
    gradient of its backward (whose epilogue then gathers too) equal the pushing path's bit for bit."""
    w, xs, ids, ws, fp8 = _problem(1, 20, seed=8)
    g = torch.Generator().manual_seed(9)
    d_outs = [torch.randn(20, w.w13_E2IH.shape[-1], generator=g).to(DEV, torch.bfloat16)]
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    base_out = megakernel_forward_multirank(*a, config=CFG, fp8=fp8).outputs[0]
    base = _fp8_fwd_bwd_grads(CFG, w, xs, ids, ws, fp8, d_outs)
    for name, kw in _FP8_ONE_RANK_KNOBS.items():
        out = megakernel_forward_multirank(*a, config=CFG.with_(**kw), fp8=fp8)
        out.check_errors()
        assert_bitwise_equal(out.outputs[0], base_out, f"{name}: output")
        got = _fp8_fwd_bwd_grads(CFG.with_(**kw), w, xs, ids, ws, fp8, d_outs)
        assert got.keys() == base.keys()
        for k in base:
            assert_bitwise_equal(got[k], base[k], f"{name}: {k}")


def _fp8_fwd_bwd_grads(cfg, w, xs, ids, ws, fp8, d_outs):
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    fwd = megakernel_forward_multirank(*a, config=cfg, fp8=fp8, save_for_backward=True)
    bwd = megakernel_backward_multirank(d_outs, *a, config=cfg, saved=fwd.saved(), fp8=fp8)
    bwd.check_errors()
    got = {f"d_x[{k}]": g for k, g in enumerate(bwd.d_x)}
    got.update({f"d_w[{k}]": g for k, g in enumerate(bwd.d_topk_weights)})
    got.update({n: getattr(bwd, n) for n in ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2")})
    return got


@pytest.fixture(scope="module")
def fp8_bwd_base():
    w, xs, ids, ws, fp8 = _problem(2, 12, seed=26)
    d_outs = [torch.randn(12, FP8_TINY.h, generator=torch.Generator().manual_seed(27)).to(DEV, torch.bfloat16)
              for _ in range(2)]
    prob = (w, xs, ids, ws, fp8, d_outs)
    base = _fp8_fwd_bwd_grads(CFG, *prob)
    for n, g in base.items():
        assert torch.isfinite(g).all(), n
    return prob, base


@pytest.mark.parametrize("variant", list(FP8_BWD_KNOBS))
def test_fp8_backward_bitwise_across_knobs(fp8_bwd_base, variant):
    prob, base = fp8_bwd_base
    got = _fp8_fwd_bwd_grads(CFG.with_(**FP8_BWD_KNOBS[variant]), *prob)
    for n in base:
        assert_bitwise_equal(got[n], base[n], f"{n} with {variant}")


# ----------------------------------------------------------------------------- autograd (kittenmoe.moe(fp8=...))


@pytest.mark.parametrize("flags", [
    {},  # every routed GEMM on e4m3
    dict(down_high=True),  # FP8Config.down_high: the forward's down projection in bf16
    dict(dx_high=True, down_high=True),  # and FP8Config.dx_high: the backward's d_x GEMM too
], ids=["e4m3", "down-high", "dx-down-high"])
def test_fp8_through_autograd_equals_the_ops(flags):
    """kittenmoe.moe(..., fp8=FP8Config(...)) quantises the bf16 master weights, runs the FP8 forward keeping
    gate|up, and autograd's backward runs the FP8 backward: output and every gradient equal the ops-level calls
    bit for bit (the same kernels on the same data, the FP8 config's precision flags carried through the custom
    ops); gradients land on the bf16 master weights."""
    from kittenmoe import moe

    w, xs, ids, ws, fp8 = _problem(1, 20, seed=12, **flags)
    d_out = torch.randn(20, FP8_TINY.h, generator=torch.Generator().manual_seed(13)).to(DEV, torch.bfloat16)
    leaves = [xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()] + \
        [t.clone().requires_grad_() for t in w.tensors()]
    out = moe(leaves[0], ids[0], leaves[1], *leaves[2:], backend="megakernel", config=CFG, fp8=FP8Config(**flags))
    grads = torch.autograd.grad(out, leaves, d_out)
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None)
    f = megakernel_forward_multirank(*a, config=CFG, fp8=fp8, save_for_backward=True)
    b = megakernel_backward_multirank([d_out], *a, config=CFG, saved=f.saved(), fp8=fp8)
    assert_bitwise_equal(out, f.outputs[0], "out")
    want = [b.d_x[0], b.d_topk_weights[0], b.d_w13, b.d_w2, b.d_shared_w13, b.d_shared_w2]
    for i, (g, v) in enumerate(zip(grads, want, strict=True)):
        assert_bitwise_equal(g, v.to(g.dtype), f"grad {i}")


@pytest.mark.parametrize("cfg,fp8_cfg", [
    (CFG.with_(keep_activations=False), FP8Config()),  # nothing kept: the backward replays every row in e4m3
    (CFG.with_(macrobatch_size=16), FP8Config()),  # a ring that wraps: macrobatch 0 kept, the rest replayed
    (CFG.with_(keep_activations=False), FP8Config(32, pow2_scales=True)),  # MXFP8 blocks replayed
])
def test_fp8_training_without_kept_activations(cfg, fp8_cfg):
    """kittenmoe.moe(fp8=...) trains with the activations not kept (or a wrapping ring) too: output and every
    gradient equal the kept-activation run's bit for bit."""
    from kittenmoe import moe

    w, xs, ids, ws, _ = _problem(1, 40, seed=16)
    d_out = torch.randn(40, FP8_TINY.h, generator=torch.Generator().manual_seed(17)).to(DEV, torch.bfloat16)

    def run(c):
        leaves = [xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()] + \
            [t.clone().requires_grad_() for t in w.tensors()]
        out = moe(leaves[0], ids[0], leaves[1], *leaves[2:], backend="megakernel", config=c, fp8=fp8_cfg)
        return [out, *torch.autograd.grad(out, leaves, d_out)]

    for i, (a, b) in enumerate(zip(run(cfg), run(CFG), strict=True)):
        assert_bitwise_equal(a, b, f"tensor {i}")


@pytest.mark.parametrize("kw,exc,match", [
    # the torch backend has no e4m3 path
    (dict(backend="torch"), NotImplementedError, "fp8 runs the megakernel only"),
    # not an FP8 description
    (dict(fp8="e4m3"), TypeError, "FP8Config or FP8ExpertWeights"),
])
def test_fp8_through_autograd_refuses(kw, exc, match):
    from kittenmoe import moe

    w, xs, ids, ws, _ = _problem(1, 20, seed=14)
    x = xs[0].clone().requires_grad_()
    args = dict(backend="megakernel", config=CFG, fp8=FP8Config())
    args.update(kw)
    with pytest.raises(exc, match=match):
        moe(x, ids[0], ws[0], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, **args)


def test_fp8_moe_layer_trains_close_to_bf16():
    """MoELayer(fp8=FP8Config()) (megakernel; its auto config gets block_n 128): output and every parameter's
    gradient within the fp8 bar of the same layer in bf16 (quantisation is the only difference), and its
    repr says fp8."""
    from kittenmoe import MoELayer
    from kittenmoe.testing import cosine, rel_l1

    shape = ModelShape(name="fp8-layer", e=4, h=256, i=128, k=2)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(20, shape.h, generator=g).to(DEV, torch.bfloat16)
    d_out = torch.randn(20, shape.h, generator=g).to(DEV, torch.bfloat16)
    res = {}
    for fp8 in (None, FP8Config()):
        layer = MoELayer(shape, dtype=torch.bfloat16, device=DEV, backend="megakernel", fp8=fp8,
                         generator=torch.Generator().manual_seed(16))
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(d_out)
        res[fp8 is not None] = (out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()})
        if fp8 is not None:
            assert "fp8=e4m3/128" in repr(layer)
    (o8, dx8, g8), (o16, dx16, g16) = res[True], res[False]
    for n, a, b in [("out", o8, o16), ("d_x", dx8, dx16)] + [(k, g8[k], g16[k]) for k in g16]:
        assert rel_l1(a.double(), b.double()) <= 0.1 and cosine(a.double(), b.double()) >= 0.996, \
            f"{n}: rel L1 {rel_l1(a.double(), b.double()):.3e}, cosine {cosine(a.double(), b.double()):.5f}"


@pytest.mark.parametrize("kw,exc,match", [
    # H not a multiple of the scale block
    (dict(shape=ModelShape(name="odd", e=4, h=192, i=128, k=2)), ValueError, "multiples of 128"),
    # the torch backend has no e4m3 path
    (dict(backend="torch"), NotImplementedError, "fp8 runs the megakernel only"),
])
def test_fp8_moe_layer_refuses(kw, exc, match):
    from kittenmoe import MoELayer

    args = dict(shape=FP8_TINY, backend="megakernel", fp8=FP8Config())
    args.update(kw)
    shape = args.pop("shape")
    with pytest.raises(exc, match=match):
        MoELayer(shape, dtype=torch.bfloat16, device=DEV, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kimi-k2.7", "qwen3.5-397b-a17b"])
def test_gpu_fp8_seed_slice(name):
    """A seed shape sliced to one EP8 rank, 512 tokens, on the tensor cores (float8e4nv, TMA): the forward
    against the fp8 emulation and the unquantised reference, bitwise repeatable; the backward's gradients
    against the fp8 backward emulation."""
    base = SEED_SHAPES[name]
    shape = base.with_(e=base.e // 8)
    w, xs, ids, ws, fp8 = _problem(1, 512, shape=shape, seed=7, device=torch.device("cuda"))
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
    peers = LocalPeers(1, torch.device("cuda"))
    res = megakernel_forward_multirank(*a, config=GPU_CFG, peers=peers, fp8=fp8)
    res.check_errors()
    out = res.outputs[0].clone()
    emu = moe_reference_fp8(xs[0], ids[0], ws[0], fp8, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
    ref = moe_reference_multirank(*a, compute_dtype=torch.float64)[0]
    assert_close(out.double(), emu, "bf16", "vs the fp8 emulation")
    assert_close(out.double(), ref, "fp8", "vs the unquantised reference")
    again = megakernel_forward_multirank(*a, config=GPU_CFG, peers=peers, fp8=fp8).outputs[0]
    assert_bitwise_equal(again, out, "repeat")
    # forward+backward as autograd runs them (gate|up kept), against the backward emulation
    d_out = torch.randn(512, shape.h, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    f = megakernel_forward_multirank(*a, config=GPU_CFG, peers=peers, fp8=fp8, save_for_backward=True)
    b = megakernel_backward_multirank([d_out], *a, config=GPU_CFG, peers=peers, saved=f.saved(), fp8=fp8)
    b.check_errors()
    emu_g = moe_backward_reference_fp8(d_out, xs[0], ids[0], ws[0], fp8, w.shared_w13_2SH, w.shared_w2_HS,
                                       shape.swiglu_limit, dgu_block=fp8_dgu_block(GPU_CFG, fp8.cfg.scale_block))
    for n, got in (("d_x", b.d_x[0]), ("d_topk_weights", b.d_topk_weights[0]), ("d_w13", b.d_w13),
                   ("d_w2", b.d_w2), ("d_shared_w13", b.d_shared_w13), ("d_shared_w2", b.d_shared_w2)):
        want = emu_g[n]
        # relative to the gradient's RMS; no whole float64 copy of either (Kimi's d_w13 is 11 GB in float64)
        scale = max((torch.linalg.vector_norm(want) / want.numel() ** 0.5).item(), 1e-30)
        assert_close(got, want, "bf16", f"{n} vs the fp8 backward emulation", scale=scale)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_backward_heuristic_knobs_same_bits():
    """The backward knobs default_config turns on at block_m 128 (wgrad="persistent", bwd_num_stages=4, and on
    Hopper wgrad="gluon") in the FP8 backward, kept gate|up, on the Kimi slice (512 tokens): every gradient has the
    bits of the per-tile launch at 3 stages (the order of each sum is unchanged; only when operands arrive and
    which program stores a tile)."""
    base = SEED_SHAPES["kimi-k2.7"]
    shape = base.with_(e=base.e // 8)
    w, xs, ids, ws, fp8 = _problem(1, 512, shape=shape, seed=9, device=torch.device("cuda"))
    a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
    peers = LocalPeers(1, torch.device("cuda"))
    d_out = torch.randn(512, shape.h, generator=torch.Generator().manual_seed(10)).to("cuda", torch.bfloat16)
    plain = KernelConfig(minibatch_size=256)
    grads = {}
    heuristic = plain.with_(wgrad="persistent", bwd_num_stages=4)
    for label, cfg in (("plain", plain), ("heuristic", heuristic), ("gluon", heuristic.with_(wgrad="gluon"))):
        f = megakernel_forward_multirank(*a, config=cfg, peers=peers, fp8=fp8, save_for_backward=True)
        b = megakernel_backward_multirank([d_out], *a, config=cfg, peers=peers, saved=f.saved(), fp8=fp8)
        b.check_errors()
        grads[label] = {"d_x": b.d_x[0].clone(), "d_topk_weights": b.d_topk_weights[0].clone(),
                        "d_w13": b.d_w13.clone(), "d_w2": b.d_w2.clone(), "d_shared_w13": b.d_shared_w13.clone(),
                        "d_shared_w2": b.d_shared_w2.clone()}
    for n, want in grads["plain"].items():
        assert_bitwise_equal(grads["heuristic"][n], want, f"{n}: wgrad='persistent' + bwd_num_stages=4 vs plain")
        assert_bitwise_equal(grads["gluon"][n], want, f"{n}: wgrad='gluon' vs plain")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_layer_cuda_graph_and_compile():
    """MoELayer(fp8=FP8Config()) on the tensor cores: forward+backward captured in one CUDA graph (weights
    quantised inside the graph, no host sync) replays to the eager bits, and a fullgraph torch.compile of it
    matches eager within the fp8 emulation's tolerance (bf16)."""
    from kittenmoe import MoELayer, check_errors

    shape = ModelShape(name="fp8-gpu", e=8, h=512, i=256, k=2)
    layer = MoELayer(shape, dtype=torch.bfloat16, device="cuda", backend="megakernel", fp8=FP8Config(),
                     config=GPU_CFG.with_(block_n=128), generator=torch.Generator().manual_seed(17))
    g = torch.Generator().manual_seed(18)
    x = torch.randn(256, shape.h, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    d_out = torch.randn(256, shape.h, generator=g).to("cuda", torch.bfloat16)
    params = [x, *layer.parameters()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, workspace, pointer tables
        for _ in range(2):
            for p in params:
                p.grad = None
            layer(x).backward(d_out)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(x)
        static_out.backward(d_out)
    graph.replay()
    torch.cuda.synchronize()
    check_errors()
    static_grads = [p.grad for p in params]  # the graph's gradient buffers, rewritten by every replay
    cap = [static_out.detach().clone()] + [t.clone() for t in static_grads]
    for p in params:
        p.grad = None
    out = layer(x)
    eager = [out.detach()] + list(torch.autograd.grad(out, params, d_out))
    for i, (a, b) in enumerate(zip(cap, eager, strict=True)):
        assert_bitwise_equal(a, b, f"replayed tensor {i}")
    # New tokens and new bf16 master weights copied into the captured tensors: the replay quantises the new
    # weights inside the graph and gives the eager bits of the new problem (nothing baked in at capture).
    with torch.no_grad():
        x.copy_(torch.randn(x.shape, generator=g).to(x.device, x.dtype))
        for p in layer.parameters():
            p.mul_(torch.rand(p.shape, generator=g).add(0.5).to(p.device, p.dtype))
    graph.replay()
    torch.cuda.synchronize()
    check_errors()
    cap2 = [static_out.detach().clone()] + [t.clone() for t in static_grads]
    out = layer(x)
    eager2 = [out.detach()] + list(torch.autograd.grad(out, params, d_out))
    assert not torch.equal(eager2[0], eager[0]), "the new problem should give a new output"
    for i, (a, b) in enumerate(zip(cap2, eager2, strict=True)):
        assert_bitwise_equal(a, b, f"replayed tensor {i} after new inputs and weights")
    eager = eager2
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    out_c = compiled(x)
    grads_c = torch.autograd.grad(out_c, params, d_out)
    assert_close(out_c.detach().double(), eager[0].double(), "bf16", "compiled out")
    for i, (a, b) in enumerate(zip(grads_c, eager[1:], strict=True)):
        scale = b.double().pow(2).mean().sqrt().clamp_min(1e-30)
        assert_close(a.double() / scale, b.double() / scale, "bf16", f"compiled grad {i}")

