"""The public API as a user meets it: the config a call runs, inputs models produce, and every refused input.

``kittenmoe.moe`` / ``MoELayer`` on CPU: the torch backend, and the megakernel under the Triton interpreter
(the conftest sets ``TRITON_INTERPRET=1``), each against the fp64 reference with the tolerance table's bars.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kittenmoe
from kittenmoe import autoconfig, functional
from kittenmoe.config import KernelConfig, default_config, get_shape
from kittenmoe.reference import moe_reference
from kittenmoe.testing import assert_close, make_weights, routing_uniform

SHAPE = get_shape("tiny")  # E=8 H=32 I=16 K=2, shared width 16
# small tiles for the interpreter (cases that pass a config reach the megakernel's launch checks, not the tune cache)
SMALL_CONFIG = KernelConfig(block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4, minibatch_size=64,
                            num_comm_programs_fwd=1, num_comm_programs_bwd=1)


def _inputs(t: int, dtype=torch.float32, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = make_weights(SHAPE, dtype=dtype, generator=g)
    x = torch.randn(t, SHAPE.h, generator=g).to(dtype)
    ids, wts = routing_uniform(t, SHAPE.e, SHAPE.k, generator=g)
    if requires_grad:
        x.requires_grad_(True)
        wts.requires_grad_(True)
        w.requires_grad_()
    return x, ids, wts, w


def _call(x, ids, wts, w, **kw):
    return kittenmoe.moe(x, ids, wts, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, **kw)


def _reference(x, ids, wts, w):
    return moe_reference(x.double(), ids, wts.double(), w.w13_E2IH.double(), w.w2_EHI.double(),
                         w.shared_w13_2SH.double(), w.shared_w2_HS.double(), compute_dtype=torch.float64)


# --------------------------------------------------------------------------- the config a call runs


def test_moe_without_config_runs_the_tuned_or_heuristic_config(monkeypatch):
    """config=None is what MoELayer and the benchmark run (the tune cache, else default_config), not
    KernelConfig()'s dataclass defaults; an explicit config passes through untouched."""
    monkeypatch.setenv("KITTENMOE_AUTOTUNE", "0")  # no cache entry: the heuristic
    seen = []
    monkeypatch.setattr(functional.autograd, "moe_megakernel",
                        lambda x, *a, config=None, **k: seen.append(a[-1] if config is None else config) or x)
    x, ids, wts, w = _inputs(40)
    _call(x, ids, wts, w, backend="megakernel")
    want = default_config(40, SHAPE.h, SHAPE.i, SHAPE.e, SHAPE.k, 1, "cpu", torch.float32, s=SHAPE.shared_width)
    assert seen[-1] == want and seen[-1] != KernelConfig()
    mine = KernelConfig(block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4, minibatch_size=64)
    _call(x, ids, wts, w, backend="megakernel", config=mine)
    assert seen[-1] is mine


def test_layer_and_functional_resolve_the_same_config(monkeypatch):
    """One home for the choice: MoELayer.config_for_tokens and kittenmoe.moe agree for the same problem."""
    monkeypatch.setenv("KITTENMOE_AUTOTUNE", "0")
    layer = kittenmoe.MoELayer(SHAPE, backend="megakernel")
    want = autoconfig.auto_config(33, SHAPE.h, SHAPE.i, SHAPE.e, SHAPE.k, SHAPE.shared_width, 1, "cpu",
                                  torch.float32)
    assert layer.config_for_tokens(33, torch.device("cpu")) == want


# --------------------------------------------------------------------------- inputs users have


@pytest.mark.parametrize("backend", ["torch", "megakernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch_returns_empty_output_and_zero_gradients(backend, dtype):
    """T = 0 (an empty micro-batch): [0, H] in x's dtype, and every differentiable input gets a zero gradient
    of its own shape (not None), so an optimizer step and a DP all-reduce see the usual parameters."""
    x, ids, wts, w = _inputs(0, dtype=dtype, requires_grad=True)
    out = _call(x, ids, wts, w, backend=backend)
    assert out.shape == (0, SHAPE.h) and out.dtype == dtype
    out.float().sum().backward()
    for name, p in (("x", x), ("topk_weights", wts), *zip(("w13", "w2", "shared_w13", "shared_w2"), w.tensors())):
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any(), name


# the megakernel backend: the layer picks its config before the call (from the token count), which an empty
# batch must not trip
@pytest.mark.parametrize("backend", ["torch", "megakernel"])
def test_empty_batch_through_the_layer(backend):
    """MoELayer on [B, 0, H] (no tokens): [B, 0, H] out, zero gradients for the router and the experts."""
    layer = kittenmoe.MoELayer(SHAPE, backend=backend, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 0, SHAPE.h, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


@pytest.mark.parametrize("backend", ["torch", "megakernel"])
@pytest.mark.parametrize("view", [
    "x_column_slice",  # x a [:, :H] slice of a wider activation (row stride > H)
    "x_transposed",  # x the transpose of an [H, T] buffer
    "routing_strided",  # ids and weights every other column of [T, 2K] (as a fused router output gives)
    "router_weights_bf16",  # bf16 router weights beside fp32 experts: summed in fp32, gradient in bf16
])
def test_views_and_router_dtypes_match_the_reference(backend, view):
    x, ids, wts, w = _inputs(37, seed=3)
    if view == "x_column_slice":
        wide = torch.randn(37, SHAPE.h + 5)
        wide[:, :SHAPE.h] = x
        x = wide[:, :SHAPE.h]
    elif view == "x_transposed":
        x = x.t().contiguous().t()
    elif view == "routing_strided":
        ids = torch.stack([ids, ids.flip(1)], 2).reshape(37, 2 * SHAPE.k)[:, ::2]
        wts = torch.stack([wts, wts], 2).reshape(37, 2 * SHAPE.k)[:, ::2]
    else:
        wts = wts.bfloat16()
    if view != "router_weights_bf16":
        assert not (x.is_contiguous() and ids.is_contiguous() and wts.is_contiguous())
    x = x.detach().requires_grad_(True)
    wts = wts.detach().requires_grad_(True)
    out = _call(x, ids, wts, w, backend=backend)
    ref = _reference(x.detach(), ids, wts.detach(), w)
    assert_close(out, ref, torch.float32, "out")
    (out * torch.randn_like(out)).sum().backward()
    assert x.grad.shape == x.shape and wts.grad.dtype == wts.dtype and torch.isfinite(wts.grad.float()).all()


def test_forward_and_backward_leave_the_callers_tensors_alone():
    """With one rank the megakernels read x, the output gradient and the router weights where the caller holds
    them (``LocalPeers.stage``, no copy): a forward+backward must leave every one of them, and the weights,
    unchanged bit for bit."""
    x, ids, wts, w = _inputs(37, seed=5, requires_grad=True)
    g = torch.randn(37, SHAPE.h)
    before = [t.detach().clone() for t in (x, ids, wts, g, w.w13_E2IH, w.w2_EHI)]
    out = _call(x, ids, wts, w, backend="megakernel")
    out.backward(g)
    for was, now in zip(before, (x, ids, wts, g, w.w13_E2IH, w.w2_EHI), strict=True):
        assert torch.equal(was, now.detach())


# --------------------------------------------------------------------------- refused inputs


def _bad(case: str):
    """(args of kittenmoe.moe, kwargs) for one bad-input case, built from fresh valid inputs."""
    x, ids, wts, w = _inputs(12, seed=7)
    a = dict(x=x, ids=ids, wts=wts, w13=w.w13_E2IH, w2=w.w2_EHI, sw13=w.shared_w13_2SH, sw2=w.shared_w2_HS)
    kw = {}
    T, H, E, K = 12, SHAPE.h, SHAPE.e, SHAPE.k
    edit = {
        "x_list": lambda: a.update(x=[x]),
        "x_1d": lambda: a.update(x=x[0]),
        "x_int": lambda: a.update(x=x.long()),
        "x_hidden": lambda: a.update(x=torch.randn(T, H + 1)),
        "x_meta": lambda: a.update(x=torch.empty(T, H, device="meta")),
        "x_dtype_vs_weights": lambda: a.update(x=x.double()),
        "ids_float": lambda: a.update(ids=ids.float()),
        "ids_rows": lambda: a.update(ids=ids[:-1]),
        "ids_cols_vs_weights": lambda: a.update(ids=torch.cat([ids, ids[:, :1]], 1)),
        "ids_3d": lambda: a.update(ids=ids[None]),
        "wts_int": lambda: a.update(wts=wts.long()),
        "wts_1d": lambda: a.update(wts=wts.reshape(-1)),
        "k_above_e": lambda: a.update(ids=ids.repeat(1, E), wts=wts.repeat(1, E)),
        "k_zero": lambda: a.update(ids=ids[:, :0], wts=wts[:, :0]),
        "w13_odd": lambda: a.update(w13=a["w13"][:, 1:].contiguous()),
        "w13_2d": lambda: a.update(w13=a["w13"][0]),
        "w13_noncontiguous": lambda: a.update(w13=a["w13"].transpose(1, 2).contiguous().transpose(1, 2)),
        "w2_shape": lambda: a.update(w2=a["w2"][:, :, 1:].contiguous()),
        "w2_dtype": lambda: a.update(w2=a["w2"].double()),
        "shared_alone": lambda: a.update(sw2=None),
        "shared_hidden": lambda: a.update(sw13=torch.randn(2 * SHAPE.shared_width, H + 2)),
        "shared_w2_shape": lambda: a.update(sw2=a["sw2"][:, 1:].contiguous()),
        "shared_dtype": lambda: a.update(sw13=a["sw13"].double(), sw2=a["sw2"].double()),
        "swiglu_negative": lambda: kw.update(swiglu_limit=-1.0),
        "swiglu_bool": lambda: kw.update(swiglu_limit=True),
        "backend_unknown": lambda: kw.update(backend="cuda"),
        "config_dict": lambda: kw.update(config={"block_m": 64}),
        "fp8_on_torch": lambda: kw.update(backend="torch", fp8=kittenmoe.FP8Config()),
        "expert_id_high": lambda: a.update(ids=torch.where(ids == ids[0, 0], E, ids)),
        "expert_id_negative": lambda: a.update(ids=torch.where(ids == ids[0, 0], -1, ids)),
        "expert_id_no_route": lambda: a.update(ids=torch.where(ids == ids[0, 0], 2**31 - 1, ids.int())),
        "expert_id_int64_wraps": lambda: a.update(ids=torch.where(ids == ids[0, 0], 2**32 + 1, ids.long())),
        "fp8_name": lambda: kw.update(fp8="e4m3"),
        "w13_zero_width": lambda: (a.update(w13=torch.empty(E, 0, H), w2=torch.empty(E, H, 0)),
                                   kw.update(config=SMALL_CONFIG)),
        "x_zero_hidden": lambda: (a.update(x=torch.empty(T, 0), w13=torch.empty(E, 2 * SHAPE.i, 0),
                                           w2=torch.empty(E, 0, SHAPE.i)), kw.update(config=SMALL_CONFIG)),
    }[case]
    edit()
    return (a["x"], a["ids"], a["wts"], a["w13"], a["w2"], a["sw13"], a["sw2"]), kw


BAD_INPUTS = [
    # (case, exception, a fragment of its message naming the argument); each case edits one valid input. One rank:
    # the messages name x, topk_ids and topk_weights without a rank index ("x[0]" would read as a row)
    ("x_list", TypeError, "x must be a torch.Tensor"),  # a list where a tensor belongs
    ("x_1d", ValueError, "x must have 2 dimensions"),  # one token's row instead of [T, H]
    ("x_int", TypeError, "x has dtype torch.int64"),  # token ids passed as activations
    ("x_hidden", ValueError, "hidden size 33"),  # H off by one against the weights
    ("x_meta", ValueError, "x is on meta"),  # activations on another device than the weights
    ("x_dtype_vs_weights", TypeError, "x has dtype torch.float64 but the expert weights"),  # mixed precision
    ("ids_float", TypeError, "topk_ids has dtype torch.float32"),  # router scores passed as ids
    ("ids_rows", ValueError, "topk_ids"),  # routing for T-1 tokens
    ("ids_cols_vs_weights", ValueError, "topk_weights"),  # K of ids and weights disagree
    ("ids_3d", ValueError, "topk_ids must have 2 dimensions"),  # a batch dimension left on
    ("wts_int", TypeError, "topk_weights has dtype torch.int64"),  # integer weights
    ("wts_1d", ValueError, "topk_weights must have 2 dimensions"),  # flattened weights
    ("k_above_e", ValueError, "top-k K=16 exceeds the number of experts E=8"),  # K > E
    ("k_zero", ValueError, "K=0"),  # no expert per token
    ("w13_odd", ValueError, "w13 must be [E, 2*I, H]"),  # gate|up rows not paired
    ("w13_2d", ValueError, "w13 must have 3 dimensions"),  # one expert's weight
    ("w13_noncontiguous", ValueError, "w13 must be contiguous"),  # a transposed view of the weights
    ("w2_shape", ValueError, "w2 must be [E, H, I]"),  # down projection of another width
    ("w2_dtype", TypeError, "w13 (torch.float32) and w2 (torch.float64)"),  # mixed weight dtypes
    ("shared_alone", ValueError, "shared_w13 and shared_w2 must be given together"),  # half a shared expert
    ("shared_hidden", ValueError, "shared_w13 must be [2*S, H=32]"),  # shared expert of another H
    ("shared_w2_shape", ValueError, "shared_w2 must be [H, S]"),  # shared down of another width
    ("shared_dtype", TypeError, "shared expert weights must have the routed weights' dtype"),
    ("swiglu_negative", ValueError, "swiglu_limit must be a positive number"),  # a clamp below zero
    ("swiglu_bool", ValueError, "swiglu_limit must be a positive number"),  # True is not a limit
    ("backend_unknown", ValueError, "unknown MoE backend 'cuda'"),  # a device name as backend
    ("config_dict", TypeError, "config must be a kittenmoe.KernelConfig"),  # knobs as a dict
    ("fp8_on_torch", NotImplementedError, "fp8 runs the megakernel only"),  # e4m3 on the torch backend
    ("expert_id_high", ValueError, "expert id outside [0, E=8)"),  # id E: found on device, raised
    ("expert_id_negative", ValueError, "expert id outside [0, E=8)"),  # id -1
    # 2**31 - 1 in int32: the padding tokens' NO_ROUTE inside the launchers, from a caller a route dropped
    ("expert_id_no_route", ValueError, "expert id outside [0, E=8)"),
    ("expert_id_int64_wraps", ValueError, "expert id outside [0, E=8)"),  # int64 2**32 + 1: expert 1 once cast
    ("fp8_name", TypeError, "fp8 must be None, a kittenmoe.fp8.FP8Config or FP8ExpertWeights, got str"),  # a name
    ("w13_zero_width", ValueError, "w13 must be [E, 2*I, H] with I >= 1 and H >= 1"),  # I = 0: experts of no width
    ("x_zero_hidden", ValueError, "w13 must be [E, 2*I, H] with I >= 1 and H >= 1"),  # H = 0: tokens of no width
]


@pytest.mark.parametrize("case,exc,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_clear_error(case, exc, match):
    args, kw = _bad(case)
    kw.setdefault("backend", "torch")
    with pytest.raises(exc, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*").replace("]", r"\]")):
        kittenmoe.moe(*args, **kw)


@pytest.mark.parametrize("case", ["x_hidden", "ids_float", "k_above_e", "expert_id_high", "expert_id_no_route",
                                  "expert_id_int64_wraps", "fp8_name", "w13_zero_width", "x_zero_hidden"])
def test_bad_input_refused_by_the_megakernel_too(case):
    """The same checks guard the megakernel path: host-side before launch; ids out of range are found on
    device and raised as MegakernelError (at once on CPU, at ``kittenmoe.check_errors()`` on CUDA)."""
    args, kw = _bad(case)
    exc = next(e for c, e, _ in BAD_INPUTS if c == case)
    with pytest.raises(kittenmoe.MegakernelError if case.startswith("expert_id") else exc):
        kittenmoe.moe(*args, backend="megakernel", **kw)


@pytest.mark.parametrize("backend", ["megakernel", "auto"])  # asked for by name, or what auto means on CUDA
def test_float64_on_the_megakernel_points_at_the_torch_backend(backend, monkeypatch):
    """float64 is the torch backend's precision: the megakernel refuses it by name, at the call and when a layer
    is built, instead of failing later in its config lookup; the torch backend runs it."""
    x, ids, wts, w = _inputs(12, dtype=torch.float64, seed=5)
    assert _call(x, ids, wts, w, backend="torch").dtype == torch.float64
    if backend == "auto":  # auto resolves to the megakernel on CUDA: the check's path, without a GPU
        monkeypatch.setattr(kittenmoe.functional, "resolve_backend", lambda b, d: "megakernel")
    with pytest.raises(TypeError, match="the megakernel runs .* operands, got torch.float64; backend='torch'"):
        _call(x, ids, wts, w, backend=backend)
    if backend == "megakernel":
        with pytest.raises(TypeError, match="MoELayer: the megakernel runs"):
            kittenmoe.MoELayer(SHAPE, dtype=torch.float64, backend="megakernel")


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: torch.randn(4, 31), ValueError, "expects \\[..., H=32\\]"),  # last dim is not H
    (lambda: torch.randn(()), ValueError, "expects \\[..., H=32\\]"),  # a scalar
    (lambda: torch.randn(4, 32, dtype=torch.float64), TypeError, "dtype torch.float64"),  # not the layer's dtype
])
def test_layer_refuses_bad_input(bad, exc, match):
    layer = kittenmoe.MoELayer(SHAPE, backend="torch")
    with pytest.raises(exc, match=match):
        layer(bad())


def test_swiglu_limit_takes_any_real_number():
    """A limit from a numpy scalar or an int (a config file's value) is the same clamp as the float."""
    import numpy as np

    x, ids, wts, w = _inputs(12, seed=7)
    want = _call(x, ids, wts, w, backend="torch", swiglu_limit=0.5)
    assert torch.equal(_call(x, ids, wts, w, backend="torch", swiglu_limit=np.float32(0.5)), want)
    assert not torch.equal(_call(x, ids, wts, w, backend="torch", swiglu_limit=2), want)  # (the clamp acts)


@pytest.mark.parametrize("dtype", [
    torch.int32,  # integer parameters cannot train
    torch.float8_e4m3fn,  # e4m3 comes from fp8=FP8Config() over bf16 weights, not from the parameters' dtype
    torch.complex64,  # no complex experts
    "bfloat16",  # a dtype's name
])
def test_layer_refuses_a_parameter_dtype_it_cannot_run(dtype):
    with pytest.raises(TypeError, match="MoELayer: dtype must be one of torch.float32, torch.bfloat16"):
        kittenmoe.MoELayer(SHAPE, dtype=dtype, backend="torch")


@pytest.mark.parametrize("wrt", ["x", "w13"])  # a second derivative in the activations, or in the weights
def test_double_backward_through_the_megakernel_is_refused(wrt):
    """The megakernel backward has no derivative: a gradient of its gradients (create_graph=True, as a gradient
    penalty takes) raises instead of coming out zero, while the first-order gradients under create_graph are the
    usual ones. The torch backend differentiates twice."""
    x, ids, wts, w = _inputs(9, seed=11, requires_grad=True)
    target = x if wrt == "x" else w.w13_E2IH
    plain, = torch.autograd.grad(_call(x, ids, wts, w, backend="megakernel").square().sum(), x)
    g, = torch.autograd.grad(_call(x, ids, wts, w, backend="megakernel").square().sum(), x, create_graph=True)
    assert torch.equal(g, plain)
    with pytest.raises(NotImplementedError, match="megakernel's backward is not differentiable"):
        torch.autograd.grad(g.square().sum(), target)
    g, = torch.autograd.grad(_call(x, ids, wts, w, backend="torch").square().sum(), x, create_graph=True)
    g2, = torch.autograd.grad(g.square().sum(), target)
    assert torch.isfinite(g2).all() and g2.abs().sum() > 0


# --------------------------------------------------------------------------- the package surface


def test_package_exports_the_api_not_fixtures():
    names = set(kittenmoe.__all__)
    assert {"moe", "MoELayer", "moe_ep", "SymmetricPeers", "KernelConfig", "FP8Config", "ModelShape", "get_shape",
            "check_errors", "set_error_check", "MegakernelError"} <= names
    assert not names & {"TEST_SHAPES", "SHAPES", "Schedule", "build_schedule", "LocalPeers"}
    for n in names:
        assert getattr(kittenmoe, n) is not None


def test_python_dash_m_kittenmoe_runs():
    res = subprocess.run([sys.executable, "-m", "kittenmoe", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "bench" in res.stdout and "demo" in res.stdout


# --------------------------------------------------------------------------- on the GPU

GPU_SHAPE = get_shape("small")  # E=16 H=128 I=64 K=4, shared width 64


def _gpu_inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = make_weights(GPU_SHAPE, dtype=torch.bfloat16, device="cuda", generator=g)
    x = torch.randn(t, GPU_SHAPE.h, generator=g).to("cuda", torch.bfloat16)
    ids, wts = routing_uniform(t, GPU_SHAPE.e, GPU_SHAPE.k, generator=g, device="cuda")
    return x, ids, wts, w


@pytest.mark.gpu
@pytest.mark.parametrize("t,view", [
    (1000, None),  # the auto config on a T that is a multiple of nothing
    (1000, "x_column_slice"),  # x a slice of a wider activation
    (0, None),  # an empty batch on the megakernel backend
])
def test_gpu_public_path_auto_config_matches_reference(t, view):
    x, ids, wts, w = _gpu_inputs(t)
    if view == "x_column_slice":
        wide = torch.randn(t, GPU_SHAPE.h + 8, device="cuda").bfloat16()
        wide[:, :GPU_SHAPE.h] = x
        x = wide[:, :GPU_SHAPE.h]
    x = x.detach().requires_grad_(True)
    w.requires_grad_()
    out = _call(x, ids, wts, w)  # backend auto -> megakernel, config None -> tuned or heuristic
    kittenmoe.check_errors()
    assert out.shape == (t, GPU_SHAPE.h)
    if t:
        assert_close(out.float(), _reference(x.detach(), ids, wts, w).float(), torch.bfloat16, "out")
    out.float().square().sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None for p in w.tensors())


@pytest.mark.gpu
def test_gpu_auto_config_under_compile_and_cuda_graph():
    """config=None stays host-only work: a fullgraph torch.compile traces it (the choice is a graph constant)
    and forward+backward capture in a CUDA graph after one eager warm-up, with the eager run's bits, and
    again after new values are written into the captured x."""
    x, ids, wts, w = _gpu_inputs(512, seed=1)
    d_out = torch.randn_like(x)

    def leaves():  # fresh leaves: an autograd graph touched on another stream must not reach the capture
        return [t.detach().clone().requires_grad_(True) for t in (x, wts, *w.tensors())]

    def step(ls):
        out = kittenmoe.moe(ls[0], ids, ls[1], *ls[2:])
        return (out, *torch.autograd.grad(out, ls, d_out))

    eager_leaves = leaves()
    eager = step(eager_leaves)
    compiled = torch.compile(lambda: kittenmoe.moe(eager_leaves[0], ids, eager_leaves[1], *eager_leaves[2:]),
                             fullgraph=True)
    assert torch.equal(compiled(), eager[0])
    cap_leaves = leaves()
    side = torch.cuda.Stream()  # autograd's warm-up for capture runs on a side stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(cap_leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(cap_leaves)
    graph.replay()
    torch.cuda.synchronize()
    kittenmoe.check_errors()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    # new values written into the captured inputs (the one-rank path reads x and d_out in place, its address
    # tables filled inside the graph): a replay gives what an eager run on them gives
    x2 = torch.randn_like(x)
    with torch.no_grad():
        cap_leaves[0].copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    eager2 = step([x2.clone().requires_grad_(True), *(t.detach().clone().requires_grad_(True) for t in
                                                     (wts, *w.tensors()))])
    for a, b in zip(captured, eager2):
        assert torch.equal(a, b)
