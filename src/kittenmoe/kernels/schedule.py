"""The routing schedule as two Triton launches (the torch-op version in schedule.py is the model).

``build_schedule`` in torch ops costs ~30 small kernels and as many host
dispatches per rank (measured ~0.3 ms of GPU time and most of a forward's
host time on the H200). These two kernels compute the same
tables bit for bit:

1. ``schedule_count_kernel``, one program per local expert e: the number of
   routes each source rank sends to e, ``cnt[e, r]``; program 0 also counts
   expert ids outside [0, E) (``schedule.NO_ROUTE`` entries are no route, not invalid).
2. ``schedule_place_kernel``, one program per local expert e: padded segment
   offsets from every expert's count (exclusive prefix sum), then each route
   of e gets its row. Rows of an expert are ordered by (per-source ordinal o,
   source r), so route (r, o) lands at
   ``offset[e] + sum_r' min(cnt[e, r'], o) + #{r' < r : cnt[e, r'] > o}``;
   the ordinal is a running count over the source's routes in (t, j) order.
   Padding rows, the rows past ``num_rows`` and the tile table are written
   here too.
"""

import triton
import triton.language as tl


@triton.jit
def schedule_count_kernel(
    ids_ptr,  # [R, P] int32 global expert ids, P = T*K
    cnt_ptr,  # [L, R] int32 out: routes from source r to local expert e
    invalid_ptr,  # [1] int32 out: ids outside [0, E), NO_ROUTE aside
    P, R, rank, L, E,
    RB: tl.constexpr, BLOCK: tl.constexpr, NO_ROUTE: tl.constexpr,
):
    e = tl.program_id(0)
    eg = rank * L + e
    rr = tl.arange(0, RB)
    cnt = tl.zeros((RB,), dtype=tl.int32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for r in range(0, R):
        c = tl.zeros((BLOCK,), dtype=tl.int32)
        for p0 in range(0, P, BLOCK):
            pp = p0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + r * P + pp, mask=pp < P, other=-1)
            c += (ids == eg).to(tl.int32)
            if e == 0:
                bad += ((pp < P) & ((ids < 0) | (ids >= E)) & (ids != NO_ROUTE)).to(tl.int32)
        cnt = tl.where(rr == r, tl.sum(c, axis=0), cnt)
    tl.store(cnt_ptr + e * R + rr, cnt, mask=rr < R)
    if e == 0:
        tl.store(invalid_ptr, tl.sum(bad, axis=0))


@triton.jit
def schedule_place_kernel(
    ids_ptr,  # [R, P] int32
    cnt_ptr,  # [L, R] int32 from schedule_count_kernel
    peer_rank_ptr,  # [C] int32 out
    peer_tok_ptr,  # [C] int32 out
    offsets_ptr,  # [L + 1] int32 out
    counts_ptr,  # [L] int32 out
    num_rows_ptr,  # [1] int32 out
    tile_expert_ptr,  # [C // BM] int32 out
    P, R, rank, L, C,
    BM: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    nprog = tl.num_programs(0)
    eg = rank * L + e
    ll = tl.arange(0, LB)
    rr = tl.arange(0, RB)
    cnt_all = tl.load(cnt_ptr + ll[:, None] * R + rr[None, :], mask=(ll < L)[:, None] & (rr < R)[None, :],
                      other=0)
    tot = tl.sum(cnt_all, axis=1)  # [LB]
    padded = (tot + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    num_rows = tl.sum(padded, axis=0)
    off = tl.sum(tl.where(ll == e, ends - padded, 0), axis=0)
    my_tot = tl.sum(tl.where(ll == e, tot, 0), axis=0)
    my_pad = tl.sum(tl.where(ll == e, padded, 0), axis=0)
    cnt_e = tl.sum(tl.where((ll == e)[:, None], cnt_all, 0), axis=0)  # [RB] routes from each source to e
    tl.store(counts_ptr + e, my_tot)
    tl.store(offsets_ptr + e, off)
    if e == 0:
        tl.store(offsets_ptr + L, num_rows)
        tl.store(num_rows_ptr, num_rows)

    for r in range(0, R):
        run = 0
        for p0 in range(0, P, BLOCK):
            pp = p0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + r * P + pp, mask=pp < P, other=-1)
            hit = (ids == eg) & (pp < P)
            o = run + tl.cumsum(hit.to(tl.int32), axis=0) - 1  # ordinal of each hit
            before = tl.sum(tl.minimum(cnt_e[None, :], o[:, None]), axis=1) + \
                tl.sum(((cnt_e[None, :] > o[:, None]) & (rr[None, :] < r)).to(tl.int32), axis=1)
            row = off + before
            tl.store(peer_rank_ptr + row, tl.full((BLOCK,), 0, tl.int32) + r, mask=hit)
            tl.store(peer_tok_ptr + row, pp, mask=hit)
            run += tl.sum(hit.to(tl.int32), axis=0)
    # this expert's padding rows and row tiles
    for q0 in range(my_tot, my_pad, BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        m = q < my_pad
        tl.store(peer_rank_ptr + off + q, tl.full((BLOCK,), -1, tl.int32), mask=m)
        tl.store(peer_tok_ptr + off + q, tl.full((BLOCK,), -1, tl.int32), mask=m)
    for t0 in range(0, my_pad // BM, BLOCK):
        tt = t0 + tl.arange(0, BLOCK)
        tl.store(tile_expert_ptr + off // BM + tt, tl.full((BLOCK,), 0, tl.int32) + e, mask=tt < my_pad // BM)
    # rows and tiles past num_rows, split over the programs
    for q0 in range(num_rows + e * BLOCK, C, nprog * BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        m = q < C
        tl.store(peer_rank_ptr + q, tl.full((BLOCK,), -1, tl.int32), mask=m)
        tl.store(peer_tok_ptr + q, tl.full((BLOCK,), -1, tl.int32), mask=m)
    for t0 in range(num_rows // BM + e * BLOCK, C // BM, nprog * BLOCK):
        tt = t0 + tl.arange(0, BLOCK)
        tl.store(tile_expert_ptr + tt, tl.full((BLOCK,), -1, tl.int32), mask=tt < C // BM)
