"""kittenmoe under torchtitan's MoE layers (torchtitan 0.3.0, optional extra ``[torchtitan]``).

    from kittenmoe.integrations.torchtitan import apply_kittenmoe, fuse_gate_up_storage
    model = model_config.build()      # any module holding torchtitan MoE layers, or one MoE
    apply_kittenmoe(model)            # before torchtitan's parallelize / fully_shard
    # optional, without FSDP / TP / EP, before building the optimizer: one dense gate|up parameter
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
an activation-checkpointing recompute), 2*E*F*D elements, unless ``fuse_gate_up_storage`` has made the experts
a ``FusedGateUpExperts``: one dense parameter ``w13_E2FD`` [E, 2F, D] in place of ``w1_EFD`` and ``w3_EFD``,
which become read-only views of its two halves. kittenmoe reads that parameter in place and its gradient lands
in ``w13_E2FD.grad`` as the kernels write it; a foreach optimizer keeps every parameter on its fast path (a
non-dense parameter would take its group off it). torchtitan's forward, its ``param_init`` initialisers
(``init_states``) and the state dict (torchtitan's ``w1_EFD`` / ``w3_EFD`` keys, loaded back into
``w13_E2FD``) work on the views; ``.to()``, ``to_empty()`` and any ``_apply`` move the one parameter as it is.

Precision. torchtitan's ``GroupedExperts`` casts x and the weights to bf16 for ``torch._grouped_mm`` whatever
their dtype, and its combine rounds every weighted row to x's dtype before summing in that dtype. kittenmoe
computes in the weights' dtype (x must share it; under torchtitan's FSDP mixed precision both are bf16) and
sums the K weighted rows of a token in fp32, rounding once. So bf16 layers agree within bf16 tolerance, and
fp32 parameters compute in fp32 here where torchtitan computes in bf16.

What the layer may not have is refused with ``NotImplementedError`` naming it, never approximated: experts
other than plain ``GroupedExperts`` or its ``FusedGateUpExperts`` (``FusedGroupedExperts``' interleaved
[E, F, 2, D] gate|up, ``GptOssGroupedExperts``' biases and clamped activation, MXFP8's quantised
``_grouped_mm``), a subclassed ``RoutedExperts`` forward, expert parallelism (an EP token dispatcher, or the
all-to-all dispatcher with an EP mesh: use ``kittenmoe.moe_ep``), expert weights sharded as DTensors (tensor
parallelism), spmd_types type checking, and activations in another dtype than the weights. ``apply_kittenmoe``
must run before torchtitan's ``parallelize``, which wraps each module's forward at that point.
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
    if type(experts) not in (GroupedExperts, FusedGateUpExperts):
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


_GATE_UP = ("w1_EFD", "w3_EFD")
_GROUPED_EXPERTS_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")  # as GroupedExperts registers them: its state dict order


class FusedGateUpExperts(GroupedExperts):
    """``GroupedExperts`` whose gate and up weights are one dense parameter, ``w13_E2FD`` [E, 2F, D] (the gate
    rows, then the up rows: kittenmoe's ``w13`` as it is), what ``fuse_gate_up_storage`` swaps in. ``w1_EFD``
    and ``w3_EFD`` are read-only properties, the views ``w13_E2FD[:, :F]`` and ``w13_E2FD[:, F:]``: torchtitan's
    forward and whatever reads them run as before, and in-place writes (``copy_``, ``nn.init.*_``) land in
    ``w13_E2FD``; assigning them raises. The state dict is torchtitan's (``w1_EFD``, ``w2_EDF``, ``w3_EFD``, the
    gate and up as views of ``w13_E2FD``) and loading one fills ``w13_E2FD``; ``init_states`` runs torchtitan's
    ``param_init`` entries for ``w1_EFD`` and ``w3_EFD`` into ``w13_E2FD``'s halves, in ``GroupedExperts``'
    order, so a seed gives the values it gives unfused."""

    w13_E2FD: nn.Parameter

    @property
    def w1_EFD(self) -> torch.Tensor:
        return self.w13_E2FD[:, :self.w13_E2FD.shape[1] // 2]

    @property
    def w3_EFD(self) -> torch.Tensor:
        return self.w13_E2FD[:, self.w13_E2FD.shape[1] // 2:]

    def __setattr__(self, name: str, value) -> None:
        # nn.Module.__setattr__ would register a Parameter under the name beside the property (a KeyError) and
        # hand anything else to the property: one clear refusal for both
        if name in _GATE_UP:
            raise NotImplementedError(
                f"{name} of a FusedGateUpExperts is a view of w13_E2FD (fuse_gate_up_storage) and cannot be "
                f"reassigned: write into it in place (copy_, nn.init) or assign w13_E2FD [E, 2F, D], gate rows "
                f"then up rows")
        super().__setattr__(name, value)

    def _init_self_parameters(self) -> None:
        # torchtitan's Module.init_states looks each own parameter's name up in param_init, which names
        # GroupedExperts' three. The gate and up initialisers each get a dense parameter of their half's shape,
        # copied in after: random fills of a strided view draw other values than of a dense tensor (CPU
        # normal_), and an initialiser may replace its tensor's data; so a seed gives the unfused values.
        if self._param_init is None:
            super()._init_self_parameters()  # torchtitan's error: GroupedExperts has no reset_parameters
            return
        with torch.no_grad():
            for name in _GROUPED_EXPERTS_PARAMS:
                if name not in _GATE_UP:
                    self._init_param(name, getattr(self, name))
                    continue
                view = getattr(self, name)
                half = nn.Parameter(torch.empty_like(view, memory_format=torch.contiguous_format),
                                    requires_grad=self.w13_E2FD.requires_grad)
                self._init_param(name, half)
                view.copy_(half)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        # torchtitan's keys in its order; the gate and up are views of w13_E2FD, sharing its memory as an
        # unfused model's state dict shares its parameters' (torch.save writes their one storage once; DCP copies
        # each out)
        own = {}
        super()._save_to_state_dict(own, prefix, keep_vars)
        w13_E2FD = own.pop(prefix + "w13_E2FD")
        f = w13_E2FD.shape[1] // 2
        views = {"w1_EFD": w13_E2FD[:, :f], "w3_EFD": w13_E2FD[:, f:]}
        for name in _GROUPED_EXPERTS_PARAMS:
            destination[prefix + name] = views[name] if name in views else own.pop(prefix + name)
        destination.update(own)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # torchtitan's w1_EFD and w3_EFD become one [E, 2F, D] tensor that torch's own loading copies into
        # w13_E2FD (or, with assign=True, makes the new w13_E2FD); missing and unexpected keys are torchtitan's
        key1, key3, key13 = prefix + "w1_EFD", prefix + "w3_EFD", prefix + "w13_E2FD"
        own = {k: v for k, v in state_dict.items() if k not in (key1, key3, key13)}
        if key13 in state_dict:  # (a fused model's state dict never has it)
            unexpected_keys.append(key13)
        given = {}
        for key, view in ((key1, self.w1_EFD), (key3, self.w3_EFD)):
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or '
                                  f'Tensor-like object from checkpoint but received {type(value)}')
            elif value.shape != view.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {view.shape}.")
            else:
                given[key] = value
        if len(given) == 2:
            w1, w3 = given[key1], given[key3]
            own[key13] = torch.cat([w1, w3.to(device=w1.device, dtype=w1.dtype)], dim=1)
        missing = []
        super()._load_from_state_dict(own, prefix, local_metadata, strict, missing, unexpected_keys, error_msgs)
        for key in missing:
            missing_keys.extend([k for k in (key1, key3) if k not in state_dict] if key == key13 else [key])
        if len(given) == 1:  # one half alone (strict=False): written into its view, as unfused copies it in
            (key, value), = given.items()
            with torch.no_grad():
                (self.w1_EFD if key == key1 else self.w3_EFD).copy_(value)


def _check_fusable(experts: nn.Module) -> None:
    w1, w3 = experts.w1_EFD, experts.w3_EFD
    if isinstance(w1, DTensor) or isinstance(w3, DTensor):
        raise NotImplementedError("fuse_gate_up_storage needs plain tensors, not DTensor expert weights (FSDP, "
                                  "tensor or expert parallelism shard each parameter on its own)")
    one, three = ((w.shape, w.dtype, w.device, w.requires_grad) for w in (w1, w3))
    if one != three:
        raise NotImplementedError(f"fuse_gate_up_storage makes w1_EFD and w3_EFD one parameter, so they need one "
                                  f"shape, dtype, device and requires_grad: w1_EFD {one}, w3_EFD {three}")
    if (w1.grad is None) != (w3.grad is None):
        raise NotImplementedError("fuse_gate_up_storage found a gradient on only one of w1_EFD and w3_EFD; the "
                                  "fused parameter has one .grad (zero_grad(set_to_none=True) first)")


def _fuse(experts: nn.Module) -> None:
    w1, w3 = experts.w1_EFD, experts.w3_EFD
    w13_E2FD = nn.Parameter(torch.cat([w1, w3], dim=1), requires_grad=w1.requires_grad)
    if w1.grad is not None:
        w13_E2FD.grad = torch.cat([w1.grad, w3.grad], dim=1)
    params = experts._parameters
    others = {n: p for n, p in params.items() if n not in _GATE_UP}
    params.clear()
    params["w13_E2FD"] = w13_E2FD  # (first, where w1_EFD was: named_parameters lists the gate|up, then w2_EDF)
    params.update(others)
    experts.__class__ = FusedGateUpExperts


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
        if isinstance(experts, FusedGateUpExperts):
            # the dense parameter as it is: no copy, and kittenmoe's d_w13 is its gradient as it stands
            w13_E2FD = _local_weight(self, "w13_E2FD", experts.w13_E2FD)
        else:
            w13_E2FD = torch.cat([_local_weight(self, "w1_EFD", experts.w1_EFD),
                                  _local_weight(self, "w3_EFD", experts.w3_EFD)], dim=1)
        w2_EDF = _local_weight(self, "w2_EDF", experts.w2_EDF)
        if x_BLD.dtype != w13_E2FD.dtype:
            _refuse(self, [f"x in {x_BLD.dtype} with expert weights in {w13_E2FD.dtype} (torchtitan casts both "
                           f"to bf16; kittenmoe computes in the weights' dtype and takes x in it)"])
        b, l, d = x_BLD.shape
        k = topk_scores_BLK.shape[-1]
        options = self._kittenmoe_options
        # Router scores join kittenmoe's fp32 combine as fp32 (torchtitan's router gives fp32 already).
        out_TD = moe(x_BLD.reshape(b * l, d), topk_expert_ids_BLK.reshape(b * l, k),
                     topk_scores_BLK.reshape(b * l, k).float(), w13_E2FD, w2_EDF,
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
    """Give every swapped ``RoutedExperts`` in ``model`` back its torchtitan forward; returns how many. Experts
    that ``fuse_gate_up_storage`` fused stay fused (the parameter objects an optimizer holds stay valid):
    torchtitan's forward reads their ``w1_EFD`` / ``w3_EFD`` views, and ``apply_kittenmoe`` takes them again."""
    layers = [m for m in _routed_experts(model) if isinstance(m, KittenmoeRoutedExperts)]
    for routed in layers:
        routed.__class__ = RoutedExperts
        routed.__dict__.pop("_kittenmoe_options", None)
    return len(layers)


@torch.no_grad()
def fuse_gate_up_storage(model: nn.Module) -> int:
    """Make every plain ``GroupedExperts`` under a ``RoutedExperts`` in ``model`` a ``FusedGateUpExperts``: its
    ``w1_EFD`` and ``w3_EFD`` parameters become one dense parameter ``w13_E2FD`` = cat(w1, w3) [E, 2F, D]
    (values and any gradients kept), which kittenmoe reads in place instead of concatenating them every forward,
    and whose gradient kittenmoe writes whole; ``w1_EFD`` / ``w3_EFD`` stay readable as views of it, and the state
    dict keeps torchtitan's keys. Returns how many experts modules are fused (those fused already included, so a
    second call changes nothing); other experts are left alone (``apply_kittenmoe`` refuses them).

    The parameter objects change (``named_parameters()`` lists ``w13_E2FD``, then ``w2_EDF``): call it before
    building the optimizer. Plain (not DTensor) parameters only (DTensor weights raise ``NotImplementedError``):
    not with FSDP, tensor or expert parallelism, whose torchtitan sharding configs name ``w1_EFD`` and ``w3_EFD``
    and which kittenmoe has not been checked on with ``w13_E2FD``. It may run on the meta device, before
    ``to_empty()`` and ``init_states()``. Every module is checked before any is fused, so a refusal leaves the
    model as it was; ``remove_kittenmoe`` leaves the experts fused."""
    to_fuse, count = {}, 0
    for routed in _routed_experts(model):
        experts = routed.inner_experts
        if type(experts) is FusedGateUpExperts:
            count += 1
        elif type(experts) is GroupedExperts and id(experts) not in to_fuse:
            _check_fusable(experts)
            to_fuse[id(experts)] = experts
    for experts in to_fuse.values():
        _fuse(experts)
    return count + len(to_fuse)
