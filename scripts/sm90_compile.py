"""Compile the megakernels for sm_90 on a machine without a GPU; print registers, spills and shared memory.

    PYTHONPATH=src python scripts/sm90_compile.py [--which fwd,bwd] [--shape kimi-k2.7] [--config "block_n=64,..."]
        [--fp8 [--fp8-block 32] [--replay] [--dx-high] [--down-high]] [--resident]

Saves device time: a tile or stage change that cannot fit 227 KB of shared memory, or that spills, shows here
in a minute instead of in a device call (``tools/sm90_build.py`` says how). KITTENMOE_DUMP_DIR=DIR also
writes each kernel's TTGIR and PTX there. The figures are the installed Triton's: the device runs 3.6.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from kittenmoe.config import KernelConfig  # noqa: E402
from sm90_build import build_megakernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--config", default="", help="KernelConfig overrides, e.g. block_n=64,num_stages=3")
    ap.add_argument("--fp8", action="store_true", help="e4m3 routed experts (128 x 128 scales), forward and backward")
    ap.add_argument("--fp8-block", type=int, default=128, help="the FP8 scale block with --fp8 (32: MXFP8, pow2)")
    ap.add_argument("--replay", action="store_true",
                    help="with --fp8: the backward without the forward's kept activations (the e4m3 replay)")
    ap.add_argument("--dx-high", action="store_true", help="with --fp8: FP8Config.dx_high (d_x GEMM in bf16)")
    ap.add_argument("--down-high", action="store_true", help="with --fp8: FP8Config.down_high (down GEMM in bf16)")
    ap.add_argument("--resident", action="store_true",
                    help="the variants that keep the forward's activations for the backward (SAVE_GU / RESIDENT)")
    args = ap.parse_args()
    kw = {}
    for item in filter(None, args.config.split(",")):
        k, v = item.split("=")
        default = getattr(KernelConfig(), k)
        if isinstance(default, bool):
            kw[k] = v.lower() in ("1", "true")
        elif isinstance(default, str):  # wgrad=triton|persistent|gluon
            kw[k] = v
        else:
            kw[k] = None if v.lower() == "none" else int(v)
    cfg = KernelConfig(**kw)
    for which in args.which.split(","):
        for b in build_megakernels(which, args.shape, cfg, fp8_block=args.fp8_block if args.fp8 else None,
                                   replay=args.replay, resident=args.resident, fp8_dx_high=args.dx_high,
                                   fp8_down_high=args.down_high):
            print(b.line())
            if os.environ.get("KITTENMOE_DUMP_DIR"):
                for ir in ("ttgir", "ptx"):
                    with open(os.path.join(os.environ["KITTENMOE_DUMP_DIR"], f"{b.name}.{ir}"), "w") as f:
                        f.write(b.kernel.asm[ir])
    return 0


if __name__ == "__main__":
    sys.exit(main())
