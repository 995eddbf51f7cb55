"""Functional API: one differentiable MoE layer call, one rank, backend chosen by name.

``moe(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, ...)`` validates its inputs
(``kittenmoe.checks.check_moe_inputs``) and dispatches:

- ``"torch"``: ``kittenmoe.torch_backend.moe_forward`` (torch ops, autograd through it, any device;
  ``torch.compile`` traces it, ``fullgraph`` included).
- ``"megakernel"``: the custom op ``kittenmoe::moe_forward`` (forward and backward megakernels). Runs on
  CUDA, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``); anywhere else the
  launcher raises ``RuntimeError``.
- ``"auto"``: ``"megakernel"`` on CUDA tensors, ``"torch"`` otherwise.

Nothing falls back silently: a backend that cannot run raises.
"""

from __future__ import annotations

from typing import Literal

import torch

from kittenmoe import autograd, torch_backend
from kittenmoe.autoconfig import auto_config
from kittenmoe.checks import check_megakernel_dtype, check_moe_inputs, check_swiglu_limit
from kittenmoe.config import KernelConfig
from kittenmoe.fp8 import check_fp8_option
from kittenmoe.schedule import ids_int32

Backend = Literal["auto", "torch", "megakernel"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "megakernel")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def check_config(config: KernelConfig | None, name: str = "config") -> KernelConfig | None:
    """``config`` if it is a ``KernelConfig`` or None, else TypeError naming the argument ``name``."""
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"{name} must be a kittenmoe.KernelConfig or None, got {type(config).__name__}")
    return config


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend ``backend`` means for tensors on ``device`` ("auto" resolved)."""
    check_backend(backend)
    if backend == "auto":
        return "megakernel" if torch.device(device).type == "cuda" else "torch"
    return backend


class _NoTokens(torch.autograd.Function):
    """The layer on ``T = 0`` tokens (an empty micro-batch, an EP rank that got none): an empty ``[0, H]``
    output whose backward gives every differentiable input a zero gradient of its own shape (not ``None``:
    an optimizer step and a data-parallel reduction then see the same parameters on every rank)."""

    @staticmethod
    def forward(ctx, x_TH, *differentiable):
        ctx.shapes = [(t.shape, t.dtype, t.device) if t is not None else None for t in (x_TH, *differentiable)]
        return x_TH.new_empty(0, x_TH.shape[1])

    @staticmethod
    def backward(ctx, d_out_TH):
        return tuple(None if s is None else torch.zeros(s[0], dtype=s[1], device=s[2]) for s in ctx.shapes)


def no_tokens_output(x_TH, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS) -> torch.Tensor:
    """``[0, H]`` in x's dtype, differentiable with zero gradients (``_NoTokens``)."""
    return _NoTokens.apply(x_TH, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS)


def contiguous_activations(x_TH, topk_ids_TK, topk_weights_TK):
    """The per-token inputs in row-major layout: one copy each for a non-contiguous view (a slice or a
    transpose, as models produce; ``[T, H]`` bytes for x, a no-op otherwise). The kernels address rows by a
    fixed stride, and a copy here is cheaper than a strided pull on every routed row. Anything that is not a
    tensor passes through for ``check_moe_inputs`` to name."""
    return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in (x_TH, topk_ids_TK, topk_weights_TK))


def moe(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    backend: Backend = "auto",
    config: KernelConfig | None = None,
    fp8=None,
) -> torch.Tensor:
    """out[t] = shared(x[t]) + sum_{j<K} w[t, j] * expert_{ids[t, j]}(x[t]); differentiable in x, the
    router weights and every expert weight (not in ``topk_ids``).

    Shapes: x [T, H], topk_ids [T, K] int32/int64, topk_weights [T, K] (fp32 or x's dtype; summed in fp32
    either way, its gradient in its own dtype), w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I],
    shared_w13 [2S, H], shared_w2 [H, S]. Returns [T, H] in x's dtype. ``T = 0`` returns ``[0, H]`` and zero
    gradients. Non-contiguous x, topk_ids or topk_weights are copied once to row-major; the weights must be
    contiguous (a copy of them every step would go unnoticed).

    ``config``: the megakernel's knobs; None (the default) takes the ``kittenmoe tune`` cache entry for this
    problem or the heuristic (``kittenmoe.autoconfig``), what ``MoELayer`` and ``kittenmoe bench`` run. The
    torch backend has no knobs and ignores it. ``fp8`` (megakernel only): a ``kittenmoe.FP8Config`` to
    quantise the routed experts' weights now, or their ``FP8ExpertWeights``: routed GEMMs on e4m3 (forward
    and data gradients; weight gradients reach the bf16 weights passed here). Needs H and I multiples of 128.
    """
    check_backend(backend)
    check_config(config)
    check_fp8_option(fp8)
    swiglu_limit = check_swiglu_limit(swiglu_limit)
    x_TH, topk_ids_TK, topk_weights_TK = contiguous_activations(x_TH, topk_ids_TK, topk_weights_TK)
    dims = check_moe_inputs([x_TH], [topk_ids_TK], [topk_weights_TK], w13_E2IH, w2_EHI, shared_w13_2SH,
                            shared_w2_HS, allow_empty=True)
    # int32 ids with every id outside [0, 2**31 - 1) made -1: counted invalid and raised, never wrapped into range
    # or taken for a padding token's NO_ROUTE (a route dropped)
    topk_ids_TK = ids_int32(topk_ids_TK)
    which = resolve_backend(backend, x_TH.device)
    if fp8 is not None and which != "megakernel":
        raise NotImplementedError(f"fp8 runs the megakernel only (CUDA, or CPU under TRITON_INTERPRET=1); the "
                                  f"{which} backend resolved here has no e4m3 path: pass backend='megakernel'")
    if dims.t == 0:
        return no_tokens_output(x_TH, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS)
    if which == "megakernel":
        check_megakernel_dtype(x_TH.dtype, "kittenmoe.moe")
        if config is None:
            config = auto_config(dims.t, dims.h, dims.i, dims.e, dims.k, dims.s, 1, x_TH.device, x_TH.dtype, fp8)
        return autograd.moe_megakernel(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                       shared_w2_HS, swiglu_limit, config, fp8=fp8)
    return torch_backend.moe_forward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                     shared_w2_HS, swiglu_limit)
