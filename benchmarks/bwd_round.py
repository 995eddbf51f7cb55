"""One device run for the backward megakernel: check gradients, time forward+backward; a table last.

    PYTHONPATH=src python3 benchmarks/bwd_round.py [--shapes kimi-k2.7,...] [--out DIR]

Gradients of x, router weights, w13, w2 and the shared expert against the fp32
reference (relative L1 and cosine), bitwise repeatability over two runs, and
forward+backward latency of the megakernels vs the grouped_mm baseline under
autograd, same routing, same run. Peak memory of each beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import traceback

import torch
import triton

from kittenmoe.baselines import grouped_mm_forward
from kittenmoe.bench import measure_interleaved, parse_config_overrides, parse_problem
from kittenmoe.bench.timing import sync_warnings
from kittenmoe.config import KernelConfig, SEED_SHAPES, SLICE_TOKENS, TEST_SHAPES, default_config
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_reference_multirank
from kittenmoe.testing import cosine, make_weights, rel_l1, routing_uniform

SLICES = SLICE_TOKENS  # kittenmoe.config: the one-GPU slices (tokens at EP8)


def case(shape, R, T, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g)
    xs = [torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    rts = [routing_uniform(T, shape.e, shape.k, generator=g, device=dev) for _ in range(R)]
    gos = [torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    return w, xs, [r[0] for r in rts], [r[1] for r in rts], gos


def check(name, shape, R, T, cfg, dev):
    w, xs, ids, ws, gos = case(shape, R, T, dev)
    args = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)
    # The path autograd takes: the forward keeps its activations (cfg.keep_activations), the backward reads them.
    fwd = megakernel_forward_multirank(*args, config=cfg, save_for_backward=cfg.keep_activations)
    res = megakernel_backward_multirank(gos, *args, config=cfg, saved=fwd.saved())
    res.check_errors()
    got = res.d_x + res.d_topk_weights + [res.d_w13, res.d_w2, res.d_shared_w13, res.d_shared_w2]
    res2 = megakernel_backward_multirank(gos, *args, config=cfg, saved=fwd.saved())
    got2 = res2.d_x + res2.d_topk_weights + [res2.d_w13, res2.d_w2, res2.d_shared_w13, res2.d_shared_w2]
    if w.shared_w13_2SH is None:  # no shared expert (a TxHxIxExK problem): no gradients of its weights
        got, got2 = got[:-2], got2[:-2]
    det = all(torch.equal(a, b) for a, b in zip(got, got2))
    leaves = [x.float().requires_grad_() for x in xs] + [v.float().requires_grad_() for v in ws] + \
             [t.float().requires_grad_() for t in w.tensors()]
    ref = moe_reference_multirank(leaves[:R], ids, leaves[R:2 * R], *leaves[2 * R:], shape.swiglu_limit,
                                  compute_dtype=torch.float32)
    grads = torch.autograd.grad(ref, leaves, [g_.float() for g_ in gos])
    names = [f"d_x{r}" for r in range(R)] + [f"d_w{r}" for r in range(R)] + ["d_w13", "d_w2", "d_sw13", "d_sw2"]
    errs = {n: (rel_l1(a, b), cosine(a, b)) for n, a, b in zip(names, got, grads)}
    worst = max(e[0] for e in errs.values())
    cmin = min(e[1] for e in errs.values())
    print(f"  {name}: worst rel L1 {worst:.2e}, min cosine {cmin:.6f}, bitwise repeat {det}", flush=True)
    for n, (e, c) in errs.items():
        print(f"    {n:<8} rel L1 {e:.2e} cos {c:.6f}", flush=True)
    return dict(worst_rel_l1=worst, min_cosine=cmin, deterministic=det, per_tensor=errs)


def gaps(label, fn, out_dir, n=5):
    """Where one call's wall time goes beyond its kernels (--gaps). Host ms: ``n`` back-to-back calls' enqueue
    time on the host over ``n`` (~50 launches a call for kittenmoe, 114-137 for grouped_mm: at n = 5 under the
    ~1,000 pending launches at which a launch would wait). Loop ms: the same calls' GPU time over ``n`` (the
    host runs ahead, so no launch gaps unless a call syncs). Then one call after an L2 flush under the profiler,
    as do_bench times it: its span from the first kernel to the last, the kernels' busy time (union) and the
    largest idle gaps with the kernels either side. Synchronizing calls are listed from
    ``torch.cuda.set_sync_debug_mode('warn')``'s warnings."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b.record()
    for _ in range(n):
        fn()
    e.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    loop_ms = b.elapsed_time(e) / n
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in sync_warnings(fn)})
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        flush.zero_()
        fn()
        torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"gaps-{label}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = [x for x in json.load(f)["traceEvents"] if x.get("ph") == "X" and x.get("cat") in ("kernel", "gpu_memcpy",
                                                                                                   "gpu_memset")]
    ev.sort(key=lambda x: x["ts"])
    ev = ev[1:]  # the flush's memset / fill kernel
    busy, end, holes = 0.0, None, []
    for x in ev:
        s, d = x["ts"], x["dur"]
        if end is not None and s > end:
            holes.append((s - end, prev, x["name"]))
        busy += max(0.0, s + d - max(s, end if end is not None else s))
        if end is None or s + d > end:
            end, prev = s + d, x["name"]
    span = (end - ev[0]["ts"]) / 1e3
    holes.sort(reverse=True)
    res = dict(host_ms=host_ms, loop_ms=loop_ms, span_ms=span, busy_ms=busy / 1e3, idle_ms=span - busy / 1e3,
               kernels=len(ev), syncs=syncs,
               largest_gaps=[(round(g / 1e3, 4), a[:60], z[:60]) for g, a, z in holes[:6]])
    print(f"  gaps {label}: host {host_ms:.3f} ms a call, back to back {loop_ms:.3f} ms a call; one call after a "
          f"flush: span {span:.3f} ms, kernels busy {busy / 1e3:.3f}, idle {span - busy / 1e3:.3f} "
          f"({len(ev)} kernels); syncs {len(syncs)}", flush=True)
    for s in syncs:
        print(f"    sync: {s}", flush=True)
    for g, a, z in res["largest_gaps"]:
        print(f"    gap {g:.3f} ms  after {a}  before {z}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,qwen3.5-397b-a17b")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=10, help="time budget: reps x 20 ms of timed runs a variant")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the budget is split over")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time subsets of the backward's phases (pull, +A, +B and push, +shared, all)")
    ap.add_argument("--trace", action="store_true",
                    help="also run the backward megakernel's traced build once and print kittenmoe.trace's summary")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernel time table of three forward+backwards")
    ap.add_argument("--gaps", action="store_true",
                    help="also say where a call's wall time goes beyond its kernels, for the heuristic and the "
                         "baseline: host ms a call (enqueue), GPU ms a call back to back, and one call's GPU idle "
                         "after an L2 flush (do_bench's setting) from a profiler trace, with the largest gaps")
    ap.add_argument("--aa", action="store_true",
                    help="time the heuristic a second time as its own variant ('heuristic-again'): the gap between "
                         "the two is a rough noise floor for the other variants' gaps (one config read 0-3.8%% "
                         "apart from itself over five rounds). One sample, and the two copies sit at fixed "
                         "places in the rotated order (each after the same neighbour), so 'within / past the A/A "
                         "gap' is a rule of thumb, not a test")
    ap.add_argument("--shared-replay", action="store_true",
                    help="also time the heuristic with the shared expert's gate|up replayed in the backward (the "
                         "forward still keeps it): the kept shared gate|up's A/B")
    ap.add_argument("--config", default="", help="KernelConfig overrides (k=v,k=v); several separated by ';' are "
                    "each timed (forward+backward) beside the default in the same run")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    extra = [parse_config_overrides(c) for c in args.config.split(";") if c.strip()]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__)
    print(env, flush=True)
    small = TEST_SHAPES["small"]
    small_cfg = KernelConfig(block_m=64, minibatch_size=256)
    check("small R=2 T=300", small, 2, 300, small_cfg, dev)
    rows = []
    for name in args.shapes.split(","):
        if "x" in name:  # TxHxIxExK, e.g. 8192x2048x768x128x8 (Qwen3-30B-A3B): one rank, no shared expert
            T, shape = parse_problem(name)
        else:
            base = SEED_SHAPES[name]
            shape = base.with_(e=base.e // 8)
            T = SLICES[name]
        cfg = default_config(T, shape.h, shape.i, shape.e, shape.k, device=dev)  # what the layer runs untuned
        print(f"  {name}: heuristic {cfg}", flush=True)
        row = dict(kind="forward+backward", shape=name, ep_slice=8, experts_local=shape.e, tokens=T, h=shape.h,
                   i=shape.i, k=shape.k, dtype="bf16", ranks=1, config=str(cfg.__dict__), **env,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="PYTHONPATH=src python3 " + " ".join(sys.argv))
        row.update(check(name, shape, 1, T, cfg, dev))
        w, xs, ids, ws, gos = case(shape, 1, T, dev)
        peers = LocalPeers(1, dev)
        a = (xs, ids, ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)

        def mk(keep=cfg.keep_activations, c=cfg, shared_kept=True):
            f = megakernel_forward_multirank(*a, config=c, peers=peers, save_for_backward=keep)
            saved = f.saved()
            if not shared_kept:  # (--shared-replay) the backward replays the shared expert's gate|up
                saved = [None if s is None else (s[0], s[1], None) for s in saved]
            megakernel_backward_multirank(gos, *a, config=c, peers=peers, saved=saved)

        if args.breakdown:
            from kittenmoe.kernels import megakernel_bwd as mb

            masks = {"pull": mb.PB_PULL, "+A": mb.PB_PULL | mb.PB_A,
                     "+B+push": mb.PB_PULL | mb.PB_A | mb.PB_B | mb.PB_PUSH,
                     "+wgrad": mb.PB_PULL | mb.PB_A | mb.PB_B | mb.PB_PUSH | mb.PB_WGRAD, "all": mb.PB_ALL}
            row["phase_ms"] = {}
            saved_fwd = megakernel_forward_multirank(*a, config=cfg, peers=peers,
                                                     save_for_backward=cfg.keep_activations)
            for label, m in masks.items():
                row["phase_ms"][label] = triton.testing.do_bench(
                    lambda m=m: megakernel_backward_multirank(gos, *a, config=cfg, peers=peers, phases=m,
                                                              saved=saved_fwd.saved()),
                    warmup=20, rep=args.reps * 10, return_mode="median")
                print(f"  backward phases {label:<8} {row['phase_ms'][label]:.3f} ms", flush=True)
        if args.trace:
            from kittenmoe.trace import BWD_KINDS, chrome_trace, summarize

            kept = megakernel_forward_multirank(*a, config=cfg, peers=peers, save_for_backward=cfg.keep_activations)
            for _ in range(3):  # compile, then warm caches; the last run's trace is read
                tr = megakernel_backward_multirank(gos, *a, config=cfg, peers=peers, saved=kept.saved(),
                                                   trace=True).traces[0]
            torch.cuda.synchronize()
            summary = summarize(tr, cfg.num_comm_programs_bwd, BWD_KINDS, num_programs=props.multi_processor_count)
            print(summary.table(), flush=True)
            row["trace"] = dataclasses.asdict(summary)
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"trace-bwd-{name}.json")  # chrome://tracing or ui.perfetto.dev
            with open(path, "w") as f:
                json.dump(chrome_trace(tr, cfg.num_comm_programs_bwd, BWD_KINDS), f)
            print(f"  timeline: {path}", flush=True)
        if args.profile:  # as fwd_round's --profile: where the GPU time of a forward+backward goes, per kernel
            from torch.profiler import ProfilerActivity, profile
            mk()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    mk()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=25), flush=True)

        def peak_mb(fn):  # the peak memory of one call above what was allocated before it
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20

        # Everything timed is timed together: the heuristic config, the replaying backward
        # (keep_activations=False), each --config and the baseline, in interleaved rounds (kittenmoe.bench.
        # measure_interleaved: the GPU's clock falls under sustained load, so back-to-back timing favours
        # whatever runs first).
        fns = {"kittenmoe": mk, "replay": lambda: mk(False)}
        if args.aa:  # the same callable under a second name: timed in its own slots of every round
            fns["heuristic-again"] = lambda: mk()
        fns["replay"]()  # compiled (its own backward build) before the timed rounds
        if args.shared_replay:  # A/B of the kept shared gate|up: the same forward, the shared replay in the backward
            fns["shared-replay"] = lambda: mk(shared_kept=False)
            fns["shared-replay"]()
        row["sweep_ms"] = {}
        for over in extra:
            key = ",".join(f"{k}={v}" for k, v in over.items())  # as asked, even where it equals the heuristic
            try:
                c = cfg.with_overrides(**over)  # (in the try: an override invalid here is reported, not fatal)
                row.setdefault("sweep_check", {})[key] = check(f"{name} [{key}]", shape, 1, T, c, dev)["worst_rel_l1"]
                fn = lambda c=c: mk(keep=c.keep_activations, c=c)
                fn()  # compiled before the timed rounds
                fns[key] = fn
            except Exception as exc:  # reported in the row and on the terminal, not hidden
                traceback.print_exc()
                row.setdefault("sweep_error", {})[key] = repr(exc)
        lw = [t.detach().requires_grad_() for t in [xs[0], ws[0]] + w.tensors()]

        def bl():
            out = grouped_mm_forward(lw[0], ids[0], lw[1], *lw[2:], shape.swiglu_limit)
            torch.autograd.grad(out, lw, gos[0])

        try:
            row["peak_mb_grouped_mm"] = peak_mb(bl)
            fns["grouped_mm"] = bl
        except Exception as exc:  # reported in the row and on the terminal, not hidden
            traceback.print_exc()
            row["baseline_error"] = repr(exc)
        mk()
        row["peak_mb_kittenmoe"] = peak_mb(mk)
        if args.gaps:
            row["gaps"] = {k: gaps(f"{name}-{k}", fns[k], args.out) for k in ("kittenmoe", "grouped_mm") if k in fns}
        errors = {}  # a variant failing in the rounds is dropped and reported (the heuristic's own failure raises)
        timed = measure_interleaved(fns, dev, rounds=args.rounds, rep_ms=args.reps * 20 / args.rounds,
                                    warmup_ms=20, errors=errors)
        for key in ("kittenmoe", "replay"):
            if key in errors:
                raise RuntimeError(f"{name}: the {key} forward+backward failed when timed: {errors[key]}")
        for key, why in errors.items():
            print(f"  {name} [{key}] failed when timed: {why}", flush=True)
            if key == "grouped_mm":
                row["baseline_error"] = why
            else:
                row.setdefault("sweep_error", {})[key] = why
        row["timing"] = f"interleaved, {args.rounds} rounds of {args.reps * 20 / args.rounds:.0f} ms a variant"
        row["round_ms"] = {k: list(v.round_ms) for k, v in timed.items()}
        row["ms_kittenmoe"] = timed["kittenmoe"].ms
        row["ms_kittenmoe_replay"] = timed["replay"].ms
        aa_gap = None
        if "heuristic-again" in timed:
            row["ms_kittenmoe_again"] = timed["heuristic-again"].ms
            aa_gap = abs(row["ms_kittenmoe_again"] / row["ms_kittenmoe"] - 1)
            print(f"  {name} A/A: the heuristic {row['ms_kittenmoe']:.3f} ms, again {row['ms_kittenmoe_again']:.3f} "
                  f"({100 * aa_gap:.1f}% apart; rounds "
                  f"{' '.join(f'{t:.3f}' for t in timed['heuristic-again'].round_ms)})", flush=True)
        for key in [k for k in timed if k not in ("kittenmoe", "replay", "grouped_mm", "heuristic-again")]:
            row["sweep_ms"][key] = timed[key].ms
            gap = timed[key].ms / row["ms_kittenmoe"] - 1
            within = "" if aa_gap is None else (" (within the A/A gap)" if abs(gap) <= aa_gap else
                                                " (past the A/A gap)")
            print(f"  {name} [{key}]: {timed[key].ms:.3f} ms against {row['ms_kittenmoe']:.3f}, {100 * gap:+.1f}%"
                  f"{within} (rounds {' '.join(f'{t:.3f}' for t in timed[key].round_ms)})", flush=True)
        print(f"  {name} heuristic rounds: {' '.join(f'{t:.3f}' for t in timed['kittenmoe'].round_ms)}", flush=True)
        if "grouped_mm" in timed:
            row["ms_grouped_mm"] = timed["grouped_mm"].ms
            row["speedup"] = row["ms_grouped_mm"] / row["ms_kittenmoe"]
        routed = 18 * T * shape.k * shape.h * shape.i
        row["routed_tflops"] = routed / row["ms_kittenmoe"] / 1e9
        if "ms_grouped_mm" in row:
            row["baseline_routed_tflops"] = routed / row["ms_grouped_mm"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        del peers, w, xs, gos
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"fwdbwd-{stamp}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'shape':<20}{'kmoe ms':>9}{'replay':>8}{'base ms':>9}{'x':>6}{'routed TF':>10}{'relL1':>9}{'cos':>10}{'det':>6}"
          f"{'MB k':>8}{'MB base':>9}")
    for r in rows:
        print(f"{r['shape']:<20}{r['ms_kittenmoe']:>9.3f}{r['ms_kittenmoe_replay']:>8.3f}"
              f"{r.get('ms_grouped_mm', float('nan')):>9.3f}"
              f"{r.get('speedup', float('nan')):>6.2f}{r['routed_tflops']:>10.0f}{r['worst_rel_l1']:>9.1e}"
              f"{r['min_cosine']:>10.6f}{str(r['deterministic']):>6}{r['peak_mb_kittenmoe']:>8.0f}"
              f"{r.get('peak_mb_grouped_mm', float('nan')):>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
