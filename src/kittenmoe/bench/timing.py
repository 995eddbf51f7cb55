"""Latency measurement: one callable (``measure``), several interleaved in rounds (``measure_rounds``,
``measure_interleaved``), and collective callables across torchrun ranks (``measure_ranks``,
``measure_ranks_rounds``: each iteration the slowest rank's).

On CUDA the figures are ``triton.testing.do_bench`` quantiles (CUDA events, L2 flushed between runs); on CPU
(the Triton interpreter, for tests) ``time.perf_counter`` quantiles of a few calls. Every callable has run once
(compiled) before it is timed.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

QUANTILES = (0.2, 0.5, 0.8)
DEFAULT_ROUNDS = 5  # interleaved rounds of kittenmoe bench and tune's finalists (at least, see measure_rounds)
L2_FLUSH_BYTES = 256 << 20  # what triton.testing.do_bench zeroes before each run (measure_ranks does the same)


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


def _quantiles(ts: list[float]) -> tuple[float, float, float]:
    if len(ts) == 1:
        return ts[0], ts[0], ts[0]
    qs = statistics.quantiles(ts, n=10, method="inclusive")  # deciles: qs[1] = p20, qs[7] = p80
    return qs[1], statistics.median(ts), qs[7]


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


@dataclass(frozen=True)
class Interleaved:
    """One variant's latency from ``measure_interleaved``, in ms: the median over rounds of each round's median
    (``ms``), p20 and p80; and each round's median."""

    ms: float
    round_ms: tuple[float, ...]
    p20: float
    p80: float


def sync_warnings(fn: Callable[[], object]) -> list[warnings.WarningMessage]:
    """The warnings of the host-device syncs torch reports in one call of ``fn`` (``.item()``, a copy to the host,
    ``nonzero`` ...; ``torch.cuda.set_sync_debug_mode("warn")``, the previous mode restored after). Each such
    sync serialises the host with the GPU, so a call's host time adds to its GPU time."""
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    return [w for w in caught if "synchroniz" in str(w.message).lower()]


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
    1,400-1,750 (nvidia-smi's sw_power_cap reason; the Kimi forward megakernel went 3.02 -> 3.36 ms over 30
    calls). Timing variant A to the end and then variant B gives whichever runs later a slower GPU, a bias as
    large as the 2-5% differences between knobs. Here every round times each variant for ``rep_ms``
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


# ----------------------------------------------------------------------------- across torchrun ranks


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
