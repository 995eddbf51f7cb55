"""The training demo (``examples/train_lm.py``): a small MoE transformer LM on the standard library's source bytes.

CPU: a 40-step run of a tiny model with the torch backend learns (the loss falls clearly) and is bitwise
repeatable; two steps with the megakernel (interpreted) match the torch backend. GPU: 50 steps of the demo
model with the megakernel learn and are bitwise repeatable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kittenmoe.config import KernelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the demo is an example script, not part of the package

from train_lm import TrainConfig, load_stdlib_bytes, main, train  # noqa: E402

# Tiny and fast: ~0.03 s a step on 2 CPU cores.
TINY = TrainConfig(steps=40, layers=2, hidden=32, heads=2, experts=4, topk=2, expert_width=16, shared_width=16,
                   seq_len=32, batch_size=4, lr=1e-2, warmup_steps=5, data_bytes=1 << 18, log_every=10)


def _mean(xs):
    return sum(xs) / len(xs)


def _assert_learns(curve, steps, drop):
    assert len(curve) == steps and all(isinstance(v, float) for v in curve)
    assert all(v == v and v < 1e3 for v in curve), "loss is not finite"
    # an untrained byte model sits near ln(256) = 5.55 nats; a few dozen steps learn the byte statistics
    first, last = _mean(curve[:5]), _mean(curve[-5:])
    assert last < first - drop, f"loss did not fall clearly: first 5 steps {first:.3f}, last 5 {last:.3f}"


def test_train_cpu_loss_falls_and_is_bitwise_repeatable():
    logs = []
    det_before = torch.are_deterministic_algorithms_enabled()
    a = train(TINY, log=logs.append)
    b = train(TINY, log=None)
    _assert_learns(a, TINY.steps, drop=1.0)
    assert a == b, "two runs with one config gave different loss curves"
    assert any("loss" in line for line in logs) and logs[0].startswith("train_lm:")
    # the run restores the caller's determinism setting
    assert torch.are_deterministic_algorithms_enabled() == det_before


def test_train_seed_changes_the_run():
    a = train(replace(TINY, steps=3), log=None)
    b = train(replace(TINY, steps=3, seed=1), log=None)
    assert a != b


def test_stdlib_data_is_fixed_real_text():
    a, b = load_stdlib_bytes(4096), load_stdlib_bytes(4096)
    assert a.dtype == torch.uint8 and a.numel() == 4096 and torch.equal(a, b)
    text = bytes(a.tolist()).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text  # Python source
    with pytest.raises(ValueError, match="holds only"):
        load_stdlib_bytes(1 << 40)


def test_train_config_errors():
    with pytest.raises(ValueError, match="multiple of heads"):
        TrainConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="unknown MoE backend"):
        TrainConfig(backend="fast")
    with pytest.raises(ValueError, match="topk"):
        TrainConfig(experts=2, topk=3)
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype="float16")


def test_train_command_line(capsys):
    rc = main(["--steps", "3", "--layers", "1", "--hidden", "16", "--heads", "2", "--experts", "4",
               "--expert-width", "8", "--shared-width", "0", "--seq-len", "16", "--batch-size", "2",
               "--log-every", "1", "--untied"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "step     2" in out and "mean loss" in out
    assert main(["--hidden", "30", "--heads", "4"]) == 2  # bad config: one line, exit code 2
    assert "train_lm.py: error: TrainConfig: hidden=30 is not a multiple of heads=4" in capsys.readouterr().err


def test_train_script_runs_as_a_file():
    """``python examples/train_lm.py`` (with kittenmoe importable) runs a short CPU training; the
    ``kittenmoe`` CLI has no training subcommand."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                      if p))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", "2", "--layers", "1", "--hidden", "16",
         "--heads", "2", "--experts", "4", "--expert-width", "8", "--seq-len", "16", "--batch-size", "2",
         "--data-bytes", "4096"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "mean loss" in proc.stdout
    from kittenmoe.cli import main as kittenmoe_main

    with pytest.raises(SystemExit):  # argparse: invalid choice 'train'
        kittenmoe_main(["train"])


def test_train_megakernel_backend_matches_torch_backend():
    """The whole stack end to end: two steps (the second after an update from the first one's gradients) with
    the megakernel MoE, under the interpreter on CPU (the GPU when there is one), give the torch backend's
    losses up to fp32 rounding."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = replace(TINY, steps=2, layers=1, batch_size=2, seq_len=16, device=dev,
                  kernel_config=KernelConfig(num_comm_programs_fwd=2, num_comm_programs_bwd=2, minibatch_size=32,
                                             block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2))
    mk = train(replace(cfg, backend="megakernel"), log=None)
    tb = train(replace(cfg, backend="torch"), log=None)
    assert mk == pytest.approx(tb, rel=1e-4), (mk, tb)


# ----------------------------------------------------------------------------- GPU

# The demo's default model and knobs (train_lm.DEMO_KERNEL_CONFIG), fp32, on the GPU: what
# `python examples/train_lm.py --device cuda --steps 50` runs.
GPU_TRAIN = TrainConfig(steps=50, device="cuda", backend="megakernel", log_every=10)


@pytest.mark.gpu
def test_gpu_train_megakernel_loss_falls_and_is_bitwise_repeatable():
    a = train(GPU_TRAIN)
    b = train(GPU_TRAIN, log=None)
    _assert_learns(a, GPU_TRAIN.steps, drop=1.0)
    assert a == b, "two megakernel runs with one config gave different loss curves"
