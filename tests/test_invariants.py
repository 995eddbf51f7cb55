"""docs/design.md's invariants ("Invariants and errors"), the checks the rest of the suite did not make on CPU.

An audit mapped each invariant to the CPU tests that can fail when it breaks:

- No host sync: nothing on CPU (only the GPU's CUDA-graph captures). Here: the launchers' compiled-GPU path,
  the custom ops' implementations and the MoELayer stack run on ``meta`` tensors, where any ``.item()``,
  ``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``nonzero`` or mask-sized allocation raises, with every Triton
  launch recorded instead of run.
- No dropped tokens: test_megakernel_fwd / _bwd's MATCH_CASES and poisoned combine buffers. Not covered there and
  added here: three ranks (not a power of two) with one expert a rank, one token per rank in the backward, the
  same expert twice in one token's top-k, and the public op with a ring that wraps.
- Bitwise determinism: test_megakernel_fwd's test_bitwise_* (fp32, one routing) and the atomics scan;
  test_megakernel_bwd's test_bitwise_*. Added: bf16 across minibatch / macrobatch / comm knobs on an all-to-one-
  expert routing with a T that is a multiple of nothing, with scratch NaN; the output with and without kept
  activations; the backward from a wrapping ring's kept rows run twice; no float scatter-accumulate (a CUDA
  atomic) between the kernels.
- No deadlock: test_megakernel_fwd / _bwd's test_spin_wait_timeout_flagged_without_hang (launcher level, the
  backward replaying only). Added: the backward reading kept activations (resident and wrapping rings) with a
  producer left out, and a timeout surfacing through the public op as MegakernelError (sync and deferred
  checking) with the next clean call still correct.
- Bad input before launch: test_checks (torch backend and forward launcher: the error, not the "before
  launch"); bad expert ids flagged on device in test_megakernel_fwd / _bwd / test_layer. Added: every malformed
  input of test_checks.BAD_INPUTS refused by both launchers with no Triton launch at all, the launchers' own
  knob refusals and functional.moe(backend="megakernel") likewise; and a malformed ``saved`` entry of a later
  rank (this audit found it refused only after the earlier ranks' kernels ran; launch_backward._check_saved now checks
  every rank's entry first).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

import test_checks as tc
import test_megakernel_bwd as tb
import test_megakernel_fwd as tf
from test_layer import _error_check
from kittenmoe import autograd as kag
from kittenmoe import launch_backward, launch_common, launch_forward
from kittenmoe import schedule as ksched
from kittenmoe.config import TEST_SHAPES, ModelShape
from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
from kittenmoe.functional import moe
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.layer import MoELayer
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_common import MegakernelError
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_reference
from kittenmoe.testing import (assert_bitwise_equal, assert_close, make_weights, nan_scratch, routing_one_hot,
                               routing_uniform)

# The interpreter computes on padding rows (never used) and numpy warns there, as in test_megakernel_bwd.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DEV = tf.DEV
TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4
# The suite's interpreter-sized knobs (test_megakernel_bwd's: 16-row minibatches and row tiles, 2 comm programs)
CFG = tb.CFG


# ============================================================================= no host sync

class _AccumulateSpy(TorchDispatchMode):
    """Records torch ops that accumulate floats through a scatter (index_add_, scatter_add_, index_put_ with
    accumulate, ...): CUDA runs them with atomics, whose order varies run to run."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1].rstrip("_")
        acc = name in ("index_add", "scatter_add", "scatter_reduce", "index_reduce")
        if name in ("index_put", "_index_put_impl", "put"):
            acc = bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
        if name == "scatter" and ("reduce" in kwargs or len(args) > 4):  # scatter_(..., reduce="add" / "multiply")
            acc = True
        if acc and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def meta_launches(monkeypatch):
    """The launchers' compiled (GPU) path on any machine: ``interpreting()`` is False, the device check passes
    ``meta`` tensors, and every Triton launch (``kernel[grid](...)``) is recorded by kernel name instead of run.
    On ``meta`` tensors every host read of device data raises (test_meta_harness_catches_host_reads)."""
    calls: list[str] = []

    def getitem(kernel, grid):
        name = getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))

        def launch(*args, **kwargs):
            assert isinstance(grid, tuple) and all(type(g) is int for g in grid), f"{name}: grid {grid!r}"
            calls.append(name)
        return launch

    monkeypatch.setattr(KernelInterface, "__getitem__", getitem)
    monkeypatch.setattr(launch_common, "interpreting", lambda: False)
    monkeypatch.setattr(launch_common, "check_device", lambda device: None)
    return calls


FP8_SHAPE = ModelShape("fp8-meta", e=8, h=128, i=128, k=2, score_func="softmax")
FP8_CFG = CFG.with_(block_n=128)

# Shapes, knobs and what the backward reads; every case runs forward then backward on meta tensors.
META_CASES = {
    # two ranks, clamp, fp32, a ring that wraps (macrobatch 16): the forward keeps macrobatch 0, the backward
    # reads those rows and replays the others
    "R2-ring-kept": dict(shape=TINY, r=2, t=7, cfg=CFG.with_(macrobatch_size=16), keep=True, limit=0.5),
    # four ranks, bf16, no shared expert, the backward replays everything; persistent weight-gradient programs
    "R4-bf16-no-shared-replay": dict(shape=TINY, r=4, t=5, dtype=torch.bfloat16, shared=False, keep=False,
                                     cfg=CFG.with_(wgrad="persistent")),
    # one rank, both gathering epilogues, no communication programs at all, every routed row kept
    "R1-gather-no-comm": dict(shape=TINY_SIG, r=1, t=9, keep=True, cfg=CFG.with_(
        combine_gather=True, num_comm_programs_fwd=0, num_comm_programs_bwd=0)),
    # FP8 routed experts (e4m3 weights quantised without the finite check, as the layer does every step)
    "R2-fp8": dict(shape=FP8_SHAPE, r=2, t=5, dtype=torch.bfloat16, keep=True, cfg=FP8_CFG, fp8=True),
}


def _meta_problem(c: dict):
    shape, r, t, dtype = c["shape"], c["r"], c["t"], c.get("dtype", torch.float32)
    mw = make_weights(shape, dtype=dtype, device="meta", shared=c.get("shared", True))
    xs = [torch.empty(t, shape.h, dtype=dtype, device="meta") for _ in range(r)]
    ids = [torch.empty(t, shape.k, dtype=torch.int64, device="meta") for _ in range(r)]
    ws = [torch.empty(t, shape.k, dtype=torch.float32, device="meta") for _ in range(r)]
    fp8 = FP8ExpertWeights.quantize(mw.w13_E2IH, mw.w2_EHI, check_finite=False) if c.get("fp8") else None
    return xs, ids, ws, (mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS), fp8


@pytest.mark.parametrize("sched_impl", ["torch", "triton"])  # the schedule in torch ops, or the GPU's Triton one
@pytest.mark.parametrize("name", list(META_CASES))
def test_launchers_have_no_host_sync(name, sched_impl, meta_launches, monkeypatch):
    """docs/design.md: no ``.item()``, ``.tolist()``, ``.cpu()``, data-dependent branching or size-from-data
    allocation in the forward or backward. The multi-rank launchers (schedule, buffers, pointer tables,
    megakernel, weight gradients, epilogues) run to the end on meta tensors, one persistent megakernel launch
    per rank, and nothing between the kernels accumulates floats through a scatter (atomics on CUDA)."""
    c = META_CASES[name]
    if sched_impl == "triton":
        for launcher in (launch_forward, launch_backward):
            monkeypatch.setattr(launcher, "build_schedule", functools.partial(ksched.build_schedule, impl="triton"))
        monkeypatch.setattr(ksched, "check_triton_device", lambda device, who: None)
    xs, ids, ws, w, fp8 = _meta_problem(c)
    r, limit = c["r"], c.get("limit")
    spy = _AccumulateSpy()
    with spy:
        f = megakernel_forward_multirank(xs, ids, ws, *w, limit, config=c["cfg"], save_for_backward=c["keep"],
                                         fp8=fp8)
        fwd = list(meta_launches)
        meta_launches.clear()
        d_outs = [torch.empty_like(x) for x in xs]
        b = megakernel_backward_multirank(d_outs, xs, ids, ws, *w, limit, config=c["cfg"],
                                          saved=f.saved() if c["keep"] else None, fp8=fp8)
    assert fwd.count("dispatch_mlp_swiglu_combine_kernel") == r, fwd
    assert meta_launches.count("combine_mlp_swiglu_dispatch_bwd_kernel") == r, meta_launches
    if sched_impl == "triton":
        assert fwd.count("schedule_place_kernel") == r and meta_launches.count("schedule_place_kernel") == r
    assert not spy.seen, f"float scatter-accumulates between the kernels: {spy.seen}"
    assert [tuple(o.shape) for o in f.outputs] == [tuple(x.shape) for x in xs]
    assert [tuple(g.shape) for g in b.d_x] == [tuple(x.shape) for x in xs]
    assert tuple(b.d_w13.shape) == tuple(w[0].shape)


def test_meta_harness_catches_host_reads(meta_launches, monkeypatch):
    """The harness above can fail: the interpreter's own launch loop reads ``num_rows`` on the host (free on
    CPU, by design), and on meta that raises; so do the usual spellings of a host read or a size from data;
    and the spy sees a float index_add_."""
    xs, ids, ws, w, _ = _meta_problem(META_CASES["R2-ring-kept"])
    monkeypatch.setattr(launch_common, "interpreting", lambda: True)
    with pytest.raises(RuntimeError, match="meta"):
        megakernel_forward_multirank(xs, ids, ws, *w, None, config=CFG)
    m = torch.empty(4, 3, device="meta")
    for read in (lambda: m.sum().item(), lambda: m.tolist(), lambda: m.cpu(), lambda: bool((m > 0).any()),
                 lambda: int(m[0, 0]), lambda: m.nonzero(), lambda: m[m > 0], lambda: m.unique()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()
    spy = _AccumulateSpy()
    with spy:
        m.index_add_(0, torch.zeros(1, dtype=torch.int64, device="meta"), torch.empty(1, 3, device="meta"))
        torch.zeros(4, dtype=torch.int64, device="meta").index_add_(0, torch.zeros(1, dtype=torch.int64,
                                                                                 device="meta"),
                                                                     torch.ones(1, dtype=torch.int64, device="meta"))
    assert spy.seen == ["aten.index_add_.default"]


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


@pytest.mark.parametrize("cfg", [
    CFG,  # every routed row kept for the backward (resident ring)
    CFG.with_(keep_activations=False),  # nothing kept: the backward replays
    CFG.with_(macrobatch_size=16),  # a ring that wraps: macrobatch 0 kept
], ids=["kept", "replay", "ring-wraps"])
def test_custom_op_impls_have_no_host_sync(cfg, meta_launches, monkeypatch):
    """The implementations of ``kittenmoe::moe_forward`` / ``moe_backward`` (workspace lookup, the launcher, kept
    activations packed as op outputs, gradients unpacked) run on meta tensors. Their one host read is by
    design: the device error flags, read at once on CPU and under ``set_error_check("sync")``; under
    "deferred" on CUDA they are OR-ed on device. That reporting step is recorded here instead."""
    reported = []
    monkeypatch.setattr(kag, "_report", lambda st, flags, *detail: reported.append(len(flags)))
    monkeypatch.setattr(kag, "_states", {})  # a fresh workspace, on meta
    sh, t = TINY, 7
    mw = make_weights(sh, device="meta")
    x = torch.empty(t, sh.h, device="meta")
    args = (x, torch.empty(t, sh.k, dtype=torch.int64, device="meta"), torch.empty(t, sh.k, device="meta"),
            *mw.tensors(), 0.5)
    cargs = kag.config_to_args(cfg)
    out = torch.ops.kittenmoe.moe_forward.default.redispatch(_COMPOSITE, *args, *cargs)
    grads = torch.ops.kittenmoe.moe_backward.default.redispatch(_COMPOSITE, torch.empty_like(x), *args,
                                                                *kag._NO_FP8, *out[1:], *cargs)
    assert reported == [1, 1]
    assert meta_launches.count("dispatch_mlp_swiglu_combine_kernel") == 1
    assert meta_launches.count("combine_mlp_swiglu_dispatch_bwd_kernel") == 1
    assert [tuple(g.shape) for g in grads[:4]] == [(t, sh.h), (t, sh.k), tuple(mw.w13_E2IH.shape),
                                                   tuple(mw.w2_EHI.shape)]


@pytest.mark.parametrize("shape,fp8", [
    (TINY_SIG, None),  # sigmoid scores, routed scaling, the clamp, a correction bias
    (TINY.with_(shared_i=0), None),  # softmax, no shared expert
    (FP8_SHAPE, FP8Config()),  # FP8: the layer quantises its bf16 master weights every forward
], ids=["sigmoid-bias", "no-shared", "fp8"])
def test_layer_stack_has_no_host_sync(shape, fp8, meta_launches):
    """MoELayer(backend="megakernel") forward and backward on meta tensors: router, top-k, input checks, weight
    quantisation, the autograd glue (the custom ops' fake impls stand in for the kernels on meta)."""
    dtype = torch.bfloat16 if fp8 is not None else torch.float32
    layer = MoELayer(shape, backend="megakernel", config=FP8_CFG if fp8 is not None else CFG, device="meta",
                     dtype=dtype, correction_bias=shape is TINY_SIG, fp8=fp8)
    x = torch.empty(2, 5, shape.h, device="meta", dtype=dtype, requires_grad=True)
    out = layer(x)
    out.backward(torch.empty_like(out))
    assert out.shape == x.shape and x.grad.shape == x.shape
    assert all(p.grad is not None for p in layer.parameters())


# ============================================================================= no dropped tokens

THREE = TINY.with_(e=3)  # with R = 3: one expert a rank
SIX = TINY.with_(e=6)  # with R = 3: two experts a rank

DROP_CASES = {
    # three ranks (not a power of two), one expert each, T = 5, a ring of one 16-row slot that wraps
    "R3-L1-T5-ring": (tf.Case(THREE, r=3, t=5, macrobatch=16), None),
    # three ranks, two experts each, skewed load, T = 7
    "R3-L2-zipf-T7": (tf.Case(SIX, r=3, t=7, routing="zipf"), None),
    # the same expert twice in one token's top-k: every route of every token to expert 3 (rank 0 of 2), so each
    # token holds two rows of one segment (28 rows over two minibatches); rank 1 gets no row
    "R2-dup-expert-in-topk": (tf.Case(TINY, r=2, t=7), "all-to-3"),
    # one token per rank, K = 1, all four ranks' single route to expert 5 (rank 2): one 4-row segment,
    # three ranks idle
    "R4-T1-K1-one-hot": (tf.Case(TINY.with_(k=1), r=4, t=1, routing="one_hot", hot=5), None),
    # one token per rank, K = 2, a clamp, bf16: T*K = 2 < block_m
    "R2-T1-bf16-limit": (tf.Case(TINY, r=2, t=1, dtype=torch.bfloat16, swiglu_limit=0.5), None),
}


def _drop_inputs(name: str):
    case, ids_override = DROP_CASES[name]
    inp = tf._make_inputs(case, seed=13)
    if ids_override == "all-to-3":
        inp = dataclasses.replace(inp, ids=[torch.full_like(i, 3) for i in inp.ids])
    bcase = tb.Case(case.shape, r=case.r, t=case.t, swiglu_limit=case.swiglu_limit, dtype=case.dtype)
    gen = torch.Generator().manual_seed(14)
    d_outs = [torch.randn(case.t, case.shape.h, generator=gen).to(DEV, case.dtype) for _ in range(case.r)]
    binp = tb.Inputs(inp.xs, inp.ids, inp.ws, inp.mw, d_outs)
    return case, inp, bcase, binp


@pytest.mark.parametrize("name", list(DROP_CASES))
def test_no_route_dropped_forward(name, monkeypatch):
    """Every route t*K+j of every rank reaches its origin's combine row (the buffers start NaN, scratch too),
    holding that route's expert output; outputs match the fp64 reference."""
    case, inp, _, _ = _drop_inputs(name)
    tol = "fp32" if case.dtype == torch.float32 else "bf16"
    peers = tf._poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
    nan_scratch(monkeypatch)
    res = tf._megakernel(case, inp, peers=peers)
    monkeypatch.undo()
    ref = tf._reference64(case, inp)
    for r in range(case.r):
        comb = peers.buffer("combine", r)
        unwritten = (~torch.isfinite(comb)).any(dim=1).nonzero().flatten().tolist()
        assert not unwritten, f"rank {r}: combine rows (t*K+j) never pushed: {unwritten}"
        assert_close(comb.float(), tf._route_outputs64(case, inp, r).float(), tol, f"combine[{r}]")
        assert_close(res.outputs[r].float(), ref[r].float(), tol, f"out[{r}]")


@pytest.mark.parametrize("name", list(DROP_CASES))
def test_no_route_dropped_backward(name, monkeypatch):
    """Every route's d_x row and router-weight gradient is pushed back to its origin (combine buffers and
    scratch NaN first); gradients match autograd through the fp64 reference; experts without a token get an
    exactly zero weight gradient, every other a nonzero one."""
    case, _, bcase, binp = _drop_inputs(name)
    tol = "fp32" if case.dtype == torch.float32 else "bf16"
    nan_scratch(monkeypatch)
    res = tb._backward(bcase, binp, config=case.config())
    monkeypatch.undo()
    ref = tb._reference_grads64(bcase, binp)
    for gname, g in tb._named(res).items():
        tb._assert_grad_close(gname, g, ref[gname], tol, rescale=tol != "fp32")
    tb._check_pushed_rows(bcase, binp, res, tol)
    used = tb._used_experts(bcase, binp).to(res.d_w13.device)
    for gname in ("d_w13", "d_w2"):
        g = getattr(res, gname)
        assert torch.all(g[~used] == 0), f"{gname}: nonzero gradient on experts that got no token"
        assert torch.all(g[used].abs().sum(dim=(1, 2)) > 0), f"{gname}: a used expert got zero gradient"


def test_no_token_dropped_through_the_op_with_a_wrapping_ring(monkeypatch):
    """The public path (functional.moe, backend="megakernel"): all 11 tokens' first route to expert 7, the
    second to expert 0, through a 16-row ring that wraps (the forward keeps macrobatch 0, the backward replays
    the rest). Fresh workspace and every scratch buffer NaN; output and every gradient against the fp64
    reference."""
    t = 11  # a multiple of nothing
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(t, TINY.h, generator=gen).to(DEV)
    ids, w = routing_one_hot(t, TINY.e, TINY.k, hot=TINY.e - 1, generator=gen)
    ids, w = ids.to(DEV), w.to(DEV)
    weights = make_weights(TINY, device=DEV, generator=gen).tensors()
    d_out = torch.randn(t, TINY.h, generator=gen).to(DEV)
    leaves = [a.clone().requires_grad_() for a in (x, w, *weights)]
    monkeypatch.setattr(kag, "_states", {})
    nan_scratch(monkeypatch)
    out = moe(leaves[0], ids, leaves[1], *leaves[2:], swiglu_limit=0.5, backend="megakernel",
              config=CFG.with_(macrobatch_size=16))
    grads = torch.autograd.grad(out, leaves, d_out)
    monkeypatch.undo()
    ref_leaves = [a.double().requires_grad_() for a in (x, w, *weights)]
    ref = moe_reference(ref_leaves[0], ids, ref_leaves[1], *ref_leaves[2:], 0.5, compute_dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_leaves, d_out.double())
    assert_close(out.detach(), ref.detach().float(), "fp32", "out")
    for gname, g, rg in zip(["d_x", "d_w", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2"], grads, ref_grads,
                            strict=True):
        assert_close(g, rg.float(), "fp32", gname)


# ============================================================================= bitwise determinism

# bf16, all tokens' first route to the last expert, T = 13 (a multiple of nothing) on two ranks
BF16_BASE = tf.Case(TINY, r=2, t=13, routing="one_hot", hot=TINY.e - 1, dtype=torch.bfloat16, swiglu_limit=0.5)

BF16_VARIANTS = {
    # two row tiles per handoff
    "minibatch-32": (dict(minibatch_size=32), False),
    # the ring wraps with one 16-row slot (every pull waits on the previous minibatch's push)
    "macrobatch-16": (dict(macrobatch_size=16), False),
    # one communication program, a two-slot ring
    "comm-1-mac-32": (dict(num_comm_programs_fwd=1, macrobatch_size=32), False),
    # the same config with the activations kept for a backward (gate|up stored, padding rows zeroed)
    "save-for-backward": ({}, True),
    # kept activations with the ring wrapping
    "save-for-backward-mac-16": (dict(macrobatch_size=16), True),
}


@pytest.fixture(scope="module")
def bf16_base():
    inp = tf._make_inputs(BF16_BASE, seed=17)
    res = tf._megakernel(BF16_BASE, inp)
    ref = tf._reference64(BF16_BASE, inp)
    for r, o in enumerate(res.outputs):
        assert_close(o.float(), ref[r].float(), "bf16", f"base out[{r}] vs fp64 reference")
    return inp, [o.clone() for o in res.outputs]


@pytest.mark.parametrize("variant", list(BF16_VARIANTS))
def test_bf16_forward_bitwise_across_configs(bf16_base, variant, monkeypatch):
    """docs/design.md: the forward output is bitwise identical across minibatch / macrobatch / comm-program settings
    (the suite checks this on CPU in fp32 with one routing only). bf16 rows, every segment but two empty, scratch
    NaN in the variant's run."""
    inp, base = bf16_base
    kw, save = BF16_VARIANTS[variant]
    cfg = BF16_BASE.config().with_(**kw)
    nan_scratch(monkeypatch)
    res = megakernel_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), BF16_BASE.swiglu_limit, config=cfg,
                                       peers=tf._poisoned_peers(2, BF16_BASE.t, TINY.k, TINY.h, torch.bfloat16),
                                       save_for_backward=save)
    monkeypatch.undo()
    res.check_errors()
    for r in range(BF16_BASE.r):
        assert_bitwise_equal(res.outputs[r], base[r], f"out[{r}] with {variant}")


def test_backward_from_wrapping_ring_kept_rows_repeatable(monkeypatch):
    """Same inputs and config, same bits: forward keeping a wrapping ring's macrobatch 0, then the backward
    reading it and replaying the rest, twice on fresh peers; the second time every scratch buffer starts NaN
    (a result that depended on uninitialised memory would differ)."""
    # two ranks, skewed load, the clamp; a 16-row ring that wraps, T = 6
    case = tb.Case(TINY, r=2, t=6, routing="zipf", swiglu_limit=0.5)
    inp = tb._make_inputs(case, seed=19)
    cfg = case.config().with_(macrobatch_size=16)

    def run():
        peers = tb._poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
        f = tb._forward_saved(case, inp, cfg, peers)
        assert all(not st.ring.resident for st in f.states)
        tb._poison(peers, case.t, case.shape.k, case.shape.h, case.dtype)
        res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                            config=cfg, peers=peers, saved=f.saved())
        res.check_errors()
        return [o.clone() for o in f.outputs], {k: v.clone() for k, v in tb._named(res).items()}

    out1, g1 = run()
    nan_scratch(monkeypatch)
    out2, g2 = run()
    monkeypatch.undo()
    for r in range(case.r):
        assert_bitwise_equal(out2[r], out1[r], f"out[{r}]")
    assert sorted(g1) == sorted(g2)
    for k in g1:
        assert torch.isfinite(g2[k]).all(), k
        assert_bitwise_equal(g2[k], g1[k], k)


# ============================================================================= no deadlock

@pytest.mark.parametrize("ring,missing", [
    ("resident", "PB_PULL"),  # every routed row kept: the x pull is skipped, phase A still waits on d_out rows
    ("wraps", "PB_A"),  # macrobatch 0 kept, the rest replayed: phase B waits on phase A
    ("resident", "PB_SHARED_A"),  # the shared gate|up kept: the shared phase B waits on its phase A
])
def test_kept_activations_backward_timeouts_flagged(ring, missing):
    """The suite's backward timeout tests run the replaying backward only; the backward that reads the forward's
    kept activations takes other paths through its waits. One producer left out, max_spin = 50: the rank
    flags a timeout (not a bad id), the call returns, and check_errors raises "timed out"."""
    from kittenmoe.kernels import megakernel_bwd as mb

    case = tb.Case(TINY, r=1, t=12)  # one rank: 24 routed rows, two minibatches
    inp = tb._make_inputs(case, seed=27)
    cfg = case.config().with_(macrobatch_size=16 if ring == "wraps" else None)
    f = tb._forward_saved(case, inp, cfg, LocalPeers(case.r, DEV))
    assert all(st.ring.resident == (ring == "resident") for st in f.states)
    if not tf.HAS_CUDA:  # the control: under the interpreter 50 polls suffice when no producer is left out
        megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=cfg,
                                      saved=f.saved(), max_spin=50).check_errors()
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=cfg,
                                        saved=f.saved(), max_spin=50, phases=mb.PB_ALL & ~getattr(mb, missing))
    for r, e in enumerate(res.errs):
        code = int(e.max())
        assert code & mk.ERR_TIMEOUT and not code & mk.ERR_BAD_EXPERT_ID, f"rank {r}: err={code}"
    with pytest.raises(MegakernelError, match="spin-wait timed out"):
        res.check_errors()


def _op_problem(seed: int, t: int = 10):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, TINY.h, generator=gen).to(DEV)
    ids, w = routing_uniform(t, TINY.e, TINY.k, generator=gen)
    weights = make_weights(TINY, device=DEV, generator=gen).tensors()
    d_out = torch.randn(t, TINY.h, generator=gen).to(DEV)
    return x, ids.to(DEV), w.to(DEV), weights, d_out


@pytest.mark.parametrize("which,mode", [
    ("forward", "sync"),  # the op reads its flags at once and raises
    ("forward", "deferred"),  # the default mode (on CPU flags are still read at once)
    ("backward", "deferred"),  # the forward is clean, the backward op (run by autograd.grad) times out
])
def test_timeout_surfaces_through_the_op(which, mode, monkeypatch):
    """A producer role that never runs (the pull, forward or backward, through the launcher's ``phases``) makes
    the consumers' bounded waits give up: the public op returns and raises MegakernelError "timed out" (on CPU
    flags are read at once in either mode; on CUDA under "deferred" at the next check_errors()), and the next
    clean call on the same workspace gives the reference's result."""
    x, ids, w, weights, d_out = _op_problem(seed=23)
    if which == "forward":
        fn = functools.partial(launch_forward.megakernel_forward_multirank, phases=mk.PH_ALL & ~mk.PH_PULL,
                               max_spin=50)
        monkeypatch.setattr(launch_forward, "megakernel_forward_multirank", fn)
    else:
        from kittenmoe.kernels import megakernel_bwd as mb

        fn = functools.partial(launch_backward.megakernel_backward_multirank, phases=mb.PB_ALL & ~mb.PB_PULL,
                               max_spin=50)
        monkeypatch.setattr(launch_backward, "megakernel_backward_multirank", fn)
    leaves = [a.clone().requires_grad_() for a in (x, w, *weights)]
    with _error_check(mode), pytest.raises(MegakernelError, match="timed out"):
        out = moe(leaves[0], ids, leaves[1], *leaves[2:], backend="megakernel", config=CFG)
        torch.autograd.grad(out, leaves, d_out)
        kag.check_errors()
    monkeypatch.undo()
    out = moe(x, ids, w, *weights, backend="megakernel", config=CFG)
    kag.check_errors()
    ref = moe_reference(x.double(), ids, w.double(), *(t.double() for t in weights), compute_dtype=torch.float64)
    assert_close(out, ref.float(), "fp32", "out after the timeout")


# ============================================================================= bad input: refused before any launch

@pytest.fixture
def no_launch(monkeypatch):
    """Any Triton launch fails the test: what is checked must be refused before the first kernel runs."""
    def getitem(kernel, grid):
        name = getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
        raise AssertionError(f"{name} launched before the bad input was refused")

    monkeypatch.setattr(KernelInterface, "__getitem__", getitem)


_HOST_CHECKED = [p for p in tc.BAD_INPUTS if p.id not in tc._DEVICE_CHECKED]


@pytest.mark.parametrize("launcher", ["forward", "backward"])  # each megakernel launcher
@pytest.mark.parametrize("mutate, exc, match", _HOST_CHECKED)  # test_checks' cases, each commented there
def test_bad_input_refused_before_any_launch(launcher, mutate, exc, match, no_launch):
    """test_checks' malformed inputs (shapes, dtypes, devices, contiguity, K > E, T = 0, ...): both megakernel
    launchers raise test_checks' error, and no kernel has been launched when they do."""
    kw = tc.make_inputs()
    d_outs = [torch.randn_like(x) for x in kw["x_RTH"]]
    mutate(kw)
    with pytest.raises(exc, match=match):
        if launcher == "forward":
            megakernel_forward_multirank(**kw, config=CFG)
        else:
            megakernel_backward_multirank(d_outs, **kw, config=CFG)


def _tiny_inputs(r: int, t: int = 8, shape: ModelShape = TINY, seed: int = 2):
    case = tb.Case(shape, r=r, t=t)
    return tb._make_inputs(case, seed=seed)


KNOB_REFUSALS = {
    # combine_gather reads rows of this rank only: refused on two ranks, forward and backward
    "gather-R2": (2, TINY, CFG.with_(combine_gather=True), "both", NotImplementedError, "combine_gather runs one rank"),
    # combine_gather with a ring that wraps (its rows would be overwritten before the epilogue reads them)
    "gather-ring": (1, TINY, CFG.with_(combine_gather=True, macrobatch_size=16), "forward", ValueError,
                    "ring must hold them all"),
    # no forward comm programs with a ring that wraps (every program pulls everything first: a deadlock)
    "comm0-ring": (1, TINY, CFG.with_(num_comm_programs_fwd=0, combine_gather=True, macrobatch_size=16),
                   "forward", ValueError, "ring must hold them all"),
    # the Gluon weight gradients under the interpreter (Gluon does not run there): refused, never replaced
    "wgrad-gluon-interpreter": (1, TINY, CFG.with_(wgrad="gluon", block_n=128, block_k=64, block_m=64,
                                                      minibatch_size=64),
                                "backward", NotImplementedError, "Gluon kernels do not run under the Triton"),
}


@pytest.mark.parametrize("name", list(KNOB_REFUSALS))
def test_knob_refusals_before_any_launch(name, no_launch):
    """Knob combinations the launchers refuse for a given problem (not at KernelConfig construction): a clear
    error, and no kernel launched first."""
    r, shape, cfg, which, exc, match = KNOB_REFUSALS[name]
    inp = _tiny_inputs(r, shape=shape)
    a = (inp.xs, inp.ids, inp.ws, *inp.weights(), None)
    if which in ("forward", "both"):
        with pytest.raises(exc, match=match):
            megakernel_forward_multirank(*a, config=cfg)
    if which in ("backward", "both"):
        with pytest.raises(exc, match=match):
            megakernel_backward_multirank(inp.d_outs, *a, config=cfg)


FUNCTIONAL_BAD = [
    # w13 non-contiguous (activations are copied once; a per-step copy of the weights is refused)
    pytest.param(lambda a: a.update(w13=a["w13"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
                 "w13 must be contiguous", id="w13-noncontig"),
    # K = E + 1 routes a token
    pytest.param(lambda a: a.update(ids=torch.zeros(a["x"].shape[0], TINY.e + 1, dtype=torch.int64, device=DEV),
                                    w=torch.ones(a["x"].shape[0], TINY.e + 1, device=DEV)),
                 ValueError, "exceeds the number of experts", id="K>E"),
    # x in float64, weights in float32
    pytest.param(lambda a: a.update(x=a["x"].double()), TypeError, "dtype", id="x-dtype"),
    # a negative clamp
    pytest.param(lambda a: a.update(limit=-1.0), ValueError, "swiglu_limit", id="limit-negative"),
    # a knob dict instead of a KernelConfig
    pytest.param(lambda a: a.update(config={"block_m": 16}), TypeError, "KernelConfig", id="config-dict"),
    # w2 of the wrong inner width
    pytest.param(lambda a: a.update(w2=a["w2"][:, :, :-1].contiguous()), ValueError, r"w2 must be \[E, H, I\]",
                 id="w2-width"),
]


@pytest.mark.parametrize("mutate, exc, match", FUNCTIONAL_BAD)
def test_functional_megakernel_bad_input_before_any_launch(mutate, exc, match, no_launch):
    """The public entry point with backend="megakernel": the same clear errors, before any kernel runs."""
    x, ids, w, weights, _ = _op_problem(seed=3, t=6)
    a = dict(x=x, ids=ids, w=w, w13=weights[0], w2=weights[1], limit=None, config=CFG)
    mutate(a)
    with pytest.raises(exc, match=match):
        moe(a["x"], a["ids"], a["w"], a["w13"], a["w2"], weights[2], weights[3], swiglu_limit=a["limit"],
            backend="megakernel", config=a["config"])


def test_malformed_saved_on_a_later_rank_refused_before_any_launch():
    """The backward launcher's ``saved`` (the forward's kept activations, one entry per rank): a float64 gate|up
    on rank 1 is refused with a clear error, and no rank's kernels have run when it is."""
    inp = _tiny_inputs(2)
    a = (inp.xs, inp.ids, inp.ws, *inp.weights(), None)
    f = megakernel_forward_multirank(*a, config=CFG, save_for_backward=True)
    saved = f.saved()
    bad = [saved[0], (saved[1][0], saved[1][1].double(), saved[1][2])]
    launched = []
    orig = KernelInterface.__getitem__

    def getitem(kernel, grid):
        launched.append(getattr(getattr(kernel, "fn", None), "__name__", repr(kernel)))
        return orig(kernel, grid)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KernelInterface, "__getitem__", getitem)
        with pytest.raises(ValueError, match="saved gate_up must be a contiguous torch.float32"):
            megakernel_backward_multirank(inp.d_outs, *a, config=CFG, saved=bad)
    assert not launched, f"launched before the error: {sorted(set(launched))}"
