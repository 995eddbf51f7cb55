"""The backward megakernel (``launch_backward.megakernel_backward_multirank``) against autograd through the reference and the
torch backend.

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1) at tiny shapes and
small tiles; the launcher then runs one role over one minibatch per launch. With CUDA the same tests run on the
GPU (one persistent launch per rank, every role concurrent), and the ``gpu``-marked tests add the seed shapes
sliced to one EP8 rank, determinism over many runs, multi-rank bf16 against the torch backend, bitwise equality
across knobs with concurrent roles, and forward+backward captured in one CUDA graph.

Every run first fills the peers' ``dx_comb`` ([T*K, H]) and ``dw_comb`` ([T*K] fp32) buffers with NaN, so a
route whose d_x row or router-weight gradient was never pushed back to its origin shows up as NaN (checked on the
buffers themselves, and ``assert_close`` rejects non-finite gradients).

Gradients are those of ``loss = sum_r <out[r], d_out[r]>`` for random upstream gradients ``d_out``.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass

import pytest
import torch

from kittenmoe import launch_common
from kittenmoe.config import SEED_SHAPES, TEST_SHAPES, KernelConfig, ModelShape, default_config
from kittenmoe.kernels import megakernel_bwd as mb
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_common import MegakernelError
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_reference_multirank, swiglu_ffn
from kittenmoe.testing import (
    nan_scratch,
    routing_few_experts,
    ROUTINGS,
    MoEWeights,
    assert_bitwise_equal,
    assert_close,
    cosine,
    make_weights,
    rel_l1,
    routing_uniform,
    tolerance_for,
)
from kittenmoe.torch_backend import moe_forward_multirank

HAS_CUDA = torch.cuda.is_available()
# The "CPU" tests run wherever the megakernel can: under the interpreter on CPU, on the GPU when there is one.
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4
SMALL = TEST_SHAPES["small"]  # E=16, H=128, I=64, K=4

# Interpreter-sized knobs: 2 communication programs (+3 compute programs under the interpreter), 16-row
# minibatches and row tiles. The backward halves block_n for its phase-A (gate|up) tiles: 16 columns of I (two
# I tiles, the second partial, on TINY_SIG's I=24, so the router-weight gradient is reduced over two partial
# sums), and 32-column tiles of H (two on TINY_SIG's H=48, the second partial).
CFG = KernelConfig(num_comm_programs_fwd=2, num_comm_programs_bwd=2, minibatch_size=16, block_m=16, block_n=32,
                   block_k=16, num_warps=4, num_stages=2)

GRAD_NAMES_WEIGHTS = ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2")

# The forward (run by some tests here) computes on uninitialised padding rows of an expert's last row tile (masked
# out of every output) and numpy warns about overflow and NaN in reductions there. The backward pulls padding rows
# as zeros (test_scratch_buffers_poisoned_with_nan).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


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
    minibatch: int = 16
    comm: int = 2

    def config(self) -> KernelConfig:
        return CFG.with_(minibatch_size=self.minibatch, num_comm_programs_bwd=self.comm)


@dataclass
class Inputs:
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    ws: list[torch.Tensor]
    mw: MoEWeights
    d_outs: list[torch.Tensor]  # upstream gradients, x's dtype

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
        ids.append(i.to(device).contiguous())
        ws.append(w.float().to(device).contiguous())  # router weights stay fp32
    mw = make_weights(case.shape, dtype=case.dtype, device=device, generator=gen, shared=case.shared)
    d_outs = [torch.randn(case.t, case.shape.h, generator=gen).to(device, case.dtype) for _ in range(case.r)]
    return Inputs(xs, ids, ws, mw, d_outs)


def _poison(peers: LocalPeers, t: int, k: int, h: int, dtype: torch.dtype) -> LocalPeers:
    """NaN in every rank's d_x and d_w combine buffers: a route never pushed back stays NaN."""
    peers.alloc("dx_comb", (t * k, h), dtype, fill=float("nan"))
    peers.alloc("dw_comb", (t * k,), torch.float32, fill=float("nan"))
    return peers


def _poisoned_peers(r: int, t: int, k: int, h: int, dtype: torch.dtype, device=DEV) -> LocalPeers:
    return _poison(LocalPeers(r, device), t, k, h, dtype)


def _backward(case: Case, inp: Inputs, config: KernelConfig | None = None, peers: LocalPeers | None = None,
              check: bool = True):
    """The backward megakernel over NaN-poisoned peers; shapes and dtypes of every gradient checked."""
    R, T, K, H = case.r, case.t, case.shape.k, case.shape.h
    if peers is None:
        peers = _poisoned_peers(R, T, K, H, case.dtype, inp.xs[0].device)
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                        config=config or case.config(), peers=peers)
    if check:
        res.check_errors()
    assert res.peers is peers
    assert len(res.d_x) == R and len(res.d_topk_weights) == R and len(res.errs) == R
    for r in range(R):
        assert res.d_x[r].shape == (T, H) and res.d_x[r].dtype == case.dtype, f"d_x[{r}]"
        assert res.d_topk_weights[r].shape == (T, K) and res.d_topk_weights[r].dtype == torch.float32, r
    for name, w in zip(GRAD_NAMES_WEIGHTS, inp.weights(), strict=True):
        g = getattr(res, name)
        if w is None:
            assert g is None, f"{name} without a shared expert"
        else:
            assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, name
    return res


def _named(res) -> dict[str, torch.Tensor]:
    """Every gradient of a ``MultirankBackward`` by name (the shared expert's only when it exists)."""
    out = {f"d_x[{r}]": g for r, g in enumerate(res.d_x)}
    out.update({f"d_topk_weights[{r}]": g for r, g in enumerate(res.d_topk_weights)})
    for name in GRAD_NAMES_WEIGHTS:
        if getattr(res, name) is not None:
            out[name] = getattr(res, name)
    return out


def _autograd(fn, case: Case, inp: Inputs, dtype: torch.dtype | None, **kw) -> dict[str, torch.Tensor]:
    """Gradients of sum_r <fn(...)[r], d_out[r]> w.r.t. fresh leaves (cast to ``dtype`` when given)."""
    def leaf(t):
        if t is None:
            return None
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        return t.requires_grad_(True)

    xs = [leaf(x) for x in inp.xs]
    ws = [leaf(w) for w in inp.ws]
    weights = [leaf(t) for t in inp.weights()]
    outs = fn(xs, inp.ids, ws, *weights, swiglu_limit=case.swiglu_limit, **kw)
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, inp.d_outs, strict=True))
    loss.backward()
    named = {f"d_x[{r}]": x.grad for r, x in enumerate(xs)}
    named.update({f"d_topk_weights[{r}]": w.grad for r, w in enumerate(ws)})
    for name, t in zip(GRAD_NAMES_WEIGHTS, weights, strict=True):
        if t is not None:
            named[name] = t.grad
    for name, g in named.items():
        assert g is not None, f"{name}: no gradient reached this input"
    return named


def _reference_grads64(case: Case, inp: Inputs, swiglu_limit="case") -> dict[str, torch.Tensor]:
    c = case if swiglu_limit == "case" else dataclasses.replace(case, swiglu_limit=swiglu_limit)
    return _autograd(moe_reference_multirank, c, inp, torch.float64, compute_dtype=torch.float64)


def _backend_grads(case: Case, inp: Inputs) -> dict[str, torch.Tensor]:
    return _autograd(moe_forward_multirank, case, inp, None, block_m=case.config().block_m)


def _assert_grad_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: str, rescale: bool) -> None:
    """``assert_close`` at ``tol``; with ``rescale``, both sides on the reference's RMS scale first.

    The rescale is tests/test_torch_backend.py's: the table's rtol/atol are absolute bounds meant for O(1)
    tensors, but a gradient is a sum over many rows (a weight gradient over every row its expert got, with terms
    that cancel) and bf16 rounding error grows with the terms, not with the result; so gradients are compared on
    the reference's RMS scale, per expert for the [E, ...] routed weight gradients. rel-L1 and cosine are
    scale-free and unaffected.
    """
    g, rg = got.double(), want.double()
    if rescale:
        dims = tuple(range(1, rg.dim())) if name in ("d_w13", "d_w2") else tuple(range(rg.dim()))
        scale = rg.pow(2).mean(dim=dims, keepdim=True).sqrt().clamp_min(1e-30)
        g, rg = g / scale, rg / scale
    assert_close(g, rg, tol, name)


def _route_grads64(case: Case, inp: Inputs, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank r's origin should receive per route t*K + j (fp64): the route's d_x row,
    d/dx[t] <d_out[t], w[t, j] * expert_e(x[t])>, and its router-weight gradient <d_out[t], expert_e(x[t])>.
    Routes with an expert id outside [0, E) are left NaN (never computed)."""
    T, K, H, E = case.t, case.shape.k, case.shape.h, case.shape.e
    w13, w2 = inp.mw.w13_E2IH.double(), inp.mw.w2_EHI.double()
    x, d_out = inp.xs[r].double(), inp.d_outs[r].double()
    ids, w = inp.ids[r].reshape(-1), inp.ws[r].double().reshape(-1)
    tok = torch.arange(T * K, device=ids.device) // K
    dx = torch.full((T * K, H), float("nan"), dtype=torch.float64, device=x.device)
    dw = torch.full((T * K,), float("nan"), dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        if not 0 <= e < E:
            continue
        sel = (ids == e).nonzero().flatten()
        xe = x[tok[sel]].clone().requires_grad_(True)
        y = swiglu_ffn(xe, w13[e], w2[e], case.swiglu_limit)
        dw[sel] = (y * d_out[tok[sel]]).sum(1).detach()
        (dx[sel],) = torch.autograd.grad((y * d_out[tok[sel]] * w[sel, None]).sum(), xe)
    return dx, dw


def _check_pushed_rows(case: Case, inp: Inputs, res, tol: str) -> None:
    """The peers' combine buffers after the run: every valid route's d_x row and d_w at its origin's slot t*K+j
    (the per-route values, so a row pushed to the wrong slot fails), the invalid routes untouched (still NaN),
    and the epilogue's d_topk_weights equal to the pushed d_w bit for bit (0 for invalid routes)."""
    E = case.shape.e
    for r in range(case.r):
        dxc = res.peers.buffer("dx_comb", r)
        dwc = res.peers.buffer("dw_comb", r)
        ids = inp.ids[r].reshape(-1)
        valid = (ids >= 0) & (ids < E)
        unwritten = (~torch.isfinite(dxc[valid])).any(dim=1) | ~torch.isfinite(dwc[valid])
        assert not unwritten.any(), \
            f"rank {r}: routes (t*K+j) never pushed back: {valid.nonzero().flatten()[unwritten].tolist()}"
        assert torch.isnan(dxc[~valid]).all() and torch.isnan(dwc[~valid]).all(), \
            f"rank {r}: a route with an out-of-range expert id was written"
        want_dx, want_dw = _route_grads64(case, inp, r)
        _assert_grad_close(f"dx_comb[{r}]", dxc[valid].float(), want_dx[valid], tol, rescale=tol != "fp32")
        _assert_grad_close(f"dw_comb[{r}]", dwc[valid], want_dw[valid], tol, rescale=tol != "fp32")
        dtw = res.d_topk_weights[r].reshape(-1)
        assert_bitwise_equal(dtw[valid], dwc[valid], f"d_topk_weights[{r}] vs pushed d_w")
        assert torch.all(dtw[~valid] == 0), f"d_topk_weights[{r}]: nonzero gradient for an out-of-range id"


def _used_experts(case: Case, inp: Inputs) -> torch.Tensor:
    used = torch.zeros(case.shape.e, dtype=torch.bool)
    for i in inp.ids:
        i = i.flatten().cpu()
        used[i[(i >= 0) & (i < case.shape.e)]] = True
    return used


# ----------------------------------------------------------------------------- accuracy

MATCH_CASES = {
    # one rank: the schedule is a local sort, every pull and push stays on the rank itself
    "R1-T16": Case(TINY, r=1, t=16),
    # two ranks, balanced load: pulls of x, d_out and w from both origins, pushes back to both
    "R2-T16": Case(TINY, r=2, t=16),
    # four ranks (E_local=2), balanced load
    "R4-T8": Case(TINY, r=4, t=8),
    # zero-token experts and zero-row ranks: only experts 0..2 are chosen, so ranks 2 and 3 own no row (no
    # minibatch is live there: their d_w13/d_w2 come only from empty weight-gradient loops and must be exactly 0)
    "R4-zero-token-experts": Case(TINY, r=4, t=10, routing="few_experts"),
    # all tokens to one expert: every first route to the last expert (rank 1), every second to expert 0
    # (rank 0, ids wrap mod E); each segment holds R*T = 40 rows over three minibatches, so an expert's weight
    # gradient waits on several minibatches and sums rows across minibatch boundaries
    "R2-one-hot": Case(TINY, r=2, t=20, routing="one_hot", hot=TINY.e - 1),
    # K=1 one-hot: literally every route of every rank to expert 5 (rank 1 of 2); rank 0 gets no row; the
    # epilogue sums a single term
    "R2-one-hot-K1": Case(TINY.with_(k=1), r=2, t=20, routing="one_hot", hot=5),
    # K=1 with balanced load
    "R2-K1": Case(TINY.with_(k=1), r=2, t=16),
    # skewed (zipf) load: a few experts take most rows, many segments are one partial tile
    "R2-zipf": Case(TINY, r=2, t=16, routing="zipf"),
    # T=7, not a multiple of block_m: partial shared-expert row tile (phase A, phase B and its weight gradient),
    # every expert segment one partial tile
    "R2-T7": Case(TINY, r=2, t=7),
    # SwiGLU clamp active (limit 0.3 << the O(1) pre-activations): the backward must zero dg where gate > L
    # and du where |up| > L, routed and shared
    "R2-swiglu-limit-0.3": Case(TINY, r=2, t=16, swiglu_limit=0.3),
    # the K=4 shape (I=24: two I tiles, the second partial; H=48: two H tiles) with its own clamp (1.5) and
    # skewed load
    "R2-swiglu-limit-1.5-zipf-K4": Case(TINY_SIG, r=2, t=5, routing="zipf", swiglu_limit=1.5),
    # no shared expert: d_x is the routed sum only, no shared gradients returned
    "R2-no-shared": Case(TINY, r=2, t=16, shared=False),
    # minibatch 32 (two row tiles per handoff) and one communication program pulling and pushing every chunk
    "R2-mb32-comm1": Case(TINY, r=2, t=16, minibatch=32, comm=1),
    # bf16 operands (the interpreter casts dot operands to fp32; d_gate|up, w*h, d_x rows rounded to bf16),
    # skewed load, against the fp64 reference at the bf16 tolerance (gradients on the reference's RMS scale)
    "R2-bf16-zipf": Case(TINY, r=2, t=16, routing="zipf", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(MATCH_CASES))
def test_grads_match_reference_and_torch_backend(name):
    case = MATCH_CASES[name]
    assert case.shape.e % case.r == 0
    inp = _make_inputs(case)
    res = _backward(case, inp)
    got = _named(res)
    ref = _reference_grads64(case, inp)
    backend = _backend_grads(case, inp)
    assert sorted(got) == sorted(ref) == sorted(backend)
    tol = "fp32" if case.dtype == torch.float32 else "bf16"
    for gname, g in got.items():
        _assert_grad_close(gname, g, ref[gname], tol, rescale=tol != "fp32")
        _assert_grad_close(f"{gname} vs torch backend", g, backend[gname].double(), tol, rescale=tol != "fp32")
    _check_pushed_rows(case, inp, res, tol)

    # Experts that received no token get exactly zero weight gradient, every used one a nonzero one (nothing
    # dropped, nothing invented).
    used = _used_experts(case, inp).to(res.d_w13.device)
    if case.routing in ("few_experts", "one_hot"):
        assert not used.all()
    for gname in ("d_w13", "d_w2"):
        g = getattr(res, gname)
        assert torch.all(g[~used] == 0), f"{gname}: nonzero gradient on experts that got no token"
        assert torch.all(g[used].abs().sum(dim=(1, 2)) > 0), f"{gname}: a used expert got zero gradient"


def _clamp_activity(case: Case, inp: Inputs) -> dict[str, bool]:
    """Whether gate > L and |up| > L occur, over the routes actually taken and in the shared expert."""
    i, lim = case.shape.i, case.swiglu_limit
    w13 = inp.mw.w13_E2IH.double().cpu()
    hit = {"routed gate": False, "routed up": False}
    if case.shared:
        hit.update({"shared gate": False, "shared up": False})
    for x, idx in zip(inp.xs, inp.ids, strict=True):
        x = x.double().cpu()
        gu = torch.einsum("th,tkoh->tko", x, w13[idx.cpu()])
        hit["routed gate"] |= bool((gu[..., :i] > lim).any())
        hit["routed up"] |= bool((gu[..., i:].abs() > lim).any())
        if case.shared:
            s = inp.mw.shared_w2_HS.shape[1]
            sgu = x @ inp.mw.shared_w13_2SH.double().cpu().t()
            hit["shared gate"] |= bool((sgu[:, :s] > lim).any())
            hit["shared up"] |= bool((sgu[:, s:].abs() > lim).any())
    return hit


@pytest.mark.parametrize("name", [n for n, c in MATCH_CASES.items() if c.swiglu_limit is not None])
def test_swiglu_limit_cases_clamp(name):
    """The clamp cases above would prove nothing if no element reached the limit (reference only, no kernel)."""
    case = MATCH_CASES[name]
    inp = _make_inputs(case)
    hit = _clamp_activity(case, inp)
    idle = [k for k, v in hit.items() if not v]
    assert not idle, f"clamp at L={case.swiglu_limit} never active for: {idle}"
    clamped, free = _reference_grads64(case, inp), _reference_grads64(case, inp, swiglu_limit=None)
    for gname in ("d_x[0]", "d_w13", "d_shared_w13"):
        assert (clamped[gname] - free[gname]).abs().max() > 1e-3, f"{gname}: the clamp changes no gradient"


@pytest.mark.parametrize("name", [
    "R2-T16",  # balanced load: every expert's last row tile is partly padding
    "R4-zero-token-experts",  # whole ranks and experts without rows
])
def test_scratch_buffers_poisoned_with_nan(name, monkeypatch):
    """Every float scratch buffer the backward launcher allocates (pulled rows, d(gate|up), w*h, d_x rows,
    shared-expert buffers, weight gradients) starts as NaN: a row the kernels read without writing first
    (schedule padding in the weight-gradient sums, for one) or a gradient they never write shows as NaN."""
    case = MATCH_CASES[name]
    inp = _make_inputs(case)
    nan_scratch(monkeypatch)
    got = _named(_backward(case, inp))
    monkeypatch.undo()
    ref = _reference_grads64(case, inp)
    for gname, g in got.items():
        assert torch.isfinite(g).all(), f"{gname}: NaN from an unwritten scratch row"
        _assert_grad_close(gname, g, ref[gname], "fp32", rescale=False)


# ----------------------------------------------------------------------------- resident forward activations

RESIDENT_CASES = {
    # R=1 with a shared expert, fp32: the plainest resident path
    "r1": Case(TINY, r=1, t=24),
    # R=2, clamp, two I tiles of which the second is partial (TINY_SIG's I=24): gate|up read back per tile
    "r2-sig-limit": Case(TINY_SIG, r=2, t=20, swiglu_limit=0.5),
    # R=4, experts 0..2 only: ranks that receive no row, zero-token experts, padding-heavy tiles
    "r4-few": Case(TINY, r=4, t=12, routing="few_experts"),
    # bf16 rows (gate|up kept in bf16: the replay rounds g and u the same way)
    "bf16": Case(TINY_SIG, r=2, t=20, dtype=torch.bfloat16),
    # I = 32 = 2 x the half-width tile: the routed phase A takes one 32-wide GEMM tile and runs its SwiGLU
    # backward in two 16-wide halves (d_w partials of both halves), fp32
    "r2-wide": Case(TINY.with_(i=32), r=2, t=16),
    # the same wide tile in bf16 with the clamp active, and two wide tiles (I = 64)
    "wide-bf16-limit": Case(TINY.with_(i=64), r=2, t=20, dtype=torch.bfloat16, swiglu_limit=0.5),
}


def _forward_saved(case: Case, inp: Inputs, config: KernelConfig, peers: LocalPeers):
    f = megakernel_forward_multirank(inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit, config=config,
                                     peers=peers, save_for_backward=True)
    f.check_errors()
    return f


def _kept_grads(case: Case, inp: Inputs, config: KernelConfig) -> dict[str, torch.Tensor]:
    """Every gradient (named, cloned) of the backward that reads the forward's kept activations, both on fresh
    peers on the inputs' device."""
    peers = LocalPeers(case.r, inp.xs[0].device)
    saved = _forward_saved(case, inp, config, peers).saved()
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                        config=config, peers=peers, saved=saved)
    res.check_errors()
    return {k: v.clone() for k, v in _named(res).items()}


@pytest.mark.parametrize("name", list(RESIDENT_CASES))
def test_resident_backward_matches_replay(name, monkeypatch):
    """forward(save_for_backward=True) then backward(saved=forward.saved()) reads the forward's routed x rows and gate|up
    pre-activations instead of pulling x again and replaying the GEMM. Every float buffer either launcher
    allocates starts NaN, so padding rows of x_routed the forward left unwritten (the weight gradients sum them)
    or a gate|up tile it did not store show up. Gradients: equal to the replaying backward (bit for bit under the
    interpreter, whose fp32 accumulators agree; within tolerance on a GPU, whose forward and replay tiles
    differ) and close to the fp64 reference."""
    case = RESIDENT_CASES[name]
    inp = _make_inputs(case, seed=5)
    cfg = case.config()
    nan_scratch(monkeypatch)
    peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
    fwd = _forward_saved(case, inp, cfg, peers)
    assert all(st.ring.resident and st.gate_up is not None for st in fwd.states)
    _poison(peers, case.t, case.shape.k, case.shape.h, case.dtype)
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                        config=cfg, peers=peers, saved=fwd.saved())
    res.check_errors()
    monkeypatch.undo()
    got = _named(res)
    replay = _named(_backward(case, inp))
    # (bf16 with a clamp: the kept bf16 gate|up's mask flips; the tolerance entry gives the measured numbers)
    tol = "fp32" if case.dtype == torch.float32 else "bf16-clamp" if case.swiglu_limit else "bf16"
    ref = _reference_grads64(case, inp)
    for gname, g in got.items():
        assert torch.isfinite(g).all(), f"{gname}: NaN from an unwritten row"
        if not HAS_CUDA:
            assert_bitwise_equal(g, replay[gname], f"{gname}: resident vs replay")
        _assert_grad_close(gname, g, replay[gname].double(), tol, rescale=tol != "fp32")
        _assert_grad_close(gname, g, ref[gname], tol, rescale=tol != "fp32")


@pytest.mark.parametrize("name", ["r2-sig-limit", "r4-few"])  # two ranks and a partial I tile; four, some empty
def test_backward_reads_the_forward_schedule(name):
    """backward(schedules=[each rank's forward schedule]) builds none and gives every gradient bit for bit as
    the backward that builds its own; a schedule of another rank is refused before any launch."""
    case = RESIDENT_CASES[name]
    inp = _make_inputs(case, seed=9)
    cfg = case.config()
    peers = LocalPeers(case.r, inp.xs[0].device)
    fwd = _forward_saved(case, inp, cfg, peers)
    args = (inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit)
    built = {k: v.clone() for k, v in _named(megakernel_backward_multirank(
        *args, config=cfg, peers=peers, saved=fwd.saved())).items()}
    res = megakernel_backward_multirank(*args, config=cfg, peers=peers, saved=fwd.saved(),
                                        schedules=[st.schedule for st in fwd.states])
    res.check_errors()
    for gname, g in _named(res).items():
        assert_bitwise_equal(g, built[gname], f"{gname}: the forward's schedule vs one built again")
    swapped = [fwd.states[1].schedule, fwd.states[0].schedule, *(st.schedule for st in fwd.states[2:])]
    with pytest.raises(ValueError, match="schedule was built for rank 1"):
        megakernel_backward_multirank(*args, config=cfg, peers=peers, saved=fwd.saved(), schedules=swapped)


@pytest.mark.parametrize("t", [16, 40])  # a ring that wraps at run time (40 tokens), one that does not (16)
def test_wrapping_ring_keeps_macrobatch_zero(t, monkeypatch):
    """A 32-row ring (macrobatch 32 < the capacity): the forward runs its macrobatches last to first, so the ring
    ends holding macrobatch 0 = routed rows [0, 32). The backward reads their gate|up and replays the others'
    (pulling x for every row); every scratch buffer starts NaN. Gradients: the plain replaying backward's, bit
    for bit under the interpreter (within tolerance on a GPU)."""
    case = Case(TINY, r=2, t=t)
    inp = _make_inputs(case, seed=6)
    cfg = case.config().with_(macrobatch_size=32)
    nan_scratch(monkeypatch)
    peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
    fwd = _forward_saved(case, inp, cfg, peers)
    assert all(not st.ring.resident and st.gate_up.shape == (32, 2 * TINY.i) for st in fwd.states)
    _poison(peers, case.t, case.shape.k, case.shape.h, case.dtype)
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=cfg,
                                        peers=peers, saved=fwd.saved())
    res.check_errors()
    monkeypatch.undo()
    plain = _named(_backward(case, inp, config=cfg))
    ref = _reference_grads64(case, inp)
    for gname, g in _named(res).items():
        assert torch.isfinite(g).all(), f"{gname}: NaN from an unwritten row"
        if not HAS_CUDA:
            assert_bitwise_equal(g, plain[gname], gname)
        _assert_grad_close(gname, g, ref[gname], "fp32", rescale=False)


@pytest.mark.parametrize("case", [
    Case(TINY, r=1, t=24),  # S = 16 = one phase-A tile's width: the kept shared tiles stay narrow
    Case(TINY_SIG, r=2, t=20, swiglu_limit=0.5),  # S = 24, not a multiple of 16: a partial column tile; T = 20
    # S = 64: 32-wide kept shared tiles (two 16-wide halves each), bf16, T = 20 with a partial last row tile
    Case(TINY.with_(i=64), r=2, t=20, dtype=torch.bfloat16),
])
def test_forward_keeps_the_shared_gate_up(case, monkeypatch):
    """save_for_backward keeps the shared expert's gate|up pre-activations in x's dtype, every token's (scratch starts
    NaN, so a row or column tile never stored shows), as x @ shared_w13^T computes them; the backward reads
    them (its shared phase A then skips the replay) and gives the replaying backward's shared gradients (bit
    for bit under the interpreter, within tolerance on a GPU)."""
    inp = _make_inputs(case, seed=9)
    cfg = case.config()
    nan_scratch(monkeypatch)
    fwd = _forward_saved(case, inp, cfg, LocalPeers(case.r, DEV))
    monkeypatch.undo()
    sw13 = inp.mw.shared_w13_2SH
    for r, st in enumerate(fwd.states):
        sgu = fwd.saved()[r][2]
        assert sgu is st.shared_gate_up and sgu.dtype == case.dtype and sgu.shape == (case.t, sw13.shape[0])
        assert torch.isfinite(sgu).all(), f"rank {r}: shared gate|up rows or columns never stored"
        want = inp.xs[r].double() @ sw13.double().T
        assert_close(sgu.double(), want, "fp32" if case.dtype == torch.float32 else "bf16", f"shared gate|up[{r}]")
    got = _named(megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(),
                                               case.swiglu_limit, config=cfg, saved=fwd.saved()))
    replay = _named(_backward(case, inp))
    for gname in ("d_shared_w13", "d_shared_w2", *(n for n in got if n.startswith("d_x"))):
        if not HAS_CUDA:
            assert_bitwise_equal(got[gname], replay[gname], f"{gname}: kept vs replayed shared gate|up")
        _assert_grad_close(gname, got[gname], replay[gname].double(), "fp32" if case.dtype == torch.float32
                           else "bf16", rescale=case.dtype != torch.float32)
    # The backward reads the kept tensor rather than replaying: zeroed, the shared hidden is silu(0) * 0 = 0,
    # so d_shared_w2 = d_out^T h is exactly zero.
    zeroed = [(xr, gu, torch.zeros_like(sgu)) for xr, gu, sgu in fwd.saved()]
    z = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                      config=cfg, saved=zeroed)
    assert torch.all(z.d_shared_w2 == 0) and torch.any(replay["d_shared_w2"] != 0)


def test_forward_without_a_shared_expert_keeps_no_shared_gate_up():
    """No shared expert: nothing kept for it (None in saved()), and the backward takes that."""
    case = Case(TINY, r=1, t=12, shared=False)
    inp = _make_inputs(case, seed=10)
    fwd = _forward_saved(case, inp, case.config(), LocalPeers(1, DEV))
    assert fwd.states[0].shared_gate_up is None and fwd.saved()[0][2] is None
    res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None,
                                        config=case.config(), saved=fwd.saved())
    res.check_errors()
    assert res.d_shared_w13 is None


def test_saved_shared_gate_up_checked():
    """The saved tuple's shared entry must be the forward's [T, 2S] tensor in x's dtype or None (the backward
    replays the shared gate|up: the replaying backward's bits), and None without a shared expert; a 2-tuple of an
    older form is refused by name."""
    case = Case(TINY, r=1, t=24)
    inp = _make_inputs(case, seed=7)
    fwd = _forward_saved(case, inp, case.config(), LocalPeers(1, DEV))
    x_routed, gate_up, sgu = fwd.saved()[0]
    args = (inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None)
    for bad, match in (((x_routed, gate_up), r"saved must be the forward's \(x_routed, gate_up, shared_gate_up\)"),
                       ((x_routed, gate_up, sgu[:12]), r"saved shared_gate_up must be None or a contiguous torch.float32 "
                                                       r"tensor of shape \(24, 32\).*got \(12, 32\)"),
                       ((x_routed, gate_up, sgu.double()), r"got \(24, 32\) torch.float64")):
        with pytest.raises(ValueError, match=match):
            megakernel_backward_multirank(*args, config=case.config(), saved=[bad])
    no_shared = Case(TINY, r=1, t=24, shared=False)
    inp2 = _make_inputs(no_shared, seed=7)
    half = megakernel_backward_multirank(*args, config=case.config(), saved=[(x_routed, gate_up, None)])
    replay = _named(_backward(case, inp))
    for gname, g in _named(half).items():
        if not HAS_CUDA:
            assert_bitwise_equal(g, replay[gname], f"{gname}: routed rows kept, shared replayed")
        _assert_grad_close(gname, g, replay[gname].double(), "fp32", rescale=False)
    with pytest.raises(ValueError, match="saved shared_gate_up must be None without a shared expert"):
        megakernel_backward_multirank(inp2.d_outs, inp2.xs, inp2.ids, inp2.ws, *inp2.weights(), None,
                                      config=case.config(), saved=[(x_routed, gate_up, sgu)])


def test_saved_activations_of_another_config_rejected():
    """A forward run with a larger minibatch has a routed buffer taller than the backward's rows: refused, with
    the bound, instead of reading rows that do not line up."""
    case = Case(TINY, r=1, t=24)
    inp = _make_inputs(case, seed=7)
    peers = LocalPeers(1, DEV)
    fwd = _forward_saved(case, inp, case.config().with_(minibatch_size=32), peers)
    # capacity 24*2 routes + 8 experts * 15 padding rows = 168 -> 176 rows in 16-row minibatches (192 in 32-row)
    with pytest.raises(ValueError, match=r"saved x_routed must be the forward's \[MAC, H\] ring with 0 < MAC <= 176"):
        megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None,
                                      config=case.config(), peers=peers, saved=fwd.saved())
    with pytest.raises(ValueError, match="saved holds 1 ranks' activations, the backward runs 2 ranks"):
        two = Case(TINY, r=2, t=24)
        inp2 = _make_inputs(two, seed=7)
        megakernel_backward_multirank(inp2.d_outs, inp2.xs, inp2.ids, inp2.ws, *inp2.weights(), None,
                                      config=two.config(), peers=LocalPeers(2, DEV), saved=fwd.saved())


def test_no_route_entries_are_padding():
    """Routing entries equal to NO_ROUTE (an EP rank's padding tokens: SymmetricPeers(max_tokens=...)) are no
    route: no error flag, no row computed, output and gradients those of the same routes with weight 0, and a
    router-weight gradient of exactly 0. Rank 1's last four tokens are all padding; one route of rank 0 too."""
    from kittenmoe.schedule import NO_ROUTE

    case = Case(TINY, r=2, t=12, swiglu_limit=0.5)
    inp = _make_inputs(case, seed=8)
    pad = [torch.zeros_like(i, dtype=torch.bool) for i in inp.ids]
    pad[1][8:] = True
    pad[0][3, 1] = True
    ids = [torch.where(p, NO_ROUTE, i) for p, i in zip(pad, inp.ids, strict=True)]
    padded = dataclasses.replace(inp, ids=ids)
    # the same problem without NO_ROUTE: any valid expert with router weight 0
    ref_inp = dataclasses.replace(inp, ids=[torch.where(p, 0, i) for p, i in zip(pad, inp.ids, strict=True)],
                                  ws=[torch.where(p, 0.0, w) for p, w in zip(pad, inp.ws, strict=True)])
    fwd = megakernel_forward_multirank(padded.xs, padded.ids, padded.ws, *padded.weights(), case.swiglu_limit,
                                       config=case.config())
    fwd.check_errors()  # NO_ROUTE is not an invalid expert id
    want = moe_reference_multirank([x.double() for x in ref_inp.xs], ref_inp.ids, [w.double() for w in ref_inp.ws],
                                   *[t.double() for t in ref_inp.weights()], swiglu_limit=case.swiglu_limit,
                                   compute_dtype=torch.float64)
    for r in range(case.r):
        assert_close(fwd.outputs[r].double(), want[r], "fp32", f"out[{r}]")
    got = _named(_backward(case, dataclasses.replace(padded, ws=ref_inp.ws)))
    ref = _reference_grads64(case, ref_inp)
    for gname, g in got.items():
        if gname.startswith("d_topk_weights"):
            r = int(gname[-2])
            assert torch.all(g[pad[r]] == 0), f"{gname}: nonzero gradient for a NO_ROUTE entry"
            _assert_grad_close(gname, g[~pad[r]], ref[gname][~pad[r]], "fp32", rescale=False)
        else:
            _assert_grad_close(gname, g, ref[gname], "fp32", rescale=False)


# ----------------------------------------------------------------------------- bitwise determinism

BITWISE_BASE = Case(TINY, r=2, t=16, routing="zipf", swiglu_limit=0.5)

# Config variants that must leave every gradient bit-for-bit unchanged: each d_x row and router-weight gradient
# is one row's arithmetic (its I-tile partial sums reduced in tile order), and each weight-gradient element is
# summed by one program over its expert's rows in row order, rows fixed by the schedule (which depends on
# block_m only). Neither depends on the minibatch grain or on how many programs communicate. Every variant
# differs from BITWISE_BASE's config (minibatch 16, 2 communication programs).
BITWISE_VARIANTS = {
    # minibatch 32: two row tiles per handoff instead of one
    "minibatch-32": dict(minibatch_size=32),
    # one communication program
    "comm-1": dict(num_comm_programs_bwd=1),
    # three communication programs
    "comm-3": dict(num_comm_programs_bwd=3),
    # weight gradients from 3 persistent programs walking every tile (KernelConfig.wgrad="persistent")
    "wgrad-persistent": dict(wgrad="persistent"),
}


@pytest.fixture(scope="module")
def bitwise_base():
    inp = _make_inputs(BITWISE_BASE, seed=3)
    res = _backward(BITWISE_BASE, inp)
    base = {k: v.clone() for k, v in _named(res).items()}
    for k, v in base.items():
        assert torch.isfinite(v).all(), k
    return inp, base, res.peers


def test_bitwise_repeatable(bitwise_base):
    """Same inputs and config, run again through the same peers (combine buffers re-poisoned): same bits."""
    inp, base, peers = bitwise_base
    c = BITWISE_BASE
    _poison(peers, c.t, c.shape.k, c.shape.h, c.dtype)
    res = _backward(c, inp, peers=peers)
    got = _named(res)
    assert sorted(got) == sorted(base)
    for k in base:
        assert_bitwise_equal(got[k], base[k], k)


@pytest.mark.parametrize("group,keep", [
    (1, False),  # one row tile at a time; phase A replays (three 16-wide tiles of I = 48)
    (2, True),  # a group of two row tiles and a last one of one; phase A kept (I = 48 is not 2 x 16-wide: narrow)
    (2, False),  # the same order with replay
    (-1, True),  # each expert's run of row tiles a group; phase A kept
    (-1, False),  # the same order with replay
])
def test_tile_group_order_same_bits(group, keep):
    """KernelConfig.tile_group_m: the backward's gradients do not depend on the order of a minibatch's phase-A
    and phase-B tiles (H = 64: two phase-B tiles of 32; I = 48: three phase-A tiles; minibatch 48 = three row
    tiles)."""
    case = Case(TINY.with_(h=64, i=48), r=2, t=24)
    inp = _make_inputs(case, seed=12)
    cfg = case.config().with_(minibatch_size=48)

    def run(c):
        peers = _poisoned_peers(case.r, case.t, case.shape.k, case.shape.h, case.dtype)
        saved = _forward_saved(case, inp, c, peers).saved() if keep else None
        res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                            config=c, peers=peers, saved=saved)
        res.check_errors()
        return {k: v.clone() for k, v in _named(res).items()}

    base = run(cfg)
    got = run(cfg.with_(tile_group_m=group))
    for k in base:
        assert torch.isfinite(got[k]).all(), k
        assert_bitwise_equal(got[k], base[k], f"{k}, tile_group_m={group}")


@pytest.mark.parametrize("variant", list(BITWISE_VARIANTS))
def test_bitwise_across_configs(bitwise_base, variant):
    inp, base, _ = bitwise_base
    cfg = BITWISE_BASE.config().with_(**BITWISE_VARIANTS[variant])
    got = _named(_backward(BITWISE_BASE, inp, config=cfg))
    assert sorted(got) == sorted(base)
    for k in base:
        assert_bitwise_equal(got[k], base[k], f"{k} with {variant}")


@pytest.mark.parametrize("persistent", [False, True])
def test_wgrad_sums_rows_up_to_rounded_counts(persistent):
    """The weight-gradient kernels sum group g's rows from offsets[g] up to its real rows counts[g] rounded up to
    the row step, at most to its segment's end, and nothing past: an expert's padding past the last step it
    needs is never read, and the shared expert's one group [0, T) stops at T. Rows past each end hold NaN
    here; group 1 has no rows (its gradient is zeros), group 2 ends mid-segment, group 3's rounded count
    (16) runs past its segment (7 rows, the last of the operands)."""
    wn, wm, wk, n, m = 16, 32, 16, 16, 32
    offsets = torch.tensor([0, 48, 64, 112, 119], dtype=torch.int32, device=DEV)  # segments of 48, 16, 48, 7 rows
    counts = torch.tensor([25, 0, 9, 7], dtype=torch.int32, device=DEV)  # 2 steps, none, 1 step, 7 rows
    g = torch.Generator().manual_seed(17)
    p_op = torch.randn(119, n, generator=g).to(DEV)
    q_op = torch.randn(119, m, generator=g).to(DEV)
    for lo, hi in ((32, 48), (80, 112)):  # the rows past each end
        p_op[lo:hi] = float("nan")
        q_op[lo:hi] = float("nan")
    out = torch.full((4, n, m), float("nan"), device=DEV)
    meta = dict(WN=wn, WM=wm, WK=wk, USE_TMA=False, DOT_FP32=True, PRECISION="ieee")
    order = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)  # the order tiles are taken in: any permutation
    if persistent:
        mb.weight_grad_persistent_kernel[(2,)](order, offsets, counts, p_op, q_op, out, out, n, m, n, m, 4,
                                               TMA_STORE=False, **meta)
    else:
        mb.weight_grad_kernel[(4,)](order, offsets, counts, p_op, q_op, out, n, m, n, m, **meta)
    for gi, (lo, hi) in enumerate(((0, 32), (48, 48), (64, 80), (112, 119))):
        want = p_op[lo:hi].double().T @ q_op[lo:hi].double()
        assert torch.isfinite(out[gi]).all(), f"group {gi} read a row past its end"
        torch.testing.assert_close(out[gi].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("progs", [
    1,  # one program takes every tile, waves of one (nothing to reverse)
    3,  # 12 tiles: four full waves, the odd ones reversed
    5,  # two full waves and a partial third (kept in slot order)
    8,  # one full wave and a partial second: the partial odd wave is not reversed
    13,  # more programs than tiles: one tile or none each
])
def test_wgrad_persistent_takes_every_tile_once(progs):
    """The persistent weight-gradient kernel over groups taken in a given order (a permutation, as the launcher's
    most-rows-first sort gives) with odd waves reversed: every tile of every group is written once with its own
    group's sum (output NaN-poisoned first), whatever the number of programs."""
    wn, wm, wk, n, m = 16, 16, 16, 32, 32  # 2 x 2 tiles a group
    counts = [16, 48, 0]
    offsets = torch.tensor([0, 16, 64, 64], dtype=torch.int32, device=DEV)
    order = torch.tensor([1, 0, 2], dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(23)
    p_op = torch.randn(64, n, generator=g).to(DEV)
    q_op = torch.randn(64, m, generator=g).to(DEV)
    out = torch.full((3, n, m), float("nan"), device=DEV)
    tiles = 3 * 2 * 2
    mb.weight_grad_persistent_kernel[(min(progs, tiles),)](order, offsets, torch.tensor(counts, dtype=torch.int32,
                                                                                        device=DEV),
                                                           p_op, q_op, out, out, n, m, n, m,
                                                           tiles, TMA_STORE=False, WN=wn, WM=wm, WK=wk,
                                                           USE_TMA=False, DOT_FP32=True, PRECISION="ieee")
    for gi, c in enumerate(counts):
        lo = int(offsets[gi])
        want = p_op[lo:lo + c].double().T @ q_op[lo:lo + c].double()
        assert torch.isfinite(out[gi]).all(), f"group {gi}: a tile never written with {progs} programs"
        torch.testing.assert_close(out[gi].double(), want, rtol=1e-5, atol=1e-5)


WGRAD_PERSISTENT_CASES = {
    # four ranks, experts 0..2 only: ranks 2 and 3 own no row, so every group of theirs is empty and its tiles
    # take one step of zeros; rank 1 mixes empty and full groups within one program's walk
    "R4-zero-token-experts": Case(TINY, r=4, t=10, routing="few_experts"),
    # T = 7: the shared expert's one group ends mid-step (rows past T load as zeros)
    "R2-T7": Case(TINY, r=2, t=7),
    # one hot expert: a 40-row segment of several steps beside empty groups
    "R2-one-hot": Case(TINY, r=2, t=20, routing="one_hot", hot=TINY.e - 1),
}


@pytest.mark.parametrize("name", list(WGRAD_PERSISTENT_CASES))
def test_wgrad_persistent_same_bits(name, monkeypatch):
    """KernelConfig.wgrad="persistent": every weight gradient the same bits as one program per tile, every
    tile written (the launchers' buffers start NaN), the other gradients untouched."""
    case = WGRAD_PERSISTENT_CASES[name]
    inp = _make_inputs(case, seed=9)
    plain = {k: v.clone() for k, v in _named(_backward(case, inp)).items()}
    nan_scratch(monkeypatch)
    got = _named(_backward(case, inp, config=case.config().with_(wgrad="persistent")))
    monkeypatch.undo()
    assert sorted(got) == sorted(plain)
    for k in plain:
        assert torch.isfinite(got[k]).all(), f"{k}: NaN from an unwritten tile"
        assert_bitwise_equal(got[k], plain[k], f"{name}: {k}")


# ----------------------------------------------------------------------------- out-of-range expert ids

BAD_ID_CASE = Case(TINY, r=2, t=256 if HAS_CUDA else 8)


@pytest.fixture(scope="module")
def bad_id_run():
    """ids == E on rank 0 and ids == -1 on rank 1, the rest valid; run without raising."""
    case = BAD_ID_CASE
    inp = _make_inputs(case, seed=5)
    inp.ids[0][3, 1] = case.shape.e  # one past the last expert
    inp.ids[1][5, 0] = -1
    res = _backward(case, inp, check=False)
    return case, inp, res


def test_out_of_range_expert_ids_flagged(bad_id_run):
    """Out-of-range ids pass the metadata checks (no error before the launch) and are reported through the
    backward's error flag on every rank, as the forward reports them (docs/design.md "Invariants and errors")."""
    case, inp, res = bad_id_run
    for r, err in enumerate(res.errs):
        code = int(err.max())
        assert not code & mk.ERR_TIMEOUT, f"rank {r}: a bad id must not cause a timeout (err={code})"
        assert code & mk.ERR_BAD_EXPERT_ID, f"rank {r}: err={code}"
        with pytest.raises(MegakernelError, match="outside"):
            launch_common.check_errors(err)
    with pytest.raises(MegakernelError, match="expert ids"):
        res.check_errors()


def test_out_of_range_expert_ids_leave_valid_routes_intact(bad_id_run):
    """Only the bad routes are dropped: their router-weight gradient is exactly 0, their combine rows are never
    written (still NaN, yet d_x stays finite), and every gradient equals the reference's, in which a route with
    an id outside [0, E) contributes nothing."""
    case, inp, res = bad_id_run
    assert res.d_topk_weights[0][3, 1] == 0 and res.d_topk_weights[1][5, 0] == 0
    _check_pushed_rows(case, inp, res, "fp32")
    got, ref = _named(res), _reference_grads64(case, inp)
    for gname, g in got.items():
        _assert_grad_close(gname, g, ref[gname], "fp32", rescale=False)


# ----------------------------------------------------------------------------- spin-wait timeout

# Each omits one producer role, so one of the backward's four bounded waits never sees its counter reach the
# target (docs/design.md "Invariants and errors": no deadlock).
TIMEOUT_MISSING_PHASE = {
    # no pull: phase A waits on pull_ready for d_out / x rows that never arrive
    "no-pull": mb.PB_PULL,
    # no phase A (down dgrad + SwiGLU backward): phase B waits on a_ready
    "no-phase-a": mb.PB_A,
    # no phase B (gate|up dgrad): the push waits on b_ready
    "no-phase-b": mb.PB_B,
    # no shared-expert phase A: the shared phase B waits on sa_ready
    "no-shared-a": mb.PB_SHARED_A,
}


@pytest.mark.parametrize("name", list(TIMEOUT_MISSING_PHASE))
def test_spin_wait_timeout_flagged_without_hang(name):
    """bf16, two ranks, max_spin = 50 polls, one producer role left out: every rank's error flag says timeout
    (not a bad id), ``check_errors`` raises "timed out", and the call returns (bounded waits, no hang). Under the
    interpreter the same max_spin with every phase reports nothing: the timeout comes from the missing producer."""
    case = Case(TINY, r=2, t=8, dtype=torch.bfloat16)
    inp = _make_inputs(case, seed=9)
    args = (inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None)
    if not HAS_CUDA:
        # Under the interpreter every producer finishes before its consumer starts, so 50 polls are plenty when
        # nothing is left out (on a GPU the roles run concurrently and a legitimate wait may need more polls).
        megakernel_backward_multirank(*args, config=case.config(), max_spin=50).check_errors()
    t0 = time.monotonic()
    res = megakernel_backward_multirank(*args, config=case.config(), max_spin=50,
                                        phases=mb.PB_ALL & ~TIMEOUT_MISSING_PHASE[name])
    codes = [int(e.max()) for e in res.errs]  # syncs on CUDA: the launches have returned
    assert time.monotonic() - t0 < 120, "the bounded wait took far too long"
    for r, code in enumerate(codes):
        assert code & mk.ERR_TIMEOUT, f"rank {r}: err={code}"
        assert not code & mk.ERR_BAD_EXPERT_ID, f"rank {r}: a timeout reported as a bad id (err={code})"
        with pytest.raises(MegakernelError, match="timed out"):
            launch_common.check_errors(res.errs[r])
    with pytest.raises(MegakernelError, match="spin-wait timed out"):
        res.check_errors()


# ----------------------------------------------------------------------------- host-side checks

def _zeros(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEV)


# Each maps (T, H, the R correct d_out tensors) to a mismatched list of d_out tensors.
D_OUT_VARIANTS = {
    # one rank's d_out with a token too many
    "T+1": lambda T, H, g: [_zeros(T + 1, H), *g[1:]],
    # one rank's d_out with the wrong hidden width
    "H-1": lambda T, H, g: [*g[:-1], _zeros(T, H - 1)],
    # every d_out transposed ([H, T])
    "transposed": lambda T, H, g: [_zeros(H, T) for _ in g],
    # every d_out flattened ([T*H])
    "1-D": lambda T, H, g: [_zeros(T * H) for _ in g],
    # a d_out per rank missing
    "too-few": lambda T, H, g: g[:-1],
    # one d_out too many
    "too-many": lambda T, H, g: [*g, g[0]],
}


@pytest.mark.parametrize("variant", list(D_OUT_VARIANTS))
def test_mismatched_d_out_raises(variant):
    """Checked on the host before anything is allocated or launched."""
    case = Case(TINY, r=2, t=4)
    inp = _make_inputs(case)
    d_outs = D_OUT_VARIANTS[variant](case.t, case.shape.h, inp.d_outs)
    with pytest.raises(ValueError, match="d_out"):
        megakernel_backward_multirank(d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=CFG)


def test_peers_of_wrong_rank_count_raise():
    case = Case(TINY, r=2, t=4)
    inp = _make_inputs(case)
    with pytest.raises(ValueError, match="ranks"):
        megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=CFG,
                                      peers=LocalPeers(3, DEV))


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    """CPU tensors are only accepted under the interpreter; the variable is read at call time."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = Case(TINY, r=1, t=4)
    inp = _make_inputs(case, device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET") as info:
        megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), None, config=CFG)
    assert not isinstance(info.value, MegakernelError)


# ============================================================================= GPU

@pytest.fixture
def cuda_cleanup():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _cuda_weights(shape: ModelShape, dtype, seed: int) -> MoEWeights:
    """make_weights' scaling (std 1/sqrt(fan_in)), drawn on the GPU (seed-shape weights are GBs)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i, s = shape.e, shape.h, shape.i, shape.shared_width

    def rnd(*size, fan_in):
        return (torch.randn(*size, generator=gen, device="cuda", dtype=torch.float32) / fan_in ** 0.5).to(dtype)

    return MoEWeights(rnd(e, 2 * i, h, fan_in=h), rnd(e, h, i, fan_in=i), rnd(2 * s, h, fan_in=h),
                      rnd(h, s, fan_in=s))


def _seed_slice(name: str, t: int, seed: int = 0):
    """Seed shape ``name`` sliced to one EP8 rank (E_local = E / 8 experts), run at R=1: bf16 inputs."""
    base = SEED_SHAPES[name]
    shape = base.with_(e=base.e // 8)
    case = Case(shape, r=1, t=t, swiglu_limit=shape.swiglu_limit, dtype=torch.bfloat16)
    mw = _cuda_weights(shape, torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, shape.h, generator=gen).to("cuda", torch.bfloat16)
    ids, w = routing_uniform(t, shape.e, shape.k, generator=gen, device="cuda")
    d_out = torch.randn(t, shape.h, generator=gen).to("cuda", torch.bfloat16)
    return case, Inputs([x], [ids.contiguous()], [w.float().contiguous()], mw, [d_out])


def _reference_grads32(case: Case, inp: Inputs) -> dict[str, torch.Tensor]:
    """Autograd through the reference on float32 leaves (benchmarks/bwd_round.py's truth on the GPU)."""
    return _autograd(moe_reference_multirank, case, inp, torch.float32, compute_dtype=torch.float32)


def _rel_l1_and_cosine(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``testing.rel_l1`` and ``testing.cosine``, accumulated in fp64 over slices of dim 0 (a seed-shape weight
    gradient is tens of GB in fp64 at once)."""
    if got.numel() <= 1 << 24:
        return rel_l1(got, want), cosine(got, want)
    step = max(1, (1 << 24) // got[0].numel())
    acc = torch.zeros(5, dtype=torch.float64, device=got.device)
    for s in range(0, got.shape[0], step):
        a, b = got[s:s + step].double(), want[s:s + step].double()
        acc += torch.stack([(a - b).abs().sum(), b.abs().sum(), (a * b).sum(), (a * a).sum(), (b * b).sum()])
        del a, b
    err = acc[0] / acc[1].clamp_min(1e-30)
    cos = acc[2] / (acc[3].sqrt() * acc[4].sqrt()).clamp_min(1e-30)
    return err.item(), cos.item()


def _assert_rel_l1_cosine(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """The bf16 tolerance entry's rel-L1 and cosine bars."""
    tol = tolerance_for("bf16")
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, cos = _rel_l1_and_cosine(got, want)
    assert err <= tol.rel_l1, f"{name}: relative L1 {err:.3e} > {tol.rel_l1:.1e}"
    assert cos >= tol.cosine, f"{name}: cosine {cos:.8f} < {tol.cosine}"


def _check_pushed_rows_finite(case: Case, res) -> None:
    """Every route was pushed back (all ids are valid here): no NaN left in the poisoned combine buffers."""
    for r in range(case.r):
        assert torch.isfinite(res.peers.buffer("dx_comb", r)).all(), f"rank {r}: a d_x row never pushed back"
        assert torch.isfinite(res.peers.buffer("dw_comb", r)).all(), f"rank {r}: a d_w never pushed back"


# The four seed shapes (kimi-k2.7, glm-5.2, qwen3.5-397b-a17b, deepseek-v4-pro with its SwiGLU clamp 7.0), each
# sliced to one EP8 rank and run at R=1 with T=2048.
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    "plain",  # KernelConfig()'s dataclass defaults, the backward replaying the forward's rows: pushes through the
    # NaN-poisoned combine buffers, the Triton weight gradients
    "heuristic",  # what MoELayer and the benchmarks run untuned: default_config for the slice (on the H200:
    # combine_gather, no comm programs, expert-run order, 4 backward stages, the Gluon weight gradients), the
    # backward reading the forward's kept activations
])
@pytest.mark.parametrize("name", list(SEED_SHAPES))
def test_gpu_seed_slice_grads_accuracy_and_determinism(name, knobs, cuda_cleanup, monkeypatch):
    """bf16 seed-shape slice (T=2048): every gradient within the bf16 rel-L1 and cosine bars of the fp32
    reference, then the same bits in 20 more runs. Every float ``torch.empty`` starts NaN (``nan_scratch``) and
    the combine buffers are re-poisoned before each run, so a row some run leaves unwritten cannot pass as the
    previous run's equal bits left in reused memory."""
    case, inp = _seed_slice(name, 2048)
    s = case.shape
    heuristic = knobs == "heuristic"
    cfg = default_config(case.t, s.h, s.i, s.e, s.k, dtype=torch.bfloat16, s=s.shared_width) if heuristic \
        else KernelConfig()
    peers = _poisoned_peers(1, case.t, s.k, s.h, case.dtype, "cuda")
    nan_scratch(monkeypatch)

    def run():
        saved = _forward_saved(case, inp, cfg, peers).saved() if heuristic else None
        res = megakernel_backward_multirank(inp.d_outs, inp.xs, inp.ids, inp.ws, *inp.weights(), case.swiglu_limit,
                                            config=cfg, peers=peers, saved=saved)
        res.check_errors()
        return res

    res = run()
    base = {k: v.clone() for k, v in _named(res).items()}
    if not cfg.combine_gather:  # (combine_gather pushes nothing: the combine buffers stay poisoned, unread)
        _check_pushed_rows_finite(case, res)
    del res
    ref = _reference_grads32(case, inp)
    assert sorted(ref) == sorted(base)
    for gname, g in base.items():
        _assert_rel_l1_cosine(f"{name} {gname}", g, ref[gname])
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    for i in range(20):
        _poison(peers, case.t, s.k, s.h, case.dtype)
        again = run()
        got = _named(again)
        for gname in base:
            assert_bitwise_equal(got[gname], base[gname], f"{name} {gname} run {i + 1}")
        del again, got


GPU_MR_SHAPE = ModelShape("gpu-mr", e=32, h=1024, i=512, k=4, score_func="softmax")
GPU_SMALL_TILES = KernelConfig(num_comm_programs_bwd=4, minibatch_size=128, block_m=64, block_n=64, block_k=64,
                               num_warps=4)
GPU_MR_CASES = {
    # two ranks, the small test shape (H=128, I=64) with T=300 (not a multiple of the 128-row tile), default
    # knobs (2048-row minibatches, 128-row tiles: most of each expert segment is padding)
    "small-R2-T300-default": (Case(SMALL, r=2, t=300, dtype=torch.bfloat16), KernelConfig()),
    # two ranks, H=1024, skewed load, 128-row minibatches and 64-row tiles: many minibatches, each expert's
    # weight gradient waiting on several while pushes and other experts' tiles run concurrently
    "mr-R2-zipf-small-tiles": (Case(GPU_MR_SHAPE, r=2, t=512, routing="zipf", dtype=torch.bfloat16),
                               GPU_SMALL_TILES),
    # two ranks, every token routed to experts 6..9 (one-hot, all on rank 0): rank 1 owns no row, 28 experts get
    # zero tokens; no shared expert; one communication program doing every pull and push
    "mr-R2-one-hot-no-shared-comm1": (Case(GPU_MR_SHAPE, r=2, t=384, routing="one_hot", hot=6, shared=False,
                                           dtype=torch.bfloat16), GPU_SMALL_TILES.with_(num_comm_programs_bwd=1)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_MR_CASES))
def test_gpu_multirank_bf16_vs_torch_backend(name, cuda_cleanup):
    """bf16, two ranks, every role concurrent: gradients against the torch backend's autograd (bf16 tolerance on
    the reference's RMS scale) and within the bf16 rel-L1 / cosine bars of the fp32 reference."""
    case, cfg = GPU_MR_CASES[name]
    inp = _make_inputs(case, device="cuda")
    res = _backward(case, inp, config=cfg)
    _check_pushed_rows_finite(case, res)
    got = _named(res)
    backend = _autograd(moe_forward_multirank, case, inp, None, block_m=cfg.block_m)
    ref = _reference_grads32(case, inp)
    assert sorted(got) == sorted(backend) == sorted(ref)
    for gname, g in got.items():
        _assert_grad_close(f"{gname} vs torch backend", g, backend[gname], "bf16", rescale=True)
        _assert_rel_l1_cosine(f"{gname} vs fp32 reference", g, ref[gname])
    used = _used_experts(case, inp).cuda()
    for gname in ("d_w13", "d_w2"):
        assert torch.all(getattr(res, gname)[~used] == 0), f"{gname}: nonzero gradient on unused experts"


GPU_BITWISE_VARIANTS = {
    # minibatch 256 (4 row tiles per handoff)
    "minibatch-256": dict(minibatch_size=256),
    # minibatch 2048: one handoff holds every row
    "minibatch-2048": dict(minibatch_size=2048),
    # one communication program
    "comm-1": dict(num_comm_programs_bwd=1),
    # sixteen communication programs
    "comm-16": dict(num_comm_programs_bwd=16),
}


@pytest.mark.gpu
def test_gpu_bitwise_across_configs(cuda_cleanup):
    """Concurrent roles on the GPU: the minibatch grain and the comm-program count leave every gradient's bits
    unchanged (tile shapes, warps and stages fixed)."""
    case = Case(GPU_MR_SHAPE, r=2, t=512, routing="zipf", dtype=torch.bfloat16)
    inp = _make_inputs(case, device="cuda")
    base = {k: v.clone() for k, v in _named(_backward(case, inp, config=GPU_SMALL_TILES)).items()}
    for variant, kw in GPU_BITWISE_VARIANTS.items():
        got = _named(_backward(case, inp, config=GPU_SMALL_TILES.with_(**kw)))
        for k in base:
            assert_bitwise_equal(got[k], base[k], f"{k} with {variant}")


GPU_GRAPH_CASES = {
    # the qwen3.5 slice (E_local=64, H=4096, I=1024, K=10) at R=1, T=2048, default knobs
    "qwen3.5-slice-R1": "qwen3.5-397b-a17b",
    # two virtual ranks exchanging through HBM, the small test shape, T=300
    "small-R2-T300": "small",
}


def _graph_inputs(key: str, seed: int) -> tuple[Case, Inputs]:
    if key == "small":
        case = Case(SMALL, r=2, t=300, dtype=torch.bfloat16)
        return case, _make_inputs(case, seed=seed, device="cuda")
    return _seed_slice(key, 2048, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_GRAPH_CASES))
def test_gpu_fwd_bwd_cuda_graph_replay(name, cuda_cleanup):
    """Forward and backward captured in one CUDA graph (schedules, megakernels, epilogues): replays follow
    in-place changes of x, d_out, the routing, the router weights and the expert weights, bit for bit equal to
    eager runs on fresh peers."""
    key = GPU_GRAPH_CASES[name]
    case, inp = _graph_inputs(key, seed=0)
    _, inp2 = _graph_inputs(key, seed=1)  # other tokens, upstream gradients, routing and weights
    cfg = KernelConfig()
    limit = case.swiglu_limit
    # the captured tensors
    cap_in = Inputs([x.clone() for x in inp.xs], [i.clone() for i in inp.ids], [w.clone() for w in inp.ws],
                    MoEWeights(*[None if t is None else t.clone() for t in inp.weights()]),
                    [g.clone() for g in inp.d_outs])

    def fwd_bwd(i: Inputs, peers: LocalPeers):
        f = megakernel_forward_multirank(i.xs, i.ids, i.ws, *i.weights(), limit, config=cfg, peers=peers)
        b = megakernel_backward_multirank(i.d_outs, i.xs, i.ids, i.ws, *i.weights(), limit, config=cfg,
                                          peers=peers)
        return f, b

    def results(f, b) -> dict[str, torch.Tensor]:
        out = {f"out[{r}]": o for r, o in enumerate(f.outputs)}
        out.update(_named(b))
        return out

    def eager(i: Inputs) -> dict[str, torch.Tensor]:
        f, b = fwd_bwd(i, LocalPeers(case.r, "cuda"))
        f.check_errors()
        b.check_errors()
        return {k: v.clone() for k, v in results(f, b).items()}

    peers = LocalPeers(case.r, "cuda")
    wf, wb = fwd_bwd(cap_in, peers)  # warm-up: compiled, peers' buffers and pointer tables exist
    wf.check_errors()
    wb.check_errors()
    warm = {k: v.clone() for k, v in results(wf, wb).items()}
    del wf, wb
    torch.cuda.synchronize()

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cf, cb = fwd_bwd(cap_in, peers)
    captured = results(cf, cb)

    def replay():
        g.replay()
        torch.cuda.synchronize()
        cf.check_errors()
        cb.check_errors()

    # same inputs: the warm-up's bits
    replay()
    for k, v in warm.items():
        assert_bitwise_equal(captured[k], v, f"{name}: {k}, replay with the capture's inputs")

    # new x and d_out, same routing and weights
    for dst, src in zip(cap_in.xs + cap_in.d_outs, inp2.xs + inp2.d_outs, strict=True):
        dst.copy_(src)
    replay()
    expect = eager(Inputs(inp2.xs, inp.ids, inp.ws, inp.mw, inp2.d_outs))
    assert not torch.equal(expect["d_x[0]"], warm["d_x[0]"])
    for k, v in expect.items():
        assert_bitwise_equal(captured[k], v, f"{name}: {k}, replay with new x and d_out")
    del expect

    # and a new routing, router weights and expert weights (the schedules are rebuilt on device in the graph)
    for dst, src in zip(cap_in.ids + cap_in.ws + list(cap_in.weights()), inp2.ids + inp2.ws + list(inp2.weights()),
                        strict=True):
        dst.copy_(src)
    replay()
    replay()  # replays repeat
    expect = eager(inp2)
    for k, v in expect.items():
        assert_bitwise_equal(captured[k], v, f"{name}: {k}, replay with new routing and weights")


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    dict(wgrad="persistent"),  # one program per SM walking the tiles
    dict(bwd_num_stages=4),  # the megakernel's loops one stage deeper (229,408 B of shared memory on sm_90)
    dict(wgrad="persistent", bwd_num_stages=4),  # both: what default_config runs at block_m 128
    dict(wgrad="gluon"),  # the warp-specialized Gluon kernel (a producer warp, two 64-row math groups)
    dict(wgrad="gluon", bwd_num_stages=4, tile_group_m=-1),  # it beside the heuristic's backward knobs
], ids=["persistent", "bwd-num-stages-4", "heuristic-backward", "gluon", "gluon-heuristic-backward"])
def test_gpu_wgrad_launch_same_bits(knobs, cuda_cleanup):
    """The weight-gradient launch's knobs (and the backward megakernel's pipeline depth) on the Kimi slice (512
    tokens): each output element is still summed by one program over its expert's rows in row order, 64 rows an
    MMA step, and a deeper pipeline changes when operands arrive, not the order of the sums, so every gradient
    has the default launch's bits; and the weight gradients pass the bf16 bars against the fp32 reference."""
    case, inp = _seed_slice("kimi-k2.7", 512)
    plain = {k: v.clone() for k, v in _named(_backward(case, inp, config=KernelConfig())).items()}
    got = _named(_backward(case, inp, config=KernelConfig().with_(**knobs)))
    ref = _reference_grads32(case, inp)
    for gname in ("d_w13", "d_w2"):
        _assert_rel_l1_cosine(f"{knobs} {gname}", got[gname], ref[gname])
    for gname in plain:
        assert_bitwise_equal(got[gname], plain[gname], f"{gname}: {knobs} vs the default launch")



@pytest.mark.gpu
@pytest.mark.parametrize("counts, total_rows", [
    # ragged experts: an empty one (zeros stored), one row, whole and odd steps, last steps of 16 / 32 / 33 / 63 rows
    ([341, 0, 64, 1, 383, 128, 80, 96, 97], None),
    ([7], 7),  # one group of 7 rows summed to its end (the shared expert's T): TMA reads the rest of the step as 0
    ([0, 0, 0], None),  # every group empty: every tile stores zeros
], ids=["ragged", "short-shared", "all-empty"])
def test_gpu_wgrad_gluon_kernel_same_bits(counts, total_rows, cuda_cleanup):
    """The Gluon weight-gradient kernel against the Triton one (``weight_grad_persistent_kernel``, TMA store) on
    the same segments, outputs NaN-poisoned before each run: every tile written, bit for bit the same sums, and
    an M that is not a multiple of the 256-column tile (a last tile TMA clips). 6 to 54 tiles over 132 programs
    (one tile or none each) and over 7, 5 and 3 (several tiles each, split unevenly: the producer's ring runs on
    across tile boundaries, and a program may walk one tile fewer than another)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    from kittenmoe.kernels import wgrad_gluon

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    N, M, wk = 256, 640, 64
    seg = [(c + 127) // 128 * 128 for c in counts] if total_rows is None else [total_rows]
    offsets = torch.tensor([0] + list(itertools.accumulate(seg)), dtype=torch.int32)
    rows_of = torch.tensor(counts if total_rows is None else [total_rows], dtype=torch.int32)
    rows = max(int(offsets[-1]), 1)
    p = torch.randn(rows, N, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(rows, M, generator=gen).to(dev, torch.bfloat16)
    for e, c in enumerate(counts):  # padding rows are zeros, as the pull writes them
        p[int(offsets[e]) + c:int(offsets[e + 1])] = 0
        q[int(offsets[e]) + c:int(offsets[e + 1])] = 0
    offsets, rows_of = offsets.to(dev), rows_of.to(dev)
    G = len(counts)
    want = torch.full((G, N, M), float("nan"), dtype=torch.bfloat16, device=dev)
    tiles = G * (N // 128) * triton.cdiv(M, 256)
    order = torch.randperm(G, generator=gen).to(torch.int32).to(dev)  # any order gives the same bits
    mb.weight_grad_persistent_kernel[(min(tiles, 132),)](
        order, offsets, rows_of, TD.from_tensor(p, [wk, 128]), TD.from_tensor(q, [wk, 256]), want,
        TD.from_tensor(want.view(-1, M), [128, 256]), N, M, N, M, tiles, WN=128, WM=256, WK=wk, USE_TMA=True,
        TMA_STORE=True, DOT_FP32=False, PRECISION="tf32", num_warps=8, num_stages=3)
    segs = [slice(int(offsets[e]), int(offsets[e + 1])) for e in range(G)]
    ref = torch.stack([p[sl].double().T @ q[sl].double() for sl in segs])
    for progs in (132, 7, 5, 3):  # one program an SM (as launched); and a few, each walking several tiles
        got = torch.full_like(want, float("nan"))
        wgrad_gluon.launch(order, offsets, rows_of, p, q, got, N, M, wk, 256, progs)
        torch.cuda.synchronize()
        assert not got.isnan().any(), f"{progs} programs: unwritten output"
        assert_bitwise_equal(got, want, f"gluon ({progs} programs) vs the Triton kernel")
        assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-1), f"gluon ({progs}) vs the float64 products"


@pytest.mark.gpu
def test_gpu_dw_partial_sum_layout_independent():
    """The d_w partial (``_row_sum_in_order``) of a BN-wide half split from a 2 BN-wide accumulator equals that of
    a BN-wide accumulator of the same bits, in bf16 and e4m3 (benchmarks/probes/split_sum_probe.py). tl.sum did not on
    the H200 (Triton 3.6: 155 and 134 of 256 rows), which broke the FP8 backward's kept == replayed bits; this
    catches a Triton whose fp32 FMA dot stops summing in k order."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "split_sum_probe.py"
    spec = importlib.util.spec_from_file_location("split_sum_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for r in mod.compare("cuda"):
        assert r["acc_equal"], f"{r}: the wide GEMM's halves differ from the narrow tiles"
        if r["in_order"]:
            assert r["dw_equal"], f"{r}: the in-order d_w partials depend on the accumulator's layout"
