"""Expert parallelism across processes with ``torch.distributed`` collectives: the multi-process torch backend.

``moe_forward_distributed`` is ``torch_backend.moe_forward_multirank`` (the
single-process semantic model) split over real processes: each process holds
its own ``T`` tokens and its own ``L = E / R`` experts, and the steps of
docs/design.md "The pipeline, per rank (forward)" become collectives:

1. routing all-gather: every rank's ``topk_ids`` -> ``[R, T, K]`` (``all_gather``);
2. ``build_schedule`` for this rank, exactly as the single-process model does;
3. pull dispatch: ``x`` is all-gathered (``[R*T, H]``) and routed row ``n`` is
   row ``peer_token_idx[n] // K`` of rank ``peer_rank[n]``'s slab. An
   all-gather is the collective form of "read any row of any peer's ``x``":
   its size comes from shapes, so nothing is read back to the host, where an
   exact all-to-all would need per-peer row counts on the host (that is the
   NCCL baseline's way, ``baselines.all_to_all_forward``);
4. experts per ``block_m`` row tile (``torch_backend.expert_rows``);
5. push combine: each rank writes its rows into an outbox of R slabs, slab
   ``s`` being rank ``s``'s ``[T*K, H]`` combine buffer (rows it does not own
   stay zero), and one equal-split ``all_to_all_single`` delivers slab ``s``
   to rank ``s``. The origin then takes route ``t*K + j`` from the slab of the
   rank that owns expert ``ids[t, j]``: a selection, no arithmetic, so the
   combine buffer is bitwise the single-process model's;
6. epilogue (``torch_backend.epilogue``): shared expert + fixed-order weighted sum.

Forward outputs are bitwise equal to ``moe_forward_multirank``'s (same
schedule, same per-tile arithmetic, exact data movement). Gradients flow
through autograd: the all-gather's backward is the reverse all-to-all followed
by a sum over source ranks in fixed rank order (deterministic); the push's
backward is the reverse all-to-all. Gradients match the single-process model
to fp32 rounding (its sum over destinations runs in another order).

Cost: each rank receives ``R*T*H`` rows of ``x`` and sends ``R*T*K*H`` combine
values, sizes fixed by shapes. This is the semantic model and the CPU path
(gloo), not a fast path: on GPUs the megakernel pulls and pushes only the rows
it needs through peer pointers (``peers.SymmetricPeers``).

Host syncs: inputs are compared across ranks (one small all-gather of a shape
descriptor, read on the host) so that mismatches raise the same clear error on
every rank instead of hanging a later collective; out-of-range expert ids are
reported after the routing all-gather (``raise_if_invalid_routes``), on every
rank alike since every rank sees every route.

All ranks must call these functions in the same order (they are collective),
and run backward together.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist

from kittenmoe.checks import FLOAT_DTYPES, INDEX_DTYPES, _tensor, check_shared_expert, raise_if_invalid_routes
from kittenmoe.schedule import build_schedule
from kittenmoe.torch_backend import DEFAULT_TORCH_BLOCK_M, epilogue, expert_rows

# ---------------------------------------------------------------- collectives with autograd


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of this process in ``group`` (None: the default group); clear error if uninitialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group(...) "
                           "on every rank first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``[n, ...]`` tensor along dim 0 in rank order (no autograd)."""
    _, world = group_rank_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def all_to_all_rows(x: torch.Tensor, group: dist.ProcessGroup | None, out_splits: list[int] | None = None,
                    in_splits: list[int] | None = None) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 (no autograd); equal splits when the split lists are None."""
    n_out = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty((n_out, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class AllGatherRows(torch.autograd.Function):
    """``[T, ...]`` per rank -> ``[R*T, ...]`` (rank order) on every rank.

    Backward: rank r's slab of every rank's gradient comes back to rank r with
    an equal-split all-to-all and is summed over source ranks in rank order
    0..R-1, so the result does not depend on collective internals.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rows = x.shape[0]
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        _, world = group_rank_size(ctx.group)
        slabs = all_to_all_rows(grad, ctx.group).view(world, ctx.rows, *grad.shape[1:])
        acc = slabs[0]
        for s in range(1, world):
            acc = acc + slabs[s]
        return acc, None


class AllToAllRows(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` along dim 0; backward is the reverse all-to-all.

    ``out_splits``/``in_splits``: rows received from / sent to each rank (host
    ints), or None for equal splits. (``torch.distributed.nn.functional.
    all_to_all_single`` does the same but is deprecated in torch 2.13.)
    """

    @staticmethod
    def forward(ctx, x, group, out_splits=None, in_splits=None):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all_rows(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


# ---------------------------------------------------------------- input checks across ranks

_DTYPES = (*FLOAT_DTYPES, *INDEX_DTYPES)
# Descriptor fields every rank all-gathers, in order. "ok" is 0 where the
# rank's local checks failed; "invalid" counts its out-of-range expert ids.
_FIELDS = ("ok", "T", "H", "K", "L", "I", "S", "dtype", "block_m", "swiglu_limit", "invalid")


def _limit_code(swiglu_limit: float | None) -> int:
    """swiglu_limit as int64 bits of its float64 value; None -> a NaN pattern no valid limit has."""
    if swiglu_limit is None:
        return -1
    return struct.unpack("<q", struct.pack("<d", float(swiglu_limit)))[0]


def _check_local(x, ids, w, w13, w2, sw13, sw2, swiglu_limit, block_m, world, uses_block_m) -> dict:
    """Validate this rank's inputs (TypeError/ValueError); return its descriptor fields.

    "invalid" (the count of out-of-range expert ids) is a 0-d device tensor,
    read on the host together with the rest after the all-gather.
    """
    _tensor("x", x, 2, FLOAT_DTYPES, None)
    dev = x.device
    _tensor("topk_ids", ids, 2, INDEX_DTYPES, dev)
    _tensor("topk_weights", w, 2, FLOAT_DTYPES, dev)
    _tensor("w13_local", w13, 3, FLOAT_DTYPES, dev)
    _tensor("w2_local", w2, 3, FLOAT_DTYPES, dev)
    t, h = x.shape
    local_e, two_i, hw = w13.shape
    if two_i % 2:
        raise ValueError(f"w13_local must be [L, 2*I, H] (gate rows then up rows); dim 1 = {two_i} is odd")
    i = two_i // 2
    if hw != h:
        raise ValueError(f"x has hidden size {h} but w13_local {tuple(w13.shape)} expects H={hw}")
    if local_e < 1:
        raise ValueError("w13_local has no experts (L=0); every rank needs L = E / R >= 1 experts")
    if tuple(w2.shape) != (local_e, h, i):
        raise ValueError(f"w2_local must be [L, H, I] = {(local_e, h, i)} to match w13_local {tuple(w13.shape)}, "
                         f"got {tuple(w2.shape)}")
    if w2.dtype != w13.dtype or x.dtype != w13.dtype:
        raise TypeError(f"x ({x.dtype}), w13_local ({w13.dtype}) and w2_local ({w2.dtype}) must share a dtype")
    if t == 0:
        raise ValueError("x has no tokens (T=0)")
    k = ids.shape[1]
    if tuple(ids.shape) != (t, k) or tuple(w.shape) != (t, k):
        raise ValueError(f"topk_ids {tuple(ids.shape)} and topk_weights {tuple(w.shape)} must both be [T, K] "
                         f"with T={t} (x's tokens)")
    if k < 1:
        raise ValueError("topk_ids has K=0 columns; at least one expert per token is needed")
    if k > local_e * world:
        raise ValueError(f"top-k K={k} exceeds the number of experts E = R*L = {world}*{local_e}")
    s = check_shared_expert(sw13, sw2, h, w13.dtype, dev, min_width=1)
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))
                                     or not math.isfinite(swiglu_limit) or swiglu_limit <= 0):
        raise ValueError(f"swiglu_limit must be a finite number > 0 or None, got {swiglu_limit!r}")
    if uses_block_m and (isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1):
        raise ValueError(f"block_m must be an int >= 1, got {block_m!r}")
    flat = ids.reshape(-1)
    return {"ok": 1, "T": t, "H": h, "K": k, "L": local_e, "I": i, "S": s, "dtype": _DTYPES.index(x.dtype),
            "block_m": block_m if uses_block_m else 0, "swiglu_limit": _limit_code(swiglu_limit),
            "invalid": ((flat < 0) | (flat >= local_e * world)).sum()}


def check_inputs_across_ranks(
    fn_name: str,
    x_TH, topk_ids_TK, topk_weights_TK, w13_local_L2IH, w2_local_LHI, shared_w13_2SH, shared_w2_HS,
    swiglu_limit, block_m, group: dist.ProcessGroup | None, *, same_tokens: bool, uses_block_m: bool,
) -> dict:
    """Validate this rank's inputs, then compare every rank's shapes and settings.

    Collective (one all-gather of a small int64 descriptor, read on the host).
    Every rank reaches the all-gather even when its own checks failed, so a
    problem on any rank raises on every rank, before any data moves: the rank
    with bad input raises its own TypeError/ValueError, the others a
    ValueError naming it; a mismatch between ranks raises the same ValueError
    (with every rank's value) everywhere. Out-of-range expert ids are counted
    too and reported on every rank. ``same_tokens``: whether T must be equal
    on every rank. ``uses_block_m``: whether ``block_m`` is checked and
    compared (False: the caller has no row tile). Returns this rank's descriptor fields.
    """
    rank, world = group_rank_size(group)
    local_error = None
    try:
        desc = _check_local(x_TH, topk_ids_TK, topk_weights_TK, w13_local_L2IH, w2_local_LHI, shared_w13_2SH,
                            shared_w2_HS, swiglu_limit, block_m, world, uses_block_m)
    except (TypeError, ValueError) as e:  # re-raised below, after the other ranks have heard of it
        local_error = e
        desc = dict.fromkeys(_FIELDS, 0)
    if isinstance(x_TH, torch.Tensor):
        dev = x_TH.device
    else:
        backend = str(dist.get_backend(group))
        dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    mine = torch.tensor([desc[f] for f in _FIELDS[:-1]], dtype=torch.int64, device=dev)
    mine = torch.cat([mine, torch.as_tensor(desc["invalid"], dtype=torch.int64, device=dev).reshape(1)])
    table = all_gather_rows(mine[None], group).tolist()  # [R][fields]
    if local_error is not None:
        raise type(local_error)(f"{fn_name} (rank {rank}): {local_error}") from local_error
    bad = [r for r in range(world) if table[r][0] == 0]
    if bad:
        raise ValueError(f"{fn_name} (rank {rank}): rank(s) {bad} rejected their inputs (see the error raised "
                         f"there); nothing was exchanged")
    compared = [f for f in _FIELDS if f not in ("ok", "invalid") and (same_tokens or f != "T")]
    diffs = []
    for f in compared:
        col = [row[_FIELDS.index(f)] for row in table]
        if len(set(col)) > 1:
            if f == "dtype":
                col = [str(_DTYPES[c]) for c in col]
            elif f == "swiglu_limit":
                col = [None if c == -1 else struct.unpack("<d", struct.pack("<q", c))[0] for c in col]
            diffs.append(f"{f}: {col}")
    if diffs:
        what = "shapes and settings" if same_tokens else "shapes and settings (T may differ here)"
        raise ValueError(f"{fn_name} (rank {rank}): every rank must pass the same {what}; they differ, "
                         f"listed in rank order 0..{world - 1}: " + "; ".join(diffs))
    invalid = [row[_FIELDS.index("invalid")] for row in table]
    if any(invalid):
        raise ValueError(f"{fn_name} (rank {rank}): routes name an expert id outside [0, E={desc['L'] * world}) "
                         f"(count per rank: {invalid}); every id in topk_ids must be a valid global expert index")
    desc["invalid"] = 0
    return desc


# ---------------------------------------------------------------- the multi-process torch backend


def moe_forward_distributed(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_local_L2IH: torch.Tensor,
    w2_local_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    group: dist.ProcessGroup | None = None,
    block_m: int = DEFAULT_TORCH_BLOCK_M,
) -> torch.Tensor:
    """This rank's layer output ``[T, H]`` (x's dtype) under expert parallelism over ``group``.

    Collective: every rank of ``group`` calls it with its own ``T`` tokens
    (the same T everywhere), their global expert ids ``topk_ids_TK`` and
    router weights, and its own experts ``[rank*L, (rank+1)*L)``:
    ``w13_local_L2IH`` [L, 2I, H], ``w2_local_LHI`` [L, H, I]. The shared
    expert is replicated; each rank's shared-weight gradient covers its own
    tokens (all-reduce it, as data parallelism does). See the module
    docstring for how each pipeline step maps to a collective.
    """
    rank, R = group_rank_size(group)
    check_inputs_across_ranks("moe_forward_distributed", x_TH, topk_ids_TK, topk_weights_TK, w13_local_L2IH,
                              w2_local_LHI, shared_w13_2SH, shared_w2_HS, swiglu_limit, block_m, group,
                              same_tokens=True, uses_block_m=True)
    T, H = x_TH.shape
    K = topk_ids_TK.shape[1]
    L = w13_local_L2IH.shape[0]

    # 1. Routing all-gather.
    ids_TK = topk_ids_TK.to(torch.int64)
    ids_RTK = all_gather_rows(ids_TK[None], group)
    # 2. This rank's schedule.
    sched = build_schedule(ids_RTK, rank, L, block_m)
    raise_if_invalid_routes(sched.num_invalid, R * L)  # (the descriptor check has already caught them)
    # 3. Pull dispatch from the all-gathered x.
    x_all = AllGatherRows.apply(x_TH, group)  # [R*T, H]
    valid = sched.peer_rank >= 0
    src = sched.peer_rank.long().clamp(min=0)
    tok = sched.peer_token_idx.long().clamp(min=0)
    x_routed = torch.where(valid[:, None], x_all[src * T + tok // K], 0)
    # 4. Experts per row tile.
    y_routed = expert_rows(x_routed, sched, w13_local_L2IH, w2_local_LHI, swiglu_limit)
    # 5. Push combine: slab s of the outbox is rank s's combine buffer; padding rows go to a dump row.
    dest = torch.where(valid, src * (T * K) + tok, R * T * K)
    outbox = y_routed.new_zeros(R * T * K + 1, H).index_copy(0, dest, y_routed)[: R * T * K]
    inbox = AllToAllRows.apply(outbox, group).view(R, T * K, H)  # slab d: what rank d computed for me
    owner = ids_TK.reshape(-1) // L
    combine_TKH = inbox[owner, torch.arange(T * K, device=owner.device)].view(T, K, H)
    # 6. Epilogue.
    return epilogue(x_TH, combine_TKH, topk_weights_TK, shared_w13_2SH, shared_w2_HS, swiglu_limit)
