"""The forward megakernel's trace (``trace=True``, ``kittenmoe.trace``): one event per unit of work, the
outputs unchanged, and the summary's arithmetic.

Under the interpreter every timestamp is 0, so these tests check what the trace records (which program, what
kind, how many) and that tracing changes no output bit; the timings themselves only mean something on a GPU
(``test_gpu_trace_timestamps_ordered``).
"""

from __future__ import annotations

import pytest
import torch
import triton

from kittenmoe import launch_common
from kittenmoe.config import TEST_SHAPES, KernelConfig
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.testing import assert_bitwise_equal, make_weights, routing_uniform
from kittenmoe.trace import KINDS, events, summarize

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
CFG = KernelConfig(num_comm_programs_fwd=2, minibatch_size=16, block_m=16, block_n=16, block_k=16, num_warps=4,
                   num_stages=2)


def _problem(r, t, seed=0, shape=TINY):
    g = torch.Generator().manual_seed(seed)
    w = make_weights(shape, dtype=torch.float32, generator=g)
    xs = [torch.randn(t, shape.h, generator=g).to(DEV) for _ in range(r)]
    routes = [routing_uniform(t, shape.e, shape.k, generator=g) for _ in range(r)]
    ids = [i.to(DEV) for i, _ in routes]
    ws = [v.to(DEV) for _, v in routes]
    return (xs, ids, ws, w.w13_E2IH.to(DEV), w.w2_EHI.to(DEV), w.shared_w13_2SH.to(DEV), w.shared_w2_HS.to(DEV))


@pytest.mark.parametrize("r,t,macrobatch,comm", [
    (1, 24, None, 2),  # one rank, two minibatches, no ring
    (2, 20, 16, 2),  # two ranks, a ring of one minibatch that wraps (pulls wait on pushes)
    (1, 20, None, 0),  # no comm programs (one rank, gathering): every program a pull per minibatch, no push
])
def test_trace_counts_every_unit_of_work_and_changes_no_bit(r, t, macrobatch, comm):
    """Each comm program records one pull and one push per live minibatch (without comm programs every program
    one pull), each gate|up / down / shared tile one event on exactly one compute program; the outputs equal an
    untraced run's bit for bit."""
    a = _problem(r, t)
    cfg = CFG.with_(macrobatch_size=macrobatch, num_comm_programs_fwd=comm, combine_gather=comm == 0)
    plain = megakernel_forward_multirank(*a, config=cfg)
    traced = megakernel_forward_multirank(*a, config=cfg, trace=True)
    for k in range(r):
        assert_bitwise_equal(traced.outputs[k], plain.outputs[k], f"out[{k}] traced")
    bm, bn = cfg.block_m, cfg.block_n
    for st in traced.states:
        assert st.trace is not None and st.trace.dtype == torch.int64
        ev = events(st.trace)
        ncomm = cfg.num_comm_programs_fwd
        live = len(st.ring.live_minibatches(int(st.schedule.num_rows.item())))
        mb_tiles = st.ring.minibatch // bm
        pullers = ncomm or launch_common.num_programs(DEV, 0)
        want = {
            "pull": pullers * live, "push": ncomm * live,
            "gate|up": live * mb_tiles * triton.cdiv(TINY.i, bn),
            "down": live * mb_tiles * triton.cdiv(TINY.h, 2 * bn),
            "shared gate|up": triton.cdiv(t, bm) * triton.cdiv(TINY.i, bn),  # the shared width is I here
            "shared down": triton.cdiv(t, bm) * triton.cdiv(TINY.h, 2 * bn),
        }
        want.update({"epilogue": 0, "counter wait": 0})  # the Gluon forward's roles only
        got = {name: int((ev[:, 1] == code).sum()) for code, name in enumerate(KINDS)}
        assert got == want, (got, want)
        comm = ev[:, 0] < ncomm
        copies = {KINDS.index("pull"), KINDS.index("push")}
        assert set(ev[comm, 1].tolist()) <= copies, "a comm program recorded a GEMM tile"
        if ncomm:
            assert not set(ev[~comm, 1].tolist()) & copies, "a compute program recorded a copy"
        else:
            pulls = ev[ev[:, 1] == KINDS.index("pull")]
            assert sorted(pulls[:, 0].tolist()) == sorted(list(range(pullers)) * live), "a pull per program"
        if not HAS_CUDA:
            assert (ev[:, 2:] == 0).all(), "the interpreter has no timer: every timestamp reads 0"


@pytest.mark.parametrize("r,t,keep,i,gather", [
    (1, 24, True, 16, False),  # one rank reading the forward's kept activations (I = one half-width phase-A tile)
    (2, 20, False, 16, False),  # two ranks replaying gate|up
    # kept, I = 64: phase A two 32-wide tiles a row tile, each with its epilogue event; the shared expert's
    # phase A (its gate|up kept) on 32-wide tiles too
    (1, 24, True, 64, False),
    # one rank gathering (combine_gather), no comm programs: every program records a pull per minibatch, no push
    (1, 24, True, 64, True),
])
def test_backward_trace_counts_every_unit_of_work_and_changes_no_bit(r, t, keep, i, gather):
    """The backward megakernel: one pull and one push per comm program and live minibatch, one event per
    phase A / phase B / shared tile, and an "A epilogue" event per wide kept phase-A tile of an expert; the
    gradients equal an untraced run's bit for bit."""
    from kittenmoe.launch_backward import megakernel_backward_multirank
    from kittenmoe.trace import BWD_KINDS

    shape = TINY.with_(i=i)
    a = _problem(r, t, shape=shape)
    g = torch.Generator().manual_seed(3)
    d_out = [torch.randn(t, TINY.h, generator=g).to(DEV) for _ in range(r)]
    cfg = CFG.with_(combine_gather=True, num_comm_programs_fwd=0, num_comm_programs_bwd=0) if gather else CFG
    fwd = megakernel_forward_multirank(*a, config=cfg, save_for_backward=keep)
    saved = fwd.saved() if keep else None
    plain = megakernel_backward_multirank(d_out, *a, config=cfg, saved=saved)
    traced = megakernel_backward_multirank(d_out, *a, config=cfg, saved=saved, trace=True)
    for k in range(r):
        assert_bitwise_equal(traced.d_x[k], plain.d_x[k], f"d_x[{k}] traced")
    assert_bitwise_equal(traced.d_w13, plain.d_w13, "d_w13 traced")
    assert plain.traces is None and len(traced.traces) == r
    bm, bn_a, bn_b = CFG.block_m, max(16, CFG.block_n // 2), 2 * CFG.block_n
    wide = keep and i % (2 * bn_a) == 0  # the launcher's rule for 2 x wide routed phase-A tiles
    bn_ra = 2 * bn_a if wide else bn_a
    s_w = shape.shared_width
    bn_sa = 2 * bn_a if keep and s_w % (2 * bn_a) == 0 else bn_a  # the kept shared gate|up's 2 x wide tiles
    ncomm = cfg.num_comm_programs_bwd
    pullers = ncomm or launch_common.num_programs(DEV, 0)
    rows = [int(st.schedule.num_rows.item()) for st in fwd.states]
    for k, tr in enumerate(traced.traces):
        ev = events(tr)
        live = -(-rows[k] // CFG.minibatch_size)  # the backward holds every routed row: no ring
        mb_tiles = CFG.minibatch_size // bm
        expert_tiles = int((fwd.states[k].schedule.tile_expert[:live * mb_tiles] >= 0).sum())
        want = {"pull": pullers * live, "push": ncomm * live,
                "A": live * mb_tiles * triton.cdiv(i, bn_ra), "B": live * mb_tiles * triton.cdiv(TINY.h, bn_b),
                "shared A": triton.cdiv(t, bm) * triton.cdiv(s_w, bn_sa),
                "shared B": triton.cdiv(t, bm) * triton.cdiv(TINY.h, bn_b)}
        want["A epilogue"] = expert_tiles * triton.cdiv(i, bn_ra) if wide else 0
        want.update({"A hand-over": 0, "B store": 0, "a_ready wait": 0})  # the Gluon backward's roles only
        got = {name: int((ev[:, 1] == code).sum()) for code, name in enumerate(BWD_KINDS)}
        assert got == want, (k, got, want)


def test_untraced_launch_has_no_trace():
    st = megakernel_forward_multirank(*_problem(1, 8), config=CFG).states[0]
    assert st.trace is None


def test_summarize_arithmetic():
    """Work = end - ready and wait = ready - start, summed per kind; busy over the role's programs."""
    tr = torch.full((6, 5), -1, dtype=torch.int64)  # rows: kind, program, start, ready, end
    # program 0 (comm): a pull 100..300 (waits until 150), a push 300..400 (no wait)
    pull, push, gateup = KINDS.index("pull"), KINDS.index("push"), KINDS.index("gate|up")
    tr[4] = torch.tensor([pull, 0, 100, 150, 300])
    tr[5] = torch.tensor([push, 0, 300, 300, 400])
    # programs 1, 2 (compute): gate|up tiles
    tr[0] = torch.tensor([gateup, 1, 150, 200, 350])
    tr[2] = torch.tensor([gateup, 2, 160, 160, 260])
    s = summarize(tr, num_comm=1)
    assert s.span_ns == 300 and s.num_compute == 2
    by = {k.kind: k for k in s.kinds}
    assert by["pull"].work_ns == 150 and by["pull"].wait_ns == 50
    assert by["gate|up"].events == 2 and by["gate|up"].programs == 2
    assert by["gate|up"].work_ns == 250 and by["gate|up"].wait_ns == 50
    assert by["gate|up"].first_start_ns == 50 and by["push"].last_end_ns == 300
    assert "gate|up" in s.table() and "span 0.000 ms" in s.table()
    assert summarize(tr, num_comm=1, num_programs=5).num_compute == 4  # idle compute programs count too


def test_chrome_trace_slices():
    """One work slice per event and a wait slice before it when the wait took time, microseconds from the first
    event, one named row per program."""
    from kittenmoe.trace import chrome_trace

    tr = torch.full((3, 5), -1, dtype=torch.int64)
    tr[0] = torch.tensor([KINDS.index("pull"), 0, 1000, 3000, 5000])
    tr[1] = torch.tensor([KINDS.index("gate|up"), 2, 2000, 2000, 4000])
    ct = chrome_trace(tr, num_comm=1)
    slices = [e for e in ct["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in slices] == [
        ("wait", 0, 0.0, 2.0), ("pull", 0, 2.0, 2.0), ("gate|up", 2, 1.0, 2.0)]
    rows = {e["tid"]: e["args"]["name"] for e in ct["traceEvents"] if e["ph"] == "M"}
    assert rows == {0: "comm 0", 2: "compute 2"}


def test_summarize_refuses_what_is_not_a_trace():
    with pytest.raises(ValueError, match=r"\[MAXE, 5\] int64"):
        summarize(torch.zeros(3, 4), num_comm=1)
    with pytest.raises(ValueError, match="no events"):
        summarize(torch.full((3, 5), -1, dtype=torch.int64), num_comm=1)
    bad = torch.full((1, 5), -1, dtype=torch.int64)
    bad[0] = torch.tensor([9, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="unknown event kinds"):
        summarize(bad, num_comm=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_trace_timestamps_ordered():
    """On a GPU the timer runs: every event has start <= ready <= end, and the summary's span is positive."""
    cfg = CFG.with_(num_comm_programs_fwd=4)
    res = megakernel_forward_multirank(*_problem(2, 256), config=cfg, trace=True)
    res.check_errors()
    for st in res.states:
        ev = events(st.trace)
        assert ((ev[:, 2] <= ev[:, 3]) & (ev[:, 3] <= ev[:, 4])).all()
        assert summarize(st.trace, cfg.num_comm_programs_fwd).span_ns > 0
