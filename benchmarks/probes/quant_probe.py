"""Why was the FP8 forward's quantising pull 5x slower than the BF16 pull? A probe, not a benchmark of record.

    PYTHONPATH=src python3 benchmarks/probes/quant_probe.py [--shape kimi-k2.7] [--progs 16,132] [--warps 4,8]

A standalone kernel gathers the routed rows of one EP8 slice (T*K rows of x, as the pull does) in
[ROWS, BLOCK_H] chunks on a few programs, in one of these modes:

- ``copy``: bf16 rows copied (the BF16 pull);
- ``lib``: quantised as the megakernels do (``quantize_rows_1xb``: 1 x 128 amax over a reshape of the chunk, one
  correctly rounded reciprocal a block and a multiply an element, hardware e4m3 conversion);
- ``recip``: the same rule written out in the probe;
- ``nodiv``: amax and scales, then the conversion of x itself (what is left without any division);
- ``div128`` / ``recip128``: chunks one scale block wide (BLOCK_H = 128), the amax a plain row reduction;
  ``div128`` divides every element (``div.rn``), the rule the megakernels had before this probe.

What it answered (H200, Kimi slice, 16 programs): the copy 0.343 ms, dividing every element 1.399, one reciprocal a
block 0.595, amax and scales with no division 0.523; so the correctly rounded division was most of the cost, and
the scale rule became ``e4m3(x * RN(1 / scale))`` (kittenmoe.fp8's docstring). The bits of ``recip`` and ``div128``
differ in about one value in 2,000; with power-of-two scales they agree.

Prints ms, GB/s (bytes read + written) and GB/s per program for each (mode, programs, warps, chunk).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS
from kittenmoe.kernels.quant import E4M3_MAX, MIN_SCALE, quantize_rows_1xb

MODES = {"copy": 0, "lib": 1, "recip": 2, "nodiv": 3, "div128": 4, "recip128": 5}
SLICES = SLICE_TOKENS  # kittenmoe.config: the seed slices' tokens at EP8


@triton.jit
def _probe_kernel(
    x_ptr,  # [T, H] bf16 source rows
    idx_ptr,  # [N] int32: source row of each routed row
    q_ptr,  # [N, H] uint8 e4m3 bits (modes 1..5)
    s_ptr,  # [N, H // SB] fp32 scales (modes 1..5)
    y_ptr,  # [N, H] bf16 (mode 0)
    N, H,
    MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, SB: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    HB = H // SB
    for ch in range(pid, tl.cdiv(N, ROWS), nprog):
        r = ch * ROWS + tl.arange(0, ROWS)
        ok = r < N
        src = tl.load(idx_ptr + r, mask=ok, other=0).to(tl.int64) * H
        dst = r.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(x_ptr + src[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
            if MODE == 0:
                tl.store(y_ptr + dst[:, None] * H + cols[None, :], v, mask=ok[:, None])
            else:
                vf = v.to(tl.float32)
                if MODE == 1:
                    bits, scale = quantize_rows_1xb(vf, ROWS, BLOCK_H, SB, False)
                elif MODE == 4 or MODE == 5:  # BLOCK_H == SB: one scale per row, no reshape
                    amax = tl.max(tl.abs(vf), axis=1)
                    sc = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_SCALE)
                    if MODE == 4:
                        qv = tl.math.div_rn(vf, sc[:, None])
                    else:
                        qv = vf * tl.math.div_rn(tl.full(sc.shape, 1.0, tl.float32), sc)[:, None]
                    bits = qv.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
                    scale = tl.reshape(sc, (ROWS, 1))
                else:
                    vb = tl.reshape(vf, (ROWS, BLOCK_H // SB, SB))
                    sc = tl.maximum(tl.math.div_rn(tl.max(tl.abs(vb), axis=2), E4M3_MAX), MIN_SCALE)
                    if MODE == 2:
                        qv = vb * tl.math.div_rn(tl.full(sc.shape, 1.0, tl.float32), sc)[:, :, None]
                    else:
                        qv = vb
                    bits = tl.reshape(qv.to(tl.float8e4nv).to(tl.uint8, bitcast=True), (ROWS, BLOCK_H))
                    scale = sc
                tl.store(q_ptr + dst[:, None] * H + cols[None, :], bits, mask=ok[:, None])
                sb = h0 // SB + tl.arange(0, BLOCK_H // SB)
                tl.store(s_ptr + dst[:, None] * HB + sb[None, :], scale, mask=ok[:, None])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--progs", default="16,132")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--chunks", default="32x512,16x1024,64x256")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    base = SEED_SHAPES[args.shape]
    T, H, K = SLICES[args.shape], base.h, base.k
    N, SB = T * K, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    idx = torch.randperm(N, generator=g).to(dev).div(K, rounding_mode="floor").to(torch.int32)
    q = torch.empty(N, H, dtype=torch.uint8, device=dev)
    s = torch.empty(N, H // SB, dtype=torch.float32, device=dev)
    y = torch.empty(N, H, dtype=torch.bfloat16, device=dev)
    print(f"{args.shape}: {N} routed rows of {H} (T {T}, K {K})", flush=True)
    rows = []
    for mode in args.modes.split(","):
        chunks = ["32x128", "64x128"] if mode.endswith("128") else args.chunks.split(",")
        for chunk in chunks:
            R_, C_ = (int(v) for v in chunk.split("x"))
            for progs in (int(v) for v in args.progs.split(",")):
                for warps in (int(v) for v in args.warps.split(",")):
                    def fn():
                        _probe_kernel[(progs,)](x, idx, q, s, y, N, H, MODE=MODES[mode], ROWS=R_, BLOCK_H=C_,
                                                SB=SB, num_warps=warps)
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=args.reps * 10, return_mode="median")
                    nbytes = N * H * 2 + (N * H * 2 if mode == "copy" else N * H + N * (H // SB) * 4)
                    row = (mode, chunk, progs, warps, ms, nbytes / ms / 1e6, nbytes / ms / 1e6 / progs)
                    rows.append(row)
                    print("  %-9s %-7s progs %3d warps %d  %.3f ms  %6.0f GB/s  %5.1f GB/s/prog" % row, flush=True)
    # Same bits as the megakernels' quantiser (quantize_rows_1xb, mode lib)?
    ref_q = None
    for mode in ("lib", "recip", "div128", "recip128"):
        R_, C_ = (32, 128) if mode.endswith("128") else (32, 512)
        _probe_kernel[(132,)](x, idx, q, s, y, N, H, MODE=MODES[mode], ROWS=R_, BLOCK_H=C_, SB=SB, num_warps=4)
        if ref_q is None:
            ref_q, ref_s = q.clone(), s.clone()
        print(f"  {mode}: bits differ from lib in {(q != ref_q).sum().item()} of {q.numel()}, scales in "
              f"{(s != ref_s).sum().item()}", flush=True)
    print("\nmode      chunk    progs warps     ms    GB/s  GB/s/prog")
    for row in rows:
        print("%-9s %-8s %5d %5d %7.3f %7.0f %9.1f" % row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
