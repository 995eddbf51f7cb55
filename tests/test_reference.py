"""Sanity of the reference layer itself (``kittenmoe.reference``): the truth must be true."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kittenmoe.config import TEST_SHAPES
from kittenmoe.reference import (
    moe_layer_reference,
    moe_reference,
    moe_reference_multirank,
    route,
    swiglu,
)
from kittenmoe.testing import assert_close, make_weights, routing_uniform

f64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- route

@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_selection_and_weights(score_func, renormalize):
    logits = torch.randn(9, 7, generator=_gen(), dtype=f64)
    k = 3
    ids, w = route(logits, k, score_func, renormalize, compute_dtype=f64)
    assert ids.dtype == torch.int64 and ids.shape == (9, k)
    assert w.dtype == f64 and w.shape == (9, k)
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    # The k highest scores, best first, k distinct experts per token.
    expected_ids = torch.argsort(scores, dim=-1, descending=True)[:, :k]
    assert torch.equal(ids, expected_ids)
    expected_w = scores.gather(1, ids)
    if renormalize:
        expected_w = expected_w / expected_w.sum(-1, keepdim=True)
        torch.testing.assert_close(w.sum(-1), torch.ones(9, dtype=f64))
    torch.testing.assert_close(w, expected_w, rtol=1e-14, atol=0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_route_scaling_factor(score_func, renormalize):
    logits = torch.randn(5, 8, generator=_gen(1), dtype=f64)
    ids1, w1 = route(logits, 2, score_func, renormalize, 1.0, compute_dtype=f64)
    ids2, w2 = route(logits, 2, score_func, renormalize, 2.5, compute_dtype=f64)
    assert torch.equal(ids1, ids2)  # scaling never changes the selection
    torch.testing.assert_close(w2, 2.5 * w1, rtol=1e-15, atol=0)
    if renormalize:  # applied after renormalisation: the weights sum to the factor
        torch.testing.assert_close(w2.sum(-1), torch.full((5,), 2.5, dtype=f64))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_correction_bias_selects_but_does_not_weigh(score_func, renormalize):
    e, k = 6, 2
    # Expert 5 always has the lowest score; a large bias makes it selected anyway.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -4.0],
                           [0.0, 1.0, 2.0, 3.0, 0.5, -5.0]], dtype=f64)
    bias = torch.zeros(e, dtype=f64)
    bias[5] = 10.0
    ids0, w0 = route(logits, k, score_func, renormalize, compute_dtype=f64)
    ids, w = route(logits, k, score_func, renormalize, correction_bias_E=bias, compute_dtype=f64)
    assert not (ids0 == 5).any()
    assert (ids[:, 0] == 5).all(), "the bias must change the selection"
    assert torch.equal(ids[:, 1], ids0[:, 0]), "the other pick is the unbiased best"
    # Weights come from the unbiased scores of the selected experts.
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    expected = scores.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expected, rtol=1e-14, atol=0)
    # A bias that does not change the ranking changes nothing at all.
    ids_c, w_c = route(logits, k, score_func, renormalize, correction_bias_E=torch.full((e,), 0.25, dtype=f64),
                       compute_dtype=f64)
    assert torch.equal(ids_c, ids0)
    torch.testing.assert_close(w_c, w0, rtol=0, atol=0)


def test_route_gradient_flows_through_weights_only():
    logits = torch.randn(4, 6, generator=_gen(2), dtype=f64, requires_grad=True)
    bias = torch.randn(6, generator=_gen(3), dtype=f64, requires_grad=True)
    ids, w = route(logits, 2, "sigmoid", True, 1.5, correction_bias_E=bias, compute_dtype=f64)
    assert not ids.requires_grad
    torch.autograd.gradcheck(
        lambda lg: route(lg, 2, "sigmoid", True, 1.5, correction_bias_E=bias.detach(), compute_dtype=f64)[1],
        (logits,))
    torch.autograd.gradcheck(lambda lg: route(lg, 3, "softmax", True, compute_dtype=f64)[1], (logits,))
    w.sum().backward()
    assert bias.grad is None, "the correction bias only selects; it must get no gradient"


def test_route_dtypes_and_errors():
    logits = torch.randn(3, 4, generator=_gen(4)).to(torch.bfloat16)
    ids, w = route(logits, 2)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    ids, w = route(logits, 4)  # K = E is allowed
    assert torch.equal(ids.sort(-1).values, torch.arange(4).expand(3, 4))
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        route(logits, 5)
    with pytest.raises(ValueError, match="score_func"):
        route(logits, 2, "relu")


# ---------------------------------------------------------------- swiglu

def test_swiglu_without_limit_is_silu_times_up():
    g = torch.randn(50, generator=_gen(5), dtype=f64) * 5
    u = torch.randn(50, generator=_gen(6), dtype=f64) * 5
    torch.testing.assert_close(swiglu(g, u), F.silu(g) * u, rtol=0, atol=0)
    torch.testing.assert_close(swiglu(g, u, None), F.silu(g) * u, rtol=0, atol=0)


def test_swiglu_clamp_semantics():
    lim = 3.0
    g = torch.tensor([-10.0, -3.5, -1.0, 0.0, 2.0, 3.0, 3.5, 10.0], dtype=f64, requires_grad=True)
    u = torch.tensor([-10.0, -3.5, -1.0, 0.5, 2.0, 3.0, 3.5, 10.0], dtype=f64, requires_grad=True)
    y = swiglu(g, u, lim)
    # gate <= L only (no lower clamp on the gate); -L <= up <= L.
    g_eff = torch.tensor([-10.0, -3.5, -1.0, 0.0, 2.0, 3.0, 3.0, 3.0], dtype=f64)
    u_eff = torch.tensor([-3.0, -3.0, -1.0, 0.5, 2.0, 3.0, 3.0, 3.0], dtype=f64)
    torch.testing.assert_close(y, F.silu(g_eff) * u_eff, rtol=0, atol=0)
    # Explicit spot values: a gate below -L is not clamped, an up below -L is.
    torch.testing.assert_close(y[0], F.silu(torch.tensor(-10.0, dtype=f64)) * -3.0, rtol=0, atol=0)
    torch.testing.assert_close(y[-1], F.silu(torch.tensor(3.0, dtype=f64)) * 3.0, rtol=0, atol=0)
    # Clamped elements pass no gradient to the clamped operand.
    y.backward(torch.ones_like(y))
    assert torch.all(g.grad[g.detach() > lim] == 0)
    assert torch.all(g.grad[g.detach() < -lim] != 0), "the gate has no lower clamp"
    assert torch.all(u.grad[u.detach().abs() > lim] == 0)
    assert torch.all(u.grad[(u.detach().abs() < lim) & (g.detach() != 0)] != 0)


# ---------------------------------------------------------------- moe_reference

def _hand_moe_one_token(x_H, ids_K, w_K, w13, w2, sw13, sw2, limit):
    """out = shared(x) + sum_j w_j * expert_{ids_j}(x), in plain Python floats, one expert at a time."""
    x = x_H.tolist()

    def ffn(w13_2IH, w2_HI):
        a, b = w13_2IH.tolist(), w2_HI.tolist()
        i = len(b[0])
        hid = []
        for c in range(i):
            gate = sum(a[c][d] * x[d] for d in range(len(x)))
            up = sum(a[i + c][d] * x[d] for d in range(len(x)))
            if limit is not None:
                gate = min(gate, limit)
                up = max(min(up, limit), -limit)
            hid.append(gate / (1 + math.exp(-gate)) * up)
        return [sum(b[o][c] * hid[c] for c in range(i)) for o in range(len(b))]

    out = ffn(sw13, sw2) if sw13 is not None else [0.0] * len(x)
    for j, e in enumerate(ids_K.tolist()):
        y = ffn(w13[e], w2[e])
        out = [o + float(w_K[j]) * v for o, v in zip(out, y)]
    return torch.tensor(out, dtype=f64)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("limit", [None, 0.4])
@pytest.mark.parametrize("ids", [[4, 0, 2], [2, 2, 3]], ids=["distinct", "repeated-expert"])
def test_moe_reference_one_token_by_hand(shared, limit, ids):
    g = _gen(7)
    e, h, i, s = 5, 6, 4, 3
    x = torch.randn(1, h, generator=g, dtype=f64)
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=f64) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g, dtype=f64) / i ** 0.5
    sw13 = torch.randn(2 * s, h, generator=g, dtype=f64) / h ** 0.5 if shared else None
    sw2 = torch.randn(h, s, generator=g, dtype=f64) / s ** 0.5 if shared else None
    ids_TK = torch.tensor([ids])
    w_TK = torch.rand(1, 3, generator=g, dtype=f64) + 0.1
    if limit is not None:  # the clamp must actually bite, on the gate and on the up half
        gu = torch.einsum("h,koh->ko", x[0], w13[ids_TK[0]])
        assert (gu[:, :i] > limit).any() and (gu[:, i:].abs() > limit).any()
    out = moe_reference(x, ids_TK, w_TK, w13, w2, sw13, sw2, limit, compute_dtype=f64)
    expected = _hand_moe_one_token(x[0], ids_TK[0], w_TK[0], w13, w2, sw13, sw2, limit)
    assert out.shape == (1, h) and out.dtype == f64
    assert_close(out[0], expected, "fp64", "out")


def test_moe_reference_rows_are_independent_and_multirank_is_per_rank():
    shape = TEST_SHAPES["tiny"]
    g = _gen(8)
    mw = make_weights(shape, dtype=f64, generator=g)
    xs, ids, ws = [], [], []
    for _ in range(2):
        xs.append(torch.randn(5, shape.h, generator=g, dtype=f64))
        i, w = routing_uniform(5, shape.e, shape.k, generator=g)
        ids.append(i)
        ws.append(w.double())
    outs = moe_reference_multirank(xs, ids, ws, *mw.tensors(), compute_dtype=f64)
    for r in range(2):
        whole = moe_reference(xs[r], ids[r], ws[r], *mw.tensors(), compute_dtype=f64)
        assert_close(outs[r], whole, "fp64", f"rank {r}")
        for t in range(5):  # each token alone gives its own row
            alone = moe_reference(xs[r][t:t + 1], ids[r][t:t + 1], ws[r][t:t + 1], *mw.tensors(),
                                  compute_dtype=f64)
            assert_close(whole[t:t + 1], alone, "fp64", f"rank {r} token {t}")


def test_moe_layer_reference_is_route_then_experts():
    shape = TEST_SHAPES["tiny-sigmoid"]
    g = _gen(9)
    mw = make_weights(shape, dtype=f64, generator=g)
    x = torch.randn(6, shape.h, generator=g, dtype=f64)
    router = torch.randn(shape.e, shape.h, generator=g, dtype=f64) / shape.h ** 0.5
    bias = torch.randn(shape.e, generator=g, dtype=f64) * 0.1
    out = moe_layer_reference(x, router, *mw.tensors(), shape.k, shape.score_func, shape.renormalize,
                              shape.routed_scaling_factor, shape.swiglu_limit, bias, compute_dtype=f64)
    ids, w = route(x @ router.t(), shape.k, shape.score_func, shape.renormalize, shape.routed_scaling_factor,
                   bias, compute_dtype=f64)
    expected = moe_reference(x, ids, w, *mw.tensors(), shape.swiglu_limit, compute_dtype=f64)
    assert_close(out, expected, "fp64", "layer")


@pytest.mark.parametrize("shape_name", ["tiny", "small"])
def test_moe_reference_fp32_agrees_with_fp64(shape_name):
    shape = TEST_SHAPES[shape_name]
    g = _gen(10)
    mw = make_weights(shape, generator=g)
    x = torch.randn(32, shape.h, generator=g)
    ids, w = routing_uniform(32, shape.e, shape.k, generator=g)
    out32 = moe_reference(x, ids, w, *mw.tensors(), compute_dtype=torch.float32)
    out64 = moe_reference(x, ids, w, *mw.tensors(), compute_dtype=f64)
    assert out32.dtype == torch.float32 and out64.dtype == f64
    assert_close(out32, out64.float(), "fp32", "out")


def test_moe_reference_grads_reach_low_precision_inputs():
    shape = TEST_SHAPES["tiny"]
    g = _gen(11)
    mw = make_weights(shape, dtype=torch.bfloat16, generator=g).requires_grad_()
    x = torch.randn(4, shape.h, generator=g).to(torch.bfloat16).requires_grad_(True)
    ids, w = routing_uniform(4, shape.e, shape.k, generator=g)
    w.requires_grad_(True)
    out = moe_reference(x, ids, w, *mw.tensors())
    assert out.dtype == torch.float32
    out.backward(torch.randn(out.shape, generator=g))
    for name, t in [("x", x), ("w", w), *zip(("w13", "w2", "sw13", "sw2"), mw.tensors())]:
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert t.grad.abs().sum() > 0, name


def _tiny_f64(seed, shared=True):
    g = _gen(seed)
    t, h, i, e, s = 3, 4, 3, 4, 2
    x = torch.randn(t, h, generator=g, dtype=f64)
    ids = torch.tensor([[0, 2], [3, 0], [2, 1]])  # expert 0 twice, expert 1 once, 2 twice, 3 once
    w = torch.rand(t, 2, generator=g, dtype=f64) + 0.2
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=f64)
    w2 = torch.randn(e, h, i, generator=g, dtype=f64)
    sw13 = torch.randn(2 * s, h, generator=g, dtype=f64) if shared else None
    sw2 = torch.randn(h, s, generator=g, dtype=f64) if shared else None
    return x, ids, w, w13, w2, sw13, sw2


def test_moe_reference_gradcheck():
    x, ids, w, w13, w2, sw13, sw2 = _tiny_f64(12)
    inputs = tuple(t.requires_grad_(True) for t in (x, w, w13, w2))
    assert torch.autograd.gradcheck(
        lambda x_, w_, w13_, w2_: moe_reference(x_, ids, w_, w13_, w2_, sw13, sw2, compute_dtype=f64), inputs)


def test_moe_reference_gradcheck_with_active_clamp():
    x, ids, w, w13, w2, sw13, sw2 = _tiny_f64(13)
    i, s = w2.shape[2], sw2.shape[1]
    # Kink points: gate = L and |up| = L. Pick L in the widest gap between them (far from every kink, so
    # finite differences stay on one side) such that some gate and some up are above it.
    gu = torch.einsum("th,tkoh->tko", x, w13[ids])
    sgu = x @ sw13.t()
    gates = torch.cat([gu[..., :i].flatten(), sgu[:, :s].flatten()])
    ups = torch.cat([gu[..., i:].flatten(), sgu[:, s:].flatten()]).abs()
    top = min(gates.max(), ups.max())
    kinks = torch.cat([gates, ups]).sort().values
    kinks = kinks[(kinks > 0.2) & (kinks < top)]
    gaps = kinks[1:] - kinks[:-1]
    j = int(gaps.argmax())
    limit = float((kinks[j] + kinks[j + 1]) / 2)
    assert gaps[j] > 1e-3
    assert (gates > limit).any() and (ups > limit).any() and (gates < limit).any()
    inputs = tuple(t.requires_grad_(True) for t in (x, w, w13, w2, sw13, sw2))
    assert torch.autograd.gradcheck(
        lambda x_, w_, w13_, w2_, sw13_, sw2_: moe_reference(x_, ids, w_, w13_, w2_, sw13_, sw2_, limit,
                                                             compute_dtype=f64), inputs)
