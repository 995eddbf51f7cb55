"""The routing schedule as three Triton launches (the torch-op version in schedule.py is the model).

``build_schedule`` in torch ops costs ~30 small kernels and as many host
dispatches per rank (measured ~0.3 ms of GPU time and most of a forward's
host time on the H200). These kernels compute the same tables bit for bit.

They split the routes, not the experts, over the programs: each source rank's
P = T*K routes are cut into NCH chunks of CH routes (a multiple of BLOCK), one
program a chunk, ~1024 programs at large P (the launcher picks NCH and BLOCK).
The first design ran one program per local expert, each scanning all R*P
routes: 581 us at R = 1, T = 32768, K = 8, L = 128 on the H100 (128 programs
for 132 SMs, every id read 128 times); this one takes 2.4 + 4.3 + 12.8 us there
(24 us for the whole call, graph-replayed), 2.3 + 2.4 + 12.1 us at R = 8,
T = 4096, L = 48 (1331 us before).

1. ``schedule_count_kernel``, grid (NCH, R): the chunk's histogram over the L
   local experts, ``hist[r, ch, e]`` (``tl.histogram``, routes to other ranks'
   experts masked out), and its count of expert ids outside [0, E),
   ``bad[r, ch]`` (``schedule.NO_ROUTE`` entries are no route, not invalid).
2. ``schedule_scan_kernel``, grid (L / EB, R): for each (source, expert), the
   exclusive prefix sum of the histograms over the chunks, ``pre[r, ch, e]``
   (the source's routes to e in chunks before ch), and the totals
   ``cnt[e, r]``; program (0, 0) sums ``bad`` into ``num_invalid``. A launch of
   its own because every chunk needs the chunks before it: done in the
   placement's programs, each of G would read all G*L histogram entries (G =
   1024, L = 128: 512 KB a program, 512 MB in all), and G would have to stay a
   few hundred, which left a program ~8 BLOCK steps in a row (46 us at the
   case above, 321 us at R = 8, T = 32768, L = 48).
3. ``schedule_place_kernel``, grid (R*NCH): padded segment offsets from the
   counts (exclusive prefix sum over experts), then for each route of the
   chunk, in (t, j) order, its per-source ordinal o = ``pre[r, ch, e]`` +
   routes to e earlier in the chunk: a running count per expert carried across
   the chunk's BLOCK steps (``tl.histogram``, read back with ``tl.gather``)
   plus the route's rank among the step's earlier routes to e (a [BLOCK, BLOCK]
   comparison, no [BLOCK, L] one-hot). Rows of an expert are ordered by
   (per-source ordinal o, source r), so route (r, o) lands at
   ``offset[e] + sum_r' min(cnt[e, r'], o) + #{r' < r : cnt[e, r'] > o}``,
   also written by route (``route_row``, -1 for a route with no row here).
   The padding rows, the rows past ``num_rows`` and the tile table are split
   over the same programs (strided); program 0 writes counts, offsets and
   ``num_rows``, the last program the experts' order by count (most first,
   ties in expert order: the weight gradients' tile order).

Every program of the placement scans all its chunk's routes, also those to
other ranks' experts: at R = 8 seven in eight are (75 us at T = 32768, L = 48;
compacting the owned routes in the count would be the next step there).
No atomics and no float anywhere: the tables are the same on every run.
"""

import triton
import triton.language as tl


@triton.jit
def schedule_count_kernel(
    ids_ptr,  # [R, P] int32 global expert ids, P = T*K
    hist_ptr,  # [R, NCH, L] int32 out: routes of chunk ch of source r to local expert e
    bad_ptr,  # [R, NCH] int32 out: ids of chunk ch of source r outside [0, E), NO_ROUTE aside
    P, rank, L, E, NCH, CH,
    LB: tl.constexpr, BLOCK: tl.constexpr, NO_ROUTE: tl.constexpr,
):
    ch = tl.program_id(0)
    r = tl.program_id(1)
    lo = rank * L  # this rank's experts are [lo, lo + L): owned by comparison, so ids - lo wrapping is harmless
    ll = tl.arange(0, LB)
    h = tl.zeros((LB,), dtype=tl.int32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    p_end = tl.minimum(ch * CH + CH, P)
    for p0 in range(ch * CH, p_end, BLOCK):
        pp = p0 + tl.arange(0, BLOCK)
        valid = pp < p_end
        ids = tl.load(ids_ptr + r * P + pp, mask=valid, other=-1)
        own = valid & (ids >= lo) & (ids < lo + L)
        # masked lanes still name a bin: keep them in range (the GPU's histogram bins by the low bits)
        h += tl.histogram(tl.where(own, ids - lo, 0), LB, mask=own)
        bad += (valid & ((ids < 0) | (ids >= E)) & (ids != NO_ROUTE)).to(tl.int32)
    tl.store(hist_ptr + (r * NCH + ch) * L + ll, h, mask=ll < L)
    tl.store(bad_ptr + r * NCH + ch, tl.sum(bad, axis=0))


@triton.jit
def schedule_scan_kernel(
    hist_ptr,  # [R, NCH, L] int32 from schedule_count_kernel
    bad_ptr,  # [R, NCH] int32 from schedule_count_kernel
    pre_ptr,  # [R, NCH, L] int32 out: routes of source r to local expert e in chunks before ch
    cnt_ptr,  # [L, R] int32 out: routes from source r to local expert e
    invalid_ptr,  # [1] int32 out: ids outside [0, E) on every source, NO_ROUTE aside
    R, L, NCH,
    EB: tl.constexpr, NB: tl.constexpr,
):
    eb = tl.program_id(0)
    r = tl.program_id(1)
    ee = eb * EB + tl.arange(0, EB)
    nn = tl.arange(0, NB)
    carry = tl.zeros((EB,), dtype=tl.int32)
    for c0 in range(0, NCH, NB):
        c = c0 + nn
        m = (c < NCH)[:, None] & (ee < L)[None, :]
        at = (r * NCH + c)[:, None] * L + ee[None, :]
        h = tl.load(hist_ptr + at, mask=m, other=0)  # [NB, EB]
        tl.store(pre_ptr + at, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(cnt_ptr + ee * R + r, carry, mask=ee < L)
    if (eb == 0) & (r == 0):
        nbad = tl.zeros((NB,), dtype=tl.int32)
        for c0 in range(0, R * NCH, NB):
            nbad += tl.load(bad_ptr + c0 + nn, mask=c0 + nn < R * NCH, other=0)
        tl.store(invalid_ptr, tl.sum(nbad, axis=0))


@triton.jit
def schedule_place_kernel(
    ids_ptr,  # [R, P] int32
    pre_ptr,  # [R, NCH, L] int32 from schedule_scan_kernel
    cnt_ptr,  # [L, R] int32 from schedule_scan_kernel
    peer_rank_ptr,  # [C] int32 out
    peer_tok_ptr,  # [C] int32 out
    offsets_ptr,  # [L + 1] int32 out
    counts_ptr,  # [L] int32 out
    num_rows_ptr,  # [1] int32 out
    tile_expert_ptr,  # [C // BM] int32 out
    order_ptr,  # [L] int32 out: the local experts by count, most first, ties in expert order
    route_row_ptr,  # [R, P] int32 out: the row of each route of each source, -1 where it has none here
    P, R, rank, L, C, NCH, CH,
    BM: tl.constexpr, BMB: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr,
    FILL: tl.constexpr, OC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)  # R * NCH
    r = pid // NCH
    ch = pid % NCH
    lo = rank * L
    ll = tl.arange(0, LB)
    rr = tl.arange(0, RB)
    cnt_all = tl.load(cnt_ptr + ll[:, None] * R + rr[None, :], mask=(ll < L)[:, None] & (rr < R)[None, :],
                      other=0)  # [LB, RB]
    tot = tl.sum(cnt_all, axis=1)  # [LB] routes to each expert
    padded = (tot + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    num_rows = tl.sum(padded, axis=0)
    off = ends - padded  # [LB] first row of each expert's segment
    if pid == 0:
        tl.store(counts_ptr + ll, tot, mask=ll < L)
        tl.store(offsets_ptr + ll, off, mask=ll < L)
        tl.store(offsets_ptr + L, num_rows)
        tl.store(num_rows_ptr, num_rows)
    if pid == nprog - 1:  # (another program than the one writing the counts, where there are two)
        # expert e's place in the order: experts with more rows, and those before it with as many;
        # OC experts a step against all LB ([32, 512] at L = 384: 128 comparisons a thread on 4 warps)
        for e0 in range(0, L, OC):
            ee = e0 + tl.arange(0, OC)
            te = tl.gather(tot, tl.where(ee < L, ee, 0), 0)
            ahead = (tot[None, :] > te[:, None]) | ((tot[None, :] == te[:, None]) & (ll[None, :] < ee[:, None]))
            place = tl.sum((ahead & (ll < L)[None, :]).to(tl.int32), axis=1)
            tl.store(order_ptr + place, ee, mask=ee < L)

    # the chunk's routes, BLOCK at a time in (t, j) order; run[e]: the source's routes to e before the step
    run = tl.load(pre_ptr + pid * L + ll, mask=ll < L, other=0)  # pid * L = (r * NCH + ch) * L
    ii = tl.arange(0, BLOCK)
    p_end = tl.minimum(ch * CH + CH, P)
    for p0 in range(ch * CH, p_end, BLOCK):
        pp = p0 + ii
        ids = tl.load(ids_ptr + r * P + pp, mask=pp < p_end, other=-1)
        own = (pp < p_end) & (ids >= lo) & (ids < lo + L)
        e = tl.where(own, ids - lo, -1)  # -1 equals no owned route's expert in the comparison below
        eg = tl.where(own, e, 0)  # an index in range, for the gathers
        # rank among the step's earlier routes to the same expert; reduced over axis 0, which the layout keeps
        # in one thread (over axis 1 it took ~2x the instructions, shuffles and shared memory, on sm_90)
        same = (e[:, None] == e[None, :]) & (ii[:, None] < ii[None, :])  # [j, i]: route j before route i
        o = tl.gather(run, eg, 0) + tl.sum(same.to(tl.int32), axis=0)  # per-source ordinal
        if RB == 1:
            before = o  # one source: o < cnt[e, 0]
        else:
            # cnt[e, r'] from memory (L * R ints, in L1): a gather from the registers' [LB, RB] copy took 16
            # shuffles an element on sm_90 at L = 384
            ce = tl.load(cnt_ptr + eg[:, None] * R + rr[None, :], mask=(rr < R)[None, :], other=0)  # [BLOCK, RB]
            before = tl.sum(tl.minimum(ce, o[:, None]), axis=1) + \
                tl.sum(((ce > o[:, None]) & (rr[None, :] < r)).to(tl.int32), axis=1)
        row = tl.gather(off, eg, 0) + before
        tl.store(peer_rank_ptr + row, tl.full((BLOCK,), 0, tl.int32) + r, mask=own)
        tl.store(peer_tok_ptr + row, pp, mask=own)
        tl.store(route_row_ptr + r * P + pp, tl.where(own, row, -1), mask=pp < p_end)
        run += tl.histogram(eg, LB, mask=own)

    # padding rows and row tiles of experts pid, pid + nprog, ...
    qq = tl.arange(0, BMB)
    ff = tl.arange(0, FILL)
    for e in range(pid, L, nprog):
        my_off = tl.sum(tl.where(ll == e, off, 0), axis=0)
        my_tot = tl.sum(tl.where(ll == e, tot, 0), axis=0)
        my_pad = tl.sum(tl.where(ll == e, padded, 0), axis=0)
        q = my_tot + qq
        m = q < my_pad  # fewer than BM <= BMB padding rows, after the last real one
        tl.store(peer_rank_ptr + my_off + q, tl.full((BMB,), -1, tl.int32), mask=m)
        tl.store(peer_tok_ptr + my_off + q, tl.full((BMB,), -1, tl.int32), mask=m)
        for t0 in range(0, my_pad // BM, FILL):
            tt = t0 + ff
            tl.store(tile_expert_ptr + my_off // BM + tt, tl.full((FILL,), 0, tl.int32) + e,
                     mask=tt < my_pad // BM)
    # rows and tiles past num_rows, split over the programs
    for q0 in range(num_rows + pid * FILL, C, nprog * FILL):
        q = q0 + ff
        tl.store(peer_rank_ptr + q, tl.full((FILL,), -1, tl.int32), mask=q < C)
        tl.store(peer_tok_ptr + q, tl.full((FILL,), -1, tl.int32), mask=q < C)
    for t0 in range(num_rows // BM + pid * FILL, C // BM, nprog * FILL):
        tt = t0 + ff
        tl.store(tile_expert_ptr + tt, tl.full((FILL,), -1, tl.int32), mask=tt < C // BM)
