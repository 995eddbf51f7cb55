"""benchmarks/train_step.py and kittenmoe.bench.train_models on CPU: the training-step benchmark at CPU sizes.

Every provider trains the same weights on the same batches, so the losses of kittenmoe and of the stack's
reference provider (grouped_mm with transformers, torchtitan's own experts) agree: exactly up to fp32 rounding
order with transformers, within bf16 with torchtitan (its GroupedExperts casts to bf16 whatever the parameters'
dtype). The rows carry what the README's table needs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kittenmoe.bench.train_models import FLOOR, MODELS, adamw, build_hf, hf_config, hf_loss, hf_providers, zipf_batches
from kittenmoe.testing import assert_close

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
# The router's gate runs under torch.autocast(float32), which CPU autocast declines with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _bench():
    spec = importlib.util.spec_from_file_location("train_step", ROOT / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(tmp_path, *argv) -> list[dict]:
    assert _bench().main(["--device", "cpu", "--out", str(tmp_path), *argv]) == 0
    (out,) = tmp_path.glob("train-*.json")
    return json.loads(out.read_text())


def _by_provider(rows):
    return {r["provider"]: r for r in rows}


def test_published_configs():
    # the built transformers configs carry the published numbers (transformers takes unknown keys silently)
    m = hf_config(MODELS["moonlight-16b-a3b"], 27)
    assert (m.hidden_size, m.intermediate_size, m.moe_intermediate_size, m.num_hidden_layers, m.vocab_size) == (
        2048, 11264, 1408, 27, 163840)
    assert (m.n_routed_experts, m.num_experts_per_tok, m.n_shared_experts, m.first_k_dense_replace) == (64, 6, 2, 1)
    assert (m.n_group, m.topk_group, m.routed_scaling_factor, m.norm_topk_prob) == (1, 1, 2.446, True)
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim) == (
        512, None, 64, 128, 128)
    assert (m.num_attention_heads, m.rope_parameters["rope_theta"], m.rms_norm_eps) == (16, 50000.0, 1e-5)
    q = hf_config(MODELS["qwen3-30b-a3b"], 48)
    assert (q.hidden_size, q.intermediate_size, q.moe_intermediate_size, q.num_hidden_layers, q.vocab_size) == (
        2048, 6144, 768, 48, 151936)
    assert (q.num_experts, q.num_experts_per_tok, q.norm_topk_prob, q.decoder_sparse_step, q.mlp_only_layers) == (
        128, 8, True, 1, [])
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (32, 4, 128)
    assert (q.rope_parameters["rope_theta"], q.rms_norm_eps, q.tie_word_embeddings) == (1e6, 1e-6, False)


def test_build_keeps_the_router_in_fp32():
    # as from_pretrained loads it: DeepSeek-V3's router weight and correction bias stay fp32 in a bf16 model
    model = build_hf(MODELS["tiny-deepseek-v3"], 2, torch.device("cpu"), torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_floor_keeps_router_and_expert_gradients():
    # the floor computes no routed expert, yet the router and the expert weights get gradients as in a real step
    model = build_hf(MODELS["tiny-qwen3-moe"], 1, torch.device("cpu"), torch.float32)
    hf_providers()  # (registers the floor)
    model.set_experts_implementation(FLOOR)
    ids = zipf_batches(1, 1, 8, 2048)[0]
    hf_loss(model, ids).backward()
    mlp = model.model.layers[0].mlp
    assert mlp.gate.weight.grad is not None and mlp.experts.gate_up_proj.grad is not None
    assert mlp.experts.down_proj.grad.abs().sum() == 0  # (zero: nothing routed reached it)


def test_zipf_batches_repeatable_and_in_range():
    a, b = zipf_batches(3, 2, 64, 100), zipf_batches(3, 2, 64, 100)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # every provider trains on the same ids
    assert all(x.shape == (2, 64) and 0 <= int(x.min()) and int(x.max()) < 100 for x in a)
    assert not torch.equal(a[0], a[1])  # fresh batches each step
    counts = torch.bincount(torch.cat(a).flatten(), minlength=100)
    assert counts[0] > counts[50:].sum() / 50 * 5  # skewed: the head dominates, so the loss has a target


@pytest.mark.parametrize("model", [
    "tiny-deepseek-v3",  # MLA, a dense first layer, a shared expert, sigmoid routing (DeepseekV3 in transformers)
    "tiny-qwen3-moe",  # GQA, every layer MoE, softmax top-k renormalised, no shared expert (Qwen3Moe)
])
def test_hf_stack(tmp_path, model):
    rows = _rows(tmp_path, "--model", model, "--layers", "1" if model == "tiny-qwen3-moe" else "2", "--seq", "16",
                 "--batch", "2", "--loss-steps", "4", "--warmup", "1",
                 "--providers", "eager,grouped_mm,kittenmoe," + FLOOR)
    by = _by_provider(rows)
    # the floor first and last (its mean is the floor), the others in between
    assert [r["provider"] for r in rows] == [FLOOR, "eager", "grouped_mm", "kittenmoe", FLOOR]
    for r in rows:
        assert r["status"] == "ok", r
        assert len(r["losses"]) == 4 and len(r["ms_all"]) == 3 and r["ms_median"] > 0
        assert r["tokens_per_step"] == 32 and r["kind"] == "train-step" and r["stack"] == "hf"
        assert {"torch", "triton", "gpu", "date", "command", "h", "i", "e", "k"} <= set(r)
    want = torch.tensor(by["grouped_mm"]["losses"])
    assert_close(torch.tensor(by["kittenmoe"]["losses"]), want, torch.float32, "kittenmoe losses")
    assert_close(torch.tensor(by["eager"]["losses"]), want, torch.float32, "eager losses")
    assert by["kittenmoe"]["losses"][-1] < by["kittenmoe"]["losses"][0]  # it learns
    # the floor trains another function (no routed experts): its losses differ, and the others' share is > 0 of it
    assert by[FLOOR]["losses"] != by["grouped_mm"]["losses"]
    assert "routed_share" in by["kittenmoe"] and "speedup_vs_grouped_mm" in by["kittenmoe"]
    assert "speedup_vs_best_other" in by["kittenmoe"] and by["kittenmoe"]["best_other"] in ("eager", "grouped_mm")


def test_hf_stack_unknown_provider_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        _bench().main(["--device", "cpu", "--out", str(tmp_path), "--model", "tiny-qwen3-moe",
                       "--providers", "grouped_mm,no-such-kernel"])
    assert not list(tmp_path.glob("*.json"))


def test_provider_that_cannot_run_gets_a_row(tmp_path, monkeypatch):
    # an implementation that raises at its first call (a missing package, a GPU-only kernel) is reported, not fatal
    from transformers.integrations.moe import ExpertsInterface

    def broken(self, hidden_states, top_k_index, top_k_weights):
        raise ImportError("the broken-kernel package is not installed")

    monkeypatch.setitem(ExpertsInterface._global_mapping, "broken-kernel", broken)
    rows = _rows(tmp_path, "--model", "tiny-deepseek-v3", "--seq", "8", "--loss-steps", "2", "--warmup", "1",
                 "--providers", "grouped_mm,broken-kernel,kittenmoe")
    by = _by_provider(rows)
    assert by["broken-kernel"]["status"] == "cannot run" and "not installed" in by["broken-kernel"]["detail"]
    assert by["grouped_mm"]["status"] == by["kittenmoe"]["status"] == "ok"


def test_kittenmoe_failing_stops_the_run(tmp_path, monkeypatch):
    import kittenmoe.integrations.transformers as kt

    def fails(*a, **kw):
        raise RuntimeError("kittenmoe broke")

    monkeypatch.setattr(kt, "moe", fails)
    with pytest.raises(RuntimeError, match="kittenmoe broke"):
        _bench().main(["--device", "cpu", "--out", str(tmp_path), "--model", "tiny-deepseek-v3", "--seq", "8",
                       "--loss-steps", "2", "--warmup", "1", "--providers", "kittenmoe"])


def test_torchtitan_stack(tmp_path):
    pytest.importorskip("torchtitan")
    rows = _rows(tmp_path, "--stack", "torchtitan", "--model", "tiny-qwen3-moe", "--layers", "1", "--seq", "8",
                 "--loss-steps", "3", "--warmup", "1")
    by = _by_provider(rows)
    assert [r["provider"] for r in rows] == [FLOOR, "torchtitan", "kittenmoe", FLOOR]
    assert all(r["status"] == "ok" and r["stack"] == "torchtitan" for r in rows), rows
    # torchtitan's experts compute in bf16 whatever the parameters' dtype; kittenmoe here in fp32
    assert_close(torch.tensor(by["kittenmoe"]["losses"]), torch.tensor(by["torchtitan"]["losses"]), torch.bfloat16,
                 "kittenmoe losses")
    assert "speedup_vs_torchtitan" in by["kittenmoe"] and "routed_share" in by["kittenmoe"]


def test_torchtitan_stack_needs_a_titan_config(tmp_path):
    pytest.importorskip("torchtitan")
    with pytest.raises(NotImplementedError, match="torchtitan has no configuration"):
        _bench().main(["--device", "cpu", "--out", str(tmp_path), "--stack", "torchtitan", "--model",
                       "tiny-deepseek-v3", "--seq", "8", "--loss-steps", "2", "--warmup", "1"])


def test_rows_render_in_the_performance_table(tmp_path, monkeypatch):
    # CPU rows relabelled as GPU rows: the README's training-step table takes its lines from them, and the
    # older whole-step table steps aside
    rows = _rows(tmp_path / "cpu", "--model", "tiny-deepseek-v3", "--seq", "8", "--loss-steps", "2", "--warmup",
                 "1", "--providers", "grouped_mm,kittenmoe," + FLOOR)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "train-x.json").write_text(json.dumps([dict(r, device="cuda", gpu="NVIDIA H200") for r in rows]))
    (results / "hf-x.json").write_text(json.dumps([dict(kind="hf-train-step", device="cuda")]))
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "scripts" / "perf_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    monkeypatch.setattr(table, "ROOT", str(tmp_path))
    text = table.render_train()
    lines = [ln for ln in text.splitlines() if ln.startswith("| tiny-deepseek-v3 |")]
    floor = FLOOR + " (the floor)"
    assert [ln.split(" | ")[4] for ln in lines] == [floor, "grouped_mm", "kittenmoe", floor]
    assert " 1.00x " in lines[1] and "`train-x.json`" in lines[2]
    header = next(ln for ln in text.splitlines() if ln.startswith("| model |"))
    assert all(ln.count("|") == header.count("|") for ln in lines)
    assert table.render_hf() == ""


def test_sonicmoe_from_pip_fills_transformers_kernel_slot(monkeypatch):
    # offline, transformers' sonicmoe gets the pip wheel's entry points; without the wheel it says why
    hf_sonic = pytest.importorskip("transformers.integrations.sonicmoe")
    import kittenmoe.baselines_sonic as bs
    from kittenmoe.bench import train_models

    monkeypatch.setattr(hf_sonic, "_SONICMOE", None)

    def missing():
        raise ImportError("sonicmoe is not importable (ModuleNotFoundError)")

    monkeypatch.setattr(bs, "import_sonicmoe", missing)
    assert "not importable" in train_models.sonicmoe_from_pip()
    assert hf_sonic._SONICMOE is None

    def entry(*a, **kw):
        return "ran"

    monkeypatch.setattr(bs, "import_sonicmoe", lambda: (entry, "ActivationTypeEnum"))
    assert train_models.sonicmoe_from_pip() is None
    assert hf_sonic.load_sonicmoe_kernel().moe_general_routing_inputs is entry
    assert hf_sonic._SONICMOE.activation_type_enum == "ActivationTypeEnum"


def test_example_trains_each_implementation(capsys):
    # examples/train_hf_moe.py: a line per implementation with tokens/s, and the same loss curve for each
    spec = importlib.util.spec_from_file_location("train_hf_moe", ROOT / "examples" / "train_hf_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", "tiny-deepseek-v3", "--device", "cpu", "--layers", "2", "--seq", "16",
                     "--steps", "3", "--warmup", "1", "--impls", "grouped_mm,kittenmoe"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [ln.split()[0] for ln in lines] == ["grouped_mm", "kittenmoe"]
    assert all(float(ln.split()[1]) > 0 and "tokens/s" in ln for ln in lines)
    assert lines[0].split("loss")[1] == lines[1].split("loss")[1]  # (printed to 4 decimals)


def test_titan_example_trains_both_experts(capsys):
    # examples/train_titan_moe.py: torchtitan's experts, then kittenmoe's through apply_kittenmoe and
    # fuse_gate_up_storage, from the same weights on the same batches; torchtitan's experts compute in bf16 whatever
    # the parameters' dtype, kittenmoe in fp32 on the CPU, so the losses agree to bf16's noise, not bit for bit
    pytest.importorskip("torchtitan")
    spec = importlib.util.spec_from_file_location("train_titan_moe", ROOT / "examples" / "train_titan_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", "tiny-qwen3-moe", "--device", "cpu", "--layers", "1", "--seq", "32", "--steps", "3",
                     "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [ln.split()[0] for ln in lines] == ["torchtitan", "kittenmoe"]
    assert all(float(ln.split()[1]) > 0 and "tokens/s" in ln for ln in lines)
    first = [[float(v) for v in ln.split("loss")[1].split("->")] for ln in lines]
    assert abs(first[0][0] - first[1][0]) < 1e-2 and abs(first[0][1] - first[1][1]) < 1e-2, lines


def test_each_provider_runs_its_own_implementation(tmp_path, monkeypatch):
    # transformers' default experts implementation is grouped_mm: the eager row must not run it
    from transformers.integrations.moe import ExpertsInterface

    calls = []
    real = ExpertsInterface._global_mapping["grouped_mm"]
    monkeypatch.setitem(ExpertsInterface._global_mapping, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    argv = ["--model", "tiny-deepseek-v3", "--seq", "8", "--loss-steps", "2", "--warmup", "1", "--providers"]
    _rows(tmp_path / "eager", *argv, "eager")
    assert not calls
    _rows(tmp_path / "grouped", *argv, "grouped_mm")
    assert calls


def test_a_failed_row_renders_with_the_table_width(tmp_path, monkeypatch):
    rows = [dict(kind="train-step", device="cuda", gpu="NVIDIA H200", stack="hf", model="m", seq=8, layers=1,
                 batch=1, provider=p, compiled=False, status=st, date="2026-01-01T00:00:00", ms_median=1.0,
                 tokens_per_s=8.0) for p, st in (("grouped_mm", "ok"), ("batched_mm", "out of memory"))]
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "train-y.json").write_text(json.dumps(rows))
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "scripts" / "perf_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    monkeypatch.setattr(table, "ROOT", str(tmp_path))
    lines = [ln for ln in table.render_train().splitlines() if ln.startswith("| m |") or ln.startswith("| model |")]
    assert len({ln.count("|") for ln in lines}) == 1 and "out of memory" in lines[2]


def test_adamw_one_group_of_dense_parameters():
    # fuse_gate_up_storage makes torchtitan's gate and up one dense parameter: one group, every parameter dense
    # (a non-dense one would take the group off the foreach kernels' fast path)
    pytest.importorskip("torchtitan")
    from kittenmoe.integrations.torchtitan import fuse_gate_up_storage
    from kittenmoe.bench.train_models import build_titan

    model = build_titan(MODELS["tiny-qwen3-moe"], 1, torch.device("cpu"), torch.float32)
    assert fuse_gate_up_storage(model) == 1
    opt = adamw(model, 1e-3)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 1e-3
    assert opt.param_groups[0]["fused"] is True  # torchtitan's default implementation, as the rows record it
    params = opt.param_groups[0]["params"]
    assert params == list(model.parameters()) and all(p.is_contiguous() for p in params)
