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
    True,  # fuse_gate_up_storage: the as_strided view of the shared buffer, through its autograd.Function
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


def test_fused_gate_up_storage_reads_in_place(monkeypatch):
    """After fuse_gate_up_storage, kittenmoe gets w1|w3's shared buffer (no cat), the parameter objects and
    values are kept, and the output and gradients are the cat path's bit for bit."""
    layer = _moe()
    ktt.apply_kittenmoe(layer, ktt.Options(backend="torch"))
    x_BLD, d_out_BLD = _inputs()
    calls = _count_calls(monkeypatch)
    want = _step(layer, x_BLD, d_out_BLD)
    experts = layer.routed_experts.inner_experts
    assert calls[0][3].data_ptr() != experts.w1_EFD.data_ptr()  # the cat's own copy
    w1, w3, values = experts.w1_EFD, experts.w3_EFD, copy.deepcopy(layer.state_dict())
    assert ktt.fuse_gate_up_storage(layer) == 1
    assert experts.w1_EFD is w1 and experts.w3_EFD is w3
    for n, v in layer.state_dict().items():
        assert_bitwise_equal(v, values[n], n)
    got = _step(layer, x_BLD, d_out_BLD)
    w13 = calls[1][3]
    assert w13.data_ptr() == w1.data_ptr() and w13.shape == (E, 2 * I, H) and w13.is_contiguous()
    assert_bitwise_equal(got[0], want[0], "out")
    for n in want[2]:
        assert_bitwise_equal(got[2][n], want[2][n], f"d {n}")


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
    True,  # fuse_gate_up_storage: the shared buffer read in place
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
    """The swapped bf16 layer with its fused gate|up buffer under torch.compile(fullgraph=True) with Inductor on
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
