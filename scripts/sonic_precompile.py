"""Compile every GEMM candidate SonicMoE's autotuner will try on an sm_90 GPU, on a machine without one.

Run by ``bash scripts/sonicmoe_wheels.sh precompile`` (which unpacks .sonic/sonic.tar.xz, runs this with a
Python 3.12 that has torch, and packs QUACK_CACHE_DIR into .sonic/quack-cache.tar.gz); not by hand.

Why: on a fresh GPU machine each of SonicMoE's QuACK GEMMs compiles 9-22 candidate configurations on its first
call before timing them, which took past 240 s a shape on the H200, most of a device call. QuACK keeps each
compiled kernel as an object file keyed by its compile arguments (dtypes, majors, tile, cluster, epilogue flags:
no shape) and by a fingerprint of its own sources, Python minor version, CUTLASS DSL and tvm-ffi versions. The
kernels compile without a GPU when the target is named (QUACK_ARCH, CUTE_DSL_ARCH), so this runs SonicMoE's own
forward and backward on small CPU tensors and compiles, for each GEMM call it makes, every candidate the
autotuner would time: its Triton kernels run under the interpreter (first config), QuACK's GEMMs compile only
(``COMPILE_ONLY``: nothing runs, the outputs stay garbage), and no timing is written. On the GPU the autotuner
then finds every candidate compiled and only times them. The cache carries over only to the same pinned versions
and Python 3.12 (the GPU machine's), which is why this needs a Python 3.12.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ["QUACK_ARCH"] = "sm_90"
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

# CUTLASS DSL checks for a CUDA driver (cuInit) before it loads a compiled module; compile-only never loads one.
import cutlass.base_dsl.compiler as cute_compiler  # noqa: E402

cute_compiler.Compiler._check_cuda_dependencies_once = lambda self, shared_libs: None

import quack.autotuner as quack_autotuner  # noqa: E402
import quack.cache_utils as quack_cache  # noqa: E402
import quack.gemm_interface as quack_gemm  # noqa: E402
import triton.runtime.autotuner as triton_autotuner  # noqa: E402
from torch._library.custom_ops import CustomOpDef  # noqa: E402

quack_cache.COMPILE_ONLY = True
compiled: list[tuple[str, int, int, float]] = []  # (GEMM, candidates, failures, seconds)


def _compile_candidates(self, tuning_key, configs, bench_fn):
    """Stands in for the autotuner's timing: compile every candidate in this process, time none, write nothing
    (the autotuner's own pre-compilation spawns workers, which would not have the patches above)."""
    t0 = time.time()
    failed = 0
    for config in configs:
        try:
            self.fn(*self._precompile_args, **self._precompile_kwargs, **config.all_kwargs())
        except Exception as exc:  # one candidate that does not build must not hide the others: counted, printed
            failed += 1
            print(f"{self.fn.__name__}: {config} did not compile: {exc!r:.300}", flush=True)
    compiled.append((self.fn.__name__, len(configs), failed, time.time() - t0))
    print(f"{self.fn.__name__}: {len(configs)} candidates, {failed} failed, {time.time() - t0:.0f} s", flush=True)
    self.cache[tuning_key] = configs[0]
    self.configs_timings = {}
    self.bench_time = 0


_autotuner_call = quack_autotuner.Autotuner.__call__


def _remembering_call(self, *args, **kwargs):
    self._precompile_args, self._precompile_kwargs = args, kwargs
    return _autotuner_call(self, *args, **kwargs)


quack_autotuner.Autotuner.__call__ = _remembering_call
quack_autotuner.Autotuner.check_disk_cache = _compile_candidates
quack_autotuner._gpu_warmup = lambda *a, **k: None
# SonicMoE's own Triton kernels autotune too: under the interpreter there is nothing to time, take the first
triton_autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [1.0, 1.0, 1.0]
# QuACK registers its GEMM ops for CUDA only; on CPU tensors the same Python bodies compile and return
for _name in dir(quack_gemm):
    _op = getattr(quack_gemm, _name)
    if isinstance(_op, CustomOpDef):
        _op.register_kernel("cpu", _op._init_fn)

from sonicmoe.enums import ActivationType  # noqa: E402
from sonicmoe.functional import moe_general_routing_inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="64,256,128,8,2",
                    help="T,H,I,E,K of the small problem run on the CPU (the compile keys hold no shape)")
    ap.add_argument("--single-cta", action="store_true",
                    help="also each 2-CTA candidate with a 1 x 1 cluster (benchmarks/probes/cluster_probe.py)")
    args = ap.parse_args()
    T, H, I, E, K = (int(v) for v in args.shape.split(","))
    if args.single_cta:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "probes"))
        from cluster_probe import add_single_cta_candidates

        add_single_cta_candidates()
    g = torch.Generator().manual_seed(0)
    x_TH = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    scores = torch.rand(T * K, generator=g, requires_grad=True)
    # SonicMoE's layouts, as kittenmoe.baselines_sonic passes them: w1 [2I, H, E], w2 [H, I, E] views
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    tokens = torch.arange(T, dtype=torch.int32)[:, None].expand(T, K).reshape(-1)

    def run(inference: bool):
        return moe_general_routing_inputs(x_TH, scores, tokens, ids_TK.reshape(-1), w1.permute(1, 2, 0), None,
                                          w2.permute(1, 2, 0), None, E, 0, ActivationType.SWIGLU,
                                          is_inference_mode_enabled=inference)[0]

    t0 = time.time()
    run(False).float().sum().backward()  # forward keeping its activations, and the backward's GEMMs
    with torch.no_grad():
        run(True)  # the inference forward's up projection compiles apart (no pre-activation stored)
    failed = sum(c[2] for c in compiled)
    print(f"{sum(c[1] for c in compiled)} candidates of {len(compiled)} GEMM calls compiled for sm_90 in "
          f"{time.time() - t0:.0f} s, {failed} failed; cache: {quack_cache.get_cache_path()}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
