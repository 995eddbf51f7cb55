"""Does a BM x 2BN phase-A accumulator split in halves give the bits of two BM x BN tiles (GPU probe)?

The FP8 backward's kept (2 BN wide) phase A and its replay (BN wide) disagreed in d_topk_weights on the H200
while d_x agreed. This separates the two suspects: the GEMM's accumulator (``acc`` columns) and the row sum of
``acc * h`` over each half (the d_w partial). For each of bf16 / e4m3 operands it prints whether the halves of
the wide accumulator equal the narrow tiles bit for bit, and whether their d_w partials do, summed with
``tl.sum`` (the layout's reduction tree) and with ``_row_sum_in_order`` (what the kernel now uses).
On the H200 (Triton 3.6): accumulators equal in both dtypes; tl.sum's partials differ in 155 (bf16) and 134
(e4m3) of 256 rows; the in-order sum's in none.

    PYTHONPATH=src python3 benchmarks/probes/split_sum_probe.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kittenmoe.kernels.megakernel_bwd import _down_dgrad_fp8, _mm_acc, _row_sum_in_order


@triton.jit
def _row_sum(p, SEQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    if SEQ:  # the kernel's d_w partial: left to right whatever p's layout
        return _row_sum_in_order(p, BN)
    return tl.sum(p, axis=1)  # what it was: the layout's reduction tree


@triton.jit
def _probe(a_ptr,  # [BM, H] bf16, or e4m3 bytes as uint8 when FP8
           as_ptr,  # [BM, H // SB] fp32 row scales (FP8)
           b_ptr,  # [H, 2BN] bf16 / FP8: [2BN, H] uint8 (B^T, K-major)
           bs_ptr,  # [H // SB, 2BN // SB] fp32 (FP8)
           h_ptr,  # [BM, 2BN] fp32
           acc_ptr,  # [BM, 2BN] fp32 out
           dw_ptr,  # [BM, 2] fp32 out
           H, WIDE: tl.constexpr, FP8: tl.constexpr, SEQ: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr):
    rm = tl.arange(0, BM)
    for half in tl.static_range(2):
        if WIDE:
            if half == 0:
                if FP8:
                    acc = _down_dgrad_fp8(a_ptr, as_ptr, 0, b_ptr, bs_ptr, 0, H, 2 * BN, H // SB, 2 * BN // SB,
                                          BM, 2 * BN, SB, False)
                else:
                    acc = _mm_acc(a_ptr, H, 0, BM, b_ptr, 2 * BN, 0, 2 * BN, H, BM, 2 * BN, BK, False, "tf32")
                lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
                t = lo
            else:
                t = hi
        else:
            if FP8:
                t = _down_dgrad_fp8(a_ptr, as_ptr, 0, b_ptr, bs_ptr, half, H, 2 * BN, H // SB, 2 * BN // SB,
                                    BM, BN, SB, False)
            else:
                t = _mm_acc(a_ptr, H, 0, BM, b_ptr, 2 * BN, half * BN, 2 * BN, H, BM, BN, BK, False, "tf32")
        rn = half * BN + tl.arange(0, BN)
        h = tl.load(h_ptr + rm[:, None] * (2 * BN) + rn[None, :])
        tl.store(acc_ptr + rm[:, None] * (2 * BN) + rn[None, :], t)
        tl.store(dw_ptr + rm * 2 + half, _row_sum(t * h, SEQ, BM, BN))


def compare(dev: str) -> list[dict]:
    """One row per (operands, sum): whether the wide accumulator's halves equal the narrow tiles and whether the
    d_w partials do (and how many of the 2 x BM differ)."""
    bm, bn, bk, sb, H = 128, 64, 64, 128, 1024
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(bm, 2 * bn, generator=g).to(dev)
    rows = []
    for fp8 in (False, True):
        if fp8:
            a = (torch.randn(bm, H, generator=g) * 8).to(dev).to(torch.float8_e4m3fn).view(torch.uint8)
            b = (torch.randn(2 * bn, H, generator=g) * 8).to(dev).to(torch.float8_e4m3fn).view(torch.uint8)
            a_s = torch.rand(bm, H // sb, generator=g).to(dev) + 0.5
            b_s = torch.rand(H // sb, 2 * bn // sb if 2 * bn >= sb else 1, generator=g).to(dev) + 0.5
        else:
            a = torch.randn(bm, H, generator=g).to(dev, torch.bfloat16)
            b = torch.randn(H, 2 * bn, generator=g).to(dev, torch.bfloat16)
            a_s = b_s = torch.ones(1, device=dev)
        for seq in (False, True):
            outs = {}
            for wide in (False, True):
                acc = torch.full((bm, 2 * bn), float("nan"), device=dev)
                dw = torch.full((bm, 2), float("nan"), device=dev)
                _probe[(1,)](a, a_s, b, b_s, h, acc, dw, H, WIDE=wide, FP8=fp8, SEQ=seq, BM=bm, BN=bn, BK=bk,
                             SB=sb, num_warps=8, num_stages=3)
                outs[wide] = (acc, dw)
            rows.append(dict(operands="e4m3" if fp8 else "bf16", in_order=seq,
                             acc_equal=torch.equal(outs[False][0], outs[True][0]),
                             dw_equal=torch.equal(outs[False][1], outs[True][1]),
                             dw_differ=int((outs[False][1] != outs[True][1]).sum()), of=2 * bm))
    return rows


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("BM=128 BN=64 (wide 2BN=128) H=1024, num_warps=8")
    for r in compare(dev):
        print(f"{r['operands']}  sum={'in order' if r['in_order'] else 'tl.sum  '}  acc halves == narrow: "
              f"{r['acc_equal']}   d_w partials equal: {r['dw_equal']} ({r['dw_differ']} of {r['of']} differ)")


if __name__ == "__main__":
    main()
