"""One device run for the forward megakernel: build, check, time; a short table last.

    PYTHONPATH=src python3 benchmarks/fwd_round.py [--shapes kimi-k2.7,...] [--tokens 2048] [--out DIR]
    PYTHONPATH=src python3 benchmarks/fwd_round.py --shapes 32768x4096x512x128x8   # T x H x I x E x K, no shared

Checks every seed shape sliced to one EP8 rank (E_local = E/8, R=1) against
the fp32 reference (relative L1 <= 1e-2) and for bitwise determinism, then
times the megakernel forward (schedule construction and epilogue included)
and the grouped_mm baseline with the same routing, median of many runs.
Writes one JSON row per shape to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch
import triton

from kittenmoe.baselines import grouped_mm_forward
from kittenmoe.bench import measure_interleaved, parse_config_overrides, parse_problem
from kittenmoe.config import KernelConfig, SEED_SHAPES, SLICE_TOKENS, default_config
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_reference
from kittenmoe.testing import make_weights, rel_l1, routing_uniform

SLICES = SLICE_TOKENS  # kittenmoe.config: the one-GPU slices (tokens at EP8)


@dataclasses.dataclass
class ForwardSlice:
    """One EP slice's forward inputs (R = 1: E_local experts, every route lands here), seeded from 0."""

    shape: object  # the seed shape with e = E_local
    experts: int  # E_local
    tokens: int
    config: KernelConfig  # the heuristic default for the slice
    weights: object  # kittenmoe.testing.make_weights' bundle
    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, K]
    wts: torch.Tensor  # [T, K]
    peers: LocalPeers

    @property
    def args(self) -> tuple:
        """megakernel_forward_multirank's positional arguments."""
        w = self.weights
        return ([self.x], [self.ids], [self.wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                self.shape.swiglu_limit)

    def run(self, config: KernelConfig | None = None) -> torch.Tensor:
        """One megakernel forward (the slice's heuristic config unless given); its output."""
        return megakernel_forward_multirank(*self.args, config=config or self.config, peers=self.peers).outputs[0]


def forward_slice(name: str, ep: int, tokens: int, dev: torch.device) -> ForwardSlice:
    """The slice of seed shape ``name`` at EP ``ep`` with ``tokens`` (0: its SLICES count), or, for a name
    ``TxHxIxExK`` (e.g. 32768x4096x512x128x8, the fine-grained shape), that problem on one rank with no shared
    expert (``ep`` and ``tokens`` do not apply)."""
    if "x" in name:
        T, shape = parse_problem(name)
        L = shape.e
        shared = False
    else:
        base = SEED_SHAPES[name]
        L = base.e // ep
        shape = base.with_(e=L, k=base.k)
        T = tokens or SLICES[name]
        shared = True
    cfg = default_config(T, shape.h, shape.i, L, shape.k, device=dev)
    g = torch.Generator().manual_seed(0)
    w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g, shared=shared)
    x = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
    ids, wts = routing_uniform(T, L, shape.k, generator=g, device=dev)
    return ForwardSlice(shape, L, T, cfg, w, x, ids, wts, LocalPeers(1, dev))


def str_cfg(d: str) -> str:
    """The sweep's dict-string key back into ``parse_config`` syntax."""
    import ast

    return ",".join(f"{k}={v}" for k, v in ast.literal_eval(d).items())


def parse_config(s: str | None) -> KernelConfig:
    return KernelConfig(**parse_config_overrides(s))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SLICES))
    ap.add_argument("--tokens", type=int, default=0, help="override tokens per shape (0 = the shape's SLICES count)")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--config", default="", help="KernelConfig overrides on top of each shape's heuristic config "
                    "(config.default_config, what the layer runs untuned), e.g. num_comm_programs_fwd=16,block_n=128; "
                    "several separated by ';' are each timed (an empty one is the heuristic config itself)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=50, help="time budget: reps x 10 ms of timed runs a variant")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the budget is split over")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernel time table of one forward")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time subsets of the forward's phases (pull, +gate|up, +down, +push, all)")
    ap.add_argument("--trace", action="store_true",
                    help="also run the best config's traced build once and print kittenmoe.trace's summary")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    print(env, flush=True)
    rows = []
    for name in args.shapes.split(","):
        sl = forward_slice(name, args.ep, args.tokens, dev)
        shape, L, T, heur = sl.shape, sl.experts, sl.tokens, sl.config
        w, x, ids, wts, peers, args_k = sl.weights, sl.x, sl.ids, sl.wts, sl.peers, sl.args
        cfgs = [heur.with_overrides(**parse_config_overrides(c)) for c in args.config.split(";")]
        cfg = cfgs[0]
        print(f"  {name}: heuristic {heur}", flush=True)

        def run_mk():
            return sl.run(cfg)

        def run_base():
            return grouped_mm_forward(x, ids, wts, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                                      shape.swiglu_limit)

        t0 = time.time()
        res = megakernel_forward_multirank(*args_k, config=cfg, peers=peers)
        res.check_errors()
        out = res.outputs[0]
        ck = res.states[0].compiled
        if ck is not None:
            ptx = ck.asm.get("ptx", "")
            print(f"  kernel: {ck.n_regs} registers, {ck.n_spills} spills, shared {ck.metadata.shared} B, "
                  f"wgmma in PTX: {'wgmma.mma_async' in ptx}, cp.async: {'cp.async' in ptx}", flush=True)
        compile_s = time.time() - t0
        err = det = base_err = float("nan")
        if not args.skip_check:
            ref = moe_reference(x, ids, wts, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                                shape.swiglu_limit, torch.float32)
            err = rel_l1(out, ref)
            base_err = rel_l1(run_base(), ref)
            det = all(torch.equal(run_mk(), out) for _ in range(5))
            del ref
        from kittenmoe.schedule import build_schedule
        ms_sched = {impl: triton.testing.do_bench(
            lambda impl=impl: build_schedule(ids[None].to(torch.int32), 0, L, cfg.block_m, impl=impl),
            warmup=20, rep=200, return_mode="median") for impl in ("torch", "triton")}
        print(f"  schedule: torch ops {ms_sched['torch']:.3f} ms, triton {ms_sched['triton']:.3f} ms", flush=True)
        # Every config and the baseline timed together in interleaved rounds (kittenmoe.bench.measure_interleaved:
        # the GPU's clock falls under sustained load, so back-to-back timing favours whatever runs first).
        fns, shorts, sweep_errors = {}, {}, {}
        for c in cfgs:
            short = ",".join(f"{k}={v}" for k, v in c.__dict__.items() if v != getattr(heur, k)) or "heuristic"
            try:
                sl.run(c)  # compiled (and any refusal raised) before the timed rounds
            except Exception as exc:  # reported on the terminal and in the row, not hidden; the others still run
                traceback.print_exc()
                sweep_errors[short] = repr(exc)
                continue
            fns[str(c.__dict__)] = lambda c=c: sl.run(c)
            shorts[str(c.__dict__)] = short
        run_base()  # run once before the rounds (with --skip-check nothing has)
        fns["grouped_mm"] = run_base
        errors = {}  # a variant failing in the rounds is dropped and reported in the row; the others go on
        timed = measure_interleaved(fns, dev, rounds=args.rounds, rep_ms=args.reps * 10 / args.rounds,
                                    warmup_ms=20, errors=errors)
        for k, why in errors.items():
            print(f"  [{shorts.get(k, k)}] failed when timed: {why}", flush=True)
            sweep_errors[shorts.get(k, k)] = why
        if "grouped_mm" not in timed:
            raise RuntimeError(f"{name}: the grouped_mm baseline failed when timed: {errors['grouped_mm']}")
        shorts = {k: v for k, v in shorts.items() if k in timed}
        sweep = {k: timed[k].ms for k in shorts}
        round_ms = {shorts.get(k, k): list(v.round_ms) for k, v in timed.items()}
        for k, short in shorts.items():
            print(f"  [{short}]: {sweep[k]:.3f} ms (rounds {' '.join(f'{t:.3f}' for t in timed[k].round_ms)})",
                  flush=True)
        best = min(sweep, key=sweep.get)
        if args.breakdown:
            from kittenmoe.kernels import megakernel_fwd as mk

            masks = {"pull": mk.PH_PULL, "+gateup": mk.PH_PULL | mk.PH_GATEUP,
                     "+down": mk.PH_PULL | mk.PH_GATEUP | mk.PH_DOWN,
                     "+push": mk.PH_PULL | mk.PH_GATEUP | mk.PH_DOWN | mk.PH_PUSH, "all": mk.PH_ALL}
            phase_ms = {}
            for label, m in masks.items():
                phase_ms[label] = triton.testing.do_bench(
                    lambda m=m: megakernel_forward_multirank(*args_k, config=parse_config(str_cfg(best)),
                                                             peers=peers, phases=m),
                    warmup=20, rep=args.reps * 10, return_mode="median")
                print(f"  forward phases {label:<8} {phase_ms[label]:.3f} ms", flush=True)
        trace_summary = None
        if args.trace:
            from kittenmoe.trace import chrome_trace, summarize

            c = parse_config(str_cfg(best))
            for _ in range(3):  # compile, then warm caches; the last run's trace is read
                st = megakernel_forward_multirank(*args_k, config=c, peers=peers, trace=True).states[0]
            torch.cuda.synchronize()
            summary = summarize(st.trace, c.num_comm_programs_fwd, num_programs=props.multi_processor_count)
            print(summary.table(), flush=True)
            trace_summary = dataclasses.asdict(summary)
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"trace-fwd-{name}.json")  # chrome://tracing or ui.perfetto.dev
            with open(path, "w") as f:
                json.dump(chrome_trace(st.trace, c.num_comm_programs_fwd), f)
            print(f"  timeline: {path}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    run_mk()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=25), flush=True)
        ms_mk = sweep[best]
        ms_base = timed["grouped_mm"].ms
        # The same two paths replayed from CUDA graphs: what a training step that captures its layers sees
        # (no Python or launch overhead; the schedule's ~30 torch ops cost host time in eager mode).
        graph_ms = {}
        for label, fn in (("kittenmoe", lambda: sl.run(parse_config(str_cfg(best)))), ("grouped_mm", run_base)):
            try:
                fn()  # warm-up outside the capture: buffers and pointer tables exist before it
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graph_ms[label] = triton.testing.do_bench(graph.replay, warmup=20, rep=args.reps * 10,
                                                          return_mode="median")
            except Exception as exc:  # reported in the row and printed; the eager figures stand
                print(f"  CUDA-graph timing of {label} failed: {type(exc).__name__}: {exc}", flush=True)
                graph_ms[label] = repr(exc)
        routed = 6 * T * shape.k * shape.h * shape.i
        total = 6 * T * (1 + shape.k) * shape.h * shape.i
        row = dict(
            kind="forward", shape=name, ep_slice=args.ep, experts_local=L, tokens=T, h=shape.h, i=shape.i,
            k=shape.k, dtype="bf16", ranks=1, config=best, sweep_ms=sweep, sweep_errors=sweep_errors, ms_schedule=ms_sched, ms_kittenmoe=ms_mk, ms_grouped_mm=ms_base,
            timing=f"interleaved, {args.rounds} rounds of {args.reps * 10 / args.rounds:.0f} ms a variant",
            round_ms=round_ms,
            speedup=ms_base / ms_mk, graph_ms=graph_ms, phase_ms=phase_ms if args.breakdown else None,
            trace=trace_summary,
            routed_tflops=routed / ms_mk / 1e9, effective_tflops=total / ms_mk / 1e9,
            baseline_routed_tflops=routed / ms_base / 1e9, rel_l1=err, baseline_rel_l1=base_err, deterministic=det,
            compile_s=compile_s, **env,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command="PYTHONPATH=src python3 " + " ".join(sys.argv),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del res, out
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"fwd-{stamp}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'shape':<20}{'T':>6}{'kmoe ms':>9}{'base ms':>9}{'x':>6}{'routed TF':>10}{'base TF':>9}"
          f"{'relL1':>9}{'det':>5}{'sched torch/triton':>19}")
    for r in rows:
        print(f"{r['shape']:<20}{r['tokens']:>6}{r['ms_kittenmoe']:>9.3f}{r['ms_grouped_mm']:>9.3f}"
              f"{r['speedup']:>6.2f}{r['routed_tflops']:>10.0f}{r['baseline_routed_tflops']:>9.0f}"
              f"{r['rel_l1']:>9.1e}{str(r['deterministic']):>5}"
              f"{r['ms_schedule']['torch']:>10.3f}/{r['ms_schedule']['triton']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
