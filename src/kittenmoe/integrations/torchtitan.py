"""kittenmoe under torchtitan's MoE layers (torchtitan 0.3.0, optional extra ``[torchtitan]``).

    from kittenmoe.integrations.torchtitan import apply_kittenmoe
    model = model_config.build()      # any module holding torchtitan MoE layers, or one MoE
    apply_kittenmoe(model)            # before torchtitan's parallelize / fully_shard
    # optional, once the weights sit on their device and FSDP is not used: no gate|up copy per step
    fuse_gate_up_storage(model)

The seam. torchtitan's ``MoE.forward`` routes with ``TokenChoiceTopKRouter`` and calls
``RoutedExperts.forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)``, which
sorts the routes by expert (``token_dispatcher.dispatch``), runs ``GroupedExperts`` on the sorted rows (three
grouped GEMMs) and combines (``token_dispatcher.combine``: each expert output times its router score, in fp32,
then a scatter_add into its token). That is ``out[t] = sum_j score[t, j] * expert_{ids[t, j]}(x[t])``, the
scores applied after the experts, exactly what ``kittenmoe.moe`` computes; so ``apply_kittenmoe`` swaps each
``RoutedExperts``' class for a subclass whose forward is one ``kittenmoe.moe`` call. ``RoutedExperts`` is the
seam rather than ``GroupedExperts.forward(x_RD, num_tokens_per_expert_E)`` because only it sees the top-k ids:
kittenmoe does its own dispatch and combine. The router, the load-balancing counters and bias, and the shared
expert stay torchtitan's; gradients reach x, the router scores (so the router) and all three expert weights.

The layout. ``GroupedExperts`` holds ``w1_EFD`` [E, F, D] (the gate: SiLU applies to ``x @ w1^T``),
``w3_EFD`` [E, F, D] (the up projection) and ``w2_EDF`` [E, D, F] (the down projection). kittenmoe's
``w13_E2IH`` is [E, 2I, H], gate rows then up rows, so ``w13 = cat(w1, w3, dim=1)``, and ``w2_EHI`` is
``w2_EDF`` as it is, read in place. The cat is a copy of the gate and up weights in every forward (and again in
an activation-checkpointing recompute), 2*E*F*D elements, unless ``fuse_gate_up_storage`` has made ``w1`` and
``w3`` the two halves of one [E, 2F, D] buffer: then that buffer is passed as it is. Moving the parameters
(``.to()``, ``to_empty()``) or sharding them with FSDP gives each its own storage again, and the copy comes back.

Precision. torchtitan's ``GroupedExperts`` casts x and the weights to bf16 for ``torch._grouped_mm`` whatever
their dtype, and its combine rounds every weighted row to x's dtype before summing in that dtype. kittenmoe
computes in the weights' dtype (x must share it; under torchtitan's FSDP mixed precision both are bf16) and
sums the K weighted rows of a token in fp32, rounding once. So bf16 layers agree within bf16 tolerance, and
fp32 parameters compute in fp32 here where torchtitan computes in bf16.

What the layer may not have is refused with ``NotImplementedError`` naming it, never approximated: experts
other than plain ``GroupedExperts`` (``FusedGroupedExperts``' interleaved [E, F, 2, D] gate|up,
``GptOssGroupedExperts``' biases and clamped activation, MXFP8's quantised ``_grouped_mm``), a subclassed
``RoutedExperts`` forward, expert parallelism (an EP token dispatcher, or the all-to-all dispatcher with an EP
mesh: use ``kittenmoe.moe_ep``), expert weights sharded as DTensors (tensor parallelism), spmd_types type
checking, and activations in another dtype than the weights. ``apply_kittenmoe`` must run before torchtitan's
``parallelize``, which wraps each module's forward at that point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kittenmoe.config import KernelConfig
from kittenmoe.functional import Backend, check_backend, check_config, moe

try:
    import spmd_types as _spmd
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import (
        AllToAllTokenDispatcher,
        LocalTokenDispatcher,
        TorchAOTokenDispatcher,
    )
except ImportError as e:  # the extra is not installed, or a torchtitan without the 0.3 MoE modules
    raise ImportError(f"kittenmoe.integrations.torchtitan needs torchtitan 0.3.0 with "
                      f"torchtitan.models.common.moe (pip install 'kittenmoe[torchtitan]'): {e}") from e

# Dispatchers whose EP = 1 path is a local sort, score and scatter_add: what kittenmoe.moe replaces. The
# all-to-all ones fall back to it while their ep_mesh is None (torchtitan's "standard" comm backend builds
# AllToAllTokenDispatcher even on one GPU); TorchAO's only adds padding for quantised grouped GEMMs.
_LOCAL_DISPATCHERS = (LocalTokenDispatcher, AllToAllTokenDispatcher, TorchAOTokenDispatcher)


@dataclass(frozen=True)
class Options:
    """How the swapped layers run: ``kittenmoe.moe``'s ``backend`` ("auto": the megakernel on CUDA, the torch
    backend otherwise) and ``config`` (None: the ``kittenmoe tune`` cache entry for each call's shape, else the
    heuristic)."""

    backend: Backend = "auto"
    config: KernelConfig | None = None

    def __post_init__(self) -> None:
        check_backend(self.backend)
        check_config(self.config, "Options.config")


def _refuse(routed: nn.Module, missing: list[str]) -> None:
    if missing:
        raise NotImplementedError(f"kittenmoe cannot run this torchtitan RoutedExperts: {'; '.join(missing)}. "
                                  f"Leave the layer to torchtitan's own experts.")


def check_supported(routed: nn.Module) -> None:
    """Raise ``NotImplementedError`` naming what this ``RoutedExperts`` needs that kittenmoe does not do (what
    can be seen before the first call; ``KittenmoeRoutedExperts.forward`` checks the rest on every call)."""
    missing = []
    if not isinstance(routed, RoutedExperts):
        raise TypeError(f"expected a torchtitan RoutedExperts, got {type(routed).__name__}")
    if type(routed) not in (RoutedExperts, KittenmoeRoutedExperts):
        missing.append(f"a forward of its own ({type(routed).__name__} subclasses RoutedExperts)")
    if "forward" in routed.__dict__:
        missing.append("a forward already wrapped by torchtitan's parallelize (call apply_kittenmoe before "
                       "parallelize)")
    experts = routed.inner_experts
    if type(experts) is not GroupedExperts:
        what = {"FusedGroupedExperts": "interleaved gate|up weights (w13 [E, F, 2, D])",
                "GptOssGroupedExperts": "expert biases and GPT-OSS's clamped SwiGLU"}.get(type(experts).__name__)
        if what is None and type(experts)._grouped_mm is not GroupedExperts._grouped_mm:
            what = "its own _grouped_mm (a quantised grouped GEMM, e.g. MXFP8)"
        missing.append(f"{type(experts).__name__} experts with {what or 'a forward of their own'} (only "
                       f"GroupedExperts' w1_EFD / w3_EFD / w2_EDF SwiGLU experts run)")
    dispatcher = routed.token_dispatcher
    if type(dispatcher) not in _LOCAL_DISPATCHERS:
        missing.append(f"expert parallelism through {type(dispatcher).__name__} (kittenmoe.moe_ep is "
                       f"kittenmoe's EP)")
    _refuse(routed, missing)


def _local_weight(routed: nn.Module, name: str, w: torch.Tensor) -> torch.Tensor:
    """The plain tensor of an expert weight. A DTensor replicated on every mesh axis (FSDP's unsharded
    parameter under a full-DTensor backend) holds all of it locally; a sharded one (tensor parallelism) holds
    a slice that kittenmoe has not been checked on."""
    if not isinstance(w, DTensor):
        return w
    if not all(p.is_replicate() for p in w.placements):
        _refuse(routed, [f"{name} sharded as a DTensor {tuple(w.placements)} (tensor parallelism of the "
                         f"experts)"])
    return w.to_local()


class _GateUpHalves(torch.autograd.Function):
    """``cat(w1, w3, dim=1)`` without the copy when ``w1`` and ``w3`` are the two halves of one [E, 2F, D]
    buffer (``fuse_gate_up_storage``): the buffer itself, viewed through ``w1``; the gradient splits back."""

    @staticmethod
    def forward(ctx, w1_EFD, w3_EFD):
        e, f, d = w1_EFD.shape
        ctx.f = f
        return w1_EFD.as_strided((e, 2 * f, d), (2 * f * d, d, 1))

    @staticmethod
    def backward(ctx, d_w13_E2FD):
        return d_w13_E2FD[:, :ctx.f], d_w13_E2FD[:, ctx.f:]


@torch._dynamo.assume_constant_result
def _halves_of_one_buffer(w1_EFD: torch.Tensor, w3_EFD: torch.Tensor) -> bool:
    # Dynamo cannot trace storage_offset or a storage's data_ptr: under torch.compile this runs once at trace
    # time and the graph keeps its answer. A graph is re-traced when the weights' strides change (moving or
    # sharding the parameters gives each its own contiguous storage), so a kept True outlives the shared buffer
    # only if the parameters are re-pointed by hand at two storages with the same strides and offsets.
    e, f, d = w1_EFD.shape
    return (w3_EFD.shape == w1_EFD.shape and w3_EFD.dtype == w1_EFD.dtype and w3_EFD.device == w1_EFD.device
            and w1_EFD.stride() == (2 * f * d, d, 1) and w3_EFD.stride() == (2 * f * d, d, 1)
            and w3_EFD.storage_offset() == w1_EFD.storage_offset() + f * d
            and w1_EFD.untyped_storage().data_ptr() == w3_EFD.untyped_storage().data_ptr())


def gate_up_weight(w1_EFD: torch.Tensor, w3_EFD: torch.Tensor) -> torch.Tensor:
    """kittenmoe's ``w13_E2IH`` from torchtitan's gate ``w1_EFD`` and up ``w3_EFD``, differentiable in both: the
    shared buffer when ``fuse_gate_up_storage`` made them its halves, else ``cat`` (one copy)."""
    if _halves_of_one_buffer(w1_EFD, w3_EFD):
        return _GateUpHalves.apply(w1_EFD, w3_EFD)
    return torch.cat([w1_EFD, w3_EFD], dim=1)


class KittenmoeRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose dispatch, experts and combine are one ``kittenmoe.moe`` call (what
    ``apply_kittenmoe`` swaps in; same parameters, state dict and forward signature)."""

    _kittenmoe_options: Options = Options()

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # The per-expert counts size torchtitan's grouped GEMMs; kittenmoe's schedule counts the routes itself,
        # on the device.
        del num_local_tokens_per_expert_E
        missing = []
        if getattr(self.token_dispatcher, "ep_mesh", None) is not None:
            missing.append(f"expert parallelism ({type(self.token_dispatcher).__name__} with an EP mesh; "
                           f"kittenmoe.moe_ep is kittenmoe's EP)")
        if _spmd.is_type_checking():
            missing.append("spmd_types type checking (kittenmoe's ops carry no SPMD type rules)")
        _refuse(self, missing)
        experts = self.inner_experts
        w1_EFD = _local_weight(self, "w1_EFD", experts.w1_EFD)
        w2_EDF = _local_weight(self, "w2_EDF", experts.w2_EDF)
        w3_EFD = _local_weight(self, "w3_EFD", experts.w3_EFD)
        if x_BLD.dtype != w1_EFD.dtype:
            _refuse(self, [f"x in {x_BLD.dtype} with expert weights in {w1_EFD.dtype} (torchtitan casts both "
                           f"to bf16; kittenmoe computes in the weights' dtype and takes x in it)"])
        b, l, d = x_BLD.shape
        k = topk_scores_BLK.shape[-1]
        options = self._kittenmoe_options
        # Router scores join kittenmoe's fp32 combine as fp32 (torchtitan's router gives fp32 already).
        out_TD = moe(x_BLD.reshape(b * l, d), topk_expert_ids_BLK.reshape(b * l, k),
                     topk_scores_BLK.reshape(b * l, k).float(), gate_up_weight(w1_EFD, w3_EFD), w2_EDF,
                     backend=options.backend, config=options.config)
        return out_TD.view(b, l, d)


def _routed_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def apply_kittenmoe(model: nn.Module, options: Options = Options()) -> int:
    """Run every torchtitan ``RoutedExperts`` in ``model`` (``model`` itself included) through
    ``kittenmoe.moe``; returns how many. Each is checked first (``check_supported``), all before any is swapped,
    so a refusal leaves the model as it was. Again on a swapped model: new options. Call it before torchtitan's
    ``parallelize`` / ``fully_shard``; ``remove_kittenmoe`` swaps back."""
    if not isinstance(options, Options):
        raise TypeError(f"options must be kittenmoe.integrations.torchtitan.Options, got {type(options).__name__}")
    layers = _routed_experts(model)
    for routed in layers:
        check_supported(routed)
    for routed in layers:
        routed.__class__ = KittenmoeRoutedExperts
        routed._kittenmoe_options = options
    return len(layers)


def remove_kittenmoe(model: nn.Module) -> int:
    """Give every swapped ``RoutedExperts`` in ``model`` back its torchtitan forward; returns how many."""
    layers = [m for m in _routed_experts(model) if isinstance(m, KittenmoeRoutedExperts)]
    for routed in layers:
        routed.__class__ = RoutedExperts
        routed.__dict__.pop("_kittenmoe_options", None)
    return len(layers)


@torch.no_grad()
def fuse_gate_up_storage(model: nn.Module) -> int:
    """Move each ``GroupedExperts``' ``w1_EFD`` and ``w3_EFD`` into the two halves of one [E, 2F, D] buffer,
    keeping the parameter objects (the optimizer's references stay valid) and their values, so that kittenmoe
    reads its ``w13`` in place instead of concatenating them every forward. Returns how many. Plain (not
    DTensor) parameters only; call it after the weights reach their device and dtype and before building the
    optimizer's state, and not with FSDP, which all-gathers each parameter into storage of its own. The
    parameters become non-contiguous views; torchtitan's own forward still runs on them. A foreach optimizer
    (AdamW's default) runs a parameter group holding a non-dense tensor off its fast path, one kernel a tensor:
    give these parameters a group of their own (``p.is_contiguous()`` tells them apart)."""
    count = 0
    for routed in _routed_experts(model):
        experts = routed.inner_experts
        if type(experts) is not GroupedExperts:
            continue
        w1, w3 = experts.w1_EFD, experts.w3_EFD
        if isinstance(w1, DTensor) or isinstance(w3, DTensor):
            raise NotImplementedError("fuse_gate_up_storage needs plain tensors, not DTensor expert weights")
        if _halves_of_one_buffer(w1, w3):
            count += 1
            continue
        f = w1.shape[1]
        buf_E2FD = torch.cat([w1, w3], dim=1)
        w1.data = buf_E2FD[:, :f]
        w3.data = buf_E2FD[:, f:]
        count += 1
    return count
