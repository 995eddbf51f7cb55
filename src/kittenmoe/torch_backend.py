"""The multi-rank pipeline in torch ops: the ``torch`` backend.

This is the semantic model the Triton megakernel must match, step for step
(docs/design.md "The pipeline, per rank (forward)"), and the CPU path of the layer:

1. every rank's routing ``[R, T, K]`` is gathered;
2. each destination rank builds its ``Schedule``;
3. pull dispatch: routed row ``n`` of rank d is row ``peer_token_idx[n] // K``
   of rank ``peer_rank[n]``'s ``x``; padding rows are zero;
4. experts: each ``block_m`` row tile belongs to one local expert
   (``tile_expert``) and runs its SwiGLU FFN (padding rows stay exactly 0);
5. push combine: row n lands in rank ``peer_rank[n]``'s ``[T*K, H]`` combine
   buffer at ``peer_token_idx[n]``;
6. epilogue: ``out = y_shared + sum_j w[t, j] * combine[t*K + j]`` in fp32,
   j in fixed order, cast to x's dtype.

All R virtual ranks live in one process (the ``LocalPeers`` setting), so the
pull and push are plain indexing into stacked tensors and autograd runs
through everything. ``expert_rows`` runs one GEMM pair per local expert over
its contiguous rows with that expert's own weights (no per-tile weight copy);
it reads the schedule's ``[L + 1]`` expert offsets to the host once per call
(under ``torch.compile`` it runs every tile instead, see there).
"""

from __future__ import annotations

import torch

from kittenmoe.checks import MoEDims, check_moe_inputs, raise_if_invalid_routes
from kittenmoe.reference import swiglu
from kittenmoe.schedule import Schedule, build_schedule

DEFAULT_TORCH_BLOCK_M = 16


def expert_rows(
    x_routed_NH: torch.Tensor,
    sched: Schedule,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Run each local expert's rows through its SwiGLU FFN; returns y_routed [C, H].

    Row tile ``n`` (``block_m`` rows) belongs to local expert ``tile_expert[n]``;
    the schedule sorts rows by expert, so expert ``e``'s tiles are exactly rows
    ``[expert_offsets[e], expert_offsets[e + 1])`` and one GEMM over that range
    with expert ``e``'s weights is the same work as its tiles one by one.
    Padding rows (zero in x) stay exactly 0; rows past ``num_rows``
    (``tile_expert < 0``) are 0 without being computed.

    gate|up stays fp32 through SwiGLU (as a GEMM epilogue on fp32 accumulators
    does): rounding it to bf16 first would move values across the clamp. hidden
    is rounded to the input dtype before the down GEMM.
    """
    if torch.compiler.is_compiling():
        # dynamo cannot take sizes from the offsets without a graph break (fullgraph traces of the torch
        # backend, tests/test_layer.py): run every tile with its own expert's weights instead. Memory
        # tiles x 2I x H, fine for the shapes one compiles this backend at.
        return _expert_rows_tiled(x_routed_NH, sched, w13_L2IH, w2_LHI, swiglu_limit)
    c, h = x_routed_NH.shape
    i = w2_LHI.shape[2]
    # The one host read here: [L + 1] ints (a sync when the schedule is on a GPU; this reference path already
    # syncs once in raise_if_invalid_routes). Every size below comes from it.
    offsets = sched.expert_offsets.tolist()
    num_rows = offsets[-1]
    busy = [e for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e]]
    # One unbind (not an index per expert): its backward stacks the per-expert gradients into one tensor
    # (zeros for experts without rows) instead of one weight-sized zeros tensor per expert.
    w13_e, w2_e = w13_L2IH.unbind(0), w2_LHI.unbind(0)
    ys = []
    # No rows at all: expert 0 on an empty range keeps x and the weights in the graph (zero gradients).
    for e in busy or [0]:
        lo, hi = (offsets[e], offsets[e + 1]) if busy else (0, 0)
        # Only this expert's weights are cast (a no-op when they are fp32 already).
        gu = x_routed_NH[lo:hi].float() @ w13_e[e].float().t()
        hid = swiglu(gu[:, :i], gu[:, i:], swiglu_limit).to(x_routed_NH.dtype)
        ys.append(hid @ w2_e[e].t())
    if num_rows < c:  # rows past num_rows (and past the last full tile) are never used
        ys.append(ys[0].new_zeros(c - num_rows, h))
    return torch.cat(ys)


def _expert_rows_tiled(x_routed_NH, sched, w13_L2IH, w2_LHI, swiglu_limit):
    """``expert_rows`` one ``block_m`` tile at a time, gathering each tile's expert weights: no host read
    (traceable by dynamo), but ``tiles x 2I x H`` fp32 weight copies. Same values as ``expert_rows`` up to
    fp32 GEMM accumulation order."""
    bm = sched.block_m
    nt = sched.num_tiles
    c, h = x_routed_NH.shape
    i = w2_LHI.shape[2]
    # Tiles past num_rows are all padding (zero rows); any expert gives 0 there.
    te = sched.tile_expert.long().clamp(min=0)
    x_tiles = x_routed_NH[: nt * bm].view(nt, bm, h)
    gu = torch.bmm(x_tiles.float(), w13_L2IH[te].float().transpose(1, 2))
    hid = swiglu(gu[..., :i], gu[..., i:], swiglu_limit).to(x_routed_NH.dtype)
    y = torch.bmm(hid, w2_LHI[te].transpose(1, 2)).reshape(nt * bm, h)
    if nt * bm < c:  # rows after the last full tile are never used
        y = torch.cat([y, y.new_zeros(c - nt * bm, h)])
    return y


def epilogue(
    x_TH: torch.Tensor,
    combine_TKH: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """out = shared(x) + sum_j w[:, j] * combine[:, j], fp32, fixed j order; cast to x's dtype."""
    t, k, h = combine_TKH.shape
    if shared_w13_2SH is not None:
        s = shared_w2_HS.shape[1]
        gu = x_TH.float() @ shared_w13_2SH.float().t()
        hid = swiglu(gu[:, :s], gu[:, s:], swiglu_limit).to(x_TH.dtype)
        acc = (hid @ shared_w2_HS.t()).float()
    else:
        acc = x_TH.new_zeros(t, h, dtype=torch.float32)
    w = topk_weights_TK.float()
    for j in range(k):
        acc = acc + w[:, j, None] * combine_TKH[:, j].float()
    return acc.to(x_TH.dtype)


def moe_forward_multirank(
    x_RTH: list[torch.Tensor],
    topk_ids_RTK: list[torch.Tensor],
    topk_weights_RTK: list[torch.Tensor],
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    block_m: int = DEFAULT_TORCH_BLOCK_M,
) -> list[torch.Tensor]:
    """Every rank's layer output from every rank's inputs, through the schedule.

    ``w13_E2IH``/``w2_EHI`` are the global expert weights; rank d uses its
    slice ``[d*L, (d+1)*L)`` (views, so gradients land in the global tensor).
    The shared expert is one replicated tensor.
    """
    dims = check_moe_inputs(x_RTH, topk_ids_RTK, topk_weights_RTK, w13_E2IH, w2_EHI, shared_w13_2SH,
                            shared_w2_HS)
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    ids_all = torch.stack(list(topk_ids_RTK))
    y_all, dest_all = _dispatch_experts(torch.stack(list(x_RTH)), ids_all, w13_E2IH, w2_EHI, swiglu_limit,
                                        block_m, dims)
    R, T, K, H = dims.r, dims.t, dims.k, dims.h
    # Push combine: every owned route is written exactly once; padding rows
    # (all zeros) go to a dump row past the end.
    combine = y_all.new_zeros(R * T * K + 1, H).index_copy(0, dest_all, y_all)
    combine_RTKH = combine[: R * T * K].view(R, T, K, H)
    return [
        epilogue(x_RTH[r], combine_RTKH[r], topk_weights_RTK[r], shared_w13_2SH, shared_w2_HS, swiglu_limit)
        for r in range(R)
    ]


def _dispatch_experts(x_RTH, ids_RTK, w13_E2IH, w2_EHI, swiglu_limit, block_m, dims: MoEDims):
    R, T, K, H, L = dims.r, dims.t, dims.k, dims.h, dims.experts_per_rank
    x_flat = x_RTH.reshape(R * T, H)
    ys, dests = [], []
    for d in range(R):
        sched = build_schedule(ids_RTK, d, L, block_m, impl="torch")  # the model; traceable by dynamo
        if d == 0:
            raise_if_invalid_routes(sched.num_invalid, dims.e)
        valid = sched.peer_rank >= 0
        src = sched.peer_rank.long().clamp(min=0)
        tok = sched.peer_token_idx.long().clamp(min=0)
        # Pull dispatch.
        x_routed = torch.where(valid[:, None], x_flat[src * T + tok // K], 0)
        ys.append(expert_rows(x_routed, sched, w13_E2IH[d * L:(d + 1) * L], w2_EHI[d * L:(d + 1) * L],
                              swiglu_limit))
        dests.append(torch.where(valid, src * (T * K) + tok, R * T * K))
    return torch.cat(ys), torch.cat(dests)


def moe_forward(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    block_m: int = DEFAULT_TORCH_BLOCK_M,
) -> torch.Tensor:
    """Single-rank (R=1) form of ``moe_forward_multirank``."""
    return moe_forward_multirank([x_TH], [topk_ids_TK], [topk_weights_TK], w13_E2IH, w2_EHI, shared_w13_2SH,
                                 shared_w2_HS, swiglu_limit, block_m)[0]
