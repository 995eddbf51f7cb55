"""The Gluon builtins the kernels call whose names changed between Triton releases, bound once to this Triton's.

Triton 3.6 (torch 2.11's) and 3.9 (torch 2.13's) spell the same operations differently; the kernels call the
names below, so one source builds with either:

    name here             Triton 3.9                              Triton 3.6
    barrier               gl.barrier                              gl.thread_barrier
    tma_load              tma.async_load                          tma.async_copy_global_to_shared
    tma_store             tma.async_store                         tma.async_copy_shared_to_global
    cp_async_load         ampere async_copy.async_load            async_copy.async_copy_global_to_shared
    reinterpret(s, ...)   s.reinterpret(...)                      s._reinterpret(...)

Every pair takes the same positional arguments the kernels pass. 3.9 keeps the old TMA and cp.async names as
stubs that raise when called, so each binding prefers the new name and falls back to the old one only where the
new is absent. ``launch_common.GLUON_API`` is the check that a Triton has one of each pair (and the rest of the
API the kernels use) before any kernel here is built.

``tensor_desc`` is the host-side helper the Gluon launchers share: a TMA descriptor in the default NVMMA shared
layout.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def _first(module, *names):
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"{getattr(module, '__name__', module)} has none of {', '.join(names)}")


barrier = _first(gl, "barrier", "thread_barrier")  # bar.sync of the partition's (or the program's) warps
tma_load = _first(tma, "async_load", "async_copy_global_to_shared")
tma_store = _first(tma, "async_store", "async_copy_shared_to_global")
cp_async_load = _first(async_copy, "async_load", "async_copy_global_to_shared")

# the descriptor's method, unbound: reinterpret(smem, dtype, shape, layout) views smem's bytes as dtype of shape in
# layout, no copy (a builtin, so layouts pass as they are; a jit function's arguments would need constexprs)
reinterpret = _first(_core.shared_memory_descriptor, "reinterpret", "_reinterpret")


_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def _nvmma_layout(block: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def tensor_desc(t, block: list[int]):
    """A host TMA descriptor of ``t`` (bf16 or fp16) in ``block`` tiles and the default NVMMA shared layout for
    them. The layout is kept a table by block and dtype: choosing it took ~7 of a descriptor's ~9 us of host
    time, and a forward+backward builds ~20 descriptors."""
    return TensorDescriptor.from_tensor(t, block, _nvmma_layout(tuple(block), _GL_DTYPE[t.dtype]))
