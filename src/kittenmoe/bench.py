"""``kittenmoe bench``: time the megakernel layer against the PyTorch grouped_mm baseline, same run.

    kittenmoe bench --model kimi-k2.7 --ep 8 --tokens 2048 --mode both
    kittenmoe bench --shape 4096,7168,2048,48,8 --routing zipf:1.2 --ranks 2 --plot bench.png
    torchrun --nproc-per-node 8 -m kittenmoe.cli bench --model kimi-k2.7 --ep 8 --mode both

Problem: ``--model NAME`` slices a registered shape to one EP rank (E_local =
E / ep experts; default ep 8), ``--shape T,H,I,E,K`` gives the dimensions
directly (default ep 1). With ``--ranks R`` (default 1) R virtual ranks run on
one device through ``LocalPeers``, each holding E_local experts, so the
problem has R * E_local experts in total and each rank's T tokens are routed
over all of them; the timed call runs every rank (the slowest rank's latency
does not exist apart from the sum there), and the baseline runs once per rank,
its times summed. With R = 1 every route lands on the one rank, as in
benchmarks/fwd_round.py.

Method on CUDA: the first call of each provider compiles and is checked (the
megakernel's device error flag, relative L1 against the fp32 reference in
``kittenmoe.reference``); then kittenmoe and the baseline are timed together
in interleaved rounds (``measure_rounds``: each round ``triton.testing.do_bench``
of each, CUDA events, L2 flushed between runs, in rotated order; about
``--warmup`` warm-up and ``--reps`` timed runs each over all rounds), reporting
the medians over rounds of p20 / p50 / p80: the GPU's clock falls under its
power cap during sustained runs, which would favour whichever provider ran
first. Schedule construction, the routing
all-gather and the epilogue are inside the timed call. ``backward`` times the
forward and the backward megakernels together against grouped_mm forward +
autograd backward.

On CPU the megakernel runs only under the Triton interpreter
(``TRITON_INTERPRET=1``); this is for tests: times are ``time.perf_counter``
medians of a few runs and rows carry ``"device": "cpu-interpreter"`` and
``"gpu": "cpu"`` so nobody mistakes them for GPU figures.

Real ranks: under ``torchrun --nproc-per-node R -m kittenmoe.cli bench ...``
(WORLD_SIZE set, or a process group the caller initialised) each process is
one rank holding E_local experts and its own T tokens routed over all
R * E_local: kittenmoe is ``kittenmoe.ep`` over ``SymmetricPeers``, the
baseline NCCL + PyTorch under EP (``--ep-baseline``: ``all-to-all``,
``baselines.all_to_all_forward``, the default; or ``distributed``,
``distributed.moe_forward_distributed``), same weights and routing. Each
iteration starts after an L2 flush and a barrier; its latency is the slowest
rank's (CUDA events, all-reduce MAX); kittenmoe and the baseline run in
interleaved rounds (``measure_ranks_rounds``), p20 / p50 / p80 the medians over
rounds of each round's, about ``--reps`` iterations each in all. The
check is against the fp32 semantic model across the same processes
(``moe_forward_distributed`` on fp32 copies). ``--ranks``, if given, must
equal the world size; CUDA only (no CPU symmetric memory). One GPU per rank
(``LOCAL_RANK``, NCCL group), or every rank on cuda:0 with
``KITTENMOE_EP_SHARE_GPU=1`` (gloo group; times then test the tool, they are
not EP figures). TFLOP/s there are the whole world's. Only rank 0 prints and
writes; rows carry ``"ranks_mode": "processes"`` (``"virtual"`` otherwise).

FP8 (``--fp8 128``, DeepSeek-V3's 1 x 128 / 128 x 128 block scales; ``--fp8 32``, MXFP8's 32-blocks with
power-of-two scales): kittenmoe runs the routed experts in e4m3 (``kittenmoe.fp8``; bf16 inputs and outputs,
``--dtype bf16`` only; H and I multiples of the scale block; ``block_n`` a multiple of it, 128 unless
``--config`` says otherwise) against the same BF16 baseline, so the speedup is FP8 kittenmoe over BF16
grouped_mm (or NCCL + PyTorch); rows say ``"precision": "fp8-e4m3/128"`` and ``"baseline_precision":
"bf16"``. The expert weights are quantised once per problem, outside the timed calls; that quantisation's
own time (what a training step adds, re-quantising its weights) is in ``ms_fp8_weight_quantisation``. The
accuracy bar is then FP8's (``kittenmoe.testing.tolerance_for("fp8")``), against the same fp32 reference
of the unquantised weights.

Output: a table on the terminal, one JSON file of rows (``bench-<date>.json``
in ``--out``, the fields ``scripts/perf_table.py`` reads plus more), and
optionally a PNG plot (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from kittenmoe.checks import interpreting
from kittenmoe.config import SHAPES, KernelConfig, ModelShape, get_shape

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("forward", "backward", "both")
FP8_BLOCKS = (128, 32)  # --fp8: the scale block (128: DeepSeek-V3's; 32: MXFP8, power-of-two scales)
FP8_QUANT_REPS = 10  # timed runs of the weight quantisation (measured once per problem)
KIND = {"forward": "forward", "backward": "forward+backward"}
QUANTILES = (0.2, 0.5, 0.8)
DEFAULT_EP_MODEL = 8
# Baselines that need packages we do not depend on: reported as skipped when not importable.
OPTIONAL_BASELINES = ("deep_ep",)


# ----------------------------------------------------------------------------- argument parsing


@dataclass(frozen=True)
class RoutingSpec:
    """A routing distribution from ``kittenmoe.testing``: uniform, zipf (with exponent alpha) or one-hot."""

    name: str  # "uniform" | "zipf" | "one-hot"
    alpha: float | None = None

    def __str__(self) -> str:
        return f"zipf:{self.alpha:g}" if self.name == "zipf" else self.name

    def generate(self, t: int, e: int, k: int, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
        from kittenmoe.testing import routing_one_hot, routing_uniform, routing_zipf

        if self.name == "uniform":
            return routing_uniform(t, e, k, generator=generator, device=device)
        if self.name == "zipf":
            return routing_zipf(t, e, k, alpha=self.alpha, generator=generator, device=device)
        return routing_one_hot(t, e, k, hot=0, generator=generator, device=device)


def parse_routing(spec: str) -> RoutingSpec:
    """``uniform``, ``zipf`` (alpha 1.2), ``zipf:ALPHA`` (ALPHA > 0) or ``one-hot`` (also ``one_hot``)."""
    s = spec.strip().lower()
    if s == "uniform":
        return RoutingSpec("uniform")
    if s in ("one-hot", "one_hot", "onehot"):
        return RoutingSpec("one-hot")
    if s == "zipf" or s.startswith("zipf:"):
        alpha = 1.2
        if ":" in s:
            try:
                alpha = float(s.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad --routing {spec!r}: the Zipf exponent after 'zipf:' must be a number, "
                                 f"e.g. zipf:1.2") from None
            if not (alpha > 0 and alpha < float("inf")):
                raise ValueError(f"bad --routing {spec!r}: the Zipf exponent must be a finite number > 0")
        return RoutingSpec("zipf", alpha)
    raise ValueError(f"bad --routing {spec!r}: expected uniform, zipf, zipf:ALPHA (e.g. zipf:1.2) or one-hot")


def parse_shape(spec: str) -> tuple[int, int, int, int, int]:
    """``T,H,I,E,K``: five positive integers, K <= E."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 5:
        raise ValueError(f"bad --shape {spec!r}: expected five comma-separated integers T,H,I,E,K "
                         f"(tokens, hidden, expert width, experts, top-k), e.g. 2048,7168,2048,384,8")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"bad --shape {spec!r}: T,H,I,E,K must all be integers") from None
    for name, v in zip("THIEK", vals):
        if v < 1:
            raise ValueError(f"bad --shape {spec!r}: {name}={v} must be a positive integer")
    t, h, i, e, k = vals
    if k > e:
        raise ValueError(f"bad --shape {spec!r}: top-k K={k} exceeds the number of experts E={e}")
    return t, h, i, e, k


_CONFIG_LITERALS = {"none": None, "true": True, "false": False}


def parse_config_overrides(spec: str | None) -> dict:
    """``k=v,k=v`` with KernelConfig field names; values are ints, ``None``, ``True`` or ``False``."""
    if not spec:
        return {}
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    out = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"bad --config item {item!r}: expected key=value (keys: {', '.join(sorted(fields))})")
        key, val = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            raise ValueError(f"bad --config key {key!r}: KernelConfig has no such field; "
                             f"known: {', '.join(sorted(fields))}")
        low = val.lower()
        if low in _CONFIG_LITERALS:
            out[key] = _CONFIG_LITERALS[low]
        else:
            try:
                out[key] = int(val)
            except ValueError:
                raise ValueError(f"bad --config value {key}={val!r}: expected an integer, None, True or False") \
                    from None
    return out


def apply_overrides(base: KernelConfig, overrides: dict) -> KernelConfig:
    """``base`` with ``overrides``; KernelConfig's own validation gives the error for a bad value. Through
    ``KernelConfig.with_overrides``: the heuristic's derived knobs follow the overrides (on Hopper, tiles off
    the Gluon kernel's 128 x 256 take the Triton weight gradients; a ring or a push turns the one-rank gather
    off), as the tuner's grid does; a knob the overrides name is checked as given."""
    try:
        return base.with_overrides(**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad --config: {e}") from None


# ----------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One benchmarked layer: ``shape.e`` is the problem's total experts (ranks * experts_local)."""

    label: str  # the model name, or "H..-I..-E..-K.." for an explicit shape
    shape: ModelShape
    tokens: int  # T per rank
    ranks: int  # R virtual ranks
    ep: int  # the EP degree the model was sliced for
    experts_local: int  # E_local = E_model / ep
    dtype: str  # "bf16" | "fp32"
    routing: RoutingSpec
    fp8_block: int | None = None  # --fp8: routed experts in e4m3 with this scale block; None: in dtype

    @property
    def precision(self) -> str:
        """What kittenmoe computes the routed experts in: the dtype, or ``fp8-e4m3/<scale block>``."""
        return self.dtype if self.fp8_block is None else f"fp8-e4m3/{self.fp8_block}"

    def fp8_config(self):
        """The ``kittenmoe.fp8.FP8Config`` of ``--fp8`` (32: MXFP8, power-of-two scales), or None."""
        from kittenmoe.fp8 import FP8Config

        return None if self.fp8_block is None else FP8Config(self.fp8_block, pow2_scales=self.fp8_block == 32)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(T, H, I, E, K) of the problem as run: E = ranks * experts_local."""
        s = self.shape
        return self.tokens, s.h, s.i, s.e, s.k

    @property
    def shared_width(self) -> int:
        return self.shape.shared_width

    def describe(self) -> str:
        t, h, i, e, k = self.dims
        return (f"{self.label}: T={t} H={h} I={i} E={e} (E_local={self.experts_local} x R={self.ranks}) K={k} "
                f"S={self.shared_width} {self.dtype}"
                f"{'' if self.fp8_block is None else f' (routed experts in {self.precision})'} routing={self.routing}")


def make_problems(model: str | None, shape: str | None, ep: int | None, tokens: int | None, ranks: int | None,
                  dtype: str, routing: str, fp8: int | None = None) -> list[Problem]:
    """Validate the shape arguments (clear ``ValueError`` on any mistake) and build the problems.

    ``model`` may name several registered shapes, comma-separated. ``ranks`` None (``--ranks`` not given) is 1.
    ``fp8``: ``--fp8``'s scale block (None: no FP8); needs bf16 and H, I multiples of it.
    """
    if (model is None) == (shape is None):
        raise ValueError("give exactly one of --model NAME or --shape T,H,I,E,K")
    ranks = 1 if ranks is None else ranks
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks}")
    if ep is not None and ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be a positive integer, got {tokens}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fp8 is not None:
        if fp8 not in FP8_BLOCKS:
            raise ValueError(f"--fp8 must be one of {', '.join(map(str, FP8_BLOCKS))} (the scale block), got {fp8!r}")
        if dtype != "bf16":
            raise ValueError(f"--fp8 {fp8} needs --dtype bf16 (the FP8 megakernels take bf16 inputs and write bf16 "
                             f"outputs), got --dtype {dtype}")
    spec = parse_routing(routing)
    bases: list[tuple[str, ModelShape, int]] = []
    if model is not None:
        ep = DEFAULT_EP_MODEL if ep is None else ep
        for name in (m.strip() for m in model.split(",")):
            if name not in SHAPES:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SHAPES))}")
            bases.append((name, get_shape(name), 2048 if tokens is None else tokens))
    else:
        if tokens is not None:
            raise ValueError("--tokens goes with --model; with --shape T,H,I,E,K the token count is T")
        ep = 1 if ep is None else ep
        t, h, i, e, k = parse_shape(shape)
        bases.append((f"H{h}-I{i}-E{e}-K{k}", ModelShape("custom", e=e, h=h, i=i, k=k), t))
    out = []
    for label, base, t in bases:
        if base.e % ep:
            raise ValueError(f"{label}: E={base.e} experts are not divisible by --ep {ep}")
        local = base.e // ep
        e_total = local * ranks
        if base.k > e_total:
            raise ValueError(f"{label}: top-k K={base.k} exceeds the {e_total} experts of the sliced problem "
                             f"(E/ep={local} per rank x {ranks} ranks); use a smaller --ep or more --ranks")
        if fp8 is not None and (base.h % fp8 or base.i % fp8):
            raise ValueError(f"{label}: --fp8 {fp8} needs H and I multiples of the scale block {fp8}, got H={base.h} "
                             f"I={base.i}")
        out.append(Problem(label, base.with_(e=e_total), t, ranks, ep, local, dtype, spec, fp8))
    return out


# ----------------------------------------------------------------------------- environment


def resolve_device(device: str | None) -> torch.device:
    """``--device`` (default: cuda if available, else cpu); a CPU device needs the Triton interpreter."""
    dev = torch.device(device if device else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {dev} asked for, but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "cpu":
        if not interpreting():
            raise ValueError("on CPU the megakernel runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
                             "in the environment (for tests; CPU times are not GPU figures)")
    else:
        raise ValueError(f"--device must be cpu or cuda[:N], got {dev}")
    return dev


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def environment(device: torch.device) -> dict:
    import triton

    import kittenmoe

    env = dict(gpu=device_name(device), device="cuda" if device.type == "cuda" else "cpu-interpreter",
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               kittenmoe=kittenmoe.__version__)
    if device.type == "cuda":
        env["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return env


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "kittenmoe " + " ".join(args)


def skipped_baselines(log: Callable[[str], None] = print, processes: bool = False) -> list[str]:
    """One line per optional baseline: skipped because not importable, or not run here."""
    notes = []
    for mod in OPTIONAL_BASELINES:
        if importlib.util.find_spec(mod) is None:
            notes.append(f"skipped: {mod} not importable")
        elif processes:
            notes.append(f"skipped: {mod} is importable, but kittenmoe bench has no {mod} baseline yet")
        else:
            notes.append(f"skipped: {mod} is importable, but its baseline needs one process per rank "
                         f"(torchrun); this single-process bench does not run it")
    for n in notes:
        log(n)
    return notes


# ----------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    p20: float
    p50: float
    p80: float
    runs: int  # timed runs (approximate on CUDA: do_bench picks the count from the time budget)


def _one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one synchronised call of ``fn`` on a CUDA device, in ms (at least 1 us): what turns a run
    count into do_bench's millisecond budgets."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return max((time.perf_counter() - t0) * 1e3, 1e-3)


def _cpu_call_ms(fn: Callable[[], object], calls: int) -> list[float]:
    """``time.perf_counter`` times in ms of ``calls`` calls of ``fn`` (the CPU timings, for tests)."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def measure(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> Timing:
    """Latency quantiles of ``fn`` in ms (p20, p50, p80); ``fn`` has already run once (compiled)."""
    if device.type == "cuda":
        import triton

        est = _one_call_ms(fn, device)
        q = triton.testing.do_bench(fn, warmup=max(1.0, warmup * est), rep=max(1.0, reps * est),
                                    quantiles=list(QUANTILES))
        return Timing(float(q[0]), float(q[1]), float(q[2]), reps)
    for _ in range(warmup):
        fn()
    ts = _cpu_call_ms(fn, max(1, reps))
    return Timing(*_quantiles(ts), len(ts))


def _quantiles(ts: list[float]) -> tuple[float, float, float]:
    if len(ts) == 1:
        return ts[0], ts[0], ts[0]
    qs = statistics.quantiles(ts, n=10, method="inclusive")  # deciles: qs[1] = p20, qs[7] = p80
    return qs[1], statistics.median(ts), qs[7]


@dataclass(frozen=True)
class Interleaved:
    """One variant's latency from ``measure_interleaved``, in ms: the median over rounds of each round's median
    (``ms``), p20 and p80; and each round's median."""

    ms: float
    round_ms: tuple[float, ...]
    p20: float
    p80: float


DEFAULT_ROUNDS = 5  # interleaved rounds of kittenmoe bench and tune's finalists (at least, see measure_rounds)


def interleaved_order(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order ``measure_interleaved`` times ``names`` in: round r starts at name r mod n, so over n rounds
    (and any multiple of n) each variant is timed once in every slot, first after a pause as often as last
    after the others' load. (Each variant still follows the same neighbour within a round.)"""
    n = len(names)
    return [[names[(r + j) % n] for j in range(n)] for r in range(rounds)]


def measure_interleaved(fns: Mapping[str, Callable[[], object]], device: torch.device, rounds: int = DEFAULT_ROUNDS,
                        rep_ms: float = 50.0, warmup_ms: float = 25.0, calls: int = 1,
                        errors: dict[str, str] | None = None) -> dict[str, Interleaved]:
    """Latency in ms of each of ``fns``, timed in ``rounds`` interleaved rounds.

    Why: under sustained load an H200 holds its 700 W power cap by lowering the SM clock from 1,980 MHz to
    1,400-1,750 (nvidia-smi's sw_power_cap reason, 2026-12-01: the Kimi forward megakernel went 3.02 -> 3.36 ms
    over 30 calls). Timing variant A to the end and then variant B gives whichever runs later a slower GPU, a
    bias as large as the 2-5% differences between knobs. Here every round times each variant for ``rep_ms``
    (``do_bench``'s p20 / p50 / p80 on CUDA, after ``warmup_ms``), in the rotated order of
    ``interleaved_order``, and each figure is the median over rounds. On CPU a round is ``calls`` timed
    ``time.perf_counter`` calls (tests; no clock to wait out). Every callable should have run once (compiled).

    A callable that raises propagates, unless ``errors`` is a dict: then the variant is dropped from this and
    later rounds, ``errors[name]`` says why, and the result has no entry for it (the others' rounds go on)."""
    if rounds < 1 or calls < 1 or not fns:
        raise ValueError(f"measure_interleaved needs rounds >= 1, calls >= 1 and at least one callable "
                         f"(rounds={rounds}, calls={calls}, {len(fns)} callables)")
    per: dict[str, list[tuple[float, float, float]]] = {name: [] for name in fns}
    for order in interleaved_order(list(fns), rounds):
        for name in order:
            if name not in per:  # failed in an earlier round
                continue
            fn = fns[name]
            try:
                if device.type == "cuda":
                    import triton

                    q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
                    per[name].append((float(q[0]), float(q[1]), float(q[2])))
                else:
                    per[name].append(_quantiles(_cpu_call_ms(fn, calls)))
            except Exception as exc:  # dropped and reported to the caller, who asked for that; else it propagates
                if errors is None:
                    raise
                errors[name] = f"{type(exc).__name__}: {exc}"
                del per[name]
    out = {}
    for name, qs in per.items():
        p20, p50, p80 = (statistics.median(q[j] for q in qs) for j in range(3))
        out[name] = Interleaved(p50, tuple(q[1] for q in qs), p20, p80)
    return out


def _round_count(rounds: int, reps: int, n: int) -> int:
    """The rounds of ``measure_rounds`` / ``measure_ranks_rounds``: ``rounds`` (``reps`` when fewer, at least 1)
    rounded up to a multiple of the ``n`` callables, so each takes every slot of ``interleaved_order`` equally
    often."""
    n = max(1, n)
    return -(-max(1, min(rounds, reps)) // n) * n


def measure_rounds(fns: Mapping[str, Callable[[], object]], device: torch.device, reps: int, warmup: int,
                   rounds: int = DEFAULT_ROUNDS, errors: dict[str, str] | None = None) -> dict[str, Timing]:
    """Several callables timed together in interleaved rounds (``measure_interleaved``) on about ``measure``'s
    budget each; every callable has already run once (compiled). The rounds are at least ``rounds`` and a
    multiple of the callables' count, so each takes every slot equally often (with fewer ``reps`` than
    ``rounds``, ``reps`` rounded up to that multiple). On CUDA each round gives every callable ``reps / rounds``
    times the slowest one's single-call time (a faster callable gets more runs) and a ``warmup`` share
    likewise; on CPU there are ``warmup`` warm-up calls, then each round ``max(1, reps // rounds)`` timed calls.
    ``Timing.runs`` is the number of timed runs asked for (on CPU: those made). ``errors``: as
    ``measure_interleaved``'s."""
    rounds = _round_count(rounds, reps, len(fns))
    if device.type == "cuda":
        est = max(_one_call_ms(fn, device) for fn in fns.values())
        timed = measure_interleaved(fns, device, rounds, rep_ms=max(1.0, reps * est / rounds),
                                    warmup_ms=max(1.0, warmup * est / rounds), errors=errors)
        runs = reps
    else:
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        calls = max(1, reps // rounds)
        timed = measure_interleaved(fns, device, rounds, calls=calls, errors=errors)
        runs = rounds * calls
    return {name: Timing(t.p20, t.ms, t.p80, runs) for name, t in timed.items()}


# ----------------------------------------------------------------------------- runner


class Runner:
    """Inputs of one problem on one device, the timed callables, and their correctness checks."""

    def __init__(self, problem: Problem, device: torch.device, seed: int = 0) -> None:
        from kittenmoe.peers import LocalPeers
        from kittenmoe.testing import make_weights

        self.problem, self.device = problem, device
        p, dt = problem, problem.torch_dtype
        R, (T, H, _, E, K) = p.ranks, p.dims
        g = torch.Generator().manual_seed(seed)
        self.w = make_weights(p.shape, dtype=dt, device=device, generator=g)
        self.xs = [torch.randn(T, H, generator=g).to(device, dt) for _ in range(R)]
        routes = [p.routing.generate(T, E, K, g, device) for _ in range(R)]
        self.ids = [r[0].contiguous() for r in routes]
        self.ws = [r[1].float().contiguous() for r in routes]
        self.d_out = [torch.randn(T, H, generator=g).to(device, dt) for _ in range(R)]
        self.peers = LocalPeers(R, device)
        # --fp8: all experts quantised once, outside the timed calls (quantize_weights times it apart)
        self.fp8 = None if p.fp8_block is None else self.quantize_weights(check_finite=True)
        self._ref_fwd: list[torch.Tensor] | None = None
        self._ref_grads: dict | None = None

    def quantize_weights(self, check_finite: bool = False):
        """The routed experts in e4m3 with their transposes (``FP8ExpertWeights.quantize``), as a layer
        re-quantises them every step (without the finite check, a host sync)."""
        from kittenmoe.fp8 import FP8ExpertWeights

        return FP8ExpertWeights.quantize(self.w.w13_E2IH, self.w.w2_EHI, self.problem.fp8_config(), check_finite)

    # megakernel ------------------------------------------------------------
    def _margs(self):
        w = self.w
        return (self.xs, self.ids, self.ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                self.problem.shape.swiglu_limit)

    def kittenmoe(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        from kittenmoe.ops import megakernel_backward_multirank, megakernel_forward_multirank

        a, fp8 = self._margs(), self.fp8
        if mode == "forward":
            return lambda: megakernel_forward_multirank(*a, config=config, peers=self.peers, fp8=fp8)

        def fwd_bwd():
            # as autograd runs them: the forward keeps its activations for the backward (keep_activations)
            f = megakernel_forward_multirank(*a, config=config, peers=self.peers,
                                             save_for_backward=config.keep_activations, fp8=fp8)
            b = megakernel_backward_multirank(self.d_out, *a, config=config, peers=self.peers, saved=f.saved(),
                                              fp8=fp8)
            return f, b

        return fwd_bwd

    # baseline --------------------------------------------------------------
    def grouped_mm(self, mode: str) -> Callable[[], object]:
        from kittenmoe.baselines import grouped_mm_forward

        w, lim, R = self.w, self.problem.shape.swiglu_limit, self.problem.ranks
        if mode == "forward":
            return lambda: [grouped_mm_forward(self.xs[r], self.ids[r], self.ws[r], w.w13_E2IH, w.w2_EHI,
                                               w.shared_w13_2SH, w.shared_w2_HS, lim) for r in range(R)]
        wl = [t.detach().requires_grad_() for t in w.tensors()]
        xl = [x.detach().requires_grad_() for x in self.xs]
        sl = [v.detach().requires_grad_() for v in self.ws]
        sw13, sw2 = (wl[2], wl[3]) if len(wl) == 4 else (None, None)

        def fwd_bwd():
            outs = []
            for r in range(R):
                out = grouped_mm_forward(xl[r], self.ids[r], sl[r], wl[0], wl[1], sw13, sw2, lim)
                outs.append((out.detach(), torch.autograd.grad(out, [xl[r], sl[r]] + wl, self.d_out[r])))
            return outs

        return fwd_bwd

    # checks ----------------------------------------------------------------
    def reference_forward(self) -> list[torch.Tensor]:
        from kittenmoe.reference import moe_reference_multirank

        if self._ref_fwd is None:
            with torch.no_grad():
                self._ref_fwd = moe_reference_multirank(*self._margs(), compute_dtype=torch.float32)
        return self._ref_fwd

    def reference_grads(self) -> dict:
        """fp32 reference gradients: d_x and d_topk_weights per rank, then the (summed) weight gradients."""
        from kittenmoe.reference import moe_reference_multirank

        if self._ref_grads is None:
            R = self.problem.ranks
            xl = [x.float().requires_grad_() for x in self.xs]
            sl = [v.float().requires_grad_() for v in self.ws]
            wl = [t.float().requires_grad_() for t in self.w.tensors()]
            outs = moe_reference_multirank(xl, self.ids, sl, *wl, *([None] * (4 - len(wl))),
                                           self.problem.shape.swiglu_limit, compute_dtype=torch.float32)
            grads = torch.autograd.grad(outs, xl + sl + wl, [g.float() for g in self.d_out])
            names = ["d_w13", "d_w2", "d_shared_w13", "d_shared_w2"][:len(wl)]
            self._ref_grads = dict(d_x=list(grads[:R]), d_topk_weights=list(grads[R:2 * R]),
                                   **dict(zip(names, grads[2 * R:])))
            if self._ref_fwd is None:
                self._ref_fwd = [o.detach() for o in outs]
        return self._ref_grads

    def check_kittenmoe(self, mode: str, result) -> dict:
        """Device error flags, then the worst relative L1 of every output (and gradient) vs the fp32 reference."""
        from kittenmoe.testing import rel_l1

        fwd = result if mode == "forward" else result[0]
        fwd.check_errors()
        errs = {}
        if mode != "forward":
            bwd = result[1]
            bwd.check_errors()
            ref = self.reference_grads()
            for r in range(self.problem.ranks):
                errs[f"d_x[{r}]"] = rel_l1(bwd.d_x[r], ref["d_x"][r])
                errs[f"d_topk_weights[{r}]"] = rel_l1(bwd.d_topk_weights[r], ref["d_topk_weights"][r])
            for name in ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2"):
                if name in ref:
                    errs[name] = rel_l1(getattr(bwd, name), ref[name])
        ref_out = self.reference_forward()
        for r in range(self.problem.ranks):
            errs[f"out[{r}]"] = rel_l1(fwd.outputs[r], ref_out[r])
        return errs

    def check_grouped_mm(self, mode: str, result) -> float:
        from kittenmoe.testing import rel_l1

        ref = self.reference_forward()
        outs = result if mode == "forward" else [o for o, _ in result]
        return max(rel_l1(o, r) for o, r in zip(outs, ref))

    def tolerance(self) -> float:
        return rel_l1_bar(self.problem, self.device)


def rel_l1_bar(problem: Problem, device: torch.device) -> float:
    """Relative-L1 bar (``kittenmoe.testing.tolerance_for``): FP8 experts fp8's; else bf16 1e-2; fp32 3e-3 on a
    GPU (tensor cores round to tf32), 1e-5 interpreted."""
    from kittenmoe.testing import tolerance_for

    if problem.fp8_block is not None:
        return tolerance_for("fp8").rel_l1
    if problem.dtype == "bf16":
        return tolerance_for("bf16").rel_l1
    return tolerance_for("tf32" if device.type == "cuda" else "fp32").rel_l1


def flops(problem: Problem, mode: str) -> tuple[float, float]:
    """(routed, effective) FLOPs of one timed call: every rank's tokens; fwd+bwd counts 3x the forward."""
    t, h, i, _, k = problem.dims
    mult = 1 if mode == "forward" else 3
    routed = 6 * problem.ranks * t * k * h * i * mult
    total = 6 * problem.ranks * t * h * (k * i + problem.shared_width) * mult
    return routed, total


# ----------------------------------------------------------------------------- one problem


def config_for_problem(problem: Problem, device: torch.device, overrides: dict) -> tuple[KernelConfig, str]:
    """The config the layer would use (tuned cache, else the heuristic) with ``--config`` overrides on top.

    FP8: a gate|up tile must hold whole scale blocks, so ``block_n`` becomes max(128, scale block), as
    ``MoELayer`` does, unless ``--config`` sets it (then it must be a multiple of the scale block)."""
    from kittenmoe.tune import config_for

    t, h, i, e, k = problem.dims
    cfg, source = config_for(t, h, i, e, k, problem.ranks, device, problem.torch_dtype, s=problem.shared_width)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
        source += " + --config overrides"
    b = problem.fp8_block
    if b is not None:
        tile_n = problem.fp8_config().tile_block_n
        if "block_n" in overrides:
            if cfg.block_n % b:
                raise ValueError(f"bad --config block_n={cfg.block_n} with --fp8 {b}: block_n must be a multiple of "
                                 f"the scale block {b} (each gate|up tile holds whole scale blocks); leave it out "
                                 f"for {tile_n}")
        elif cfg.block_n != tile_n:
            cfg = cfg.with_overrides(block_n=tile_n)
            source += f" + block_n {cfg.block_n} for --fp8 {b}"
    return cfg, source


def bench_problem(problem: Problem, config: KernelConfig, modes: list[str], device: torch.device, reps: int,
                  warmup: int, seed: int = 0, log: Callable[[str], None] = print) -> list[dict]:
    """Time kittenmoe and grouped_mm for each mode; one row dict per mode (without environment stamps)."""
    run = Runner(problem, device, seed)
    tol = run.tolerance()
    ms_quant = None
    if run.fp8 is not None:  # once per problem: what re-quantising the expert weights adds to a training step
        ms_quant = measure(run.quantize_weights, device, min(reps, FP8_QUANT_REPS), min(warmup, 2)).p50
    rows = []
    for mode in modes:
        k_fn, b_fn = run.kittenmoe(mode, config), run.grouped_mm(mode)
        t0 = time.perf_counter()
        errs = run.check_kittenmoe(mode, k_fn())  # first run: compile, error flags, accuracy
        first_s = time.perf_counter() - t0
        worst = max(errs.values())
        if not worst <= tol:
            log(f"WARNING: {problem.label} {KIND[mode]}: relative L1 {worst:.2e} vs the fp32 reference exceeds "
                f"{tol:.0e}")
        base_err = run.check_grouped_mm(mode, b_fn())
        timed = measure_rounds({"kittenmoe": k_fn, "grouped_mm": b_fn}, device, reps, warmup)
        tk, tb = timed["kittenmoe"], timed["grouped_mm"]
        routed, total = flops(problem, mode)
        t, h, i, e, k = problem.dims
        rows.append(dict(
            kind=KIND[mode], shape=problem.label, tokens=t, h=h, i=i, e=e, k=k, s=problem.shared_width,
            experts_local=problem.experts_local, ep_slice=problem.ep, ranks=problem.ranks, ranks_mode="virtual",
            dtype=problem.dtype, precision=problem.precision, baseline_precision=problem.dtype,
            ms_fp8_weight_quantisation=ms_quant, routing=str(problem.routing),
            ms_kittenmoe=tk.p50, ms_kittenmoe_p20=tk.p20, ms_kittenmoe_p80=tk.p80,
            ms_grouped_mm=tb.p50, ms_grouped_mm_p20=tb.p20, ms_grouped_mm_p80=tb.p80,
            # the provider-neutral names every row has (under torchrun the baseline is not grouped_mm)
            baseline="grouped_mm", ms_baseline=tb.p50, ms_baseline_p20=tb.p20, ms_baseline_p80=tb.p80,
            speedup=tb.p50 / tk.p50, routed_tflops=routed / tk.p50 / 1e9, effective_tflops=total / tk.p50 / 1e9,
            baseline_routed_tflops=routed / tb.p50 / 1e9,
            rel_l1=worst, rel_l1_tolerance=tol, rel_l1_ok=bool(worst <= tol), rel_l1_per_tensor=errs,
            baseline_rel_l1=base_err, first_call_s=first_s, reps=reps, warmup=warmup,
            timing="interleaved with the baseline in rounds (kittenmoe.bench.measure_rounds)",
            config=dataclasses.asdict(config),
        ))
    del run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- torchrun: one process per rank

SHARE_GPU_ENV = "KITTENMOE_EP_SHARE_GPU"
# --ep-baseline -> the function the rows name as their baseline
EP_BASELINES = {"all-to-all": "all_to_all_forward", "distributed": "moe_forward_distributed"}
DEFAULT_EP_BASELINE = "all-to-all"
# The fp32 reference (moe_forward_distributed) runs one GEMM per local expert over its rows (torch_backend.
# expert_rows; it no longer copies weights per row tile), so block_m only sets its padding: the routed buffers
# are R*T*K + L*(block_m - 1) rows and each expert's rows are padded to a multiple of it (the padding rows are
# zero: they change no result beyond fp32 GEMM rounding). Kept at 128, the value the per-tile copies needed.
REFERENCE_BLOCK_M = 128
L2_FLUSH_BYTES = 256 << 20  # what triton.testing.do_bench zeroes before each run (the virtual-rank timings)


@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process bench: one EP rank."""

    world_size: int
    rank: int
    local_rank: int | None  # torchrun's LOCAL_RANK; None in a group the caller made (its current device is used)
    share_gpu: bool  # KITTENMOE_EP_SHARE_GPU=1: every rank on cuda:0, gloo group
    owns_group: bool  # bench initialises (and at the end destroys) the process group itself

    @property
    def where(self) -> str:
        return "WORLD_SIZE, from torchrun" if self.owns_group else "the process group the caller initialised"


def share_gpu_requested(environ=None) -> bool:
    """``KITTENMOE_EP_SHARE_GPU``: ``1`` every rank on cuda:0; ``0`` or unset one GPU per rank; else an error."""
    environ = os.environ if environ is None else environ
    v = environ.get(SHARE_GPU_ENV, "").strip()
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ValueError(f"{SHARE_GPU_ENV}={v!r}: expected 1 (every rank on cuda:0, gloo group) or 0 / unset "
                     f"(one GPU per rank, NCCL group)")


def _env_int(environ, name: str, world: str | None) -> int:
    v = environ.get(name)
    if v is None:
        raise ValueError(f"{name} is not set but WORLD_SIZE={world} is: launch the ranks with torchrun "
                         f"(torchrun --nproc-per-node R -m kittenmoe.cli bench ...), which sets WORLD_SIZE, RANK "
                         f"and LOCAL_RANK")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer (torchrun sets it to one)") from None


def detect_launch(environ=None) -> Launch | None:
    """This process's rank when it is one of several: a process group already initialised (by the caller), or
    torchrun's ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` in ``environ`` (default ``os.environ``); else None
    (one process, virtual ranks)."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    if dist.is_available() and dist.is_initialized():
        return Launch(dist.get_world_size(), dist.get_rank(), None, share_gpu_requested(environ), owns_group=False)
    if "WORLD_SIZE" not in environ:
        return None
    raw = environ["WORLD_SIZE"]
    world = _env_int(environ, "WORLD_SIZE", raw)
    rank = _env_int(environ, "RANK", raw)
    local = _env_int(environ, "LOCAL_RANK", raw)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"WORLD_SIZE={world}, RANK={rank}, LOCAL_RANK={local}: need WORLD_SIZE >= 1, "
                         f"0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    if not dist.is_available():
        raise ValueError(f"WORLD_SIZE={world} (torchrun), but this torch build has no torch.distributed")
    return Launch(world, rank, local, share_gpu_requested(environ), owns_group=True)


def check_world(ranks: int | None, launch: Launch) -> int:
    """The number of EP ranks under torchrun: the world size; ``--ranks``, if given, must say the same."""
    if ranks is not None and ranks != launch.world_size:
        raise ValueError(f"--ranks {ranks} disagrees with world size {launch.world_size} ({launch.where}): "
                         f"under torchrun every process is one EP rank; leave --ranks out or pass "
                         f"--ranks {launch.world_size}")
    return launch.world_size


def resolve_ep_device(device: str | None, launch: Launch) -> torch.device:
    """This rank's GPU: cuda:LOCAL_RANK, cuda:0 when ranks share it, the current one in the caller's group.

    CUDA only: ``SymmetricPeers`` has no CPU form, and a CPU run is no stand-in for an EP measurement."""
    why = ("under torchrun each process is one EP rank over kittenmoe.SymmetricPeers, which needs CUDA "
           "(torch symmetric memory has no CPU backend); for virtual ranks on CPU run without torchrun "
           "(--ranks R, TRITON_INTERPRET=1)")
    dev = None
    if device:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"--device {device!r} is not a device; under torchrun give cuda or leave it out") \
                from None
        if dev.type != "cuda":
            raise ValueError(f"--device {device}: {why}")
    if not torch.cuda.is_available():
        raise ValueError(f"CUDA is not available here: {why}")
    if launch.local_rank is None:
        want, source = torch.cuda.current_device(), "the current CUDA device of the caller's process group"
    elif launch.share_gpu:
        want, source = 0, f"{SHARE_GPU_ENV}=1 puts every rank on cuda:0"
    else:
        want, source = launch.local_rank, f"LOCAL_RANK={launch.local_rank}"
        n = torch.cuda.device_count()
        if want >= n:
            raise ValueError(f"LOCAL_RANK={want}, but this machine has {n} CUDA device(s): one GPU per rank needs "
                             f"--nproc-per-node <= {n}; set {SHARE_GPU_ENV}=1 to run every rank on cuda:0")
    if dev is not None and dev.index is not None and dev.index != want:
        raise ValueError(f"--device {device}: rank {launch.rank} runs on cuda:{want} ({source}); leave --device "
                         f"out or pass cuda")
    return torch.device("cuda", want)


def init_world(launch: Launch, device: torch.device):
    """``(group, backend, peers)`` for this rank: the process group (made here when bench owns it) and
    ``SymmetricPeers`` over it. Collective."""
    import torch.distributed as dist

    from kittenmoe.peers import SymmetricPeers

    if launch.share_gpu:  # symmetric memory refuses two ranks on one GPU unless told before the first allocation
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(device)
    if launch.owns_group:
        # NCCL refuses two ranks on one GPU; symmetric memory only uses the group's store and rank numbering,
        # and gloo moves the baseline's CUDA tensors through the host (slow, but it runs)
        dist.init_process_group("gloo" if launch.share_gpu else "nccl")
    group = dist.group.WORLD
    return group, str(dist.get_backend(group)), SymmetricPeers(group)


def _stream_seed(seed: int, stream: int, rank: int) -> int:
    """One generator seed per (--seed, what is drawn, rank), so that no two streams coincide."""
    return (((seed * 3 + stream) << 24) + rank) & ((1 << 63) - 1)


def _scaled_randn(size: tuple[int, ...], fan_in: int, g: torch.Generator, device, dtype) -> torch.Tensor:
    """std 1/sqrt(fan_in), as ``kittenmoe.testing.make_weights`` scales weights (outputs stay O(1))."""
    return (torch.randn(size, generator=g, device=device) / fan_in ** 0.5).to(dtype)


def _gather_or_raise(group, what: str, fn: Callable[[], object]) -> list:
    """``fn()`` on every rank, its results in rank order on every rank; if it raised anywhere, every rank
    raises (so that no rank waits in a later collective for one that has stopped). Collective."""
    import torch.distributed as dist

    err, value = None, None
    try:
        value = fn()
    except Exception as e:  # re-raised below, once every rank has heard of it
        err = e
    got = [None] * dist.get_world_size(group)
    mine = (None if err is None else f"{type(err).__name__}: {err}", value)
    try:
        dist.all_gather_object(got, mine, group=group)
    except Exception as gather_err:
        if err is None:
            raise
        raise err from gather_err
    if err is not None:
        raise err
    failed = {r: m for r, (m, _) in enumerate(got) if m is not None}
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)}: "
                           + "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
    return [v for _, v in got]


def agree_config(group, config: KernelConfig) -> None:
    """Every rank must run the same KernelConfig (the tune cache is per machine); raise on every rank if not."""
    cfgs = _gather_or_raise(group, "reading the config", lambda: dataclasses.asdict(config))
    if any(c != cfgs[0] for c in cfgs):
        raise ValueError(f"the ranks chose different KernelConfigs (a tune cache that differs between machines? "
                         f"pass --config or KITTENMOE_AUTOTUNE=0), in rank order: {cfgs}")


def _barrier(group, device: torch.device) -> None:
    """Host-visible barrier: this rank's queued work has finished and every rank has arrived."""
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)  # an all-reduce every rank must join: works on gloo and NCCL alike
    torch.cuda.synchronize(device)


def measure_ranks(fn: Callable[[], object], device: torch.device, group, reps: int, warmup: int) -> Timing:
    """Latency quantiles in ms of a collective ``fn``, each iteration's time being the slowest rank's.

    Every iteration starts after an L2 flush and a barrier (so no rank's time includes waiting for a peer
    still busy with the previous one) and is timed with CUDA events; the per-iteration times are max-reduced
    across ranks once at the end. Collective."""
    import torch.distributed as dist

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    for _ in range(warmup):
        fn()
    begin = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        _barrier(group, device)
        begin[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize(device)
    ms = torch.tensor([b.elapsed_time(e) for b, e in zip(begin, end)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return Timing(*_quantiles(ms.tolist()), reps)


def measure_ranks_rounds(fns: Mapping[str, Callable[[], object]], device: torch.device, group, reps: int,
                         warmup: int, rounds: int = DEFAULT_ROUNDS) -> dict[str, Timing]:
    """``measure_ranks`` for several collective callables, timed together in interleaved rounds (as
    ``measure_rounds``: at least ``rounds``, or ``reps`` when fewer, rounded up to a multiple of the callables'
    count; ``interleaved_order``), each round ``max(1, reps // rounds)`` iterations of each, ``warmup`` warm-up
    calls of each in the first round only; p20 / p50 / p80 are the medians over rounds of each round's (every
    iteration the slowest rank's). Collective: every rank passes the same names in the same order."""
    rounds = _round_count(rounds, reps, len(fns))
    per_round = max(1, reps // rounds)
    per: dict[str, list[Timing]] = {name: [] for name in fns}
    for r, order in enumerate(interleaved_order(list(fns), rounds)):
        for name in order:
            per[name].append(measure_ranks(fns[name], device, group, per_round, warmup if r == 0 else 0))
    return {name: Timing(statistics.median(t.p20 for t in ts), statistics.median(t.p50 for t in ts),
                         statistics.median(t.p80 for t in ts), rounds * per_round) for name, ts in per.items()}


class EPRunner:
    """One rank's inputs of a problem under torchrun, the timed callables and their checks.

    Each rank makes only what it holds (the whole model may not fit one process): its E_local experts from its
    own generator stream on the GPU, the replicated shared expert from a stream every rank shares, its T tokens,
    routes over all E experts and output gradient from its own."""

    def __init__(self, problem: Problem, device: torch.device, peers, group, seed: int = 0) -> None:
        self.problem, self.device, self.peers, self.group = problem, device, peers, group
        dt, rank = problem.torch_dtype, peers.rank
        T, H, I, E, K = problem.dims
        L, S = problem.experts_local, problem.shared_width
        g_experts = torch.Generator(device=device).manual_seed(_stream_seed(seed, 0, rank))
        g_shared = torch.Generator(device=device).manual_seed(_stream_seed(seed, 1, 0))
        g_tokens = torch.Generator().manual_seed(_stream_seed(seed, 2, rank))
        self.w13 = _scaled_randn((L, 2 * I, H), H, g_experts, device, dt)
        self.w2 = _scaled_randn((L, H, I), I, g_experts, device, dt)
        self.sw13 = _scaled_randn((2 * S, H), H, g_shared, device, dt) if S else None
        self.sw2 = _scaled_randn((H, S), S, g_shared, device, dt) if S else None
        self.x = torch.randn(T, H, generator=g_tokens).to(device, dt)
        ids, w = problem.routing.generate(T, E, K, g_tokens, device)
        self.ids, self.w = ids.contiguous(), w.float().contiguous()
        self.d_out = torch.randn(T, H, generator=g_tokens).to(device, dt)
        # --fp8: this rank's experts quantised once, outside the timed calls (quantize_weights times it apart)
        self.fp8 = None if problem.fp8_block is None else self.quantize_weights(check_finite=True)
        self._ref: dict | None = None

    def quantize_weights(self, check_finite: bool = False):
        """This rank's experts in e4m3 with their transposes (``FP8ExpertWeights.quantize``), as a layer
        re-quantises them every step (without the finite check, a host sync). Local: no collective."""
        from kittenmoe.fp8 import FP8ExpertWeights

        return FP8ExpertWeights.quantize(self.w13, self.w2, self.problem.fp8_config(), check_finite)

    def _weights(self) -> list[torch.Tensor | None]:
        return [self.w13, self.w2, self.sw13, self.sw2]

    # kittenmoe -------------------------------------------------------------
    def kittenmoe(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        from kittenmoe.ep import megakernel_backward_ep, megakernel_forward_ep

        a, fp8 = (self.x, self.ids, self.w, *self._weights(), self.problem.shape.swiglu_limit), self.fp8
        if mode == "forward":
            return lambda: megakernel_forward_ep(*a, peers=self.peers, config=config, fp8=fp8)

        def fwd_bwd():
            f = megakernel_forward_ep(*a, peers=self.peers, config=config, fp8=fp8)
            b = megakernel_backward_ep(self.d_out, *a, peers=self.peers, config=config, fp8=fp8)
            return f, b

        return fwd_bwd

    # baseline --------------------------------------------------------------
    def baseline(self, mode: str, name: str, config: KernelConfig, checked: bool) -> Callable[[], object]:
        """``--ep-baseline`` ``name``; ``checked``: compare every rank's inputs first (a host all-gather that
        all_to_all_forward can leave out of its timed calls; moe_forward_distributed always does it)."""
        from kittenmoe.baselines import all_to_all_forward
        from kittenmoe.distributed import moe_forward_distributed

        lim, group = self.problem.shape.swiglu_limit, self.group
        if name == "all-to-all":
            def fn(x, w, ws):
                return all_to_all_forward(x, self.ids, w, *ws, lim, group, check_ranks=checked)
        else:  # the torch backend's semantic model, tiled like the megakernel
            def fn(x, w, ws):
                return moe_forward_distributed(x, self.ids, w, *ws, lim, group, block_m=config.block_m)
        if mode == "forward":
            return lambda: fn(self.x, self.w, self._weights())
        wl = [None if t is None else t.detach().requires_grad_() for t in self._weights()]
        xl, sl = self.x.detach().requires_grad_(), self.w.detach().requires_grad_()
        leaves = [xl, sl] + [t for t in wl if t is not None]

        def fwd_bwd():
            out = fn(xl, sl, wl)
            return out.detach(), torch.autograd.grad(out, leaves, self.d_out)

        return fwd_bwd

    # checks ----------------------------------------------------------------
    def reference(self, grads: bool) -> dict:
        """This rank's output (and with ``grads`` its gradients) from the fp32 semantic model run across the
        same processes: ``moe_forward_distributed`` on fp32 copies of the same values. Collective."""
        from kittenmoe.distributed import moe_forward_distributed

        if self._ref is not None and (not grads or "d_x" in self._ref):
            return self._ref

        def f32(t):
            return None if t is None else t.detach().float().requires_grad_(grads)

        x, w, ws = f32(self.x), f32(self.w), [f32(t) for t in self._weights()]
        with torch.set_grad_enabled(grads):
            out = moe_forward_distributed(x, self.ids, w, *ws, self.problem.shape.swiglu_limit, self.group,
                                          block_m=REFERENCE_BLOCK_M)
        ref = {"out": out.detach()}
        if grads:
            named = [(n, t) for n, t in zip(("d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13",
                                             "d_shared_w2"), [x, w, *ws]) if t is not None]
            gs = torch.autograd.grad(out, [t for _, t in named], self.d_out.float())
            ref.update({n: g for (n, _), g in zip(named, gs)})
        self._ref = ref
        return ref

    def check_kittenmoe(self, mode: str, result) -> dict:
        """This rank's device error flags, then the relative L1 of its output (and gradients) vs the reference;
        keys carry the rank (``d_w13[r]``: rank r's experts; ``d_shared_w13[r]``: rank r's tokens' share)."""
        from kittenmoe.testing import rel_l1

        r, ref = self.peers.rank, self._ref
        fwd = result if mode == "forward" else result[0]
        fwd.check_errors()
        errs = {f"out[{r}]": rel_l1(fwd.output, ref["out"])}
        if mode != "forward":
            bwd = result[1]
            bwd.check_errors()
            for name in ("d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2"):
                if name in ref:
                    errs[f"{name}[{r}]"] = rel_l1(getattr(bwd, name), ref[name])
        return errs

    def check_baseline(self, mode: str, result) -> float:
        from kittenmoe.testing import rel_l1

        return rel_l1(result if mode == "forward" else result[0], self._ref["out"])


def bench_problem_ep(problem: Problem, config: KernelConfig, modes: list[str], device: torch.device, peers,
                     group, baseline: str, reps: int, warmup: int, seed: int = 0,
                     log: Callable[[str], None] = print) -> list[dict]:
    """Time kittenmoe.ep and the EP baseline for each mode, every rank one process; the same rows on every
    rank (errors gathered from all of them). Collective."""
    run = EPRunner(problem, device, peers, group, seed)
    rows = _bench_modes_ep(run, config, modes, baseline, reps, warmup, log)
    del run  # the inputs and the callables holding them go before empty_cache
    torch.cuda.empty_cache()
    return rows


def _bench_modes_ep(run: EPRunner, config: KernelConfig, modes: list[str], baseline: str, reps: int, warmup: int,
                    log: Callable[[str], None]) -> list[dict]:
    """The rows of ``bench_problem_ep``: per mode, reference, first call and check, then the timings."""
    problem, device, group = run.problem, run.device, run.group
    tol = rel_l1_bar(problem, device)
    run.reference(grads="backward" in modes)  # before any kittenmoe call: collective, so every rank gets here
    ms_quant = None
    if run.fp8 is not None:  # once per problem, each rank its own experts; the slowest rank's p50
        ms_quant = max(_gather_or_raise(group, "timing the FP8 weight quantisation", lambda: measure(
            run.quantize_weights, device, min(reps, FP8_QUANT_REPS), min(warmup, 2)).p50))
    rows = []
    for mode in modes:
        k_fn = run.kittenmoe(mode, config)

        def first_kittenmoe():
            t0 = time.perf_counter()
            errs = run.check_kittenmoe(mode, k_fn())  # first run: compile, error flags, accuracy
            return errs, time.perf_counter() - t0

        got = _gather_or_raise(group, f"kittenmoe.ep {KIND[mode]} (first call and check)", first_kittenmoe)
        errs = {k: v for e, _ in got for k, v in e.items()}
        first_s = max(s for _, s in got)
        worst = max(errs.values())
        if not worst <= tol:
            log(f"WARNING: {problem.label} {KIND[mode]}: relative L1 {worst:.2e} vs the fp32 reference exceeds "
                f"{tol:.0e}")
        b_first = run.baseline(mode, baseline, config, checked=True)
        base_err = max(_gather_or_raise(group, f"the {EP_BASELINES[baseline]} baseline (first call and check)",
                                        lambda: run.check_baseline(mode, b_first())))
        # both timed together in interleaved rounds: the GPUs' clocks fall under sustained load (power caps)
        timed = measure_ranks_rounds({"kittenmoe": k_fn,
                                      "baseline": run.baseline(mode, baseline, config, checked=False)},
                                     device, group, reps, warmup)
        tk, tb = timed["kittenmoe"], timed["baseline"]
        routed, total = flops(problem, mode)
        t, h, i, e, k = problem.dims
        rows.append(dict(
            kind=KIND[mode], shape=problem.label, tokens=t, h=h, i=i, e=e, k=k, s=problem.shared_width,
            experts_local=problem.experts_local, ep_slice=problem.ep, ranks=problem.ranks, ranks_mode="processes",
            dtype=problem.dtype, precision=problem.precision, baseline_precision=problem.dtype,
            ms_fp8_weight_quantisation=ms_quant, routing=str(problem.routing),
            ms_kittenmoe=tk.p50, ms_kittenmoe_p20=tk.p20, ms_kittenmoe_p80=tk.p80,
            baseline=EP_BASELINES[baseline], ms_baseline=tb.p50, ms_baseline_p20=tb.p20, ms_baseline_p80=tb.p80,
            speedup=tb.p50 / tk.p50, routed_tflops=routed / tk.p50 / 1e9, effective_tflops=total / tk.p50 / 1e9,
            baseline_routed_tflops=routed / tb.p50 / 1e9,
            rel_l1=worst, rel_l1_tolerance=tol, rel_l1_ok=bool(worst <= tol), rel_l1_per_tensor=errs,
            baseline_rel_l1=base_err, first_call_s=first_s, reps=reps, warmup=warmup,
            timing="interleaved with the baseline in rounds (kittenmoe.bench.measure_ranks_rounds)",
            config=dataclasses.asdict(config),
        ))
    return rows


# ----------------------------------------------------------------------------- output


def format_table(rows: list[dict]) -> str:
    """One line per row; R is suffixed ``p`` when the ranks were processes (torchrun), not virtual; precision is
    kittenmoe's (the baseline's is the dtype: BF16 beside an FP8 kittenmoe)."""
    head = (f"{'pass':<17}{'shape':<20}{'T':>6}{'R':>4}{'E_loc':>6}{'routing':>10}{'precision':>13}"
            f"{'kmoe ms p50 [p20-p80]':>32}{'baseline':>25}{'base ms':>9}{'x':>8}{'routed TF/s':>12}"
            f"{'base TF/s':>10}{'rel L1':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rng = f"{r['ms_kittenmoe']:.3f} [{r['ms_kittenmoe_p20']:.3f}-{r['ms_kittenmoe_p80']:.3f}]"
        flag = "" if r.get("rel_l1_ok", True) else " !"
        ranks = f"{r['ranks']}{'p' if r.get('ranks_mode') == 'processes' else ''}"
        prec = r.get("precision", r["dtype"])
        lines.append(f"{r['kind']:<17}{r['shape']:<20}{r['tokens']:>6}{ranks:>4}{r['experts_local']:>6}"
                     f"{r['routing']:>10}{prec:>13}{rng:>32}{r['baseline']:>25}{r['ms_baseline']:>9.3f}"
                     f"{r['speedup']:>7.2f}x{r['routed_tflops']:>12.4g}{r['baseline_routed_tflops']:>10.4g}"
                     f"{r['rel_l1']:>9.1e}{flag}")
    return "\n".join(lines)


def unique_path(out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    n = 1
    while path.exists():
        path = out_dir / f"{stem}-{n}.json"
        n += 1
    return path


def write_json(obj, out_dir: str | os.PathLike, stem: str) -> Path:
    path = unique_path(Path(out_dir), stem)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def plot_rows(rows: list[dict], path: str, log: Callable[[str], None] = print) -> bool:
    """Bar chart of p50 latency (p20-p80 whiskers) and routed TFLOP/s per problem and provider."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"plot skipped: matplotlib is not installed (pip install matplotlib), so {path} was not written")
        return False
    labels = [f"{r['kind']}\n{r['shape']}\nT={r['tokens']} R={r['ranks']}"
              f"{'p' if r.get('ranks_mode') == 'processes' else ''} {r['routing']}" for r in rows]
    labels = [lab + ("\n" + r["precision"] if r.get("precision", "").startswith("fp8") else "")
              for lab, r in zip(labels, rows)]
    xs = list(range(len(rows)))
    width = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8.0, 2.6 * len(rows) + 4), 4.8))
    base_name = "/".join(sorted({r["baseline"] for r in rows}))
    for off, prov, label, color in ((-width / 2, "kittenmoe", "kittenmoe", "tab:orange"),
                                    (width / 2, "baseline", base_name, "tab:blue")):
        p50 = [r[f"ms_{prov}"] for r in rows]
        lo = [r[f"ms_{prov}"] - r[f"ms_{prov}_p20"] for r in rows]
        hi = [r[f"ms_{prov}_p80"] - r[f"ms_{prov}"] for r in rows]
        ax1.bar([x + off for x in xs], p50, width, yerr=[lo, hi], capsize=3, label=label, color=color)
        tf = [r["routed_tflops"] if prov == "kittenmoe" else r["baseline_routed_tflops"] for r in rows]
        ax2.bar([x + off for x in xs], tf, width, label=label, color=color)
    for ax, title in ((ax1, "latency, ms (p50, whiskers p20-p80)"), (ax2, "routed TFLOP/s")):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    env = rows[0]
    fig.suptitle(f"kittenmoe bench on {env.get('gpu', '?')} ({env.get('device', '?')}), torch {env.get('torch')}, "
                 f"triton {env.get('triton')}, {env.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot: {path}")
    return True


# ----------------------------------------------------------------------------- CLI


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """Shape, precision and routing arguments shared by ``bench`` and ``tune``."""
    g = p.add_argument_group("problem")
    g.add_argument("--model", help=f"registered shape(s), comma-separated: {', '.join(sorted(SHAPES))}; "
                   f"sliced to one EP rank (E_local = E / --ep)")
    g.add_argument("--shape", help="explicit T,H,I,E,K (tokens per rank, hidden, expert width, experts, top-k)")
    g.add_argument("--ep", type=int, default=None,
                   help=f"EP degree the experts are split over (default {DEFAULT_EP_MODEL} with --model, "
                   f"1 with --shape)")
    g.add_argument("--tokens", type=int, default=None, help="tokens per rank with --model (default 2048)")
    # default None, not 1: under torchrun an explicit --ranks must equal the world size, an absent one may not
    g.add_argument("--ranks", type=int, default=None,
                   help="virtual EP ranks on one device (LocalPeers), each holding E/ep experts (default 1); "
                   "bench under torchrun: every process is one rank and --ranks, if given, must equal the "
                   "world size")
    g.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    g.add_argument("--routing", default="uniform", help="uniform | zipf[:alpha] (default alpha 1.2) | one-hot")
    g.add_argument("--config", default="", help="KernelConfig overrides k=v,..., e.g. minibatch_size=1024,block_m=64")
    g.add_argument("--device", default=None, help="cuda[:N] (default when available) or cpu (TRITON_INTERPRET=1 only)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 100; 3 on CPU)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up runs before timing (default 10; 0 on CPU)")


def resolve_reps(args, device: torch.device) -> tuple[int, int]:
    reps = args.reps if args.reps is not None else (100 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (10 if device.type == "cuda" else 0)
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    return reps, warmup


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_problem_args(p)
    p.add_argument("--mode", default="forward", choices=MODES,
                   help="forward, backward (forward + backward together) or both (default forward)")
    p.add_argument("--fp8", type=int, default=None, choices=FP8_BLOCKS, metavar="{128,32}",
                   help="run kittenmoe's routed experts in FP8 e4m3 with this scale block (128: 1x128 / 128x128 "
                   "scales; 32: MXFP8, power-of-two scales) against the same BF16 baseline; needs --dtype bf16 "
                   "and H, I multiples of the block (default: no FP8)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON rows (default %(default)s)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="also draw a PNG (needs matplotlib)")
    p.add_argument("--ep-baseline", default=None, choices=tuple(EP_BASELINES),
                   help="under torchrun: the NCCL + PyTorch baseline, all-to-all (baselines.all_to_all_forward, "
                   "grouped_mm experts; the default) or distributed (distributed.moe_forward_distributed, the "
                   "torch backend's semantic model)")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    """``kittenmoe bench``; returns the exit status (1 if a result failed its accuracy check).

    Under torchrun (or in a process group the caller made) this process is one rank: ``run_bench_ranks``."""
    launch = detect_launch()
    if launch is not None:
        return run_bench_ranks(args, launch, argv, log)
    if args.ep_baseline is not None:
        raise ValueError(f"--ep-baseline {args.ep_baseline} applies under torchrun (one process per rank); this "
                         f"run has virtual ranks in one process, timed against grouped_mm")
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, args.ranks, args.dtype, args.routing,
                             args.fp8)
    overrides = parse_config_overrides(args.config)
    if args.plot is not None and not str(args.plot).lower().endswith(".png"):
        raise ValueError(f"--plot must name a .png file, got {args.plot!r}")
    device = resolve_device(args.device)
    configs = [config_for_problem(prob, device, overrides) for prob in problems]  # (before anything is printed)
    if share_gpu_requested():
        log(f"note: {SHARE_GPU_ENV}=1 applies under torchrun only; this run has virtual ranks in one process")
    reps, warmup = resolve_reps(args, device)
    modes = ["forward", "backward"] if args.mode == "both" else [args.mode]
    env = environment(device)
    stamp = dict(**env, date=now_iso(), command=command_line(argv))
    log(f"kittenmoe bench on {env['gpu']} ({env['device']}), torch {env['torch']}, triton {env['triton']}")
    if env["device"] == "cpu-interpreter":
        log("note: CPU under the Triton interpreter: these times test the tool, they are not GPU figures")
    skipped = skipped_baselines(log)
    rows = []
    for prob, (cfg, source) in zip(problems, configs):
        log(f"{prob.describe()}\n  config ({source}): {cfg}")
        for row in bench_problem(prob, cfg, modes, device, reps, warmup, args.seed, log):
            row.update(stamp, config_source=source, skipped_baselines=skipped)
            rows.append(row)
    return _finish(rows, args, log)


def _finish(rows: list[dict], args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """Table, JSON rows, plot; the exit status (1 if a result failed its accuracy check)."""
    log("")
    log(format_table(rows))
    day = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = write_json(rows, args.out, f"bench-{day}")
    log(f"rows: {path}")
    if args.plot:
        plot_rows(rows, args.plot, log)
    return _status(rows, log)


def _status(rows: list[dict], log: Callable[[str], None]) -> int:
    bad = [r for r in rows if not r["rel_l1_ok"]]
    if bad:
        log(f"FAIL: {len(bad)} result(s) above the accuracy bar (marked !)")
        return 1
    return 0


def run_bench_ranks(args: argparse.Namespace, launch: Launch, argv: list[str] | None = None,
                    log: Callable[[str], None] = print) -> int:
    """``kittenmoe bench`` as one rank of ``launch``: every rank times, rank 0 prints and writes the rows.

    The arguments are checked before the process group exists (every rank raises the same ValueError);
    every rank returns the same exit status."""
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, check_world(args.ranks, launch),
                             args.dtype, args.routing, args.fp8)
    overrides = parse_config_overrides(args.config)
    if args.plot is not None and not str(args.plot).lower().endswith(".png"):
        raise ValueError(f"--plot must name a .png file, got {args.plot!r}")
    device = resolve_ep_device(args.device, launch)
    reps, warmup = resolve_reps(args, device)
    baseline = args.ep_baseline or DEFAULT_EP_BASELINE
    modes = ["forward", "backward"] if args.mode == "both" else [args.mode]
    say = log if launch.rank == 0 else (lambda _line: None)
    group, backend, peers = init_world(launch, device)
    configs = [config_for_problem(prob, device, overrides) for prob in problems]  # (on this rank's GPU, set there)
    env = environment(device)
    stamp = dict(**env, date=now_iso(), command=command_line(argv), process_group=backend,
                 share_gpu=launch.share_gpu)
    say(f"kittenmoe bench on {env['gpu']} ({env['device']}), torch {env['torch']}, triton {env['triton']}: "
        f"{launch.world_size} processes, one EP rank each ({backend} group"
        f"{', every rank on cuda:0' if launch.share_gpu else ', one GPU per rank'}), baseline "
        f"{EP_BASELINES[baseline]}")
    if launch.share_gpu:
        say("note: the ranks share one GPU: these times test the tool, they are not EP figures")
    skipped = skipped_baselines(say, processes=True)
    rows = []
    for prob, (cfg, source) in zip(problems, configs):
        agree_config(group, cfg)
        say(f"{prob.describe()} as {launch.world_size} processes\n  config ({source}): {cfg}")
        for row in bench_problem_ep(prob, cfg, modes, device, peers, group, baseline, reps, warmup, args.seed,
                                    say):
            row.update(stamp, config_source=source, skipped_baselines=skipped)
            rows.append(row)
    # Clean up on success only: after an error on one rank a collective here would wait for it.
    peers.destroy()
    if launch.owns_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    if launch.rank != 0:
        return _status(rows, say)
    return _finish(rows, args, log)

