"""The torch backend (the multi-rank pipeline in torch ops) against the reference.

Every case runs ``moe_forward_multirank`` on fp32 (or bf16) inputs and
``moe_reference_multirank`` on fp64 copies of the same values, then compares
the outputs and the gradients w.r.t. every rank's x and router weights, the
routed expert weights and the shared expert weights, with random upstream
gradients, at the one tolerance table in ``kittenmoe.testing``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from kittenmoe.config import TEST_SHAPES, ModelShape
from kittenmoe.reference import moe_reference_multirank, route
from kittenmoe.testing import (
    routing_few_experts,
    ROUTINGS,
    assert_bitwise_equal,
    assert_close,
    make_weights,
)
from kittenmoe.torch_backend import moe_forward_multirank

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4, clamp 1.5
SMALL = TEST_SHAPES["small"]  # E=16, H=128, I=64, K=4
E24 = ModelShape("e24", e=24, h=32, i=16, k=3, score_func="softmax")  # splits over R = 1, 2, 3, 4, 8


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    r: int
    t: int
    routing: str = "uniform"  # a key of ROUTINGS, or "few_experts"
    block_m: int = 16
    swiglu_limit: float | None = None
    shared: bool = True
    hot: int = 0  # one_hot: the expert every token's first route goes to


def _routing(case: Case, shape: ModelShape, gen: torch.Generator):
    t, e, k = case.t, shape.e, shape.k
    if case.routing == "few_experts":
        # Experts 0..2 only: on R=4 ranks (E_local=2) rank 0 gets expert 0 and 1, rank 1 only expert 2,
        # ranks 2 and 3 receive no row at all.
        return routing_few_experts(t, e, k, [0, 1, 2], generator=gen)
    if case.routing == "one_hot":
        return ROUTINGS["one_hot"](t, e, k, hot=case.hot, generator=gen)
    return ROUTINGS[case.routing](t, e, k, generator=gen)


def _make_inputs(case: Case, seed: int = 0, dtype=torch.float32):
    """Per-rank x, routing ids and fp32 router weights, the expert weights and random upstream grads (CPU)."""
    shape = case.shape
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for _ in range(case.r):
        xs.append(torch.randn(case.t, shape.h, generator=gen).to(dtype))
        i, w = _routing(case, shape, gen)
        ids.append(i.contiguous())
        ws.append(w.float().contiguous())  # router weights stay fp32
    mw = make_weights(shape, dtype=dtype, generator=gen, shared=case.shared)
    grads = [torch.randn(case.t, shape.h, generator=gen) for _ in range(case.r)]  # random upstream grads
    return xs, ids, ws, mw, grads


def _leaves(xs, ws, mw, dtype=None):
    """Fresh leaf copies that require grad (optionally cast)."""
    def leaf(t):
        if t is None:
            return None
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        return t.requires_grad_(True)
    return ([leaf(x) for x in xs], [leaf(w) for w in ws],
            [leaf(t) for t in (mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS)])


def _run(fn, xs, ids, ws, weights, grads, **kw):
    """Forward + backward with random upstream gradients; returns outputs and named gradients."""
    w13, w2, sw13, sw2 = weights
    outs = fn(xs, ids, ws, w13, w2, sw13, sw2, **kw)
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, grads, strict=True))
    loss.backward()
    named = {f"d_x[{r}]": x.grad for r, x in enumerate(xs)}
    named.update({f"d_topk_weights[{r}]": w.grad for r, w in enumerate(ws)})
    for name, t in zip(("d_w13", "d_w2", "d_shared_w13", "d_shared_w2"), weights):
        if t is not None:
            named[name] = t.grad
    for name, g in named.items():
        assert g is not None, f"{name}: no gradient reached this input"
    return [o.detach() for o in outs], named


def _backend(case: Case, xs, ids, ws, mw, grads, dtype=None):
    lx, lw, lweights = _leaves(xs, ws, mw, dtype)
    return _run(moe_forward_multirank, lx, ids, lw, lweights, grads, swiglu_limit=case.swiglu_limit,
                block_m=case.block_m)


def _reference(case: Case, xs, ids, ws, mw, grads):
    lx, lw, lweights = _leaves(xs, ws, mw, torch.float64)
    return _run(moe_reference_multirank, lx, ids, lw, lweights, grads, swiglu_limit=case.swiglu_limit,
                compute_dtype=torch.float64)


def _compare(case: Case, tol: str, dtype=torch.float32, seed: int = 0):
    xs, ids, ws, mw, grads = _make_inputs(case, seed=seed, dtype=dtype)
    outs, dgrads = _backend(case, xs, ids, ws, mw, grads)
    ref_outs, ref_grads = _reference(case, xs, ids, ws, mw, grads)
    assert sorted(dgrads) == sorted(ref_grads)
    for r, (o, ro) in enumerate(zip(outs, ref_outs, strict=True)):
        assert o.dtype == dtype, f"out[{r}] dtype {o.dtype}, expected x's dtype {dtype}"
        assert_close(o.float(), ro.float(), tol, f"out[{r}]")
    for name, g in dgrads.items():
        assert g.dtype == (torch.float32 if name.startswith("d_topk_weights") else dtype), name
        g, rg = g.double(), ref_grads[name].float().double()  # the fp64 reference, cast to fp32
        # The table's rtol/atol are absolute bounds meant for O(1) tensors, but a gradient is a sum over
        # many rows (the shared expert's over all R*T tokens, a routed expert's over every row it got,
        # with terms up to ~3 that cancel), and rounding error grows with the terms, not with the
        # result. So gradients are compared on the reference's RMS scale, per expert for the [E, ...]
        # routed weight gradients; rel-L1 and cosine are scale-free and unaffected by this.
        dims = tuple(range(1, rg.dim())) if name in ("d_w13", "d_w2") else tuple(range(rg.dim()))
        scale = rg.pow(2).mean(dim=dims, keepdim=True).sqrt().clamp_min(1e-30)
        g, rg = g / scale, rg / scale
        assert_close(g, rg, tol, name)
    return xs, ids, ws, mw, dgrads, ref_grads


CASES = {
    # one rank: the schedule degenerates to a local sort, no exchange
    "R1-uniform": Case(TINY, r=1, t=16),
    # two ranks, balanced load, tiles smaller than most expert segments
    "R2-uniform-bm4": Case(TINY, r=2, t=32, block_m=4),
    # odd rank count (E=24, E_local=8)
    "R3-uniform": Case(E24, r=3, t=20),
    # four ranks, the K=4 shape (E=16, H=48, I=24), tiles of 4 rows
    "R4-uniform-tiny-sigmoid-bm4": Case(TINY_SIG, r=4, t=24, block_m=4),
    # eight ranks, E_local=3
    "R8-uniform": Case(E24, r=8, t=16),
    # skewed (zipf) load: a few experts take most rows, many segments are one partial tile
    "R4-zipf-small": Case(SMALL, r=4, t=32, routing="zipf"),
    # skewed load on eight ranks with small tiles
    "R8-zipf-bm4": Case(E24, r=8, t=24, routing="zipf", block_m=4),
    # one-hot: every token's first route to the last expert, second to expert 0 (ids wrap mod E): each
    # rank owns one expert holding all T*R rows of its column
    "R2-one-hot-last-expert": Case(TINY, r=2, t=32, routing="one_hot", hot=TINY.e - 1),
    # one-hot with K=1: literally all routes of all ranks to expert 5; three of four ranks get no row
    "R4-one-hot-K1": Case(TINY.with_(k=1), r=4, t=24, routing="one_hot", hot=5),
    # zero-token experts and zero-row ranks (only experts 0..2 are ever chosen)
    "R4-zero-token-experts": Case(TINY, r=4, t=16, routing="few_experts"),
    # a single token per rank: T*K < block_m, every segment mostly padding
    "R2-T1": Case(TINY, r=2, t=1),
    # a single token per rank on eight ranks with block_m=1 (no padding at all)
    "R8-T1-bm1": Case(E24, r=8, t=1, block_m=1),
    # T=7: T*K=21 routes per rank, not a multiple of block_m=4
    "R3-T7-bm4": Case(E24, r=3, t=7, block_m=4),
    # T=7 with block_m=16: every expert segment is one partial tile (28 routes over 8 experts)
    "R2-T7-bm16": Case(TINY, r=2, t=7),
    # K=1: one route per token, the epilogue sums a single term
    "R2-K1": Case(TINY.with_(k=1), r=2, t=16),
    # K=1 on eight ranks with skewed load
    "R8-K1-zipf": Case(E24.with_(k=1), r=8, t=16, routing="zipf"),
    # SwiGLU clamp active (limit 0.3 << the O(1) pre-activations), routed and shared experts
    "R2-swiglu-limit-0.3": Case(TINY, r=2, t=16, swiglu_limit=0.3),
    # the DeepSeek-V4-style clamp at the shape's own limit (1.5), four ranks, skewed
    "R4-swiglu-limit-1.5-zipf": Case(TINY_SIG, r=4, t=16, routing="zipf", swiglu_limit=1.5),
    # no shared expert: out is the routed sum only
    "R2-no-shared": Case(TINY, r=2, t=16, shared=False),
    # no shared expert with eight ranks and the clamp
    "R8-no-shared-limit": Case(E24, r=8, t=8, shared=False, swiglu_limit=0.5),
    # block_m=1: segments unpadded, one row per tile
    "R4-bm1": Case(TINY, r=4, t=16, block_m=1),
    # block_m=1 with one-hot load on two ranks
    "R2-one-hot-bm1": Case(TINY, r=2, t=16, routing="one_hot", block_m=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_fp32(name):
    case = CASES[name]
    assert case.shape.e % case.r == 0
    xs, ids, ws, mw, dgrads, ref_grads = _compare(case, "fp32")

    # Experts that received no token get exactly zero weight gradient, every used one a nonzero one
    # (nothing dropped, nothing invented). One-hot and few-experts routings always leave experts unused.
    used = torch.zeros(case.shape.e, dtype=torch.bool)
    for i in ids:
        used[i.flatten()] = True
    if case.routing in ("few_experts", "one_hot"):
        assert not used.all()
    for gname in ("d_w13", "d_w2"):
        assert torch.all(dgrads[gname][~used] == 0), f"{gname}: nonzero gradient on unused experts"
        assert torch.all(dgrads[gname][used].abs().sum(dim=(1, 2)) > 0), f"{gname}: a used expert got 0 grad"


def _clamp_activity(case: Case, xs, ids, mw, limit: float) -> dict[str, bool]:
    """Whether gate > L and |up| > L occur, over the routes actually taken and in the shared expert."""
    i = case.shape.i
    hit = {"routed gate": False, "routed up": False}
    if mw.shared_w13_2SH is not None:
        hit.update({"shared gate": False, "shared up": False})
    for x, idx in zip(xs, ids, strict=True):
        gu = torch.einsum("th,tkoh->tko", x.double(), mw.w13_E2IH.double()[idx])
        hit["routed gate"] |= bool((gu[..., :i] > limit).any())
        hit["routed up"] |= bool((gu[..., i:].abs() > limit).any())
        if mw.shared_w13_2SH is not None:
            s = mw.shared_w2_HS.shape[1]
            sgu = x.double() @ mw.shared_w13_2SH.double().t()
            hit["shared gate"] |= bool((sgu[:, :s] > limit).any())
            hit["shared up"] |= bool((sgu[:, s:].abs() > limit).any())
    return hit


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.swiglu_limit is not None])
def test_swiglu_limit_is_active(name):
    """The clamp cases above would prove nothing if no element reached the limit."""
    case = CASES[name]
    xs, ids, ws, mw, grads = _make_inputs(case)
    hit = _clamp_activity(case, xs, ids, mw, case.swiglu_limit)
    idle = [k for k, v in hit.items() if not v]
    assert not idle, f"clamp at L={case.swiglu_limit} never active for: {idle}"
    # ... and the clamp changes the outputs.
    unclamped = dataclasses.replace(case, swiglu_limit=None)
    outs, _ = _backend(case, xs, ids, ws, mw, grads)
    outs_free, _ = _backend(unclamped, xs, ids, ws, mw, grads)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(outs, outs_free))


BF16_CASES = {
    # bf16 operands, two ranks, skewed load
    "R2-zipf": Case(TINY, r=2, t=32, routing="zipf"),
    # bf16, four ranks, T not a multiple of block_m, one-hot hot spot
    "R4-T7-one-hot": Case(TINY_SIG, r=4, t=7, routing="one_hot", hot=9, block_m=4),
    # bf16 with the SwiGLU clamp active (L=1.5): gate|up must stay fp32 through the clamp
    "R4-T7-limit": Case(TINY_SIG, r=4, t=7, block_m=4, swiglu_limit=1.5),
}


@pytest.mark.parametrize("case", list(BF16_CASES.values()), ids=list(BF16_CASES))
def test_matches_reference_bf16(case):
    _compare(case, "bf16", dtype=torch.bfloat16)


def test_bf16_outputs_small_shape():
    """bf16 forward at H=128 (K=4, skewed, 4 ranks) against the fp64 reference, on the raw table."""
    case = Case(SMALL, r=4, t=32, routing="zipf")
    xs, ids, ws, mw, _ = _make_inputs(case, dtype=torch.bfloat16)
    outs = moe_forward_multirank(xs, ids, ws, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS,
                                 block_m=case.block_m)
    ref = moe_reference_multirank(xs, ids, ws, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS,
                                  compute_dtype=torch.float64)
    for r, (o, ro) in enumerate(zip(outs, ref, strict=True)):
        assert o.dtype == torch.bfloat16
        assert_close(o.float(), ro.float(), "bf16", f"out[{r}]")


DETERMINISM_CASES = {
    # fp32, skewed load, tail tile
    "R4-zipf-T7-fp32": (Case(TINY_SIG, r=4, t=7, routing="zipf", block_m=4, swiglu_limit=1.5), torch.float32),
    # fp32, eight ranks, one-hot hot spot
    "R8-one-hot-fp32": (Case(E24, r=8, t=16, routing="one_hot", hot=11), torch.float32),
    # bf16, two ranks
    "R2-uniform-bf16": (Case(SMALL, r=2, t=32), torch.bfloat16),
}


@pytest.mark.parametrize("name", list(DETERMINISM_CASES))
def test_bitwise_deterministic(name):
    case, dtype = DETERMINISM_CASES[name]
    xs, ids, ws, mw, grads = _make_inputs(case, dtype=dtype)
    outs_a, grads_a = _backend(case, xs, ids, ws, mw, grads)
    outs_b, grads_b = _backend(case, xs, ids, ws, mw, grads)
    for r, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        assert_bitwise_equal(a, b, f"out[{r}]")
    assert sorted(grads_a) == sorted(grads_b)
    for gname in grads_a:
        assert_bitwise_equal(grads_a[gname], grads_b[gname], gname)


def test_tiny_model_trains():
    """A router + MoE layer through the torch backend with R=2 fits a regression target with Adam."""
    gen = torch.Generator().manual_seed(1)
    shape, r, t = TINY, 2, 32
    xs = [torch.randn(t, shape.h, generator=gen) for _ in range(r)]
    teacher = torch.randn(shape.h, shape.h, generator=gen) / shape.h ** 0.5
    targets = [torch.tanh(x @ teacher) for x in xs]

    mw = make_weights(shape, generator=gen).requires_grad_()
    router = (torch.randn(shape.e, shape.h, generator=gen) / shape.h ** 0.5).requires_grad_(True)
    params = [router, *mw.tensors()]
    opt = torch.optim.Adam(params, lr=1e-2)

    def loss_fn():
        ids, ws = [], []
        for x in xs:
            i, w = route(x @ router.t(), shape.k, "softmax")
            ids.append(i)
            ws.append(w)
        outs = moe_forward_multirank(xs, ids, ws, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS)
        return sum(torch.nn.functional.mse_loss(o, y) for o, y in zip(outs, targets)) / r

    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        assert router.grad is not None and router.grad.abs().sum() > 0, "no gradient reached the router"
        opt.step()
        losses.append(loss.item())
    final = loss_fn().item()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert final < losses[0] / 20, f"loss did not fall enough: {losses[0]:.4f} -> {final:.4f}"


# ----------------------------------------------------------------------------- expert_rows on its own

# R=2 ranks, T=5, K=2, L=3 local experts, destination rank 0, block_m=4. Rank 0's expert 0 gets 6 rows (a
# tile with 2 padding rows), expert 1 none, expert 2 exactly one full tile; C = 29 rows, 7 tiles, 12 rows in
# use: tiles 3..6 have tile_expert -1 and row 28 is past the last full tile.
_ER_IDS = torch.tensor([[[0, 2], [0, 3], [0, 2], [2, 4], [0, 5]],
                        [[0, 2], [0, 3], [3, 5], [4, 3], [3, 5]]])
_ER_L, _ER_H, _ER_I, _ER_BM = 3, 32, 16, 4


def _expert_rows_inputs(ids, dtype, seed):
    """The schedule of rank 0, x_routed as the pipeline fills it (random real rows, zero padding rows) plus
    random garbage past num_rows, random local weights and a random upstream gradient."""
    from kittenmoe.schedule import build_schedule

    sched = build_schedule(ids, 0, _ER_L, _ER_BM, impl="torch")
    gen = torch.Generator().manual_seed(seed)
    c = sched.capacity
    x = torch.randn(c, _ER_H, generator=gen)
    real = sched.peer_rank >= 0
    in_use = torch.arange(c) < int(sched.num_rows)
    x = torch.where(real[:, None] | ~in_use[:, None], x, 0).to(dtype)
    w13 = (torch.randn(_ER_L, 2 * _ER_I, _ER_H, generator=gen) / _ER_H ** 0.5).to(dtype)
    w2 = (torch.randn(_ER_L, _ER_H, _ER_I, generator=gen) / _ER_I ** 0.5).to(dtype)
    d_y = torch.randn(c, _ER_H, generator=gen)
    return sched, x, w13, w2, d_y


def _expert_rows_fp64(ids, sched, x, w13, w2, swiglu_limit):
    """Row by row in fp64: a real row runs the expert its route names (from ids, not from the schedule's
    offsets); every other row is 0."""
    from kittenmoe.reference import swiglu

    K, L = ids.shape[2], sched.experts_per_rank
    rows = []
    for n in range(x.shape[0]):
        src, tok = int(sched.peer_rank[n]), int(sched.peer_token_idx[n])
        if src < 0:
            rows.append(x.new_zeros(x.shape[1]))
            continue
        e = int(ids[src, tok // K, tok % K]) - sched.rank * L
        gu = w13[e] @ x[n]
        rows.append(w2[e] @ swiglu(gu[:_ER_I], gu[_ER_I:], swiglu_limit))
    return torch.stack(rows)


@pytest.mark.parametrize("impl", ["per_expert", "tiled"])
@pytest.mark.parametrize("dtype,limit", [(torch.float32, None), (torch.float32, 1.5), (torch.bfloat16, 1.5)])
def test_expert_rows_matches_per_row_fp64(impl, dtype, limit):
    """expert_rows (one GEMM per expert; ``tiled``: the per-tile form torch.compile traces) against a per-row
    fp64 computation, forward and the gradients w.r.t. x_routed and both weights: an expert with no rows, a
    padded tile, unused tiles (tile_expert -1) and a row past the last full tile."""
    from kittenmoe import torch_backend as tb

    sched, x, w13, w2, d_y = _expert_rows_inputs(_ER_IDS, dtype, seed=11)
    assert sched.expert_counts.tolist() == [6, 0, 4] and sched.expert_offsets.tolist() == [0, 8, 8, 12]
    assert sched.tile_expert.tolist() == [0, 0, 2, -1, -1, -1, -1] and sched.capacity == 29
    if impl == "tiled":  # its contract: rows past num_rows are zero (the pipeline's x_routed is)
        x = torch.where(torch.arange(sched.capacity)[:, None] < 12, x, 0)
    fn = tb.expert_rows if impl == "per_expert" else tb._expert_rows_tiled
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
    y = fn(*leaves[:1], sched, *leaves[1:], limit)
    assert y.dtype == dtype and y.shape == (sched.capacity, _ER_H)
    grads = torch.autograd.grad(y, leaves, d_y.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w13, w2)]
    y_ref = _expert_rows_fp64(_ER_IDS, sched, ref_leaves[0], *ref_leaves[1:], limit)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, d_y.double())
    tol = "fp32" if dtype == torch.float32 else "bf16"
    assert_close(y.float(), y_ref.float(), tol, "y_routed")
    assert torch.equal(y[12:], torch.zeros_like(y[12:])), "rows past num_rows must be exactly 0"
    assert torch.equal(y[6:8], torch.zeros_like(y[6:8])), "padding rows must stay exactly 0"
    for name, g, rg in zip(("d_x_routed", "d_w13", "d_w2"), grads, ref_grads, strict=True):
        assert_close(g.float(), rg.float(), tol, name)
    assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1])), "expert 1 has no rows"


def test_expert_rows_no_rows_keeps_graph():
    """A rank that receives no route: y is all zeros and x and the weights still get (zero) gradients."""
    from kittenmoe.torch_backend import expert_rows

    ids = _ER_IDS.clone()
    ids[ids < _ER_L] += _ER_L  # every route goes to rank 1's experts
    sched, x, w13, w2, d_y = _expert_rows_inputs(ids, torch.float32, seed=12)
    assert int(sched.num_rows) == 0
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
    y = expert_rows(leaves[0], sched, *leaves[1:], None)
    assert torch.equal(y, torch.zeros_like(y))
    for g in torch.autograd.grad(y, leaves, d_y):
        assert torch.equal(g, torch.zeros_like(g))


def test_expert_rows_memory_does_not_scale_with_tiles():
    """No tensor expert_rows makes (forward or backward) is as big as one weight copy per tile: every op's
    output stays within max(C x max(2I, H), L x 2I x H). The per-tile form (what expert_rows did before,
    and still does under torch.compile) breaks that bound here, so the check can tell them apart."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kittenmoe import torch_backend as tb

    class MaxNumel(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.max = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.max = max(self.max, t.numel())
            return out

    sched, x, w13, w2, d_y = _expert_rows_inputs(_ER_IDS, torch.float32, seed=13)
    x = torch.where(torch.arange(sched.capacity)[:, None] < 12, x, 0)
    c, nt = sched.capacity, sched.num_tiles
    bound = max(c * max(2 * _ER_I, _ER_H), _ER_L * 2 * _ER_I * _ER_H)
    assert nt * 2 * _ER_I * _ER_H > bound
    seen = {}
    for name, fn in (("per_expert", tb.expert_rows), ("tiled", tb._expert_rows_tiled)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
        with MaxNumel() as m:
            y = fn(leaves[0], sched, *leaves[1:], None)
            torch.autograd.grad(y, leaves, d_y)
        seen[name] = m.max
    assert seen["per_expert"] <= bound, seen
    assert seen["tiled"] >= nt * 2 * _ER_I * _ER_H, seen  # the tiled form's per-tile weight gather
