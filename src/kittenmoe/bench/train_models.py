"""The published MoE model configurations the training-step benchmark trains, built with transformers or
torchtitan (``benchmarks/train_step.py``, ``examples/train_hf_moe.py``), and the batches they train on.

At full width, truncated in depth to train on one GPU: Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA, hidden
2048, 64 routed experts of width 1408, top-6 by sigmoid scores scaled 2.446, 2 shared experts, the first layer
dense) and Qwen3-30B-A3B (hidden 2048, GQA 32/4, 128 experts of width 768, top-8 softmax renormalised, no shared
expert), randomly initialised from the config (no download), plus CPU-sized versions of each architecture.
Providers: with transformers, every registered ``experts_implementation`` (and ``eager``, the module's own
loop); with torchtitan, its own ``GroupedExperts`` or kittenmoe through ``kittenmoe.integrations.torchtitan``;
with either, ``no-routed-experts``: the routed experts computing nothing, the floor under every provider's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FLOOR = "no-routed-experts"
KITTENMOE = "kittenmoe"


@dataclass(frozen=True)
class Model:
    """A published configuration: what both stacks need to build it (``layers`` is the full depth)."""

    family: str  # "deepseek_v3" | "qwen3_moe"
    hidden: int
    layers: int
    dense_layers: int  # leading layers with a dense FFN instead of the MoE
    dense_inter: int
    moe_inter: int
    experts: int
    top_k: int
    shared: int  # shared experts (each moe_inter wide)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    hf_extra: tuple[tuple[str, object], ...] = ()
    titan_flavor: str | None = None  # torchtitan's model registry flavor, where it has the model


MODELS = {
    # moonshotai/Moonlight-16B-A3B config.json (DeepseekV3ForCausalLM)
    "moonlight-16b-a3b": Model("deepseek_v3", 2048, 27, 1, 11264, 1408, 64, 6, 2, 16, 16, 128, 163840, hf_extra=(
        ("kv_lora_rank", 512), ("q_lora_rank", None), ("qk_rope_head_dim", 64), ("qk_nope_head_dim", 128),
        ("v_head_dim", 128), ("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 2.446),
        ("norm_topk_prob", True), ("rope_theta", 50000.0), ("rms_norm_eps", 1e-5),
        ("max_position_embeddings", 8192))),
    # Qwen/Qwen3-30B-A3B config.json (Qwen3MoeForCausalLM)
    "qwen3-30b-a3b": Model("qwen3_moe", 2048, 48, 0, 6144, 768, 128, 8, 0, 32, 4, 128, 151936, hf_extra=(
        ("norm_topk_prob", True), ("rope_theta", 1e6), ("rms_norm_eps", 1e-6), ("max_position_embeddings", 40960)),
        titan_flavor="30B-A3B"),
    # CPU smoke sizes of the two architectures
    "tiny-deepseek-v3": Model("deepseek_v3", 64, 3, 1, 96, 32, 8, 2, 1, 2, 2, 16, 256, hf_extra=(
        ("kv_lora_rank", 16), ("q_lora_rank", None), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 8),
        ("v_head_dim", 8), ("n_group", 1), ("topk_group", 1), ("norm_topk_prob", True))),
    # (torchtitan's debugmodel_moe: both stacks build the same shape)
    "tiny-qwen3-moe": Model("qwen3_moe", 256, 8, 0, 768, 768, 64, 8, 0, 16, 8, 128, 2048, hf_extra=(
        ("norm_topk_prob", True),), titan_flavor="debugmodel_moe"),
}


# ---- the Hugging Face stack ---------------------------------------------------------------------------------

def hf_config(spec: Model, layers: int):
    """The transformers config of ``spec``, ``layers`` deep (transformers accepts unknown keys silently:
    the tests check the built config's values)."""
    import transformers

    if spec.family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.dense_inter,
            moe_intermediate_size=spec.moe_inter, num_hidden_layers=layers, first_k_dense_replace=spec.dense_layers,
            n_routed_experts=spec.experts, num_experts_per_tok=spec.top_k, n_shared_experts=spec.shared,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, tie_word_embeddings=False,
            **dict(spec.hf_extra))
    return transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.dense_inter,
        moe_intermediate_size=spec.moe_inter, num_hidden_layers=layers, num_experts=spec.experts,
        num_experts_per_tok=spec.top_k, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, tie_word_embeddings=False, **dict(spec.hf_extra))


def build_hf(spec: Model, layers: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model, initialised on ``device`` in ``dtype`` from seed 0, except the modules transformers keeps in
    fp32 (DeepSeek-V3's router weight and score-correction bias), as ``from_pretrained`` would load them. Its
    experts implementation is transformers' default until ``set_experts_implementation``."""
    import transformers

    cls = transformers.DeepseekV3ForCausalLM if spec.family == "deepseek_v3" else transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(hf_config(spec, layers), dtype=dtype)


def register_hf_floor() -> None:
    """The floor as an experts implementation: output ``hidden_states * 0``, with one element of each expert
    weight and the router weights joined (times 0) so the expert weights and the router still get (zero)
    gradients and AdamW still updates them, as every real implementation's step pays."""
    from transformers.integrations.moe import ExpertsInterface

    def forward(self, hidden_states, top_k_index, top_k_weights):
        touch = (self.gate_up_proj[0, 0, 0] + self.down_proj[0, 0, 0]).to(hidden_states.dtype)
        return hidden_states * 0 + touch * 0 + top_k_weights.sum().to(hidden_states.dtype) * 0

    ExpertsInterface.register(FLOOR, forward)


def sonicmoe_from_pip() -> str | None:
    """Point transformers' ``sonicmoe`` experts implementation at the pip sonic-moe; None when done, else why not.

    transformers loads SonicMoE's kernels from the Hugging Face Hub (the ``kernels`` package) on the first call
    and keeps them in ``transformers.integrations.sonicmoe._SONICMOE``; a GPU machine without a network has the
    pip wheels instead (``scripts/sonicmoe_wheels.sh``), whose ``moe_general_routing_inputs`` and
    ``ActivationType`` are the same entry points. Filling that slot with them leaves transformers' own glue
    (``sonicmoe_experts_forward``: routing flattening, weight permutes, ``concat_layout``) to run as it is."""
    from kittenmoe.baselines_sonic import import_sonicmoe

    try:
        moe_general_routing_inputs, activation_type = import_sonicmoe()
        import transformers.integrations.sonicmoe as hf_sonic
    except ImportError as e:
        return str(e)
    if not hasattr(hf_sonic, "SonicMoE") or not hasattr(hf_sonic, "_SONICMOE"):
        return "this transformers keeps its SonicMoE kernels elsewhere (no integrations.sonicmoe._SONICMOE)"
    if hf_sonic._SONICMOE is None:
        hf_sonic._SONICMOE = hf_sonic.SonicMoE(activation_type_enum=activation_type,
                                               moe_general_routing_inputs=moe_general_routing_inputs)
    return None


def hf_providers() -> list[str]:
    """Every experts implementation transformers has registered here (with its module's own loop, ``eager``),
    kittenmoe's, and the floor. transformers' ``sonicmoe`` gets the pip sonic-moe where it imports
    (``sonicmoe_from_pip``)."""
    import kittenmoe.integrations.transformers  # noqa: F401  (registers "kittenmoe")
    from transformers.integrations.moe import ExpertsInterface

    register_hf_floor()
    if "sonicmoe" in ExpertsInterface._global_mapping:
        why = sonicmoe_from_pip()
        if why is not None:
            print(f"sonicmoe from the pip wheels: not set up ({why.split(';')[0]}); transformers loads its own",
                  flush=True)
    names = ["eager"] + [n for n in ExpertsInterface._global_mapping if n not in (KITTENMOE, FLOOR)]
    return names + [KITTENMOE, FLOOR]


def hf_loss(model: nn.Module, ids_BS: torch.Tensor) -> torch.Tensor:
    return model(ids_BS, labels=ids_BS, use_cache=False).loss  # (a training step keeps no KV cache)


OPTIMIZER = "AdamW fused"  # what ``adamw`` builds, as the rows record it (rows without the field ran foreach)


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters, in one group, with torch's fused kernels: torchtitan's
    default implementation, which its trainers run. The foreach one spanned 53 ms of a 4-layer Qwen3-30B-A3B
    step's ~141 ms floor on an H100 (AdamW over 3 G parameters), the same for every provider, so it diluted the
    routed experts' share of the step. Every parameter the models here train is dense (``fuse_gate_up_storage``
    makes torchtitan's gate and up one dense parameter)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)


# ---- the torchtitan stack -----------------------------------------------------------------------------------

def titan_flavor(spec: Model) -> str:
    """torchtitan's registry flavor of ``spec``; NotImplementedError naming the models torchtitan builds here."""
    if spec.titan_flavor is None:
        raise NotImplementedError(f"torchtitan has no configuration of this model here (torchtitan builds "
                                  f"{[n for n, m in MODELS.items() if m.titan_flavor]})")
    return spec.titan_flavor


class _NoDataParallelMeshDims:
    """Stands in for ``torch.distributed.fsdp.DataParallelMeshDims`` where torch predates it: refuses to be built."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("this torch has no DataParallelMeshDims (torch.distributed.fsdp): torchtitan's "
                                  "FSDP and data-parallel helpers need a newer torch")


def _titan_imports_on_older_torch() -> None:
    """torchtitan 0.3's model packages import ``DataParallelMeshDims`` from ``torch.distributed.fsdp`` (through
    torchtitan's FSDP module) at module load; torch 2.11 lacks the name. The one-GPU step here applies no FSDP
    or data parallelism, so where the name is missing it gets a stand-in that raises if anything builds one."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _NoDataParallelMeshDims


TITAN_ATTENTION = ("flex", "sdpa")


def build_titan(spec: Model, layers: int, device: torch.device, dtype: torch.dtype,
                attention: str = "flex") -> nn.Module:
    """``spec``'s first ``layers`` layers as torchtitan builds them. ``attention`` "flex" is its trainer's default
    (FlexAttention with the causal document mask); "sdpa" swaps in causal SDPA (the same math for one document a
    row), for a torch whose FlexAttention torchtitan cannot drive (torch 2.11's ``create_block_mask`` lacks
    ``separate_full_blocks``) and on the CPU, where FlexAttention has no backward. Every provider of a run
    attends the same way, so the comparison between them holds either way."""
    flavor = titan_flavor(spec)
    if attention not in TITAN_ATTENTION:
        raise ValueError(f"attention {attention!r}: one of {TITAN_ATTENTION}")
    _titan_imports_on_older_torch()
    from torchtitan.models.qwen3 import qwen3_configs

    cfg = qwen3_configs[flavor](attn_backend="flex")  # (its trainer's default; its sdpa backend is refused)
    cfg.layers = cfg.layers[:layers]
    if attention == "sdpa" or device.type == "cpu":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
        model.init_states(buffer_device=device)
    with torch.no_grad():  # the parameters in dtype; the buffers (the routers' token counts and bias) stay fp32
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


class _TitanFloor(nn.Module):
    """torchtitan's ``RoutedExperts`` computing nothing (the floor): see ``register_hf_floor``."""

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        e = self.inner_experts
        touch = (e.w1_EFD[0, 0, 0] + e.w2_EDF[0, 0, 0] + e.w3_EFD[0, 0, 0]).to(x_BLD.dtype)
        return x_BLD * 0 + touch * 0 + topk_scores_BLK.sum() * 0


def titan_providers() -> list[str]:
    return ["torchtitan", KITTENMOE, FLOOR]


def apply_titan(model: nn.Module, provider: str) -> None:
    if provider == KITTENMOE:
        from kittenmoe.integrations.torchtitan import apply_kittenmoe, fuse_gate_up_storage

        apply_kittenmoe(model)
        # (no FSDP here, and adamw builds the optimizer after: one dense w13 parameter, read in place, no
        # gate|up copy per step, its gradient kittenmoe's own)
        fuse_gate_up_storage(model)
    elif provider == FLOOR:
        from torchtitan.models.common.moe import RoutedExperts

        for m in model.modules():
            if isinstance(m, RoutedExperts):
                m.__class__ = type("FloorRoutedExperts", (_TitanFloor, RoutedExperts), {})


def titan_loss(model: nn.Module, ids_BS: torch.Tensor, flex: bool = True) -> torch.Tensor:
    """Next-token loss of a ``build_titan`` model; ``flex`` as it was built (with FlexAttention, not SDPA)."""
    # positions and the causal document mask as torchtitan's trainer passes them (one document a row)
    positions_BS = torch.arange(ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
    flex = flex and ids_BS.device.type != "cpu"
    logits_BSV = model(ids_BS, positions_BS, model.get_attention_masks(positions_BS) if flex else None)
    return F.cross_entropy(logits_BSV[:, :-1].flatten(0, 1).float(), ids_BS[:, 1:].flatten())


def zipf_batches(n: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    """``n`` batches of token ids, Zipf(1) over the vocabulary from a fixed seed: a unigram distribution the
    model learns within the first steps, so the loss curves move and a wrong implementation shows."""
    p_V = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    return [torch.multinomial(p_V, batch * seq, replacement=True, generator=g).view(batch, seq) for _ in range(n)]


def train_timed(model: nn.Module, batches: list[torch.Tensor], loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                device: torch.device, warmup: int, lr: float = 3e-4) -> tuple[float, list[float]]:
    """Train ``model`` on ``batches`` with AdamW (``adamw``), one step a batch; returns tokens/s over the steps
    after ``warmup`` (wall time, the device synchronised at both ends) and every step's loss. What the examples
    run; ``benchmarks/train_step.py`` times its steps apart with CUDA events."""
    opt = adamw(model, lr)
    losses = []
    for i, ids in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        loss = loss_fn(model, ids.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return sum(b.numel() for b in batches[warmup:]) / seconds, [float(x) for x in losses]
