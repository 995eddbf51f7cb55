"""``kittenmoe bench``'s command line: its arguments (the problem ones shared with ``kittenmoe tune``) and
``run_bench``, which runs the problems in this process (``runner``) or as one torchrun rank (``ep_runner``)
and writes the results (``report``)."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from kittenmoe.bench.baselines import BASELINES, parse_baselines, unavailable
from kittenmoe.bench.environment import (command_line, environment, now_iso, resolve_device, skipped_baselines)
from kittenmoe.bench.ep_runner import DEFAULT_EP_BASELINE, EP_BASELINES, agree_config, bench_problem_ep
from kittenmoe.bench.launch import (SHARE_GPU_ENV, Launch, check_world, detect_launch, init_world,
                                    resolve_ep_device, share_gpu_requested)
from kittenmoe.bench.problems import (DEFAULT_EP_MODEL, DTYPES, FP8_BLOCKS, config_for_problem, make_problems,
                                      parse_config_overrides)
from kittenmoe.bench.report import PATHS, finish, status
from kittenmoe.bench.runner import bench_problem
from kittenmoe.config import SHAPES

MODES = ("forward", "backward", "both")


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
    p.add_argument("--path", default=None, choices=PATHS,
                   help="what kittenmoe's time covers: public, the autograd entry point users call "
                   "(kittenmoe.moe(backend='megakernel') on one rank; kittenmoe.ep.moe_ep under torchrun; "
                   "forward+backward adds torch.autograd.grad), or launcher, the megakernel launchers without "
                   "the autograd layer. Default public, except with --ranks R > 1 virtual ranks in one process, "
                   "which only the launchers run (the public API is one rank per call): there the default is "
                   "launcher and --path public is an error")
    p.add_argument("--fp8", type=int, default=None, choices=FP8_BLOCKS, metavar="{128,32}",
                   help="run kittenmoe's routed experts in FP8 e4m3 with this scale block (128: 1x128 / 128x128 "
                   "scales; 32: MXFP8, power-of-two scales) against the same BF16 baseline; needs --dtype bf16 "
                   "and H, I multiples of the block (default: no FP8)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON rows (default %(default)s)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="also draw a PNG (needs matplotlib)")
    p.add_argument("--baseline", default=None, metavar="NAME[,NAME]",
                   help=f"baselines to time in the same rounds, comma-separated: {', '.join(BASELINES)}. "
                   "grouped_mm is always timed (the rows' baseline and speedup); sonicmoe (SonicMoE's "
                   "moe_general_routing_inputs, routed experts only, bf16, CUDA) adds ms_sonicmoe, "
                   "speedup_vs_sonicmoe and rel_l1_sonicmoe, or is skipped with a message when it is not "
                   "importable. Single process only (under torchrun see --ep-baseline)")
    p.add_argument("--no-shared", action="store_true",
                   help="no shared expert (width 0; shape labels get -S0), e.g. to time the same work as "
                   "SonicMoE, which has none")
    p.add_argument("--ep-baseline", default=None, choices=tuple(EP_BASELINES),
                   help="under torchrun: the NCCL + PyTorch baseline, all-to-all (baselines.all_to_all_forward, "
                   "grouped_mm experts; the default) or distributed (distributed.moe_forward_distributed, the "
                   "torch backend's semantic model)")


def resolve_path(path: str | None, ranks: int, processes: bool) -> str:
    """``--path`` as run: given, or public by default; R > 1 virtual ranks in one process take the launchers
    (the public API runs one rank per call), and an explicit ``--path public`` there is an error."""
    if processes or ranks == 1:
        return path or "public"
    if path == "public":
        raise ValueError(f"--path public times kittenmoe.moe, one rank per call; --ranks {ranks} virtual ranks in one "
                         f"process run only the launchers: pass --path launcher (the default there), or run the "
                         f"ranks as processes under torchrun (torchrun --nproc-per-node {ranks} -m kittenmoe.cli "
                         f"bench ...), where --path public times kittenmoe.ep.moe_ep")
    return "launcher"


def _check_plot(plot: str | None) -> None:
    if plot is not None and not str(plot).lower().endswith(".png"):
        raise ValueError(f"--plot must name a .png file, got {plot!r}")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    """``kittenmoe bench``; returns the exit status (1 if a result failed its accuracy check).

    Under torchrun (or in a process group the caller made) this process is one rank: ``run_bench_ranks``."""
    launch = detect_launch()
    if launch is not None:
        return run_bench_ranks(args, launch, argv, log)
    if args.ep_baseline is not None:
        raise ValueError(f"--ep-baseline {args.ep_baseline} applies under torchrun (one process per rank); this "
                         f"run has virtual ranks in one process, timed against grouped_mm")
    extras = parse_baselines(args.baseline)
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, args.ranks, args.dtype, args.routing,
                             args.fp8, shared=not args.no_shared)
    path = resolve_path(args.path, problems[0].ranks, processes=False)
    overrides = parse_config_overrides(args.config)
    _check_plot(args.plot)
    device = resolve_device(args.device)
    configs = [config_for_problem(prob, device, overrides) for prob in problems]  # (before anything is printed)
    if share_gpu_requested():
        log(f"note: {SHARE_GPU_ENV}=1 applies under torchrun only; this run has virtual ranks in one process")
    reps, warmup = resolve_reps(args, device)
    modes = ["forward", "backward"] if args.mode == "both" else [args.mode]
    env = environment(device)
    stamp = dict(**env, date=now_iso(), command=command_line(argv))
    log(f"kittenmoe bench on {env['gpu']} ({env['device']}), torch {env['torch']}, triton {env['triton']}; "
        f"kittenmoe timed along the {path} path")
    if path == "launcher" and args.path is None:
        log(f"note: {problems[0].ranks} virtual ranks in one process run only the launchers (--path launcher)")
    if env["device"] == "cpu-interpreter":
        log("note: CPU under the Triton interpreter: these times test the tool, they are not GPU figures")
    skipped = skipped_baselines(log)
    # --baseline: each extra baseline that cannot run in this process is skipped, with a line saying why
    extra_notes = {}
    for name in extras:
        why = unavailable(name)
        extra_notes[name] = None if why is None else f"skipped: {why}"
        if why is not None:
            log(f"{name} skipped: {why}")
            skipped.append(f"skipped: {name}: {why}")
    rows = []
    for prob, (cfg, source) in zip(problems, configs):
        log(f"{prob.describe()}\n  config ({source}): {cfg}")
        for row in bench_problem(prob, cfg, modes, device, reps, warmup, args.seed, log, path, extra_notes):
            row.update(stamp, config_source=source, skipped_baselines=skipped)
            rows.append(row)
    return finish(rows, args.out, args.plot, log)


def run_bench_ranks(args: argparse.Namespace, launch: Launch, argv: list[str] | None = None,
                    log: Callable[[str], None] = print) -> int:
    """``kittenmoe bench`` as one rank of ``launch``: every rank times, rank 0 prints and writes the rows.

    The arguments are checked before the process group exists (every rank raises the same ValueError);
    every rank returns the same exit status."""
    if args.baseline is not None:
        raise ValueError(f"--baseline {args.baseline} applies to one process (grouped_mm, SonicMoE: one GPU, no "
                         f"expert parallelism); under torchrun the baseline is --ep-baseline "
                         f"({', '.join(EP_BASELINES)})")
    problems = make_problems(args.model, args.shape, args.ep, args.tokens, check_world(args.ranks, launch),
                             args.dtype, args.routing, args.fp8, shared=not args.no_shared)
    path = resolve_path(args.path, launch.world_size, processes=True)
    overrides = parse_config_overrides(args.config)
    _check_plot(args.plot)
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
        f"{', every rank on cuda:0' if launch.share_gpu else ', one GPU per rank'}), kittenmoe timed along the "
        f"{path} path, baseline {EP_BASELINES[baseline]}")
    if launch.share_gpu:
        say("note: the ranks share one GPU: these times test the tool, they are not EP figures")
    skipped = skipped_baselines(say, processes=True)
    rows = []
    for prob, (cfg, source) in zip(problems, configs):
        agree_config(group, cfg)
        say(f"{prob.describe()} as {launch.world_size} processes\n  config ({source}): {cfg}")
        for row in bench_problem_ep(prob, cfg, modes, device, peers, group, baseline, reps, warmup, args.seed,
                                    say, path):
            row.update(stamp, config_source=source, skipped_baselines=skipped)
            rows.append(row)
    # Clean up on success only: after an error on one rank a collective here would wait for it.
    peers.destroy()
    if launch.owns_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    if launch.rank != 0:
        return status(rows, say)
    return finish(rows, args.out, args.plot, log)
