"""What sharing a weight tile between two SMs by TMA multicast is worth to our GEMM tile, in Gluon, on one GPU.

Our megakernels' tiles read 48 KB of operands from L2 per K step (128 A rows and 256 weight rows of 64 K) for
4.2 MFLOP, and run at the L2 rate those bytes allow (docs/performance.md). A cluster of two CTAs computing two
row tiles against the same weight tile can load that tile once and multicast it into both (SonicMoE's QuACK GEMMs
do so on sm_90): 32 KB a K step per CTA instead of 48. Triton 3.6's Gluon cannot issue the multicast
(``cluster_probe.py --gluon-build``); Triton 3.9's can (``tma.async_load(..., multicast=True)`` into a shared
layout both CTAs of the cluster hold, ``cga_layout`` [[0, 0]]).

This probe times one grouped GEMM, C[e] = A[e] W[e]^T for E experts of R rows each (the routed rows of a
gate|up or down GEMM, every expert's row count a multiple of 256), as three kernels with the megakernels' tile
(128 x 256 a CTA, 64-deep K steps, a STAGES-deep TMA ring, two math warpgroups of m64n256 wgmmas):

- ``1cta``: one CTA a tile;
- ``2cta``: clusters of two CTAs, each loading its own copy of the shared weight tile (the cluster's cost alone);
- ``2cta-mc``: clusters of two CTAs, CTA 0 multicasting the weight tile into both; each CTA's consumers release a
  stage on a barrier of the pair (``allocate_mbarrier(two_ctas=True)``) that CTA 0 waits on before it refills.

Consecutive programs walk one expert's row tiles for one weight column tile, so the weight tile is in L2 for all of
them in every variant. Printed: each variant's median ms and TFLOP/s (``triton.testing.do_bench``), its ratio to
``1cta``, and its largest error against torch's bf16 matmul. Needs Triton >= 3.9 (Gluon's multicast and CGA
layouts): on the GPU machine, from a carried ``.triton-next`` (``scripts/triton_next.sh``)::

    eval "$(bash scripts/triton_next.sh unpack)"; PYTHONPATH=$TRITON_NEXT:src python3 benchmarks/probes/multicast_probe.py

``--build`` compiles the three kernels for sm_90 without a GPU and prints each one's cluster, TMA and wgmma
lines (``PYTHONPATH=src:tools``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

BM_CTA, BN, BK = 128, 256, 64  # a CTA's tile: 128 rows x 256 columns, 64-deep K steps (the megakernels')
VARIANTS = {"1cta": (1, False), "2cta": (2, False), "2cta-mc": (2, True)}  # name: (CTAs a cluster, multicast)
# (E, R, N, K): the routed GEMMs of Qwen3-30B-A3B's layer at 8,192 tokens (gate|up: N = 2I, K = H; down: N = H,
# K = I; 512 rows an expert under uniform routing) and of the fine-grained 32768 x 4096 x 512 x 128 x 8 problem
SHAPES = {"qwen3-gateup": (128, 512, 1536, 2048), "qwen3-down": (128, 512, 2048, 768),
          "fine-gateup": (128, 2048, 1024, 4096), "fine-down": (128, 2048, 4096, 512)}


@gluon.jit
def grouped_gemm(a_desc,  # A [E * R, K] bf16, blocks [BM_CTA * CTAS, BK]
                 w_desc,  # W [E * N, K] bf16 (each expert's N rows), blocks [BN, BK]
                 c_ptr,  # C [E * R, N] bf16
                 R, N, K,
                 CTAS: gl.constexpr, MC: gl.constexpr, STAGES: gl.constexpr, ACC_L: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]  # the cluster's rows (BM_CTA a CTA)
    BNW: gl.constexpr = w_desc.block_type.shape[0]
    BKW: gl.constexpr = w_desc.block_type.shape[1]
    tiles_m = R // BM
    tiles_n = N // BNW
    pid = gl.program_id(0)
    e = pid // (tiles_m * tiles_n)
    i = pid % (tiles_m * tiles_n)
    row = e * R + (i % tiles_m) * BM  # consecutive programs: one expert's row tiles, one weight column tile
    wrow = e * N + (i // tiles_m) * BNW
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)  # one a CTA: its A rows' and the weight tile's bytes
    if MC:
        empty = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)  # the pair's: both CTAs released a stage
    else:
        empty = ready  # (unused)
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        if MC:
            mbarrier.init(empty.index(j), count=1)  # one arrival a CTA (Triton counts the pair: 2)
    fence_async_shared()
    # bytes landing in each CTA a K step: its own A rows, and the whole weight tile (its own load, or CTA 0's
    # multicast)
    nbytes: gl.constexpr = (BM // CTAS) * BKW * 2 + BNW * BKW * 2
    kt = K // BKW
    for j in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(j), nbytes, pred=j < kt)
        tma.async_load(a_desc, [row, j * BKW], ready.index(j), a_s.index(j), pred=j < kt)
        tma.async_load(w_desc, [wrow, j * BKW], ready.index(j), w_s.index(j), pred=j < kt, multicast=MC)
    acc = gl.zeros((BM, BNW), dtype=gl.float32, layout=ACC_L)
    for k in range(kt):
        st = k % STAGES
        mbarrier.wait(ready.index(st), (k // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(st), w_s.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # step k - 1's wgmma is done: its stage, (k - 1) % STAGES, takes step k + STAGES - 1
        kn = k + STAGES - 1
        sn = kn % STAGES
        if MC:
            mbarrier.arrive(empty.index(sn), pred=k > 0)  # this CTA has read the stage (CTA 0's barrier)
            # CTA 0 (the only waiter on a pair barrier) refills once both CTAs released the stage's last fill
            mbarrier.wait(empty.index(sn), ((kn // STAGES) & 1) ^ 1, pred=(kn < kt) & (kn >= STAGES))
        mbarrier.expect(ready.index(sn), nbytes, pred=kn < kt)
        tma.async_load(a_desc, [row, kn * BKW], ready.index(sn), a_s.index(sn), pred=kn < kt)
        tma.async_load(w_desc, [wrow, kn * BKW], ready.index(sn), w_s.index(sn), pred=kn < kt, multicast=MC)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    r = row + gl.arange(0, BM, gl.SliceLayout(1, ACC_L))
    c = (wrow - e * N) + gl.arange(0, BNW, gl.SliceLayout(0, ACC_L))
    gl.store(c_ptr + r.to(gl.int64)[:, None] * N + c[None, :], acc.to(gl.bfloat16))


def layouts(ctas: int, mc: bool):
    """(A, W, accumulator) layouts of a variant: A's rows split over the cluster's CTAs, W's tile held whole by
    each (broadcast: what a multicast fills), the accumulator's rows split as A's."""
    split = [[1, 0]] if ctas == 2 else []
    whole = [[0, 0]] if ctas == 2 else []
    a_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=split)
    w_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=whole)
    acc_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16],
                                      cga_layout=split)
    return a_l, w_l, acc_l


def launch(variant: str, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, e: int, r: int, n: int, k: int,
           stages: int = 4):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    ctas, mc = VARIANTS[variant]
    a_l, w_l, acc_l = layouts(ctas, mc)
    bm = BM_CTA * ctas
    a_d = TensorDescriptor.from_tensor(a, [bm, BK], a_l)
    w_d = TensorDescriptor.from_tensor(w, [BN, BK], w_l)
    grid = (e * (r // bm) * (n // BN),)
    return grouped_gemm[grid](a_d, w_d, c, r, n, k, CTAS=ctas, MC=mc, STAGES=stages, ACC_L=acc_l, num_warps=8,
                              num_ctas=ctas)


def build() -> None:
    """Compile every variant for sm_90 (no GPU) and print its cluster, TMA and wgmma lines' counts."""
    from sm90_build import compile_only_sm90

    e, r, n, k = 2, 256, 256, 256
    a = torch.randn(e * r, k).to(torch.bfloat16)
    w = torch.randn(e * n, k).to(torch.bfloat16)
    for v in VARIANTS:
        with compile_only_sm90() as built:
            launch(v, a, w, torch.empty(e * r, n, dtype=torch.bfloat16), e, r, n, k)
        ptx = built[-1].kernel.asm["ptx"]
        lines = [ln.strip() for ln in ptx.splitlines()]
        print(f"{v}: cluster {next((ln for ln in lines if ln.startswith('.reqnctapercluster')), 'none')}, "
              f"{sum('cp.async.bulk.tensor' in ln and 'multicast' not in ln for ln in lines)} TMA loads, "
              f"{sum('multicast::cluster' in ln for ln in lines)} multicast, "
              f"{sum('wgmma.mma_async' in ln for ln in lines)} wgmma, {built[-1].shared} B shared")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES, or E:R:N:K")
    ap.add_argument("--build", action="store_true", help="compile for sm_90 only (no GPU)")
    ap.add_argument("--out", default=None, help="folder for multicast-probe.json")
    args = ap.parse_args()
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        sys.exit(f"needs Triton >= 3.9 (Gluon multicast and CGA layouts), got {triton.__version__}: "
                 f"scripts/triton_next.sh")
    if args.build:
        build()
        return
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    rows = []
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for name in args.shapes.split(","):
        e, r, n, k = SHAPES[name] if name in SHAPES else (int(v) for v in name.split(":"))
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(e * r, k, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(e * n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16)
        ref = torch.cat([a[i * r:(i + 1) * r] @ w[i * n:(i + 1) * n].T for i in range(e)])
        flop = 2.0 * e * r * n * k
        base = None
        for v in VARIANTS:
            c = torch.full((e * r, n), float("nan"), device=dev, dtype=torch.bfloat16)
            try:
                launch(v, a, w, c, e, r, n, k)
                torch.cuda.synchronize()
                err = float((c.float() - ref.float()).abs().max())
                ms = triton.testing.do_bench(lambda v=v, c=c: launch(v, a, w, c, e, r, n, k), warmup=25, rep=200,
                                             return_mode="median")
            except Exception as exc:  # a variant that fails to build or run is reported, the others still run
                print(f"  {name} {v}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append(dict(shape=name, e=e, r=r, n=n, k=k, variant=v, error=str(exc)[:1000]))
                continue
            base = ms if v == "1cta" else base
            rows.append(dict(shape=name, e=e, r=r, n=n, k=k, variant=v, ms=ms, tflops=flop / ms / 1e9,
                             max_err=err, x_1cta=None if base is None else base / ms))
            print(f"  {name:<14}{v:<9}{ms:8.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s  x1cta "
                  f"{(base / ms) if base else float('nan'):.3f}  max err {err:.3g}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multicast-probe.json"), "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
