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

``--gluon-build`` (no GPU: ``PYTHONPATH=src:tools``, with the device's Triton) instead compiles for sm_90 a Gluon
kernel whose TMA-loaded tile two CTAs of a cluster share (``cga_layout`` [[0, 0]], ``num_ctas=2``) and prints
the PTX's cluster and bulk-copy lines: Triton 3.6 gives ``.reqnctapercluster 2`` and one plain
``cp.async.bulk.tensor`` a CTA, no ``.multicast::cluster``.

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


def gluon_build() -> list[str]:
    """The sm_90 PTX lines of a 2-CTA Gluon kernel that name the cluster or issue a bulk tensor copy."""
    import torch
    from sm90_build import compile_only_sm90
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shared = [[0, 0]]  # both CTAs hold the whole tile: the layout a multicast load would fill
    tile_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=shared)
    bar_l = mbarrier.MBarrierLayout(cga_layout=[[0]])
    reg_l = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=shared)

    @gluon.jit
    def shared_tile(desc, out_ptr,  # desc: [256, 64] bf16 in blocks of [128, 64]; out_ptr: [128, 64]
                    TILE_L: gl.constexpr, BAR_L: gl.constexpr, REG_L: gl.constexpr):
        s = gl.allocate_shared_memory(gl.bfloat16, [128, 64], TILE_L)
        bar = gl.allocate_shared_memory(gl.int64, [1, 1], BAR_L)
        mbarrier.init(bar.index(0), count=1)
        fence_async_shared()
        mbarrier.expect(bar.index(0), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [0, 0], bar.index(0), s)
        mbarrier.wait(bar.index(0), 0)
        r = gl.arange(0, 128, gl.SliceLayout(1, REG_L))[:, None]
        c = gl.arange(0, 64, gl.SliceLayout(0, REG_L))[None, :]
        gl.store(out_ptr + r * 64 + c, s.load(REG_L))

    x = torch.randn(256, 64).to(torch.bfloat16)
    desc = TensorDescriptor.from_tensor(x, [128, 64], tile_l)
    with compile_only_sm90() as built:
        shared_tile[(1,)](desc, torch.empty(128, 64, dtype=torch.bfloat16), tile_l, bar_l, reg_l,
                          num_warps=4, num_ctas=2)
    ptx = built[-1].kernel.asm["ptx"]
    return [ln.strip() for ln in ptx.splitlines()
            if "cp.async.bulk.tensor" in ln or ln.strip().startswith((".explicitcluster", ".reqnctapercluster"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192,2048,768,128,8", help="T,H,I,E,K")
    ap.add_argument("--out", default=None, help="folder for cluster-probe-<shape>.json")
    ap.add_argument("--gluon-build", action="store_true", help="no GPU: the 2-CTA Gluon build's PTX lines")
    args = ap.parse_args()
    if args.gluon_build:
        lines = gluon_build()
        print("\n".join(lines))
        print(f"multicast loads: {sum('multicast::cluster' in ln for ln in lines)}")
        return
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
