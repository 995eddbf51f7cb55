"""Results of ``kittenmoe bench``: one row dict per problem and mode, the terminal table, the JSON file of rows
(the fields ``scripts/perf_table.py`` reads plus more) and an optional PNG plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kittenmoe.bench.problems import KIND, Problem, flops
from kittenmoe.bench.timing import Timing
from kittenmoe.config import KernelConfig

PATHS = ("public", "launcher")  # what the kittenmoe side of a row timed (the rows' "path")


@dataclass(frozen=True)
class BaselineResult:
    """One baseline timed besides grouped_mm (``--baseline``), for one row: its timing and relative L1 per
    tensor against the fp32 reference of the same math, or ``note``, why it has none (skipped, failed)."""

    name: str
    timing: Timing | None = None
    errs: dict[str, float] | None = None
    note: str | None = None  # None when timed; else "skipped: ..." or "failed: ..."
    first_call_s: float | None = None
    same_work: bool = False  # kittenmoe's timed call computes the same as this baseline's


def make_row(problem: Problem, mode: str, *, path: str, timed_call: str, ranks_mode: str, kittenmoe: Timing,
             baseline: str, baseline_timing: Timing, errs: dict[str, float], tolerance: float, baseline_rel_l1: float,
             first_call_s: float, reps: int, warmup: int, ms_fp8_weight_quantisation: float | None,
             config: KernelConfig, timing: str, extra_baselines: tuple[BaselineResult, ...] = ()) -> dict:
    """One result row (without the environment stamps ``run_bench`` adds). ``path``: ``"public"`` (the
    autograd entry point users call) or ``"launcher"``; ``errs``: relative L1 of each output and gradient vs
    the fp32 reference; ``baseline``: the baseline function's name (``grouped_mm`` rows also carry the
    ``ms_grouped_mm*`` fields older readers know).

    ``extra_baselines`` (``--baseline``), each NAME adds ``ms_NAME`` (p50; ``_p20``, ``_p80``),
    ``speedup_vs_NAME`` (its p50 over kittenmoe's), ``NAME_routed_tflops``, ``rel_l1_NAME`` (worst tensor;
    ``rel_l1_NAME_per_tensor``), ``NAME_first_call_s``, ``NAME_same_work`` and ``NAME_note``; all but the note
    and same_work are None when it was not timed. ``baselines`` lists every baseline of the row, primary first."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    tk, tb = kittenmoe, baseline_timing
    routed, total = flops(problem, mode)
    t, h, i, e, k = problem.dims
    worst = max(errs.values())
    row = dict(
        kind=KIND[mode], path=path, timed_call=timed_call, shape=problem.label, tokens=t, h=h, i=i, e=e, k=k,
        s=problem.shared_width, experts_local=problem.experts_local, ep_slice=problem.ep, ranks=problem.ranks,
        ranks_mode=ranks_mode, dtype=problem.dtype, precision=problem.precision, baseline_precision=problem.dtype,
        ms_fp8_weight_quantisation=ms_fp8_weight_quantisation, routing=str(problem.routing),
        ms_kittenmoe=tk.p50, ms_kittenmoe_p20=tk.p20, ms_kittenmoe_p80=tk.p80)
    if baseline == "grouped_mm":
        row.update(ms_grouped_mm=tb.p50, ms_grouped_mm_p20=tb.p20, ms_grouped_mm_p80=tb.p80)
    row.update(
        # the provider-neutral names every row has (under torchrun the baseline is not grouped_mm)
        baseline=baseline, ms_baseline=tb.p50, ms_baseline_p20=tb.p20, ms_baseline_p80=tb.p80,
        speedup=tb.p50 / tk.p50, routed_tflops=routed / tk.p50 / 1e9, effective_tflops=total / tk.p50 / 1e9,
        baseline_routed_tflops=routed / tb.p50 / 1e9,
        rel_l1=worst, rel_l1_tolerance=tolerance, rel_l1_ok=bool(worst <= tolerance), rel_l1_per_tensor=errs,
        baseline_rel_l1=baseline_rel_l1, first_call_s=first_call_s, reps=reps, warmup=warmup, timing=timing,
        config=dataclasses.asdict(config), baselines=[baseline] + [b.name for b in extra_baselines])
    for b in extra_baselines:
        t = b.timing
        row.update({
            f"ms_{b.name}": None if t is None else t.p50,
            f"ms_{b.name}_p20": None if t is None else t.p20,
            f"ms_{b.name}_p80": None if t is None else t.p80,
            f"speedup_vs_{b.name}": None if t is None else t.p50 / tk.p50,
            f"{b.name}_routed_tflops": None if t is None else routed / t.p50 / 1e9,
            f"rel_l1_{b.name}": None if not b.errs else max(b.errs.values()),
            f"rel_l1_{b.name}_per_tensor": b.errs,
            f"{b.name}_first_call_s": b.first_call_s,
            f"{b.name}_same_work": b.same_work,
            f"{b.name}_note": b.note,
        })
    return row


def format_table(rows: list[dict]) -> str:
    """One line per row; R is suffixed ``p`` when the ranks were processes (torchrun), not virtual; precision is
    kittenmoe's (the baseline's is the dtype: BF16 beside an FP8 kittenmoe); path is what kittenmoe's time
    covers (public: the autograd entry point; launcher: the launchers)."""
    extras = list(dict.fromkeys(name for r in rows for name in r.get("baselines", [])[1:]))
    head = (f"{'pass':<17}{'path':<9}{'shape':<20}{'T':>6}{'R':>4}{'E_loc':>6}{'routing':>10}{'precision':>13}"
            f"{'kmoe ms p50 [p20-p80]':>32}{'baseline':>25}{'base ms':>9}{'x':>8}{'routed TF/s':>12}"
            f"{'base TF/s':>10}{'rel L1':>9}")
    head += "".join(f"{name[:11] + ' ms':>15}{'x':>8}{'rel L1':>9}" for name in extras)
    lines = [head, "-" * len(head)]
    for r in rows:
        rng = f"{r['ms_kittenmoe']:.3f} [{r['ms_kittenmoe_p20']:.3f}-{r['ms_kittenmoe_p80']:.3f}]"
        flag = "" if r.get("rel_l1_ok", True) else " !"
        ranks = f"{r['ranks']}{'p' if r.get('ranks_mode') == 'processes' else ''}"
        prec = r.get("precision", r["dtype"])
        lines.append(f"{r['kind']:<17}{r.get('path', '-'):<9}{r['shape']:<20}{r['tokens']:>6}{ranks:>4}"
                     f"{r['experts_local']:>6}{r['routing']:>10}{prec:>13}{rng:>32}{r['baseline']:>25}"
                     f"{r['ms_baseline']:>9.3f}{r['speedup']:>7.2f}x{r['routed_tflops']:>12.4g}"
                     f"{r['baseline_routed_tflops']:>10.4g}{r['rel_l1']:>9.1e}{flag}"
                     + "".join(_extra_cells(r, name) for name in extras))
    # why an extra baseline has no figures, each distinct reason once
    notes = dict.fromkeys(f"{name}: {r[f'{name}_note']}" for r in rows for name in extras if r.get(f"{name}_note"))
    return "\n".join(lines + list(notes))


def _extra_cells(row: dict, name: str) -> str:
    """One extra baseline's table cells: ms p50, kittenmoe's speedup over it, its relative L1; ``skipped`` or
    ``failed`` (the note, below the table, says why) when it was not timed."""
    ms = row.get(f"ms_{name}")
    if ms is None:
        note = row.get(f"{name}_note") or "-"
        return f"{note.split(':', 1)[0]:>15}{'-':>8}{'-':>9}"
    err = row.get(f"rel_l1_{name}")
    return f"{ms:>15.3f}{row[f'speedup_vs_{name}']:>7.2f}x{'-' if err is None else f'{err:.1e}':>9}"


def unique_path(out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    n = 1
    while path.exists():
        path = out_dir / f"{stem}-{n}.json"
        n += 1
    return path


def write_json(obj, out_dir: str | os.PathLike, stem: str) -> Path:
    """``obj`` as ``<out_dir>/<stem>.json`` (``-1``, ``-2``, ... when taken), written atomically."""
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
    paths = "/".join(sorted({r.get("path", "?") for r in rows}))
    for off, prov, label, color in ((-width / 2, "kittenmoe", f"kittenmoe ({paths})", "tab:orange"),
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


def status(rows: list[dict], log: Callable[[str], None]) -> int:
    """The exit status: 1 (and a line saying why) if a result failed its accuracy check, else 0."""
    bad = [r for r in rows if not r["rel_l1_ok"]]
    if bad:
        log(f"FAIL: {len(bad)} result(s) above the accuracy bar (marked !)")
        return 1
    return 0


def finish(rows: list[dict], out_dir: str | os.PathLike, plot: str | None, log: Callable[[str], None]) -> int:
    """Table, JSON rows (``bench-<date>.json`` in ``out_dir``), plot; the exit status (``status``)."""
    log("")
    log(format_table(rows))
    day = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = write_json(rows, out_dir, f"bench-{day}")
    log(f"rows: {path}")
    if plot:
        plot_rows(rows, plot, log)
    return status(rows, log)
