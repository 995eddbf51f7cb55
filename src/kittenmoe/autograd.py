"""``torch.library`` custom ops over the launchers, with fake (meta) impls and autograd. One rank (R=1).

Layering (docs/design.md "Where code lives"): launchers (``kittenmoe.launch_forward`` / ``launch_backward``) -> the
custom ops here -> autograd (``torch.library.register_autograd``) -> ``kittenmoe.functional.moe`` ->
``kittenmoe.layer.MoELayer``.

Ops (namespace ``kittenmoe``):

- ``moe_forward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH?, shared_w2_HS?,
  swiglu_limit?, config) -> (out_TH, x_routed, gate_up, shared_gate_up, schedule)``: the forward megakernel in
  x's dtype. ``moe_forward_fp8(<the same inputs>, w13_q?, w13_scale?, w2_q?, w2_scale?, w13_qt?, w2_qt?,
  fp8_pow2, fp8_dx_high, fp8_down_high, config)``: the same with e4m3 routed GEMMs (the e4m3 weights, their
  scales and transposes). Two ops, not one with optional FP8 arguments: torch's autograd wrapper refills every
  schema argument of every call in a loop quadratic in their number (``torch._library.utils.fill_defaults``:
  75 us a call at 18 arguments on a CPU core, 0.27 ms a forward+backward under the profiler on the H100's
  host), so the BF16 op takes 9. With
  ``keep_activations`` it also returns its ring's routed x rows ``[MAC, H]`` and gate|up
  pre-activations ``[MAC, 2I]`` (x's dtype) for the backward (every routed row when the ring does not wrap, else
  macrobatch 0) and the shared expert's gate|up ``[T, 2S]``; otherwise ``[0, H]`` / ``[0, 2I]`` /
  ``[0, 2S]`` (``moe_megakernel`` turns the knob off when no gradient is needed).
- ``moe_backward(d_out_TH, <moe_forward_fp8's inputs>, x_routed, gate_up, shared_gate_up, schedule, config) ->
  (d_x_TH, d_topk_weights_TK (fp32), d_w13_E2IH, d_w2_EHI, d_shared_w13_2SH, d_shared_w2_HS)``: the backward
  megakernel. It replays the dispatch, and the gate|up GEMM for the rows ``gate_up`` does not hold (in e4m3
  under FP8), and the shared expert's when ``shared_gate_up`` is empty. Without a shared expert the last two
  are empty ``[0]`` placeholders (a custom op cannot return an optional tensor); autograd turns them into
  ``None``.

The ``torch`` backend needs no op: dynamo traces it directly (its expert-id check becomes an async
assert under ``torch.compile``, ``kittenmoe.checks.raise_if_invalid_routes``).

The KernelConfig travels as one ``str`` schema argument, its field values in order (``config_to_args``;
generated from ``dataclasses.fields(KernelConfig)``, so a new knob needs no change here).

Device errors (spin-wait timeouts, expert ids out of range) land in the launches' error flags. How they
are read is set by :func:`set_error_check`:

- ``"sync"``: every megakernel op reads its flags right after launching and raises
  ``kittenmoe.launch_common.MegakernelError`` at once. On CUDA that is one device sync per op; during CUDA-graph
  capture it is impossible, so capture under ``"sync"`` raises a clear error.
- ``"deferred"`` (default, docs/design.md's "no host sync" invariant): on CUDA the flags are OR-ed, on device,
  into a per-device accumulator; nothing syncs, so CUDA-graph capture works. :func:`check_errors` reads (and
  clears) it: call it at a point of your choosing (e.g. every logging step).

On CPU (the Triton interpreter) reading a flag costs nothing, so flags are always read at once there.

Op calls reuse one ``LocalPeers`` workspace per device and (T, H, K, dtype), stream-ordered on the current
stream, so pointer tables are built once, outside any CUDA-graph capture (up to
``MAX_WORKSPACES_PER_DEVICE`` shapes, least recently used out first; one used in a capture stays).
Capturing a call whose shapes never ran eagerly on that device raises a clear error (warm up first).
"""

from __future__ import annotations

import dataclasses
import ast
import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import torch

from kittenmoe import launch_backward, launch_common, launch_forward
from kittenmoe.checks import canonical_device
from kittenmoe.config import KernelConfig, routed_capacity
from kittenmoe.peers import LocalPeers
from kittenmoe.schedule import Schedule, table_length

Tensor = torch.Tensor
ErrorCheck = Literal["sync", "deferred"]

# ----------------------------------------------------------------------------- schema

CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KernelConfig))
_N_CFG = len(CONFIG_FIELDS)


# The fields whose values are names (Literal types), kept as written; every other value is a Python literal
# (``str`` of it, read back by ``ast.literal_eval``). A field of another type needs a line here.
_NAME_TYPES = ("WgradKernel", "ForwardKernel", "BackwardKernel")
_LITERAL_TYPES = ("int", "int | None", "bool")
for _f in dataclasses.fields(KernelConfig):
    if _f.type not in _NAME_TYPES + _LITERAL_TYPES:
        raise TypeError(f"KernelConfig.{_f.name} has type {_f.type!r}, which kittenmoe.autograd cannot pass to a "
                        f"custom op; supported: {', '.join(_NAME_TYPES + _LITERAL_TYPES)}")
_NAME_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelConfig) if f.type in _NAME_TYPES)


def config_to_args(config: KernelConfig) -> tuple[str]:
    """KernelConfig -> the op's trailing argument: its field values in order, joined by "|" into one string
    (plain ``str`` and ``join``, which dynamo folds to a constant where ``json`` would break the graph). One
    argument, not one a field: torch's autograd wrapper of a custom op refills every schema argument of every
    call in a loop that is quadratic in their number (``torch._library.utils.fill_defaults``: 0.29 ms a call at
    34 arguments, 0.08 at 18, on a CPU core where the rest of the forward's host work takes ~1 ms)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a kittenmoe.KernelConfig, got {type(config).__name__}")
    return ("|".join([str(getattr(config, n)) for n in CONFIG_FIELDS]),)


@functools.lru_cache(maxsize=256)
def _config_from_text(text: str) -> KernelConfig:
    values = text.split("|")
    if len(values) != _N_CFG:
        raise TypeError(f"expected the {_N_CFG} KernelConfig field values ({', '.join(CONFIG_FIELDS)}) joined by "
                        f"'|', got {text!r}")
    return KernelConfig(*(v if n in _NAME_FIELDS else ast.literal_eval(v) for n, v in zip(CONFIG_FIELDS, values)))


def config_from_args(args) -> KernelConfig:
    """The op's trailing argument -> KernelConfig (validated once a distinct config: KernelConfig is frozen)."""
    if len(args) != 1 or not isinstance(args[0], str):
        raise TypeError(f"expected one KernelConfig argument (config_to_args' string), got {args!r}")
    return _config_from_text(args[0])


_INPUTS = ("Tensor x_TH, Tensor topk_ids_TK, Tensor topk_weights_TK, Tensor w13_E2IH, Tensor w2_EHI, "
           "Tensor? shared_w13_2SH, Tensor? shared_w2_HS, float? swiglu_limit")
_GRADS = "(Tensor d_x_TH, Tensor d_topk_weights_TK, Tensor d_w13_E2IH, Tensor d_w2_EHI, " \
         "Tensor d_shared_w13_2SH, Tensor d_shared_w2_HS)"

# The forward also returns what it kept for the backward (KernelConfig.keep_activations): its ring's x_routed
# [MAC, H], gate_up [MAC, 2I] and the shared expert's gate|up [T, 2S] (all in x's dtype), or [0, H] / [0, 2I] /
# [0, 2S] when it kept nothing (the backward replays; [0, 0] for the last without a shared expert).
# FP8: the routed experts' e4m3 weights and 128 x 128 scales (kittenmoe.fp8.FP8ExpertWeights, None for
# bf16), whether the activation scales are powers of two, and FP8Config's dx_high / down_high (which GEMMs stay
# in x's dtype). The bf16 master weights stay the differentiable
# inputs: their gradients are computed from e4m3 data gradients and bf16 weight-gradient products.
# w13_qt / w2_qt: the same e4m3 weights transposed ([E, H, 2I], [E, I, H]), which the backward's data-gradient
# GEMMs read (e4m3 wgmma takes B K-major only); None makes the backward transpose them per call.
_FP8 = ("Tensor? w13_q, Tensor? w13_scale, Tensor? w2_q, Tensor? w2_scale, Tensor? w13_qt, Tensor? w2_qt, "
        "bool fp8_pow2, bool fp8_dx_high, bool fp8_down_high")
# And its routing schedule, the tables packed in one int32 tensor (kittenmoe.schedule.Schedule.packed): the
# backward reads it rather than building the same schedule again.
_FORWARD_OUT = "(Tensor out_TH, Tensor x_routed, Tensor gate_up, Tensor shared_gate_up, Tensor schedule)"
torch.library.define("kittenmoe::moe_forward", f"({_INPUTS}, str config) -> {_FORWARD_OUT}")
torch.library.define("kittenmoe::moe_forward_fp8", f"({_INPUTS}, {_FP8}, str config) -> {_FORWARD_OUT}")
_NO_FP8 = (None,) * 6 + (False,) * 3  # moe_forward_fp8's FP8 arguments for x's dtype
torch.library.define("kittenmoe::moe_backward",
                     f"(Tensor d_out_TH, {_INPUTS}, {_FP8}, Tensor x_routed, Tensor gate_up, Tensor shared_gate_up, "
                     f"Tensor schedule, str config) -> {_GRADS}")


def _fp8_weights(w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high, fp8_down_high):
    """The op's FP8 arguments as a kittenmoe.fp8.FP8ExpertWeights, or None (bf16)."""
    if w13_q is None:
        return None
    from kittenmoe.fp8 import FP8Config, FP8ExpertWeights

    # The scale block (128, or MXFP8's 32) from the shapes: w13's scales are [E, cdiv(2I, block), cdiv(H, block)]
    # (2I >= 64 whenever I is a multiple of 32, so the two blocks never give the same shape).
    dims, sdims = tuple(w13_q.shape[-2:]), tuple(w13_scale.shape[-2:])
    block = next((b for b in (128, 32) if tuple(-(-d // b) for d in dims) == sdims), None)
    if block is None:
        raise ValueError(f"FP8 weights: w13 scales {sdims} for w13 {dims} match neither 128- nor 32-blocks")
    cfg = FP8Config(block, pow2_scales=fp8_pow2, dx_high=fp8_dx_high, down_high=fp8_down_high)
    return FP8ExpertWeights(w13_q, w13_scale, w2_q, w2_scale, cfg, w13_qt, w2_qt)

# ----------------------------------------------------------------------------- device errors, workspace

_error_check: ErrorCheck = "deferred"


# Workspaces kept per device, least recently used out first. A workspace used inside a CUDA-graph capture is
# never evicted (the graph holds its addresses).
MAX_WORKSPACES_PER_DEVICE = 8


@dataclass
class _DeviceState:
    err_acc: Tensor  # [1] int32, deferred flags OR-ed together
    workspaces: OrderedDict = field(default_factory=OrderedDict)  # (T, H, K, dtype) -> LocalPeers
    pinned: set = field(default_factory=set)  # keys used inside a capture


_states: dict[torch.device, _DeviceState] = {}


def set_error_check(mode: ErrorCheck) -> None:
    """``"sync"``: megakernel ops raise device errors at once (a sync per op on CUDA). ``"deferred"``: they
    accumulate on device until :func:`check_errors` (needed for CUDA-graph capture)."""
    global _error_check
    if mode not in ("sync", "deferred"):
        raise ValueError(f"error check mode must be 'sync' or 'deferred', got {mode!r}")
    _error_check = mode


def get_error_check() -> ErrorCheck:
    return _error_check


def check_errors(device: torch.device | str | None = None) -> None:
    """Raise ``kittenmoe.launch_common.MegakernelError`` if a megakernel op flagged a deferred error on ``device``
    (all devices when None) since the last check, and clear the flags. Reads a device value (a sync)."""
    devs = list(_states) if device is None else [canonical_device(device)]
    for d in devs:
        st = _states.get(d)
        if st is None:
            continue
        flags = st.err_acc.clone()
        st.err_acc.zero_()
        launch_common.check_errors(flags)


def _capturing(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _workspace(x_TH: Tensor, k: int) -> tuple[_DeviceState, LocalPeers]:
    """The device's error state and the ``LocalPeers`` workspace for this call's shapes."""
    dev = canonical_device(x_TH.device)
    key = (x_TH.shape[0], x_TH.shape[1], k, x_TH.dtype)
    capturing = _capturing(dev)
    if capturing and _error_check == "sync":
        raise RuntimeError(
            "kittenmoe: a megakernel op is being captured in a CUDA graph while device errors are checked "
            "synchronously (a sync is impossible during capture); call "
            "kittenmoe.set_error_check('deferred') before capturing and kittenmoe.check_errors() after replays")
    st = _states.get(dev)
    if capturing and (st is None or key not in st.workspaces):
        raise RuntimeError(
            f"kittenmoe: first megakernel call with T={key[0]}, H={key[1]}, K={k}, {key[3]} on {dev} happens "
            f"inside CUDA-graph capture; run it once eagerly first (warm-up) so its workspace and pointer "
            f"tables exist outside the graph")
    st = _device_state(dev)
    if capturing:
        st.pinned.add(key)
    peers = st.workspaces.get(key)
    if peers is None:
        peers = st.workspaces[key] = LocalPeers(1, dev)
        for old in [kk for kk in st.workspaces if kk not in st.pinned][:-MAX_WORKSPACES_PER_DEVICE]:
            del st.workspaces[old]
    st.workspaces.move_to_end(key)
    return st, peers


def _device_state(dev: torch.device) -> _DeviceState:
    st = _states.get(dev)
    if st is None:
        st = _states[dev] = _DeviceState(torch.zeros(1, dtype=torch.int32, device=dev))
    return st


def report_device_errors(device: torch.device | str, flags: list[Tensor]) -> None:
    """Megakernel error flags of a call outside the custom ops (``kittenmoe.ep``): raised now under
    ``set_error_check("sync")`` (and on CPU), accumulated for :func:`check_errors` under "deferred"."""
    _report(_device_state(canonical_device(device)), flags)


def _report(st: _DeviceState, flags: list[Tensor], num_invalid: Tensor | None = None,
            num_experts: int | None = None) -> None:
    """``num_invalid`` / ``num_experts``: the schedule's count of routes with a bad expert id, and E, for the
    message of an error raised now (the deferred path keeps only the flags)."""
    dev = st.err_acc.device
    if dev.type != "cuda" or _error_check == "sync":
        for f in flags:
            launch_common.check_errors(f, num_invalid, num_experts)
        return
    for f in flags:
        st.err_acc.bitwise_or_(f)


# ----------------------------------------------------------------------------- megakernel ops


def _moe_forward_impl(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                      swiglu_limit, config_text):
    return _moe_forward_fp8_impl(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                 shared_w2_HS, swiglu_limit, *_NO_FP8, config_text)


def _moe_forward_fp8_impl(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                      swiglu_limit, w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high,
                      fp8_down_high, *config_args):
    config = config_from_args(config_args)
    launch_common.check_device(x_TH.device)  # the launcher's RuntimeError, before touching any workspace
    st, peers = _workspace(x_TH, topk_ids_TK.shape[1])
    res = launch_forward.megakernel_forward_multirank(
        [x_TH], [topk_ids_TK], [topk_weights_TK], w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
        swiglu_limit, config=config, peers=peers, save_for_backward=config.keep_activations,
        fp8=_fp8_weights(w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high, fp8_down_high))
    _report(st, [state.err for state in res.states], res.states[0].schedule.num_invalid, w13_E2IH.shape[0])
    kept = res.saved()[0]
    if kept is None:  # the fake impl's dtypes (an FP8 forward keeps its rows in x's dtype too)
        H, two_i = x_TH.shape[1], w13_E2IH.shape[1]
        kept = (x_TH.new_empty(0, H, dtype=x_TH.dtype),
                x_TH.new_empty(0, two_i, dtype=x_TH.dtype), None)
    shared_gu = kept[2]
    if shared_gu is None:
        shared_gu = x_TH.new_empty(0, _shared_width(shared_w13_2SH), dtype=x_TH.dtype)
    return res.outputs[0], kept[0], kept[1], shared_gu, res.states[0].schedule.packed()


torch.library.impl("kittenmoe::moe_forward", "default")(_moe_forward_impl)
torch.library.impl("kittenmoe::moe_forward_fp8", "default")(_moe_forward_fp8_impl)


@torch.library.impl("kittenmoe::moe_backward", "default")
def _moe_backward_impl(d_out_TH, x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                       shared_w2_HS, swiglu_limit, w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2,
                       fp8_dx_high, fp8_down_high, x_routed, gate_up, shared_gate_up, schedule,
                       *config_args):
    config = config_from_args(config_args)
    launch_common.check_device(x_TH.device)
    st, peers = _workspace(x_TH, topk_ids_TK.shape[1])
    (T, K), E = topk_ids_TK.shape, w13_E2IH.shape[0]
    sched = Schedule.from_table(schedule, rank=0, num_ranks=1, experts_per_rank=E, tokens=T, topk=K,
                                block_m=config.block_m)
    res = launch_backward.megakernel_backward_multirank(
        d_out_RTH=[d_out_TH.contiguous()], x_RTH=[x_TH], topk_ids_RTK=[topk_ids_TK],
        topk_weights_RTK=[topk_weights_TK], w13_E2IH=w13_E2IH, w2_EHI=w2_EHI, shared_w13_2SH=shared_w13_2SH,
        shared_w2_HS=shared_w2_HS, swiglu_limit=swiglu_limit, config=config, peers=peers,
        saved=[(x_routed, gate_up, shared_gate_up if shared_gate_up.shape[0] else None)
               if x_routed.shape[0] else None],
        fp8=_fp8_weights(w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high, fp8_down_high),
        schedules=[sched])
    _report(st, list(res.errs), sched.num_invalid, E)
    return _pack_grads(res.d_x[0], res.d_topk_weights[0], res.d_w13, res.d_w2, res.d_shared_w13,
                       res.d_shared_w2, w13_E2IH)


def _pack_grads(d_x, d_w, d_w13, d_w2, d_sw13, d_sw2, w13_E2IH):
    # Without a shared expert: two distinct empty placeholders (op outputs must not alias each other).
    return (d_x, d_w.float(), d_w13, d_w2,
            w13_E2IH.new_empty(0) if d_sw13 is None else d_sw13, w13_E2IH.new_empty(0) if d_sw2 is None else d_sw2)


def _shared_width(shared_w13_2SH) -> int:
    """2S, the shared expert's kept gate|up width (0 without one)."""
    return 0 if shared_w13_2SH is None else shared_w13_2SH.shape[0]


def _kept_rows(x_TH, topk_ids_TK, w13_E2IH, config: KernelConfig) -> int:
    """Rows of the activations the forward keeps (from shapes and config only, as the fake impl needs)."""
    if not config.keep_activations:
        return 0
    ring = launch_common.RingGeometry.make(
        routed_capacity(1, x_TH.shape[0], topk_ids_TK.shape[1], w13_E2IH.shape[0], config.block_m), config)
    return ring.macrobatch


def _fake_forward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                  swiglu_limit, config_text):
    return _fake_forward_fp8(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                             swiglu_limit, *_NO_FP8, config_text)


def _fake_forward_fp8(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                  swiglu_limit, w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high, fp8_down_high,
                  *config_args):
    config = config_from_args(config_args)
    n = _kept_rows(x_TH, topk_ids_TK, w13_E2IH, config)
    # (an FP8 forward keeps its routed rows and gate|up in x's dtype, beside the e4m3 ring its GEMMs read)
    two_s = _shared_width(shared_w13_2SH)
    (T, K), E, bm = topk_ids_TK.shape, w13_E2IH.shape[0], config.block_m
    return (torch.empty_like(x_TH), x_TH.new_empty(n, x_TH.shape[1], dtype=x_TH.dtype),
            x_TH.new_empty(n, w13_E2IH.shape[1], dtype=x_TH.dtype),
            x_TH.new_empty(x_TH.shape[0] if n and two_s else 0, two_s, dtype=x_TH.dtype),
            x_TH.new_empty(table_length(routed_capacity(1, T, K, E, bm), E, bm, T * K), dtype=torch.int32))


def _fake_backward(d_out_TH, x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                   shared_w2_HS, swiglu_limit, w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt, fp8_pow2, fp8_dx_high,
                   fp8_down_high, x_routed, gate_up, shared_gate_up, *rest):
    return (
        torch.empty_like(x_TH),
        topk_weights_TK.new_empty(topk_weights_TK.shape, dtype=torch.float32),
        torch.empty_like(w13_E2IH),
        torch.empty_like(w2_EHI),
        w13_E2IH.new_empty(0) if shared_w13_2SH is None else torch.empty_like(shared_w13_2SH),
        w13_E2IH.new_empty(0) if shared_w2_HS is None else torch.empty_like(shared_w2_HS),
    )


torch.library.register_fake("kittenmoe::moe_forward", _fake_forward)
torch.library.register_fake("kittenmoe::moe_forward_fp8", _fake_forward_fp8)
torch.library.register_fake("kittenmoe::moe_backward", _fake_backward)

# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Both forward ops': ``inputs`` are moe_forward's 9 or moe_forward_fp8's 18."""
    x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS = inputs[:7]
    _, x_routed, gate_up, shared_gate_up, schedule = output
    ctx.num_inputs = len(inputs)
    if len(inputs) == 9:
        inputs = (*inputs[:8], *_NO_FP8, inputs[8])
    fp8_tensors = inputs[8:14]  # w13_q, w13_scale, w2_q, w2_scale, w13_qt, w2_qt
    ctx.save_for_backward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
                          x_routed, gate_up, shared_gate_up, schedule, *fp8_tensors)
    ctx.swiglu_limit, ctx.fp8_flags = inputs[7], tuple(inputs[14:17])  # fp8_pow2, fp8_dx_high, fp8_down_high
    ctx.config_args = tuple(inputs[17:])
    # The kept activations are not differentiable outputs: their (absent) gradients arrive as None rather
    # than as materialised zero tensors (0.3 GB for gate_up on the Kimi slice).
    ctx.mark_non_differentiable(x_routed, gate_up, shared_gate_up, schedule)
    ctx.set_materialize_grads(False)


class _NotDifferentiable(torch.autograd.Function):
    """The identity on a megakernel backward's gradients, linked to that backward's inputs, whose own backward
    refuses: the kernels have no derivative, so a gradient of these gradients (double backward) would otherwise
    come out zero or None without a word."""

    @staticmethod
    def forward(ctx, message, n, *tensors):  # n gradients, then the backward's inputs (the graph's edges)
        ctx.message = message
        return tensors[:n]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)


def refuse_double_backward(what: str, gradients, ctx, d_out_TH, instead: str = "") -> tuple:
    """``gradients(ctx, d_out_TH)``: a megakernel backward's gradients. Under ``create_graph=True`` (grad mode on
    inside a backward) they are computed without a graph and handed on through ``_NotDifferentiable``, linked to
    ``d_out_TH`` and the tensors ``ctx`` saved, so that differentiating them raises (naming ``what``, then
    ``instead``) instead of giving zero; otherwise as they are (one grad-mode read, no device work)."""
    if not torch.is_grad_enabled():
        return gradients(ctx, d_out_TH)
    with torch.no_grad():
        grads = gradients(ctx, d_out_TH)
    at = [i for i, g in enumerate(grads) if isinstance(g, Tensor)]
    links = [t for t in (d_out_TH, *ctx.saved_tensors) if isinstance(t, Tensor)]
    out = list(grads)
    message = (f"{what}'s backward is not differentiable: a gradient of its gradients (double backward, "
               f"create_graph=True) is not supported{instead}")
    for i, g in zip(at, _NotDifferentiable.apply(message, len(at), *(grads[i] for i in at), *links)):
        out[i] = g
    return tuple(out)


def _backward(ctx, d_out_TH, _d_x_routed, _d_gate_up, _d_shared_gate_up, _d_schedule):
    return refuse_double_backward("the megakernel", _gradients, ctx, d_out_TH,
                                  "; backend='torch' (kittenmoe.moe, MoELayer) runs it in differentiable torch ops")


def _gradients(ctx, d_out_TH):
    (x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS, x_routed,
     gate_up, shared_gate_up, schedule, *fp8_tensors) = ctx.saved_tensors
    if d_out_TH is None:  # the output did not reach the loss
        d_out_TH = torch.zeros_like(x_TH)
    d_x, d_w, d_w13, d_w2, d_sw13, d_sw2 = torch.ops.kittenmoe.moe_backward(
        d_out_TH.contiguous(), x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
        shared_w2_HS, ctx.swiglu_limit, *fp8_tensors, *ctx.fp8_flags, x_routed, gate_up, shared_gate_up, schedule,
        *ctx.config_args)
    if shared_w13_2SH is None:
        d_sw13 = d_sw2 = None
    # topk_ids, the e4m3 copies and every non-tensor argument get no gradient.
    return ((d_x, None, d_w.to(topk_weights_TK.dtype), d_w13, d_w2, d_sw13, d_sw2)
            + (None,) * (ctx.num_inputs - 7))


torch.library.register_autograd("kittenmoe::moe_forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("kittenmoe::moe_forward_fp8", _backward, setup_context=_setup_context)

# ----------------------------------------------------------------------------- python entry points


def moe_megakernel(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH=None,
                   shared_w2_HS=None, swiglu_limit: float | None = None,
                   config: KernelConfig | None = None, fp8=None) -> Tensor:
    """The differentiable megakernel layer (one rank): ``torch.ops.kittenmoe.moe_forward`` (``moe_forward_fp8``
    with ``fp8``).

    ``fp8``: None (x's dtype), a ``kittenmoe.fp8.FP8Config`` (quantise ``w13_E2IH`` / ``w2_EHI`` now, as a
    layer with bf16 master weights does each step) or ``FP8ExpertWeights`` (already quantised, same experts)."""
    from kittenmoe.fp8 import expert_weight_operands

    config = KernelConfig() if config is None else config
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_TH, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                                    shared_w2_HS))
    if config.keep_activations and not needs_grad:
        config = config.with_(keep_activations=False)  # no backward will read them
    # None or (w13_q, w13_scale, w2_q, w2_scale, cfg, w13_qt, w2_qt)
    fp8 = expert_weight_operands(fp8, w13_E2IH, w2_EHI)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    if fp8 is None:
        return torch.ops.kittenmoe.moe_forward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                               shared_w2_HS, limit, *config_to_args(config))[0]
    return torch.ops.kittenmoe.moe_forward_fp8(
        x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS, limit, *fp8[:4],
        *fp8[5:7], *_fp8_flags(fp8[4]), *config_to_args(config))[0]


def _fp8_flags(cfg) -> tuple[bool, bool, bool]:
    """moe_forward_fp8's (fp8_pow2, fp8_dx_high, fp8_down_high) from a kittenmoe.fp8.FP8Config."""
    return cfg.pow2_scales, cfg.dx_high, cfg.down_high
