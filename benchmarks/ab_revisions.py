"""Another revision of kittenmoe against this tree, in one process: same inputs, interleaved timing, bits.

A change that should keep the kernels' arithmetic (a refactor, a retired knob) must leave every output and
gradient equal bit for bit and no slice slower. This runs both revisions' public paths on the same inputs:

    python3 benchmarks/ab_revisions.py prepare <git-rev>        # here: writes .ab/kittenmoe_before (ignored)
    PYTHONPATH=src:.ab python3 benchmarks/ab_revisions.py run   # on the GPU (carry .ab)
        [--slices kimi-k2.7:2048,8192x2048x768x128x8] [--config k=v,...] [--config-before k=v,...]
        [--routing uniform,zipf:1.0] [--modes forward+backward]

``prepare`` exports ``src/kittenmoe`` at the revision and renames the package (imports and the
``torch.library`` namespace) to ``kittenmoe_before`` so both load side by side. ``run`` times, per seed EP8
slice (or TxHxIxExK problem), the forward and forward+backward of each revision's ``moe`` with its own heuristic
config (the one its public path picks, with ``--config``'s overrides, and ``--config-before``'s on the prepared
revision: a kernel against another), in interleaved rounds (the median of the rounds' medians;
``triton.testing.do_bench`` flushes L2 before each call), checks the two revisions' outputs and gradients for
equal bits, and writes a JSON row per slice under ``benchmarks/results/`` (``ab-<date>.json``) and a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / ".ab"
BEFORE = "kittenmoe_before"


def prepare(rev: str) -> None:
    """Export ``src/kittenmoe`` at ``rev`` as the package ``kittenmoe_before`` under ``.ab/``."""
    data = subprocess.run(["git", "archive", rev, "src/kittenmoe"], cwd=ROOT, check=True, capture_output=True).stdout
    dest = AB_DIR / BEFORE
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.endswith(".py"):
                continue
            rel = Path(m.name).relative_to("src/kittenmoe")
            text = tar.extractfile(m).read().decode()
            # imports, torch.ops.kittenmoe / "kittenmoe::" op names: every whole-word use of the package name
            text = re.sub(r"\bkittenmoe\b", BEFORE, text)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
    (AB_DIR / "REV").write_text(subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                                               text=True).stdout)
    print(f"wrote {dest} ({rev})")


def _problem(pkg, model: str, tokens: int, routing: str = "uniform", seed: int = 0):
    """The inputs of one slice: a seed model's EP8 slice (its shared expert included) with ``tokens``, or for a
    ``model`` written TxHxIxExK that problem on one rank without a shared expert (``tokens`` is T); routed as
    ``routing`` (``kittenmoe bench --routing``'s names)."""
    import torch

    if "x" in model:
        from kittenmoe.bench import parse_problem

        _, shape = parse_problem(model)
        local, l_local = shape, shape.e
    else:
        shape = pkg.config.get_shape(model)
        l_local = shape.e // 8
        local = shape.with_(e=l_local)
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same inputs on any GPU
    w = pkg.testing.make_weights(local, dtype=torch.bfloat16, device="cuda", generator=g)
    x = torch.randn(tokens, shape.h, generator=g).to("cuda", torch.bfloat16)
    from kittenmoe.bench.problems import parse_routing

    ids, wts = parse_routing(routing).generate(tokens, l_local, shape.k, generator=g, device="cuda")
    return shape, local, x, ids, wts, w


def run(args) -> int:
    import importlib

    import torch
    import triton

    pkgs = {}
    for name in ("after", "before"):
        mod = "kittenmoe" if name == "after" else BEFORE
        pkg = importlib.import_module(mod)
        for sub in ("config", "testing", "functional"):
            setattr(pkg, sub, importlib.import_module(f"{mod}.{sub}"))
        pkgs[name] = pkg
    rows = []
    rev = (AB_DIR / "REV").read_text().strip() if (AB_DIR / "REV").exists() else "unknown"
    out_dir = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ab-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"

    def write():  # after every slice: a run cut short by a time limit keeps what it measured
        doc = dict(kind="ab-revisions", before_rev=rev, gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, rounds=args.rounds,
                   command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
        path.write_text(json.dumps(doc, indent=1))

    for (model, tokens), routing in itertools.product(args.slices, args.routing):
        shape, local, x, ids, wts, w = _problem(pkgs["after"], model, tokens, routing)
        d_out = torch.randn_like(x)
        fns, results = {}, {}
        for name, pkg in pkgs.items():
            cfg = pkg.config.default_config(tokens, local.h, local.i, local.e, local.k, 1, "cuda", torch.bfloat16,
                                            s=local.shared_width)
            over = {**args.config, **(args.config_before if name == "before" else {})}
            cfg = dataclasses.replace(cfg, **over) if over else cfg
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, wts, *w.tensors())]

            def call(leaves=leaves, pkg=pkg, cfg=cfg):
                return pkg.functional.moe(leaves[0], ids, leaves[1], *leaves[2:], swiglu_limit=shape.swiglu_limit,
                                          backend="megakernel", config=cfg)

            def fwd(call=call):
                with torch.no_grad():
                    return call()

            def fwdbwd(call=call, leaves=leaves):
                return torch.autograd.grad(call(), leaves, d_out)  # fresh gradients each call, none accumulated

            fns[(name, "forward")], fns[(name, "forward+backward")] = fwd, fwdbwd
            results[name] = (fwd(), fwdbwd(), str(cfg))
        bits = {
            "forward": torch.equal(results["after"][0], results["before"][0]),
            "forward+backward": all(torch.equal(a, b) for a, b in zip(results["after"][1], results["before"][1])),
        }
        for mode in args.modes:
            ms = {n: [] for n in pkgs}
            for r in range(args.rounds):
                order = list(pkgs) if r % 2 == 0 else list(reversed(pkgs))
                for n in order:
                    ms[n].append(triton.testing.do_bench(fns[(n, mode)], warmup=10, rep=args.rep_ms,
                                                         return_mode="median"))
            med = {n: statistics.median(v) for n, v in ms.items()}
            rows.append(dict(model=model, tokens=tokens, e_local=local.e, routing=routing, mode=mode,
                             after_ms=med["after"], before_ms=med["before"],
                             after_over_before=med["before"] / med["after"], rounds_after=ms["after"],
                             rounds_before=ms["before"], bitwise_equal=bits[mode],
                             config_after=results["after"][2], config_before=results["before"][2]))
            print(f"{model} {routing} {mode}: after {med['after']:.3f} ms, before {med['before']:.3f} ms, "
                  f"speed {med['before'] / med['after']:.3f}x, equal bits {bits[mode]}", flush=True)
        write()
    print(f"\nwrote {path}\n")
    print("| slice | T | routing | pass | this tree ms | before ms | speed | equal bits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['mode']} | {r['after_ms']:.3f} | "
              f"{r['before_ms']:.3f} | {r['after_over_before']:.3f}x | {r['bitwise_equal']} |")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


def _slices(spec: str) -> list[tuple[str, int]]:
    """``model:tokens`` (a seed model's EP8 slice) or ``TxHxIxExK`` (one rank, no shared expert), comma-separated."""
    out = []
    for item in spec.split(","):
        if "x" in item:
            from kittenmoe.bench import parse_problem  # (run only: prepare needs no kittenmoe on the path)

            out.append((item, parse_problem(item)[0]))
            continue
        model, _, t = item.partition(":")
        out.append((model, int(t)))
    return out


def _routings(spec: str) -> list[str]:
    """``--routing``: a comma list of ``kittenmoe bench --routing`` names, each checked here."""
    from kittenmoe.bench.problems import parse_routing

    try:
        return [str(parse_routing(r)) for r in spec.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _modes(spec: str) -> list[str]:
    """``--modes``: a comma list of forward and forward+backward."""
    modes = spec.split(",")
    bad = [m for m in modes if m not in ("forward", "forward+backward")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown pass {bad}: forward, forward+backward")
    return modes


def _config(spec: str) -> dict:
    """``--config`` / ``--config-before``: KernelConfig overrides as ``kittenmoe bench --config`` reads them."""
    from kittenmoe.bench import parse_config_overrides

    return parse_config_overrides(spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="export a revision as kittenmoe_before under .ab/")
    pp.add_argument("rev")
    pr = sub.add_parser("run", help="time and compare both revisions on the GPU")
    pr.add_argument("--slices", type=_slices, default=_slices(
        "kimi-k2.7:2048,deepseek-v4-pro:2048,qwen3.5-397b-a17b:4096,glm-5.2:2048"))
    pr.add_argument("--config", type=_config, default={},
                    help="KernelConfig overrides k=v,... on both revisions' heuristic configs")
    pr.add_argument("--config-before", type=_config, default={},
                    help="more overrides on the prepared revision's config only (e.g. the kernel it is compared as)")
    pr.add_argument("--routing", type=_routings, default=["uniform"],
                    help="comma list of routings, each slice run under each: uniform | zipf[:alpha] | one-hot")
    pr.add_argument("--modes", type=_modes, default=_modes("forward,forward+backward"),
                    help="comma list: forward, forward+backward")
    pr.add_argument("--rounds", type=int, default=5)
    pr.add_argument("--rep-ms", type=int, default=100)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.rev)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
