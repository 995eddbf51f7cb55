"""kittenmoe under torchtitan's MoE layers (kittenmoe.integrations.torchtitan).

A tiny torchtitan ``MoE`` (T = 16 tokens as 2 x 8, H = 64, I = 32, E = 4, K = 2) built from its configs on
the CPU; a deep copy runs its routed experts through kittenmoe. The output, a loss, and the gradients of x and
every parameter (router, routed and shared experts) equal torchtitan's own at the tolerances of
``kittenmoe.testing``, on both backends; unsupported layers raise ``NotImplementedError`` naming what is
missing.

torchtitan's ``GroupedExperts`` casts x and the weights to bf16 for ``torch._grouped_mm`` whatever their dtype,
so its fp32 layer computes in bf16. The fp32 truth here is torchtitan's code unchanged with that cast made a
no-op (``_torchtitan_in_fp32``); the bf16 test compares with torchtitan as it runs.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (pip install -e '.[torchtitan]')")

import kittenmoe.integrations.torchtitan as ktt  # noqa: E402
from kittenmoe.testing import assert_bitwise_equal, assert_close  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
    MinimalAsyncEPTokenDispatcher,
)

# The router's gate runs under torch.autocast(float32), which CPU autocast declines with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")

B, L, H, I, E, K = 2, 8, 64, 32, 4, 2
ROOT = Path(__file__).resolve().parents[1]


def _moe(score_func="softmax", route_norm=False, route_scale=1.0, groups=None, shared=True,
         dispatcher=LocalTokenDispatcher, experts=GroupedExperts, seed=0) -> MoE:
    """A torchtitan MoE layer from its configs, weights ~ N(0, 1/fan_in) from ``seed`` (GroupedExperts has no
    initialiser of its own: torchtitan's model configs supply one)."""
    router = TokenChoiceTopKRouter.Config(
        num_experts=E, gate=Linear.Config(in_features=H, out_features=E), top_k=K, score_func=score_func,
        route_norm=route_norm, route_scale=route_scale, num_expert_groups=groups,
        num_limited_groups=None if groups is None else 1)
    routed = RoutedExperts.Config(inner_experts=experts.Config(dim=H, hidden_dim=I, num_experts=E),
                                  token_dispatcher=dispatcher.Config(num_experts=E, top_k=K))
    ffn = FeedForward.Config(w1=Linear.Config(in_features=H, out_features=I),
                             w2=Linear.Config(in_features=I, out_features=H),
                             w3=Linear.Config(in_features=H, out_features=I)) if shared else None
    layer = MoE.Config(num_experts=E, router=router, routed_experts=routed, shared_experts=ffn).build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return layer


def _step(layer: MoE, x_BLD: torch.Tensor, d_out_BLD: torch.Tensor):
    """Output, loss and the gradients of x and every parameter (zeros where autograd gave none)."""
    layer.zero_grad(set_to_none=True)
    x_BLD = x_BLD.detach().clone().requires_grad_(True)
    out_BLD = layer(x_BLD)
    loss = (out_BLD.float() * d_out_BLD).sum()
    loss.backward()
    grads = {"x": x_BLD.grad}
    grads.update({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()})
    return out_BLD.detach(), loss.detach(), grads


def _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD):
    """torchtitan's own layer, its bf16 cast before the grouped GEMMs made a no-op: its math in fp32."""
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "bfloat16", lambda self: self)
        return _step(layer, x_BLD, d_out_BLD)


def _inputs(seed=1, dtype=torch.float32, length=L):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, length, H, generator=g).to(dtype), torch.randn(B, length, H, generator=g)


def _count_calls(monkeypatch):
    calls = []
    real_moe = ktt.moe
    monkeypatch.setattr(ktt, "moe", lambda *a, **kw: calls.append(a) or real_moe(*a, **kw))
    return calls


def _assert_matches(got, want, dtype):
    (out_k, loss_k, grads_k), (out_t, loss_t, grads_t) = got, want
    assert_close(out_k, out_t, dtype, "out")
    assert_close(loss_k.reshape(1), loss_t.reshape(1), dtype, "loss")
    assert sorted(grads_k) == sorted(grads_t)
    for n in grads_t:
        assert_close(grads_k[n], grads_t[n], dtype, f"d {n}")


def _skewed(layer: MoE) -> MoE:
    # expert_bias only steers the choice (the scores stay unbiased): every token picks experts 0 and 1
    layer.expert_bias_E.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    return layer


CASES = {
    # softmax scores, a shared expert beside the routed ones, the EP = 1 LocalTokenDispatcher
    "softmax-shared": lambda: _moe(),
    # sigmoid scores renormalised and scaled (not summing to 1), node-limited routing over 2 groups, no shared
    # expert, and the AllToAllTokenDispatcher torchtitan's "standard" comm backend builds on one GPU (no EP mesh)
    "sigmoid-norm-scale-groups-alltoall": lambda: _moe(score_func="sigmoid", route_norm=True, route_scale=2.5,
                                                       groups=2, shared=False, dispatcher=AllToAllTokenDispatcher),
    # skewed routing: experts 2 and 3 get no token, so their weight gradients must be zero as torchtitan's are
    "two-empty-experts": lambda: _skewed(_moe()),
}


@pytest.mark.parametrize("backend", ["torch", "megakernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torchtitan_fp32(case, backend, monkeypatch):
    """Output, loss and every gradient equal torchtitan's fp32 math at fp32 tolerances; the kittenmoe path ran
    (counted) and the layer kept torchtitan's parameters and state dict."""
    layer = CASES[case]()
    x_BLD, d_out_BLD = _inputs()
    want = _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD)
    swapped = copy.deepcopy(layer)
    assert ktt.apply_kittenmoe(swapped, ktt.Options(backend=backend)) == 1
    assert isinstance(swapped.routed_experts, RoutedExperts)
    assert swapped.state_dict().keys() == layer.state_dict().keys()
    calls = _count_calls(monkeypatch)
    got = _step(swapped, x_BLD, d_out_BLD)
    assert len(calls) == 1
    _assert_matches(got, want, torch.float32)
    if case == "two-empty-experts":
        for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
            assert got[2][f"routed_experts.inner_experts.{n}"][2:].abs().sum() == 0


def test_matches_torchtitan_bf16():
    """A bf16 layer on bf16 activations (what torchtitan's FSDP mixed precision runs): kittenmoe against
    torchtitan as it runs, at the bf16 tolerance (torchtitan rounds each weighted row to bf16 and sums in bf16;
    kittenmoe sums a token's K rows in fp32)."""
    layer = _moe().to(torch.bfloat16)
    x_BLD, d_out_BLD = _inputs(dtype=torch.bfloat16)
    want = _step(layer, x_BLD, d_out_BLD)
    swapped = copy.deepcopy(layer)
    ktt.apply_kittenmoe(swapped, ktt.Options(backend="torch"))
    _assert_matches(_step(swapped, x_BLD, d_out_BLD), want, torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "megakernel"])
@pytest.mark.parametrize("fused", [
    False,  # w13 = cat(w1, w3) in the graph
    True,  # fuse_gate_up_storage: the dense w13_E2FD parameter as it is, w1_EFD / w3_EFD properties unread
])
def test_compiles_fullgraph(backend, fused):
    """The swapped layer (router, kittenmoe experts, shared expert) under ``torch.compile(fullgraph=True)``: no
    graph break, and output and every gradient equal the uncompiled swapped layer's."""
    layer = _moe()
    ktt.apply_kittenmoe(layer, ktt.Options(backend=backend))
    if fused:
        assert ktt.fuse_gate_up_storage(layer) == 1
    x_BLD, d_out_BLD = _inputs()
    want = _step(layer, x_BLD, d_out_BLD)
    layer.compile(fullgraph=True, backend="aot_eager")  # (in place: the parameter names stay)
    _assert_matches(_step(layer, x_BLD, d_out_BLD), want, torch.float32)


def test_no_tokens(monkeypatch):
    """L = 0 (an empty micro-batch): [B, 0, H] out and zero gradients, as torchtitan gives."""
    layer = _moe()
    x_BLD, d_out_BLD = _inputs(length=0)
    want = _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD)
    swapped = copy.deepcopy(layer)
    ktt.apply_kittenmoe(swapped, ktt.Options(backend="torch"))
    got = _step(swapped, x_BLD, d_out_BLD)
    assert got[0].shape == (B, 0, H)
    _assert_matches(got, want, torch.float32)


W1, W3, W13 = (f"routed_experts.inner_experts.{n}" for n in ("w1_EFD", "w3_EFD", "w13_E2FD"))


def _swapped(layer: MoE, backend="torch", fused=False) -> MoE:
    """A deep copy of ``layer`` through kittenmoe, its gate and up fused into one parameter if ``fused``."""
    swapped = copy.deepcopy(layer)
    ktt.apply_kittenmoe(swapped, ktt.Options(backend=backend))
    if fused:
        assert ktt.fuse_gate_up_storage(swapped) == 1
    return swapped


def _fused_moe(**kw) -> MoE:
    """``_moe(**kw)`` with its gate and up fused, torchtitan's forward kept."""
    layer = _moe(**kw)
    assert ktt.fuse_gate_up_storage(layer) == 1
    return layer


def _as_torchtitan(grads):
    """A fused layer's gradients under torchtitan's names: w13_E2FD's gate and up halves as w1_EFD and w3_EFD."""
    out = {n: g for n, g in grads.items() if n != W13}
    if W13 in grads:
        out[W1], out[W3] = grads[W13].chunk(2, dim=1)
    return out


def test_fused_gate_up_is_one_dense_parameter_read_in_place(monkeypatch):
    """fuse_gate_up_storage leaves one gate|up parameter, w13_E2FD, dense, holding cat(w1, w3); w1_EFD and
    w3_EFD are views of its halves with the old values; kittenmoe gets the parameter itself (no cat, no copy);
    a second call changes nothing; the views cannot be reassigned."""
    layer = _moe()
    ktt.apply_kittenmoe(layer, ktt.Options(backend="torch"))
    experts = layer.routed_experts.inner_experts
    w1_EFD, w3_EFD = experts.w1_EFD.detach().clone(), experts.w3_EFD.detach().clone()
    calls = _count_calls(monkeypatch)
    _step(layer, *_inputs())
    assert calls[0][3].data_ptr() != experts.w1_EFD.data_ptr()  # unfused: the cat's own copy
    assert ktt.fuse_gate_up_storage(layer) == 1
    assert type(experts) is ktt.FusedGateUpExperts and isinstance(experts, GroupedExperts)
    assert [n for n, _ in experts.named_parameters()] == ["w13_E2FD", "w2_EDF"]
    w13 = experts.w13_E2FD
    assert w13.shape == (E, 2 * I, H) and w13.is_contiguous() and w13.requires_grad
    assert_bitwise_equal(experts.w1_EFD, w1_EFD, "w1_EFD")
    assert_bitwise_equal(experts.w3_EFD, w3_EFD, "w3_EFD")
    assert experts.w1_EFD.data_ptr() == w13.data_ptr()
    assert experts.w3_EFD.data_ptr() == w13.data_ptr() + I * H * w13.element_size()
    _step(layer, *_inputs(seed=2))
    assert calls[1][3] is w13  # the parameter as it is: kittenmoe's d_w13 is its gradient
    assert w13.grad.shape == w13.shape and w13.grad.is_contiguous()
    assert ktt.fuse_gate_up_storage(layer) == 1 and experts.w13_E2FD is w13
    with pytest.raises(NotImplementedError, match="w1_EFD of a FusedGateUpExperts is a view of w13_E2FD"):
        experts.w1_EFD = torch.nn.Parameter(w1_EFD)
    with pytest.raises(NotImplementedError, match="w3_EFD of a FusedGateUpExperts is a view of w13_E2FD"):
        experts.w3_EFD = w3_EFD


@pytest.mark.parametrize("backend", ["torch", "megakernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_unfused_bitwise(case, backend, monkeypatch):
    """The fused layer gives the unfused kittenmoe layer's output, loss and gradients bit for bit (w13_E2FD's
    gradient is the unfused w1 and w3 gradients concatenated), and torchtitan's fp32 math at fp32 tolerances."""
    layer = CASES[case]()
    x_BLD, d_out_BLD = _inputs()
    want = _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD)
    out_u, loss_u, grads_u = _step(_swapped(layer, backend), x_BLD, d_out_BLD)
    out_f, loss_f, grads_f = got = _step(_swapped(layer, backend, fused=True), x_BLD, d_out_BLD)
    assert_bitwise_equal(out_f, out_u, "out")
    assert_bitwise_equal(loss_f.reshape(1), loss_u.reshape(1), "loss")
    assert sorted(grads_f) == sorted([n for n in grads_u if n not in (W1, W3)] + [W13])
    assert_bitwise_equal(grads_f[W13], torch.cat([grads_u[W1], grads_u[W3]], dim=1), "d w13_E2FD")
    for n in grads_f:
        if n != W13:
            assert_bitwise_equal(grads_f[n], grads_u[n], f"d {n}")
    _assert_matches(got[:2] + (_as_torchtitan(grads_f),), want, torch.float32)


def test_fused_state_dict_is_torchtitans(tmp_path):
    """A fused model's state dict has torchtitan's keys in its order and its values (the gate and up as views of
    w13_E2FD); it loads into an unfused model, an unfused one loads into it (in place, w13_E2FD kept), also
    through torch.save / torch.load."""
    unfused, fused = _moe(), _fused_moe()
    w13 = fused.routed_experts.inner_experts.w13_E2FD
    want, got = unfused.state_dict(), fused.state_dict()
    assert list(got) == list(want)
    for n in want:
        assert_bitwise_equal(got[n], want[n], n)
    assert got[W1].data_ptr() == w13.data_ptr() and got[W3].data_ptr() == w13[:, I:].data_ptr()

    other = _moe(seed=5)  # other values to load
    fused.load_state_dict(other.state_dict())
    assert fused.routed_experts.inner_experts.w13_E2FD is w13
    for n, v in other.state_dict().items():
        assert_bitwise_equal(fused.state_dict()[n], v, f"fused <- unfused {n}")
    unfused.load_state_dict(fused.state_dict())
    for n, v in other.state_dict().items():
        assert_bitwise_equal(unfused.state_dict()[n], v, f"unfused <- fused {n}")

    torch.save(_moe(seed=6).state_dict(), tmp_path / "unfused.pt")
    fused.load_state_dict(torch.load(tmp_path / "unfused.pt"))
    torch.save(fused.state_dict(), tmp_path / "fused.pt")
    unfused.load_state_dict(torch.load(tmp_path / "fused.pt"))
    for n, v in _moe(seed=6).state_dict().items():
        assert_bitwise_equal(unfused.state_dict()[n], v, f"through torch.save {n}")


@pytest.mark.parametrize("edit, match", [
    # a half missing: strict loading names torchtitan's key, not w13_E2FD
    (lambda sd: sd.pop(W3), f'Missing key\\(s\\) in state_dict: "{W3}"\\. $'),
    # both halves missing
    (lambda sd: (sd.pop(W1), sd.pop(W3)), f'Missing key\\(s\\) in state_dict: "{W1}", "{W3}"\\. $'),
    # fused's own parameter is no key of its state dict: unexpected, as for an unfused model
    (lambda sd: sd.update({W13: torch.randn(E, 2 * I, H)}), f'Unexpected key\\(s\\) in state_dict: "{W13}"'),
    # a half of the wrong shape: torch's size-mismatch message, under torchtitan's name
    (lambda sd: sd.update({W1: torch.randn(E, I + 1, H)}),
     f"size mismatch for {W1}: copying a param with shape torch.Size\\(\\[4, 33, 64\\]\\)"),
])
def test_fused_strict_load_refuses(edit, match):
    """Strict loading into a fused model fails as it fails for an unfused one, naming torchtitan's keys."""
    sd = dict(_moe(seed=5).state_dict())
    edit(sd)
    for layer in (_moe(), _fused_moe()):
        with pytest.raises(RuntimeError, match=match):
            layer.load_state_dict(sd)


def test_fused_non_strict_and_assign_load():
    """strict=False with one half given loads that half into its view and reports the other missing, as an
    unfused model does; assign=True makes the loaded tensors the new (dense) w13_E2FD."""
    source = _moe(seed=5).state_dict()
    fused = _fused_moe()
    experts = fused.routed_experts.inner_experts
    w3_EFD = experts.w3_EFD.detach().clone()
    result = fused.load_state_dict({k: v for k, v in source.items() if k != W3}, strict=False)
    assert result.missing_keys == [W3] and result.unexpected_keys == []
    assert_bitwise_equal(experts.w1_EFD, source[W1], "w1_EFD loaded")
    assert_bitwise_equal(experts.w3_EFD, w3_EFD, "w3_EFD kept")
    fused.load_state_dict(_moe(seed=7).state_dict(), assign=True)
    w13 = experts.w13_E2FD
    assert isinstance(w13, torch.nn.Parameter) and w13.is_contiguous() and w13.requires_grad
    for n, v in _moe(seed=7).state_dict().items():
        assert_bitwise_equal(fused.state_dict()[n], v, f"assigned {n}")


def test_fused_adamw_step_matches_unfused():
    """Two foreach AdamW steps on the fused layer update w13_E2FD's halves as they update the unfused w1_EFD and
    w3_EFD, bit for bit; every fused parameter is dense (the foreach fast path)."""
    layer = _moe()
    models = [_swapped(layer), _swapped(layer, fused=True)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in models]
    assert all(p.is_contiguous() for p in models[1].parameters())
    for seed in (1, 2):
        x_BLD, d_out_BLD = _inputs(seed=seed)
        for model, opt in zip(models, opts):
            _step(model, x_BLD, d_out_BLD)
            opt.step()
    unfused, fused = (m.state_dict() for m in models)
    assert not torch.equal(unfused[W1], layer.state_dict()[W1])  # (the step moved them)
    for n in unfused:
        assert_bitwise_equal(fused[n], unfused[n], n)


@pytest.mark.parametrize("kittenmoe_first", [
    False,  # fused on a torchtitan model kittenmoe never touched
    True,  # fused under kittenmoe, then remove_kittenmoe: the experts stay fused, apply_kittenmoe takes them again
])
def test_fused_under_torchtitans_forward(kittenmoe_first, monkeypatch):
    """torchtitan's own forward on fused experts (it reads the w1_EFD / w3_EFD views) gives its unfused
    output and gradients at fp32 tolerances."""
    layer = _moe()
    x_BLD, d_out_BLD = _inputs()
    want = _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD)
    fused = copy.deepcopy(layer)
    if kittenmoe_first:
        ktt.apply_kittenmoe(fused)
    assert ktt.fuse_gate_up_storage(fused) == 1
    if kittenmoe_first:
        assert ktt.remove_kittenmoe(fused) == 1
    calls = _count_calls(monkeypatch)
    out_BLD, loss, grads = _torchtitan_in_fp32(monkeypatch, fused, x_BLD, d_out_BLD)
    assert not calls
    _assert_matches((out_BLD, loss, _as_torchtitan(grads)), want, torch.float32)
    assert ktt.apply_kittenmoe(fused) == 1


def _grouped_experts_config(init_w1):
    return RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E, param_init={
            "w1_EFD": init_w1, "w2_EDF": partial(torch.nn.init.normal_, std=0.5),
            "w3_EFD": partial(torch.nn.init.trunc_normal_, std=0.7)}),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))


@pytest.mark.parametrize("init_w1", [
    # torchtitan's truncated normal (normal_ draws: a strided view would draw other values on the CPU)
    partial(torch.nn.init.trunc_normal_, std=0.02),
    # an initialiser that replaces its tensor's data instead of writing into it
    lambda w: setattr(w, "data", torch.randn(w.shape) * 0.05),
])
def test_fused_init_states_gives_torchtitans_values(init_w1):
    """Built on the meta device, fused there, then to_empty and init_states (torchtitan's flow): torchtitan's
    param_init entries fill w13_E2FD's halves, and a seed gives the unfused values."""
    cfg = _grouped_experts_config(init_w1)
    models = []
    for fused in (False, True):
        with torch.device("meta"):
            routed = cfg.build()
        if fused:
            assert ktt.fuse_gate_up_storage(routed) == 1
        routed.to_empty(device="cpu")
        torch.manual_seed(3)
        routed.init_states()
        models.append(routed)
    w13 = models[1].inner_experts.w13_E2FD
    assert w13.device.type == "cpu" and w13.is_contiguous()
    unfused, fused = (m.state_dict() for m in models)
    assert list(fused) == list(unfused)
    for n in unfused:
        assert_bitwise_equal(fused[n], unfused[n], n)
    assert fused["inner_experts.w3_EFD"].std() > 0.3  # (each half got its own initialiser)


@pytest.mark.parametrize("spoil, match", [
    # a frozen gate beside a trained up projection: one parameter has one requires_grad
    (lambda e: e.w1_EFD.requires_grad_(False), "one shape, dtype, device and requires_grad"),
    # the up projection in another dtype
    (lambda e: setattr(e, "w3_EFD", torch.nn.Parameter(e.w3_EFD.detach().double())), "one shape, dtype"),
    # a gradient on the gate alone (one .grad for the fused parameter)
    (lambda e: setattr(e.w1_EFD, "grad", torch.randn(E, I, H)), "gradient on only one of w1_EFD and w3_EFD"),
])
def test_fuse_refuses_and_leaves_the_model(spoil, match):
    """What one dense parameter cannot hold is refused with NotImplementedError, before any module changes."""
    layer = _moe()
    spoil(layer.routed_experts.inner_experts)
    before = list(layer.named_parameters())
    with pytest.raises(NotImplementedError, match=match):
        ktt.fuse_gate_up_storage(layer)
    assert type(layer.routed_experts.inner_experts) is GroupedExperts
    assert list(layer.named_parameters()) == before


def test_remove_gives_torchtitan_back(monkeypatch):
    layer = _moe()
    ktt.apply_kittenmoe(layer)
    assert type(layer.routed_experts) is ktt.KittenmoeRoutedExperts
    assert ktt.remove_kittenmoe(layer) == 1
    assert type(layer.routed_experts) is RoutedExperts
    calls = _count_calls(monkeypatch)
    layer(_inputs()[0])
    assert not calls


def _gpt_oss():
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    return _moe(experts=GptOssGroupedExperts)


def _fused():
    from torchtitan.overrides.fused_swiglu import FusedGroupedExperts

    return _moe(experts=FusedGroupedExperts)


def _ep_dispatcher():
    layer = _moe()
    # made without __init__: its real one needs CUDA; the class alone is what apply_kittenmoe refuses
    layer.routed_experts.token_dispatcher = object.__new__(MinimalAsyncEPTokenDispatcher)
    return layer


def _parallelized():
    layer = _moe()
    # what Module.parallelize leaves behind: the forward wrapped on the instance
    layer.routed_experts.forward = layer.routed_experts.forward
    return layer


@pytest.mark.parametrize("build, match", [
    (_gpt_oss, "GptOssGroupedExperts experts with expert biases"),  # biases, clamped SwiGLU, interleaved rows
    (_fused, "FusedGroupedExperts experts with interleaved gate.up"),  # w13 [E, F, 2, D]
    (_ep_dispatcher, "expert parallelism through MinimalAsyncEPTokenDispatcher"),  # an EP-only dispatcher
    (_parallelized, "already wrapped by torchtitan's parallelize"),  # forward already wrapped on the instance
])
def test_unsupported_refused_at_apply(build, match):
    """Refused with NotImplementedError naming what is missing, and nothing swapped."""
    layer = build()
    with pytest.raises(NotImplementedError, match=match):
        ktt.apply_kittenmoe(layer)
    assert type(layer.routed_experts) is RoutedExperts


def test_unsupported_refused_at_call():
    """What only a call shows: an EP mesh wired into the all-to-all dispatcher by parallelize, activations in
    another dtype than the weights."""
    layer = _moe(dispatcher=AllToAllTokenDispatcher)
    ktt.apply_kittenmoe(layer, ktt.Options(backend="torch"))
    layer.routed_experts.token_dispatcher.ep_mesh = object()  # stands for a DeviceMesh of EP ranks
    with pytest.raises(NotImplementedError, match="expert parallelism .AllToAllTokenDispatcher with an EP mesh"):
        layer(_inputs()[0])
    layer.routed_experts.token_dispatcher.ep_mesh = None
    with pytest.raises(NotImplementedError, match="x in torch.float64 with expert weights in torch.float32"):
        layer.routed_experts(*_routed_inputs(layer, _inputs()[0].double()))


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo group in this process and a CPU DeviceMesh over it, destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_replicated_dtensor_weights(one_rank_mesh, monkeypatch):
    """Expert weights as DTensors replicated on every mesh axis (FSDP's unsharded parameters under a
    full-DTensor backend) run on their local tensors, as torchtitan's GroupedExperts does, with the same
    gradients; a sharded one (tensor parallelism) is refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    layer = _moe()
    experts = layer.routed_experts.inner_experts
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        w = getattr(experts, n).detach()
        setattr(experts, n, torch.nn.Parameter(distribute_tensor(w, one_rank_mesh, [Replicate()])))
    x_BLD, d_out_BLD = _inputs()
    want = _torchtitan_in_fp32(monkeypatch, layer, x_BLD, d_out_BLD)
    swapped = copy.deepcopy(layer)
    ktt.apply_kittenmoe(swapped, ktt.Options(backend="torch"))
    got = _step(swapped, x_BLD, d_out_BLD)
    local = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
    _assert_matches(got[:2] + ({n: local(g) for n, g in got[2].items()},),
                    want[:2] + ({n: local(g) for n, g in want[2].items()},), torch.float32)
    with pytest.raises(NotImplementedError, match="fuse_gate_up_storage needs plain tensors, not DTensor"):
        ktt.fuse_gate_up_storage(swapped)
    sharded = distribute_tensor(experts.w1_EFD.detach().full_tensor(), one_rank_mesh, [Shard(1)])
    swapped.routed_experts.inner_experts.w1_EFD = torch.nn.Parameter(sharded)
    with pytest.raises(NotImplementedError, match=r"w1_EFD sharded as a DTensor \(Shard\(dim=1\),\)"):
        swapped(x_BLD)


def _routed_inputs(layer: MoE, x_BLD):
    scores_BLK, ids_BLK, _ = layer.router(x_BLD.float())
    return x_BLD, scores_BLK, ids_BLK, torch.zeros(E)


def test_options_checked():
    with pytest.raises(ValueError, match="unknown MoE backend"):
        ktt.Options(backend="cuda")
    with pytest.raises(TypeError, match="Options.config"):
        ktt.Options(config={"block_m": 16})
    with pytest.raises(TypeError, match="options must be"):
        ktt.apply_kittenmoe(_moe(), {"backend": "torch"})


# ----------------------------------------------------------------------------- GPU


def _cuda_bf16(layer: MoE) -> MoE:
    return layer.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [
    False,  # w13 = cat(w1, w3) each forward
    True,  # fuse_gate_up_storage: the dense w13_E2FD parameter read in place
])
def test_gpu_bf16_megakernel_matches_torchtitan(fused):
    """A bf16 layer on CUDA through the megakernel against torchtitan's own grouped GEMMs, at the bf16
    tolerance: output, loss and every gradient."""
    layer = _cuda_bf16(_moe())
    x_BLD, d_out_BLD = (t.cuda() for t in _inputs(dtype=torch.bfloat16))
    want = _step(layer, x_BLD, d_out_BLD)
    swapped = copy.deepcopy(layer)
    ktt.apply_kittenmoe(swapped, ktt.Options(backend="megakernel"))
    if fused:
        assert ktt.fuse_gate_up_storage(swapped) == 1
    _assert_matches(_step(swapped, x_BLD, d_out_BLD), want, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_compiled_matches_uncompiled():
    """The swapped bf16 layer with its fused gate|up parameter under torch.compile(fullgraph=True) with Inductor on
    CUDA: the same output and gradients as uncompiled, within bf16 (Inductor fuses the router's ops)."""
    layer = _cuda_bf16(_moe())
    ktt.apply_kittenmoe(layer, ktt.Options(backend="megakernel"))
    ktt.fuse_gate_up_storage(layer)
    x_BLD, d_out_BLD = (t.cuda() for t in _inputs(dtype=torch.bfloat16))
    want = _step(layer, x_BLD, d_out_BLD)
    layer.compile(fullgraph=True)
    _assert_matches(_step(layer, x_BLD, d_out_BLD), want, torch.bfloat16)


def test_import_without_torchtitan_names_the_extra():
    """kittenmoe never imports torchtitan; the integration, without it, raises an ImportError with the fix."""
    code = ("import sys\n"
            "import kittenmoe, kittenmoe.integrations\n"
            "assert 'torchtitan' not in sys.modules\n"
            "sys.modules['torchtitan.models.common.moe'] = None  # as if torchtitan (0.3) were not installed\n"
            "import kittenmoe.integrations.torchtitan\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                      if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ImportError: kittenmoe.integrations.torchtitan needs torchtitan 0.3.0" in proc.stderr, proc.stderr
    assert "pip install 'kittenmoe[torchtitan]'" in proc.stderr
