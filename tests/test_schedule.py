"""build_schedule against a naive pure-Python construction (docs/design.md "The pipeline, per rank (forward)", step 2).

The naive table: for each local expert, for each per-source ordinal, for each
source rank (round-robin), one row holding (source rank, t*K + j); each expert
segment padded to a multiple of block_m with -1 rows; -1 beyond num_rows up to
the worst-case capacity R*T*K + L*(block_m - 1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kittenmoe.schedule import NO_ROUTE, Schedule, build_schedule, ids_int32

BLOCK_MS = (1, 2, 4, 16)


# ---------------------------------------------------------------- naive model

def naive_schedule(ids: list, rank: int, L: int, bm: int) -> dict:
    """Pure-Python schedule of destination ``rank`` from nested-list ids [R][T][K]."""
    R, T = len(ids), len(ids[0])
    K = len(ids[0][0]) if T else 0
    E = R * L
    # routes[src][e]: this rank's local expert e's routes from src, in (t, j) order.
    routes = [[[] for _ in range(L)] for _ in range(R)]
    num_invalid = 0
    for src in range(R):
        for t in range(T):
            for j in range(K):
                g = ids[src][t][j]
                if not 0 <= g < E:
                    num_invalid += 1
                    continue
                if g // L == rank:
                    routes[src][g - rank * L].append(t * K + j)
    peer_rank, peer_tok, offsets, counts = [], [], [0], []
    for e in range(L):
        cnt = sum(len(routes[src][e]) for src in range(R))
        counts.append(cnt)
        longest = max(len(routes[src][e]) for src in range(R))
        for o in range(longest):
            for src in range(R):
                if o < len(routes[src][e]):
                    peer_rank.append(src)
                    peer_tok.append(routes[src][e][o])
        while len(peer_rank) % bm:
            peer_rank.append(-1)
            peer_tok.append(-1)
        offsets.append(len(peer_rank))
    num_rows = len(peer_rank)
    cap = R * T * K + L * (bm - 1)
    peer_rank += [-1] * (cap - num_rows)
    peer_tok += [-1] * (cap - num_rows)
    tile_expert = []
    for tile in range(cap // bm):
        start = tile * bm
        owner = -1
        if start < num_rows:
            owner = next(e for e in range(L) if offsets[e] <= start < offsets[e + 1])
        tile_expert.append(owner)
    route_row = [-1] * (R * T * K)  # each route's row here, by source and route
    for row, (src, tok) in enumerate(zip(peer_rank, peer_tok)):
        if src >= 0:
            route_row[src * T * K + tok] = row
    return dict(peer_rank=peer_rank, peer_token_idx=peer_tok, expert_offsets=offsets, expert_counts=counts,
                num_rows=num_rows, tile_expert=tile_expert, num_invalid=num_invalid, capacity=cap,
                expert_order=sorted(range(L), key=lambda e: (-counts[e], e)), route_row=route_row)


# ---------------------------------------------------------------- the checks

INT32_FIELDS = ("peer_rank", "peer_token_idx", "expert_offsets", "expert_counts", "num_rows", "tile_expert",
                "num_invalid", "expert_order", "route_row")


def assert_same_tables(a: Schedule, b: Schedule, what: str) -> None:
    """Every int32 table of ``b`` equals ``a``'s, dtype and bits."""
    for f in INT32_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {f} differs: {x} vs {y}"


def check_schedule(ids_RTK: torch.Tensor, rank: int, L: int, bm: int) -> Schedule:
    """Build the schedule and check every property against the naive model; returns it."""
    ids = ids_RTK.tolist()
    R, T, K = ids_RTK.shape
    E = R * L
    s = build_schedule(ids_RTK, rank, L, bm)
    ref = naive_schedule(ids, rank, L, bm)
    ctx = f"R={R} T={T} K={K} L={L} block_m={bm} rank={rank} ids={ids}"

    # dtypes and sizes
    for f in INT32_FIELDS:
        assert getattr(s, f).dtype == torch.int32, f"{f} dtype {getattr(s, f).dtype}; {ctx}"
    cap = R * T * K + L * (bm - 1)
    assert s.capacity == cap == ref["capacity"], ctx
    assert tuple(s.peer_rank.shape) == tuple(s.peer_token_idx.shape) == (cap,), ctx
    assert tuple(s.expert_offsets.shape) == (L + 1,), ctx
    assert tuple(s.expert_counts.shape) == (L,), ctx
    assert tuple(s.num_rows.shape) == (1,) and tuple(s.num_invalid.shape) == (1,), ctx
    assert s.num_tiles == cap // bm and tuple(s.tile_expert.shape) == (cap // bm,), ctx
    assert (s.rank, s.num_ranks, s.experts_per_rank, s.tokens, s.topk, s.block_m) == (rank, R, L, T, K, bm)

    # table equality with the naive construction, over the whole capacity
    assert s.peer_rank.tolist() == ref["peer_rank"], ctx
    assert s.peer_token_idx.tolist() == ref["peer_token_idx"], ctx
    assert s.expert_offsets.tolist() == ref["expert_offsets"], ctx
    assert s.expert_counts.tolist() == ref["expert_counts"], ctx
    assert s.num_rows.tolist() == [ref["num_rows"]], ctx
    assert s.tile_expert.tolist() == ref["tile_expert"], ctx
    assert s.num_invalid.tolist() == [ref["num_invalid"]], ctx
    assert s.expert_order.tolist() == ref["expert_order"], ctx
    assert s.route_row.tolist() == ref["route_row"], ctx

    # structural invariants, stated independently of the naive table
    pr, pt = s.peer_rank.tolist(), s.peer_token_idx.tolist()
    off, cnt = s.expert_offsets.tolist(), s.expert_counts.tolist()
    n = s.num_rows.item()
    assert off[0] == 0 and off[-1] == n, ctx
    assert n % bm == 0 and n <= cap, ctx
    for e in range(L):
        assert off[e] % bm == 0, ctx
        assert off[e + 1] - off[e] == -(-cnt[e] // bm) * bm, ctx
        seg = list(zip(pr[off[e]:off[e + 1]], pt[off[e]:off[e + 1]]))
        real = [r for r in seg if r != (-1, -1)]
        # real rows first, then padding rows; padding is -1 in both columns
        assert seg[:cnt[e]] == real and len(real) == cnt[e], ctx
        for src, tok in real:
            assert ids[src][tok // K][tok % K] == rank * L + e, ctx
    for row in range(cap):
        assert (pr[row] == -1) == (pt[row] == -1), f"row {row} half padding; {ctx}"
    assert all(v == -1 for v in pr[n:]) and all(v == -1 for v in pt[n:]), ctx

    # every owned route appears exactly once; no foreign or invalid route appears
    owned = {(src, t * K + j) for src in range(R) for t in range(T) for j in range(K)
             if 0 <= ids[src][t][j] < E and ids[src][t][j] // L == rank}
    rows = [(a, b) for a, b in zip(pr, pt) if a != -1]
    assert len(rows) == len(set(rows)), f"duplicate route; {ctx}"
    assert set(rows) == owned, ctx

    # tile_expert: each tile's expert owns all its rows, -1 past num_rows
    te = s.tile_expert.tolist()
    for tile, e in enumerate(te):
        if tile * bm < n:
            assert off[e] <= tile * bm < off[e + 1], ctx
        else:
            assert e == -1, ctx

    # invalid count
    assert s.num_invalid.item() == sum(not 0 <= g < E for plane in ids for tok in plane for g in tok), ctx
    return s


# ---------------------------------------------------------------- hypothesis

@st.composite
def routing_case(draw):
    R = draw(st.integers(1, 4))
    L = draw(st.integers(1, 4))
    E = R * L
    T = draw(st.integers(1, 9))
    K = draw(st.integers(1, min(E, 4)))
    bm = draw(st.sampled_from(BLOCK_MS))
    rank = draw(st.integers(0, R - 1))
    mode = draw(st.sampled_from(["distinct", "repeats", "invalid"]))
    if mode == "distinct":  # a real router: K distinct experts per token
        tok = st.lists(st.integers(0, E - 1), min_size=K, max_size=K, unique=True)
    elif mode == "repeats":  # any valid ids, repeats within a token allowed
        tok = st.lists(st.integers(0, E - 1), min_size=K, max_size=K)
    else:  # some ids outside [0, E)
        tok = st.lists(st.integers(-3, E + 2), min_size=K, max_size=K)
    ids = draw(st.lists(st.lists(tok, min_size=T, max_size=T), min_size=R, max_size=R))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(ids, dtype=dtype).reshape(R, T, K), rank, L, bm


@settings(max_examples=400, deadline=None)
@given(routing_case())
def test_schedule_matches_naive(case):
    ids, rank, L, bm = case
    check_schedule(ids, rank, L, bm)


@settings(max_examples=60, deadline=None)
@given(routing_case())
def test_every_route_lands_on_exactly_one_rank(case):
    """Across all destination ranks together, each valid route is scheduled exactly once."""
    ids, _, L, bm = case
    R, T, K = ids.shape
    seen = []
    for d in range(R):
        s = build_schedule(ids, d, L, bm)
        seen += [(a, b) for a, b in zip(s.peer_rank.tolist(), s.peer_token_idx.tolist()) if a != -1]
    flat = ids.reshape(R, T * K).tolist()
    valid = [(src, p) for src in range(R) for p in range(T * K) if 0 <= flat[src][p] < R * L]
    assert sorted(seen) == sorted(valid)


# ---------------------------------------------------------------- explicit extremes

def _ids(R, T, K, fill):
    """ids[r, t, j] = fill(r, t, j) as an int64 tensor [R, T, K]."""
    return torch.tensor([[[fill(r, t, j) for j in range(K)] for t in range(T)] for r in range(R)],
                        dtype=torch.int64)


EXTREMES = [
    # every route of every rank to one expert (repeats within a token): one segment holds all R*T*K rows
    pytest.param(_ids(3, 5, 2, lambda r, t, j: 4), 1, 3, 4, id="all-to-one-expert"),
    # the same with distinct ids per token: all first choices to expert 0, second choices spread
    pytest.param(_ids(2, 6, 2, lambda r, t, j: 0 if j == 0 else 1 + (t % 3)), 0, 4, 4, id="hot-first-choice"),
    # this rank's local experts 0 and 2 receive nothing: empty segments before and between filled ones
    pytest.param(_ids(2, 4, 1, lambda r, t, j: 7 if t % 2 else 5), 1, 4, 16, id="empty-experts"),
    # all experts of this rank are empty, but other ranks get routes: num_rows 0, every tile -1
    pytest.param(_ids(2, 4, 2, lambda r, t, j: j), 1, 2, 4, id="routes-all-foreign"),
    # single token per rank
    pytest.param(_ids(3, 1, 2, lambda r, t, j: (r + j) % 6), 0, 2, 2, id="T=1"),
    # T=7, not a multiple of block_m or anything else
    pytest.param(_ids(2, 7, 3, lambda r, t, j: (3 * t + j + r) % 8), 1, 4, 4, id="T=7"),
    # K=1: one route per token
    pytest.param(_ids(4, 5, 1, lambda r, t, j: (t + r) % 4), 2, 1, 2, id="K=1"),
    # K equals E_local (and E for R=1): every token routes to every local expert
    pytest.param(_ids(1, 5, 4, lambda r, t, j: j), 0, 4, 4, id="K=E_local-R1"),
    # K = E_local with R=2, ids permuted per token so each token hits all of rank 1's experts
    pytest.param(_ids(2, 3, 3, lambda r, t, j: 3 + (j + t) % 3), 1, 3, 2, id="K=E_local-R2"),
    # block_m larger than any segment: every non-empty segment is mostly padding
    pytest.param(_ids(2, 3, 2, lambda r, t, j: (t + j) % 4), 0, 2, 16, id="block_m>rows"),
    # block_m=1: no padding at all, tiles are rows
    pytest.param(_ids(3, 4, 2, lambda r, t, j: (r * 5 + t + j) % 6), 2, 2, 1, id="block_m=1"),
    # ids out of range, negative and >= E, mixed with valid ones: counted, never written
    pytest.param(_ids(2, 4, 2, lambda r, t, j: [-1, 4, 0, 3, 100, -7, 2, 1][(t * 2 + j) % 8]), 1, 2, 4,
                 id="invalid-mixed"),
    # every id invalid: empty table, num_invalid = R*T*K
    pytest.param(_ids(2, 3, 2, lambda r, t, j: -1 if (t + j) % 2 else 8), 0, 4, 2, id="invalid-all"),
    # invalid id equal to exactly E (one past the last rank's last expert), checked on the last rank
    pytest.param(_ids(2, 2, 1, lambda r, t, j: 4), 1, 2, 2, id="invalid-E-on-last-rank"),
    # large negative / large positive int32 extremes do not overflow into a valid slot (2**31 - 1 itself is
    # NO_ROUTE, not invalid: test_no_route_is_skipped_not_invalid)
    pytest.param(torch.tensor([[[-2**31, 2**31 - 2], [1, 0]]], dtype=torch.int32), 0, 2, 2,
                 id="invalid-int32-extremes"),
]


@pytest.mark.parametrize("ids, rank, L, bm", EXTREMES)
def test_schedule_extremes(ids, rank, L, bm):
    s = check_schedule(ids, rank, L, bm)
    check_schedule(ids.to(torch.int32), rank, L, bm)
    # never writes an invalid route: all rows reference in-range ids of this rank
    R, T, K = ids.shape
    flat = ids.reshape(R, T * K)
    for a, b in zip(s.peer_rank.tolist(), s.peer_token_idx.tolist()):
        if a != -1:
            assert rank * L <= flat[a, b].item() < (rank + 1) * L


def test_all_to_one_expert_counts():
    # every route in the system to global expert 4 (rank 1, local 1): one full segment, the rest empty
    ids = _ids(3, 5, 2, lambda r, t, j: 4)
    s = build_schedule(ids, 1, 3, 4)
    assert s.expert_counts.tolist() == [0, 30, 0]
    assert s.expert_offsets.tolist() == [0, 0, 32, 32]
    assert s.num_rows.item() == 32
    # round-robin: rows cycle over source ranks 0, 1, 2
    assert s.peer_rank[:30].tolist() == [0, 1, 2] * 10
    for d in (0, 2):
        other = build_schedule(ids, d, 3, 4)
        assert other.num_rows.item() == 0 and (other.peer_rank == -1).all() and (other.tile_expert == -1).all()


def test_routes_all_foreign():
    # no route names this rank's experts: empty table, zero counts, every tile -1, nothing invalid
    ids = _ids(2, 4, 2, lambda r, t, j: j)
    s = build_schedule(ids, 1, 2, 4)
    assert s.num_rows.item() == 0 and s.num_invalid.item() == 0
    assert s.expert_counts.tolist() == [0, 0] and s.expert_offsets.tolist() == [0, 0, 0]
    assert (s.peer_rank == -1).all() and (s.peer_token_idx == -1).all() and (s.tile_expert == -1).all()


def test_invalid_ids_counted_on_every_rank():
    # num_invalid counts invalid routes of all ranks, the same on every destination rank
    ids = _ids(2, 3, 2, lambda r, t, j: [-1, 0, 4, 3, 2, 9][(t * 2 + j)] if r == 0 else 1)
    for d in range(2):
        s = build_schedule(ids, d, 2, 2)
        assert s.num_invalid.item() == 3


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_route_is_skipped_not_invalid(impl):
    """NO_ROUTE entries (an EP rank's padding tokens) are neither placed nor counted as invalid; a -1 or E in
    the same routing still is. The tables equal those of the routing with the NO_ROUTE tokens removed."""
    R, L, T, K, bm = 2, 2, 5, 2, 4
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels take CPU tensors only interpreted
    ids = _ids(R, T, K, lambda r, t, j: (r + t + j) % (R * L)).to(dev)
    padded = torch.cat([ids, torch.full((R, 3, K), NO_ROUTE, dtype=ids.dtype, device=dev)], dim=1)
    padded[1, 6, 0] = -1  # a real invalid id among the padding tokens: still counted
    for rank in range(R):
        a = build_schedule(ids, rank, L, bm, impl=impl)
        b = build_schedule(padded, rank, L, bm, impl=impl)
        assert b.num_invalid.item() == 1 and a.num_invalid.item() == 0
        for f in ("peer_rank", "expert_offsets", "expert_counts", "num_rows"):
            x, y = getattr(a, f), getattr(b, f)
            assert torch.equal(x, y[:x.shape[0]]), f"rank {rank}: {f}"
        # token indices t*K + j are the same (padding sits after the real tokens)
        assert torch.equal(a.peer_token_idx, b.peer_token_idx[:a.capacity])


@pytest.mark.parametrize("padding", [False, True])  # a caller's ids, or the launchers' with padding tokens
def test_ids_int32_never_turns_a_wrong_id_into_a_route(padding):
    """int64 ids past int32 would wrap into range in a plain cast (2**32 + 3 -> expert 3); ids_int32 makes them
    -1, which the schedule counts invalid. NO_ROUTE stays only as padding; from a caller it is invalid, not a
    dropped route. Valid ids keep their values, and padded int32 ids come back as the same tensor."""
    valid = torch.randint(0, 12, (3, 5, 4), generator=torch.Generator().manual_seed(3))
    wrong = torch.tensor([2**32 + 3, -(2**32) + 1, 2**31, -1, -(2**31), NO_ROUTE], dtype=torch.int64)
    ids = valid.clone()
    ids.view(-1)[:wrong.numel()] = wrong
    got = ids_int32(ids, padding=padding)
    assert got.dtype == torch.int32
    want = valid.to(torch.int32)
    want.view(-1)[:wrong.numel()] = -1
    if padding:
        want.view(-1)[wrong.numel() - 1] = NO_ROUTE
    assert torch.equal(got, want)
    for rank in range(3):  # the schedule counts every wrong id (NO_ROUTE aside as padding)
        assert build_schedule(got, rank, 4, 4).num_invalid.item() == wrong.numel() - padding
    narrow = ids.clamp(-1, NO_ROUTE).to(torch.int32)
    assert (ids_int32(narrow, padding=True) is narrow) if padding else torch.equal(ids_int32(narrow), want)


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("bm", BLOCK_MS)
def test_schedule_deterministic(bm):
    # two calls on the same input give bitwise identical tables
    g = torch.Generator().manual_seed(bm)
    ids = torch.randint(-1, 13, (3, 9, 4), generator=g)
    for rank in range(3):
        a = build_schedule(ids, rank, 4, bm)
        b = build_schedule(ids.clone(), rank, 4, bm)
        for f in INT32_FIELDS:
            assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_schedule_int32_int64_agree():
    # the ids' integer width does not change the table
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (2, 7, 3), generator=g)
    for rank in range(2):
        a = build_schedule(ids, rank, 4, 4)
        b = build_schedule(ids.to(torch.int32), rank, 4, 4)
        for f in INT32_FIELDS:
            assert torch.equal(getattr(a, f), getattr(b, f)), f


# ---------------------------------------------------------------- bad arguments

GOOD_IDS = torch.zeros(2, 3, 2, dtype=torch.int64)

BAD_ARGS = [
    # rank past the last rank
    pytest.param(GOOD_IDS, 2, 2, 4, ValueError, r"rank=2 outside \[0, R=2\)", id="rank>=R"),
    # negative rank
    pytest.param(GOOD_IDS, -1, 2, 4, ValueError, r"rank=-1 outside", id="rank<0"),
    # ids [T, K] instead of [R, T, K]
    pytest.param(GOOD_IDS[0], 0, 2, 4, ValueError, r"\[R, T, K\]", id="ids-2d"),
    # ids with a 4th dimension
    pytest.param(GOOD_IDS[None], 0, 2, 4, ValueError, r"\[R, T, K\]", id="ids-4d"),
    # float ids
    pytest.param(GOOD_IDS.float(), 0, 2, 4, TypeError, r"int32 or int64", id="ids-float"),
    # narrower integer ids
    pytest.param(GOOD_IDS.to(torch.int16), 0, 2, 4, TypeError, r"int32 or int64", id="ids-int16"),
    # not a tensor at all
    pytest.param(GOOD_IDS.tolist(), 0, 2, 4, TypeError, r"torch.Tensor", id="ids-list"),
    # block_m 0
    pytest.param(GOOD_IDS, 0, 2, 0, ValueError, r"block_m must be >= 1", id="block_m=0"),
    # no local experts
    pytest.param(GOOD_IDS, 0, 0, 4, ValueError, r"experts_per_rank must be >= 1", id="L=0"),
]


@pytest.mark.parametrize("ids, rank, L, bm, exc, match", BAD_ARGS)
def test_build_schedule_bad_args(ids, rank, L, bm, exc, match):
    with pytest.raises(exc, match=match):
        build_schedule(ids, rank, L, bm)


# ---------------------------------------------------------------- Triton schedule kernels

TRITON_CASES = {
    # R=1, uniform distinct ids, block_m 16 (the GPU-like case)
    "R1-uniform": (1, 4, 9, 3, 16, "distinct"),
    # several ranks, ids with repeats and out-of-range values (-1 and E): counted, never placed
    "R3-invalid": (3, 2, 7, 2, 4, "invalid"),
    # every route to one expert: one long segment, the other experts empty
    "R2-one-expert": (2, 3, 8, 1, 2, "one"),
    # block_m 1: no padding at all
    "R4-bm1": (4, 2, 5, 2, 1, "distinct"),
    # padding tokens (NO_ROUTE) mixed with invalid ids: only the invalid ones are counted, neither placed
    "R2-no-route": (2, 3, 6, 2, 4, "no-route"),
    # T=1, K = L (every local expert gets the token)
    "R2-T1-K=L": (2, 3, 1, 3, 4, "distinct"),
}


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_schedule_matches_torch_bitwise(name):
    R, L, T, K, bm, kind = TRITON_CASES[name]
    E = R * L
    g = torch.Generator().manual_seed(7)
    if kind == "invalid":
        ids = torch.randint(-1, E + 1, (R, T, K), generator=g)
    elif kind == "no-route":
        ids = torch.randint(-1, E + 1, (R, T, K), generator=g)
        ids[:, T // 2:] = NO_ROUTE  # the last tokens of every rank are padding
    elif kind == "one":
        ids = torch.full((R, T, K), E - 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R * T)]).reshape(R, T, K)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = ids.to(dev)
    for rank in range(R):
        a = build_schedule(ids, rank, L, bm, impl="torch")
        b = build_schedule(ids, rank, L, bm, impl="triton")
        assert_same_tables(a, b, f"{name} rank {rank}")


@pytest.mark.parametrize("impl", ["torch", "triton"])  # a concatenation, or the Triton build's one buffer
@pytest.mark.parametrize("name", ["R2-no-route", "R1-steps-like"])  # several ranks with padding; one rank
def test_packed_table_round_trips(impl, name):
    """``Schedule.packed`` then ``from_table`` gives every table bit for bit (what a forward hands its
    backward); a table of another problem is refused."""
    R, L, T, K, bm = (2, 3, 6, 2, 4) if name == "R2-no-route" else (1, 6, 175, 4, 16)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(-1, R * L + 1, (R, T, K), generator=g)
    ids[:, T // 2:] = NO_ROUTE
    for rank in range(R):
        a = build_schedule(ids, rank, L, bm, impl=impl)
        table = a.packed()
        assert table.dtype == torch.int32 and table.dim() == 1
        b = Schedule.from_table(table, rank, R, L, T, K, bm)
        assert_same_tables(a, b, f"{impl} rank {rank}")
        assert (b.rank, b.num_ranks, b.experts_per_rank, b.tokens, b.topk, b.block_m) == (rank, R, L, T, K, bm)
        if impl == "triton":  # views of the one buffer the kernels wrote: no copy
            assert table.data_ptr() == a.peer_rank.data_ptr()
        # every table from a 16-byte boundary, as a separate allocation's (the kernels' pointer specialisations)
        for f in INT32_FIELDS:
            assert (getattr(b, f).data_ptr() - table.data_ptr()) % 16 == 0, f
        with pytest.raises(ValueError, match="another problem"):
            Schedule.from_table(table, rank, R, L, T + 1, K, bm)
        with pytest.raises(ValueError, match="another problem"):
            Schedule.from_table(table.long(), rank, R, L, T, K, bm)


# Routes split over chunk programs (kernels/schedule.py): (R, L, T, K, block_m, programs, routing). ``programs``
# is the launcher's target R*NCH; small ones give several BLOCK steps (128 routes at R = 1, 64 otherwise) a chunk.
CHUNK_CASES = {
    # one source, 700 routes in 2 chunks of 3 BLOCK steps, the last one short: the running count per expert
    # carried across steps and the earlier chunk's prefix
    "R1-steps": (1, 6, 175, 4, 16, 2, "uniform"),
    # three sources, 2 chunks of 3 steps each: per-source ordinals interleave over the ranks (cnt[e, r'] differ),
    # ids -1 and E mixed in, counted once over all chunks
    "R3-interleave": (3, 4, 96, 4, 4, 6, "invalid"),
    # 384 local experts (512 histogram bins, few repeats in a step), two sources of 2 chunks (2 steps, 1)
    "R2-L384": (2, 384, 24, 8, 16, 4, "uniform"),
    # skewed: ~70% of routes to experts 0-2 (long runs inside a step, segments over many tiles), NO_ROUTE tail
    "R2-skew": (2, 8, 150, 4, 8, 3, "skew"),
    # one BLOCK step a chunk: the default target (1024 programs) exceeds the 3 BLOCKs of each of the 2 sources
    "R2-one-step": (2, 5, 40, 4, 4, 1024, "invalid"),
    # no tokens (T = 0): one empty chunk a source; every row and tile -1, nothing counted
    "R2-T0": (2, 3, 0, 2, 4, 1024, "invalid"),
}


@pytest.mark.parametrize("name", list(CHUNK_CASES))
def test_triton_schedule_chunks_match_torch_bitwise(name):
    from kittenmoe.schedule import _build_schedule_triton

    R, L, T, K, bm, programs, kind = CHUNK_CASES[name]
    E = R * L
    g = torch.Generator().manual_seed(3)
    if kind == "invalid":
        ids = torch.randint(-1, E + 1, (R, T, K), generator=g)
    elif kind == "skew":
        ids = torch.randint(0, E, (R, T, K), generator=g)
        ids = torch.where(torch.rand(R, T, K, generator=g) < 0.7, torch.randint(0, 3, (R, T, K), generator=g), ids)
        ids[:, T - 20:] = NO_ROUTE
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R * T)]).reshape(R, T, K)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = ids.to(dev)
    for rank in range(R):
        a = build_schedule(ids, rank, L, bm, impl="torch")
        b = _build_schedule_triton(ids, rank, L, bm, programs=programs)
        assert_same_tables(a, b, f"{name} rank {rank}")


def test_schedule_scan_kernel_several_steps():
    """The scan over chunks in [NB, EB] steps, NB = 2 < NCH = 5 chunks: the carry between steps, experts past L
    in the last expert block, and the invalid ids summed over every (source, chunk)."""
    from kittenmoe.kernels import schedule as ks

    R, NCH, L = 2, 5, 6
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    hist = torch.randint(0, 9, (R, NCH, L), generator=g, dtype=torch.int32).to(dev)
    bad = torch.randint(0, 3, (R, NCH), generator=g, dtype=torch.int32).to(dev)
    pre = torch.full_like(hist, -7)
    cnt = torch.full((L, R), -7, dtype=torch.int32, device=dev)
    invalid = torch.full((1,), -7, dtype=torch.int32, device=dev)
    ks.schedule_scan_kernel[(2, R)](hist, bad, pre, cnt, invalid, R, L, NCH, EB=4, NB=2)
    assert torch.equal(pre, (hist.cumsum(1) - hist).to(torch.int32))
    assert torch.equal(cnt, hist.sum(1).T.to(torch.int32))
    assert invalid.item() == bad.sum().item()


def test_triton_schedule_refuses_cpu_tensors_uninterpreted(monkeypatch):
    """impl='triton' on CPU tensors without the interpreter: a clear error naming the fix, before any launch
    (Triton's own, on a machine with a GPU, is "Pointer argument (at 0) cannot be accessed")."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        build_schedule(torch.zeros(1, 2, 1, dtype=torch.int64), 0, 2, 4, impl="triton")


def test_build_schedule_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        build_schedule(torch.zeros(1, 2, 1, dtype=torch.int64), 0, 2, 4, impl="numpy")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton"])  # both implementations against the CPU model
def test_schedule_same_on_cpu_and_cuda(impl):
    """The torch-op schedule on CPU is the model; CUDA (either implementation) must give the same tables."""
    g = torch.Generator().manual_seed(11)
    R, L, T, K, bm = 4, 12, 512, 8, 128  # a GPU-sized case: 16 K routes, 12 local experts, 128-row tiles
    ids = torch.stack([torch.randperm(R * L, generator=g)[:K] for _ in range(R * T)]).reshape(R, T, K)
    for rank in range(R):
        a = build_schedule(ids, rank, L, bm, impl="torch")
        b = build_schedule(ids.cuda(), rank, L, bm, impl=impl)
        for f in INT32_FIELDS:
            assert torch.equal(getattr(a, f), getattr(b, f).cpu()), f"rank {rank}: {f} differs on CUDA ({impl})"
