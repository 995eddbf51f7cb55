"""Can a warp-specialized Gluon kernel hide the weight-gradient tiles' fill? A probe, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/gluon_wgrad_probe.py [--shapes kimi-k2.7,deepseek-v4-pro] [--jobs dw13,dw2]
    PYTHONPATH=.triton-device:src python benchmarks/gluon_wgrad_probe.py --build   # no GPU: sm_90 build only

Why (docs/perf-notes.md, session 15): the four weight-gradient launches are the largest part of a forward+backward
now (Kimi slice: 3.45 of ~9.7 ms of GPU time, 470 TFLOP/s; their floors are 2.0 ms of MMAs at the measured dense
rate and 0.96 ms of stores, which can overlap). A tile sums an expert's ~341 rows (Kimi) in six 64-row steps, so
each tile pays its pipeline fill, the drain of its last wgmma and its epilogue: the library's persistent form
(``weight_grad_persistent_kernel``) drains the store under the next tile, but Triton 3.6 does not pipeline the
next tile's first loads across the data-dependent K loop (perf-notes, "why wgrad_persistent cannot take the
tutorial's form").

The kernel (now the library's, ``kittenmoe/kernels/wgrad_gluon.py``, KernelConfig.wgrad_gluon): one program per SM
walking the library's tiles in the library's order; a producer warp keeps a 3-deep TMA ring full across tile
boundaries (the next tile's first steps load while this tile's last steps and its epilogue run), and two 4-warp
math groups each own 64 of the tile's 128 rows, each storing its half through its own shared-memory buffer and a
TMA bulk store drained under the next tile. Each output element is still one fp32 sum over the expert's rows in
order, 16 rows a wgmma: the Triton kernel's bits, checked here. The first runs (2026-12-03) also timed rings of
shorter steps, 32 x 6 and 16 x 12 stages: no faster (docs/perf-notes.md, session 15).

Beside it in the same run: the library's launch as the backward makes it, and torch._grouped_mm (cutlass), the
baseline's weight gradients.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

from kittenmoe.kernels.wgrad_gluon import _tile_at


@gluon.jit
def _two_consume(p_s, q_s, c_s, ready, empty, out_desc, offsets_ptr, ends_ptr, N, M, tiles,
                 GRP: gl.constexpr, STAGES: gl.constexpr):
    """Variant ``two``: math group GRP runs whole 128 x WM tiles (two m64 wgmmas a k16 step) of its own ring: the
    program's tiles j = GRP, GRP + 2, ... Two such streams share the SM, so one's drain and epilogue can run
    under the other's wgmmas."""
    WK: gl.constexpr = p_s.shape[1]
    WN: gl.constexpr = p_s.shape[2]
    WM: gl.constexpr = q_s.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WM, 16])
    it = 0
    for t in range(gl.program_id(0) + GRP * gl.num_programs(0), tiles, 2 * gl.num_programs(0)):
        g, n0, m0, seg0, seg1 = _tile_at(t, offsets_ptr, ends_ptr, N, M, WN, WM)
        acc = gl.zeros((WN, WM), dtype=gl.float32, layout=layout)
        for r in range(seg0, seg1, WK):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            acc = warpgroup_mma(p_s.index(st).permute((1, 0)), q_s.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=r > seg0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=seg1 > seg0)
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        c_s.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [g * N + n0, m0], c_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _two_produce(p_desc, q_desc, p_s, q_s, ready, empty, offsets_ptr, ends_ptr, N, M, tiles,
                 GRP: gl.constexpr, STAGES: gl.constexpr):
    WK: gl.constexpr = p_desc.block_type.shape[0]
    WN: gl.constexpr = p_desc.block_type.shape[1]
    WM: gl.constexpr = q_desc.block_type.shape[1]
    it = 0
    for t in range(gl.program_id(0) + GRP * gl.num_programs(0), tiles, 2 * gl.num_programs(0)):
        g, n0, m0, seg0, seg1 = _tile_at(t, offsets_ptr, ends_ptr, N, M, WN, WM)
        for r in range(seg0, seg1, WK):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), p_desc.block_type.nbytes + q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p_desc, [r, n0], ready.index(st), p_s.index(st))
            tma.async_copy_global_to_shared(q_desc, [r, m0], ready.index(st), q_s.index(st))
            it += 1


@gluon.jit
def _two_partition(ROLE: gl.constexpr, p_desc, q_desc, out_desc, p0_s, q0_s, p1_s, q1_s, c0_s, c1_s, ready0,
                   empty0, ready1, empty1, offsets_ptr, ends_ptr, N, M, tiles, STAGES: gl.constexpr):
    """ROLE 0 / 1: math groups of streams 0 / 1; ROLE 2 / 3: their producer warps."""
    if ROLE == 0:
        _two_consume(p0_s, q0_s, c0_s, ready0, empty0, out_desc, offsets_ptr, ends_ptr, N, M, tiles, 0, STAGES)
    elif ROLE == 1:
        _two_consume(p1_s, q1_s, c1_s, ready1, empty1, out_desc, offsets_ptr, ends_ptr, N, M, tiles, 1, STAGES)
    elif ROLE == 2:
        _two_produce(p_desc, q_desc, p0_s, q0_s, ready0, empty0, offsets_ptr, ends_ptr, N, M, tiles, 0, STAGES)
    else:
        _two_produce(p_desc, q_desc, p1_s, q1_s, ready1, empty1, offsets_ptr, ends_ptr, N, M, tiles, 1, STAGES)


@gluon.jit
def gluon_wgrad_two_kernel(
    offsets_ptr,  # [G + 1] int32, first row of each group's segment
    ends_ptr,  # [G] int32, end of the rows summed
    p_desc,  # P [rows, N] descriptor, blocks [WK, WN]
    q_desc,  # Q [rows, M] descriptor, blocks [WK, WM]
    out_desc,  # out [G * N, M] descriptor, blocks [WN, WM]
    N, M, tiles,
    STAGES: gl.constexpr,
):
    """Variant ``two``: two independent tile streams an SM (a ring, a producer warp and a 4-warp math group
    each), WN x WM tiles (128 x 128: 64 FLOP an operand byte against the library's 85)."""
    p0_s = gl.allocate_shared_memory(p_desc.dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    q0_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    p1_s = gl.allocate_shared_memory(p_desc.dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    q1_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    c0_s = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    c1_s = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready0.index(i), count=1)
        mbarrier.init(empty0.index(i), count=1)
        mbarrier.init(ready1.index(i), count=1)
        mbarrier.init(empty1.index(i), count=1)
    args = (p_desc, q_desc, out_desc, p0_s, q0_s, p1_s, q1_s, c0_s, c1_s, ready0, empty0, ready1, empty1,
            offsets_ptr, ends_ptr, N, M, tiles, STAGES)
    gl.warp_specialize([(_two_partition, (0,) + args), (_two_partition, (1,) + args), (_two_partition, (2,) + args),
                        (_two_partition, (3,) + args)], [4, 1, 1], [224, 24, 24])


def launch_two(offsets, ends, p_op, q_op, out, progs: int, stages: int = 2, wm: int = 128):
    """Variant ``two``: 128 x wm tiles, two streams an SM, ``stages`` a ring."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    G, N, M = out.shape
    wk, wn = 64, 128
    lay = gl.NVMMASharedLayout.get_default_for
    bf = gl.bfloat16
    p_desc = TensorDescriptor.from_tensor(p_op, [wk, wn], lay([wk, wn], bf))
    q_desc = TensorDescriptor.from_tensor(q_op, [wk, wm], lay([wk, wm], bf))
    out_desc = TensorDescriptor.from_tensor(out.view(G * N, M), [wn, wm], lay([wn, wm], bf))
    tiles = G * (N // wn) * triton.cdiv(M, wm)
    return gluon_wgrad_two_kernel[(min(triton.cdiv(tiles, 2), progs),)](
        offsets, ends, p_desc, q_desc, out_desc, N, M, tiles, STAGES=stages, num_warps=4, maxnreg=168)


def launch_gluon(offsets, ends, p_op, q_op, out, progs: int):
    """The library's Gluon launch (``kittenmoe.kernels.wgrad_gluon``, KernelConfig.wgrad_gluon) as the backward
    makes it: 128 x 256 tiles of 64-row steps, 3 stages."""
    from kittenmoe.kernels import wgrad_gluon

    G, N, M = out.shape
    return wgrad_gluon.launch(offsets, ends, p_op, q_op, out, N, M, 64, 256, progs)


def launch_library(offsets, ends, p_op, q_op, out, progs: int):
    """The backward's d_W launch with the default CUDA config: ``weight_grad_persistent_kernel``, 128 x 256 tiles
    of 64-row steps, 8 warps, the TMA store (3 stages), one program an SM (kittenmoe.ops)."""
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    from kittenmoe.kernels import megakernel_bwd as mb

    G, N, M = out.shape
    wn, wm, wk = 128, 256, 64
    tiles = G * triton.cdiv(N, wn) * triton.cdiv(M, wm)
    return mb.weight_grad_persistent_kernel[(min(tiles, progs),)](
        offsets, ends, TD.from_tensor(p_op, [wk, wn]), TD.from_tensor(q_op, [wk, wm]), out,
        TD.from_tensor(out.view(-1, M), [wn, wm]), N, M, p_op.stride(0), q_op.stride(0), tiles,
        WN=wn, WM=wm, WK=wk, USE_TMA=True, TMA_STORE=True, DOT_FP32=False, PRECISION="tf32", num_warps=8,
        num_stages=3)


def build_report() -> int:
    """Build the Gluon kernel for sm_90 without a GPU and print registers, stack, shared memory, TMA copies."""
    os.environ.pop("TRITON_INTERPRET", None)
    from kittenmoe.sm90_build import compile_only_sm90

    G, rows, N, M = 2, 256, 256, 512
    offsets = torch.arange(G + 1, dtype=torch.int32) * rows
    p = torch.zeros(G * rows, N, dtype=torch.bfloat16)
    q = torch.zeros(G * rows, M, dtype=torch.bfloat16)
    out = torch.zeros(G, N, M, dtype=torch.bfloat16)
    with compile_only_sm90() as built:
        launch_gluon(offsets, offsets[1:], p, q, out, 132)
        for st in (2,):
            launch_two(offsets, offsets[1:], p, q, out, 132, st)
    for kb in built:
        print(f"{kb.line()}")
        ptx = kb.kernel.asm["ptx"]
        print("  TMA loads", ptx.count("cp.async.bulk.tensor.2d.shared"), "stores",
              ptx.count("cp.async.bulk.tensor.2d.global"), "wgmma", ptx.count("wgmma.mma_async"),
              "bar.sync", ptx.count("bar.sync"), "setmaxnreg", ptx.count("setmaxnreg"))
    return 0


def ragged(L: int, routed: int, pad: int, wk: int, dev, gen):
    """Expert row counts of uniform top-k routing (multinomial), segments padded to ``pad`` rows, the rows summed
    up to the count rounded to ``wk`` (the backward's ``ends``)."""
    counts = torch.bincount(torch.randint(0, L, (routed,), generator=gen), minlength=L)
    seg = (counts + pad - 1) // pad * pad
    offsets = torch.zeros(L + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(seg, 0)
    ends = offsets[:-1] + (counts + wk - 1) // wk * wk
    return counts, offsets.to(torch.int32).to(dev), ends.to(torch.int32).to(dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,deepseek-v4-pro")
    ap.add_argument("--jobs", default="dw13,dw2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--build", action="store_true", help="build for sm_90 only (no GPU)")
    args = ap.parse_args()
    if args.build:
        return build_report()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fwd_round import SLICES

    from kittenmoe.config import SEED_SHAPES

    dev = torch.device("cuda")
    progs = torch.cuda.get_device_properties(dev).multi_processor_count
    lines = []
    for name in args.shapes.split(","):
        base = SEED_SHAPES[name]
        L, T = base.e // 8, SLICES[name]
        gen = torch.Generator().manual_seed(0)
        counts, offsets, ends = ragged(L, T * base.k, 128, 64, dev, gen)
        rows = int(offsets[-1])
        for job in args.jobs.split(","):
            N, M = (2 * base.i, base.h) if job == "dw13" else (base.h, base.i)
            p = torch.randn(rows, N, generator=gen).to(torch.bfloat16)
            q = torch.randn(rows, M, generator=gen).to(torch.bfloat16)
            for e in range(L):  # the padding rows are zeros, as the pull writes them
                lo, n = int(offsets[e]), int(counts[e])
                p[lo + n:int(offsets[e + 1])] = 0
                q[lo + n:int(offsets[e + 1])] = 0
            p, q = p.to(dev), q.to(dev)
            out = torch.empty(L, N, M, dtype=torch.bfloat16, device=dev)
            flop = 2.0 * int(counts.sum()) * N * M
            ref = None
            res = {}
            offs_gm = offsets[1:].clone()
            variants = {"library": lambda: launch_library(offsets, ends, p, q, out, progs),
                        "grouped_mm": lambda: torch._grouped_mm(p.T, q, offs=offs_gm, out_dtype=torch.bfloat16)}
            variants["gluon"] = lambda: launch_gluon(offsets, ends, p, q, out, progs)
            if N % 128 == 0:
                variants["two x 128"] = lambda: launch_two(offsets, ends, p, q, out, progs)
            for label, fn in variants.items():
                out.fill_(float("nan"))  # unwritten tiles show
                try:
                    got = fn()
                    torch.cuda.synchronize()
                except Exception as exc:  # a variant that does not build or launch is reported; the rest still run
                    print(f"  {name} {job} {label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    continue
                val = got if label == "grouped_mm" else out
                if ref is None:
                    ref = out.clone()
                    check = "reference"
                else:
                    same = torch.equal(val, ref)
                    err = ((val.float() - ref.float()).abs().sum() / ref.float().abs().sum()).item()
                    check = f"bits equal {same}, rel L1 {err:.1e}, NaN {bool(val.isnan().any())}"
                ms = triton.testing.do_bench(fn, warmup=10, rep=args.reps * 10, return_mode="median")
                res[label] = ms
                line = f"{name:<16} {job:<5} {label:<11} {ms:7.3f} ms {flop / ms / 1e9:5.0f} TF/s  {check}"
                print(line, flush=True)
                lines.append(line)
            if "library" in res:
                for label, ms in res.items():
                    if label != "library":
                        lines.append(f"{name:<16} {job:<5} {label:<11} library / this = {res['library'] / ms:.3f}")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
