"""``kittenmoe bench`` / ``kittenmoe tune`` on CPU: argument validation, tiny end-to-end runs under the
Triton interpreter, the tuned-config cache (round trip, stale, corrupt, KITTENMOE_AUTOTUNE=0), grid
pruning and the heuristic default config; bench under torchrun: its argument and environment checks on CPU,
two real processes sharing one GPU in a GPU test.

The end-to-end runs use fp32 (the interpreter computes it exactly enough for the 1e-5 bar) on the
smallest shape the kernels accept; every file they write goes to tmp_path, and KITTENMOE_CACHE_DIR
points into tmp_path for every test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kittenmoe
from kittenmoe import cli
from kittenmoe.bench.problems import (apply_overrides, parse_config_overrides, parse_problem, parse_routing,
                                      parse_shape)
from kittenmoe.config import (SHARED_MEMORY_LIMIT, KernelConfig, bwd_phase_a_smem_bytes, default_config,
                              gate_up_smem_bytes)
from kittenmoe.tune import DEFAULT_GRID, expand_grid, parse_grid
from kittenmoe.tune_cache import (TuneCacheWarning, cache_dir, cache_key, cache_path, config_for, lookup_config,
                                  store_config)

ROOT = Path(__file__).resolve().parents[1]
TINY = "20,32,16,8,2"  # T=20 tokens, H=32, I=16, E=8 experts, K=2
FP8_TINY = "32,256,128,4,2"  # the smallest FP8 shape: H=256 and I=128 multiples of the 128 scale block
# What scripts/perf_table.py reads from every row.
PERF_TABLE_FIELDS = ("kind", "shape", "tokens", "experts_local", "ms_kittenmoe", "ms_grouped_mm", "speedup",
                     "routed_tflops", "baseline_routed_tflops", "rel_l1", "gpu", "torch", "triton", "date",
                     "config", "command")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty cache and the autotune switch at its default."""
    monkeypatch.setenv("KITTENMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KITTENMOE_AUTOTUNE", raising=False)


# ----------------------------------------------------------------------------- CLI validation

BAD_ARGS = [
    # unknown model name: the error lists the known ones
    (["bench", "--model", "nope"], "unknown model 'nope'"),
    # one unknown name inside a comma-separated list
    (["bench", "--model", "tiny,nope", "--ep", "1"], "unknown model 'nope'"),
    # --shape with four numbers instead of five
    (["bench", "--shape", "20,32,16,8"], "expected five comma-separated integers"),
    # --shape with a non-integer
    (["bench", "--shape", "20,32,x,8,2"], "must all be integers"),
    # --shape with a zero
    (["bench", "--shape", "20,32,16,8,0"], "K=0 must be a positive integer"),
    # --shape with top-k above the expert count
    (["bench", "--shape", "20,32,16,2,4"], "K=4 exceeds the number of experts E=2"),
    # E=8 of an explicit shape not divisible by --ep 3
    (["bench", "--shape", TINY, "--ep", "3"], "not divisible by --ep 3"),
    # E=384 of a seed model not divisible by --ep 5
    (["bench", "--model", "kimi-k2.7", "--ep", "5"], "E=384 experts are not divisible by --ep 5"),
    # the EP slice leaves fewer experts than top-k (tiny: E=8, K=2; ep 8 -> 1 expert)
    (["bench", "--model", "tiny", "--ep", "8"], "top-k K=2 exceeds the 1 experts"),
    # routing name that does not exist
    (["bench", "--shape", TINY, "--routing", "gaussian"], "bad --routing 'gaussian'"),
    # Zipf exponent that is not a number
    (["bench", "--shape", TINY, "--routing", "zipf:abc"], "exponent after 'zipf:' must be a number"),
    # Zipf exponent <= 0
    (["bench", "--shape", TINY, "--routing", "zipf:-1"], "exponent must be a finite number > 0"),
    # --config key that is no KernelConfig field
    (["bench", "--shape", TINY, "--config", "blockm=16"], "bad --config key 'blockm'"),
    # --config value that is not an int / None / bool
    (["bench", "--shape", TINY, "--config", "block_m=big"], "bad --config value block_m='big'"),
    # --config item without '='
    (["bench", "--shape", TINY, "--config", "block_m"], "expected key=value"),
    # --config value KernelConfig itself rejects (block_m must be a power of two)
    (["bench", "--shape", TINY, "--config", "block_m=24"], "block_m must be a power of two"),
    # neither --model nor --shape
    (["bench"], "exactly one of --model NAME or --shape"),
    # both --model and --shape
    (["bench", "--model", "tiny", "--shape", TINY], "exactly one of --model NAME or --shape"),
    # --tokens beside --shape (T is in the shape)
    (["bench", "--shape", TINY, "--tokens", "64"], "--tokens goes with --model"),
    # --ranks 0
    (["bench", "--shape", TINY, "--ranks", "0"], "--ranks must be a positive integer"),
    # --reps 0
    (["bench", "--shape", TINY, "--reps", "0"], "--reps must be >= 1"),
    # the public path is one rank per call: 2 virtual ranks in one process run only the launchers
    (["bench", "--shape", TINY, "--ranks", "2", "--path", "public"],
     "--path public times kittenmoe.moe, one rank per call; --ranks 2 virtual ranks in one process run only the "
     "launchers: pass --path launcher"),
    # --plot to something that is not a PNG
    (["bench", "--shape", TINY, "--plot", "out.pdf"], "--plot must name a .png file"),
    # tune validates the shape the same way (unknown model)
    (["tune", "--model", "nope"], "unknown model 'nope'"),
    # tune takes one problem only
    (["tune", "--model", "tiny,small", "--ep", "1"], "tune takes one problem"),
    # tune: --grid key that is neither tiles nor a KernelConfig field
    (["tune", "--shape", TINY, "--grid", "warps=4:8"], "bad --grid key 'warps'"),
    # tune: --grid tiles not written as BLOCK_NxSTAGES
    (["tune", "--shape", TINY, "--grid", "tiles=128"], "expected BLOCK_NxSTAGES"),
    # tune: --grid value that is not an int
    (["tune", "--shape", TINY, "--grid", "minibatch_size=lots"], "bad --grid value minibatch_size='lots'"),
    # tune: bad --config key, as in bench
    (["tune", "--shape", TINY, "--config", "nope=1"], "bad --config key 'nope'"),
    # --fp8 with fp32 inputs: the FP8 megakernels take bf16, so it is refused rather than run in bf16 silently
    (["bench", "--shape", FP8_TINY, "--fp8", "128", "--dtype", "fp32"], "--fp8 128 needs --dtype bf16"),
    # --fp8 128 with H=192, not a multiple of the scale block: named with the shape, before anything runs
    (["bench", "--shape", "32,192,128,4,2", "--fp8", "128"],
     "H192-I128-E4-K2: --fp8 128 needs H and I multiples of the scale block 128, got H=192 I=128"),
    # --fp8 32 with I=48, not a multiple of MXFP8's 32-block (H=256 is)
    (["bench", "--shape", "32,256,48,4,2", "--fp8", "32"], "needs H and I multiples of the scale block 32"),
    # a --config block_n that splits a 128 scale block: the user's override is refused, not replaced
    (["bench", "--shape", FP8_TINY, "--fp8", "128", "--config", "block_n=64"],
     "bad --config block_n=64 with --fp8 128: block_n must be a multiple of the scale block 128"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_cli_rejects_bad_arguments(argv, message, capsys, tmp_path):
    # Validation runs before anything is built or timed: exit status 2 and one clear line on stderr.
    rc = cli.main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"kittenmoe {argv[0]}: error:" in err
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ["bench", "--shape", TINY, "--mode", "sideways"],  # --mode outside its choices
    ["bench", "--shape", TINY, "--dtype", "fp8"],  # --dtype outside bf16|fp32
    ["tune", "--shape", TINY, "--mode", "both"],  # tune times one mode, not both
    ["bench", "--shape", TINY, "--ranks", "two"],  # an int option given a word
    ["bench", "--shape", FP8_TINY, "--fp8", "64"],  # --fp8 outside its scale blocks 128|32
    ["bench", "--shape", TINY, "--path", "autograd"],  # --path outside public|launcher
    ["tune", "--shape", TINY, "--path", "public"],  # tune sweeps the launchers: no --path there
    ["tune", "--shape", FP8_TINY, "--fp8", "128"],  # tune stays BF16: no --fp8 there
])
def test_cli_argparse_errors(argv, capsys):
    # argparse's own checks: usage plus an error on stderr, exit status 2.
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("spec,name,alpha", [
    ("uniform", "uniform", None),  # balanced top-k of randn logits
    ("zipf", "zipf", 1.2),  # Zipf with the default exponent
    ("zipf:0.8", "zipf", 0.8),  # Zipf with a chosen exponent
    ("one-hot", "one-hot", None),  # every token's first choice is expert 0
    ("one_hot", "one-hot", None),  # the testing module's spelling is accepted too
])
def test_parse_routing(spec, name, alpha):
    r = parse_routing(spec)
    assert (r.name, r.alpha) == (name, alpha)


def test_parse_shape_and_config():
    assert parse_shape(" 20, 32,16,8,2") == (20, 32, 16, 8, 2)
    assert parse_config_overrides("macrobatch_size=None,combine_gather=True,num_stages=3") == dict(
        macrobatch_size=None, combine_gather=True, num_stages=3)
    assert parse_config_overrides("") == {}


def test_parse_problem():
    """The benchmark scripts' TxHxIxExK problems: one rank, no shared expert; parse_shape's checks, named in the
    form given."""
    t, shape = parse_problem("8192x2048x768x128x8")
    assert t == 8192 and (shape.h, shape.i, shape.e, shape.k, shape.shared_width) == (2048, 768, 128, 8, 0)
    for bad in ("8192x2048x768x128", "8x16x8x2x4", "8x16x8x0x1"):  # four numbers; K > E; a zero
        with pytest.raises(ValueError, match=f"bad problem '{bad}'"):
            parse_problem(bad)


@pytest.mark.parametrize("given,ranks,processes,want", [
    (None, 1, False, "public"),  # one rank: the public entry point by default
    ("launcher", 1, False, "launcher"),  # ... or the launchers when asked
    (None, 2, False, "launcher"),  # virtual ranks in one process: only the launchers run them
    ("launcher", 4, False, "launcher"),
    (None, 2, True, "public"),  # torchrun ranks: kittenmoe.ep.moe_ep by default
    ("public", 8, True, "public"),
    ("launcher", 2, True, "launcher"),  # ... or the EP launchers
])
def test_resolve_path(given, ranks, processes, want):
    from kittenmoe.bench.main import resolve_path

    assert resolve_path(given, ranks, processes) == want


def test_bench_help_documents_the_ranks_rule(capsys):
    # --help says what each path times and that virtual ranks take the launchers
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--path {public,launcher}" in text and "kittenmoe.moe(backend='megakernel')" in text
    assert "kittenmoe.ep.moe_ep" in text and "--ranks R > 1 virtual ranks in one process" in text


def test_tune_cache_and_bench_import_no_tuner_or_kernels():
    """The layer's hot-path lookup (kittenmoe.tune_cache) loads neither the benchmark, the tuner, the kernels nor
    Triton; the benchmark package does not import the tuner (tune builds on bench, not the other way round)."""
    code = (
        "import sys\n"
        "import kittenmoe.tune_cache\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] == 'triton' or m in ('kittenmoe.tune', 'kittenmoe.launch_common',"
        " 'kittenmoe.autograd') or m.startswith(('kittenmoe.bench', 'kittenmoe.kernels'))]\n"
        "assert not heavy, heavy\n"
        "import kittenmoe.bench, kittenmoe.bench.main, kittenmoe.bench.runner, kittenmoe.bench.ep_runner\n"
        "assert 'kittenmoe.tune' not in sys.modules\n"
        "import kittenmoe.tune\n"
        "assert 'kittenmoe.launch_common' not in sys.modules, 'importing the tuner loaded the launchers'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                      if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch, capsys, tmp_path):
    # On CPU the megakernel needs TRITON_INTERPRET=1; without it bench says so instead of crashing.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc = cli.main(["bench", "--shape", TINY, "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end (interpreter)


def _perf_table():
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "scripts" / "perf_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ncu_summary_reads_a_raw_csv(tmp_path, capsys, monkeypatch):
    """benchmarks/probes/ncu_summary.py on ncu's raw page (ncu's own lines before the header, a units row, base and
    scaled units, an n/a cell): one line a kernel, ns -> ms and bytes -> GB, the tensor pipe's busy share
    (not the instruction-count metric beside it), '-' for what a kernel lacks."""
    csv_path = tmp_path / "raw.csv"
    csv_path.write_text(
        '==PROF== Disconnected from process 1\n'
        '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","lts__t_sector_hit_rate.pct",'
        '"sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",'
        '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"\n'
        '"","","nsecond","Mbyte","%","%","%"\n'
        '"0","dispatch_mlp_swiglu_combine_kernel","3,849,000","11,550","39.1","3.77","70.33"\n'
        '"1","void cutlass::device_kernel<T>(P)","2131000","n/a","39.1","2.9","88.3"\n')
    spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "benchmarks" / "probes" / "ncu_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["ncu_summary.py", str(csv_path)])
    assert mod.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["kernel", "ms", "DRAM", "rd", "GB", "L2", "hit", "%", "tensor", "%"]
    assert out[1].split() == ["dispatch_mlp_swiglu_combine_kernel", "3.849", "11.55", "39.1", "70.3"]
    assert out[2].split() == ["cutlass::device_kernel<T>", "2.131", "-", "39.1", "88.3"]


def _bench_rows(argv, out, capsys):
    """Run ``kittenmoe`` with ``argv`` (which writes to ``out``); it must exit 0 and write one JSON file of a
    forward and a forward+backward row, each with the fields scripts/perf_table.py reads.
    (rows, stdout, the JSON file)."""
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1
    rows = json.loads(files[0].read_text())
    assert [r["kind"] for r in rows] == ["forward", "forward+backward"]
    for r in rows:
        for f in PERF_TABLE_FIELDS:
            assert f in r, f
    return rows, text, files[0]


# The interpreter computes on the uninitialised padding rows of the routed buffers; numpy warns there.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run; on a GPU bench times the real thing")
@pytest.mark.parametrize("path_args,path,timed", [
    # the default: the public autograd entry point users call, kittenmoe.moe(backend="megakernel")
    ([], "public", "kittenmoe.moe(backend='megakernel')"),
    # the launchers without the autograd layer
    (["--path", "launcher"], "launcher", "launch_forward.megakernel_forward_multirank"),
])
def test_bench_end_to_end(tmp_path, capsys, path_args, path, timed):
    # A tiny forward and forward+backward run, checked against the fp32 reference (output and every gradient),
    # written as JSON rows that scripts/perf_table.py can render, stamped as CPU-interpreter figures and with the
    # path kittenmoe was timed along.
    out = tmp_path / "results"
    png = tmp_path / "plot.png"
    argv = ["bench", "--shape", TINY, "--mode", "both", "--dtype", "fp32", "--reps", "2", "--warmup", "0",
            "--out", str(out), "--plot", str(png)] + path_args
    rows, text, path_file = _bench_rows(argv, out, capsys)
    assert rows[0]["timed_call"] == timed and rows[1]["timed_call"].startswith(timed + " + ")
    assert f"timed along the {path} path" in text
    for r in rows:
        assert r["path"] == path
        assert r["device"] == "cpu-interpreter" and r["gpu"] == "cpu"
        assert (r["tokens"], r["h"], r["i"], r["e"], r["k"], r["ranks"], r["experts_local"]) == (20, 32, 16, 8, 2, 1, 8)
        assert r["shape"] == "H32-I16-E8-K2" and r["dtype"] == "fp32" and r["routing"] == "uniform"
        assert r["precision"] == "fp32" and r["ms_fp8_weight_quantisation"] is None  # no --fp8
        for f in ("ms_kittenmoe", "ms_grouped_mm", "speedup", "routed_tflops", "baseline_routed_tflops"):
            assert math.isfinite(r[f]) and r[f] > 0, f
        assert r["ms_kittenmoe_p20"] <= r["ms_kittenmoe"] <= r["ms_kittenmoe_p80"]
        assert r["rel_l1"] <= 1e-5 and r["rel_l1_ok"] and r["baseline_rel_l1"] <= 1e-5
        assert KernelConfig(**r["config"]) == default_config(20, 32, 16, 8, 2, 1, "cpu", torch.float32)
        assert r["config_source"].startswith("heuristic")
        assert r["command"] == "kittenmoe " + " ".join(argv[0:])
        assert r["skipped_baselines"] == ["skipped: deep_ep not importable"] or \
            importlib.util.find_spec("deep_ep") is not None
    # the output, and in forward+backward every gradient (x, router weights, each expert weight), vs fp32
    assert set(rows[0]["rel_l1_per_tensor"]) == {"out[0]"}
    assert set(rows[1]["rel_l1_per_tensor"]) == {"out[0]", "d_x[0]", "d_topk_weights[0]", "d_w13", "d_w2",
                                                 "d_shared_w13", "d_shared_w2"}
    # terminal: the note, the skipped baseline, the table, the JSON path and the plot (or why not)
    assert "not GPU figures" in text and "skipped: deep_ep not importable" in text
    assert "forward+backward" in text and "kmoe ms p50 [p20-p80]" in text and str(path_file) in text
    if importlib.util.find_spec("matplotlib") is None:
        assert "plot skipped: matplotlib is not installed" in text and not png.exists()
    else:
        assert png.exists() and png.stat().st_size > 0
    pt = _perf_table()
    table = pt.render([dict(r, _file=path_file.name) for r in rows])
    assert "H32-I16-E8-K2" in table and "forward+backward" in table


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run")
def test_tune_end_to_end(tmp_path, capsys):
    # A 3-point grid (one pruned: minibatch 512 above the 160-row capacity, while 256 already holds
    # every row); the heuristic default is one of the points. The winner lands in the cache, the
    # sweep in a JSON record, and best / default / worst are printed.
    out = tmp_path / "results"
    argv = ["tune", "--shape", TINY, "--dtype", "fp32", "--reps", "1", "--warmup", "0", "--out", str(out),
            "--grid", "num_comm_programs_fwd=1,minibatch_size=64:256:512,tiles=32x1"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    for word in ("[1/2]", "[2/2]", "ETA", "best ", "default ", "worst ", "grouped_mm", "cached:"):
        assert word in text, word
    rec_files = list(out.glob("tune-*.json"))
    assert len(rec_files) == 1
    rec = json.loads(rec_files[0].read_text())
    assert rec["kind"] == "tune" and rec["device"] == "cpu-interpreter" and rec["mode"] == "forward"
    assert len(rec["trials"]) == 2 and all(t["ms"] > 0 and t["error"] is None for t in rec["trials"])
    assert len(rec["pruned"]) == 1 and "routed capacity" in rec["pruned"][0]["reason"]
    assert rec["pruned"][0]["point"]["minibatch_size"] == 512
    assert rec["best"]["ms"] == min(t["ms"] for t in rec["trials"])
    assert rec["worst"]["ms"] == max(t["ms"] for t in rec["trials"])
    # both trials are finalists (TUNE_FINALISTS = 3): re-timed interleaved, their sweep figures kept
    assert all(t["ms_sweep"] > 0 for t in rec["trials"]) and text.count("interleaved (sweep") == 2
    assert "rel_l1" not in rec  # scripts/perf_table.py skips the record (no top-level rel_l1)
    # the cache: the file named by the key, the same config back from lookup_config
    best = KernelConfig(**rec["best"]["config"])
    key = cache_key(20, 32, 16, 8, 2, 1, "cpu", "fp32")
    assert rec["key"] == key
    entry = json.loads(cache_path(key).read_text())
    assert entry["kittenmoe_version"] == kittenmoe.__version__ and entry["ms"] == rec["best"]["ms"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup_config(20, 32, 16, 8, 2, 1, "cpu", torch.float32) == best
    # what bench (and the layer) now pick for this problem
    cfg, source = config_for(20, 32, 16, 8, 2, 1, "cpu", "fp32")
    assert cfg == best and source == "tuned cache"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter run; on a GPU bench times the real thing")
@pytest.mark.parametrize("block,extra", [
    # DeepSeek-V3's 1x128 / 128x128 scales, one rank: forward and forward+backward (every gradient on FP8's bar)
    (128, []),
    # MXFP8's 32-blocks (power-of-two scales) on 2 virtual ranks: each rank's slice of the quantised experts
    (32, ["--ranks", "2"]),
])
def test_bench_fp8_end_to_end(tmp_path, capsys, block, extra):
    # FP8 kittenmoe against the BF16 grouped_mm baseline: rows labelled with the precision (and the baseline's),
    # the weight quantisation timed apart, block_n raised to 128 over the CPU heuristic's, checked against the
    # fp32 reference at FP8's bar.
    from kittenmoe.testing import tolerance_for

    out = tmp_path / "results"
    argv = ["bench", "--shape", FP8_TINY, "--fp8", str(block), "--mode", "both", "--reps", "1", "--warmup", "0",
            "--out", str(out)] + extra
    rows, text, _ = _bench_rows(argv, out, capsys)
    for r in rows:
        # one rank: the public path (kittenmoe.moe with the quantised experts); 2 virtual ranks: the launchers
        assert r["path"] == ("launcher" if extra else "public")
        assert r["precision"] == f"fp8-e4m3/{block}" and r["baseline_precision"] == "bf16" and r["dtype"] == "bf16"
        assert r["baseline"] == "grouped_mm" and r["ranks"] == (2 if extra else 1)
        for f in ("ms_kittenmoe", "ms_baseline", "speedup", "ms_fp8_weight_quantisation"):
            assert math.isfinite(r[f]) and r[f] > 0, f
        assert r["ms_fp8_weight_quantisation"] == rows[0]["ms_fp8_weight_quantisation"]  # once per problem
        assert r["rel_l1_tolerance"] == tolerance_for("fp8").rel_l1
        assert r["rel_l1_ok"] and 0 < r["rel_l1"] <= r["rel_l1_tolerance"]
        assert r["config"]["block_n"] == 128 and f"block_n 128 for --fp8 {block}" in r["config_source"]
    assert "d_w13" in rows[1]["rel_l1_per_tensor"] and "d_x[0]" in rows[1]["rel_l1_per_tensor"]
    assert f"fp8-e4m3/{block}" in text and "routed experts in" in text
    assert ("2 virtual ranks in one process run only the launchers" in text) == bool(extra)


@pytest.mark.parametrize("overrides,block,block_n", [
    ({}, 128, 128),  # no override: the CPU heuristic's block_n (32) becomes 128
    ({}, 32, 128),  # MXFP8: still 128 wide (four 32-blocks a tile), as MoELayer picks
    ({"block_n": 256}, 128, 256),  # a user's block_n that holds whole scale blocks is kept
    ({"block_n": 64}, 32, 64),  # ... also for 32-blocks
    ({"block_n": 64}, None, 64),  # BF16: no FP8 rule
])
def test_fp8_block_n_in_config(overrides, block, block_n):
    from kittenmoe.bench.problems import config_for_problem, make_problems

    prob, = make_problems(None, FP8_TINY, None, None, None, "bf16", "uniform", block)
    cfg, source = config_for_problem(prob, torch.device("cpu"), overrides)
    assert cfg.block_n == block_n
    assert ("for --fp8" in source) == (block is not None and not overrides)


def test_perf_table_keeps_fp8_rows_out_of_bf16_tables(monkeypatch):
    # Edge: a --fp8 bench row has the same (kind, shape, tokens, dtype) as a BF16 one; the one-GPU BF16 table
    # leaves it out (its speedup is FP8 over BF16), the EP table shows it labelled beside the BF16 row.
    pt = _perf_table()
    base = dict(kind="forward", shape="kimi-k2.7", tokens=2048, dtype="bf16", routing="uniform", experts_local=48,
                ms_kittenmoe=1.0, ms_grouped_mm=2.0, ms_baseline=2.0, speedup=2.0, routed_tflops=500.0,
                baseline_routed_tflops=250.0, rel_l1=1e-3, gpu="H200", torch="2", triton="3", device="cuda",
                date="2026-12-01T00:00:00+00:00")
    one = dict(base, ranks=1)
    ep = dict(base, ranks=2, ranks_mode="processes")
    fp8 = dict(precision="fp8-e4m3/128", baseline_precision="bf16", rel_l1=4e-2, speedup=3.0,
               date="2026-12-02T00:00:00+00:00")
    monkeypatch.setattr(pt, "_result_rows", lambda: iter([("a.json", dict(one)), ("b.json", dict(one, **fp8))]))
    assert [r["_file"] for r in pt.load_rows()] == ["a.json"]
    monkeypatch.setattr(pt, "_result_rows", lambda: iter([("a.json", dict(ep)), ("b.json", dict(ep, **fp8))]))
    table = pt.render_ep()
    assert "| forward | kimi-k2.7 (48) |" in table and "| forward (fp8-e4m3/128) | kimi-k2.7 (48) |" in table
    assert "FP8 rows" in table and "3.00x" in table and "2.00x" in table
    monkeypatch.setattr(pt, "_result_rows", lambda: iter([("a.json", dict(ep))]))
    assert "FP8" not in pt.render_ep()


def test_perf_table_gives_the_spread_of_same_config_runs(monkeypatch):
    # Edge: three runs of one shape; two share the newest row's config and versions, one is another config.
    # The row is the newest; its speedup cell gives the range of the two same-config runs only.
    pt = _perf_table()
    base = dict(kind="forward+backward", shape="kimi-k2.7", tokens=2048, dtype="bf16", routing="uniform",
                experts_local=48, ms_kittenmoe=10.0, ms_grouped_mm=14.0, speedup=1.40, routed_tflops=430.0,
                baseline_routed_tflops=300.0, rel_l1=2.7e-3, gpu="H200", torch="2", triton="3", config="A",
                date="2026-12-03T10:00:00+00:00")
    rows = [("a.json", dict(base)), ("b.json", dict(base, speedup=1.20, config="B", date="2026-12-03T11:00:00")),
            ("c.json", dict(base, speedup=1.34, ms_kittenmoe=10.4, date="2026-12-03T12:00:00"))]
    monkeypatch.setattr(pt, "_result_rows", lambda: iter([(n, dict(r)) for n, r in rows]))
    table = pt.render(pt.load_rows())
    assert "| 10.400 | 14.000 | 1.34x (1.34-1.40x in 2 runs) |" in table, table
    monkeypatch.setattr(pt, "_result_rows", lambda: iter([rows[0]]))
    assert "| 1.40x |" in pt.render(pt.load_rows())  # one run: no range


# ----------------------------------------------------------------------------- the cache

CFG = KernelConfig(num_comm_programs_fwd=12, minibatch_size=1024, macrobatch_size=4096, block_n=64, num_stages=3)
DIMS = (2048, 7168, 2048, 48, 8)  # the Kimi K2.7 EP8 slice


def test_cache_round_trip(tmp_path):
    key = cache_key(*DIMS, 1, "NVIDIA H200", torch.bfloat16)
    path = store_config(key, CFG, dict(ms=1.0))
    assert path.parent == tmp_path / "cache" / "tune" and path.name.startswith("NVIDIA_H200-bf16-T2048")
    assert lookup_config(*DIMS, 1, "NVIDIA H200", torch.bfloat16) == CFG
    assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16", s=2048) == CFG  # same key, spelled differently
    # any other key component misses
    assert lookup_config(*DIMS, 2, "NVIDIA H200", "bf16") is None  # other R
    assert lookup_config(*DIMS, 1, "NVIDIA H100", "bf16") is None  # other GPU
    assert lookup_config(*DIMS, 1, "NVIDIA H200", "fp32") is None  # other dtype
    assert lookup_config(4096, *DIMS[1:], 1, "NVIDIA H200", "bf16") is None  # other T
    assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16", s=0) is None  # no shared expert
    # a re-tune overwrites, and the memo sees it
    other = CFG.with_(minibatch_size=2048, macrobatch_size=None)
    store_config(key, other)
    assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16") == other


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("KITTENMOE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kittenmoe"


def test_stale_version_is_ignored_with_a_warning(monkeypatch):
    # A file written by another kittenmoe version at the same key: warned about, not used.
    key = cache_key(*DIMS, 1, "NVIDIA H200", "bf16")
    store_config(key, CFG)
    written = kittenmoe.__version__
    monkeypatch.setattr(kittenmoe, "__version__", "9.9.9")
    with pytest.warns(TuneCacheWarning, match=f"stale: written by kittenmoe '{re.escape(written)}', this is '9.9.9'"):
        assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16") is None
    cfg, source = config_for(*DIMS, 1, "cpu", "bf16")  # the heuristic takes over
    assert source.startswith("heuristic")


CORRUPT = [
    # not JSON at all
    ("garbage", lambda e: "{not json", "cannot be read as JSON"),
    # a file cut off half-way through
    ("truncated", lambda e: json.dumps(e)[:40], "cannot be read as JSON"),
    # bytes that are not UTF-8
    ("binary", lambda e: b"\xff\xfe\x00\x81", "cannot be read as JSON"),
    # valid JSON of the wrong type
    ("list", lambda e: "[1, 2, 3]", "unknown format"),
    # a format number this code does not know
    ("format", lambda e: json.dumps(dict(e, format=99)), "unknown format 99"),
    # the key inside does not match the file's key (a renamed or hand-copied file)
    ("key", lambda e: json.dumps(dict(e, key=dict(e["key"], t=1))), "does not match"),
    # a config field this version does not have
    ("field", lambda e: json.dumps(dict(e, config=dict(e["config"], warp_specialize=1))),
     "another set of KernelConfig knobs .*unknown: warp_specialize"),
    # tuned before a knob existed (the package version did not move, and the knob would silently take its
    # dataclass default over what the heuristic now sets)
    ("missing-knob", lambda e: json.dumps(dict(e, config={k: v for k, v in e["config"].items() if k != "wgrad"})),
     "stale: tuned with another set of KernelConfig knobs \\(missing: wgrad; unknown: none\\)"),
    # a config value KernelConfig rejects
    ("value", lambda e: json.dumps(dict(e, config=dict(e["config"], block_m=24))), "not a valid KernelConfig"),
    # config missing altogether
    ("no-config", lambda e: json.dumps({k: v for k, v in e.items() if k != "config"}), "not a valid KernelConfig"),
]


@pytest.mark.parametrize("make,match", [(m, w) for _, m, w in CORRUPT], ids=[n for n, _, _ in CORRUPT])
def test_corrupt_file_is_ignored_with_a_warning(make, match):
    key = cache_key(*DIMS, 1, "NVIDIA H200", "bf16")
    path = store_config(key, CFG)
    content = make(json.loads(path.read_text()))
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(TuneCacheWarning, match=match):
        assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16") is None


def test_unreadable_path_is_ignored_with_a_warning():
    # A directory where the file should be: open() fails, lookup warns and returns None.
    key = cache_key(*DIMS, 1, "NVIDIA H200", "bf16")
    cache_path(key).mkdir(parents=True)
    with pytest.warns(TuneCacheWarning, match="cannot be read"):
        assert lookup_config(*DIMS, 1, "NVIDIA H200", "bf16") is None


@pytest.mark.parametrize("value,pinned", [
    ("0", True),  # the documented switch
    ("off", True),  # and its spellings
    ("false", True),
    ("1", False),  # explicitly on: the cache is used
])
def test_autotune_switch(monkeypatch, value, pinned):
    store_config(cache_key(*DIMS, 1, "cpu", "bf16"), CFG)
    monkeypatch.setenv("KITTENMOE_AUTOTUNE", value)
    got = lookup_config(*DIMS, 1, "cpu", "bf16")
    cfg, source = config_for(*DIMS, 1, "cpu", torch.bfloat16)
    if pinned:
        assert got is None
        assert cfg == default_config(*DIMS, 1, "cpu", torch.bfloat16) and "KITTENMOE_AUTOTUNE=0" in source
    else:
        assert got == CFG and cfg == CFG and source == "tuned cache"


# ----------------------------------------------------------------------------- grid and heuristic


def test_default_grid_prunes_what_cannot_fit():
    # The default GPU grid on the Kimi slice: smem fits for every tile choice listed; a 256-wide
    # tile with 4 stages (320 KB) is pruned; comm programs >= SMs are pruned.
    base = KernelConfig()
    kept, pruned = expand_grid(DEFAULT_GRID, base, 2048, 8, 48, 1, 2, 132)
    assert len(kept) + len(pruned) == math.prod(len(v) for v in DEFAULT_GRID.values())
    assert all(gate_up_smem_bytes(c) <= SHARED_MEMORY_LIMIT for c in kept)
    assert len(set(kept)) == len(kept)
    grid = parse_grid("num_comm_programs_fwd=16:200,minibatch_size=2048,macrobatch_size=None,tiles=128x4:256x4",
                      DEFAULT_GRID)
    kept, pruned = expand_grid(grid, base, 2048, 8, 48, 1, 2, 132)
    assert kept == [base.with_(num_comm_programs_fwd=16, block_n=128, num_stages=4)]
    reasons = " | ".join(r for _, r in pruned)
    assert "shared memory ~320 KB > 227 KB" in reasons and "no compute program on 132 SMs" in reasons


def test_grid_under_a_gathering_base():
    """The one-rank default gathers with no forward comm programs (default_config). Its grid points with a
    wrapping ring push instead (the rows would be overwritten before the epilogue reads them) or, where the point
    itself sets no forward comm programs, are pruned as invalid (nothing would push); a base that pushes (several
    ranks) prunes 0 comm programs as an invalid config."""
    base = KernelConfig(combine_gather=True, num_comm_programs_fwd=0, num_comm_programs_bwd=0)
    grid = {"num_comm_programs_fwd": (0, 8), "macrobatch_size": (None, 4096), "tiles": ((128, 4),)}
    kept, pruned = expand_grid(grid, base, 2048, 8, 48, 1, 2, 132)
    ring = [c for c in kept if c.macrobatch_size is not None]
    # the pushing backward gets KernelConfig's default comm programs back (the base had none)
    assert ring == [base.with_(num_comm_programs_fwd=8, macrobatch_size=4096, combine_gather=False,
                               num_comm_programs_bwd=KernelConfig().num_comm_programs_bwd)]
    assert base in kept and base.with_(num_comm_programs_fwd=8) in kept  # no ring: gathering, with 0 or 8
    assert any("num_comm_programs_fwd=0 leaves no program to push" in r for p, r in pruned
               if p["macrobatch_size"] is not None)
    kept, pruned = expand_grid(grid, KernelConfig(), 2048, 8, 384, 8, 2, 132)
    assert all(c.num_comm_programs_fwd == 8 and not c.combine_gather for c in kept)
    assert any("num_comm_programs_fwd=0" in r for _, r in pruned)


def test_grid_normalises_and_rejects():
    # macrobatch >= the whole routed buffer is "no ring": a duplicate of None; a macrobatch that is
    # not a multiple of the minibatch is an invalid KernelConfig.
    base = KernelConfig(block_m=16, minibatch_size=64, block_n=32, block_k=32, num_stages=1)
    grid = {"macrobatch_size": (None, 64, 1 << 20, 96)}
    kept, pruned = expand_grid(grid, base, 20, 2, 8, 1, 4, None)
    assert kept == [base, base.with_(macrobatch_size=64)]
    reasons = [r for _, r in pruned]
    assert any("no ring" in r for r in reasons) and any(r.startswith("invalid") for r in reasons)


def test_default_config_keeps_the_triton_wgrad_without_the_gluon_api(fake_gpu):
    """On Hopper with a Triton whose Gluon API lacks a name the Gluon kernel calls (Triton 3.9's renames), the
    weight gradients stay on the persistent Triton kernel instead of a Gluon kernel that would not compile."""
    fake_gpu(gluon_missing="triton.experimental.gluon.language.thread_barrier")
    assert default_config(2048, 7168, 2048, 48, 8, device="cuda", dtype=torch.bfloat16).wgrad == "persistent"


@pytest.mark.parametrize("dims,ranks,dtype,expect", [
    # a seed slice (Kimi EP8, R=1): one rank with a resident ring gathers (no push) and has no comm programs
    # (every program pulls its share first, forward and backward)
    ((2048, 7168, 2048, 48, 8), 1, torch.bfloat16, dict(block_m=128, minibatch_size=2048, num_stages=4,
                                                        num_comm_programs_fwd=0, combine_gather=True,
                                                        num_comm_programs_bwd=0,
                                                        macrobatch_size=None, wgrad="gluon",
                                                        bwd_num_stages=4, tile_group_m=-1)),
    # narrow experts (Qwen3.5 EP8, I=1024) on one rank: no comm programs either
    ((4096, 4096, 1024, 64, 10), 1, torch.bfloat16, dict(num_comm_programs_fwd=0, num_comm_programs_bwd=0)),
    # the Kimi slice's widths over 8 ranks: pushes (no gather), forward comm programs by I (12), the backward's
    # pull crosses NVLink, 16 comm programs (timed there)
    ((2048, 7168, 2048, 384, 8), 8, torch.bfloat16, dict(num_comm_programs_fwd=12, num_comm_programs_bwd=16,
                                                         combine_gather=False)),
    # wide experts (DeepSeek-V4-Pro EP8, I=3072) over 8 ranks: 8 forward comm programs
    ((2048, 7168, 3072, 384, 6), 8, torch.bfloat16, dict(num_comm_programs_fwd=8)),
    # fp32 operands: narrower K tiles, stages that still fit shared memory
    # (the backward's knobs were timed with 2-byte operands only: fp32 keeps the per-tile launch, 3 stages, and
    # the comm programs pushing)
    ((2048, 7168, 2048, 48, 8), 1, torch.float32, dict(block_k=32, num_stages=4, bwd_num_stages=0,
                                                       wgrad="triton", tile_group_m=0,
                                                       combine_gather=False, num_comm_programs_fwd=12)),
    # few rows per expert (T*K*R/E = 16 < 96): block_m 64, a minibatch of n/4 rows (backward stages as timed)
    ((256, 1024, 512, 128, 8), 1, torch.bfloat16, dict(block_m=64, minibatch_size=512, bwd_num_stages=0,
                                                       wgrad="gluon")),
    # a huge routed buffer (64 ranks x 8192 tokens x 8 routes x 2*7168+2048 wide): the ring window kicks in
    ((8192, 7168, 2048, 384, 8), 64, torch.bfloat16, dict(minibatch_size=2048)),
])
def test_default_config_on_a_gpu(fake_gpu, dims, ranks, dtype, expect):
    fake_gpu()
    cfg = default_config(*dims, ranks=ranks, device="cuda", dtype=dtype)
    for k, v in expect.items():
        assert getattr(cfg, k) == v, (k, cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    assert gate_up_smem_bytes(cfg, elem) <= SHARED_MEMORY_LIMIT
    assert bwd_phase_a_smem_bytes(cfg, elem) <= SHARED_MEMORY_LIMIT
    if ranks == 64:
        assert cfg.macrobatch_size is not None and cfg.macrobatch_size % cfg.minibatch_size == 0


def test_default_config_gluon_weight_gradients_on_hopper_only(fake_gpu):
    # the Gluon weight-gradient kernel issues Hopper's wgmma: a newer GPU (sm_100) keeps the Triton kernel
    fake_gpu(major=10)
    cfg = default_config(2048, 7168, 2048, 48, 8, device="cuda")
    assert cfg.wgrad == "persistent", cfg


@pytest.mark.parametrize("h,i,s,gluon", [
    (7168, 2048, None, True),  # the Kimi slice, shared width not given (assumed to fit)
    (7168, 2048, 2048, True),  # ... and given: 2S a multiple of 128
    (7168, 2048, 96, False),  # a shared expert of 96: its 2S = 192 rows would split a 128-row tile
    (32, 16, 0, False),  # the tiny test shapes: H = 32 and 2I = 32 rows
    (2880, 2048, 0, False),  # H = 2880 is not a multiple of 128 (d_W2's rows)
])
def test_default_config_gluon_weight_gradients_only_where_the_widths_fit(fake_gpu, h, i, s, gluon):
    # where the widths do not fit the 128-row tiles the heuristic keeps the Triton kernel (the backward would
    # refuse the knob there, so the heuristic must not set it)
    fake_gpu()
    cfg = default_config(2048, h, i, 48, 8, device="cuda", s=s)
    assert cfg.wgrad == ("gluon" if gluon else "persistent"), cfg


def test_grid_turns_gluon_weight_gradients_off_for_other_tiles():
    # a tile point the Gluon kernel does not build (block_n 64) keeps its place in the grid with the Triton
    # weight gradients, rather than being pruned as an invalid config
    base = KernelConfig(wgrad="gluon")
    kept, pruned = expand_grid({"tiles": ((128, 4), (64, 4))}, base, 2048, 8, 48, 1, 2, 132)
    assert not pruned, pruned
    assert [(c.block_n, c.wgrad) for c in kept] == [(128, "gluon"), (64, "persistent")]


@pytest.mark.parametrize("spec, want", [
    # tiles off the Gluon kernel's 128 x 256: the Triton weight gradients
    ("block_n=64", dict(block_n=64, wgrad="persistent")),
    # no TMA: the Gluon kernel cannot run; the Triton one does
    ("tma=False", dict(tma=False, wgrad="persistent")),
    # a deeper K step: the backward's phase-A tile no longer fits at 4 stages, so it takes bwd_stages' default
    ("block_k=128,num_stages=2", dict(block_k=128, num_stages=2, bwd_num_stages=0, wgrad="persistent")),
    # a ring, or pushes: the one-rank gather goes (a wrapping ring would overwrite the rows it reads) and the
    # comm programs that push come back at KernelConfig()'s counts
    ("macrobatch_size=8192", dict(macrobatch_size=8192, combine_gather=False, num_comm_programs_fwd=16,
                                  num_comm_programs_bwd=16)),
    ("combine_gather=False", dict(combine_gather=False, num_comm_programs_fwd=16, num_comm_programs_bwd=16)),
    ("combine_gather=False,num_comm_programs_fwd=8", dict(combine_gather=False, num_comm_programs_fwd=8,
                                                          num_comm_programs_bwd=16)),
    # knobs that touch none of those: nothing else changes
    ("minibatch_size=1024,tile_group_m=0", dict(minibatch_size=1024, tile_group_m=0)),
])
def test_overrides_on_the_h200_heuristic(fake_gpu, spec, want):
    """--config (and the tuner's grid, the FP8 tile width, the transformers knobs) on top of the H200's one-rank
    heuristic for the Kimi slice (Gluon weight gradients, 4 backward stages, the gather with no comm programs):
    every knob the heuristic derived from the changed ones follows them, so the result is a config the launches
    accept (an audit found each of these refused at launch), and nothing else moves."""
    fake_gpu()
    base = default_config(2048, 7168, 2048, 48, 8, device="cuda", s=2048)
    assert base.wgrad == "gluon" and base.combine_gather and base.bwd_num_stages == 4 and base.num_comm_programs_fwd == 0
    cfg = apply_overrides(base, parse_config_overrides(spec))
    assert cfg == base.with_(**want)
    assert bwd_phase_a_smem_bytes(cfg) <= SHARED_MEMORY_LIMIT and gate_up_smem_bytes(cfg) <= SHARED_MEMORY_LIMIT


@pytest.mark.parametrize("spec, match", [
    ("block_n=64,wgrad=gluon", "KernelConfig.wgrad='gluon' builds 128 x 256"),  # asked for: checked as given
    # both named: the config's own error (no program would push the backward's d_x rows)
    ("combine_gather=False,num_comm_programs_bwd=0", "num_comm_programs_bwd=0 leaves no program to push"),
    ("macrobatch_size=8192,num_comm_programs_fwd=0", "leaves no program to push"),  # no pusher, and none given back
])
def test_overrides_that_name_the_conflicting_knob_are_errors(fake_gpu, spec, match):
    fake_gpu()
    base = default_config(2048, 7168, 2048, 48, 8, device="cuda", s=2048)
    with pytest.raises(ValueError, match=match):
        apply_overrides(base, parse_config_overrides(spec))


def test_default_config_small_gpu_and_cpu(fake_gpu):
    # fewer than 100 SMs: an eighth of them communicate
    fake_gpu(sms=40)
    assert default_config(2048, 7168, 2048, 48, 8, device="cuda").num_comm_programs_fwd == 5
    # CPU (interpreter): small tiles, one comm program, one minibatch covering the capacity
    cfg = default_config(20, 32, 16, 8, 2, device="cpu")
    assert (cfg.block_m, cfg.block_n, cfg.num_comm_programs_fwd, cfg.minibatch_size) == (16, 32, 1, 256)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        default_config(20, 32, 16, 8, 2, ranks=3, device="cpu")


# ----------------------------------------------------------------------------- MoELayer reads the cache


@pytest.mark.parametrize("compiled", [
    False,  # eager: the lookup runs on every forward
    True,  # torch.compile(fullgraph=True): the lookup is a trace-time constant (dynamo cannot read files)
])
def test_layer_uses_tuned_config_else_heuristic(monkeypatch, compiled):
    """MoELayer(config=None, backend="megakernel") runs the tune cache's config for its (T, shape, device,
    dtype) when one is stored, the heuristic when none is or KITTENMOE_AUTOTUNE=0; an explicit config wins."""
    from kittenmoe import MoELayer, functional
    from kittenmoe.config import TEST_SHAPES

    shape = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2, shared expert of width 16
    t = 24
    seen = []
    real = functional.autograd.moe_megakernel
    monkeypatch.setattr(functional.autograd, "moe_megakernel",
                        lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))
    tuned = KernelConfig(num_comm_programs_fwd=2, num_comm_programs_bwd=2, minibatch_size=16, block_m=16,
                         block_n=16, block_k=16)
    store_config(cache_key(t, shape.h, shape.i, shape.e, shape.k, 1, "cpu", torch.float32, shape.shared_width),
                 tuned)
    x = torch.randn(t, shape.h, generator=torch.Generator().manual_seed(0))

    def run(layer):
        torch._dynamo.reset()
        fn = torch.compile(layer, backend="eager", fullgraph=True) if compiled else layer
        seen.clear()
        out = fn(x)
        assert torch.isfinite(out).all() and seen, "the megakernel path did not run"
        return seen[-1]

    layer = MoELayer(shape, backend="megakernel", generator=torch.Generator().manual_seed(1))
    assert layer.config_for_tokens(t, x.device) == tuned
    assert run(layer) == tuned
    heuristic = default_config(t, shape.h, shape.i, shape.e, shape.k, 1, "cpu", torch.float32)
    assert heuristic != tuned
    assert layer.config_for_tokens(t + 1, x.device) == default_config(t + 1, shape.h, shape.i, shape.e, shape.k,
                                                                       1, "cpu", torch.float32)  # no entry
    monkeypatch.setenv("KITTENMOE_AUTOTUNE", "0")
    assert layer.config_for_tokens(t, x.device) == heuristic
    assert run(layer) == heuristic
    monkeypatch.delenv("KITTENMOE_AUTOTUNE")
    explicit = tuned.with_(minibatch_size=32)
    assert run(MoELayer(shape, backend="megakernel", config=explicit)) == explicit
    assert MoELayer(shape, backend="torch").config_for_tokens(t, x.device) is None  # no knobs there


# ----------------------------------------------------------------------------- bench under torchrun (real ranks)

TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def _fake_torchrun(monkeypatch, **extra):
    """This process looks like rank 0 of a 2-process torchrun world (no process group is made)."""
    for k, v in {**TORCHRUN_ENV, **extra}.items():
        monkeypatch.setenv(k, v)


def _fake_cuda(monkeypatch, count: int):
    """torch.cuda says ``count`` devices exist; resolve_ep_device asks nothing more of it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_bench_torchrun_ranks_disagree_with_world_size(monkeypatch, capsys, tmp_path):
    # Edge: --ranks 4 under a 2-process torchrun world is refused, naming both numbers, before any process
    # group or file exists (every rank raises the same error, so none hangs waiting for another).
    _fake_torchrun(monkeypatch)
    rc = cli.main(["bench", "--shape", TINY, "--ranks", "4", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--ranks 4" in err and "world size 2" in err and "--ranks 2" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,cuda,message", [
    # --device cpu under torchrun: SymmetricPeers has no CPU form; no silent fallback to virtual ranks
    (["--device", "cpu"], True, "--device cpu: under torchrun each process is one EP rank"),
    # no --device and no CUDA: the same reason, not a CPU run (TRITON_INTERPRET=1 is set in these tests)
    ([], False, "CUDA is not available here: under torchrun"),
])
def test_bench_torchrun_needs_cuda(monkeypatch, capsys, tmp_path, argv, cuda, message):
    _fake_torchrun(monkeypatch)
    if cuda:
        _fake_cuda(monkeypatch, 1)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["bench", "--shape", TINY, "--out", str(tmp_path / "out")] + argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "SymmetricPeers, which needs CUDA" in err and "no CPU backend" in err, err
    assert not (tmp_path / "out").exists()


def test_ep_baseline_without_torchrun_is_an_error(monkeypatch, capsys, tmp_path):
    # Edge: --ep-baseline chooses the baseline of real ranks; in the one-process virtual mode (no WORLD_SIZE)
    # it would be ignored, so it is refused instead.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc = cli.main(["bench", "--shape", TINY, "--ep-baseline", "distributed", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--ep-baseline distributed applies under torchrun" in err, err


def test_detect_launch_reads_torchrun_environment():
    # Edge: the seam between the environment and the bench: no WORLD_SIZE is one process (virtual ranks);
    # torchrun's variables give this rank; KITTENMOE_EP_SHARE_GPU=1 puts every rank on one GPU.
    from kittenmoe.bench.launch import Launch, detect_launch

    assert detect_launch({}) is None
    assert detect_launch({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == Launch(4, 3, 1, False, True)
    assert detect_launch({**TORCHRUN_ENV, "KITTENMOE_EP_SHARE_GPU": "1"}).share_gpu
    assert not detect_launch({**TORCHRUN_ENV, "KITTENMOE_EP_SHARE_GPU": "0"}).share_gpu


@pytest.mark.parametrize("environ,message", [
    # WORLD_SIZE without RANK: not a torchrun launch; say how to launch
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not set but WORLD_SIZE=2 is"),
    # a variable that is not an integer
    ({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    # RANK outside [0, WORLD_SIZE)
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "0 <= RANK < WORLD_SIZE"),
    # KITTENMOE_EP_SHARE_GPU neither 0 nor 1 (a typo must not silently mean "one GPU per rank")
    ({**TORCHRUN_ENV, "KITTENMOE_EP_SHARE_GPU": "yes"}, "KITTENMOE_EP_SHARE_GPU='yes'"),
])
def test_detect_launch_rejects_broken_environment(environ, message):
    from kittenmoe.bench.launch import detect_launch

    with pytest.raises(ValueError, match=re.escape(message)):
        detect_launch(environ)


def test_check_world_and_device_under_torchrun(monkeypatch):
    # Edge: an absent or equal --ranks gives the world size; each rank's GPU is cuda:LOCAL_RANK, cuda:0 when
    # the ranks share it; LOCAL_RANK past the GPUs and a --device naming another GPU are clear errors.
    from kittenmoe.bench.launch import check_world, detect_launch, resolve_ep_device

    _fake_cuda(monkeypatch, 2)
    launch = detect_launch({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert check_world(None, launch) == 2 and check_world(2, launch) == 2
    assert resolve_ep_device(None, launch) == torch.device("cuda", 1)
    assert resolve_ep_device("cuda", launch) == torch.device("cuda", 1)
    assert resolve_ep_device("cuda:1", launch) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=re.escape("--device cuda:0: rank 1 runs on cuda:1 (LOCAL_RANK=1)")):
        resolve_ep_device("cuda:0", launch)
    shared = detect_launch({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "KITTENMOE_EP_SHARE_GPU": "1"})
    assert resolve_ep_device(None, shared) == torch.device("cuda", 0)
    beyond = detect_launch({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3"})
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3, but this machine has 2 CUDA device\(s\).*"
                                         r"KITTENMOE_EP_SHARE_GPU=1"):
        resolve_ep_device(None, beyond)
    with pytest.raises(ValueError, match="'nope' is not a device"):
        resolve_ep_device("nope", launch)


def test_table_marks_process_ranks():
    # Edge: rows of real ranks and of virtual ranks look alike in the table except for R ("2p" = processes)
    # and the baseline's name.
    from kittenmoe.bench.report import format_table

    row = dict(kind="forward", shape="H32-I16-E8-K2", tokens=20, ranks=2, experts_local=4, routing="uniform",
               dtype="bf16", ms_kittenmoe=1.0, ms_kittenmoe_p20=0.9, ms_kittenmoe_p80=1.1, ms_baseline=2.0,
               speedup=2.0, routed_tflops=1.0, baseline_routed_tflops=0.5, rel_l1=1e-3, rel_l1_ok=True)
    lines = format_table([dict(row, ranks_mode="virtual", baseline="grouped_mm"),
                          dict(row, ranks_mode="processes", baseline="all_to_all_forward")]).splitlines()
    assert re.search(r"20\s+2\s+4\s+uniform", lines[2]) and "grouped_mm" in lines[2]
    assert re.search(r"20\s+2p\s+4\s+uniform", lines[3]) and "all_to_all_forward" in lines[3]


# A small problem two processes on one GPU compile and run quickly: 96 tokens a rank, H=128, I=64, K=4, 8 experts
# per rank (E=16 over 2 ranks), the tiles the EP GPU tests in test_distributed.py run.
EP_SMOKE_SHAPE = "96,128,64,16,4"
EP_SMOKE_CONFIG = ("num_comm_programs_fwd=8,num_comm_programs_bwd=8,minibatch_size=256,block_m=64,block_n=64,"
                   "block_k=64,num_stages=3,num_warps=4")


@pytest.mark.gpu
@pytest.mark.parametrize("path,timed", [
    ("public", "kittenmoe.ep.moe_ep"),  # the default: the autograd entry point under EP
    ("launcher", "ep.megakernel_forward_ep"),
])
def test_bench_torchrun_two_processes_share_one_gpu(tmp_path, path, timed):
    # Edge: real ranks. torchrun starts 2 processes on one GPU (KITTENMOE_EP_SHARE_GPU=1: gloo group, symmetric
    # memory allowed to overlap); each is one EP rank of kittenmoe.ep over SymmetricPeers, timed against the
    # NCCL + PyTorch EP baseline in the same run; rank 0 alone prints and writes one JSON file.
    out = tmp_path / "results"
    env = dict(os.environ, KITTENMOE_EP_SHARE_GPU="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "kittenmoe.cli", "bench", "--shape", EP_SMOKE_SHAPE, "--ep", "2", "--mode", "both",
           "--config", EP_SMOKE_CONFIG, "--reps", "5", "--warmup", "2", "--out", str(out), "--path", path]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1, files
    rows = json.loads(files[0].read_text())
    assert [r["kind"] for r in rows] == ["forward", "forward+backward"]
    assert rows[0]["timed_call"] == timed and rows[1]["timed_call"].startswith(timed + " + ")
    for r in rows:
        assert r["path"] == path
        assert r["ranks"] == 2 and r["ranks_mode"] == "processes" and r["share_gpu"] and r["process_group"] == "gloo"
        assert (r["e"], r["experts_local"], r["device"]) == (16, 8, "cuda")
        assert r["baseline"] == "all_to_all_forward"
        for f in ("ms_kittenmoe", "ms_baseline", "speedup", "routed_tflops", "baseline_routed_tflops"):
            assert math.isfinite(r[f]) and r[f] > 0, f
        assert r["ms_kittenmoe_p20"] <= r["ms_kittenmoe"] <= r["ms_kittenmoe_p80"]
        assert r["rel_l1_ok"] and r["baseline_rel_l1"] <= r["rel_l1_tolerance"], r
        assert "out[0]" in r["rel_l1_per_tensor"] and "out[1]" in r["rel_l1_per_tensor"]
    assert {f"{n}[{r}]" for n in ("out", "d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2")
            for r in (0, 1)} == set(rows[1]["rel_l1_per_tensor"])
    assert proc.stdout.count("kmoe ms p50 [p20-p80]") == 1  # one table: rank 0's


# ----------------------------------------------------------------------------- interleaved timing


@pytest.mark.parametrize("n,rounds", [
    (1, 3),  # one variant: every round times it alone
    (3, 3),  # as many rounds as variants: each variant once in every slot
    (3, 7),  # more rounds than variants: the rotation wraps
])
def test_interleaved_order_rotates(n, rounds):
    from kittenmoe.bench.timing import interleaved_order

    names = [f"v{j}" for j in range(n)]
    order = interleaved_order(names, rounds)
    assert len(order) == rounds
    for r, round_ in enumerate(order):
        assert sorted(round_) == names  # every variant once a round
        assert round_[0] == names[r % n]  # round r starts at variant r mod n
    if rounds >= n:  # over n rounds each variant takes every slot once
        for j in range(n):
            assert sorted(order[r][j] for r in range(n)) == names


def test_measure_rounds_on_cpu():
    """kittenmoe bench's timing on CPU: warm-up calls once, then rounds (5, or fewer when reps are fewer, rounded
    up to a multiple of the callables' count) of reps // rounds timed calls."""
    from kittenmoe.bench.timing import measure_rounds

    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    got = measure_rounds({n: (lambda n=n: bump(n)) for n in calls}, torch.device("cpu"), reps=12, warmup=2)
    # 2 warm-up calls, then 6 rounds (5 rounded up to a multiple of 2) of 12 // 6 = 2 timed calls
    assert calls == {"a": 2 + 6 * 2, "b": 2 + 6 * 2}
    for t in got.values():
        assert t.runs == 12 and t.p20 <= t.p50 <= t.p80
    calls = {"a": 0, "b": 0}
    got = measure_rounds({n: (lambda n=n: bump(n)) for n in calls}, torch.device("cpu"), reps=1, warmup=0)
    assert calls == {"a": 2, "b": 2} and got["a"].runs == 2  # one rep: 2 rounds (one slot each) of one call


def test_measure_interleaved_drops_a_failing_variant():
    """With errors={}, a callable that raises in round 2 is dropped and reported; the others keep every round.
    Without it, the exception propagates."""
    from kittenmoe.bench.timing import measure_interleaved

    n = {"bad": 0}

    def bad():
        n["bad"] += 1
        if n["bad"] > 1:  # round 0's call passes, round 1's fails
            raise RuntimeError("out of memory")

    errors = {}
    got = measure_interleaved({"ok": lambda: None, "bad": bad}, torch.device("cpu"), rounds=4, errors=errors)
    assert set(got) == {"ok"} and len(got["ok"].round_ms) == 4
    assert errors == {"bad": "RuntimeError: out of memory"}
    n["bad"] = 0
    with pytest.raises(RuntimeError, match="out of memory"):
        measure_interleaved({"ok": lambda: None, "bad": bad}, torch.device("cpu"), rounds=4)


def test_measure_interleaved_times_each_variant_every_round():
    """On CPU: the calls go in the rotated order, each variant has one time a round, the median is theirs."""
    from kittenmoe.bench.timing import interleaved_order, measure_interleaved

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    got = measure_interleaved(fns, torch.device("cpu"), rounds=4)
    # each slot is one timed call
    want = [name for round_ in interleaved_order(["a", "b", "c"], 4) for name in round_]
    assert calls == want
    for t in got.values():
        assert len(t.round_ms) == 4 and all(x >= 0 for x in t.round_ms)
        assert min(t.round_ms) <= t.ms <= max(t.round_ms)


@pytest.mark.parametrize("rounds,fns", [
    (0, {"a": lambda: None}),  # no round
    (3, {}),  # nothing to time
])
def test_measure_interleaved_refuses_empty(rounds, fns):
    from kittenmoe.bench.timing import measure_interleaved

    with pytest.raises(ValueError, match="measure_interleaved needs"):
        measure_interleaved(fns, torch.device("cpu"), rounds=rounds)


def test_measure_ranks_rounds_orchestration(monkeypatch):
    """The torchrun path's interleaving, with measure_ranks (CUDA events, collectives) stood in for: every name in
    every round in the rotated order, warm-up calls in the first round only, reps split over the rounds, and
    each quantile the median of the rounds'."""
    from kittenmoe.bench import timing

    seen = []

    def fake_measure_ranks(fn, device, group, reps, warmup):
        p50 = float(len(seen) ** 2)  # the call's position, squared: distinct medians for the two names
        seen.append((fn(), reps, warmup))
        return timing.Timing(p50 - 0.5, p50, p50 + 0.5, reps)

    monkeypatch.setattr(timing, "measure_ranks", fake_measure_ranks)
    fns = {"kittenmoe": lambda: "k", "baseline": lambda: "b"}
    got = timing.measure_ranks_rounds(fns, torch.device("cpu"), None, reps=13, warmup=3, rounds=5)
    # 5 rounds rounded up to 6 (a multiple of 2), rotated; 13 // 6 = 2 iterations a round; warm-up in round 0 only
    assert [s[0] for s in seen] == ["k", "b", "b", "k", "k", "b", "b", "k", "k", "b", "b", "k"]
    assert all(s[1] == 2 for s in seen) and [s[2] for s in seen] == [3, 3] + [0] * 10
    # kittenmoe ran at positions 0, 3, 4, 7, 8, 11: p50s 0, 9, 16, 49, 64, 121, median 32.5; the baseline 30.5
    assert got["kittenmoe"].p50 == 32.5 and got["baseline"].p50 == 30.5
    assert got["kittenmoe"].p20 == 32.0 and got["kittenmoe"].p80 == 33.0 and got["kittenmoe"].runs == 12


def test_cpu_host_probe_runs():
    """benchmarks/probes/cpu_host_probe.py (the public path's own host time with kernel bodies skipped) still
    drives kittenmoe.moe forward and forward+backward, with a real schedule, at a tiny shape."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "cpu_host_probe.py"),
                        "--shape", "64,64,32,8,2", "--blocks", "1"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    times = re.findall(r"==== (forward|forward\+backward) 64,64,32,8,2: ([0-9.]+) ms", r.stdout)
    assert [m for m, _ in times] == ["forward", "forward+backward"] and all(float(v) > 0 for _, v in times)
