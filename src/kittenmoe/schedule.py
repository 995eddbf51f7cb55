"""The on-device routing schedule (docs/design.md "The pipeline, per rank (forward)", step 2).

One rank's routed buffer is laid out by a two-column table indexed by
destination row: ``peer_rank[row]`` (source rank) and ``peer_token_idx[row]``
(``t * K + j`` of the source route). Rows are sorted by (local expert,
per-source ordinal, source rank): each expert's rows are contiguous and the
source ranks interleave round-robin so every link carries similar load. Each
expert segment is padded to a multiple of ``block_m`` with ``-1`` rows.

Built from torch ops with fixed output sizes: no host sync, no size taken from
data, identical on CPU and CUDA (integer sorts on unique keys, integer
scatter-adds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kittenmoe.checks import check_triton_device
from kittenmoe.config import routed_capacity

# A routing entry that is no route at all: the padding tokens of an expert-parallel rank with fewer tokens than
# the workspace's max (``SymmetricPeers(max_tokens=...)``). Skipped by the schedule and the epilogues, and not
# counted as an invalid expert id (a user's stray -1 or E still is). INT32_MAX: no real id comes near it.
NO_ROUTE = 2**31 - 1


@dataclass(frozen=True)
class Schedule:
    """Routing tables for one destination rank.

    C = ``capacity`` = R*T*K + L*(block_m - 1), the worst case (every route of
    every rank lands here), so the table can never overflow.
    """

    peer_rank: torch.Tensor  # [C] int32, source rank of each row; -1 for padding and unused rows
    peer_token_idx: torch.Tensor  # [C] int32, t*K + j on the source rank; -1 for padding and unused rows
    expert_offsets: torch.Tensor  # [L + 1] int32, first row of each expert's padded segment; [L] = num_rows
    expert_counts: torch.Tensor  # [L] int32, real (unpadded) rows of each local expert
    num_rows: torch.Tensor  # [1] int32, padded rows in use (a multiple of block_m)
    tile_expert: torch.Tensor  # [C // block_m] int32, local expert of each row tile; -1 past num_rows
    num_invalid: torch.Tensor  # [1] int32, routes on any rank whose expert id is outside [0, E) (NO_ROUTE aside)
    # [L] int32, the local experts by real rows, most first, ties in expert order (a stable sort): the order the
    # weight-gradient kernels take their tiles in (``kernels/megakernel_bwd.py``, ``_wgrad_slot_tile``)
    expert_order: torch.Tensor
    # [R * T * K] int32, the routed row of each route r*T*K + t*K + j (source r's route t*K + j) on this rank, -1
    # where it has none (another rank's expert, an invalid id, NO_ROUTE): what a one-rank epilogue gathers by
    route_row: torch.Tensor
    rank: int
    num_ranks: int
    experts_per_rank: int
    tokens: int
    topk: int
    block_m: int
    # the nine tables above as views of one int32 buffer, in that order (``packed``), where they were built so
    table: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.peer_rank.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.shape[0]

    def packed(self) -> torch.Tensor:
        """The nine tables in one int32 tensor of ``table_length`` entries: peer_rank, peer_token_idx,
        expert_offsets, expert_counts, num_rows, tile_expert, num_invalid, expert_order, route_row, each from a
        16-byte boundary. What a forward hands its backward so that the backward does not build the same schedule
        again (``from_table``). No copy where the tables were built as views of one buffer (the Triton build); one
        copy each otherwise."""
        if self.table is not None:
            return self.table
        parts = (self.peer_rank, self.peer_token_idx, self.expert_offsets, self.expert_counts, self.num_rows,
                 self.tile_expert, self.num_invalid, self.expert_order, self.route_row)
        n = self.route_row.shape[0]
        table = torch.zeros(table_length(self.capacity, self.experts_per_rank, self.block_m, n), dtype=torch.int32,
                            device=self.peer_rank.device)
        for dst, src in zip(_split_table(table, self.capacity, self.experts_per_rank, self.block_m, n), parts):
            dst.copy_(src.reshape(-1))
        return table

    @classmethod
    def from_table(cls, table: torch.Tensor, rank: int, num_ranks: int, experts_per_rank: int, tokens: int,
                   topk: int, block_m: int) -> Schedule:
        """The schedule ``packed`` gave as ``table``, for routing of ``num_ranks`` x ``tokens`` x ``topk`` to
        ``experts_per_rank`` experts of ``rank`` at ``block_m`` (views, no copy). A table of another length or
        dtype is refused: it was built for another problem."""
        C = routed_capacity(num_ranks, tokens, topk, experts_per_rank, block_m)
        L = experts_per_rank
        n = table_length(C, L, block_m, num_ranks * tokens * topk)
        if table.dtype != torch.int32 or table.dim() != 1 or table.shape[0] != n or not table.is_contiguous():
            raise ValueError(f"a schedule table for R={num_ranks}, T={tokens}, K={topk}, L={L}, block_m={block_m} is "
                             f"a contiguous int32 tensor of {n} entries, got {table.dtype} of shape "
                             f"{tuple(table.shape)}: it was built for another problem")
        parts = _split_table(table, C, L, block_m, num_ranks * tokens * topk)
        return cls(*parts, rank=rank, num_ranks=num_ranks, experts_per_rank=L, tokens=tokens, topk=topk,
                   block_m=block_m, table=table)


def _table_entries(capacity: int, experts_per_rank: int, block_m: int, num_routes: int) -> tuple[int, ...]:
    """Entries of each of the nine tables, in ``Schedule.packed``'s order (``num_routes``: R*T*K)."""
    L = experts_per_rank
    return capacity, capacity, L + 1, L, 1, capacity // block_m, 1, L, num_routes


def _table_sizes(capacity: int, experts_per_rank: int, block_m: int, num_routes: int) -> list[int]:
    """Entries of each table in the packed form, each rounded up to 4 (16 bytes): every table starts where a
    separate allocation would be aligned, so the kernels reading them keep their pointer specialisations."""
    return [-(-n // 4) * 4 for n in _table_entries(capacity, experts_per_rank, block_m, num_routes)]


def table_length(capacity: int, experts_per_rank: int, block_m: int, num_routes: int) -> int:
    """Entries of a schedule's packed table (``Schedule.packed``) for ``capacity`` routed rows and ``num_routes``
    (R*T*K) routes."""
    return sum(_table_sizes(capacity, experts_per_rank, block_m, num_routes))


@functools.lru_cache(maxsize=64)
def _split_pieces(capacity: int, experts_per_rank: int, block_m: int, num_routes: int) -> tuple[int, ...]:
    """Each table's entries, then its padding to the next 16-byte boundary, table after table."""
    return tuple(v for n, size in zip(_table_entries(capacity, experts_per_rank, block_m, num_routes),
                                      _table_sizes(capacity, experts_per_rank, block_m, num_routes))
                 for v in (n, size - n))


def _split_table(table: torch.Tensor, capacity: int, experts_per_rank: int, block_m: int,
                 num_routes: int) -> list[torch.Tensor]:
    """The nine tables of a packed table, views, each its own length (the padding past it left out): one split
    into tables and paddings, every other piece kept (a forward and a backward each split one: 18 view ops a
    call were 9 us more on a CPU core)."""
    return list(table.split_with_sizes(_split_pieces(capacity, experts_per_rank, block_m, num_routes))[::2])


def check_routing_ids(topk_ids_RTK: torch.Tensor) -> None:
    if not isinstance(topk_ids_RTK, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids_RTK).__name__}")
    if topk_ids_RTK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_RTK.dtype}")
    if topk_ids_RTK.dim() != 3:
        raise ValueError(f"topk_ids_RTK must be [R, T, K], got shape {tuple(topk_ids_RTK.shape)}")


def ids_int32(topk_ids: torch.Tensor, padding: bool = False) -> torch.Tensor:
    """Routing ids as the int32 the schedule and kernels read, without a wrong id turning into a valid one.

    A plain cast wraps int64 ids: 2**32 + 3 would route to expert 3. Here every id outside ``[0, NO_ROUTE)``
    becomes -1, which the schedule counts as invalid (``Schedule.num_invalid``) and the entries raise.
    ``padding``: ``NO_ROUTE`` stays as it is (the launchers' and ``ep``'s padding tokens, never dispatched);
    without it, as for a caller's own ids, ``NO_ROUTE`` is invalid too, not a route silently dropped. An int32
    tensor with ``padding`` comes back as it is (no id of it can wrap)."""
    if padding and topk_ids.dtype == torch.int32:
        return topk_ids
    top = NO_ROUTE if padding else NO_ROUTE - 1  # (both fit int32: the comparison never overflows)
    return torch.where((topk_ids >= 0) & (topk_ids <= top), topk_ids, -1).to(torch.int32)


def stack_ids(topk_ids_RTK) -> torch.Tensor:
    """Every rank's ``[T, K]`` routing ids as one contiguous int32 ``[R, T, K]`` (``ids_int32`` with padding): the
    launchers' routing all-gather. One rank's is a view of its ids when they are int32 already (no copy)."""
    if len(topk_ids_RTK) == 1:
        return ids_int32(topk_ids_RTK[0], padding=True).contiguous().unsqueeze(0)
    return torch.stack([ids_int32(ids, padding=True) for ids in topk_ids_RTK])


def _check_args(R: int, T: int, K: int, rank: int, L: int, block_m: int) -> None:
    if not 0 <= rank < R:
        raise ValueError(f"build_schedule: rank={rank} outside [0, R={R})")
    if L < 1:
        raise ValueError(f"build_schedule: experts_per_rank must be >= 1, got {L}")
    if block_m < 1:
        raise ValueError(f"build_schedule: block_m must be >= 1, got {block_m}")
    rows = routed_capacity(R, T, K, L, block_m)
    if rows >= NO_ROUTE:  # the tables and the kernels index routes and routed rows in int32
        raise ValueError(f"build_schedule: {R} x {T} x {K} routes and each expert's padding make {rows} routed rows "
                         f"a rank at worst; routes and rows are indexed in int32 (below {NO_ROUTE}): split the "
                         f"batch into smaller calls")


def build_schedule(topk_ids_RTK: torch.Tensor, rank: int, experts_per_rank: int, block_m: int,
                   impl: str | None = None) -> Schedule:
    """Schedule of destination ``rank`` from every rank's routing ``[R, T, K]`` (global expert ids).

    ``impl``: "torch" (torch ops, the model) or "triton" (three Triton launches,
    kernels/schedule.py; same tables bit for bit, checked under the
    interpreter and on the H200). Default: "triton" for CUDA tensors (Kimi
    slice on the H200: 0.057 ms against 1.023 ms for the ~30
    torch ops, most of it host time), "torch" otherwise. "triton" on CPU
    tensors needs TRITON_INTERPRET=1.
    """
    check_routing_ids(topk_ids_RTK)
    if impl is None:
        impl = "triton" if topk_ids_RTK.is_cuda else "torch"
    if impl == "triton":
        return _build_schedule_triton(topk_ids_RTK, rank, experts_per_rank, block_m)
    if impl != "torch":
        raise ValueError(f"build_schedule: impl must be 'torch' or 'triton', got {impl!r}")
    R, T, K = topk_ids_RTK.shape
    L = experts_per_rank
    _check_args(R, T, K, rank, L, block_m)
    dev = topk_ids_RTK.device
    P = T * K  # routes per source rank
    C = routed_capacity(R, T, K, L, block_m)
    i64 = torch.int64

    ids_RP = topk_ids_RTK.reshape(R, P).to(i64)
    num_invalid = (((ids_RP < 0) | (ids_RP >= R * L)) & (ids_RP != NO_ROUTE)).sum().to(torch.int32).reshape(1)
    local_RP = ids_RP - rank * L
    mine_RP = (local_RP >= 0) & (local_RP < L)
    # Bucket L collects every route this rank does not own.
    bucket_RP = torch.where(mine_RP, local_RP, L)
    cnt_RB = torch.zeros(R, L + 1, dtype=i64, device=dev).scatter_add_(1, bucket_RP, torch.ones_like(bucket_RP))

    # Ordinal of each route among the routes of the same (source, expert), in
    # (t, j) order: a stable sort groups them, position minus group start.
    sorted_b_RP, order_RP = torch.sort(bucket_RP, dim=1, stable=True)
    start_RB = torch.cumsum(cnt_RB, dim=1) - cnt_RB
    pos_P = torch.arange(P, dtype=i64, device=dev).expand(R, P)
    ordinal_RP = torch.empty_like(order_RP).scatter_(1, order_RP, pos_P - start_RB.gather(1, sorted_b_RP))

    # Sort every owned route by (expert, ordinal, source); the key is unique
    # per route. Foreign routes get a key past every owned one.
    src_RP = torch.arange(R, dtype=i64, device=dev)[:, None].expand(R, P)
    key_RP = (local_RP * P + ordinal_RP) * R + src_RP
    key_RP = torch.where(mine_RP, key_RP, L * P * R)
    sorted_key, order = torch.sort(key_RP.reshape(-1))
    owned = sorted_key < L * P * R
    e_sorted = torch.where(owned, sorted_key // (P * R), 0)

    cnt_L = cnt_RB[:, :L].sum(0)
    unpadded_start_L = torch.cumsum(cnt_L, 0) - cnt_L
    padded_L = (cnt_L + block_m - 1) // block_m * block_m
    # The end offsets are their own buffer (not offsets[1:]): inductor on CUDA (torch 2.11) cannot lower
    # searchsorted over a sliced view ("NotImplementedError: SliceView"), seen when compiling the torch backend.
    ends_L = torch.cumsum(padded_L, 0)
    offsets = torch.cat([torch.zeros(1, dtype=i64, device=dev), ends_L])
    # Destination row of each sorted route; foreign routes go to a dump row C.
    s = torch.arange(R * P, dtype=i64, device=dev)
    row = torch.where(owned, offsets[e_sorted] + s - unpadded_start_L[e_sorted], C)
    src = order // P
    tok = order % P
    # order is a permutation of the R*P routes (r*P + p): each route's row written once
    route_row = torch.empty(R * P, dtype=torch.int32, device=dev).scatter_(
        0, order, torch.where(owned, row, -1).to(torch.int32))

    peer_rank = torch.full((C + 1,), -1, dtype=torch.int32, device=dev)
    peer_token_idx = torch.full((C + 1,), -1, dtype=torch.int32, device=dev)
    # Owned rows are unique; the dump row only receives -1.
    peer_rank.scatter_(0, row, torch.where(owned, src, -1).to(torch.int32))
    peer_token_idx.scatter_(0, row, torch.where(owned, tok, -1).to(torch.int32))

    num_rows = offsets[L:].clone()
    n_tiles = C // block_m
    tile_start = torch.arange(n_tiles, dtype=i64, device=dev) * block_m
    tile_expert = torch.searchsorted(ends_L, tile_start, right=True)
    tile_expert = torch.where(tile_start < num_rows, tile_expert, -1)

    return Schedule(
        peer_rank=peer_rank[:C],
        peer_token_idx=peer_token_idx[:C],
        expert_offsets=offsets.to(torch.int32),
        expert_counts=cnt_L.to(torch.int32),
        num_rows=num_rows.to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        num_invalid=num_invalid,
        expert_order=torch.sort(cnt_L, descending=True, stable=True).indices.to(torch.int32),
        route_row=route_row,
        rank=rank,
        num_ranks=R,
        experts_per_rank=L,
        tokens=T,
        topk=K,
        block_m=block_m,
    )


def _build_schedule_triton(topk_ids_RTK: torch.Tensor, rank: int, experts_per_rank: int, block_m: int,
                           programs: int = 1024) -> Schedule:
    """``programs``: how many chunk programs the launches aim at (R*NCH; at most one a BLOCK of routes). Tests
    pass a few, to get several BLOCKs a chunk from a routing small enough for the interpreter."""
    from kittenmoe.intmath import cdiv, next_pow2
    from kittenmoe.kernels import schedule as ks

    R, T, K = topk_ids_RTK.shape
    L = experts_per_rank
    _check_args(R, T, K, rank, L, block_m)
    dev = topk_ids_RTK.device
    check_triton_device(dev, "build_schedule(impl='triton')")
    P = T * K
    C = routed_capacity(R, T, K, L, block_m)
    i32 = torch.int32
    ids = topk_ids_RTK.reshape(R, P).to(i32).contiguous()
    # NCH chunks a source of CH routes each (a multiple of BLOCK), one program each in the count and placement
    # launches: ~1024 programs where there are enough BLOCKs (~8 a Hopper SM), at least one chunk a source, also
    # at P = 0. T = 32768, K = 8: R = 1, 1024 chunks of 256 routes; R = 8, 128 chunks of 2048 routes a source.
    # BLOCK, the placement's step: 128 routes on 4 warps for one source, 64 on 2 warps for several, where most
    # routes are other ranks' and its [BLOCK, BLOCK] comparison is most of the work (H100, R = 8, T = 4096,
    # L = 48: 21 us with 64 against 27 with 128; R = 1, T = 8192, L = 128: 15 us with 128 against 17 with 64).
    rb = next_pow2(R)
    lb = max(32, next_pow2(L))  # tl.histogram takes at least a bin a lane of the warp
    block = 128 if R == 1 else 64
    nblk = cdiv(P, block)
    nch = max(1, min(nblk, cdiv(programs, R)))
    ch = cdiv(nblk, nch) * block if nblk else block
    nch = max(1, cdiv(P, ch))
    hist = torch.empty(R, nch, L, dtype=i32, device=dev)
    bad = torch.empty(R, nch, dtype=i32, device=dev)
    # the count takes a chunk in one step up to 1024 routes: a histogram step costs two barriers and L/32 shared
    # atomics a thread whatever its width
    ks.schedule_count_kernel[(nch, R)](ids, hist, bad, P, rank, L, R * L, nch, ch, LB=lb,
                                       BLOCK=min(1024, next_pow2(ch)), NO_ROUTE=NO_ROUTE)
    # the nine tables as views of one buffer (Schedule.packed: what a forward hands its backward), one allocation
    table = torch.empty(table_length(C, L, block_m, R * P), dtype=i32, device=dev)
    (peer_rank, peer_tok, offsets, counts, num_rows, tile_expert, num_invalid, order,
     route_row) = _split_table(table, C, L, block_m, R * P)
    # the scan: 4 experts a program, one [NB, 4] step up to 1024 chunks on 8 warps (100 registers on sm_90;
    # [256, 8] steps on 4 warps took 7 us at 1024 chunks on the H100, four steps in a row)
    pre = torch.empty(R, nch, L, dtype=i32, device=dev)
    cnt = torch.empty(L, R, dtype=i32, device=dev)
    ks.schedule_scan_kernel[(cdiv(L, 4), R)](hist, bad, pre, cnt, num_invalid, R, L, nch, EB=4,
                                             NB=min(next_pow2(nch), 1024), num_warps=8)
    ks.schedule_place_kernel[(R * nch,)](ids, pre, cnt, peer_rank, peer_tok, offsets, counts, num_rows,
                                         tile_expert, order, route_row, P, R, rank, L, C, nch, ch, BM=block_m,
                                         BMB=next_pow2(block_m), RB=rb, LB=lb, BLOCK=block, FILL=1024, OC=32,
                                         num_warps=block // 32)
    return Schedule(peer_rank=peer_rank, peer_token_idx=peer_tok, expert_offsets=offsets, expert_counts=counts,
                    num_rows=num_rows, tile_expert=tile_expert, num_invalid=num_invalid, expert_order=order,
                    route_row=route_row, rank=rank, num_ranks=R,
                    experts_per_rank=L, tokens=T, topk=K, block_m=block_m, table=table)
