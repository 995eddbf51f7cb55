"""Baselines every benchmark times beside kittenmoe, in the same run.

``grouped_mm_forward``: the PyTorch MoE path a team would write today on one
GPU: argsort the routes by expert, gather the token rows, two
``torch._grouped_mm`` calls with SwiGLU between, then a weighted
``index_add_`` back to the tokens. Differentiable through autograd. No host
sync (expert counts come from a scatter-add, not ``bincount``).
"""

from __future__ import annotations

import torch

from kittenmoe.reference import swiglu


def grouped_mm_forward(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    T, K = topk_ids_TK.shape
    E, two_i, H = w13_E2IH.shape
    i = two_i // 2
    flat = topk_ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // K
    x_sorted = x_TH[tok]
    gu = torch._grouped_mm(x_sorted, w13_E2IH.transpose(1, 2), offs=offs)
    hid = swiglu(gu[:, :i], gu[:, i:], swiglu_limit)
    y = torch._grouped_mm(hid, w2_EHI.transpose(1, 2), offs=offs)
    w_sorted = topk_weights_TK.reshape(-1)[order].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    out = out.index_add(0, tok, y.float() * w_sorted[:, None])
    if shared_w13_2SH is not None:
        s = shared_w2_HS.shape[1]
        gs = x_TH @ shared_w13_2SH.t()
        out = out + (swiglu(gs[:, :s], gs[:, s:], swiglu_limit) @ shared_w2_HS.t()).float()
    return out.to(x_TH.dtype)
