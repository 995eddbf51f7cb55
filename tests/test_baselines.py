"""The single-GPU PyTorch baseline ``grouped_mm_forward`` against the reference (one process, CPU).

fp32 inputs; the reference runs in fp64 on the same values. Outputs and the
gradients w.r.t. x, the router weights, the expert weights and the shared
expert weights are compared at the fp32 tolerance (gradients on the
reference's RMS scale, as in tests/test_torch_backend.py). The multi-process
``all_to_all_forward`` baseline is tested in tests/test_distributed.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kittenmoe.baselines import grouped_mm_forward
from kittenmoe.config import TEST_SHAPES, ModelShape
from kittenmoe.reference import moe_reference
from kittenmoe.testing import ROUTINGS, assert_bitwise_equal, assert_close, make_weights, routing_few_experts

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4
SMALL = TEST_SHAPES["small"]  # E=16, H=128, I=64, K=4


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    t: int
    routing: str = "uniform"  # a key of ROUTINGS, or "few_experts"
    swiglu_limit: float | None = None
    shared: bool = True
    hot: int = 0


CASES = {
    # balanced routing, shared expert, no clamp
    "uniform": Case(TINY, t=24),
    # no shared expert: the output is the routed sum only
    "no-shared": Case(TINY, t=24, shared=False),
    # SwiGLU clamp active (L=0.3, well inside the O(1) pre-activations), routed and shared experts
    "limit-0.3": Case(TINY, t=24, swiglu_limit=0.3),
    # clamp without a shared expert, K=4 shape
    "limit-1.5-no-shared": Case(TINY_SIG, t=16, swiglu_limit=1.5, shared=False),
    # skewed (zipf) load at H=128
    "zipf-small": Case(SMALL, t=32, routing="zipf"),
    # zero-token experts: only experts 0..2 are ever chosen (empty grouped_mm groups)
    "zero-token-experts": Case(TINY, t=16, routing="few_experts"),
    # every route to the last expert (K=1): one group holds all rows, the rest are empty
    "one-hot-K1-last": Case(TINY.with_(k=1), t=12, routing="one_hot", hot=TINY.e - 1),
    # a single token
    "T1": Case(TINY, t=1),
    # T=7, an odd token count with K=4 (28 routes over 16 experts)
    "T7-K4": Case(TINY_SIG, t=7),
}


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = case.shape
    x = torch.randn(case.t, s.h, generator=gen)
    if case.routing == "few_experts":
        ids, w = routing_few_experts(case.t, s.e, s.k, [0, 1, 2], generator=gen)
    elif case.routing == "one_hot":
        ids, w = ROUTINGS["one_hot"](case.t, s.e, s.k, hot=case.hot, generator=gen)
    else:
        ids, w = ROUTINGS[case.routing](case.t, s.e, s.k, generator=gen)
    mw = make_weights(s, generator=gen, shared=case.shared)
    grad = torch.randn(case.t, s.h, generator=gen)
    return x, ids.contiguous(), w.float().contiguous(), mw, grad


def _run(fn, x, ids, w, mw, grad, dtype, **kw):
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True)
              for t in (x, w, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS)]
    lx, lw, w13, w2, sw13, sw2 = leaves
    out = fn(lx, ids, lw, w13, w2, sw13, sw2, **kw)
    (out.double() * grad.double()).sum().backward()
    names = ("d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2")
    grads = {n: t.grad for n, t in zip(names, leaves, strict=True) if t is not None}
    for n, g in grads.items():
        assert g is not None, f"{n}: no gradient"
    return out.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_mm_matches_reference(name):
    case = CASES[name]
    x, ids, w, mw, grad = _inputs(case)
    out, grads = _run(grouped_mm_forward, x, ids, w, mw, grad, torch.float32, swiglu_limit=case.swiglu_limit)
    ref, ref_grads = _run(moe_reference, x, ids, w, mw, grad, torch.float64, swiglu_limit=case.swiglu_limit,
                          compute_dtype=torch.float64)
    assert out.dtype == torch.float32
    assert_close(out, ref.float(), "fp32", "out")
    assert sorted(grads) == sorted(ref_grads)
    for n, g in grads.items():
        rg = ref_grads[n].double()
        dims = tuple(range(1, rg.dim())) if n in ("d_w13", "d_w2") else tuple(range(rg.dim()))
        scale = rg.pow(2).mean(dim=dims, keepdim=True).sqrt().clamp_min(1e-30)
        assert_close(g.double() / scale, rg.float().double() / scale, "fp32", n)
    used = torch.zeros(case.shape.e, dtype=torch.bool)
    used[ids.flatten()] = True
    for n in ("d_w13", "d_w2"):  # nothing dropped, nothing invented
        assert torch.all(grads[n][~used] == 0), f"{n}: nonzero gradient on unused experts"
        assert torch.all(grads[n][used].abs().sum(dim=(1, 2)) > 0), f"{n}: a used expert got 0 grad"


@pytest.mark.parametrize("name", ["limit-0.3", "limit-1.5-no-shared"])
def test_swiglu_limit_changes_the_output(name):
    """The clamp cases would prove nothing if the clamp never bit."""
    case = CASES[name]
    x, ids, w, mw, _ = _inputs(case)
    args = (x, ids, w, mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS)
    clamped = grouped_mm_forward(*args, swiglu_limit=case.swiglu_limit)
    free = grouped_mm_forward(*args)
    assert (clamped - free).abs().max() > 1e-3


def test_grouped_mm_repeatable():
    """Same inputs, same bits."""
    case = CASES["zipf-small"]
    x, ids, w, mw, grad = _inputs(case, seed=4)
    a_out, a_grads = _run(grouped_mm_forward, x, ids, w, mw, grad, torch.float32)
    b_out, b_grads = _run(grouped_mm_forward, x, ids, w, mw, grad, torch.float32)
    assert_bitwise_equal(a_out, b_out, "out")
    for n in a_grads:
        assert_bitwise_equal(a_grads[n], b_grads[n], n)
