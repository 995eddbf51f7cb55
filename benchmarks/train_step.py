"""Whole training steps of published MoE model configurations, every experts implementation in one run.

    PYTHONPATH=src python3 benchmarks/train_step.py --model moonlight-16b-a3b --seq 8192
    PYTHONPATH=src python3 benchmarks/train_step.py --model qwen3-30b-a3b --seq 4096 --compile both
    PYTHONPATH=src python3 benchmarks/train_step.py --stack torchtitan --model qwen3-30b-a3b --seq 8192
    PYTHONPATH=src python3 benchmarks/train_step.py --model tiny-qwen3-moe --device cpu   # seconds, a smoke run

The models and providers are ``kittenmoe.bench.train_models``'s: Moonlight-16B-A3B and Qwen3-30B-A3B at full
width, ``--layers`` deep; with ``--stack hf`` every ``experts_implementation`` transformers has registered
(eager, batched_mm, grouped_mm, deepgemm, sonicmoe) and kittenmoe, with ``--stack torchtitan`` torchtitan's own
experts and kittenmoe; with either, ``no-routed-experts``, the floor, so that ``step - floor`` is the routed
experts' share of the step. ``--compile both`` runs every provider also under ``torch.compile`` of the model.

Each provider builds the same weights from one seed and trains on the same batches: bf16 parameters, AdamW
(torch's fused kernels, torchtitan's default), ``--loss-steps`` steps whose losses are kept (every implementation
must train the same model: the rows give each one's largest loss difference from the reference provider's,
grouped_mm or torchtitan, beside eager's as the scale of bf16 noise), of which all after ``--warmup`` are timed
with CUDA events (median). Providers run one after another, the floor first and last (the mean of the two is the
floor), each model freed before the next (Dynamo reset too), so the peak memory of a provider
(``max_memory_allocated`` from its build to its last step) is its own; the rows are rewritten after each
provider. One more step runs under ``torch.cuda.set_sync_debug_mode("warn")`` to count the host syncs a step
makes; with ``--profile``, two more under ``torch.profiler`` give each row its heaviest GPU kernels. A provider
that does not fit (out of memory) or cannot run here (a missing package, a CPU) gets a row saying so; kittenmoe
failing for any other reason stops the run. Rows go to ``benchmarks/results/`` as JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Callable

import torch

from kittenmoe.bench.environment import command_line, environment, now_iso
from kittenmoe.bench.train_models import (FLOOR, KITTENMOE, MODELS, OPTIMIZER, TITAN_ATTENTION, Model, adamw,
                                          apply_titan, build_hf, build_titan, hf_loss, hf_providers, titan_flavor,
                                          titan_loss, titan_providers, zipf_batches)


def host_syncs(step: Callable[[], None]) -> list[str]:
    """The host syncs one call of ``step`` makes, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them: one
    "file:line" a sync, the Python line that made it (where a row shows more syncs than another, this says where
    they come from)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def top_kernels(step: Callable[[], None], steps: int = 2, rows: int = 60) -> list[dict]:
    """The GPU kernels of ``steps`` calls of ``step`` by total time (ms a step), heaviest first."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in kernels)
    out = [dict(kernel=e.key[:120], ms=e.self_device_time_total / 1e3 / steps, calls=e.count // steps)
           for e in kernels[:rows]]
    return [dict(kernel="(all kernels)", ms=total / 1e3 / steps, calls=sum(e.count for e in kernels) // steps)] + out


def run_provider(args, spec: Model, provider: str, compiled: bool, batches, device, dtype) -> dict:
    row = dict(provider=provider, compiled=compiled, status="ok")
    cuda = device.type == "cuda"
    model = opt = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            mem_before = torch.cuda.memory_allocated(device)
        if args.stack == "hf":
            model = build_hf(spec, args.layers, device, dtype)
            model.set_experts_implementation(provider)  # (transformers' default is grouped_mm, not eager)
            loss_fn = hf_loss
        else:
            model = build_titan(spec, args.layers, device, dtype, args.titan_attention)
            apply_titan(model, provider)
            loss_fn = functools.partial(titan_loss, flex=args.titan_attention == "flex")
        if compiled:
            model.compile()
        opt = adamw(model, args.lr)

        def step(ids_BS):
            loss = loss_fn(model, ids_BS)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        losses, times = [], []
        t_build = time.perf_counter()
        for i, ids in enumerate(batches):
            ids = ids.to(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = step(ids)
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            losses.append(loss.item())
            if i >= args.warmup:
                times.append(ms)
            if i == 0:
                row["first_step_s"] = time.perf_counter() - t_build  # compiles and autotuning included
        row.update(losses=losses, ms_all=times, ms_median=statistics.median(times))
        row["tokens_per_s"] = batches[0].numel() / (row["ms_median"] / 1e3)
        if cuda:
            row["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) - mem_before) / 2**30
            ids = batches[0].to(device)
            sites = host_syncs(lambda: step(ids))
            row["host_syncs_per_step"] = len(sites)
            row["host_sync_sites"] = sorted(set(sites))
            if args.profile:  # a profiler failure is the row's to report, not the run's to end
                try:
                    row["kernels"] = top_kernels(lambda: step(ids))
                except (RuntimeError, AttributeError) as e:  # (the profiler's, or its API in another torch)
                    row["kernels_error"] = f"{type(e).__name__}: {e}"
                    print(f"{provider}: the profile failed: {row['kernels_error']}", flush=True)
    except torch.OutOfMemoryError as e:
        row.update(status="out of memory", detail=str(e).splitlines()[0])
    except Exception as e:  # a provider that cannot run here: its row says why; ours may not fail
        if provider == KITTENMOE:
            raise
        row.update(status="cannot run", detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        del model, opt
        if compiled:  # the next provider's graphs start from nothing (no recompile limit shared across them)
            torch._dynamo.reset()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def summarise(rows: list[dict], base: str) -> None:
    """Ratios against the stack's reference provider and the best other one, the routed share from the floor
    (the mean of its two runs, first and last, so that the GPU's drift over the run falls on both sides), and
    loss agreement against the reference (eager's, where it ran, is the scale of bf16 noise)."""
    for compiled in (False, True):
        ok = [r for r in rows if r["compiled"] == compiled and r["status"] == "ok"]
        ref = next((r for r in ok if r["provider"] == base), None)
        floors = [r["ms_median"] for r in ok if r["provider"] == FLOOR]
        floor_ms = statistics.mean(floors) if floors else None
        for r in ok:
            if ref is not None:
                r["speedup_vs_" + base] = ref["ms_median"] / r["ms_median"]
                n = min(len(r["losses"]), len(ref["losses"]))
                r["loss_max_abs_diff_vs_" + base] = max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
            if floor_ms is not None and r["provider"] != FLOOR:
                r["ms_floor"] = floor_ms
                r["ms_routed_experts"] = r["ms_median"] - floor_ms
                r["routed_share"] = r["ms_routed_experts"] / r["ms_median"]
    others = [r for r in rows if r["status"] == "ok" and r["provider"] not in (KITTENMOE, FLOOR)]
    if others:
        best = min(others, key=lambda r: r["ms_median"])
        for r in rows:
            if r["status"] == "ok" and r["provider"] == KITTENMOE:
                r["best_other"] = f"{best['provider']}{' (compiled)' if best['compiled'] else ''}"
                r["speedup_vs_best_other"] = best["ms_median"] / r["ms_median"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moonlight-16b-a3b")
    ap.add_argument("--stack", choices=("hf", "torchtitan"), default="hf")
    ap.add_argument("--titan-attention", choices=TITAN_ATTENTION, default="flex",
                    help="the torchtitan stack's attention: flex (its trainer's) or causal sdpa (torch 2.11's "
                         "FlexAttention lacks what torchtitan 0.3 asks of it)")
    ap.add_argument("--layers", type=int, default=None, help="depth (default 4 on CUDA, 2 on CPU)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--loss-steps", type=int, default=20, help="steps a provider trains (losses kept)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="torch.compile the model: off, on, or every provider both ways")
    ap.add_argument("--providers", default=None, help="comma list (default: every one registered here)")
    ap.add_argument("--profile", action="store_true", help="keep each provider's heaviest GPU kernels")
    ap.add_argument("--knobs", default="",
                    help="KernelConfig fields set on kittenmoe's per-call config, k=v,... (hf stack; "
                         "kittenmoe.integrations.transformers.Options.knobs), e.g. backward_kernel=gluon")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = MODELS[args.model]
    if args.layers is None:
        args.layers = min(spec.layers, 4 if device.type == "cuda" else 2)
    if args.loss_steps <= args.warmup:
        ap.error(f"--loss-steps ({args.loss_steps}) must exceed --warmup ({args.warmup}) to time any step")
    if args.stack == "torchtitan":
        titan_flavor(spec)  # (a model torchtitan has no configuration of fails here, before any row)
    providers = hf_providers() if args.stack == "hf" else titan_providers()
    if args.knobs:
        if args.stack != "hf":
            ap.error("--knobs sets the transformers integration's options: the hf stack only")
        from kittenmoe.bench.problems import parse_config_overrides
        from kittenmoe.integrations.transformers import Options, register

        register(Options(knobs=tuple(parse_config_overrides(args.knobs).items())))
    if args.providers:
        asked = args.providers.split(",")
        unknown = sorted(set(asked) - set(providers))
        if unknown:
            ap.error(f"--providers {unknown} not registered here; known: {providers}")
        providers = [p for p in providers if p in asked]
    base = "grouped_mm" if args.stack == "hf" else "torchtitan"
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    batches = zipf_batches(args.loss_steps, args.batch, args.seq, spec.vocab)
    print(f"{args.stack} {args.model}: {args.layers} layers, {args.batch} x {args.seq} tokens a step, {dtype}, "
          f"providers {providers}, compile {args.compile}", flush=True)
    stamp = dict(kind="train-step", stack=args.stack, model=args.model, layers=args.layers, batch=args.batch,
                 seq=args.seq, tokens_per_step=args.batch * args.seq, dtype=str(dtype).removeprefix("torch."),
                 h=spec.hidden, i=spec.moe_inter, e=spec.experts, k=spec.top_k, shared=spec.shared,
                 loss_steps=args.loss_steps, warmup=args.warmup, lr=args.lr, optimizer=OPTIMIZER,
                 knobs=args.knobs,
                 **(dict(attention=args.titan_attention) if args.stack == "torchtitan" else {}),
                 **environment(device),
                 date=now_iso(), command=command_line(sys.argv if argv is None else ["benchmarks/train_step.py", *argv]))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"train-{args.stack}-{args.model}-s{args.seq}-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def write(rows: list[dict]) -> None:  # after every provider, so that a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump([dict(stamp, **r) for r in rows], f, indent=1)

    # The floor runs first and last (the mean is the floor): the GPU warms over a run and its clock falls.
    floor = [FLOOR] if FLOOR in providers else []
    order = floor + [p for p in providers if p != FLOOR] + floor
    rows = []
    for compiled in modes:
        for provider in order:
            row = run_provider(args, spec, provider, compiled, batches, device, dtype)
            rows.append(row)
            write(rows)
            tag = provider + (" +compile" if compiled else "")
            if row["status"] != "ok":
                print(f"{tag:<26} {row['status']}: {row.get('detail', '')}", flush=True)
            else:
                print(f"{tag:<26} {row['ms_median']:9.2f} ms/step {row['tokens_per_s']:10.0f} tok/s "
                      f"peak {row.get('peak_mem_gib', math.nan):6.2f} GiB syncs {row.get('host_syncs_per_step', '-')} "
                      f"loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}", flush=True)
    summarise(rows, base)
    write(rows)
    print(f"\n{'provider':<26}{'ms/step':>10}{'tok/s':>10}{'x ' + base:>15}{'routed %':>10}{'loss diff':>11}")
    for r in rows:
        if r["status"] != "ok":
            continue
        tag = r["provider"] + (" +compile" if r["compiled"] else "")
        print(f"{tag:<26}{r['ms_median']:10.2f}{r['tokens_per_s']:10.0f}{r.get('speedup_vs_' + base, math.nan):15.3f}"
              f"{100 * r.get('routed_share', math.nan):10.1f}{r.get('loss_max_abs_diff_vs_' + base, math.nan):11.4f}")
    for r in rows:
        if "speedup_vs_best_other" in r:
            print(f"kittenmoe{' +compile' if r['compiled'] else ''} vs the best other ({r['best_other']}): "
                  f"{r['speedup_vs_best_other']:.3f}x")
    print(f"rows: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
