"""Triton's launch path for the public path's kernels, timed on a CPU without a GPU.

    PYTHONPATH=.triton-device:src:tools python3 benchmarks/probes/cpu_launch_probe.py [--shape 8192,2048,768,128,8]
        [--calls 20]

Asked because on an H100 the public path (``kittenmoe.moe`` forward+backward at Qwen3-30B-A3B's widths) took
4.9-6.8 ms of host time a call against ~4.3 ms of kernels, while ``cpu_host_probe.py`` puts the library's own
Python and torch ops near 1 ms: the rest is Triton's launch path, CUDA's per-op costs, or both. This probe
measures the first of them where GPU time is not at hand. The launchers take their GPU code path on CPU tensors
(``tools/sm90_build.gpu_path_on_cpu``: TMA descriptors, the Gluon kernels where the config's "auto" values pick
them on Hopper) with a fake sm_90 driver; every kernel compiles for sm_90 on its first call (minutes), and later
calls go through ``JITFunction.run`` with the compiled kernel cached (argument binding and specialisation, the
cache key, the globals check) up to the launch itself. One part of a real launch is then timed by hand: the
driver wrapper's expansion of each TMA descriptor argument (``make_tensordesc_arg``), with the driver's
CUtensorMap encoding stubbed. Left out: the launch metadata (nothing without a launch hook), the C launcher
(argument parsing, ``cuLaunchKernelEx``), the encoding itself, and every CUDA op and allocation (on CPU tensors
here).

Prints, per mode (forward, forward+backward), the host us a call: all of it, in ``JITFunction.run``, in the
hand-timed launch parts, and per kernel (calls, us a call each). The config is the one the heuristic picks on a
132-SM Hopper GPU (``default_config`` with the device's properties faked). The total is not the GPU's host
time: every torch op here runs on CPU tensors at full size.

On this repository's 2-core CPU machine (Triton 3.6 from ``.triton-device``, Qwen3-30B-A3B's widths, the Gluon
forward, backward and weight-gradient kernels): a forward+backward spends ~0.41 ms a call in ``JITFunction.run``
and ~0.07 ms expanding descriptors, of which the forward megakernel's launch ~0.16-0.19 ms and the backward's
~0.13 ms. The same forward launch repeated back to back takes 49 us (29 of them binding and specialising its 50
arguments, 16 module globals checked a launch): inside a real call sequence each launch runs with cold caches, at
~3x that. So Triton's Python launch path is ~0.5 ms of the GPU's 4.9-6.8 ms of host time a forward+backward; a
Gluon descriptor's specialisation is 1.4 us of it (its layout's repr 0.65).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import types

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("cpu_launch_probe: run without TRITON_INTERPRET (it compiles the real kernels for sm_90)")

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kittenmoe.launch_common as launch_common  # noqa: E402
from host_probe import public_path_calls  # noqa: E402
from kittenmoe.config import default_config  # noqa: E402
from sm90_build import gpu_path_on_cpu  # noqa: E402


def hopper_config(t: int, h: int, i: int, e: int, k: int):
    """The heuristic config of a 132-SM Hopper GPU with 80 GB (an H100's properties, faked on this machine)."""
    props = types.SimpleNamespace(multi_processor_count=132, major=9, minor=0, total_memory=80 << 30,
                                  L2_cache_size=50 << 20, name="sm_90 (faked)")
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda dev=None: props
    try:
        return default_config(t, h, i, e, k, device="cuda", dtype=torch.bfloat16)
    finally:
        torch.cuda.get_device_properties = real


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,2048,768,128,8", help="T,H,I,E,K (no shared expert)")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    t, h, i, e, k = (int(v) for v in args.shape.split(","))
    config = hopper_config(t, h, i, e, k)
    print(f"config: {config}")
    forward, forward_backward, _, _ = public_path_calls(args.shape, torch.device("cpu"), config=config)

    from triton.backends.nvidia import driver as nv_driver
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc
    from triton.tools.tensor_descriptor import TensorDescriptor as TritonDesc

    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    timing = [False]

    class _Utils:  # the driver's CUtensorMap encoding, stubbed (a C call on a GPU machine)
        @staticmethod
        def fill_tma_descriptor(*a):
            return None

    fake_active = types.SimpleNamespace(utils=_Utils())

    def run(orig_run, self, *a, grid, warmup, **kw):
        t0 = time.perf_counter()
        kernel = orig_run(self, *a, grid=grid, warmup=True, **kw)
        t1 = time.perf_counter()
        # the launch's own Python: each descriptor argument's expansion
        meta = getattr(kernel.metadata, "tensordesc_meta", None) or []
        descs = [v for v in a if isinstance(v, (GluonDesc, TritonDesc))]
        real_driver = nv_driver.triton.runtime.driver.active
        nv_driver.triton.runtime.driver._active = fake_active
        try:
            for j, d in enumerate(descs):
                nv_driver.make_tensordesc_arg(d, meta[j] if j < len(meta) else None)
        finally:
            nv_driver.triton.runtime.driver._active = real_driver
        t2 = time.perf_counter()
        if timing[0]:
            rec = spent[self.fn.__name__]
            rec[0] += 1
            rec[1] += t1 - t0
            rec[2] += t2 - t1
        return kernel

    # the error flags the fake launches never write: left unread, as a launch that ran would leave them clear
    launch_common.check_errors = lambda *flags_and_detail: None
    with gpu_path_on_cpu(run, gluon_auto=True):
        for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
            t0 = time.perf_counter()
            fn()  # every kernel compiles for sm_90 here
            print(f"{name}: first call (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
            fn()
            spent.clear()
            timing[0] = True
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            total = (time.perf_counter() - t0) / args.calls
            timing[0] = False
            in_run = sum(v[1] for v in spent.values()) / args.calls
            in_launch = sum(v[2] for v in spent.values()) / args.calls
            print(f"==== {name} {args.shape}: host us a call {1e6 * total:.0f}; in JITFunction.run (cached) "
                  f"{1e6 * in_run:.0f}; descriptor expansion {1e6 * in_launch:.0f}")
            for kname, (n, a_s, b_s) in sorted(spent.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
                print(f"  {kname:44s} {n / args.calls:4.1f} a call  run {1e6 * a_s / n:7.1f} us  "
                      f"descriptors {1e6 * b_s / n:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
