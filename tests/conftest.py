"""Test setup: without CUDA, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so
this runs before the package's kernels are imported.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(sms=132, mem=141 << 30, major=9, gluon_missing=None)``: torch reports a GPU of ``sms`` SMs,
    ``mem`` bytes and compute capability ``major``, whose Triton's Gluon API lacks ``gluon_missing`` (None: it
    has every name the Gluon kernels call, as Triton 3.6 does), for the config heuristics' device branches."""
    from types import SimpleNamespace

    from kittenmoe import launch_common

    def fake(sms=132, mem=141 << 30, major=9, gluon_missing=None):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev=None: SimpleNamespace(multi_processor_count=sms, total_memory=mem,
                                                             major=major))
        monkeypatch.setattr(launch_common, "gluon_api_missing", lambda: gluon_missing)

    return fake


@pytest.fixture(scope="session")
def ring_protocol():
    """benchmarks/probes/ring_protocol.py, the CPU model of the Gluon kernels' barrier protocols."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "probes",
                        "ring_protocol.py")
    spec = importlib.util.spec_from_file_location("ring_protocol", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _interpreter_dot_in_fp64() -> None:
    """Make the interpreter's fp32-accumulating ``tl.dot`` independent of the BLAS and of the tile shape.

    The interpreter computes ``tl.dot`` with ``np.matmul(a, b, dtype=float32)``, and OpenBLAS picks its sgemm
    kernel (and with it the summation order) by CPU type and matrix size: on an AMD EPYC runner (OpenBLAS
    0.3.31, DYNAMIC_ARCH) a 16x32x32 and a 16x64x32 product summed differently, so tests that promise equal
    bits across tile configurations (resident vs replayed gate|up, the torch backend vs its distributed twin)
    failed there and passed on another CPU. Summing the products in fp64 and rounding once to fp32 gives the
    same bits for any order (bf16 and fp16 products are exact in fp64; an fp64 sum of a few hundred of them
    lands within an ulp of fp64, far below fp32's rounding step), and adding the fp32 accumulator stays one
    fp32 addition, as on the GPU. Integer and fp64 accumulators keep the interpreter's own path."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "_kittenmoe_fp64", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._kittenmoe_fp64 = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def _interpreter_bf16_round_to_nearest() -> None:
    """Make the interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's (``cvt.rn.bf16.f32``).

    The interpreter (Triton 3.6-3.9) converts fp32 to bf16 by dropping the low 16 bits when no rounding mode is
    given (``x.to(tl.bfloat16)``): round toward zero, twice the error of rounding to nearest and always toward
    zero, so the errors add up in a sum instead of cancelling. On the tiny test shapes that put a bf16 backward
    that rounds one more tensor (the kept gate|up) at rel L1 1.2e-2 against the fp64 reference where rounding
    to nearest gives about half that: the test measured the interpreter, not the kernel. torch's conversion
    rounds to nearest even (NaN and inf kept)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl
    if getattr(original, "_kittenmoe_rne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._kittenmoe_rne = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


if not HAS_CUDA:
    _interpreter_dot_in_fp64()
    _interpreter_bf16_round_to_nearest()
