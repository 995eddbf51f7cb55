"""Compile the megakernels for sm_90 on a machine without a GPU; print registers, spills and shared memory.

    PYTHONPATH=src python scripts/sm90_compile.py [--which fwd,bwd] [--shape kimi-k2.7] [--config "block_n=64,..."]

Saves device time: a tile or stage change that cannot fit 227 KB of shared memory, or that spills, shows here
in a minute instead of in a device call. The launchers run on small CPU tensors of the shape's widths (H, I, S;
few tokens and experts, which are runtime values) with the GPU code path forced (TMA descriptors, no
interpreter); every ``kernel[grid](...)`` compiles through ``JITFunction.run(warmup=True)`` for a fake sm_90
driver instead of launching. The local Triton may be newer than the device's (3.6): the figures are a proxy
for what the device compiles, close but not guaranteed equal.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kittenmoe import ops  # noqa: E402
from kittenmoe.config import SEED_SHAPES, TEST_SHAPES, KernelConfig  # noqa: E402
from kittenmoe.testing import make_weights, routing_uniform  # noqa: E402


class _FakeSm90Driver:
    """Just enough of a driver for ``JITFunction.run(warmup=True)`` to compile for sm_90."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


compiled: list[tuple[str, object]] = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    k = _orig_run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append((self.fn.__name__, k))
    return k


_orig_run = JITFunction.run


def _resource_usage(cubin: bytes) -> str:
    """REG / STACK / LOCAL (spills show as LOCAL > 0) from cuobjdump, shipped with Triton's NVIDIA backend."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"regs {m[1]:>3} stack {m[2]:>4} local {m[4]:>4}" if m else out.strip()[-120:]


def report(name, k) -> str:
    ptx = k.asm.get("ptx", "")
    return (f"{name:<40} {_resource_usage(k.asm['cubin'])}  shared {k.metadata.shared:>7} B  "
            f"wgmma {'wgmma.mma_async' in ptx}  TMA {'cp.async.bulk.tensor' in ptx}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", default="fwd,bwd")
    ap.add_argument("--shape", default="kimi-k2.7")
    ap.add_argument("--config", default="", help="KernelConfig overrides, e.g. block_n=64,num_stages=3")
    ap.add_argument("--fp8", action="store_true", help="e4m3 routed experts (128 x 128 scales), forward and backward")
    ap.add_argument("--fp8-block", type=int, default=128, help="the FP8 scale block with --fp8 (32: MXFP8, pow2)")
    ap.add_argument("--resident", action="store_true",
                    help="the variants that keep the forward's activations for the backward (SAVE_GU / RESIDENT)")
    args = ap.parse_args()
    shape = {**SEED_SHAPES, **TEST_SHAPES}[args.shape]
    kw = {}
    for item in filter(None, args.config.split(",")):
        k, v = item.split("=")
        default = getattr(KernelConfig(), k)
        kw[k] = v.lower() in ("1", "true") if isinstance(default, bool) else int(v)
    cfg = KernelConfig(**kw)
    # Widths as the shape has them; experts and tokens small (runtime values, not compiled in).
    sh = shape.with_(e=4, k=2) if hasattr(shape, "with_") else shape
    T = 64
    g = torch.Generator().manual_seed(0)
    w = make_weights(sh, dtype=torch.bfloat16, device="cpu", generator=g)
    x = [torch.randn(T, sh.h, generator=g).to(torch.bfloat16)]
    ids, wts = routing_uniform(T, sh.e, sh.k, generator=g, device="cpu")
    d_out = [torch.randn(T, sh.h, generator=g).to(torch.bfloat16)]
    a = (x, [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, sh.swiglu_limit)

    prev_driver = driver._active
    driver.set_active(_FakeSm90Driver())
    JITFunction.run = _compile_only
    saved = {n: getattr(ops, n) for n in ("interpreting", "_tma_ok", "_bwd_tma_ok", "_num_programs",
                                          "_check_device")}
    ops.interpreting = lambda: False
    ops._check_device = lambda device: None
    ops._tma_ok = lambda config, *a_, **k_: config.tma
    ops._bwd_tma_ok = lambda config, *a_, **k_: config.tma
    ops._num_programs = lambda dev, num_comm: 132
    try:
        for which in args.which.split(","):
            compiled.clear()
            try:
                if which == "fwd":
                    fp8 = None
                    if args.fp8:
                        from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
                        fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI, FP8Config(args.fp8_block, args.fp8_block == 32))
                    ops.megakernel_forward_multirank(*a, config=cfg, save_for_backward=args.resident, fp8=fp8)
                else:
                    fwd = fp8 = None
                    if args.fp8:
                        from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
                        fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI, FP8Config(args.fp8_block, args.fp8_block == 32))
                    if args.resident or args.fp8:  # the forward's states (compile-only launch) carry the buffers
                        JITFunction.run = lambda self, *a_, grid, warmup, **k_: _orig_run(self, *a_, grid=grid,
                                                                                        warmup=True, **k_)
                        fwd = ops.megakernel_forward_multirank(*a, config=cfg, save_for_backward=True, fp8=fp8)
                        JITFunction.run = _compile_only
                    ops.megakernel_backward_multirank(d_out, *a, config=cfg, saved=fwd.saved() if fwd else None,
                                                      fp8=fp8)
            except Exception as exc:  # the launcher reads results after the fake launch; compiles are done
                if not compiled:
                    raise
                print(f"({which}: stopped after compiling: {type(exc).__name__}: {str(exc)[:120]})")
            for name, k in compiled:
                print(report(name, k))
                if os.environ.get("KITTENMOE_DUMP_DIR"):
                    for ir in ("ttgir", "ptx"):
                        with open(os.path.join(os.environ["KITTENMOE_DUMP_DIR"], f"{name}.{ir}"), "w") as f:
                            f.write(k.asm[ir])
    finally:
        JITFunction.run = _orig_run
        driver._active = prev_driver
        for n, v in saved.items():
            setattr(ops, n, v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
