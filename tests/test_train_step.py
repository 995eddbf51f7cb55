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

from kittenmoe.bench.train_models import FLOOR, MODELS, zipf_batches
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
    # the numbers the benchmark stands on, as the models' config.json files give them
    m = MODELS["moonlight-16b-a3b"]
    assert (m.hidden, m.moe_inter, m.experts, m.top_k, m.shared, m.layers, m.vocab) == (2048, 1408, 64, 6, 2, 27,
                                                                                           163840)
    q = MODELS["qwen3-30b-a3b"]
    assert (q.hidden, q.moe_inter, q.experts, q.top_k, q.shared, q.layers, q.vocab) == (2048, 768, 128, 8, 0, 48,
                                                                                           151936)


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
    assert list(by) == ["eager", "grouped_mm", "kittenmoe", FLOOR]
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
    assert list(by) == ["torchtitan", "kittenmoe", FLOOR]
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
    assert [ln.split(" | ")[4] for ln in lines] == ["grouped_mm", "kittenmoe", FLOOR + " (the floor)"]
    assert " 1.00x " in lines[0] and "`train-x.json`" in lines[1]
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
