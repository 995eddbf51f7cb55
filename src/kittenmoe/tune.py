"""``kittenmoe tune``: sweep the megakernel's knobs for one problem and cache the fastest config on disk.

    kittenmoe tune --model kimi-k2.7 --ep 8 --tokens 2048

The grid (``DEFAULT_GRID``; ``--grid`` replaces any part of it) is
``num_comm_programs_fwd`` x ``minibatch_size`` x ``macrobatch_size`` x
(``block_n``, ``num_stages``) on top of a base config (the heuristic
``kittenmoe.config.default_config`` for the problem, plus ``--config``
overrides). Configs that cannot fit or would repeat another are pruned before
anything compiles:

- invalid ``KernelConfig`` (e.g. a macrobatch that is not a multiple of the
  minibatch);
- a minibatch above the routed capacity (``routed_capacity(R, T, K, E_local,
  block_m)`` rounded up to ``block_m``): all such minibatches mean "one
  minibatch holds every row", so only the smallest of them is kept;
- a macrobatch at or above the whole routed buffer is "no ring" (None) and is
  dropped as a duplicate;
- shared memory of the gate|up tile over 227 KB:
  ``num_stages * (BM*BK + 2*BN*BK) * bytes`` (``config.gate_up_smem_bytes``);
- on a GPU, ``num_comm_programs_fwd`` >= the SM count (no compute program left);
- a wrapping ring under a gathering base (``combine_gather``: one rank): the
  point pushes instead (the ring's rows are overwritten before an epilogue
  could read them), with the backward's comm programs at KernelConfig's
  default where the point had none; with no forward comm programs it is pruned.

Every remaining config, and the default (the heuristic) beside them, is run
once (compile, device error flag, relative L1 against the fp32 reference:
configs that fail are reported and never win) and timed on its own
(``kittenmoe.bench.timing.measure``: ``triton.testing.do_bench`` p50 on
CUDA). A progress line with an ETA follows the sweep. The sweep times one config
after another, and a GPU's clock falls under sustained load (the H200's power
cap), so the ``TUNE_FINALISTS`` fastest, the default and the grouped_mm baseline
are then timed again together in interleaved rounds
(``kittenmoe.bench.timing.measure_rounds``); the winner is the fastest of those,
and their sweep figures stay in the record as ``ms_sweep`` (the other configs'
``ms``, the worst's among them, are their sweep figures). The winner goes to the
cache (``kittenmoe.tune_cache``: one JSON file per problem, GPU, dtype and
version, read back by ``tune_cache.config_for`` in the layer and in ``kittenmoe
bench``), and best vs default vs worst is printed; the whole sweep is written as
one JSON record to ``--out``.

The sweep times the launchers (``TUNE_PATH``, ``kittenmoe.bench.runner.Runner``):
they run every R, and the public path's autograd layer adds about the same
per-call work (input checks, the custom op's dispatch) to every config.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kittenmoe.bench.environment import command_line, environment, now_iso, resolve_device
from kittenmoe.bench.main import add_problem_args, resolve_reps
from kittenmoe.bench.problems import apply_overrides, make_problems, parse_config_overrides, parse_knob_value
from kittenmoe.bench.report import write_json
from kittenmoe.bench.runner import Runner
from kittenmoe.bench.timing import measure, measure_rounds
from kittenmoe.config import SHARED_MEMORY_LIMIT, KernelConfig, default_config, gate_up_smem_bytes, routed_capacity
from kittenmoe.tune_cache import cache_key, store_config

TUNE_FINALISTS = 3  # the sweep's fastest configs re-timed together (with the default and the baseline)
TUNE_PATH = "launcher"  # what the sweep times (see the module docstring)

# The default sweep: 4 x 3 x 2 x 3 = 72 configs before pruning. The values bracket
# what the H200 runs found best for the seed slices (docs/performance.md)
# (8-16 comm programs, or none on one rank, minibatch 2048, block_n 128, 4 stages).
# 0 comm programs is valid where the base config gathers (one rank, no ring) and is
# pruned elsewhere.
DEFAULT_GRID: dict[str, tuple] = {
    "num_comm_programs_fwd": (0, 8, 16, 24),
    "minibatch_size": (1024, 2048, 4096),
    "macrobatch_size": (None, 16384),
    "tiles": ((64, 4), (128, 3), (128, 4)),  # (block_n, num_stages)
}
# Under the interpreter (CPU tests) the GPU grid is pointless; a token one.
CPU_GRID: dict[str, tuple] = {
    "num_comm_programs_fwd": (1, 2),
    "minibatch_size": (64, 256),
    "macrobatch_size": (None,),
    "tiles": ((32, 1),),
}


# ----------------------------------------------------------------------------- grid


def parse_grid(spec: str | None, base_grid: dict[str, tuple]) -> dict[str, tuple]:
    """``--grid key=v1:v2,key=...``: replaces those axes of ``base_grid``.

    Keys: ``tiles`` with values ``BNxSTAGES`` (e.g. ``tiles=128x3:64x4``), or
    any KernelConfig field with ints / ``None`` / ``True`` / ``False``.
    """
    grid = dict(base_grid)
    if not spec:
        return grid
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"bad --grid item {item!r}: expected key=v1:v2:...")
        key, vals = (s.strip() for s in item.split("=", 1))
        parts = [v.strip() for v in vals.split(":") if v.strip()]
        if not parts:
            raise ValueError(f"bad --grid item {item!r}: no values")
        if key == "tiles":
            try:
                grid[key] = tuple(tuple(int(x) for x in p.lower().split("x")) for p in parts)
            except ValueError:
                raise ValueError(f"bad --grid tiles {vals!r}: expected BLOCK_NxSTAGES values, e.g. 128x3:64x4") \
                    from None
            if any(len(v) != 2 for v in grid[key]):
                raise ValueError(f"bad --grid tiles {vals!r}: expected BLOCK_NxSTAGES values, e.g. 128x3:64x4")
            continue
        if key not in fields:
            raise ValueError(f"bad --grid key {key!r}: expected tiles or a KernelConfig field "
                             f"({', '.join(sorted(fields))})")
        grid[key] = tuple(parse_knob_value(key, p, "--grid") for p in parts)
    return grid


@dataclass
class Candidate:
    config: KernelConfig
    tag: str = ""  # "default" for the heuristic
    ms: float | None = None
    p20: float | None = None
    p80: float | None = None
    rel_l1: float | None = None
    error: str | None = None
    ms_sweep: float | None = None  # a finalist's sweep figure; its ms is then the interleaved re-timing's


def expand_grid(grid: dict[str, tuple], base: KernelConfig, t: int, k: int, experts_local: int, ranks: int,
                elem_bytes: int, num_sms: int | None) -> tuple[list[KernelConfig], list[tuple[dict, str]]]:
    """Every grid point on top of ``base``, minus the pruned ones: (kept configs, [(point, reason)])."""
    axes = list(grid)
    kept: list[KernelConfig] = []
    seen: set[KernelConfig] = set()
    pruned: list[tuple[dict, str]] = []
    for values in itertools.product(*(grid[a] for a in axes)):
        point = dict(zip(axes, values))
        changes = {a: v for a, v in point.items() if a != "tiles"}
        if "tiles" in point:
            changes["block_n"], changes["num_stages"] = point["tiles"]
        # the point's row tile and minibatch as they merge (validated below): a ring holding every routed row
        # does not wrap, so it is no ring (None), and the one-rank gather can stay
        bm = changes.get("block_m", base.block_m)
        mb = changes.get("minibatch_size", base.minibatch_size)
        cap = routed_capacity(ranks, t, k, experts_local, bm)
        cap_r = math.ceil(cap / bm) * bm
        if mb > cap_r:
            bigger = sorted(v for v in grid.get("minibatch_size", (mb,)) if v >= cap_r)
            if bigger and mb != bigger[0]:
                pruned.append((point, f"minibatch {mb} > routed capacity {cap_r} rows (the smaller "
                                      f"{bigger[0]} already holds every row)"))
                continue
        full = math.ceil(cap / mb) * mb
        if changes.get("macrobatch_size") is not None and changes["macrobatch_size"] >= full:
            changes["macrobatch_size"] = None
        try:
            # the heuristic's derived knobs follow the point's (a wrapping ring pushes: the gather's rows would
            # be overwritten; a point that also sets no comm programs is then invalid)
            cfg = base.with_overrides(**changes)
        except (TypeError, ValueError) as exc:
            pruned.append((point, f"invalid: {exc}"))
            continue
        if cfg.macrobatch_size is not None and cfg.macrobatch_size >= full:
            cfg = cfg.with_(macrobatch_size=None)  # (the base's ring, where the point's minibatch holds every row)
        smem = gate_up_smem_bytes(cfg, elem_bytes)
        if smem > SHARED_MEMORY_LIMIT:
            pruned.append((point, f"shared memory ~{smem // 1024} KB > {SHARED_MEMORY_LIMIT // 1024} KB"))
            continue
        if num_sms is not None and max(cfg.num_comm_programs_fwd, cfg.num_comm_programs_bwd) >= num_sms:
            pruned.append((point, f"{cfg.num_comm_programs_fwd} comm programs leave no compute program "
                                  f"on {num_sms} SMs"))
            continue
        if cfg in seen:
            pruned.append((point, "same config as another point (macrobatch covers every row: no ring)"))
            continue
        seen.add(cfg)
        kept.append(cfg)
    return kept, pruned


def describe(cfg: KernelConfig) -> str:
    mac = "-" if cfg.macrobatch_size is None else str(cfg.macrobatch_size)
    return (f"comm={cfg.num_comm_programs_fwd} mb={cfg.minibatch_size} mac={mac} bm={cfg.block_m} "
            f"bn={cfg.block_n} bk={cfg.block_k} st={cfg.num_stages}")


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ----------------------------------------------------------------------------- the sweep


@dataclass
class TuneResult:
    candidates: list[Candidate]
    pruned: list[tuple[dict, str]]
    best: Candidate | None
    default: Candidate
    worst: Candidate | None
    ms_grouped_mm: float | None = None
    cache_file: Path | None = None
    record: dict = field(default_factory=dict)


def tune_problem(problem, base: KernelConfig, default: KernelConfig, grid: dict[str, tuple], mode: str,
                 device: torch.device, reps: int, warmup: int, seed: int = 0,
                 log: Callable[[str], None] = print, progress: Callable[[str, bool], None] | None = None
                 ) -> TuneResult:
    """Time ``default`` and every kept grid point on ``base``; pick the fastest correct one."""
    t, h, i, e, k = problem.dims
    elem = torch.empty((), dtype=problem.torch_dtype).element_size()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    kept, pruned = expand_grid(grid, base, t, k, problem.experts_local, problem.ranks, elem, sms)
    cands = [Candidate(default, "default")] + [Candidate(c) for c in kept if c != default]
    for c in kept:
        if c == default:
            cands[0].tag = "default (also a grid point)"
    log(f"grid: {len(kept) + len(pruned)} points, {len(pruned)} pruned, {len(cands)} configs to time "
        f"(the default included)")
    for point, why in pruned:
        log(f"  pruned {point}: {why}")
    run = Runner(problem, device, seed)
    tol = run.tolerance()
    progress = progress or _progress_printer()
    t_start = time.perf_counter()
    best_ms = math.inf
    for n, c in enumerate(cands, 1):
        try:
            fn = run.kittenmoe(mode, c.config, TUNE_PATH)
            errs = run.check_kittenmoe(mode, fn(), TUNE_PATH)
            c.rel_l1 = max(errs.values())
            if not c.rel_l1 <= tol:
                raise RuntimeError(f"relative L1 {c.rel_l1:.2e} vs the fp32 reference exceeds {tol:.0e}")
            tm = measure(fn, device, reps, warmup)
            c.ms, c.p20, c.p80 = tm.p50, tm.p20, tm.p80
            best_ms = min(best_ms, c.ms)
            what = f"{c.ms:.3f} ms"
        except Exception as exc:  # a config that fails is reported and never wins; the sweep goes on
            c.error = f"{type(exc).__name__}: {exc}"
            what = f"FAILED ({c.error.splitlines()[0][:120]})"
        elapsed = time.perf_counter() - t_start
        eta = elapsed / n * (len(cands) - n)
        best = f"best {best_ms:.3f} ms" if best_ms < math.inf else "no result yet"
        progress(f"[{n}/{len(cands)}] {describe(c.config)}{' (' + c.tag + ')' if c.tag else ''}: {what} | "
                 f"{best} | elapsed {_fmt_s(elapsed)}, ETA {_fmt_s(eta)}", n == len(cands))
    ok = [c for c in cands if c.ms is not None]
    # The sweep timed one config after another, and the GPU's clock falls under sustained load (its power cap),
    # so the fastest few, the default and the baseline are timed again together in interleaved rounds
    # (kittenmoe.bench.timing.measure_rounds); the winner is the fastest of those.
    finalists = sorted(ok, key=lambda c: c.ms)[:TUNE_FINALISTS]
    if cands[0].ms is not None and cands[0] not in finalists:
        finalists.append(cands[0])
    fns = {str(n): run.kittenmoe(mode, c.config, TUNE_PATH) for n, c in enumerate(finalists)}
    try:
        b_fn = run.grouped_mm(mode)
        b_fn()
        fns["grouped_mm"] = b_fn
    except Exception as exc:  # the baseline is context, not the point: say so and carry on
        log(f"grouped_mm baseline failed: {type(exc).__name__}: {exc}")
    ms_base = None
    errors: dict[str, str] = {}
    timed = measure_rounds(fns, device, reps, warmup, errors=errors) if fns else {}
    for n, c in enumerate(finalists):
        if str(n) in errors:  # it ran in the sweep but not here: reported, and it does not win
            c.ms_sweep, c.ms, c.error = c.ms, None, f"failed when re-timed: {errors[str(n)]}"
            log(f"  finalist {describe(c.config)}: {c.error}")
            continue
        tm = timed[str(n)]
        c.ms_sweep, c.ms, c.p20, c.p80 = c.ms, tm.p50, tm.p20, tm.p80
        log(f"  finalist {describe(c.config)}{' (' + c.tag + ')' if c.tag else ''}: {c.ms:.3f} ms "
            f"interleaved (sweep {c.ms_sweep:.3f})")
    if "grouped_mm" in timed:
        ms_base = timed["grouped_mm"].p50
    elif "grouped_mm" in errors:
        log(f"grouped_mm baseline failed when timed: {errors['grouped_mm']}")
    finalists = [c for c in finalists if c.ms is not None]
    ok = [c for c in ok if c.ms is not None]
    best_c = min(finalists, key=lambda c: c.ms) if finalists else None
    worst_c = max(ok, key=lambda c: c.ms) if ok else None  # (a finalist's figure is its re-timing's)
    del run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return TuneResult(cands, pruned, best_c, cands[0], worst_c, ms_base)


def _progress_printer() -> Callable[[str, bool], None]:
    tty = sys.stdout.isatty()
    width = [0]

    def show(line: str, last: bool) -> None:
        if tty:
            pad = max(0, width[0] - len(line))
            width[0] = len(line)
            sys.stdout.write("\r" + line + " " * pad + ("\n" if last else ""))
            sys.stdout.flush()
        else:
            print(line, flush=True)

    return show


# ----------------------------------------------------------------------------- CLI


def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_problem_args(p)
    p.add_argument("--mode", default="forward", choices=("forward", "backward"),
                   help="what is timed: forward, or backward (forward + backward together); default forward")
    p.add_argument("--grid", default="",
                   help="replace axes of the grid: key=v1:v2,... with tiles=BNxSTAGES:... or KernelConfig fields, "
                   "e.g. num_comm_programs_fwd=12:16,tiles=128x4 (default: kittenmoe.tune.DEFAULT_GRID)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory for the sweep's JSON record (default %(default)s); '' to skip")


def run_tune(args: argparse.Namespace, argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    """``kittenmoe tune``; returns the exit status (1 when no config ran correctly)."""
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, args.ranks, args.dtype, args.routing)
    if len(problems) != 1:
        raise ValueError("kittenmoe tune takes one problem: give one --model name")
    prob = problems[0]
    overrides = parse_config_overrides(args.config)
    device = resolve_device(args.device)
    grid = parse_grid(args.grid, DEFAULT_GRID if device.type == "cuda" else CPU_GRID)
    reps, warmup = resolve_reps(args, device)
    env = environment(device)
    t, h, i, e, k = prob.dims
    default = default_config(t, h, i, e, k, prob.ranks, device, prob.torch_dtype, prob.shared_width)
    base = apply_overrides(default, overrides)
    default = base  # "default" = what runs without a cache: the heuristic plus the user's overrides
    log(f"kittenmoe tune on {env['gpu']} ({env['device']}), torch {env['torch']}, triton {env['triton']}")
    log(f"{prob.describe()}, mode {args.mode}")
    log(f"default (heuristic{' + --config' if overrides else ''}): {default}")
    res = tune_problem(prob, base, default, grid, args.mode, device, reps, warmup, args.seed, log)
    key = cache_key(t, h, i, e, k, prob.ranks, env["gpu"], prob.dtype, prob.shared_width)
    date, cmd = now_iso(), command_line(argv)

    def cand_row(c: Candidate) -> dict:
        return dict(config=dataclasses.asdict(c.config), tag=c.tag, ms=c.ms, ms_p20=c.p20, ms_p80=c.p80,
                    ms_sweep=c.ms_sweep, rel_l1=c.rel_l1, error=c.error)

    record = dict(kind="tune", mode=args.mode, shape=prob.label, tokens=t, h=h, i=i, e=e, k=k,
                  s=prob.shared_width, experts_local=prob.experts_local, ep_slice=prob.ep, ranks=prob.ranks,
                  dtype=prob.dtype, routing=str(prob.routing), grid={a: list(v) for a, v in grid.items()},
                  reps=reps, warmup=warmup, key=key,
                  best=cand_row(res.best) if res.best else None, default=cand_row(res.default),
                  worst=cand_row(res.worst) if res.worst else None, ms_grouped_mm=res.ms_grouped_mm,
                  trials=[cand_row(c) for c in res.candidates],
                  pruned=[dict(point={a: (list(v) if isinstance(v, tuple) else v) for a, v in p.items()}, reason=r)
                          for p, r in res.pruned],
                  **env, date=date, command=cmd)
    log("")
    if res.best is None:
        log("FAIL: no config ran correctly; nothing cached")
        for c in res.candidates:
            log(f"  {describe(c.config)}: {c.error}")
        if args.out:
            log(f"record: {write_json(record, args.out, _stem(prob))}")
        return 1
    d = res.default
    lines = [("best", res.best), ("default", d), ("worst", res.worst)]
    for name, c in lines:
        ms = f"{c.ms:8.3f} ms" if c.ms is not None else "  failed   "
        rel = "" if c.ms is None or c is res.best else f"  (best is {c.ms / res.best.ms:.2f}x faster)"
        log(f"{name:<8}{ms}  {describe(c.config)}{rel}")
    if res.ms_grouped_mm is not None:
        log(f"{'grouped_mm':<8}{res.ms_grouped_mm:8.3f} ms  (speedup of the best config over it: "
            f"{res.ms_grouped_mm / res.best.ms:.2f}x)")
    if d.error:
        log(f"the default config failed: {d.error}")
    path = store_config(key, res.best.config, dict(
        mode=args.mode, ms=res.best.ms, default_ms=d.ms, worst_ms=res.worst.ms, ms_grouped_mm=res.ms_grouped_mm,
        routing=str(prob.routing), torch=env["torch"], triton=env["triton"], date=date, command=cmd))
    log(f"cached: {path}")
    if env["device"] == "cpu-interpreter":
        log("note: tuned under the CPU interpreter: the cache entry is keyed to device 'cpu' and means nothing "
            "for a GPU")
    if args.out:
        log(f"record: {write_json(record, args.out, _stem(prob))}")
    return 0


def _stem(prob) -> str:
    day = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"tune-{prob.label}-T{prob.tokens}-R{prob.ranks}-{prob.dtype}-{day}"
