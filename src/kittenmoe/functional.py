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
from kittenmoe.checks import check_moe_inputs
from kittenmoe.config import KernelConfig

Backend = Literal["auto", "torch", "megakernel"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "megakernel")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend ``backend`` means for tensors on ``device`` ("auto" resolved)."""
    check_backend(backend)
    if backend == "auto":
        return "megakernel" if torch.device(device).type == "cuda" else "torch"
    return backend


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

    Shapes: x [T, H], topk_ids [T, K] int32/int64, topk_weights [T, K] (fp32 recommended), w13 [E, 2I, H]
    (gate rows then up rows), w2 [E, H, I], shared_w13 [2S, H], shared_w2 [H, S]. Returns [T, H] in x's
    dtype. ``config`` sets the megakernel's knobs (``KernelConfig()`` when None); the torch backend has no
    knobs and ignores it. ``fp8`` (megakernel only): a ``kittenmoe.fp8.FP8Config`` to quantise the routed
    experts' weights now, or their ``FP8ExpertWeights``: routed GEMMs on e4m3 (forward and data gradients;
    weight gradients reach the bf16 weights passed here). Needs H and I multiples of 128 and block_n 128.
    """
    check_backend(backend)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a kittenmoe.KernelConfig or None, got {type(config).__name__}")
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))
                                     or not swiglu_limit > 0):
        raise ValueError(f"swiglu_limit must be a positive number or None, got {swiglu_limit!r}")
    check_moe_inputs([x_TH], [topk_ids_TK], [topk_weights_TK], w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS)
    which = resolve_backend(backend, x_TH.device)
    if which == "megakernel":
        return autograd.moe_megakernel(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                       shared_w2_HS, swiglu_limit, config, fp8=fp8)
    if fp8 is not None:
        raise NotImplementedError(f"fp8 runs the megakernel only (CUDA, or CPU under TRITON_INTERPRET=1); the "
                                  f"{which} backend resolved here has no e4m3 path: pass backend='megakernel'")
    return torch_backend.moe_forward(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, shared_w13_2SH,
                                     shared_w2_HS, swiglu_limit)
