"""Baselines every benchmark times beside kittenmoe, in the same run.

``grouped_mm_forward``: the PyTorch MoE path a team would write today on one
GPU: argsort the routes by expert, gather the token rows, two
``torch._grouped_mm`` calls with SwiGLU between, then a weighted
``index_add_`` back to the tokens. Differentiable through autograd. No host
sync (expert counts come from a scatter-add, not ``bincount``).

``all_to_all_forward``: the expert-parallel path a team would write today
with NCCL and PyTorch (the baseline every EP benchmark shows): exchange
per-expert row counts, ``all_to_all_single`` dispatch of the token rows,
grouped_mm experts, reverse ``all_to_all_single`` combine, weighted sum at
the origin. Differentiable through autograd. It needs the split sizes on the
host, so it syncs once per call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kittenmoe.distributed import AllToAllRows, all_to_all_rows, check_inputs_across_ranks, group_rank_size
from kittenmoe.reference import swiglu, swiglu_ffn


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
        out = out + swiglu_ffn(x_TH, shared_w13_2SH, shared_w2_HS, swiglu_limit).float()
    return out.to(x_TH.dtype)


def all_to_all_forward(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_local_L2IH: torch.Tensor,
    w2_local_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    check_ranks: bool = True,
) -> torch.Tensor:
    """This rank's layer output ``[T, H]`` (x's dtype) through all-to-all expert parallelism over ``group``.

    Collective: every rank calls it with its own tokens (T may differ between
    ranks), their global expert ids and router weights, and its own experts
    ``[rank*L, (rank+1)*L)`` as ``w13_local_L2IH`` [L, 2I, H] and
    ``w2_local_LHI`` [L, H, I]; the shared expert is replicated (each rank's
    shared-weight gradient covers its own tokens).

    1. Routing metadata: routes sorted by global expert id (hence by
       destination rank, then local expert); per-(destination, local expert)
       row counts go out with one ``all_to_all_single``, together with this
       rank's count of out-of-range expert ids so that every rank can raise.
    2. The split sizes must be Python ints for ``all_to_all_single``, so they
       are read back to the host (one ``.tolist()``: a device sync every call,
       and the reason this path cannot be captured in a CUDA graph; that is the
       nature of this baseline, not an accident of this code).
    3. Dispatch: ``all_to_all_single`` of the token rows, sorted by destination.
    4. Local experts: received rows argsorted by local expert, two
       ``torch._grouped_mm`` calls with SwiGLU (optionally clamped) between.
    5. Combine: rows back in arrival order, reverse ``all_to_all_single``, then
       at the origin ``out = shared(x) + sum_j w[t, j] * y[t, j]`` in fp32 in
       the fixed order j = 0..K-1.

    ``check_ranks`` (default True) first compares every rank's shapes and
    settings with one small all-gather (``distributed.check_inputs_across_ranks``),
    so a mismatch raises the same clear error on every rank instead of failing
    or hanging inside a collective; benchmarks may turn it off to time the bare
    path.
    """
    rank, R = group_rank_size(group)
    if check_ranks:
        check_inputs_across_ranks("all_to_all_forward", x_TH, topk_ids_TK, topk_weights_TK, w13_local_L2IH,
                                  w2_local_LHI, shared_w13_2SH, shared_w2_HS, swiglu_limit, None, group,
                                  same_tokens=False, uses_block_m=False)
    T, H = x_TH.shape
    K = topk_ids_TK.shape[1]
    L, two_i, _ = w13_local_L2IH.shape
    i = two_i // 2
    E = R * L
    dev = x_TH.device
    i64 = torch.int64

    # 1. Routing metadata.
    flat = topk_ids_TK.reshape(-1).to(i64)
    invalid = (flat < 0) | (flat >= E)
    counts_E = torch.zeros(E, dtype=i64, device=dev).scatter_add_(0, flat.clamp(0, E - 1), (~invalid).to(i64))
    meta_send = torch.cat([counts_E.view(R, L), invalid.sum().expand(R, 1)], dim=1)  # [dest, L + 1]
    meta_recv = all_to_all_rows(meta_send, group)  # [src, L + 1]: rows each source sends me, per local expert
    send_rows = counts_E.view(R, L).sum(1)
    recv_rows = meta_recv[:, :L].sum(1)
    # 2. The host sync: split sizes (and every source's invalid-id count) to Python.
    host = torch.cat([send_rows, recv_rows, meta_recv[:, L]]).tolist()
    send_splits, recv_splits, invalid_per_src = host[:R], host[R:2 * R], host[2 * R:]
    if any(invalid_per_src):
        raise ValueError(f"all_to_all_forward (rank {rank}): routes name an expert id outside [0, E={E}) "
                         f"(count per rank: {invalid_per_src}); every id in topk_ids must be a valid global "
                         f"expert index")
    order = torch.argsort(flat, stable=True)  # by (destination rank, local expert, route)
    # 3. Dispatch.
    x_recv = AllToAllRows.apply(x_TH[order // K], group, recv_splits, send_splits)
    # 4. Local experts. Rows from each source arrive sorted by local expert; their expert ids follow
    # from the counts, then one stable argsort groups them across sources.
    n_recv = sum(recv_splits)
    counts_SL = meta_recv[:, :L]
    local_ids = torch.arange(L, device=dev).repeat(R).repeat_interleave(counts_SL.reshape(-1), output_size=n_recv)
    lorder = torch.argsort(local_ids, stable=True)
    offs = torch.cumsum(counts_SL.sum(0), 0).to(torch.int32)
    gu = torch._grouped_mm(x_recv[lorder], w13_local_L2IH.transpose(1, 2), offs=offs)
    hid = swiglu(gu[:, :i], gu[:, i:], swiglu_limit)
    y_sorted = torch._grouped_mm(hid, w2_local_LHI.transpose(1, 2), offs=offs)
    y_recv = y_sorted[torch.argsort(lorder)]  # back to arrival order
    # 5. Combine: reverse all-to-all, rows back in this rank's route order, weighted fixed-order sum.
    y_back = AllToAllRows.apply(y_recv, group, send_splits, recv_splits)
    y_TKH = y_back[torch.argsort(order)].view(T, K, H)
    if shared_w13_2SH is not None:
        acc = swiglu_ffn(x_TH, shared_w13_2SH, shared_w2_HS, swiglu_limit).float()
    else:
        acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
    w = topk_weights_TK.float()
    for j in range(K):
        acc = acc + w[:, j, None] * y_TKH[:, j].float()
    return acc.to(x_TH.dtype)
