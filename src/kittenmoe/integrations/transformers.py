"""kittenmoe as a Hugging Face transformers ``experts_implementation`` (transformers >= 5, optional extra).

    import kittenmoe.integrations.transformers as kt   # registers "kittenmoe" with transformers
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="kittenmoe")
    # or, on a built model: model.set_experts_implementation("kittenmoe")

transformers dispatches every ``@use_experts_implementation`` experts module through
``transformers.integrations.moe.ExpertsInterface``; the forward receives ``hidden_states [S, H]``,
``top_k_index [S, K]`` and ``top_k_weights [S, K]`` with the module's ``gate_up_proj [E, 2I, H]`` (gate rows
then up rows) and ``down_proj [E, H, I]``: exactly ``kittenmoe.moe``'s ``w13_E2IH`` and ``w2_EHI``, read in
place (no copy per call). The routed experts run through ``kittenmoe.moe`` (megakernel on CUDA, the torch
backend on CPU by default; one process, R=1), forward and backward; gradients reach ``gate_up_proj``,
``down_proj``, ``hidden_states`` and ``top_k_weights``. The model's router and shared expert stay HF's.

What the experts module may not have is refused with ``NotImplementedError`` naming it, never approximated:
biases, experts without a gate, transposed or interleaved weight layouts, a post-expert norm, an activation
other than SiLU, a custom ``_apply_gate``, and HF's own expert-parallel sentinel ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kittenmoe.config import KernelConfig
from kittenmoe.fp8 import FP8Config
from kittenmoe.functional import Backend, check_backend, check_config, moe, resolve_backend
from kittenmoe.autoconfig import auto_config

IMPLEMENTATION_NAME = "kittenmoe"


@dataclass(frozen=True)
class Options:
    """How the registered implementation runs: ``kittenmoe.moe``'s ``backend``, ``config`` (None: the
    ``kittenmoe tune`` cache entry for each call's shape, else the heuristic, as ``MoELayer`` does) and
    ``fp8`` (a ``kittenmoe.fp8.FP8Config``: the experts in e4m3, weights quantised every call; megakernel
    only, H and I multiples of 128; which GEMMs stay in the weights' dtype is the FP8 config's too, e.g.
    ``Options(fp8=FP8Config(dx_high=True, down_high=True))``). ``knobs``: ``KernelConfig`` fields set on top of the
    per-call config (tuned or heuristic), e.g. ``(("tile_group_m", -1),)``; pairs, so that the options stay
    hashable."""

    backend: Backend = "auto"
    config: KernelConfig | None = None
    fp8: FP8Config | None = None
    knobs: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        check_backend(self.backend)
        check_config(self.config, "Options.config")
        if not isinstance(self.knobs, tuple) or not all(isinstance(k, tuple) and len(k) == 2 for k in self.knobs):
            raise TypeError(f"Options.knobs must be a tuple of (KernelConfig field, value) pairs, got {self.knobs!r}")
        KernelConfig().with_(**dict(self.knobs))  # unknown fields and bad values fail here, not at the first call
        if self.fp8 is not None and not isinstance(self.fp8, FP8Config):
            raise TypeError(f"Options.fp8 must be a kittenmoe.fp8.FP8Config or None, got {type(self.fp8).__name__}")


def _is_silu(act: nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (nn.SiLU, SiLUActivation))


def check_supported(experts: nn.Module) -> None:
    """Raise ``NotImplementedError`` naming what this experts module needs that kittenmoe does not do."""
    from transformers.integrations.moe import _default_apply_gate

    name = type(experts).__name__
    missing = []
    if getattr(experts, "has_bias", False):
        missing.append("expert biases (has_bias=True)")
    if not getattr(experts, "has_gate", True):
        missing.append("experts without a gate (has_gate=False: up_proj only)")
    if getattr(experts, "is_transposed", False):
        missing.append("transposed weights (is_transposed=True: gate_up_proj [E, H, 2I])")
    if not getattr(experts, "is_concatenated", True):
        missing.append("interleaved gate/up rows (is_concatenated=False)")
    if getattr(experts, "has_post_expert_norm", False):
        missing.append("a post-expert norm (has_post_expert_norm=True)")
    if getattr(experts, "_is_expert_parallel", False):
        missing.append("transformers' expert parallelism (sentinel expert ids); use kittenmoe.ep for EP")
    if not _is_silu(getattr(experts, "act_fn", None)):
        missing.append(f"activation {type(getattr(experts, 'act_fn', None)).__name__} (only SiLU: SwiGLU experts)")
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        missing.append("a custom _apply_gate (only silu(gate) * up)")
    if missing:
        raise NotImplementedError(f"experts_implementation='kittenmoe' cannot run {name}: it needs "
                                  f"{'; '.join(missing)}. Use another experts_implementation for this model.")


def make_experts_forward(options: Options = Options()):
    """The function transformers calls in place of the experts module's forward."""

    def kittenmoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                  top_k_weights: torch.Tensor) -> torch.Tensor:
        check_supported(self)
        config = options.config
        if config is None and resolve_backend(options.backend, hidden_states.device) == "megakernel":
            # as MoELayer: the tune cache's entry for this call, else the heuristic (trace-time under compile)
            e, two_i, h = self.gate_up_proj.shape
            config = auto_config(hidden_states.shape[0], h, two_i // 2, e, top_k_index.shape[1], 0, 1,
                                 hidden_states.device, self.gate_up_proj.dtype, options.fp8)
        if options.knobs:  # (with_overrides: the heuristic's derived knobs follow them, as under --config)
            config = (config if config is not None else KernelConfig()).with_overrides(**dict(options.knobs))
        # Router weights join the fp32 combine as fp32; autograd casts their gradient back to their dtype.
        out = moe(hidden_states.contiguous(), top_k_index, top_k_weights.float(), self.gate_up_proj,
                  self.down_proj, backend=options.backend, config=config, fp8=options.fp8)
        return out.to(hidden_states.dtype)

    kittenmoe_experts_forward.options = options
    return kittenmoe_experts_forward


def register(options: Options = Options(), name: str = IMPLEMENTATION_NAME) -> None:
    """Register (or re-register with new options) the implementation under ``name`` with transformers."""
    if not isinstance(options, Options):
        raise TypeError(f"options must be kittenmoe.integrations.transformers.Options, got {type(options).__name__}")
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, make_experts_forward(options))


try:
    import transformers.integrations.moe as _hf_moe  # noqa: F401
except ImportError as e:  # the extra is not installed: say so at import, with the fix
    raise ImportError(f"kittenmoe.integrations.transformers needs transformers >= 5 with "
                      f"transformers.integrations.moe (pip install 'kittenmoe[transformers]'): {e}") from e
register()
