"""``kittenmoe bench``: time the megakernel layer against the PyTorch grouped_mm baseline, same run.

    kittenmoe bench --model kimi-k2.7 --ep 8 --tokens 2048 --mode both
    kittenmoe bench --shape 4096,7168,2048,48,8 --routing zipf:1.2 --ranks 2 --plot bench.png

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
``kittenmoe.reference``); then ``triton.testing.do_bench`` (CUDA events, L2
flushed between runs) asked for about ``--warmup`` warm-up and ``--reps``
timed runs, reporting p20 / p50 / p80. Schedule construction, the routing
all-gather and the epilogue are inside the timed call. ``backward`` times the
forward and the backward megakernels together against grouped_mm forward +
autograd backward.

On CPU the megakernel runs only under the Triton interpreter
(``TRITON_INTERPRET=1``); this is for tests: times are ``time.perf_counter``
medians of a few runs and rows carry ``"device": "cpu-interpreter"`` and
``"gpu": "cpu"`` so nobody mistakes them for GPU figures.

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
from typing import Callable

import torch

from kittenmoe.config import SHAPES, KernelConfig, ModelShape, get_shape

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("forward", "backward", "both")
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
    """``base`` with ``overrides``; KernelConfig's own validation gives the error for a bad value."""
    try:
        return base.with_(**overrides)
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
                f"S={self.shared_width} {self.dtype} routing={self.routing}")


def make_problems(model: str | None, shape: str | None, ep: int | None, tokens: int | None, ranks: int,
                  dtype: str, routing: str) -> list[Problem]:
    """Validate the shape arguments (clear ``ValueError`` on any mistake) and build the problems.

    ``model`` may name several registered shapes, comma-separated.
    """
    if (model is None) == (shape is None):
        raise ValueError("give exactly one of --model NAME or --shape T,H,I,E,K")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks}")
    if ep is not None and ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be a positive integer, got {tokens}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
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
        out.append(Problem(label, base.with_(e=e_total), t, ranks, ep, local, dtype, spec))
    return out


# ----------------------------------------------------------------------------- environment


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def skipped_baselines(log: Callable[[str], None] = print) -> list[str]:
    """One line per optional baseline: skipped because not importable, or not run in one process."""
    notes = []
    for mod in OPTIONAL_BASELINES:
        if importlib.util.find_spec(mod) is None:
            notes.append(f"skipped: {mod} not importable")
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


def measure(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> Timing:
    """Latency quantiles of ``fn`` in ms (p20, p50, p80); ``fn`` has already run once (compiled)."""
    if device.type == "cuda":
        import triton

        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        est = max((time.perf_counter() - t0) * 1e3, 1e-3)
        q = triton.testing.do_bench(fn, warmup=max(1.0, warmup * est), rep=max(1.0, reps * est),
                                    quantiles=list(QUANTILES))
        return Timing(float(q[0]), float(q[1]), float(q[2]), reps)
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return Timing(*_quantiles(ts), len(ts))


def _quantiles(ts: list[float]) -> tuple[float, float, float]:
    if len(ts) == 1:
        return ts[0], ts[0], ts[0]
    qs = statistics.quantiles(ts, n=10, method="inclusive")  # deciles: qs[1] = p20, qs[7] = p80
    return qs[1], statistics.median(ts), qs[7]


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
        self._ref_fwd: list[torch.Tensor] | None = None
        self._ref_grads: dict | None = None

    # megakernel ------------------------------------------------------------
    def _margs(self):
        w = self.w
        return (self.xs, self.ids, self.ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                self.problem.shape.swiglu_limit)

    def kittenmoe(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        from kittenmoe.ops import megakernel_backward_multirank, megakernel_forward_multirank

        a = self._margs()
        if mode == "forward":
            return lambda: megakernel_forward_multirank(*a, config=config, peers=self.peers)

        def fwd_bwd():
            f = megakernel_forward_multirank(*a, config=config, peers=self.peers)
            b = megakernel_backward_multirank(self.d_out, *a, config=config, peers=self.peers)
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
        """Relative-L1 bar: bf16 1e-2; fp32 3e-3 on a GPU (tensor cores round to tf32), 1e-5 interpreted."""
        from kittenmoe.testing import tolerance_for

        if self.problem.dtype == "bf16":
            return tolerance_for("bf16").rel_l1
        return tolerance_for("tf32" if self.device.type == "cuda" else "fp32").rel_l1


def flops(problem: Problem, mode: str) -> tuple[float, float]:
    """(routed, effective) FLOPs of one timed call: every rank's tokens; fwd+bwd counts 3x the forward."""
    t, h, i, _, k = problem.dims
    mult = 1 if mode == "forward" else 3
    routed = 6 * problem.ranks * t * k * h * i * mult
    total = 6 * problem.ranks * t * h * (k * i + problem.shared_width) * mult
    return routed, total


# ----------------------------------------------------------------------------- one problem


def config_for_problem(problem: Problem, device: torch.device, overrides: dict) -> tuple[KernelConfig, str]:
    """The config the layer would use (tuned cache, else the heuristic) with ``--config`` overrides on top."""
    from kittenmoe.tune import config_for

    t, h, i, e, k = problem.dims
    cfg, source = config_for(t, h, i, e, k, problem.ranks, device, problem.torch_dtype, s=problem.shared_width)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
        source += " + --config overrides"
    return cfg, source


def bench_problem(problem: Problem, config: KernelConfig, modes: list[str], device: torch.device, reps: int,
                  warmup: int, seed: int = 0, log: Callable[[str], None] = print) -> list[dict]:
    """Time kittenmoe and grouped_mm for each mode; one row dict per mode (without environment stamps)."""
    run = Runner(problem, device, seed)
    tol = run.tolerance()
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
        tk = measure(k_fn, device, reps, warmup)
        base_err = run.check_grouped_mm(mode, b_fn())
        tb = measure(b_fn, device, reps, warmup)
        routed, total = flops(problem, mode)
        t, h, i, e, k = problem.dims
        rows.append(dict(
            kind=KIND[mode], shape=problem.label, tokens=t, h=h, i=i, e=e, k=k, s=problem.shared_width,
            experts_local=problem.experts_local, ep_slice=problem.ep, ranks=problem.ranks, dtype=problem.dtype,
            routing=str(problem.routing),
            ms_kittenmoe=tk.p50, ms_kittenmoe_p20=tk.p20, ms_kittenmoe_p80=tk.p80,
            ms_grouped_mm=tb.p50, ms_grouped_mm_p20=tb.p20, ms_grouped_mm_p80=tb.p80,
            speedup=tb.p50 / tk.p50, routed_tflops=routed / tk.p50 / 1e9, effective_tflops=total / tk.p50 / 1e9,
            baseline_routed_tflops=routed / tb.p50 / 1e9,
            rel_l1=worst, rel_l1_tolerance=tol, rel_l1_ok=bool(worst <= tol), rel_l1_per_tensor=errs,
            baseline_rel_l1=base_err, first_call_s=first_s, reps=reps, warmup=warmup,
            config=dataclasses.asdict(config),
        ))
    del run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- output


def format_table(rows: list[dict]) -> str:
    head = (f"{'pass':<17}{'shape':<20}{'T':>6}{'R':>3}{'E_loc':>6}{'routing':>10}{'dtype':>6}"
            f"{'kmoe ms p50 [p20-p80]':>32}{'grouped_mm ms':>15}{'x':>8}{'routed TF/s':>12}{'base TF/s':>10}"
            f"{'rel L1':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rng = f"{r['ms_kittenmoe']:.3f} [{r['ms_kittenmoe_p20']:.3f}-{r['ms_kittenmoe_p80']:.3f}]"
        flag = "" if r.get("rel_l1_ok", True) else " !"
        lines.append(f"{r['kind']:<17}{r['shape']:<20}{r['tokens']:>6}{r['ranks']:>3}{r['experts_local']:>6}"
                     f"{r['routing']:>10}{r['dtype']:>6}{rng:>32}{r['ms_grouped_mm']:>15.3f}{r['speedup']:>7.2f}x"
                     f"{r['routed_tflops']:>12.4g}{r['baseline_routed_tflops']:>10.4g}{r['rel_l1']:>9.1e}{flag}")
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
    labels = [f"{r['kind']}\n{r['shape']}\nT={r['tokens']} R={r['ranks']} {r['routing']}" for r in rows]
    xs = list(range(len(rows)))
    width = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8.0, 2.6 * len(rows) + 4), 4.8))
    for off, prov, color in ((-width / 2, "kittenmoe", "tab:orange"), (width / 2, "grouped_mm", "tab:blue")):
        p50 = [r[f"ms_{prov}"] for r in rows]
        lo = [r[f"ms_{prov}"] - r[f"ms_{prov}_p20"] for r in rows]
        hi = [r[f"ms_{prov}_p80"] - r[f"ms_{prov}"] for r in rows]
        ax1.bar([x + off for x in xs], p50, width, yerr=[lo, hi], capsize=3, label=prov, color=color)
        tf = [r["routed_tflops"] if prov == "kittenmoe" else r["baseline_routed_tflops"] for r in rows]
        ax2.bar([x + off for x in xs], tf, width, label=prov, color=color)
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
    g.add_argument("--ranks", type=int, default=1,
                   help="virtual EP ranks on one device (LocalPeers), each holding E/ep experts (default 1)")
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
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON rows (default %(default)s)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="also draw a PNG (needs matplotlib)")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    """``kittenmoe bench``; returns the exit status (1 if a result failed its accuracy check)."""
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, args.ranks, args.dtype, args.routing)
    overrides = parse_config_overrides(args.config)
    if args.plot is not None and not str(args.plot).lower().endswith(".png"):
        raise ValueError(f"--plot must name a .png file, got {args.plot!r}")
    device = resolve_device(args.device)
    reps, warmup = resolve_reps(args, device)
    modes = ["forward", "backward"] if args.mode == "both" else [args.mode]
    env = environment(device)
    stamp = dict(**env, date=now_iso(), command=command_line(argv))
    log(f"kittenmoe bench on {env['gpu']} ({env['device']}), torch {env['torch']}, triton {env['triton']}")
    if env["device"] == "cpu-interpreter":
        log("note: CPU under the Triton interpreter: these times test the tool, they are not GPU figures")
    skipped = skipped_baselines(log)
    rows = []
    for prob in problems:
        cfg, source = config_for_problem(prob, device, overrides)
        log(f"{prob.describe()}\n  config ({source}): {cfg}")
        for row in bench_problem(prob, cfg, modes, device, reps, warmup, args.seed, log):
            row.update(stamp, config_source=source, skipped_baselines=skipped)
            rows.append(row)
    log("")
    log(format_table(rows))
    day = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = write_json(rows, args.out, f"bench-{day}")
    log(f"rows: {path}")
    if args.plot:
        plot_rows(rows, args.plot, log)
    bad = [r for r in rows if not r["rel_l1_ok"]]
    if bad:
        log(f"FAIL: {len(bad)} result(s) above the accuracy bar (marked !)")
        return 1
    return 0
