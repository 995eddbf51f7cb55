"""The layer stack above the kernels: custom ops (``kittenmoe.autograd``), ``kittenmoe.functional.moe`` and
``kittenmoe.layer.MoELayer``, against the fp64 reference.

Without CUDA the megakernel ops run under the Triton interpreter (conftest sets TRITON_INTERPRET=1) at tiny
shapes with 16-wide tiles; with CUDA the same tests run on the GPU, and the ``gpu``-marked tests add bf16
layer comparisons, ``torch.compile`` of the megakernel layer and CUDA-graph capture of forward + backward.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from kittenmoe import autograd as kag
from kittenmoe.config import TEST_SHAPES, KernelConfig, ModelShape
from kittenmoe.functional import moe
from kittenmoe.layer import MoELayer
from kittenmoe.launch_common import MegakernelError
from kittenmoe.reference import moe_layer_reference, moe_reference
from kittenmoe.testing import ROUTINGS, assert_bitwise_equal, assert_close, make_weights

HAS_CUDA = torch.cuda.is_available()
# Where the megakernel tests run: the GPU when there is one, else CPU tensors under the interpreter.
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2, softmax
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4, sigmoid, scaling 2.0, clamp 1.5
SMALL = TEST_SHAPES["small"]  # E=16, H=128, I=64, K=4, softmax
NO_SHARED = ModelShape("tiny-no-shared", e=8, h=32, i=16, k=3, shared_i=0, score_func="sigmoid",
                       renormalize=False)

# Interpreter-sized knobs: 2 communication programs (+3 compute programs under the interpreter), 16-row
# minibatches and 16-wide tiles, so the tiny shapes still span several minibatches and tiles.
CFG = KernelConfig(num_comm_programs_fwd=2, num_comm_programs_bwd=2, minibatch_size=16, block_m=16, block_n=16,
                   block_k=16, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    t: int
    routing: str = "uniform"  # a key of kittenmoe.testing.ROUTINGS
    shared: bool = True
    swiglu_limit: float | None = None
    ids_dtype: torch.dtype = torch.int64


def _inputs(case: Case, device=DEV, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.t, case.shape.h, generator=gen).to(device, dtype)
    ids, w = ROUTINGS[case.routing](case.t, case.shape.e, case.shape.k, generator=gen)
    mw = make_weights(case.shape, dtype=dtype, device=device, generator=gen, shared=case.shared)
    d_out = torch.randn(case.t, case.shape.h, generator=gen).to(device, dtype)
    return x, ids.to(device, case.ids_dtype).contiguous(), w.float().to(device).contiguous(), mw.tensors(), d_out


def _reference(x, ids, w, weights, swiglu_limit, d_out):
    """fp64 reference output and gradients w.r.t. x, topk_weights and every weight."""
    leaves = [t.detach().double().requires_grad_() for t in [x, w, *weights]]
    wts = leaves[2:] + [None] * (4 - len(weights))
    out = moe_reference(leaves[0], ids, leaves[1], *wts, swiglu_limit, compute_dtype=torch.float64)
    return out.detach(), torch.autograd.grad(out, leaves, d_out.double())


def _run(x, ids, w, weights, swiglu_limit, d_out, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in [x, w, *weights]]
    wts = leaves[2:] + [None] * (4 - len(weights))
    out = moe(leaves[0], ids, leaves[1], *wts, swiglu_limit=swiglu_limit, **kw)
    return out.detach(), torch.autograd.grad(out, leaves, d_out)


GRAD_NAMES = ["d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2"]


def _compare(out, grads, ref_out, ref_grads, dtype, what):
    assert_close(out, ref_out, dtype, f"{what}: out")
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads, strict=False):
        assert g.dtype == (torch.float32 if name == "d_topk_weights" else out.dtype), (name, g.dtype)
        assert_close(g, r, dtype, f"{what}: {name}")


# ----------------------------------------------------------------------------- functional, torch backend

TORCH_CASES = {
    # softmax shape, T=13 (not a multiple of the torch backend's 16-row tile), shared expert
    "tiny-T13": Case(TINY, t=13),
    # K=4 sigmoid shape, skewed (zipf) load, the SwiGLU clamp active in routed and shared experts
    "sig-zipf-limit": Case(TINY_SIG, t=9, routing="zipf", swiglu_limit=1.5),
    # a single token and no shared expert: out is the routed sum only
    "tiny-T1-no-shared": Case(TINY, t=1, shared=False),
    # every token's first route to one expert (the others of a K-window get the rest, most experts none),
    # int32 ids
    "one-hot-int32": Case(TINY, t=20, routing="one_hot", ids_dtype=torch.int32),
}


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_functional_torch_backend_matches_reference(name):
    case = TORCH_CASES[name]
    x, ids, w, weights, d_out = _inputs(case, device="cpu")
    ref = _reference(x, ids, w, weights, case.swiglu_limit, d_out)
    got = _run(x, ids, w, weights, case.swiglu_limit, d_out, backend="torch")
    _compare(*got, *ref, torch.float32, name)
    # "auto" on CPU tensors is the torch backend: the same bits
    auto = _run(x, ids, w, weights, case.swiglu_limit, d_out, backend="auto")
    assert_bitwise_equal(auto[0], got[0], f"{name}: auto vs torch")


# ----------------------------------------------------------------------------- functional, megakernel op

MK_CASES = {
    # softmax shape, T=13 (partial row tiles), shared expert; routed rows span two 16-row minibatches
    "tiny-T13": Case(TINY, t=13),
    # zipf load, clamp active, no shared expert (the op's placeholder gradients), int32 ids
    "zipf-limit-no-shared": Case(TINY, t=7, routing="zipf", swiglu_limit=0.5, shared=False,
                                 ids_dtype=torch.int32),
}


@pytest.mark.parametrize("name", list(MK_CASES))
def test_megakernel_op_forward_matches_reference(name):
    case = MK_CASES[name]
    x, ids, w, weights, d_out = _inputs(case)
    ref_out, _ = _reference(x, ids, w, weights, case.swiglu_limit, d_out)
    wts = weights + [None] * (4 - len(weights))
    out = moe(x, ids, w, *wts, swiglu_limit=case.swiglu_limit, backend="megakernel", config=CFG)
    assert out.dtype == x.dtype and out.device == x.device
    assert_close(out, ref_out.to(out.device), torch.float32, f"{name}: out")


@pytest.mark.parametrize("name", list(MK_CASES))
def test_megakernel_op_backward_matches_reference(name):
    case = MK_CASES[name]
    x, ids, w, weights, d_out = _inputs(case)
    ref = _reference(x, ids, w, weights, case.swiglu_limit, d_out)
    got = _run(x, ids, w, weights, case.swiglu_limit, d_out, backend="megakernel", config=CFG)
    _compare(*got, ref[0].to(DEV), [g.to(DEV) for g in ref[1]], torch.float32, name)


@contextlib.contextmanager
def _error_check(mode):
    old = kag.get_error_check()
    kag.set_error_check(mode)
    try:
        yield
    finally:
        kag.set_error_check(old)


def test_megakernel_op_bad_expert_id_raises():
    """An expert id outside [0, E) is found on device and raised: by the op itself with sync error checking,
    by the next check_errors() with deferred checking (the default; on CPU flags are always read at once)."""
    x, ids, w, weights, _ = _inputs(Case(TINY, t=5))
    ids = ids.clone()
    ids[2, 1] = TINY.e  # one past the last expert
    # raised at once, the message says how many routes and E
    with _error_check("sync"), pytest.raises(MegakernelError, match=rf"outside \[0, E={TINY.e}\) in 1 route"):
        moe(x, ids, w, *weights, backend="megakernel", config=CFG)
    with _error_check("deferred"), pytest.raises(MegakernelError, match="expert ids outside"):
        moe(x, ids, w, *weights, backend="megakernel", config=CFG)
        kag.check_errors()


@pytest.mark.parametrize("limit", [None, 0.7])  # plain SwiGLU, and the clamp whose masks read gate|up
def test_kept_activations_give_the_replays_gradients(limit):
    """Autograd through the op with keep_activations (the forward returns x_routed and gate|up, the backward
    reads them) against keep_activations=False (the backward replays both): the same gradients, bit for bit under
    the interpreter, within fp32 tolerance on a GPU (forward and replay tiles differ there)."""
    import dataclasses

    case = dataclasses.replace(Case(TINY_SIG, t=9), swiglu_limit=limit)
    grads = {}
    for keep in (True, False):
        args, d_out = _op_args(case, DEV, requires_grad=True)
        out = kag.moe_megakernel(*args[:8], config=CFG.with_(keep_activations=keep))
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads[keep] = torch.autograd.grad(out, leaves, d_out)
    for i, (a, b) in enumerate(zip(grads[True], grads[False], strict=True)):
        if HAS_CUDA:
            assert_close(a, b, torch.float32, f"grad {i}")
        else:
            assert_bitwise_equal(a, b, f"grad {i}")


def test_no_activations_kept_without_grad():
    """Under no_grad (or with no input requiring grad) the op keeps nothing: no [NR, 2I] fp32 buffer lives on."""
    args, _ = _op_args(Case(TINY, t=5), DEV, requires_grad=False)
    assert kag._kept_rows(args[0], args[1], args[3], CFG) > 0  # CFG would keep them for a backward
    seen = []
    real = torch.ops.kittenmoe.moe_forward

    class Spy:
        def __call__(self, *a):
            res = real(*a)
            seen.append(res[2].shape[0])
            return res

    orig = torch.ops.kittenmoe.moe_forward
    try:
        torch.ops.kittenmoe.moe_forward = Spy()
        kag.moe_megakernel(*args[:8], config=CFG)
    finally:
        torch.ops.kittenmoe.moe_forward = orig
    assert seen == [0]


# ----------------------------------------------------------------------------- custom ops: opcheck / fake


def _op_args(case: Case, device, requires_grad: bool):
    x, ids, w, weights, d_out = _inputs(case, device=device)
    wts = weights + [None] * (4 - len(weights))
    if requires_grad:
        x, w = x.requires_grad_(), w.requires_grad_()
        wts = [t.requires_grad_() if t is not None else None for t in wts]
    # moe_forward's inputs (x's dtype: moe_backward takes moe_forward_fp8's, kag._NO_FP8 between)
    return (x, ids, w, *wts, case.swiglu_limit), d_out


def test_opcheck_megakernel_forward_op():
    # On a GPU the full opcheck (its AOT-dispatch test runs the backward op through autograd, real and fake).
    # Under the interpreter that costs ~30 s, so there: schema, autograd registration and fake tensor (AOT
    # dispatch runs in the GPU tests).
    args, _ = _op_args(Case(TINY, t=5), DEV, requires_grad=True)
    utils = None if HAS_CUDA else ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.kittenmoe.moe_forward, (*args, *kag.config_to_args(CFG)),
                          **({} if utils is None else {"test_utils": utils}))


def test_opcheck_megakernel_forward_fp8_op():
    """The e4m3 forward op (its own op: the BF16 one takes 9 arguments, not 18): autograd registration and fake
    tensor (opcheck's schema test compares inputs before and after with arithmetic torch has no e4m3 kernel for);
    and autograd through it reaches the bf16 master weights."""
    from kittenmoe.fp8 import FP8Config, FP8ExpertWeights

    shape = ModelShape(name="fp8-op", e=4, h=256, i=128, k=2)  # the e4m3 path needs H, I multiples of 128
    args, _ = _op_args(Case(shape, t=5), DEV, requires_grad=True)
    q = FP8ExpertWeights.quantize(args[3].detach(), args[4].detach(), FP8Config())
    cfg = CFG.with_overrides(block_n=FP8Config().tile_block_n)
    fargs = (*args, q.w13_q, q.w13_scale, q.w2_q, q.w2_scale, q.w13_qt, q.w2_qt, *kag._fp8_flags(q.cfg),
             *kag.config_to_args(cfg))
    torch.library.opcheck(torch.ops.kittenmoe.moe_forward_fp8, fargs,
                          test_utils=("test_autograd_registration", "test_faketensor"))
    out = kag.moe_megakernel(*args[:8], config=cfg, fp8=q)
    d_w13, d_w2 = torch.autograd.grad(out.float().square().sum(), [args[3], args[4]])
    assert d_w13.shape == args[3].shape and d_w2.shape == args[4].shape
    assert torch.isfinite(d_w13).all() and d_w13.abs().sum() > 0


@pytest.mark.parametrize("shared", [True, False])  # the shared gradients, or their [0] placeholders
def test_ops_fake_impls(shared):
    """Fake impls give the real ops' shapes, dtypes and devices (checked without running the ops)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, d_out = _op_args(Case(TINY, t=5, shared=shared), DEV, requires_grad=False)
    fwd, bwd = torch.ops.kittenmoe.moe_forward, torch.ops.kittenmoe.moe_backward
    cfg = kag.config_to_args(CFG)
    expect = [(tuple(args[0].shape), args[0].dtype), (tuple(args[2].shape), torch.float32)]
    expect += [(tuple(t.shape), t.dtype) if t is not None else ((0,), args[3].dtype) for t in args[3:7]]
    x, w13 = args[0], args[3]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out, x_routed, gate_up, shared_gu, schedule = fwd(*fargs, *cfg)
        grads = bwd(mode.from_tensor(d_out), *fargs, *kag._NO_FP8, x_routed, gate_up, shared_gu, schedule, *cfg)
    real = fwd(*args, *cfg)  # the kept activations' and the schedule's shapes come from shapes and config: compare
    fake = (out, x_routed, gate_up, shared_gu, schedule)
    assert [(tuple(t.shape), t.dtype) for t in real] == [(tuple(t.shape), t.dtype) for t in fake]
    assert real[1].shape[0] > 0 and real[2].dtype == x.dtype  # CFG keeps them (resident ring)
    assert (tuple(out.shape), out.dtype, out.device) == (tuple(x.shape), x.dtype, x.device)
    assert gate_up.shape[1] == w13.shape[1]
    # the shared expert's gate|up, every token's, or [0, 0] without a shared expert
    assert tuple(shared_gu.shape) == ((x.shape[0], args[5].shape[0]) if shared else (0, 0))
    assert [(tuple(g.shape), g.dtype) for g in grads] == expect
    assert all(g.device == args[0].device for g in grads)


def test_config_roundtrip_through_op_args():
    cfg = KernelConfig(macrobatch_size=4096, minibatch_size=2048, combine_gather=True, tma=False, wgrad="gluon")
    assert kag.config_from_args(kag.config_to_args(cfg)) == cfg
    with pytest.raises(TypeError, match="KernelConfig"):
        kag.config_to_args({"block_m": 16})


# ----------------------------------------------------------------------------- MoELayer

LAYER_CASES = {
    # softmax shape with a shared expert, [B, S, H] input (the layer flattens and restores leading dims)
    "tiny-3d": (TINY, (2, 5), False),
    # sigmoid scores with routed scaling 2.0 and the SwiGLU clamp, plus a nonzero correction bias that
    # changes which experts are selected (but not the weights)
    "sig-correction-bias": (TINY_SIG, (11,), True),
    # no shared expert (shared_i=0: its parameters are None), sigmoid without renormalisation, K=3
    "no-shared": (NO_SHARED, (3, 3), False),
}


def _layer_reference_grads(layer: MoELayer, x: torch.Tensor, d_out: torch.Tensor):
    sh = layer.shape
    params = [layer.router_w_EH, layer.w13_E2IH, layer.w2_EHI, layer.shared_w13_2SH, layer.shared_w2_HS]
    leaves = [x.detach().double().requires_grad_()]
    leaves += [p.detach().double().requires_grad_() if p is not None else None for p in params]
    bias = layer.correction_bias_E
    out = moe_layer_reference(leaves[0].reshape(-1, sh.h), *leaves[1:], sh.k, sh.score_func, sh.renormalize,
                              sh.routed_scaling_factor, sh.swiglu_limit, bias, compute_dtype=torch.float64)
    inputs = [t for t in leaves if t is not None]
    return out.reshape(x.shape).detach(), torch.autograd.grad(out, inputs, d_out.double().reshape(out.shape))


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_moe_layer_torch_backend_matches_reference_layer(name):
    shape, lead, with_bias = LAYER_CASES[name]
    gen = torch.Generator().manual_seed(1)
    layer = MoELayer(shape, backend="torch", correction_bias=with_bias, generator=gen)
    if with_bias:
        layer.correction_bias_E.copy_(torch.randn(shape.e, generator=gen) * 0.5)
    assert (layer.shared_w13_2SH is None) == (shape.shared_width == 0)
    x = torch.randn(*lead, shape.h, generator=gen, requires_grad=True)
    d_out = torch.randn(*lead, shape.h, generator=gen)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    inputs = [x] + [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, inputs, d_out)
    ref_out, ref_grads = _layer_reference_grads(layer, x, d_out)
    assert_close(out.detach(), ref_out, torch.float32, f"{name}: out")
    names = ["d_x"] + [n for n, _ in layer.named_parameters()]
    assert len(grads) == len(ref_grads) == len(names)
    for n, g, r in zip(names, grads, ref_grads, strict=True):
        assert_close(g, r, torch.float32, f"{name}: {n}")


def test_moe_layer_init_and_state():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = MoELayer(TINY, generator=g1), MoELayer(TINY, generator=g2)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach(), n)  # a seeded generator fixes the init
    # std 1/sqrt(fan_in): routed w13 has fan-in H, w2 fan-in I
    assert abs(a.w13_E2IH.std().item() * TINY.h ** 0.5 - 1) < 0.1
    assert abs(a.w2_EHI.std().item() * TINY.i ** 0.5 - 1) < 0.1
    assert set(a.state_dict()) == {"router_w_EH", "w13_E2IH", "w2_EHI", "shared_w13_2SH", "shared_w2_HS"}
    c = MoELayer(NO_SHARED, correction_bias=True)
    assert set(c.state_dict()) == {"router_w_EH", "w13_E2IH", "w2_EHI", "correction_bias_E"}
    assert "backend='auto'" in repr(a)


# ----------------------------------------------------------------------------- torch.compile (CPU)


def _has_cpp_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


class _Block(nn.Module):
    """A module holding a MoELayer: pre-norm residual MoE FFN."""

    def __init__(self, shape: ModelShape, **kw) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(shape.h, device=kw.get("device"), dtype=kw.get("dtype"))
        self.moe = MoELayer(shape, **kw)

    def forward(self, x):
        return x + self.moe(self.norm(x))


@pytest.mark.skipif(not _has_cpp_compiler(), reason="torch.compile's inductor CPU backend needs a C++ compiler "
                                                    "(g++/c++/clang++), none found on PATH")
def test_torch_compile_fullgraph_torch_backend_cpu():
    """fullgraph compile (inductor) of a module holding MoELayer(backend="torch") runs and matches eager,
    forward and backward; dynamo traces the torch backend directly."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    block = _Block(TINY_SIG, backend="torch", generator=gen)
    x = torch.randn(3, 4, TINY_SIG.h, generator=gen, requires_grad=True)
    d_out = torch.randn(3, 4, TINY_SIG.h, generator=gen)

    def run(fn):
        out = fn(x)
        return out.detach(), torch.autograd.grad(out, [x, *block.parameters()], d_out)

    eager_out, eager_grads = run(block)
    comp_out, comp_grads = run(torch.compile(block, fullgraph=True))
    assert_close(comp_out, eager_out, torch.float32, "compiled out")
    for (n, _), g, e in zip([("x", None), *block.named_parameters()], comp_grads, eager_grads, strict=True):
        assert_close(g, e, torch.float32, f"compiled d_{n}")


# ----------------------------------------------------------------------------- clear errors


def test_bad_backend_names_raise():
    x, ids, w, weights, _ = _inputs(Case(TINY, t=4), device="cpu")
    for bad in ("cuda", "Torch", "triton", ""):
        with pytest.raises(ValueError, match="unknown MoE backend"):
            moe(x, ids, w, *weights, backend=bad)
        with pytest.raises(ValueError, match="unknown MoE backend"):
            MoELayer(TINY, backend=bad)


def test_megakernel_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, ids, w, weights, _ = _inputs(Case(TINY, t=4), device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        moe(x, ids, w, *weights, backend="megakernel", config=CFG)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        MoELayer(TINY, backend="megakernel")
    MoELayer(TINY, backend="auto")  # auto means torch on CPU: fine


def test_bad_inputs_raise():
    x, ids, w, weights, _ = _inputs(Case(TINY, t=4), device="cpu")
    layer = MoELayer(TINY, backend="torch")
    with pytest.raises(ValueError, match=r"\[\.\.\., H=32\]"):
        layer(torch.randn(4, TINY.h + 1))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(4, TINY.h, dtype=torch.float64))  # no silent cast to the weights' dtype
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe(x, ids, w, *weights, swiglu_limit=-1.0)
    with pytest.raises(TypeError, match="KernelConfig"):
        moe(x, ids, w, *weights, config={"block_m": 16})
    with pytest.raises(ValueError, match="w13 must be contiguous"):  # activations are copied, weights never
        moe(x.t().contiguous().t(), ids, w, weights[0].transpose(1, 2).contiguous().transpose(1, 2), *weights[1:])
    with pytest.raises(TypeError, match="ModelShape"):
        MoELayer("tiny")
    with pytest.raises(ValueError, match="'sync' or 'deferred'"):
        kag.set_error_check("lazy")


def test_capture_guards_raise(monkeypatch):
    """What a CUDA-graph capture would hit, checked without one (the guards raise before any launch): sync
    error checking cannot run inside a capture, and a first call with new shapes must not happen there."""
    monkeypatch.setattr(kag, "_capturing", lambda dev: True)
    x, ids, w, weights, _ = _inputs(Case(TINY, t=97))
    with _error_check("sync"):
        with pytest.raises(RuntimeError, match=r"set_error_check\('deferred'\)"):
            moe(x, ids, w, *weights, backend="megakernel", config=CFG)
    with _error_check("deferred"):
        with pytest.raises(RuntimeError, match="warm-up"):
            moe(x, ids, w, *weights, backend="megakernel", config=CFG)


def test_workspace_cache_is_bounded_and_keeps_captured_shapes(monkeypatch):
    """One workspace per (T, H, K, dtype), reused; at most MAX_WORKSPACES_PER_DEVICE kept, least recently used
    out first, except shapes used inside a capture (a graph holds their addresses). No launch happens here."""
    monkeypatch.setattr(kag, "_states", {})
    h, k, n = 8, 2, kag.MAX_WORKSPACES_PER_DEVICE
    st, first = kag._workspace(torch.empty(1001, h, device=DEV), k)
    assert kag._workspace(torch.empty(1001, h, device=DEV), k)[1] is first  # reused
    with monkeypatch.context() as m, _error_check("deferred"):
        m.setattr(kag, "_capturing", lambda dev: True)
        kag._workspace(torch.empty(1001, h, device=DEV), k)  # as if inside a capture: pinned from now on
    for t in range(1, 3 * n):
        kag._workspace(torch.empty(t, h, device=DEV), k)
    keys = list(st.workspaces)
    assert len(keys) == n + 1
    assert (1001, h, k, torch.float32) in keys  # the pinned shape survives
    assert [key[0] for key in keys if key[0] != 1001] == list(range(2 * n, 3 * n))  # the n most recent


# ----------------------------------------------------------------------------- GPU

GPU_CFG = KernelConfig(num_comm_programs_fwd=8, num_comm_programs_bwd=8, minibatch_size=256, block_m=64,
                       block_n=64, block_k=64, num_stages=3, num_warps=4)


def _gpu_layers(shape, cfg, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = MoELayer(shape, dtype=dtype, device="cuda", backend="megakernel", config=cfg, generator=gen)
    tb = MoELayer(shape, dtype=dtype, device="cuda", backend="torch")
    tb.load_state_dict(mk.state_dict())
    return mk, tb


def _fwd_bwd(layer, x, d_out):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], d_out)
    return out.detach(), grads


@pytest.mark.gpu
@pytest.mark.parametrize("cfg_name", [
    "gpu-cfg",  # 64-row tiles, 256-row minibatches: T*K = 1024 routed rows span several minibatches
    "default",  # KernelConfig() defaults (128x128x64 tiles, 2048-row minibatch) on a shape narrower than a tile
])
def test_gpu_layer_megakernel_matches_torch_backend_bf16(cfg_name):
    cfg = GPU_CFG if cfg_name == "gpu-cfg" else KernelConfig()
    mk, tb = _gpu_layers(SMALL, cfg)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, SMALL.h, generator=gen).to("cuda", torch.bfloat16)
    d_out = torch.randn(4, 64, SMALL.h, generator=gen).to("cuda", torch.bfloat16)
    out_mk, g_mk = _fwd_bwd(mk, x, d_out)
    out_tb, g_tb = _fwd_bwd(tb, x, d_out)
    kag.check_errors()
    assert_close(out_mk, out_tb, torch.bfloat16, "out")
    for (n, _), a, b in zip([("x", None), *mk.named_parameters()], g_mk, g_tb, strict=True):
        assert_close(a, b, torch.bfloat16, f"d_{n}")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_megakernel_layer():
    """fullgraph compile of a block holding MoELayer(backend="megakernel") matches the same block compiled with
    the torch backend, forward and backward. Compiled against compiled, because inductor fuses the bf16 RMSNorm
    and router differently from eager: on the H200 compiled-vs-eager d_x alone reached cosine
    0.99988 while every eager megakernel-vs-torch comparison passed."""
    torch._dynamo.reset()
    block = _Block(SMALL, dtype=torch.bfloat16, device="cuda", backend="megakernel", config=GPU_CFG,
                   generator=torch.Generator().manual_seed(0))
    tb_block = _Block(SMALL, dtype=torch.bfloat16, device="cuda", backend="torch")
    tb_block.load_state_dict(block.state_dict())
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 64, SMALL.h, generator=gen).to("cuda", torch.bfloat16)
    d_out = torch.randn(2, 64, SMALL.h, generator=gen).to("cuda", torch.bfloat16)
    out_e, _ = _fwd_bwd(block, x, d_out)
    out_c, g_c = _fwd_bwd(torch.compile(block, fullgraph=True), x, d_out)
    out_t, g_t = _fwd_bwd(torch.compile(tb_block, fullgraph=True), x, d_out)
    kag.check_errors()
    assert_close(out_c, out_e, torch.bfloat16, "compiled vs eager out")
    assert_close(out_c, out_t, torch.bfloat16, "compiled megakernel vs compiled torch out")
    for (n, _), a, b in zip([("x", None), *block.named_parameters()], g_c, g_t, strict=True):
        assert_close(a, b, torch.bfloat16, f"compiled d_{n}")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_forward_backward():
    """Capture router + megakernel forward + backward megakernel in one CUDA graph (deferred error checks);
    replays with new inputs give the eager bits."""
    layer, _ = _gpu_layers(SMALL, GPU_CFG)
    gen = torch.Generator().manual_seed(7)
    shape = (256, SMALL.h)
    x = torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    d_out = torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    x2 = torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    params = [x, *layer.parameters()]
    with _error_check("deferred"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles, builds the workspace and pointer tables
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
        with torch.no_grad():
            x.copy_(x2)
        graph.replay()
        graph.replay()  # replays repeat (grads are overwritten, not accumulated)
        torch.cuda.synchronize()
        kag.check_errors()
        cap_out = static_out.detach().clone()
        cap_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    out = layer(x)
    grads = torch.autograd.grad(out, params, d_out)
    assert_bitwise_equal(cap_out, out.detach(), "replayed out")
    for (n, _), a, b in zip([("x", None), *layer.named_parameters()], cap_grads, grads, strict=True):
        assert_bitwise_equal(a, b, f"replayed d_{n}")


@pytest.mark.parametrize("max_tokens, want", [
    (None, 5),  # every rank brings the same T: the config for T
    (64, 64),  # SymmetricPeers(max_tokens=64): every routed buffer is sized for 64 tokens a rank, so is the config
])
def test_ep_layer_picks_its_config_for_the_buffers_token_rows(monkeypatch, max_tokens, want):
    """Under expert parallelism the kernels size the routed buffers for max_tokens rows a rank (``ep.token_slots``)
    whatever this rank brings; a config chosen for the rank's own T would size the ring for the wrong problem
    (an audit's example: Kimi at EP 8, max_tokens 8,192, T 64: ~24 GiB of routed buffers a layer instead of an
    8 GiB ring). The peers and the EP op are stubs (no process group on CPU); what is checked is the T the
    layer asks its config for."""
    import types

    import kittenmoe.ep as kep

    layer = MoELayer(TINY, backend="megakernel", device="cpu")
    layer.ep = types.SimpleNamespace(max_tokens=max_tokens, num_ranks=2, rank=0)
    asked = []
    monkeypatch.setattr(layer, "config_for_tokens", lambda t, device: asked.append(t) or KernelConfig())
    monkeypatch.setattr(kep, "moe_ep", lambda x, *a, **k: torch.zeros_like(x))
    layer(torch.randn(5, TINY.h))
    assert asked == [want]
