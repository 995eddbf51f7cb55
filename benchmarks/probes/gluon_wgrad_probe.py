"""Can a warp-specialized Gluon kernel hide the weight-gradient tiles' fill? A probe, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/probes/gluon_wgrad_probe.py [--shapes kimi-k2.7,deepseek-v4-pro] [--jobs dw13,dw2]
    PYTHONPATH=.triton-device:src python benchmarks/probes/gluon_wgrad_probe.py --build   # no GPU: sm_90 build only

Why (docs/performance.md, "Backward: phase A, phase B, weight gradients"): with the Triton kernel the four
weight-gradient launches were the largest part of a forward+backward (Kimi slice: 3.45 of ~9.7 ms of GPU time, 470
TFLOP/s; their floors are 2.0 ms of MMAs at the measured dense rate and 0.96 ms of stores, which can overlap). A
tile sums an expert's ~341 rows (Kimi) in six 64-row steps, so each tile pays its pipeline fill, the drain of its
last wgmma and its epilogue: the Triton persistent form (``weight_grad_persistent_kernel``) drains the store under
the next tile, but Triton 3.6 does not pipeline the next tile's first loads across the data-dependent K loop
(docs/design.md, "Weight gradients").

The kernel (the library's, ``kittenmoe/kernels/wgrad_gluon.py``, ``KernelConfig.wgrad="gluon"``): one program per SM
walking the library's tiles in the library's order; a producer warp keeps a 3-deep TMA ring full across tile
boundaries (the next tile's first steps load while this tile's last steps and its epilogue run), and two 4-warp
math groups each own 64 of the tile's 128 rows, each storing its half through its own shared-memory buffer and a
TMA bulk store drained under the next tile. Each output element is still one fp32 sum over the expert's rows in
order, 16 rows a wgmma: the Triton kernel's bits, checked here. Variants timed with it and
removed, none faster: rings of shorter steps (32 x 6 and 16 x 12 stages), a two-stream form (two producer warps and
math groups an SM, each on its own 128 x 128 tiles) and a short last step (at most 32 rows, only the wgmmas that
hold rows, peeled off the loop): docs/experiments/wgrad-gluon-shorter-steps.md, wgrad-gluon-two-streams.md,
wgrad-gluon-short-last-step.md.

Beside it in the same run: the library's launch as the backward makes it, and torch._grouped_mm (cutlass), the
baseline's weight gradients.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton


def launch_gluon(order, offsets, counts, p_op, q_op, out, progs: int):
    """The library's Gluon launch (``kittenmoe.kernels.wgrad_gluon``, ``KernelConfig.wgrad="gluon"``) as the backward
    makes it: 128 x 256 tiles of 64-row steps, 3 stages."""
    from kittenmoe.kernels import wgrad_gluon

    G, N, M = out.shape
    return wgrad_gluon.launch(order, offsets, counts, p_op, q_op, out, N, M, 64, 256, progs)


def launch_library(order, offsets, counts, p_op, q_op, out, progs: int):
    """The backward's d_W launch with the default CUDA config: ``weight_grad_persistent_kernel``, 128 x 256 tiles
    of 64-row steps, 8 warps, the TMA store (3 stages), one program an SM (kittenmoe.launch_backward)."""
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    from kittenmoe.kernels import megakernel_bwd as mb

    G, N, M = out.shape
    wn, wm, wk = 128, 256, 64
    tiles = G * triton.cdiv(N, wn) * triton.cdiv(M, wm)
    return mb.weight_grad_persistent_kernel[(min(tiles, progs),)](
        order, offsets, counts, TD.from_tensor(p_op, [wk, wn]), TD.from_tensor(q_op, [wk, wm]), out,
        TD.from_tensor(out.view(-1, M), [wn, wm]), N, M, p_op.stride(0), q_op.stride(0), tiles,
        WN=wn, WM=wm, WK=wk, USE_TMA=True, TMA_STORE=True, DOT_FP32=False, PRECISION="tf32", num_warps=8,
        num_stages=3)


def build_report() -> int:
    """Build the Gluon kernel for sm_90 without a GPU and print registers, stack, shared memory, TMA copies."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    from sm90_build import compile_only_sm90

    G, rows, N, M = 2, 256, 256, 512
    offsets = torch.arange(G + 1, dtype=torch.int32) * rows
    p = torch.zeros(G * rows, N, dtype=torch.bfloat16)
    q = torch.zeros(G * rows, M, dtype=torch.bfloat16)
    out = torch.zeros(G, N, M, dtype=torch.bfloat16)
    with compile_only_sm90() as built:
        launch_gluon(torch.arange(G, dtype=torch.int32), offsets, offsets[1:], p, q, out, 132)
    for kb in built:
        print(f"{kb.line()}")
        ptx = kb.kernel.asm["ptx"]
        print("  TMA loads", ptx.count("cp.async.bulk.tensor.2d.shared"), "stores",
              ptx.count("cp.async.bulk.tensor.2d.global"), "wgmma", ptx.count("wgmma.mma_async"),
              "bar.sync", ptx.count("bar.sync"), "setmaxnreg", ptx.count("setmaxnreg"))
        print("  ptxas:", ptxas_notes(ptx) or "no notes", "| wgmma descriptors unset on some path:",
              list(kb.hgmma_unset) or "none")
    return 0


def ptxas_notes(ptx: str) -> str:
    """ptxas's notes on a PTX for sm_90a, e.g. 'wgmma.mma_async instructions are serialized' (C7515: an
    accumulator touched while a wgmma is in flight makes ptxas wait after every wgmma, correct but slow)."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=300)
    notes = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "Performance" in ln or "error" in ln.lower()]
    if r.returncode:
        notes.append(f"ptxas exit {r.returncode}")
    return "; ".join(notes)


def ragged(L: int, routed: int, pad: int, wk: int, dev, gen):
    """Expert row counts of uniform top-k routing (multinomial) and segments padded to ``pad`` rows (the kernels
    sum each expert's rows up to its count rounded to ``wk``)."""
    counts = torch.bincount(torch.randint(0, L, (routed,), generator=gen), minlength=L)
    seg = (counts + pad - 1) // pad * pad
    offsets = torch.zeros(L + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(seg, 0)
    return counts, offsets.to(torch.int32).to(dev), counts.to(torch.int32).to(dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,deepseek-v4-pro")
    ap.add_argument("--jobs", default="dw13,dw2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--build", action="store_true", help="build for sm_90 only (no GPU)")
    args = ap.parse_args()
    if args.build:
        return build_report()
    from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS as SLICES

    dev = torch.device("cuda")
    progs = torch.cuda.get_device_properties(dev).multi_processor_count
    lines = []
    for name in args.shapes.split(","):
        base = SEED_SHAPES[name]
        L, T = base.e // 8, SLICES[name]
        gen = torch.Generator().manual_seed(0)
        counts, offsets, rows_of = ragged(L, T * base.k, 128, 64, dev, gen)
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
            order = torch.sort(counts, descending=True, stable=True).indices.to(torch.int32).to(dev)  # the schedule's
            variants = {"library": lambda: launch_library(order, offsets, rows_of, p, q, out, progs),
                        "grouped_mm": lambda: torch._grouped_mm(p.T, q, offs=offs_gm, out_dtype=torch.bfloat16)}
            variants["gluon"] = lambda: launch_gluon(order, offsets, rows_of, p, q, out, progs)
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
                line = f"{name:<16} {job:<5} {label:<12} {ms:7.3f} ms {flop / ms / 1e9:5.0f} TF/s  {check}"
                print(line, flush=True)
                lines.append(line)
            if "library" in res:
                for label, ms in res.items():
                    if label != "library":
                        lines.append(f"{name:<16} {job:<5} {label:<12} library / this = {res['library'] / ms:.3f}")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
