"""SonicMoE as a baseline: ``kittenmoe.baselines_sonic`` and ``kittenmoe bench --baseline sonicmoe --no-shared``.

On CPU, SonicMoE is replaced by ``FakeSonic``, a torch implementation of the contract its source documents for
``moe_general_routing_inputs`` (sonic-moe 0.1.2.post1: w1 [2I, H, E] with stride order (2, 0, 1) and gate/up rows
interleaved, w2 [H, I, E] likewise, routes sorted by token, int32 indices, fp32 scores; SwiGLU silu(gate) * up
with gate the even rows). Through it the adapter's layout conversion, routing and gradients are checked against
the fp32 reference, and the bench's rows, table and skip paths are exercised. The GPU test runs the real
SonicMoE (skipped when it is not importable: ``scripts/sonicmoe_wheels.sh`` brings it to an offline machine).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kittenmoe import baselines_sonic, cli
from kittenmoe.baselines_sonic import (deinterleave_gate_up, interleave_gate_up, sonicmoe_forward,
                                       sonicmoe_prepare)
from kittenmoe.bench.baselines import parse_baselines
from kittenmoe.bench.problems import Problem, make_problems, parse_routing
from kittenmoe.bench.report import BaselineResult, format_table, make_row
from kittenmoe.bench.timing import Timing
from kittenmoe.config import KernelConfig, ModelShape
from kittenmoe.reference import moe_reference
from kittenmoe.testing import make_weights, rel_l1, routing_uniform, tolerance_for

TINY = "20,32,16,8,2"  # T=20 tokens, H=32, I=16, E=8 experts, K=2


class FakeSonic:
    """``moe_general_routing_inputs`` as SonicMoE's source documents it, in fp32 torch (differentiable through
    autograd); it asserts the input contract and records each call's inference flag."""

    def __init__(self, fail: str | None = None) -> None:
        self.inference: list[bool] = []
        self.fail = fail

    def __call__(self, x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                 activation_type, is_inference_mode_enabled=False, concat_layout=False):
        if self.fail is not None:
            raise RuntimeError(self.fail)
        two_i, h, e = w1.shape
        assert (b1, b2, concat_layout, activation_type) == (None, None, False, "swiglu")
        assert e == E and w2.shape == (h, two_i // 2, e)
        # stride order (2, 0, 1): E outermost, then rows, then the contiguous dim
        assert w1.permute(2, 0, 1).is_contiguous() and w2.permute(2, 0, 1).is_contiguous()
        assert token_indices.dtype == expert_indices.dtype == torch.int32 and router_scores.dtype == torch.float32
        assert router_scores.shape == token_indices.shape == expert_indices.shape
        assert bool((token_indices[1:] >= token_indices[:-1]).all()), "token indices must be sorted ascending"
        self.inference.append(is_inference_mode_enabled)
        tok, exp = token_indices.long(), expert_indices.long()
        gu = torch.einsum("rh,rnh->rn", x.float()[tok], w1.permute(2, 0, 1).float()[exp])  # [TK, 2I]
        hid = F.silu(gu[:, 0::2]) * gu[:, 1::2]  # row 2j gate j, row 2j + 1 up j
        y = torch.einsum("ri,rhi->rh", hid, w2.permute(2, 0, 1).float()[exp])
        out = torch.zeros(x.shape[0], h, dtype=torch.float32).index_add(0, tok, y * router_scores[:, None])
        return out.to(x.dtype), torch.bincount(exp, minlength=E).int()


def _install_fake(monkeypatch, fake: FakeSonic) -> None:
    """sonicmoe "imports" as ``fake`` and runs on CPU tensors."""
    monkeypatch.setattr(baselines_sonic, "import_sonicmoe",
                        lambda: (fake, SimpleNamespace(SWIGLU="swiglu")))
    real = baselines_sonic.sonicmoe_unsupported
    monkeypatch.setattr(baselines_sonic, "sonicmoe_unsupported",
                        lambda device, dtype, lim: real("cuda", dtype, lim))


def _no_sonicmoe(monkeypatch) -> None:
    """``import sonicmoe`` fails here, whatever is installed."""
    for name in [m for m in sys.modules if m == "sonicmoe" or m.startswith("sonicmoe.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sonicmoe", None)


def _problem(t=24, h=32, i=16, e=8, k=2, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = ModelShape("t", e=e, h=h, i=i, k=k, shared_i=0)
    w = make_weights(shape, dtype=dtype, device=device, generator=g)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    ids, tw = routing_uniform(t, e, k, generator=g, device=device)
    d_out = torch.randn(t, h, generator=g).to(device, dtype)
    return x, ids, tw.float(), w.w13_E2IH, w.w2_EHI, d_out


# ----------------------------------------------------------------------------- layout


def test_interleave_puts_gate_on_even_rows_and_round_trips():
    e, i, h = 3, 4, 5
    w13 = torch.arange(e * 2 * i * h, dtype=torch.float32).view(e, 2 * i, h)
    inter = interleave_gate_up(w13)
    assert inter.is_contiguous() and inter.shape == w13.shape
    assert torch.equal(inter[:, 0::2], w13[:, :i]) and torch.equal(inter[:, 1::2], w13[:, i:])
    assert torch.equal(deinterleave_gate_up(inter), w13)
    w2 = torch.randn(e, i, h).transpose(1, 2)  # [E, H, I], not contiguous
    w13i, w2p = sonicmoe_prepare(w13.requires_grad_(), w2)
    assert torch.equal(w13i, inter) and torch.equal(w2p, w2) and w2p.is_contiguous() and not w13i.requires_grad


# ----------------------------------------------------------------------------- adapter, through the fake


def test_forward_and_gradients_match_the_reference(monkeypatch):
    # Our layout (gate rows, then up rows; w2 [E, H, I]) through sonicmoe_prepare and SonicMoE's documented
    # contract gives the routed reference's output and every gradient (w13's converted back).
    fake = FakeSonic()
    _install_fake(monkeypatch, fake)
    x, ids, tw, w13, w2, d_out = _problem()
    w13i, w2p = sonicmoe_prepare(w13, w2)
    with torch.no_grad():
        out = sonicmoe_forward(x, ids, tw, w13i, w2p)
    ref = moe_reference(x, ids, tw, w13, w2)
    tol = tolerance_for("bf16").rel_l1
    assert out.dtype == x.dtype and rel_l1(out, ref) <= tol
    assert fake.inference == [True]  # nothing needed a gradient: SonicMoE's inference mode

    leaves = [x.detach().requires_grad_(), tw.detach().requires_grad_(), w13i.detach().requires_grad_(),
              w2p.detach().requires_grad_()]
    out = sonicmoe_forward(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    d_x, d_tw, d_w13i, d_w2 = torch.autograd.grad(out, leaves, d_out)
    assert fake.inference[-1] is False
    ref_leaves = [t.float().requires_grad_() for t in (x, tw, w13, w2)]
    ref_out = moe_reference(ref_leaves[0], ids, ref_leaves[1], ref_leaves[2], ref_leaves[3])
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, d_out.float())
    for name, got, want in zip(("d_x", "d_topk_weights", "d_w13", "d_w2"),
                               (d_x, d_tw, deinterleave_gate_up(d_w13i), d_w2), ref_grads):
        assert got.shape == want.shape and rel_l1(got, want) <= tol, name


def test_forward_refuses_what_sonicmoe_cannot_run(monkeypatch):
    _install_fake(monkeypatch, FakeSonic())
    x, ids, tw, w13, w2, _ = _problem()
    w13i, w2p = sonicmoe_prepare(w13, w2)
    with pytest.raises(NotImplementedError, match="no SwiGLU clamp"):
        sonicmoe_forward(x, ids, tw, w13i, w2p, swiglu_limit=7.0)
    with pytest.raises(NotImplementedError, match="bf16"):
        sonicmoe_forward(x.float(), ids, tw, w13i.float(), w2p.float())
    with pytest.raises(ValueError, match="share one dtype"):
        sonicmoe_forward(x, ids, tw, w13i.float(), w2p)
    with pytest.raises(ValueError, match="sonicmoe_prepare"):
        sonicmoe_forward(x, ids, tw, w13, w2p.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="do not fit"):
        sonicmoe_forward(x, ids, tw[:, :1], w13i, w2p)


def test_forward_off_cuda_is_refused(monkeypatch):
    # SonicMoE's kernels are CUDA only (the stand-in importable, the real device check kept)
    monkeypatch.setattr(baselines_sonic, "import_sonicmoe", lambda: (FakeSonic(), SimpleNamespace(SWIGLU="swiglu")))
    x, ids, tw, w13, w2, _ = _problem()
    with pytest.raises(NotImplementedError, match="CUDA only"):
        sonicmoe_forward(x, ids, tw, *sonicmoe_prepare(w13, w2))


def test_unsupported_reasons():
    f = baselines_sonic.sonicmoe_unsupported
    assert f(torch.device("cuda", 0), torch.bfloat16, None) is None
    assert "CUDA only" in f("cpu", torch.bfloat16, None)
    assert "bf16" in f("cuda", torch.float32, None)
    assert "clamp" in f("cuda", torch.bfloat16, 10.0)


def test_missing_sonicmoe_is_an_import_error_with_the_hint(monkeypatch):
    _no_sonicmoe(monkeypatch)
    x, ids, tw, w13, w2, _ = _problem()
    with pytest.raises(ImportError, match="sonicmoe is not importable") as exc:
        sonicmoe_forward(x, ids, tw, *sonicmoe_prepare(w13, w2))
    assert "pip install sonic-moe==0.1.2.post1" in str(exc.value)
    assert "scripts/sonicmoe_wheels.sh" in str(exc.value)
    assert baselines_sonic.sonicmoe_unavailable() == str(exc.value)


# ----------------------------------------------------------------------------- bench: arguments


@pytest.mark.parametrize("spec,extras", [
    (None, ()),  # no --baseline: grouped_mm alone
    ("grouped_mm", ()),
    ("sonicmoe", ("sonicmoe",)),  # grouped_mm is timed anyway
    ("grouped_mm,sonicmoe", ("sonicmoe",)),
    (" sonicmoe , sonicmoe ", ("sonicmoe",)),  # spaces and repeats
])
def test_parse_baselines(spec, extras):
    assert parse_baselines(spec) == extras


@pytest.mark.parametrize("argv,message", [
    (["--baseline", "megablocks"], "bad --baseline 'megablocks': known baselines are grouped_mm, sonicmoe"),
    (["--baseline", ","], "bad --baseline ','"),
])
def test_bad_baseline_is_a_clear_error(argv, message, capsys, tmp_path):
    rc = cli.main(["bench", "--shape", TINY, "--out", str(tmp_path / "out")] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_baseline_under_torchrun_is_an_error(monkeypatch, capsys, tmp_path):
    # SonicMoE and grouped_mm are one-GPU baselines; under torchrun the baseline is --ep-baseline's
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    rc = cli.main(["bench", "--shape", TINY, "--baseline", "sonicmoe", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--baseline sonicmoe applies to one process" in err and "--ep-baseline" in err, err


def test_no_shared_problems():
    p, = make_problems(None, TINY, None, None, None, "bf16", "uniform", shared=False)
    assert p.shared_width == 0 and p.label == "H32-I16-E8-K2-S0" and "S=0" in p.describe()
    m, = make_problems("kimi-k2.7", None, None, None, None, "bf16", "uniform", shared=False)
    assert m.shared_width == 0 and m.label == "kimi-k2.7-S0"
    d, = make_problems(None, TINY, None, None, None, "bf16", "uniform")
    assert d.shared_width == 16 and d.label == "H32-I16-E8-K2"


# ----------------------------------------------------------------------------- bench: rows and table


def _row(extra: tuple[BaselineResult, ...], s: int = 0) -> dict:
    prob = Problem("H32-I16-E8-K2-S0", ModelShape("custom", e=8, h=32, i=16, k=2, shared_i=s), 20, 1, 1, 8,
                   "bf16", parse_routing("uniform"))
    return make_row(prob, "forward", path="public", timed_call="x", ranks_mode="virtual",
                    kittenmoe=Timing(0.9, 1.0, 1.1, 10), baseline="grouped_mm",
                    baseline_timing=Timing(1.8, 2.0, 2.2, 10), errs={"out[0]": 1e-3}, tolerance=1e-2, baseline_rel_l1=2e-3, first_call_s=1.0, reps=10,
                    warmup=1, ms_fp8_weight_quantisation=None, config=KernelConfig(), timing="t",
                    extra_baselines=extra)


def test_row_fields_and_table_of_an_extra_baseline():
    timed = BaselineResult("sonicmoe", Timing(1.4, 1.5, 1.6, 10), {"out[0]": 3e-3, "d_x[0]": 4e-3}, None, 70.0, True)
    r = _row((timed,))
    assert r["baselines"] == ["grouped_mm", "sonicmoe"] and r["speedup"] == pytest.approx(2.0)
    assert (r["ms_sonicmoe"], r["ms_sonicmoe_p20"], r["ms_sonicmoe_p80"]) == (1.5, 1.4, 1.6)
    assert r["speedup_vs_sonicmoe"] == pytest.approx(1.5) and r["rel_l1_sonicmoe"] == 4e-3
    assert r["rel_l1_sonicmoe_per_tensor"] == {"out[0]": 3e-3, "d_x[0]": 4e-3}
    assert r["sonicmoe_routed_tflops"] == pytest.approx(r["routed_tflops"] / 1.5)
    assert r["sonicmoe_first_call_s"] == 70.0 and r["sonicmoe_same_work"] and r["sonicmoe_note"] is None
    json.dumps(r)  # the row is JSON as written
    skipped = _row((BaselineResult("sonicmoe", note="skipped: sonicmoe is not importable (...)"),))
    for f in ("ms_sonicmoe", "speedup_vs_sonicmoe", "rel_l1_sonicmoe", "sonicmoe_routed_tflops"):
        assert skipped[f] is None, f
    table = format_table([r, skipped]).splitlines()
    assert "sonicmoe ms" in table[0]
    assert table[2].split()[-3:] == ["1.500", "1.50x", "4.0e-03"]
    assert table[3].split()[-3:] == ["skipped", "-", "-"]
    assert table[4] == "sonicmoe: skipped: sonicmoe is not importable (...)"
    assert "sonicmoe" not in format_table([_row(())])  # no extra baseline, no extra columns


def _bench(argv, tmp_path, capsys) -> tuple[list[dict], str]:
    out = tmp_path / "results"
    assert cli.main(["bench", "--shape", TINY, "--reps", "2", "--warmup", "0", "--out", str(out)] + argv) == 0
    text = capsys.readouterr().out
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text()), text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run")
def test_bench_skips_sonicmoe_when_not_importable(monkeypatch, tmp_path, capsys):
    # Not importable: a line says so, the rows say why, kittenmoe and grouped_mm are timed as always
    _no_sonicmoe(monkeypatch)
    rows, text = _bench(["--mode", "forward", "--dtype", "fp32", "--baseline", "grouped_mm,sonicmoe"],
                        tmp_path, capsys)
    assert "sonicmoe skipped: sonicmoe is not importable" in text and "pip install sonic-moe" in text
    r, = rows
    assert r["baselines"] == ["grouped_mm", "sonicmoe"] and r["ms_sonicmoe"] is None
    assert r["sonicmoe_note"].startswith("skipped: sonicmoe is not importable")
    assert any(s.startswith("skipped: sonicmoe: sonicmoe is not importable") for s in r["skipped_baselines"])
    assert r["ms_kittenmoe"] > 0 and r["ms_grouped_mm"] > 0 and r["rel_l1_ok"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run")
def test_bench_no_shared_with_sonicmoe_rows(monkeypatch, tmp_path, capsys):
    # --no-shared --baseline sonicmoe (through the fake): both modes timed in the same rounds, SonicMoE's output
    # and every gradient checked against the routed reference, the rows' fields and the table's columns
    fake = FakeSonic()
    _install_fake(monkeypatch, fake)
    rows, text = _bench(["--mode", "both", "--dtype", "bf16", "--no-shared", "--baseline", "sonicmoe"],
                        tmp_path, capsys)
    assert [r["kind"] for r in rows] == ["forward", "forward+backward"]
    assert fake.inference[0] is True and fake.inference[-1] is False
    assert "times are of different work" not in text  # the same work: no shared expert, no FP8
    for r in rows:
        assert r["s"] == 0 and r["shape"] == "H32-I16-E8-K2-S0" and r["baselines"] == ["grouped_mm", "sonicmoe"]
        assert r["ms_sonicmoe"] > 0 and r["speedup_vs_sonicmoe"] == pytest.approx(r["ms_sonicmoe"] / r["ms_kittenmoe"])
        assert r["rel_l1_sonicmoe"] <= 1e-2 and r["sonicmoe_same_work"] and r["sonicmoe_note"] is None
        assert r["rel_l1_ok"] and r["sonicmoe_first_call_s"] > 0
    assert set(rows[0]["rel_l1_sonicmoe_per_tensor"]) == {"out[0]"}
    assert set(rows[1]["rel_l1_sonicmoe_per_tensor"]) == {"out[0]", "d_x[0]", "d_topk_weights[0]", "d_w13", "d_w2"}
    # kittenmoe without the shared expert: no shared-expert gradients to check
    assert set(rows[1]["rel_l1_per_tensor"]) == {"out[0]", "d_x[0]", "d_topk_weights[0]", "d_w13", "d_w2"}
    assert "sonicmoe ms" in text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run")
def test_bench_reports_a_failing_sonicmoe_and_keeps_the_rest(monkeypatch, tmp_path, capsys):
    # Its first call raises: the traceback is logged, the rows say why, the other providers' figures stand;
    # with the shared expert on, a note says the times are of different work
    _install_fake(monkeypatch, FakeSonic(fail="no kernel for this shape"))
    rows, text = _bench(["--mode", "forward", "--dtype", "bf16", "--baseline", "sonicmoe"], tmp_path, capsys)
    assert "sonicmoe failed on its first call" in text and "Traceback" in text
    assert "kittenmoe here also computes the shared expert (S=16)" in text
    r, = rows
    assert r["sonicmoe_note"] == "failed: RuntimeError: no kernel for this shape" and r["ms_sonicmoe"] is None
    assert not r["sonicmoe_same_work"] and r["ms_kittenmoe"] > 0 and r["ms_grouped_mm"] > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run")
def test_bench_skips_sonicmoe_for_fp32(monkeypatch, tmp_path, capsys):
    _install_fake(monkeypatch, FakeSonic())
    rows, text = _bench(["--mode", "forward", "--dtype", "fp32", "--no-shared", "--baseline", "sonicmoe"],
                        tmp_path, capsys)
    assert "sonicmoe skipped for H32-I16-E8-K2-S0: SonicMoE runs bf16" in text
    assert rows[0]["sonicmoe_note"].startswith("skipped: SonicMoE runs bf16") and rows[0]["ms_sonicmoe"] is None


# ----------------------------------------------------------------------------- GPU: the real SonicMoE


@pytest.mark.gpu
def test_sonicmoe_matches_the_reference_on_gpu():
    # T=512, H=1024, I=512, E=8, K=2 in bf16: forward and every gradient against the fp32 routed reference
    pytest.importorskip("sonicmoe", reason="sonicmoe not importable (scripts/sonicmoe_wheels.sh)")
    x, ids, tw, w13, w2, d_out = _problem(t=512, h=1024, i=512, e=8, k=2, device="cuda")
    tol = tolerance_for("bf16").rel_l1
    w13i, w2p = sonicmoe_prepare(w13, w2)
    with torch.no_grad():
        out = sonicmoe_forward(x, ids, tw, w13i, w2p)
    ref_leaves = [t.float().requires_grad_() for t in (x, tw, w13, w2)]
    ref_out = moe_reference(ref_leaves[0], ids, ref_leaves[1], ref_leaves[2], ref_leaves[3])
    assert out.shape == (512, 1024) and out.dtype == torch.bfloat16
    assert rel_l1(out, ref_out) <= tol, rel_l1(out, ref_out)
    leaves = [x.detach().requires_grad_(), tw.detach().requires_grad_(), w13i.detach().requires_grad_(),
              w2p.detach().requires_grad_()]
    out = sonicmoe_forward(*leaves[:1], ids, *leaves[1:])
    assert rel_l1(out, ref_out) <= tol
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, d_out.float())
    for name, got, want in zip(("d_x", "d_topk_weights", "d_w13", "d_w2"),
                               (grads[0], grads[1], deinterleave_gate_up(grads[2]), grads[3]), ref_grads):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        assert rel_l1(got, want) <= tol, f"{name}: relative L1 {rel_l1(got, want):.3e}"
