"""The forward megakernel (``launch_forward.megakernel_forward_multirank``) against the torch backend and the reference.

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1) at tiny shapes
and 16-wide tiles; the launcher then runs one role over one minibatch per launch. With CUDA the same tests run
on the GPU (one persistent launch per rank, every role concurrent), and the ``gpu``-marked tests add the seed
shapes, determinism over many runs, CUDA-graph replay and multi-rank bf16 cases.

Every run first fills the peers' combine buffers with NaN, so a route that was never pushed shows up as NaN in
the output (``assert_close`` rejects non-finite values, ``assert_bitwise_equal`` any difference).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass

import pytest
import torch

from kittenmoe import launch_forward
from kittenmoe.config import SEED_SHAPES, TEST_SHAPES, KernelConfig, ModelShape, default_config, routed_capacity
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_common import MegakernelError, RingGeometry, check_errors
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_reference, moe_reference_multirank, swiglu_ffn
from kittenmoe.testing import (
    nan_scratch,
    routing_few_experts,
    ROUTINGS,
    MoEWeights,
    assert_bitwise_equal,
    assert_close,
    make_weights,
    rel_l1,
    routing_uniform,
    tolerance_for,
)
from kittenmoe.torch_backend import moe_forward_multirank

HAS_CUDA = torch.cuda.is_available()
# The "CPU" tests run wherever the megakernel can: under the interpreter on CPU, on the GPU when there is one
# (CPU tensors without the interpreter are refused, see test_cpu_tensors_without_interpreter_raise).
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4

# Interpreter-sized knobs: 2 communication programs (+3 compute programs under the interpreter), 16-row
# minibatches and 16-wide tiles, so tiny shapes still span several minibatches, tiles and ring slots.
CFG = KernelConfig(num_comm_programs_fwd=2, minibatch_size=16, block_m=16, block_n=16, block_k=16, num_warps=4,
                   num_stages=2)


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    r: int
    t: int
    routing: str = "uniform"  # a key of ROUTINGS, or "few_experts"
    hot: int = 0  # one_hot: the expert every token's first route goes to
    swiglu_limit: float | None = None
    shared: bool = True
    dtype: torch.dtype = torch.float32
    ids_dtype: torch.dtype = torch.int64
    minibatch: int = 16
    macrobatch: int | None = None  # None: the ring never wraps
    comm: int = 2

    def config(self) -> KernelConfig:
        return CFG.with_(minibatch_size=self.minibatch, macrobatch_size=self.macrobatch,
                         num_comm_programs_fwd=self.comm)


@dataclass
class Inputs:
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    ws: list[torch.Tensor]
    mw: MoEWeights

    def weights(self):
        return self.mw.w13_E2IH, self.mw.w2_EHI, self.mw.shared_w13_2SH, self.mw.shared_w2_HS


def _routing(case: Case, gen: torch.Generator):
    t, e, k = case.t, case.shape.e, case.shape.k
    if case.routing == "few_experts":
        # Experts 0..max(2, K) only. TINY on R=4 ranks (E_local=2): rank 0 owns experts 0 and 1, rank 1 only
        # expert 2, ranks 2 and 3 receive no row at all; experts 3..7 get zero tokens.
        return routing_few_experts(t, e, k, list(range(max(3, k + 1))), generator=gen)
    if case.routing == "one_hot":
        return ROUTINGS["one_hot"](t, e, k, hot=case.hot, generator=gen)
    return ROUTINGS[case.routing](t, e, k, generator=gen)


def _make_inputs(case: Case, seed: int = 0, device=DEV) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for _ in range(case.r):
        xs.append(torch.randn(case.t, case.shape.h, generator=gen).to(device, case.dtype))
        i, w = _routing(case, gen)
        ids.append(i.to(device, case.ids_dtype).contiguous())
        ws.append(w.float().to(device).contiguous())  # router weights stay fp32
    mw = make_weights(case.shape, dtype=case.dtype, device=device, generator=gen, shared=case.shared)
    return Inputs(xs, ids, ws, mw)


def _poisoned_peers(r: int, t: int, k: int, h: int, dtype: torch.dtype, device=DEV) -> LocalPeers:
    """Peers whose combine buffers hold NaN: a route the megakernel never pushes stays NaN in the output."""
    peers = LocalPeers(r, device)
    peers.alloc("combine", (t * k, h), dtype, fill=float("nan"))
    return peers


def _megakernel(case: Case, inp: Inputs, config: KernelConfig | None = None, peers: LocalPeers | None = None,
                check: bool = True):
    if peers is None:
        peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype, inp.xs[0].device)
    res = megakernel_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                       config=config or case.config(), peers=peers)
    if check:
        res.check_errors()
    assert len(res.outputs) == case.r and len(res.states) == case.r
    for r, o in enumerate(res.outputs):
        assert o.dtype == case.dtype and o.shape == (case.t, case.shape.h) and o.device == inp.xs[0].device, r
    return res


def _reference64(case: Case, inp: Inputs, swiglu_limit="case"):
    limit = case.swiglu_limit if swiglu_limit == "case" else swiglu_limit
    return moe_reference_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), limit, compute_dtype=torch.float64)


# ----------------------------------------------------------------------------- accuracy

MATCH_CASES = {
    # one rank, the ring never wraps (macrobatch None): the schedule is a local sort, every row resident
    "R1-T16": Case(TINY, r=1, t=16),
    # two ranks, macrobatch = minibatch = 16: the ring wraps with one slot, so every pull waits for the previous
    # minibatch's down/push and the compute rounds run with LAG 0
    "R2-ring-mac16": Case(TINY, r=2, t=16, macrobatch=16),
    # four ranks, K=4 shape, ring of two 16-row slots (macrobatch 32) that wraps, several expert segments per
    # macrobatch and a partial last macrobatch
    "R4-ring-mac32-k4": Case(TINY_SIG, r=4, t=6, macrobatch=32),
    # two ranks, the ring wraps with minibatch 32 = macrobatch 32 (one slot, two row tiles per minibatch)
    "R2-ring-mb32-mac32": Case(TINY, r=2, t=24, minibatch=32, macrobatch=32),
    # zero-token experts and zero-row ranks: only experts 0..2 are chosen, so ranks 2 and 3 own no row (no
    # minibatch is live there) and only their shared expert runs
    "R4-zero-token-experts": Case(TINY, r=4, t=10, routing="few_experts"),
    # all tokens to one expert (one-hot, hot = last expert, ids wrap mod E) on two ranks with the ring wrapping:
    # each owned expert's segment spans several minibatches and macrobatches
    "R2-one-hot-ring": Case(TINY, r=2, t=24, routing="one_hot", hot=TINY.e - 1, macrobatch=32),
    # K=1 one-hot: literally every route of every rank to expert 5 (rank 1 of 2); rank 0 gets no row
    "R2-one-hot-K1": Case(TINY.with_(k=1), r=2, t=20, routing="one_hot", hot=5),
    # T=7, not a multiple of block_m: partial shared-expert row tile, every expert segment one partial tile
    "R1-T7": Case(TINY, r=1, t=7),
    # T=7 on two ranks with the ring wrapping (macrobatch 16)
    "R2-T7-ring": Case(TINY, r=2, t=7, macrobatch=16),
    # a single token per rank: T*K = 2 < block_m, every segment almost all padding
    "R2-T1": Case(TINY, r=2, t=1),
    # SwiGLU clamp active (limit 0.3 << the O(1) pre-activations), routed and shared experts
    "R2-swiglu-limit-0.3": Case(TINY, r=2, t=16, swiglu_limit=0.3),
    # the DeepSeek-V4-style clamp at the K=4 shape's own limit (1.5), skewed (zipf) load
    "R2-swiglu-limit-1.5-zipf": Case(TINY_SIG, r=2, t=8, routing="zipf", swiglu_limit=1.5),
    # no shared expert: out is the routed sum only (the shared phases compute nothing)
    "R2-no-shared": Case(TINY, r=2, t=16, shared=False),
    # minibatch 48 (three row tiles, not a power of two nor a multiple of the 32-row copy chunk)
    "R1-mb48": Case(TINY, r=1, t=40, minibatch=48),
    # one communication program pulls every chunk alone
    "R2-comm1": Case(TINY, r=2, t=16, comm=1),
    # bf16 operands (the interpreter casts dot operands to fp32; hidden and y rounded to bf16) with the ring
    # wrapping, against the fp64 reference at the bf16 tolerance
    "R2-bf16-ring": Case(TINY_SIG, r=2, t=8, dtype=torch.bfloat16, macrobatch=32),
    # int32 expert ids (the router's other index dtype), four ranks
    "R4-int32-ids": Case(TINY, r=4, t=6, ids_dtype=torch.int32),
    # the ring wrapping under skewed load: a pull into a slot waits on the push of its previous occupant
    "R4-ring-mac32-zipf": Case(TINY_SIG, r=4, t=5, routing="zipf", macrobatch=32),
}


@pytest.mark.parametrize("name", list(MATCH_CASES))
def test_matches_torch_backend_and_reference(name):
    case = MATCH_CASES[name]
    assert case.shape.e % case.r == 0
    inp = _make_inputs(case)
    res = _megakernel(case, inp)
    tol = "fp32" if case.dtype == torch.float32 else "bf16"
    backend = moe_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                    block_m=case.config().block_m)
    ref = _reference64(case, inp)
    for r in range(case.r):
        out = res.outputs[r]
        assert_close(out.float(), backend[r].float(), tol, f"out[{r}] vs torch backend")
        assert_close(out.float(), ref[r].float(), tol, f"out[{r}] vs fp64 reference")


@pytest.mark.parametrize("name", [n for n, c in MATCH_CASES.items() if c.swiglu_limit is not None])
def test_swiglu_limit_cases_clamp(name):
    """The clamp cases above would prove nothing if the limit never changed the result."""
    case = MATCH_CASES[name]
    inp = _make_inputs(case)
    clamped, free = _reference64(case, inp), _reference64(case, inp, swiglu_limit=None)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(clamped, free, strict=True))


def _route_outputs64(case: Case, inp: Inputs, r: int) -> torch.Tensor:
    """[T*K, H] fp64: route t*K + j of rank r through expert ids[r][t, j] alone (unweighted)."""
    w13, w2 = inp.mw.w13_E2IH.double(), inp.mw.w2_EHI.double()
    x = inp.xs[r].double()
    ids = inp.ids[r].reshape(-1)
    tok = torch.arange(ids.numel(), device=ids.device) // case.shape.k
    out = torch.zeros(ids.numel(), case.shape.h, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        sel = (ids == e).nonzero().flatten()
        out[sel] = swiglu_ffn(x[tok[sel]], w13[e], w2[e], case.swiglu_limit)
    return out


POISON_CASES = {
    # ring wrapping with one slot on two ranks: every route is pushed exactly once into its origin's slot t*K+j
    "R2-ring-mac16": Case(TINY, r=2, t=12, macrobatch=16),
    # skewed load on four ranks, K=4, two-slot ring
    "R4-zipf-mac32": Case(TINY_SIG, r=4, t=5, routing="zipf", macrobatch=32),
}


@pytest.mark.parametrize("name", list(POISON_CASES))
def test_every_route_pushed_to_its_combine_row(name):
    """NaN-filled combine buffers: after the run every row t*K+j of every rank holds expert ids[t, j] of x[t]."""
    case = POISON_CASES[name]
    inp = _make_inputs(case)
    peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
    res = _megakernel(case, inp, peers=peers)
    ref = _reference64(case, inp)
    for r in range(case.r):
        comb = peers.buffer("combine", r)
        unwritten = (~torch.isfinite(comb)).any(dim=1).nonzero().flatten().tolist()
        assert not unwritten, f"rank {r}: combine rows (t*K+j) never pushed: {unwritten}"
        assert_close(comb.float(), _route_outputs64(case, inp, r).float(), "fp32", f"combine[{r}]")
        assert_close(res.outputs[r], ref[r].float(), "fp32", f"out[{r}]")


# ----------------------------------------------------------------------------- bitwise determinism

BITWISE_BASE = Case(TINY, r=2, t=16, routing="zipf", swiglu_limit=0.5)

# Config variants that must leave the forward output bit-for-bit unchanged (docs/design.md "Invariants and errors":
# each row's arithmetic does not depend on tiling along rows); every one differs from BITWISE_BASE's config.
BITWISE_VARIANTS = {
    # minibatch 32: two row tiles per handoff instead of one
    "minibatch-32": dict(minibatch_size=32),
    # minibatch 48: three row tiles per handoff
    "minibatch-48": dict(minibatch_size=48),
    # ring wraps with two 16-row slots
    "macrobatch-32": dict(macrobatch_size=32),
    # ring wraps with a single slot (LAG 0, every pull waits on the previous minibatch)
    "macrobatch-16": dict(macrobatch_size=16),
    # one communication program
    "comm-1": dict(num_comm_programs_fwd=1),
    # three communication programs (more than the chunks of a minibatch)
    "comm-3": dict(num_comm_programs_fwd=3),
    # all three knobs at once: minibatch 32, one 32-row slot, three communication programs
    "mb32-mac32-comm3": dict(minibatch_size=32, macrobatch_size=32, num_comm_programs_fwd=3),
}


@pytest.fixture(scope="module")
def bitwise_base():
    inp = _make_inputs(BITWISE_BASE, seed=3)
    res = _megakernel(BITWISE_BASE, inp)
    for o in res.outputs:
        assert torch.isfinite(o).all()
    return inp, [o.clone() for o in res.outputs]


def test_bitwise_repeatable(bitwise_base):
    """Same inputs and config (fresh peers), same bits."""
    inp, base = bitwise_base
    res = _megakernel(BITWISE_BASE, inp)
    for r, (a, b) in enumerate(zip(res.outputs, base, strict=True)):
        assert_bitwise_equal(a, b, f"out[{r}]")


def test_bitwise_repeatable_reused_peers(bitwise_base):
    """A second run through the same peers (buffers kept, combine re-poisoned) gives the same bits."""
    inp, base = bitwise_base
    c = BITWISE_BASE
    peers = _poisoned_peers(c.r, c.t, c.shape.k, c.shape.h, c.dtype)
    first = [o.clone() for o in _megakernel(c, inp, peers=peers).outputs]
    peers.alloc("combine", (c.t * c.shape.k, c.shape.h), c.dtype, fill=float("nan"))
    second = _megakernel(c, inp, peers=peers).outputs
    for r in range(c.r):
        assert_bitwise_equal(first[r], base[r], f"first out[{r}]")
        assert_bitwise_equal(second[r], base[r], f"second out[{r}]")


# KernelConfig.tile_group_m on a shape with several column tiles (I = 64: four gate|up tiles of 16, H = 64: two
# down tiles of 32), minibatch 48 = three row tiles
TILE_GROUP_CASE = Case(TINY.with_(h=64, i=64), r=2, t=24)


@pytest.mark.parametrize("group", [
    1,  # one row tile at a time, across every column tile
    2,  # a full group of two row tiles, then a last group of one
    3,  # the whole minibatch in one group: the default order written another way
    -1,  # each expert's run of row tiles a group (runs of 1-2 tiles here, cut at the minibatch's edges)
])
def test_tile_group_order_same_bits(group, monkeypatch):
    """The forward's output does not depend on the order of a minibatch's GEMM tiles; the scratch starts NaN,
    so a tile the order skipped would show."""
    case = TILE_GROUP_CASE
    inp = _make_inputs(case, seed=11)
    cfg = case.config().with_(minibatch_size=48)
    base = [o.clone() for o in _megakernel(case, inp, config=cfg).outputs]
    nan_scratch(monkeypatch)
    got = _megakernel(case, inp, config=cfg.with_(tile_group_m=group)).outputs
    for r in range(case.r):
        assert torch.isfinite(got[r]).all()
        assert_bitwise_equal(got[r], base[r], f"out[{r}], tile_group_m={group}")


def test_tile_group_m_checked():
    """-1 (expert runs), 0 (the whole minibatch) and G > 0 are orders; anything below -1 is refused."""
    with pytest.raises(ValueError, match="must be >= -1"):
        KernelConfig(tile_group_m=-2)


def _assert_kept_backward_equal(case: Case, inp: Inputs, base: KernelConfig, variant: KernelConfig,
                                monkeypatch=None) -> None:
    """The forward with its activations kept, then the backward from them, under ``base`` and under ``variant``
    (another combine or pull path): each run's kept gate|up is finite with exact-zero padding rows (the backward's weight
    gradients sum them), and the variant's gate|up, d_x, d_w and weight gradients equal the base's bit for bit.
    With ``monkeypatch`` the variant's scratch starts NaN, so a row read before it is written shows."""
    a = (inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit)
    runs = []
    for label, c in (("base", base), ("variant", variant)):
        d_out = [torch.randn(case.t, case.shape.h, generator=torch.Generator().manual_seed(5)).to(DEV, case.dtype)
                 for _ in range(case.r)]
        if monkeypatch is not None and label == "variant":
            nan_scratch(monkeypatch)
        f = megakernel_forward_multirank(*a, config=c, save_for_backward=True)
        f.check_errors()
        b = megakernel_backward_multirank(d_out, *a, config=c, saved=f.saved())
        b.check_errors()
        if monkeypatch is not None:
            monkeypatch.undo()
        for r, st in enumerate(f.states):
            n = int(st.schedule.num_rows.item())
            pad = st.schedule.peer_rank[:n] < 0
            assert torch.all(st.gate_up[:n][pad] == 0), f"{label}: rank {r} gate|up padding rows not zero"
            assert torch.isfinite(st.gate_up[:n]).all(), f"{label}: rank {r} gate|up rows unwritten"
        runs.append((f, b))
    (ff, fb), (vf, vb) = runs
    for r in range(case.r):
        n = int(ff.states[r].schedule.num_rows.item())
        assert_bitwise_equal(vf.states[r].gate_up[:n], ff.states[r].gate_up[:n], f"gate|up[{r}]")
        assert_bitwise_equal(vb.d_x[r], fb.d_x[r], f"d_x[{r}]")
        assert_bitwise_equal(vb.d_topk_weights[r], fb.d_topk_weights[r], f"d_w[{r}]")
    for gname in ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2"):
        assert_bitwise_equal(getattr(vb, gname), getattr(fb, gname), gname)


def test_no_comm_programs_refuse_a_wrapping_ring():
    """Every program pulls all its rows before any tile, so a ring smaller than the worst case would deadlock:
    refused before launch, saying why (the kept forward and backward without them: the combine_gather tests)."""
    case = Case(TINY, r=1, t=20, routing="zipf", swiglu_limit=0.5)
    inp = _make_inputs(case, seed=29)
    cfg = case.config().with_(num_comm_programs_fwd=0, combine_gather=True, macrobatch_size=32)
    with pytest.raises(ValueError, match=r"num_comm_programs_fwd=0 .* ring must hold them all"):
        _megakernel(case, inp, config=cfg)


# KernelConfig.combine_gather (one rank): the epilogue reads each route's row from y_routed, nothing is pushed
GATHER_CASES = {
    # skewed load with a swiglu clamp, two minibatches
    "zipf-limit": Case(TINY, r=1, t=24, routing="zipf", swiglu_limit=0.5),
    # experts with zero tokens (routes to three experts only), T not a multiple of block_m
    "few-experts": Case(TINY, r=1, t=19, routing="few_experts"),
    # K = 4 of 16 experts, no shared expert: the epilogue's sum is the routed rows alone
    "k4-no-shared": Case(TINY_SIG, r=1, t=21, shared=False),
}


@pytest.mark.parametrize("comm", [2, 0])  # comm programs pulling only; or none (every program pulls first)
@pytest.mark.parametrize("name", list(GATHER_CASES))
def test_combine_gather_same_bits(name, comm, monkeypatch):
    """The gathering epilogue gives the pushed path's output bit for bit; scratch (y_routed among it) starts NaN
    and the combine buffers hold NaN, so a route read from a row nobody wrote, or from the combine buffer, shows."""
    case = GATHER_CASES[name]
    inp = _make_inputs(case, seed=31)
    base = [o.clone() for o in _megakernel(case, inp).outputs]
    nan_scratch(monkeypatch)
    res = _megakernel(case, inp, config=case.config().with_(combine_gather=True, num_comm_programs_fwd=comm))
    monkeypatch.undo()
    st = res.states[0]
    n = int(st.schedule.num_rows.item())
    real = st.schedule.peer_rank[:n] >= 0
    assert sorted(st.route_row[st.route_row >= 0].tolist()) == torch.nonzero(real).flatten().tolist(), \
        "route_row is not a bijection onto the schedule's real rows"
    assert torch.isfinite(res.outputs[0]).all()
    assert_bitwise_equal(res.outputs[0], base[0], f"out with combine_gather, comm {comm}")


@pytest.mark.parametrize("comm_bwd", [16, 0])  # the backward's comm programs pulling; or none (every program)
def test_combine_gather_kept_backward_equal(comm_bwd, monkeypatch):
    """The gathering forward keeps the same activations, and the gathering backward (its epilogue reads the d_x
    rows and d_w partials where phase B left them, nothing pushed) gives the same gradients."""
    case = GATHER_CASES["zipf-limit"]
    inp = _make_inputs(case, seed=37)
    cfg = case.config()
    _assert_kept_backward_equal(case, inp, cfg, cfg.with_(combine_gather=True, num_comm_programs_fwd=0,
                                                          num_comm_programs_bwd=comm_bwd), monkeypatch)


@pytest.mark.parametrize("name,comm_bwd", [
    ("few-experts", 16),  # zero-token experts, comm programs pulling x and d_out rows
    ("k4-no-shared", 16),  # no shared expert
    ("few-experts", 0),  # every program pulls x and d_out rows first (num_comm_programs_bwd = 0)
])
def test_combine_gather_replayed_backward_same_bits(name, comm_bwd, monkeypatch):
    """Without kept activations (the backward replays gate|up) the gathering backward's d_x, d_w and weight
    gradients equal the pushing one's; scratch starts NaN and the pushed combine buffers are never read."""
    case = GATHER_CASES[name]
    inp = _make_inputs(case, seed=41)
    a = (inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit)
    d_out = [torch.randn(case.t, case.shape.h, generator=torch.Generator().manual_seed(6)).to(DEV, case.dtype)]
    base = megakernel_backward_multirank(d_out, *a, config=case.config())
    nan_scratch(monkeypatch)
    got = megakernel_backward_multirank(d_out, *a, config=case.config().with_(combine_gather=True,
                                                                              num_comm_programs_bwd=comm_bwd))
    monkeypatch.undo()
    got.check_errors()
    assert torch.isfinite(got.d_x[0]).all() and torch.isfinite(got.d_topk_weights[0]).all()
    assert_bitwise_equal(got.d_x[0], base.d_x[0], "d_x")
    assert_bitwise_equal(got.d_topk_weights[0], base.d_topk_weights[0], "d_w")
    assert_bitwise_equal(got.d_w13, base.d_w13, "d_w13")
    assert_bitwise_equal(got.d_w2, base.d_w2, "d_w2")


@pytest.mark.parametrize("r,macrobatch,exc,match", [
    (2, None, NotImplementedError, r"combine_gather runs one rank .* got R=2"),  # rows on other ranks
    (1, 16, ValueError, r"combine_gather reads every route's row .* ring must hold them all"),  # a wrapping ring
])
def test_combine_gather_refuses(r, macrobatch, exc, match):
    case = Case(TINY, r=r, t=24)
    inp = _make_inputs(case, seed=2)
    with pytest.raises(exc, match=match):
        _megakernel(case, inp, config=case.config().with_(combine_gather=True, macrobatch_size=macrobatch))


@pytest.mark.parametrize("variant", list(BITWISE_VARIANTS))
def test_bitwise_across_configs(bitwise_base, variant):
    inp, base = bitwise_base
    cfg = BITWISE_BASE.config().with_(**BITWISE_VARIANTS[variant])
    res = _megakernel(BITWISE_BASE, inp, config=cfg)
    for r, (a, b) in enumerate(zip(res.outputs, base, strict=True)):
        assert_bitwise_equal(a, b, f"out[{r}] with {variant}")


# ----------------------------------------------------------------------------- device error flag

def _bad_id_case():
    """ids == E on rank 0 and ids == -1 on rank 1; the rest valid. Longer on a GPU, where roles run concurrently."""
    case = Case(TINY, r=2, t=256 if HAS_CUDA else 8)
    inp = _make_inputs(case, seed=5)
    inp.ids[0][3, 1] = case.shape.e  # one past the last expert
    inp.ids[1][5, 0] = -1
    return case, inp


def test_out_of_range_expert_ids_flagged():
    """Out-of-range ids pass the metadata checks (no error before the launch) and are reported on device.

    The schedule counts them (num_invalid) and every rank's kernel sets ERR_BAD_EXPERT_ID.
    """
    case, inp = _bad_id_case()
    res = _megakernel(case, inp, check=False)
    with pytest.raises(MegakernelError, match="expert ids"):
        res.check_errors()
    for r, st in enumerate(res.states):
        code = int(st.err.max())
        assert code & mk.ERR_BAD_EXPERT_ID, f"rank {r}: err={code}"
        with pytest.raises(MegakernelError, match="outside"):
            check_errors(st.err)


def test_out_of_range_expert_ids_leave_valid_routes_intact():
    """Only the bad routes are dropped ("those routes were not computed"): no timeout is reported and the
    outputs equal the reference, in which a route with an id outside [0, E) contributes nothing."""
    case, inp = _bad_id_case()
    peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype, inp.xs[0].device)
    res = _megakernel(case, inp, peers=peers, check=False)
    for r, st in enumerate(res.states):
        code = int(st.err.max())
        assert not code & mk.ERR_TIMEOUT, f"rank {r}: a bad id must not cause a timeout (err={code})"
    ref = _reference64(case, inp)
    for r in range(case.r):
        assert_close(res.outputs[r], ref[r].float(), "fp32", f"out[{r}]")
        # the combine rows (t*K + j): a bad route's row is never written (still the NaN poison), every valid
        # route's row is
        ids = inp.ids[r].reshape(-1).cpu()
        bad = (ids < 0) | (ids >= case.shape.e)
        assert bad.any(), "the case must hold a bad id on every rank"
        written = ~torch.isnan(peers.buffer("combine", r).float()).all(dim=1).cpu()
        assert not written[bad].any(), f"rank {r}: rows of bad routes were written"
        assert written[~bad].all(), f"rank {r}: valid routes not pushed: {(~written & ~bad).nonzero().flatten()}"


@pytest.mark.parametrize("missing,macrobatch", [
    (mk.PH_PULL, None),  # gate|up waits on x_ready forever
    (mk.PH_GATEUP, None),  # the down GEMM waits on hid_ready
    (mk.PH_DOWN, None),  # the push waits on y_ready
    (mk.PH_SHARED_GU, None),  # the shared expert's down waits on shared_ready
    (mk.PH_PUSH, 16),  # a ring that wraps: the next macrobatch's pull waits for the push to free its slots
], ids=["no-pull", "no-gateup", "no-down", "no-shared-gate-up", "no-push-ring"])
def test_spin_wait_timeout_flagged_without_hang(missing, macrobatch):
    """A launch without one phase: whatever waits on it gives up after max_spin polls, flags a timeout (and
    nothing else), and the launch returns."""
    case = Case(TINY, r=1, t=16, macrobatch=macrobatch)
    inp = _make_inputs(case)
    R, T, K, H = case.r, case.t, case.shape.k, case.shape.h
    peers = LocalPeers(R, DEV)
    peers.alloc("x", (T, H), case.dtype)[0].copy_(inp.xs[0])
    peers.alloc("combine", (T * K, H), case.dtype, fill=float("nan"))
    ids_all = torch.stack([i.to(torch.int32) for i in inp.ids])
    t0 = time.monotonic()
    st = launch_forward.launch_rank_forward(0, peers, ids_all, *inp.weights(), None, case.config(), max_spin=50,
                                 phases=mk.PH_ALL & ~missing)
    code = int(st.err.max())  # syncs on CUDA: the launch has returned
    assert time.monotonic() - t0 < 120, "the bounded wait took far too long"
    assert code & mk.ERR_TIMEOUT, f"err={code}"
    assert not code & mk.ERR_BAD_EXPERT_ID, f"err={code}: only the timeout was expected"
    with pytest.raises(MegakernelError, match="timed out"):
        check_errors(st.err)


def test_int32_and_int64_ids_same_bits(bitwise_base):
    inp, base = bitwise_base
    inp32 = dataclasses.replace(inp, ids=[i.to(torch.int32) for i in inp.ids])
    res = _megakernel(BITWISE_BASE, inp32)
    for r, (a, b) in enumerate(zip(res.outputs, base, strict=True)):
        assert_bitwise_equal(a, b, f"out[{r}] with int32 ids")


def test_clean_run_reports_no_error():
    case = Case(TINY, r=1, t=4)
    res = _megakernel(case, _make_inputs(case), check=False)
    res.check_errors()
    for st in res.states:
        assert int(st.err.max()) == 0


# ----------------------------------------------------------------------------- host-side checks

def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    """CPU tensors are only accepted under the interpreter; the variable is read at call time."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = Case(TINY, r=1, t=4)
    inp = _make_inputs(case, device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET") as info:
        megakernel_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=CFG)
    assert not isinstance(info.value, MegakernelError)


def test_peers_of_wrong_rank_count_raise():
    case = Case(TINY, r=2, t=4)
    inp = _make_inputs(case)
    with pytest.raises(ValueError, match="ranks"):
        megakernel_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=CFG,
                                     peers=LocalPeers(3, DEV))


# ----------------------------------------------------------------------------- ring geometry

MB16 = KernelConfig(minibatch_size=16, block_m=16)


def test_ring_geometry_no_wrap():
    # capacity 152 rounds up to 160 rows = 10 minibatches, all resident in one macrobatch
    g = RingGeometry.make(152, MB16)
    assert g == RingGeometry(capacity=152, minibatch=16, macrobatch=160, slots=10, num_minibatches=10)
    assert g.live_minibatches(128) == list(range(8))  # one macrobatch: processing order is row order
    assert g.live_minibatches(0) == []


def test_ring_geometry_wrapping_reverse_order():
    g = RingGeometry.make(152, MB16.with_(macrobatch_size=32))
    assert (g.macrobatch, g.slots, g.num_minibatches) == (32, 2, 10)  # 5 macrobatches of 2 slots, worst case
    # 96 rows = 3 full macrobatches: all six minibatches live, in processing indices 0..5
    assert g.live_minibatches(96) == [0, 1, 2, 3, 4, 5]
    # 80 rows: macrobatch 2 (rows 64..79) is partial and runs first (reverse order), so processing index 1
    # (its second slot, rows 80..95) holds nothing; macrobatches 1 and 0 follow in indices 2..5
    assert g.live_minibatches(80) == [0, 2, 3, 4, 5]
    # 16 rows: one partial macrobatch, one minibatch
    assert g.live_minibatches(16) == [0]
    assert g.live_minibatches(0) == []
    assert g.live_minibatches(160) == list(range(10))


def test_ring_geometry_three_slots():
    g = RingGeometry.make(152, MB16.with_(macrobatch_size=48))
    assert (g.macrobatch, g.slots, g.num_minibatches) == (48, 3, 12)  # ceil(152 / 48) = 4 macrobatches
    assert g.live_minibatches(144) == list(range(9))  # 3 full macrobatches
    # 112 rows: macrobatch 2 holds rows 96..111 only (first slot), then 1 and 0 in full
    assert g.live_minibatches(112) == [0, 3, 4, 5, 6, 7, 8]


def test_ring_geometry_macrobatch_clamped_to_capacity():
    # a macrobatch larger than the (rounded-up) capacity holds just the capacity
    g = RingGeometry.make(20, MB16.with_(macrobatch_size=64))
    assert (g.macrobatch, g.slots, g.num_minibatches) == (32, 2, 2)
    assert g.live_minibatches(16) == [0]
    assert g.live_minibatches(32) == [0, 1]


@pytest.mark.parametrize("mac", [None, 16, 32, 48, 64])
def test_ring_geometry_live_minibatches_cover_every_row_once(mac):
    cap = routed_capacity(2, 16, 2, 4, 16)  # 124 (R=2, T=16, K=2, L=4, block_m=16)
    g = RingGeometry.make(cap, MB16.with_(macrobatch_size=mac))
    assert g.macrobatch % g.minibatch == 0 and g.slots == g.macrobatch // g.minibatch
    assert g.num_minibatches * g.minibatch >= cap
    for num_rows in range(0, cap + 1, 16):
        live = g.live_minibatches(num_rows)
        assert live == sorted(set(live)) and all(0 <= p < g.num_minibatches for p in live)
        assert len(live) == -(-num_rows // g.minibatch), (mac, num_rows, live)


# ============================================================================= GPU

def _cuda_weights(shape: ModelShape, dtype, seed: int) -> MoEWeights:
    """make_weights' scaling (std 1/sqrt(fan_in)), drawn on the GPU (seed-shape weights are GBs)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i, s = shape.e, shape.h, shape.i, shape.shared_width

    def rnd(*size, fan_in):
        return (torch.randn(*size, generator=gen, device="cuda", dtype=torch.float32) / fan_in ** 0.5).to(dtype)

    return MoEWeights(rnd(e, 2 * i, h, fan_in=h), rnd(e, h, i, fan_in=i), rnd(2 * s, h, fan_in=h),
                      rnd(h, s, fan_in=s))


@pytest.fixture
def cuda_cleanup():
    yield
    gc.collect()
    torch.cuda.empty_cache()


# The seed shapes sliced to one EP8 rank and run at R=1: E_local = E / 8 experts, every route lands locally.
SEED_SLICES = {
    f"{name}-T{t}": (name, t) for name in SEED_SHAPES for t in (2048, 4096)
}


def _seed_slice_inputs(name: str, seed: int = 0):
    base_name, t = SEED_SLICES[name]
    base = SEED_SHAPES[base_name]
    shape = base.with_(e=base.e // 8)
    dev = torch.device("cuda")
    mw = _cuda_weights(shape, torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, shape.h, generator=gen).to(dev, torch.bfloat16)
    ids, w = routing_uniform(t, shape.e, shape.k, generator=gen, device=dev)
    return shape, t, x, ids.contiguous(), w.float().contiguous(), mw


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    "plain",  # KernelConfig()'s dataclass defaults: 16 comm programs pulling, then pushing into the combine buffer
    "heuristic",  # what MoELayer and the benchmarks run untuned: default_config for the slice (on the H200:
    # combine_gather, so the epilogue reads y_routed; no comm programs; expert-run order)
])
@pytest.mark.parametrize("name", list(SEED_SLICES))
def test_gpu_seed_slice_accuracy_and_determinism(name, knobs, cuda_cleanup, monkeypatch):
    """bf16 seed-shape slice: rel L1 vs the fp32 reference, then the same bits 20 times. Every float
    ``torch.empty`` starts NaN (``nan_scratch``: y_routed, hidden, the output) and the combine buffer is
    re-poisoned before each run, so a row some run leaves unwritten cannot pass as the previous run's bits."""
    shape, t, x, ids, w, mw = _seed_slice_inputs(name)
    args = ([x], [ids], [w], mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS, shape.swiglu_limit)
    cfg = KernelConfig() if knobs == "plain" else default_config(
        t, shape.h, shape.i, shape.e, shape.k, dtype=torch.bfloat16, s=shape.shared_width)
    peers = _poisoned_peers(1, t, shape.k, shape.h, torch.bfloat16, "cuda")
    nan_scratch(monkeypatch)
    res = megakernel_forward_multirank(*args, config=cfg, peers=peers)
    res.check_errors()
    out = res.outputs[0].clone()
    assert out.dtype == torch.bfloat16 and out.shape == (t, shape.h)
    assert torch.isfinite(out).all(), "non-finite output (a route never pushed or computed, or overflow)"
    ref = moe_reference(x, ids, w, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS, shape.swiglu_limit,
                        compute_dtype=torch.float32)
    err = rel_l1(out, ref)
    assert err <= tolerance_for("bf16").rel_l1, f"{name}: relative L1 {err:.3e}"
    del ref
    for i in range(20):
        peers.alloc("combine", (t * shape.k, shape.h), torch.bfloat16, fill=float("nan"))
        again = megakernel_forward_multirank(*args, config=cfg, peers=peers)
        again.check_errors()
        assert_bitwise_equal(again.outputs[0], out, f"{name} run {i + 1}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in SEED_SLICES if n.endswith("T2048")])
def test_gpu_cuda_graph_replay(name, cuda_cleanup):
    """Capture the whole forward (schedule, megakernel, epilogue) once; replays follow in-place input changes."""
    shape, t, x, ids, w, mw = _seed_slice_inputs(name)
    _, _, x2, ids2, w2, _ = _seed_slice_inputs(name, seed=1)  # other tokens and another routing
    wts = (mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS, shape.swiglu_limit)
    cfg = KernelConfig()
    x_in, ids_in, w_in = x.clone(), ids.clone(), w.clone()  # the captured input tensors
    peers = LocalPeers(1, "cuda")
    warm = megakernel_forward_multirank([x_in], [ids_in], [w_in], *wts, config=cfg, peers=peers)
    warm.check_errors()  # compiled, peers' buffers and pointer tables exist
    warm_out = warm.outputs[0].clone()
    torch.cuda.synchronize()

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = megakernel_forward_multirank([x_in], [ids_in], [w_in], *wts, config=cfg, peers=peers)

    def eager(xv, iv, wv):
        res = megakernel_forward_multirank([xv], [iv], [wv], *wts, config=cfg, peers=LocalPeers(1, "cuda"))
        res.check_errors()
        return res.outputs[0]

    # new x, same routing
    x_in.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    cap.check_errors()
    expect = eager(x2, ids, w)
    assert not torch.equal(expect, warm_out)
    assert_bitwise_equal(cap.outputs[0], expect, f"{name}: replay with new x")

    # new x and a new routing (the schedule is rebuilt on device inside the graph)
    ids_in.copy_(ids2)
    w_in.copy_(w2)
    g.replay()
    g.replay()  # replays repeat
    torch.cuda.synchronize()
    cap.check_errors()
    assert_bitwise_equal(cap.outputs[0], eager(x2, ids2, w2), f"{name}: replay with new x and routing")


GPU_MR_SHAPE = ModelShape("gpu-mr", e=32, h=1024, i=512, k=4, score_func="softmax")
GPU_RING = KernelConfig(num_comm_programs_fwd=4, minibatch_size=128, macrobatch_size=256, block_m=64,
                        block_n=64, block_k=64, num_warps=4)
GPU_MR_CASES = {
    # two ranks, default knobs, balanced load
    "R2-default": (Case(GPU_MR_SHAPE, r=2, t=512, dtype=torch.bfloat16), KernelConfig()),
    # four ranks, default knobs
    "R4-default": (Case(GPU_MR_SHAPE, r=4, t=512, dtype=torch.bfloat16), KernelConfig()),
    # four ranks, skewed load, the ring wraps (2 slots of 128 rows) while every role runs concurrently
    "R4-ring-zipf": (Case(GPU_MR_SHAPE, r=4, t=512, routing="zipf", dtype=torch.bfloat16), GPU_RING),
    # four ranks, all tokens' first route to expert 6: two ranks own every row, two own none; ring wraps
    "R4-one-hot-ring": (Case(GPU_MR_SHAPE, r=4, t=384, routing="one_hot", hot=6, dtype=torch.bfloat16),
                        GPU_RING),
    # four ranks, zero-token experts (only experts 0..4 used, all on rank 0: ranks 1..3 own no row), T not a
    # multiple of 64
    "R4-few-experts-T300": (Case(GPU_MR_SHAPE, r=4, t=300, routing="few_experts", dtype=torch.bfloat16),
                            GPU_RING),
    # two ranks, SwiGLU clamp active (0.5), no shared expert, one communication program
    "R2-limit-no-shared-comm1": (Case(GPU_MR_SHAPE, r=2, t=256, swiglu_limit=0.5, shared=False,
                                      dtype=torch.bfloat16), GPU_RING.with_(num_comm_programs_fwd=1)),
}


if "tma" in {f.name for f in dataclasses.fields(KernelConfig)}:
    # the pointer-load path on the GPU (TMA descriptors off), ring wrapping, skewed load
    GPU_MR_CASES["R4-ring-zipf-no-tma"] = (Case(GPU_MR_SHAPE, r=4, t=512, routing="zipf", dtype=torch.bfloat16),
                                           GPU_RING.with_(tma=False))
    # no shared expert through the pointer-load path (the TMA path has its own case above)
    GPU_MR_CASES["R2-limit-no-shared-no-tma"] = (Case(GPU_MR_SHAPE, r=2, t=256, swiglu_limit=0.5, shared=False,
                                                      dtype=torch.bfloat16), GPU_RING.with_(tma=False))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [
    n for n in GPU_MR_CASES])
def test_gpu_multirank_bf16(name, cuda_cleanup):
    case, cfg = GPU_MR_CASES[name]
    inp = _make_inputs(case, device="cuda")
    res = _megakernel(case, inp, config=cfg)
    backend = moe_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                    block_m=cfg.block_m)
    ref = moe_reference_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                  compute_dtype=torch.float32)
    for r in range(case.r):
        assert_close(res.outputs[r].float(), backend[r].float(), "bf16", f"out[{r}] vs torch backend")
        assert_close(res.outputs[r].float(), ref[r], "bf16", f"out[{r}] vs fp32 reference")


GPU_BITWISE_VARIANTS = {
    # minibatch 256 (4 row tiles per handoff)
    "minibatch-256": dict(minibatch_size=256, macrobatch_size=None),
    # no ring (macrobatch None)
    "no-ring": dict(macrobatch_size=None),
    # one-slot ring
    "macrobatch-128": dict(macrobatch_size=128),
    # one communication program
    "comm-1": dict(num_comm_programs_fwd=1),
    # sixteen communication programs
    "comm-16": dict(num_comm_programs_fwd=16),
    # minibatch 64 with a four-slot ring
    "mb64-mac256": dict(minibatch_size=64, macrobatch_size=256),
    # minibatch 256 walked in groups of 3 row tiles (3 + 1; KernelConfig.tile_group_m)
    "tile-group-3-mb256": dict(minibatch_size=256, macrobatch_size=None, tile_group_m=3),
    # minibatch 256 walked expert by expert (tile_group_m = -1)
    "tile-group-expert-mb256": dict(minibatch_size=256, macrobatch_size=None, tile_group_m=-1),
}


@pytest.mark.gpu
def test_gpu_bitwise_across_configs(cuda_cleanup):
    """Concurrent roles on the GPU: minibatch, macrobatch and comm-program knobs leave the bits unchanged."""
    case = Case(GPU_MR_SHAPE, r=2, t=512, routing="zipf", dtype=torch.bfloat16)
    inp = _make_inputs(case, device="cuda")
    base = [o.clone() for o in _megakernel(case, inp, config=GPU_RING).outputs]
    for variant, kw in GPU_BITWISE_VARIANTS.items():
        res = _megakernel(case, inp, config=GPU_RING.with_(**kw))
        for r in range(case.r):
            assert_bitwise_equal(res.outputs[r], base[r], f"out[{r}] with {variant}")


@pytest.mark.gpu
def test_gpu_combine_gather_same_bits(cuda_cleanup):
    """One rank, concurrent roles: the gathering epilogue (with comm programs pulling only, and with none) gives
    the pushed path's bits."""
    case = Case(GPU_MR_SHAPE, r=1, t=1000, routing="zipf", dtype=torch.bfloat16)
    inp = _make_inputs(case, device="cuda")
    cfg = KernelConfig(block_m=64, block_n=64, block_k=64, num_warps=4, minibatch_size=256)
    base = [o.clone() for o in _megakernel(case, inp, config=cfg).outputs]
    for kw in (dict(combine_gather=True), dict(combine_gather=True, num_comm_programs_fwd=0)):
        res = _megakernel(case, inp, config=cfg.with_(**kw))
        assert_bitwise_equal(res.outputs[0], base[0], f"out with {kw}")
    # the backward (kept activations) with its gathering epilogue
    a = (inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit)
    d_out = [torch.randn_like(inp.xs[0])]
    runs = []
    for c in (cfg, cfg.with_(combine_gather=True), cfg.with_(combine_gather=True, num_comm_programs_fwd=0,
                                                            num_comm_programs_bwd=0)):
        f = megakernel_forward_multirank(*a, config=c, save_for_backward=True)
        b = megakernel_backward_multirank(d_out, *a, config=c, saved=f.saved())
        b.check_errors()
        runs.append(b)
    for run in runs[1:]:
        for gname in ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2"):
            assert_bitwise_equal(getattr(run, gname), getattr(runs[0], gname), gname)
        assert_bitwise_equal(run.d_x[0], runs[0].d_x[0], "d_x")
        assert_bitwise_equal(run.d_topk_weights[0], runs[0].d_topk_weights[0], "d_w")


@pytest.mark.gpu
def test_gpu_spin_wait_timeout_flagged(cuda_cleanup):
    """One concurrent launch without the pull phase ends with the timeout flag instead of hanging."""
    case = Case(GPU_MR_SHAPE, r=1, t=256, dtype=torch.bfloat16)
    inp = _make_inputs(case, device="cuda")
    T, K, H = case.t, case.shape.k, case.shape.h
    peers = LocalPeers(1, "cuda")
    peers.alloc("x", (T, H), case.dtype)[0].copy_(inp.xs[0])
    peers.alloc("combine", (T * K, H), case.dtype, fill=float("nan"))
    ids_all = torch.stack([i.to(torch.int32) for i in inp.ids])
    st = launch_forward.launch_rank_forward(0, peers, ids_all, *inp.weights(), None, GPU_RING, max_spin=1000,
                                 phases=mk.PH_ALL & ~mk.PH_PULL)
    torch.cuda.synchronize()
    with pytest.raises(MegakernelError, match="timed out"):
        check_errors(st.err)


@pytest.mark.skipif(HAS_CUDA, reason="compiled, the epilogue's multiply-add fuses into an FMA (one rounding), "
                    "which torch's separate mul and add cannot reproduce; the interpreter rounds twice, as here")
def test_epilogue_sums_routes_in_fixed_order():
    """docs/design.md: the epilogue adds the K routes in fp32 in the fixed order j = 0..K-1 onto the shared expert's
    output. The output equals that sum rebuilt in torch from the combine rows, bit for bit; the reversed order
    differs (so the comparison could fail). fp32 activations: the Triton 3.9 interpreter converts fp32 to bf16
    by truncation (torch and the GPU round to nearest even), so a bf16 output would test the interpreter."""
    dtype = torch.float32
    case = Case(TINY_SIG, r=1, t=24, dtype=dtype)  # K = 4 routes a token
    inp = _make_inputs(case, seed=11)
    peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype, inp.xs[0].device)
    res = _megakernel(case, inp, peers=peers)
    T, K, H = case.t, case.shape.k, case.shape.h
    comb = peers.buffer("combine", 0).reshape(T, K, H).float()
    w = inp.ws[0].float()

    def ordered(js):
        acc = res.states[0].y_shared.float().clone()
        for j in js:
            acc = acc + w[:, j:j + 1] * comb[:, j]
        return acc.to(dtype)

    assert_bitwise_equal(res.outputs[0], ordered(range(K)), "out vs the j = 0..K-1 sum")
    assert not torch.equal(ordered(reversed(range(K))), ordered(range(K))), "the order never mattered: no test"


@pytest.mark.parametrize("zero_invalid", [False, True])  # invalid rows skipped, or written as zeros
def test_copy_rows_chunks(zero_invalid):
    """_copy_rows over several column chunks (H = 40 in chunks of 16: two whole and a partial one): valid rows
    copied, invalid rows zeroed or left alone, nothing past H touched."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(src, dst, valid_ptr, H, BLOCK_H: tl.constexpr, ZERO: tl.constexpr):
        r = tl.arange(0, 8)
        ok = tl.load(valid_ptr + r) != 0
        mk._copy_rows(src + r * 48, dst + r * 48, ok, H, BLOCK_H, ZERO)

    g = torch.Generator().manual_seed(4)
    src = torch.randn(8, 48, generator=g).to(DEV)  # rows of 48 of which H = 40 are copied
    dst = torch.full((8, 48), float("nan"), device=DEV)
    valid = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.int32, device=DEV)
    kernel[(1,)](src, dst, valid, 40, BLOCK_H=16, ZERO=zero_invalid)
    ok = valid.bool()
    assert_bitwise_equal(dst[ok, :40], src[ok, :40], "valid rows")
    if zero_invalid:
        assert (dst[~ok, :40] == 0).all()
    else:
        assert torch.isnan(dst[~ok, :40]).all()
    assert torch.isnan(dst[:, 40:]).all(), "columns past H were written"


def test_atomics_only_touch_counters_and_error_flags():
    """Determinism rests on no atomics on data (docs/design.md): every ``tl.atomic_*`` in the package targets a
    counter (``cnt_ptr``, through _wait_geq / _signal) or the error flag (``err_ptr``), never a data buffer, and
    every _wait_geq / _signal call is handed cnt_ptr or a name bound to it. A source scan, so a new atomic on
    data fails here before any bitwise test has to catch its nondeterminism."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "kittenmoe"
    calls, waits = [], []
    for path in sorted(src.rglob("*.py")):  # every module: kernels live outside kernels/ too (ep.py)
        text = path.read_text()
        for m in re.finditer(r"tl\.atomic_\w+\(\s*([A-Za-z_][\w.]*)", text):
            calls.append((path.name, m.group(1)))
        # _signal / _wait_geq must be handed counters: cnt_ptr or a name bound to cnt_ptr (+ offset) in that file
        counters = {"cnt_ptr"} | set(re.findall(r"^\s*(\w+) = cnt_ptr\b", text, flags=re.M))
        for m in re.finditer(r"\b(_signal|_wait_geq)\(\s*([A-Za-z_]\w*)", text):
            waits.append((path.name, m.group(1), m.group(2), m.group(2) in counters))
    assert calls, "no atomics found: the scan is broken"
    bad = [c for c in calls if c[1] not in ("cnt_ptr", "err_ptr")]
    assert not bad, f"atomics on something other than a counter or the error flag: {bad}"
    assert len(waits) >= 20, f"the scan found only {len(waits)} signal / wait calls: it is broken"
    not_counters = [w[:3] for w in waits if not w[3]]
    assert not not_counters, f"signals or waits on something not derived from cnt_ptr: {not_counters}"
