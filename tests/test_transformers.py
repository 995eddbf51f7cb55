"""kittenmoe as a Hugging Face transformers experts implementation (kittenmoe.integrations.transformers).

Tiny randomly initialised DeepSeek-V3 and Qwen3-MoE models built from their configs (no downloads): logits
and every parameter gradient with ``experts_implementation="kittenmoe"`` against ``"eager"``; unsupported
experts modules raise ``NotImplementedError`` naming what is missing. GPU: bf16 with the megakernel, and a
20-step training trajectory against ``grouped_mm``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed "
                                                          "(pip install -e '.[test,transformers]')")

import kittenmoe.integrations.transformers as kt  # noqa: E402  (registers "kittenmoe")
from kittenmoe.testing import assert_close  # noqa: E402

VOCAB = 64


def _deepseek_v3(**kw):
    # 2 layers: the first dense (first_k_dense_replace=1), the second MoE with 8 experts, top-2, a shared expert
    args = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    cfg = transformers.DeepseekV3Config(**{**args, **kw})
    return transformers.DeepseekV3ForCausalLM(cfg)


def _qwen3_moe(**kw):
    # 2 MoE layers of 8 experts, top-3 (renormalised), no shared expert
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, max_position_embeddings=64, **kw)
    return transformers.Qwen3MoeForCausalLM(cfg)


MODELS = {"deepseek-v3": _deepseek_v3, "qwen3-moe": _qwen3_moe}


def _step(model, impl, ids):
    """Logits and every parameter gradient of one LM loss with the experts run by ``impl``."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None}


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_eager_fp32(name, monkeypatch):
    """Logits and all gradients (experts, router, attention, embeddings) equal eager's at fp32 tolerances, and
    the kittenmoe path really ran (counted) on every MoE layer."""
    torch.manual_seed(0)
    model = MODELS[name]().float()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    calls = []
    real_moe = kt.moe
    monkeypatch.setattr(kt, "moe", lambda *a, **k: calls.append(1) or real_moe(*a, **k))
    logits_e, grads_e = _step(model, "eager", ids)
    assert not calls
    logits_k, grads_k = _step(model, "kittenmoe", ids)
    assert len(calls) == len(_experts_modules(model)) > 0
    assert_close(logits_k, logits_e, torch.float32, "logits")
    assert sorted(grads_k) == sorted(grads_e)
    for n in grads_e:
        assert_close(grads_k[n], grads_e[n], torch.float32, f"d {n}")
    experts = _experts_modules(model)[0]
    assert grads_k[next(n for n, p in model.named_parameters() if p is experts.gate_up_proj)].abs().sum() > 0


def test_megakernel_backend_matches_eager_fp32():
    """Options(backend="megakernel") (the Triton kernels; on CPU under the interpreter) with no config: the
    tuned-or-heuristic config path, logits and gradients at fp32 tolerances against eager."""
    try:
        kt.register(kt.Options(backend="megakernel"), name="kittenmoe-mk")
        torch.manual_seed(0)
        model = _deepseek_v3().float()
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        logits_e, grads_e = _step(model, "eager", ids)
        logits_k, grads_k = _step(model, "kittenmoe-mk", ids)
    finally:
        transformers.integrations.moe.ExpertsInterface._global_mapping.pop("kittenmoe-mk", None)
    assert_close(logits_k, logits_e, torch.float32, "logits")
    for n in grads_e:
        assert_close(grads_k[n], grads_e[n], torch.float32, f"d {n}")


@pytest.mark.parametrize("backend", [
    "torch",  # the torch backend's ops traced into the graph (its route check becomes an async assert)
    "megakernel",  # the custom op with its fake impl (the Triton kernels under the interpreter on CPU)
])
def test_moe_block_compiles_fullgraph(backend):
    """A Qwen3-MoE block (router + kittenmoe experts) under ``torch.compile(fullgraph=True)``: no graph break
    in the integration, and output and input gradient equal the uncompiled block's."""
    name = f"kittenmoe-{backend}"
    try:
        kt.register(kt.Options(backend=backend), name=name)
        torch.manual_seed(0)
        model = _qwen3_moe().float()
        model.set_experts_implementation(name)
        block = model.model.layers[0].mlp
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
        want = block(x)
        (want * x.detach()).sum().backward()
        d_x_want, x.grad = x.grad, None
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        (got * x.detach()).sum().backward()
    finally:
        transformers.integrations.moe.ExpertsInterface._global_mapping.pop(name, None)
    assert_close(got.detach(), want.detach(), torch.float32, "out")
    assert_close(x.grad, d_x_want, torch.float32, "d x")


@pytest.mark.parametrize("scale_block", [
    128,  # DeepSeek-V3's 1 x 128 / 128 x 128 blocks
    32,  # MXFP8's 32-blocks with power-of-two scales (on FP8Config.tile_block_n's 128-wide tiles)
])
def test_fp8_option_close_to_eager(scale_block):
    """Options(backend="megakernel", fp8=FP8Config(...)): a DeepSeek-V3 whose expert widths are multiples of 128
    runs its experts in e4m3; logits and every gradient within the fp8 bar (rel L1 <= 0.1, cosine >= 0.996) of
    eager, the config's block_n set by the integration to MoELayer's FP8 tile width."""
    from kittenmoe.fp8 import FP8Config
    from kittenmoe.testing import cosine, rel_l1

    try:
        kt.register(kt.Options(backend="megakernel", fp8=FP8Config(scale_block, pow2_scales=scale_block == 32)),
                    name="kittenmoe-fp8")
        torch.manual_seed(0)
        model = _deepseek_v3(hidden_size=128, moe_intermediate_size=128, intermediate_size=128,
                             n_routed_experts=4).float()
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
        logits_e, grads_e = _step(model, "eager", ids)
        logits_k, grads_k = _step(model, "kittenmoe-fp8", ids)
    finally:
        transformers.integrations.moe.ExpertsInterface._global_mapping.pop("kittenmoe-fp8", None)
    for n, a, b in [("logits", logits_k, logits_e)] + [(f"d {n}", grads_k[n], grads_e[n]) for n in grads_e]:
        if b.abs().sum() == 0:  # parameters the loss does not reach
            continue
        assert rel_l1(a.double(), b.double()) <= 0.1 and cosine(a.double(), b.double()) >= 0.996, \
            f"{n}: rel L1 {rel_l1(a.double(), b.double()):.3e}, cosine {cosine(a.double(), b.double()):.5f}"


def test_fp8_option_type_checked():
    with pytest.raises(TypeError, match="Options.fp8 must be a kittenmoe.fp8.FP8Config"):
        kt.Options(fp8="e4m3")


class _Experts(torch.nn.Module):
    """The attributes check_supported reads, as HF's experts modules have them: 4 experts, gate|up [2I, H]."""

    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 2 * i, h))
        self.down_proj = torch.nn.Parameter(torch.randn(4, h, i))
        self.act_fn = torch.nn.SiLU()


def test_knobs_option_checked_and_applied(monkeypatch):
    """Options(knobs=...): KernelConfig fields on top of the per-call config, checked when the options are made;
    the experts forward hands kittenmoe.moe a config carrying them."""
    with pytest.raises(TypeError, match="pairs"):
        kt.Options(knobs=[("tile_group_m", -1)])  # a list, not a tuple of pairs
    with pytest.raises(TypeError):
        kt.Options(knobs=(("no_such_knob", 1),))
    with pytest.raises(TypeError, match="must be a bool"):
        kt.Options(knobs=(("combine_gather", 1),))
    seen = {}

    def fake_moe(x, ids, w, w13, w2, backend, config, fp8):
        seen["config"] = config
        return x

    monkeypatch.setattr(kt, "moe", fake_moe)
    knobs = (("tile_group_m", -1), ("keep_activations", False))
    fwd = kt.make_experts_forward(kt.Options(backend="torch", knobs=knobs))

    fwd(_Experts(h=16, i=16), torch.randn(6, 16), torch.zeros(6, 2, dtype=torch.long), torch.rand(6, 2))
    assert seen["config"].tile_group_m == -1 and seen["config"].keep_activations is False


@pytest.mark.parametrize("scale_block", [
    32,  # MXFP8: 128-wide tiles hold four scale blocks (32-wide ones would give the backward 16-wide d(gate|up)
    # blocks, which the FP8 launch refuses)
    128,  # DeepSeek-V3's blocks: one a tile
])
def test_fp8_scale_block_tiles_keep_a_config_that_runs(monkeypatch, scale_block):
    """The megakernel path's heuristic config on a Hopper GPU sets wgrad="gluon"; with FP8 the integration takes
    MoELayer's gate|up tile width (``FP8Config.tile_block_n``, 128 for both blocks), so the knob stays, and the
    tiles pass what the FP8 launch checks (at 32 wide they did not: every MXFP8 call raised). The device and
    the heuristic are faked (no GPU here)."""
    from kittenmoe import autoconfig
    from kittenmoe.autograd import CONFIG_FIELDS
    from kittenmoe.config import KernelConfig
    from kittenmoe.fp8 import FP8Config
    from kittenmoe.launch_common import fp8_dgu_block

    seen = {}
    monkeypatch.setattr(kt, "resolve_backend", lambda backend, device: "megakernel")
    monkeypatch.setattr(autoconfig, "_auto_config_args", lambda *a: tuple(
        getattr(KernelConfig(wgrad="gluon"), f) for f in CONFIG_FIELDS))
    monkeypatch.setattr(kt, "moe", lambda x, *a, config, **k: seen.update(config=config) or x)
    fp8 = FP8Config(scale_block, scale_block == 32)
    fwd = kt.make_experts_forward(kt.Options(backend="megakernel", fp8=fp8))

    fwd(_Experts(h=128, i=128), torch.randn(6, 128), torch.zeros(6, 2, dtype=torch.long), torch.rand(6, 2))
    cfg = seen["config"]
    assert cfg.block_n == 128 and cfg.wgrad == "gluon"
    # what launch_common.check_fp8 asks of the tiles: whole scale blocks a tile, d(gate|up) blocks >= 32 for e4m3 dots
    assert cfg.block_n % scale_block == 0 and fp8_dgu_block(cfg, scale_block) >= 32


def test_empty_batch_on_the_megakernel_backend():
    """A call with no tokens (an empty micro-batch) picks its config like any other and returns [0, H] with zero
    gradients, instead of failing in the config choice."""
    experts = _Experts(h=64, i=32)
    x = torch.randn(0, 64, requires_grad=True)
    out = kt.make_experts_forward(kt.Options(backend="megakernel"))(
        experts, x, torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2))
    assert out.shape == (0, 64)
    out.sum().backward()
    assert not x.grad.any() and not experts.gate_up_proj.grad.any() and not experts.down_proj.grad.any()


@pytest.mark.parametrize("attr,value,match", [
    ("has_bias", True, "expert biases"),  # GPT-OSS style biases
    ("has_gate", False, "without a gate"),  # up_proj-only experts
    ("is_transposed", True, "transposed weights"),  # [E, H, 2I] storage
    ("is_concatenated", False, "interleaved"),  # gate0, up0, gate1, ... rows
    ("has_post_expert_norm", True, "post-expert norm"),
    ("_is_expert_parallel", True, "expert parallelism"),  # transformers' sentinel ids
    ("act_fn", torch.nn.GELU(), "activation GELU"),  # not SwiGLU
])
def test_unsupported_experts_raise(attr, value, match):
    torch.manual_seed(0)
    model = _deepseek_v3().float()
    setattr(_experts_modules(model)[0], attr, value)
    model.set_experts_implementation("kittenmoe")
    with pytest.raises(NotImplementedError, match=match):
        model(torch.randint(0, VOCAB, (1, 4)))


def test_custom_apply_gate_raises(monkeypatch):
    torch.manual_seed(0)
    model = _deepseek_v3().float()
    cls = type(_experts_modules(model)[0])
    monkeypatch.setattr(cls, "_apply_gate", lambda self, gu: gu.chunk(2, -1)[0], raising=False)
    model.set_experts_implementation("kittenmoe")
    with pytest.raises(NotImplementedError, match="custom _apply_gate"):
        model(torch.randint(0, VOCAB, (1, 4)))


def test_register_validates_and_options_apply(monkeypatch):
    """register() with Options passes backend/config to kittenmoe.moe; bad options raise."""
    from kittenmoe.config import KernelConfig

    with pytest.raises(TypeError, match="Options"):
        kt.register({"backend": "torch"})
    with pytest.raises(ValueError, match="unknown MoE backend"):
        kt.Options(backend="cuda")
    seen = []
    real_moe = kt.moe
    monkeypatch.setattr(kt, "moe", lambda *a, **k: seen.append(k) or real_moe(*a, **k))
    cfg = KernelConfig(block_m=16, block_n=16, block_k=16, minibatch_size=16)
    try:
        kt.register(kt.Options(backend="torch", config=cfg), name="kittenmoe-test")
        torch.manual_seed(0)
        model = _deepseek_v3().float()
        model.set_experts_implementation("kittenmoe-test")
        model(torch.randint(0, VOCAB, (1, 4)))
        assert seen and seen[0]["backend"] == "torch" and seen[0]["config"] == cfg
    finally:
        transformers.integrations.moe.ExpertsInterface._global_mapping.pop("kittenmoe-test", None)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_bf16_megakernel_matches_eager(name):
    torch.manual_seed(0)
    model = MODELS[name]().to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)).cuda()
    logits_e, grads_e = _step(model, "eager", ids)
    logits_k, grads_k = _step(model, "kittenmoe", ids)
    assert_close(logits_k, logits_e, torch.bfloat16, "logits")
    for n in grads_e:
        assert_close(grads_k[n], grads_e[n], torch.bfloat16, f"d {n}")


@pytest.mark.gpu
def test_gpu_compiled_model_matches_uncompiled():
    """A bf16 Qwen3-MoE with kittenmoe experts (the megakernel) under torch.compile with Inductor on CUDA: logits
    and gradients within bf16 of the uncompiled model's, and the MoE block alone traces whole (fullgraph)."""
    torch.manual_seed(0)
    model = _qwen3_moe().to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)).cuda()
    logits_e, grads_e = _step(model, "kittenmoe", ids)
    model.compile()
    logits_c, grads_c = _step(model, "kittenmoe", ids)
    assert_close(logits_c, logits_e, torch.bfloat16, "logits")
    for n in grads_e:
        assert_close(grads_c[n], grads_e[n], torch.bfloat16, f"d {n}")
    block = model.model.layers[0].mlp
    x = torch.randn(2, 8, 32, device="cuda", dtype=torch.bfloat16)
    assert_close(torch.compile(block, fullgraph=True)(x), block(x), torch.bfloat16, "block out")


@pytest.mark.gpu
def test_gpu_training_trajectory_matches_grouped_mm():
    """20 AdamW steps memorising one fixed batch from the same weights: kittenmoe's losses track grouped_mm's
    and fall. (Fresh uniform tokens each step cannot be learned: the loss stays at ln(VOCAB) = 4.16.)"""
    losses = {}
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2)).cuda()
    for impl in ("grouped_mm", "kittenmoe"):
        torch.manual_seed(0)
        model = _deepseek_v3().to("cuda", torch.bfloat16)
        model.set_experts_implementation(impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[impl] = []
        for _ in range(20):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[impl].append(loss.item())
    a, b = torch.tensor(losses["kittenmoe"]), torch.tensor(losses["grouped_mm"])
    # On CPU (eager experts) this falls 4.15 -> 0.40 in 20 steps; an fp32 and a bf16 run differ by <= 0.06
    # (step 14: 1.19 vs 1.25), so two bf16 runs that differ only in rounding order stay within 5% + 0.05.
    assert a[-1] < a[0] - 2.0, losses  # it learns
    assert torch.allclose(a, b, rtol=5e-2, atol=5e-2), losses
