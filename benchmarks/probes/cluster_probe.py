"""What a 2-CTA cluster that multicasts the weight tile is worth to each of SonicMoE's GEMMs, on one GPU.

SonicMoE's QuACK GEMMs on sm_90 only ever run in clusters of two CTAs (cluster 2 x 1 or 1 x 2), where one TMA
load fills both CTAs' shared memory with the tile they share. Triton 3.6 (and its Gluon) builds 2-CTA clusters
but issues one plain TMA load a CTA (no ``.multicast::cluster``), so our megakernels cannot share a weight tile
that way. This probe measures what that is worth where SonicMoE uses it: each autotuned GEMM of one SonicMoE
forward+backward (``--shape T,H,I,E,K``, bf16, uniform top-k routing) gets, beside each of its candidates, the
same candidate with a 1 x 1 cluster, and QuACK's autotuner times them all (its ``do_bench``: 5 warm-up, 25 ms
of timed calls, median). Printed per GEMM call: the fastest 2-CTA candidate, the same tile alone, and the
fastest single-CTA candidate; ``--out`` gets the JSON.

    PYTHONPATH=src python3 benchmarks/probes/cluster_probe.py --shape 8192,2048,768,128,8 --out $OUT

SonicMoE from a carried .sonic (``eval "$(bash scripts/sonicmoe_wheels.sh unpack)"``); the single-CTA candidates
compile on the first call unless ``scripts/sonic_precompile.py --single-cta`` built them (about 25 s of compile
a GEMM call on the GPU machine's 16 cores otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import sys
import time


def add_single_cta_candidates() -> None:
    """Every autotuned QuACK GEMM also tries each of its 2-CTA candidates with a 1 x 1 cluster."""
    import quack.autotuner as quack_autotuner
    import quack.gemm_interface as quack_gemm

    for name in dir(quack_gemm):
        tuner = getattr(quack_gemm, name)
        if not isinstance(tuner, quack_autotuner.Autotuner):
            continue
        seen = {str(c) for c in tuner.configs}
        extra = []
        for c in tuner.configs:
            single = dataclasses.replace(c.kwargs["config"], cluster_m=1, cluster_n=1)
            cand = quack_autotuner.AutotuneConfig(config=single)
            if str(cand) not in seen:
                seen.add(str(cand))
                extra.append(cand)
        tuner.configs = tuner.configs + extra


_TIMING = re.compile(r"^\[config: GemmConfig\((?P<cfg>[^)]*)\)\] -> (?P<ms>[0-9.]+|inf)ms$")
_DONE = re.compile(r"autotuning for function (?P<fn>\w+) finished")


def parse(log: str) -> list[dict]:
    """The autotuner's printout, one entry a GEMM call: its candidates' (tile, pingpong, cluster, ms)."""
    calls, cur = [], []
    for line in log.splitlines():
        m = _TIMING.match(line.strip())
        if m:
            f = dict(kv.split("=") for kv in m["cfg"].split(", "))
            cur.append({"tile": (int(f["tile_m"]), int(f["tile_n"])), "pingpong": f["pingpong"] == "True",
                        "cluster": (int(f["cluster_m"]), int(f["cluster_n"])), "swap_ab": f["swap_ab"] == "True",
                        "ms": float(m["ms"])})
            continue
        m = _DONE.search(line)
        if m and cur:
            calls.append({"gemm": m["fn"], "candidates": cur})
            cur = []
    return calls


def summarise(call: dict) -> dict:
    cands = [c for c in call["candidates"] if c["ms"] != float("inf")]
    duo = [c for c in cands if c["cluster"] != (1, 1)]
    solo = [c for c in cands if c["cluster"] == (1, 1)]
    best_duo = min(duo, key=lambda c: c["ms"]) if duo else None
    best_solo = min(solo, key=lambda c: c["ms"]) if solo else None
    same = None
    if best_duo:
        same = next((c for c in solo if (c["tile"], c["pingpong"], c["swap_ab"]) ==
                     (best_duo["tile"], best_duo["pingpong"], best_duo["swap_ab"])), None)
    return {"gemm": call["gemm"], "best_2cta": best_duo, "same_tile_1cta": same, "best_1cta": best_solo}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192,2048,768,128,8", help="T,H,I,E,K")
    ap.add_argument("--out", default=None, help="folder for cluster-probe-<shape>.json")
    args = ap.parse_args()
    T, H, I, E, K = (int(v) for v in args.shape.split(","))
    os.environ["QUACK_PRINT_AUTOTUNING"] = "1"
    os.environ["QUACK_FORCE_CACHE_UPDATE"] = "1"  # time every candidate even where a tuning result is cached

    import torch

    from kittenmoe.baselines_sonic import sonicmoe_forward, sonicmoe_prepare
    from kittenmoe.testing import routing_uniform

    add_single_cta_candidates()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16).requires_grad_()
    ids, w = routing_uniform(T, E, K, generator=g, device=dev)
    w = w.requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dev, torch.bfloat16)
    a, b = (t.requires_grad_() for t in sonicmoe_prepare(w13, w2))
    buf = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(buf):
        y = sonicmoe_forward(x, ids, w, a, b)
        y.backward(torch.randn_like(y))
        torch.cuda.synchronize()
    log = buf.getvalue()
    sys.stdout.write(log)
    calls = [summarise(c) for c in parse(log)]
    print(f"\n{args.shape}: {len(calls)} autotuned GEMM calls in {time.time() - t0:.0f} s "
          f"({torch.cuda.get_device_name()})")
    print(f"{'gemm':<20}{'best 2-CTA':>34}{'ms':>8}{'same tile 1-CTA ms':>20}{'x':>7}{'best 1-CTA':>30}{'ms':>8}")
    for c in calls:
        d, s, o = c["best_2cta"], c["same_tile_1cta"], c["best_1cta"]

        def name(v):
            return "-" if v is None else f"{v['tile'][0]}x{v['tile'][1]} {'pp' if v['pingpong'] else 'coop'} " \
                                         f"c{v['cluster'][0]}x{v['cluster'][1]}"
        ratio = f"{s['ms'] / d['ms']:.3f}" if d and s else "-"
        print(f"{c['gemm']:<20}{name(d):>34}{d['ms'] if d else 0:>8.3f}{s['ms'] if s else 0:>20.3f}{ratio:>7}"
              f"{name(o):>30}{o['ms'] if o else 0:>8.3f}")
    if args.out:
        path = pathlib.Path(args.out) / f"cluster-probe-{args.shape.replace(',', '-')}.json"
        path.write_text(json.dumps({"shape": args.shape, "gpu": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "calls": calls,
                                    "command": " ".join(sys.argv)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
