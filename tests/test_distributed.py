"""Multi-process expert parallelism: the distributed torch backend and the all-to-all baseline.

Each world is R real processes (spawned once per module, gloo over a
FileStore in tmp_path) that serve tasks from the test process: every rank
runs ``moe_forward_distributed`` or ``all_to_all_forward`` on its own slice
of the inputs, forward and backward, and sends back its output and
gradients. The test process compares them with ``moe_reference_multirank``
(fp64, on the same fp32 values) and, for the torch backend, with the
single-process model ``moe_forward_multirank`` (forward bitwise).

No test can hang: gloo collectives time out after ``PG_TIMEOUT_S`` (an
error, reported like any other), and the test process waits at most
``RUN_TIMEOUT_S`` for an answer, then kills that world.

GPU tests (``@pytest.mark.gpu``) run ``SymmetricPeers`` in 2 and 4
processes, rank k on ``cuda:(k % device_count)`` (``rank_gpu``): on one H200
they share it (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), on a machine
with several GPUs the peers are real NVLink peers. The group is gloo either
way (NCCL refuses two ranks on one GPU; symmetric memory only needs the
group's store and rank numbering).
"""

from __future__ import annotations

import datetime
import functools
import os
import queue
import time
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kittenmoe.baselines import all_to_all_forward
from kittenmoe.config import TEST_SHAPES, KernelConfig, ModelShape
from kittenmoe.distributed import moe_forward_distributed
from kittenmoe.peers import PeerBufferNotAddressable, SymmetricPeers
from kittenmoe.reference import moe_reference_multirank
from kittenmoe.testing import (ROUTINGS, assert_bitwise_equal, assert_close, make_weights, routing_few_experts,
                               tolerance_for)
from kittenmoe.torch_backend import moe_forward_multirank

TINY = TEST_SHAPES["tiny"]  # E=8, H=32, I=16, K=2
TINY_SIG = TEST_SHAPES["tiny-sigmoid"]  # E=16, H=48, I=24, K=4
SMALL = TEST_SHAPES["small"]  # E=16, H=128, I=64, K=4

PG_TIMEOUT_S = 30  # a gloo collective that waits longer raises
START_TIMEOUT_S = 120  # spawning R processes that import torch (slow on a 2-core machine)
RUN_TIMEOUT_S = 90  # the test process's wait for every rank's answer to one task

FNS = {"torch": moe_forward_distributed, "a2a": all_to_all_forward}


# ---------------------------------------------------------------- worker processes


def rank_gpu(rank: int) -> int:
    """The GPU of ``rank`` in the GPU worlds: its own when the machine has enough, else shared round-robin."""
    return rank % torch.cuda.device_count()


def _serve(rank, world, store_path, inbox, outbox, env, cuda):
    """A rank's process: init the gloo group, then run tasks until told to stop."""
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        if cuda:
            torch.cuda.set_device(rank_gpu(rank))
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    except Exception as e:
        outbox.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
        return
    outbox.put((rank, "ready", None))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        task, payload = msg
        try:
            outbox.put((rank, "ok", _TASKS[task](rank, world, payload)))
        except Exception as e:  # reported to the test process, which decides
            outbox.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class World:
    """R spawned processes in one gloo group, serving tasks."""

    def __init__(self, r: int, store_path: str, env: dict[str, str] | None = None, cuda: bool = False):
        ctx = mp.get_context("spawn")
        self.r = r
        self.broken = False
        self.inboxes = [ctx.Queue() for _ in range(r)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(rank, r, store_path, self.inboxes[rank], self.outbox,
                                                       env or {}, cuda), daemon=True) for rank in range(r)]
        for p in self.procs:
            p.start()
        answers = self._collect(START_TIMEOUT_S)
        failed = {rank: a for rank, (status, a) in answers.items() if status != "ready"}
        if failed:
            self.close()
            raise RuntimeError(f"world of {r} did not start: {failed}")

    def _collect(self, timeout_s: float) -> dict[int, tuple[str, object]]:
        deadline = time.monotonic() + timeout_s
        answers: dict[int, tuple[str, object]] = {}
        while len(answers) < self.r:
            try:
                rank, status, value = self.outbox.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                answers[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            dead = [rank for rank, p in enumerate(self.procs) if not p.is_alive() and rank not in answers]
            if dead or time.monotonic() > deadline:
                self.broken = True
                missing = sorted(set(range(self.r)) - set(answers))
                raise AssertionError(f"ranks {missing} gave no answer within {timeout_s}s (dead: {dead}): "
                                     f"a hang or a crash; answers so far: {answers}")
        return answers

    def run(self, task: str, payloads: list, timeout_s: float = RUN_TIMEOUT_S) -> list[tuple[str, object]]:
        """Send each rank its payload; every rank's (status, value), status "ok" or "error"."""
        assert not self.broken and len(payloads) == self.r
        for rank in range(self.r):
            self.inboxes[rank].put((task, payloads[rank]))
        answers = self._collect(timeout_s)
        return [answers[rank] for rank in range(self.r)]

    def run_ok(self, task: str, payloads: list, timeout_s: float = RUN_TIMEOUT_S) -> list:
        answers = self.run(task, payloads, timeout_s)
        errors = {rank: v[2] for rank, (s, v) in enumerate(answers) if s != "ok"}
        if errors:
            raise AssertionError("ranks failed:\n" + "\n".join(f"--- rank {r}:\n{tb}" for r, tb in errors.items()))
        return [v for _, v in answers]

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():  # only processes this World started
                p.kill()
                p.join(timeout=5)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``worlds(R)``: the module's world of R processes (restarted if a test broke it)."""
    made: dict[int, World] = {}

    def get(r: int) -> World:
        w = made.get(r)
        if w is not None and w.broken:
            w.close()
            w = None
        if w is None:
            w = made[r] = World(r, str(tmp_path_factory.mktemp(f"pg{r}") / "store"))
        return w

    yield get
    for w in made.values():
        w.close()


# ---------------------------------------------------------------- tasks (run in the workers)


def _task_forward_backward(rank, world, p):
    """Forward + backward of one function on this rank's inputs; shared grads all-reduced (DP)."""
    leaves = {k: p[k].clone().requires_grad_(True) for k in ("x", "topk_weights", "w13", "w2", "sw13", "sw2")
              if p[k] is not None}
    kw = {"block_m": p["block_m"]} if p["fn"] == "torch" else {}
    out = FNS[p["fn"]](leaves["x"], p["ids"], leaves["topk_weights"], leaves["w13"], leaves["w2"],
                       leaves.get("sw13"), leaves.get("sw2"), p["swiglu_limit"], None, **kw)
    (out.double() * p["grad"].double()).sum().backward()
    res = {"out": out.detach()}
    for k, v in leaves.items():
        if v.grad is None:
            raise AssertionError(f"rank {rank}: no gradient reached {k}")
        g = v.grad
        if k in ("sw13", "sw2"):  # the reference's shared expert is one tensor: its grad sums every rank's part
            dist.all_reduce(g)
        res["d_" + k] = g
    return res


def _task_forward(rank, world, p):
    """Forward only (for the error cases); returns the output."""
    kw = {"block_m": p["block_m"]} if p["fn"] == "torch" else {}
    kw.update(p.get("extra", {}))
    return FNS[p["fn"]](p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], p["sw13"], p["sw2"],
                        p["swiglu_limit"], None, **kw).detach()


_ABANDONED_GROUPS = []  # groups left with a timed-out collective: kept referenced, never used again


def _task_absent_rank(rank, world, p):
    """Every rank but ``absent`` calls the torch backend on a fresh group with a short timeout."""
    sub = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=p["timeout_s"]), backend="gloo")
    _ABANDONED_GROUPS.append(sub)
    if rank == p["absent"]:
        return "absent"
    return moe_forward_distributed(p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], p["sw13"], p["sw2"],
                                   p["swiglu_limit"], sub, p["block_m"])


def _task_symmetric_peers_on_cpu(rank, world, p):
    try:
        SymmetricPeers(device="cpu")
    except RuntimeError as e:
        return str(e)
    raise AssertionError("SymmetricPeers accepted a CPU device")


_TASKS = {"forward_backward": _task_forward_backward, "forward": _task_forward, "absent_rank": _task_absent_rank,
          "symmetric_peers_on_cpu": _task_symmetric_peers_on_cpu}


# ---------------------------------------------------------------- cases and inputs


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    r: int
    t: int | tuple[int, ...]  # tokens per rank (a tuple: per rank, the baseline only)
    routing: str = "uniform"  # a key of ROUTINGS, or "few_experts"
    block_m: int = 16
    swiglu_limit: float | None = None
    shared: bool = True
    hot: int = 0

    def tokens(self) -> list[int]:
        return list(self.t) if isinstance(self.t, tuple) else [self.t] * self.r


def _routing(case: Case, t: int, gen: torch.Generator):
    e, k = case.shape.e, case.shape.k
    if case.routing == "few_experts":  # experts 0..2 only: every other expert (and on R=4, ranks 2, 3) idle
        return routing_few_experts(t, e, k, [0, 1, 2], generator=gen)
    if case.routing == "one_hot":
        return ROUTINGS["one_hot"](t, e, k, hot=case.hot, generator=gen)
    return ROUTINGS[case.routing](t, e, k, generator=gen)


def _make_inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for t in case.tokens():
        xs.append(torch.randn(t, case.shape.h, generator=gen))
        i, w = _routing(case, t, gen)
        ids.append(i.contiguous())
        ws.append(w.float().contiguous())
    mw = make_weights(case.shape, generator=gen, shared=case.shared)
    grads = [torch.randn(t, case.shape.h, generator=gen) for t in case.tokens()]
    return xs, ids, ws, mw, grads


def _payloads(fn: str, case: Case, xs, ids, ws, mw, grads) -> list[dict]:
    L = case.shape.e // case.r
    return [{"fn": fn, "x": xs[r], "ids": ids[r], "topk_weights": ws[r],
             "w13": mw.w13_E2IH[r * L:(r + 1) * L].clone(), "w2": mw.w2_EHI[r * L:(r + 1) * L].clone(),
             "sw13": mw.shared_w13_2SH, "sw2": mw.shared_w2_HS, "grad": grads[r],
             "swiglu_limit": case.swiglu_limit, "block_m": case.block_m} for r in range(case.r)]


def _single_process(fn, xs, ids, ws, mw, grads, dtype, **kw):
    """Outputs and named gradients of a single-process multi-rank function (reference or model)."""
    lx = [x.detach().to(dtype).requires_grad_(True) for x in xs]
    lw = [w.detach().to(dtype if dtype == torch.float64 else w.dtype).requires_grad_(True) for w in ws]
    weights = [None if t is None else t.detach().to(dtype).requires_grad_(True)
               for t in (mw.w13_E2IH, mw.w2_EHI, mw.shared_w13_2SH, mw.shared_w2_HS)]
    # One intra-op thread, as in the rank processes (_serve): a CPU matmul may split its reduction by thread
    # count, and the forward is compared bit for bit (seen: 2 threads here vs 1 there differed in the last bit).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = fn(lx, ids, lw, *weights, **kw)
    finally:
        torch.set_num_threads(threads)
    sum((o.double() * g.double()).sum() for o, g in zip(outs, grads, strict=True)).backward()
    named = {f"d_x[{r}]": x.grad for r, x in enumerate(lx)}
    named.update({f"d_topk_weights[{r}]": w.grad for r, w in enumerate(lw)})
    for name, t in zip(("d_w13", "d_w2", "d_sw13", "d_sw2"), weights):
        if t is not None:
            named[name] = t.grad
    return [o.detach() for o in outs], named


def _gathered(results: list[dict]) -> dict[str, torch.Tensor]:
    """Per-rank results as the single-process names: global expert grads concatenated in rank order."""
    named = {}
    for r, res in enumerate(results):
        named[f"d_x[{r}]"] = res["d_x"]
        named[f"d_topk_weights[{r}]"] = res["d_topk_weights"]
    named["d_w13"] = torch.cat([res["d_w13"] for res in results])
    named["d_w2"] = torch.cat([res["d_w2"] for res in results])
    if "d_sw13" in results[0]:
        for k in ("d_sw13", "d_sw2"):
            for r in range(1, len(results)):  # all-reduced: every rank holds the same sum
                assert_bitwise_equal(results[r][k], results[0][k], f"{k} rank {r} vs rank 0")
            named[k] = results[0][k]
    return named


def _assert_grads_close(got: dict, want: dict, tol: str) -> None:
    """fp32 tolerance on the reference's RMS scale (per expert for the [E, ...] expert grads).

    A gradient sums many rows whose terms cancel; rounding grows with the terms, not with the
    result, so the table's absolute bounds are applied after scaling (as tests/test_torch_backend.py
    does). rel-L1 and cosine are scale-free.
    """
    assert sorted(got) == sorted(want)
    for name, g in got.items():
        rg = want[name].double()
        dims = tuple(range(1, rg.dim())) if name in ("d_w13", "d_w2") else tuple(range(rg.dim()))
        scale = rg.pow(2).mean(dim=dims, keepdim=True).sqrt().clamp_min(1e-30)
        assert_close(g.double() / scale, rg.float().double() / scale, tol, name)


# ---------------------------------------------------------------- forward + backward vs the reference

CASES = {
    # two ranks, balanced routing: the basic exchange
    "R2-uniform": Case(TINY, r=2, t=16),
    # four ranks, K=4 shape, T=7 not a multiple of block_m=4, SwiGLU clamp active (L=1.5)
    "R4-T7-bm4-limit": Case(TINY_SIG, r=4, t=7, block_m=4, swiglu_limit=1.5),
    # zero-token experts, and ranks 2 and 3 receive no row at all (only experts 0..2 are chosen; L=2)
    "R4-zero-token-experts": Case(TINY, r=4, t=16, routing="few_experts"),
    # K=1 and every route to the last expert: rank 1 does all the work, rank 0 receives nothing
    "R2-one-hot-K1-last-expert": Case(TINY.with_(k=1), r=2, t=9, routing="one_hot", hot=TINY.e - 1),
    # no shared expert, skewed (zipf) load, H=128, T=12 not a multiple of block_m=16
    "R4-zipf-small-no-shared": Case(SMALL, r=4, t=12, routing="zipf", shared=False),
    # one token per rank: T*K=2 rows, every expert segment mostly padding
    "R2-T1": Case(TINY, r=2, t=1),
}


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(worlds, fn, name):
    case = CASES[name]
    xs, ids, ws, mw, grads = _make_inputs(case)
    results = worlds(case.r).run_ok("forward_backward", _payloads(fn, case, xs, ids, ws, mw, grads))
    outs = [res["out"] for res in results]
    got = _gathered(results)

    ref_outs, ref_grads = _single_process(moe_reference_multirank, xs, ids, ws, mw, grads, torch.float64,
                                          swiglu_limit=case.swiglu_limit, compute_dtype=torch.float64)
    for r, (o, ro) in enumerate(zip(outs, ref_outs, strict=True)):
        assert o.dtype == torch.float32
        assert_close(o, ro.float(), "fp32", f"out[{r}]")
    _assert_grads_close(got, ref_grads, "fp32")

    # Experts that received no token get exactly zero weight gradient, every used one a nonzero one.
    used = torch.zeros(case.shape.e, dtype=torch.bool)
    for i in ids:
        used[i.flatten()] = True
    if case.routing in ("few_experts", "one_hot"):
        assert not used.all()
    for gname in ("d_w13", "d_w2"):
        assert torch.all(got[gname][~used] == 0), f"{gname}: nonzero gradient on unused experts"
        assert torch.all(got[gname][used].abs().sum(dim=(1, 2)) > 0), f"{gname}: a used expert got 0 grad"

    if fn == "torch":
        # The single-process semantic model: forward bitwise (same schedule, same tile arithmetic,
        # exact data movement), gradients to fp32 rounding (its sums over ranks run in another order).
        model_outs, model_grads = _single_process(moe_forward_multirank, xs, ids, ws, mw, grads, torch.float32,
                                                  swiglu_limit=case.swiglu_limit, block_m=case.block_m)
        for r, (o, mo) in enumerate(zip(outs, model_outs, strict=True)):
            assert_bitwise_equal(o, mo, f"out[{r}] vs moe_forward_multirank")
        _assert_grads_close(got, model_grads, "fp32")


RAGGED_CASES = {
    # two ranks with different token counts (5 and 11): the all-to-all needs no common T
    "R2-T5-T11": Case(TINY, r=2, t=(5, 11)),
    # four ranks, one of them with a single token, skewed load and the clamp
    "R4-T3-8-1-6-zipf-limit": Case(TINY_SIG, r=4, t=(3, 8, 1, 6), routing="zipf", swiglu_limit=1.5),
}


@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_all_to_all_ragged_tokens(worlds, name):
    case = RAGGED_CASES[name]
    xs, ids, ws, mw, grads = _make_inputs(case)
    results = worlds(case.r).run_ok("forward_backward", _payloads("a2a", case, xs, ids, ws, mw, grads))
    ref_outs, ref_grads = _single_process(moe_reference_multirank, xs, ids, ws, mw, grads, torch.float64,
                                          swiglu_limit=case.swiglu_limit, compute_dtype=torch.float64)
    for r, (res, ro) in enumerate(zip(results, ref_outs, strict=True)):
        assert_close(res["out"], ro.float(), "fp32", f"out[{r}]")
    _assert_grads_close(_gathered(results), ref_grads, "fp32")


def test_forward_repeatable(worlds):
    """Same inputs, same bits: the fixed-order reductions do not depend on message timing."""
    case = CASES["R4-T7-bm4-limit"]
    xs, ids, ws, mw, grads = _make_inputs(case, seed=3)
    for fn in FNS:
        a = worlds(4).run_ok("forward_backward", _payloads(fn, case, xs, ids, ws, mw, grads))
        b = worlds(4).run_ok("forward_backward", _payloads(fn, case, xs, ids, ws, mw, grads))
        for r in range(case.r):
            for k in a[r]:
                assert_bitwise_equal(a[r][k], b[r][k], f"{fn} rank {r} {k}")


# ---------------------------------------------------------------- bad input raises on every rank


def _errors(answers, expect_type: str | None = None) -> list[str]:
    """Every rank must have raised; returns the messages."""
    for rank, (status, value) in enumerate(answers):
        assert status == "error", f"rank {rank} did not raise (returned {type(value).__name__})"
        if expect_type is not None:
            assert value[0] == expect_type, f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}"
    return [value[1] for _, value in answers]


@pytest.mark.parametrize("r", [2, 4])
def test_mismatched_tokens_raise_on_every_rank(worlds, r):
    # the torch backend needs one T: rank 1 has 6 tokens, the others 8
    case = Case(TINY, r=r, t=tuple(6 if rank == 1 else 8 for rank in range(r)))
    xs, ids, ws, mw, grads = _make_inputs(case)
    t0 = time.monotonic()
    msgs = _errors(worlds(r).run("forward", _payloads("torch", case, xs, ids, ws, mw, grads)), "ValueError")
    assert time.monotonic() - t0 < PG_TIMEOUT_S / 2, "the error came from a collective timeout, not the check"
    want = "T: [" + ", ".join("6" if rank == 1 else "8" for rank in range(r)) + "]"
    for rank, m in enumerate(msgs):
        assert f"(rank {rank})" in m and want in m, m


SETTING_MISMATCHES = {
    # rank 1 passes a different SwiGLU clamp
    "swiglu_limit": ("torch", {"swiglu_limit": 1.5}, "swiglu_limit: [None, 1.5]"),
    # rank 1 uses a different row tile
    "block_m": ("torch", {"block_m": 4}, "block_m: [16, 4]"),
    # rank 1 has no shared expert
    "shared-a2a": ("a2a", {"sw13": None, "sw2": None}, "S: [16, 0]"),
}


@pytest.mark.parametrize("name", list(SETTING_MISMATCHES))
def test_mismatched_settings_raise_on_every_rank(worlds, name):
    fn, change, want = SETTING_MISMATCHES[name]
    case = Case(TINY, r=2, t=8)
    payloads = _payloads(fn, case, *_make_inputs(case))
    payloads[1].update(change)
    for m in _errors(worlds(2).run("forward", payloads), "ValueError"):
        assert want in m, m


def test_mismatched_hidden_raises_on_every_rank_a2a(worlds):
    # rank 1 runs a layer of another shape (H=48 instead of 32): the baseline allows ragged T, not this
    a, b = Case(TINY, r=2, t=8), Case(TINY_SIG.with_(k=2, e=8), r=2, t=8)
    pa, pb = _payloads("a2a", a, *_make_inputs(a)), _payloads("a2a", b, *_make_inputs(b))
    for m in _errors(worlds(2).run("forward", [pa[0], pb[1]]), "ValueError"):
        assert "H: [32, 48]" in m, m


@pytest.mark.parametrize("fn", list(FNS))
def test_local_error_on_one_rank_raises_on_every_rank(worlds, fn):
    # rank 2's x is float64 while its weights are float32: rank 2 raises TypeError, the others name rank 2
    case = Case(TINY, r=4, t=8)
    payloads = _payloads(fn, case, *_make_inputs(case))
    payloads[2]["x"] = payloads[2]["x"].double()
    answers = worlds(4).run("forward", payloads)
    msgs = _errors(answers)
    assert answers[2][1][0] == "TypeError" and "(rank 2)" in msgs[2] and "dtype" in msgs[2], msgs[2]
    for rank in (0, 1, 3):
        assert answers[rank][1][0] == "ValueError" and "rank(s) [2] rejected" in msgs[rank], msgs[rank]


@pytest.mark.parametrize("fn,extra", [("torch", {}), ("a2a", {}), ("a2a", {"check_ranks": False})],
                         ids=["torch", "a2a", "a2a-unchecked"])
def test_invalid_expert_id_raises_on_every_rank(worlds, fn, extra):
    # rank 1 routes one token to expert E=8 (out of range); with check_ranks=False the baseline finds it
    # in its own metadata exchange
    case = Case(TINY, r=2, t=8)
    payloads = _payloads(fn, case, *_make_inputs(case))
    payloads[1]["ids"] = payloads[1]["ids"].clone()
    payloads[1]["ids"][3, 1] = TINY.e
    for p in payloads:
        p["extra"] = extra
    for rank, m in enumerate(_errors(worlds(2).run("forward", payloads), "ValueError")):
        assert f"(rank {rank})" in m and "outside [0, E=8)" in m and "[0, 1]" in m, m


def test_absent_rank_gives_timeout_error_not_hang(worlds):
    # rank 1 never makes the call (a dead or diverged rank): the others get the group's timeout error
    case = Case(TINY, r=2, t=8)
    payloads = _payloads("torch", case, *_make_inputs(case))
    for p in payloads:
        p.update(absent=1, timeout_s=3)
    t0 = time.monotonic()
    answers = worlds(2).run("absent_rank", payloads)
    assert answers[1] == ("ok", "absent")
    status, (etype, msg, tb) = answers[0]
    assert status == "error" and "timed out" in msg.lower(), f"{etype}: {msg}\n{tb}"
    assert time.monotonic() - t0 < PG_TIMEOUT_S


def test_world_still_usable_after_errors(worlds):
    """The error paths leave every rank at the same collective count: the group keeps working."""
    case = CASES["R2-uniform"]
    xs, ids, ws, mw, grads = _make_inputs(case, seed=5)
    worlds(2).run_ok("forward_backward", _payloads("torch", case, xs, ids, ws, mw, grads))


def test_symmetric_peers_refuses_cpu(worlds):
    for m in worlds(2).run_ok("symmetric_peers_on_cpu", [None, None]):
        assert "no CPU backend" in m and "gloo" in m, m


def test_symmetric_peers_needs_initialised_group():
    if dist.is_initialized():
        pytest.skip("this process is already in a process group")
    with pytest.raises(RuntimeError, match="not initialised"):
        SymmetricPeers()


# ---------------------------------------------------------------- GPU: SymmetricPeers, ranks sharing one GPU


@functools.cache
def _peer_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def pull_row0(ptrs_ptr, out_ptr, N: tl.constexpr):
        """out[r] = row 0 of rank r's buffer (read through the peer-pointer table)."""
        r = tl.program_id(0)
        base = tl.load(ptrs_ptr + r).to(tl.pointer_type(tl.float32))
        offs = tl.arange(0, N)
        tl.store(out_ptr + r * N + offs, tl.load(base + offs))

    @triton.jit
    def push_row(ptrs_ptr, row, val, N: tl.constexpr):
        """Row ``row`` of every rank's buffer = val (written through the peer-pointer table)."""
        r = tl.program_id(0)
        base = tl.load(ptrs_ptr + r).to(tl.pointer_type(tl.float32))
        offs = tl.arange(0, N)
        tl.store(base + row * N + offs, tl.zeros((N,), tl.float32) + val)

    return pull_row0, push_row


def test_peer_kernels_on_local_peers():
    """The GPU tests' pull/push kernels, checked on LocalPeers (interpreter on CPU), so that a GPU failure
    points at SymmetricPeers rather than at the test."""
    from kittenmoe.peers import LocalPeers

    pull_row0, push_row = _peer_kernels()
    r_, n = 3, 64
    peers = LocalPeers(r_, "cuda" if torch.cuda.is_available() else "cpu")
    bufs = peers.alloc("x", (r_, n), torch.float32)
    for r, b in enumerate(bufs):
        b.fill_(float(r + 1))
    out = torch.empty(r_, n, device=peers.device)
    pull_row0[(r_,)](peers.ptrs("x"), out, N=n)
    assert torch.equal(out.cpu(), torch.arange(1.0, r_ + 1)[:, None].expand(r_, n))
    for r in range(r_):
        push_row[(r_,)](peers.ptrs("x"), r, float((r + 1) * 10), N=n)
    for b in bufs:
        assert torch.equal(b.cpu(), torch.arange(10.0, 10.0 * (r_ + 1), 10.0)[:, None].expand(r_, n))


def _expect_raises(fn, exc) -> str:
    """Call ``fn``; it must raise ``exc``. Returns the message."""
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError(f"expected {exc.__name__}, nothing was raised")


def _task_symmetric_peers(rank, world, p):
    pull_row0, push_row = _peer_kernels()
    n = 64
    peers = SymmetricPeers()
    assert (peers.rank, peers.num_ranks, peers.device) == (rank, world, torch.device("cuda", rank_gpu(rank)))
    # A first small buffer, so that later ones sit at a nonzero offset of a pooled symmetric block.
    small = peers.alloc("small", (3,), torch.int32, fill=rank)
    assert torch.all(small[rank] == rank)
    bufs = peers.alloc("x", (world, n), torch.float32, fill=float(rank + 1))
    mine = peers.buffer("x", rank)
    assert bufs[rank] is mine and len(bufs) == world and peers.has("x")
    for name in ("small", "x"):
        t = peers.ptrs(name)
        assert t.dtype == torch.int64 and t.shape == (world,) and t.device == peers.device
        assert t[rank].item() == peers.buffer(name, rank).data_ptr(), name
    assert len(set(peers.ptrs("x").tolist())) == world
    # Pull: every rank reads row 0 of every rank's buffer.
    peers.barrier()
    out = torch.empty(world, n, device=peers.device)
    pull_row0[(world,)](peers.ptrs("x"), out, N=n)
    want = torch.arange(1, world + 1, dtype=torch.float32, device=peers.device)[:, None].expand(world, n)
    assert torch.equal(out, want), out[:, 0]
    peers.barrier()  # every rank has read before anyone writes
    # Push: rank s writes (s+1)*10 into row s of every rank's buffer.
    push_row[(world,)](peers.ptrs("x"), rank, float((rank + 1) * 10), N=n)
    peers.barrier()
    assert torch.equal(mine, (torch.arange(world, dtype=torch.float32, device=peers.device)[:, None] + 1)
                       .mul(10).expand(world, n)), mine[:, 0]
    # The same shape again: kept (local, no collective) and refilled.
    again = peers.alloc("x", (world, n), torch.float32, fill=-1.0)
    assert again[rank] is mine and torch.all(mine == -1)
    # A new shape re-allocates (collectively) and updates the table.
    peers.alloc("x", (2 * world, n), torch.float32, fill=0.0)
    assert peers.ptrs("x")[rank].item() == peers.buffer("x", rank).data_ptr()
    # Other ranks' buffers are not reachable from Python.
    other = (rank + 1) % world
    for bad in (lambda: peers.buffer("x", other), lambda: peers.buffers("x")[other], lambda: list(bufs)):
        _expect_raises(bad, PeerBufferNotAddressable)
    _expect_raises(lambda: peers.buffer("nope", rank), KeyError)
    _expect_raises(lambda: peers.buffer("x", world), IndexError)
    peers.destroy()
    assert "destroy" in _expect_raises(lambda: peers.ptrs("x"), RuntimeError)
    return "ok"


def _task_symmetric_peers_graph(rank, world, p):
    """barrier() and a pull through ptrs() captured in a CUDA graph, then replayed."""
    pull_row0, _ = _peer_kernels()
    n = 64
    peers = SymmetricPeers()
    peers.alloc("x", (world, n), torch.float32, fill=float(rank + 100))
    out = torch.zeros(world, n, device=peers.device)
    want = torch.arange(100, world + 100, dtype=torch.float32, device=peers.device)[:, None].expand(world, n)
    torch.cuda.synchronize()
    peers.barrier()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pull_row0[(world,)](peers.ptrs("x"), out, N=n)  # warm-up: compile outside the capture
        with torch.cuda.graph(graph, stream=stream):
            peers.barrier()
            pull_row0[(world,)](peers.ptrs("x"), out, N=n)
            peers.barrier()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for step in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), (step, out[:, 0])
    peers.destroy()
    return "ok"


def _task_symmetric_peers_mismatch(rank, world, p):
    peers = SymmetricPeers()
    try:
        peers.alloc("x", (4 + (rank == 1),), torch.float32)  # rank 1 asks for 5 elements, the others 4
    except ValueError as e:
        return str(e)
    finally:
        peers.destroy()
    raise AssertionError("mismatched alloc did not raise")


_TASKS.update({"symmetric_peers": _task_symmetric_peers, "symmetric_peers_graph": _task_symmetric_peers_graph,
               "symmetric_peers_mismatch": _task_symmetric_peers_mismatch})


@pytest.fixture(scope="module")
def gpu_worlds(tmp_path_factory):
    made: dict[int, World] = {}

    def get(r: int) -> World:
        if r not in made or made[r].broken:
            made[r] = World(r, str(tmp_path_factory.mktemp(f"gpu-pg{r}") / "store"),
                            env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}, cuda=True)
        return made[r]

    yield get
    for w in made.values():
        w.close()


@pytest.mark.gpu
@pytest.mark.parametrize("r", [2, 4])
def test_symmetric_peers_tables_and_buffers(gpu_worlds, r):
    assert gpu_worlds(r).run_ok("symmetric_peers", [None] * r) == ["ok"] * r


@pytest.mark.gpu
@pytest.mark.parametrize("r", [2, 4])
def test_symmetric_peers_barrier_and_pull_in_cuda_graph(gpu_worlds, r):
    assert gpu_worlds(r).run_ok("symmetric_peers_graph", [None] * r) == ["ok"] * r


@pytest.mark.gpu
def test_symmetric_peers_mismatched_alloc_raises_on_every_rank(gpu_worlds):
    for m in gpu_worlds(2).run_ok("symmetric_peers_mismatch", [None, None]):
        assert "differs across ranks" in m and "(4,)" in m and "(5,)" in m, m


# ---------------------------------------------------------------- the megakernels across processes (kittenmoe.ep)

# 64-row tiles and 256-row minibatches: small problems still span several minibatches and tiles
EP_CFG = KernelConfig(num_comm_programs_fwd=8, num_comm_programs_bwd=8, minibatch_size=256, block_m=64,
                     block_n=64, block_k=64, num_stages=3, num_warps=4)
EP_TIMEOUT_S = 420  # a fresh GPU machine compiles the forward and backward megakernels in every process first


def _task_ep_forward_backward(rank, world, p):
    """One rank of megakernel_forward_ep + megakernel_backward_ep over SymmetricPeers; results to the CPU."""
    from kittenmoe.ep import megakernel_backward_ep, megakernel_forward_ep

    dev = torch.device("cuda", rank_gpu(rank))
    a = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    peers = SymmetricPeers()
    try:
        args = (a["x"], a["ids"], a["w"], a["w13"], a["w2"], a["sw13"], a["sw2"], a["limit"])
        fp8 = None
        if a.get("fp8_block"):  # this rank's experts in e4m3, as the single-process run quantises all of them
            from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
            fp8 = FP8ExpertWeights.quantize(a["w13"], a["w2"], FP8Config(a["fp8_block"], a["fp8_block"] == 32))
        outs = []
        keep = a.get("keep", False)
        for run in range(a.get("runs", 2)):  # more calls through the same buffers: same bits
            traced = run == 1  # the second pair traced (kittenmoe.trace): it must give the same bits too
            fwd = megakernel_forward_ep(*args, peers=peers, config=a["config"], save_for_backward=keep, fp8=fp8,
                                        trace=traced)
            assert (fwd.saved() is not None) == keep
            bwd = megakernel_backward_ep(a["d_out"], *args, peers=peers, config=a["config"], saved=fwd.saved(),
                                         fp8=fp8, trace=traced)
            fwd.check_errors()
            bwd.check_errors()
            if traced:
                from kittenmoe.trace import events

                for what, tr in (("forward", fwd.state.trace), ("backward", bwd.trace)):
                    kinds = set(events(tr)[:, 1].tolist())
                    assert {1, 4} <= kinds, f"rank {rank}: the {what} trace lacks routed tiles or pulls: {kinds}"
            else:
                assert fwd.state.trace is None and bwd.trace is None
            outs.append({"out": fwd.output, "d_x": bwd.d_x, "d_w": bwd.d_topk_weights, "d_w13": bwd.d_w13,
                         "d_w2": bwd.d_w2, "d_sw13": bwd.d_shared_w13, "d_sw2": bwd.d_shared_w2})
        for run, later in enumerate(outs[1:], 1):
            for k, v in outs[0].items():
                if v is not None:
                    assert torch.equal(v, later[k]), f"rank {rank}: {k} differs between call 0 and call {run}"
        return {k: (v.cpu() if v is not None else None) for k, v in outs[0].items()}
    finally:
        peers.destroy()


_TASKS["ep_forward_backward"] = _task_ep_forward_backward

EP_CASES = {
    # the small test shape (E=16, H=128, I=64, K=4, shared expert), 2 ranks of 8 experts, 96 tokens each
    "small-R2": (SMALL, 2, 96),
    # the same over 4 ranks of 4 experts: every rank pulls from three peers and pushes to three
    "small-R4": (SMALL, 4, 96),
    # Qwen3.5's widths (H=4096, I=1024, K=10, shared expert), 6 experts per rank, 256 tokens a rank
    "qwen3.5-R2": ("qwen3.5-397b-a17b", 2, 256),
}


def _ep_run_vs_local_peers(gpu_worlds, name, shape, r, t, keep, routing="uniform", runs=2, fp8_block=None):
    """Run one EP forward+backward ``runs`` times in R processes (each rank checks its runs agree bitwise) and
    once in this process over LocalPeers; assert every output and gradient equal bit for bit (shared-expert
    gradients summed over ranks in rank order, as the single-process run does). ``fp8_block``: the routed
    experts in e4m3 with that scale block (128, or 32 for MXFP8). Returns (inputs, got)."""
    from kittenmoe.launch_backward import megakernel_backward_multirank
    from kittenmoe.launch_forward import megakernel_forward_multirank
    from kittenmoe.testing import routing_uniform, routing_zipf

    route = {"uniform": routing_uniform, "zipf": routing_zipf}[routing]
    gen = torch.Generator().manual_seed(11)
    w = make_weights(shape, dtype=torch.bfloat16, device="cpu", generator=gen)
    xs = [torch.randn(t, shape.h, generator=gen).to(torch.bfloat16) for _ in range(r)]
    routes = [route(t, shape.e, shape.k, generator=gen, device="cpu") for _ in range(r)]
    d_outs = [torch.randn(t, shape.h, generator=gen).to(torch.bfloat16) for _ in range(r)]
    L = shape.e // r
    cfg = EP_CFG if fp8_block is None else EP_CFG.with_(block_n=128)  # FP8: gate|up tiles of whole scale blocks
    payloads = [dict(x=xs[k], ids=routes[k][0], w=routes[k][1], d_out=d_outs[k], w13=w.w13_E2IH[k * L:(k + 1) * L],
                     w2=w.w2_EHI[k * L:(k + 1) * L], sw13=w.shared_w13_2SH, sw2=w.shared_w2_HS,
                     limit=shape.swiglu_limit, config=cfg, keep=keep, runs=runs, fp8_block=fp8_block)
                for k in range(r)]
    got = gpu_worlds(r).run_ok("ep_forward_backward", payloads, timeout_s=EP_TIMEOUT_S)

    cu = lambda v: v.to("cuda") if v is not None else None  # noqa: E731
    a = ([cu(x) for x in xs], [cu(i) for i, _ in routes], [cu(v) for _, v in routes], cu(w.w13_E2IH),
         cu(w.w2_EHI), cu(w.shared_w13_2SH), cu(w.shared_w2_HS), shape.swiglu_limit)
    fp8 = None
    if fp8_block is not None:
        from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
        fp8 = FP8ExpertWeights.quantize(a[3], a[4], FP8Config(fp8_block, fp8_block == 32))
    fwd = megakernel_forward_multirank(*a, config=cfg, save_for_backward=keep, fp8=fp8)
    bwd = megakernel_backward_multirank([cu(g) for g in d_outs], *a, config=cfg, saved=fwd.saved(), fp8=fp8)
    fwd.check_errors()
    bwd.check_errors()
    for k in range(r):
        assert_bitwise_equal(got[k]["out"], fwd.outputs[k].cpu(), f"{name} rank {k} out")
        assert_bitwise_equal(got[k]["d_x"], bwd.d_x[k].cpu(), f"{name} rank {k} d_x")
        assert_bitwise_equal(got[k]["d_w"], bwd.d_topk_weights[k].cpu(), f"{name} rank {k} d_topk_weights")
        assert_bitwise_equal(got[k]["d_w13"], bwd.d_w13[k * L:(k + 1) * L].cpu(), f"{name} rank {k} d_w13")
        assert_bitwise_equal(got[k]["d_w2"], bwd.d_w2[k * L:(k + 1) * L].cpu(), f"{name} rank {k} d_w2")
    for key, want in (("d_sw13", bwd.d_shared_w13), ("d_sw2", bwd.d_shared_w2)):
        total = got[0][key].float()
        for k in range(1, r):
            total = total + got[k][key].float()
        assert_bitwise_equal(total.to(torch.bfloat16), want.cpu(), f"{name} {key} summed over ranks")
    return dict(xs=xs, routes=routes, d_outs=d_outs, w=w), got


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [False, True])  # the backward replays, or reads the forward's activations
@pytest.mark.parametrize("name", list(EP_CASES))
def test_gpu_ep_megakernels_equal_local_peers_bitwise(gpu_worlds, name, keep):
    """R processes (``rank_gpu``) through real symmetric memory give the outputs and gradients of the
    single-process LocalPeers run bit for bit, with the backward replaying or reading the kept activations."""
    from kittenmoe.config import SEED_SHAPES

    shape, r, t = EP_CASES[name]
    if isinstance(shape, str):
        shape = SEED_SHAPES[shape].with_(e=6 * r)  # K=10 needs E >= 10
    _ep_run_vs_local_peers(gpu_worlds, name, shape, r, t, keep)


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [False, True])  # the e4m3 replay of gate|up, or the forward's kept gate|up
@pytest.mark.parametrize("fp8_block", [128, 32])  # DeepSeek-V3's blocks, MXFP8's
def test_gpu_ep_fp8_megakernels_equal_local_peers_bitwise(gpu_worlds, fp8_block, keep):
    """The FP8 megakernels over 2 processes and real symmetric memory give the single-process LocalPeers
    run's outputs and gradients bit for bit (rows quantised by the puller, on either side of the link)."""
    shape = ModelShape(name="fp8-ep", e=8, h=256, i=128, k=2)
    _ep_run_vs_local_peers(gpu_worlds, f"fp8-{fp8_block}", shape, 2, 96, keep, fp8_block=fp8_block)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [2, 4])  # 2: one GPU a rank on nvidia-h200-x2; 4: shared round-robin there
@pytest.mark.parametrize("routing", ["uniform", "zipf"])  # balanced, and skewed load as real routing is
def test_gpu_ep_matches_reference_and_repeats_10_times(gpu_worlds, routing, r):
    """The EP correctness bar at Kimi's widths (H=7168, I=2048, K=8; 4 experts a rank, 192 tokens a rank):
    outputs and every gradient within rel L1 1e-2 of the fp64 multi-rank reference, equal to LocalPeers bit
    for bit, and the same bits over 10 calls on every rank."""
    from kittenmoe.config import SEED_SHAPES
    from kittenmoe.testing import rel_l1

    shape = SEED_SHAPES["kimi-k2.7"].with_(e=4 * r)
    inp, got = _ep_run_vs_local_peers(gpu_worlds, f"kimi-R{r}-{routing}", shape, r, 192, keep=True,
                                      routing=routing, runs=10)
    w = inp["w"]
    f64 = lambda v: v.double().requires_grad_() if v is not None else None  # noqa: E731
    xs, wts = [f64(x) for x in inp["xs"]], [f64(v) for _, v in inp["routes"]]
    w13, w2, sw13, sw2 = f64(w.w13_E2IH), f64(w.w2_EHI), f64(w.shared_w13_2SH), f64(w.shared_w2_HS)
    outs = moe_reference_multirank(xs, [i for i, _ in inp["routes"]], wts, w13, w2, sw13, sw2, shape.swiglu_limit,
                                   compute_dtype=torch.float64)
    sum((o * d.double()).sum() for o, d in zip(outs, inp["d_outs"])).backward()
    L = shape.e // r
    checks = []
    for k in range(r):
        rows = slice(k * L, (k + 1) * L)
        checks += [(f"rank {k} out", got[k]["out"], outs[k].detach()), (f"rank {k} d_x", got[k]["d_x"], xs[k].grad),
                   (f"rank {k} d_topk_weights", got[k]["d_w"], wts[k].grad),
                   (f"rank {k} d_w13", got[k]["d_w13"], w13.grad[rows]), (f"rank {k} d_w2", got[k]["d_w2"], w2.grad[rows])]
    checks += [("d_shared_w13", sum(got[k]["d_sw13"].double() for k in range(r)), sw13.grad),
               ("d_shared_w2", sum(got[k]["d_sw2"].double() for k in range(r)), sw2.grad)]
    errs = {what: rel_l1(a, b) for what, a, b in checks}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tolerance_for(torch.bfloat16).rel_l1, f"{worst}: rel L1 {errs[worst]:.3e}; all: {errs}"


def test_ep_needs_symmetric_peers():
    """The EP entry points refuse LocalPeers with a message that names the single-process alternative."""
    from kittenmoe.ep import megakernel_forward_ep
    from kittenmoe.peers import LocalPeers

    gen = torch.Generator().manual_seed(0)
    w = make_weights(TINY, generator=gen)
    x = torch.randn(4, TINY.h, generator=gen)
    ids = torch.zeros(4, TINY.k, dtype=torch.int64)
    with pytest.raises(TypeError, match="SymmetricPeers.*LocalPeers"):
        megakernel_forward_ep(x, ids, torch.ones(4, TINY.k), w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH,
                              w.shared_w2_HS, None, peers=LocalPeers(2))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be a positive number"),  # a clamp below zero
    (dict(swiglu_limit=True), ValueError, "swiglu_limit must be a positive number"),  # True is not a limit
    (dict(fp8="e4m3"), TypeError, "fp8 must be None, a kittenmoe.fp8.FP8Config"),  # a name for the FP8 options
])
def test_ep_refuses_bad_options_before_any_collective(kw, exc, match):
    """moe_ep checks its swiglu_limit and fp8 as kittenmoe.moe does, before the ranks compare anything: every
    rank passing the same bad limit would otherwise agree on it and compute a wrong clamp. The peers are a stub
    (no process group on CPU) that records the collectives asked of it."""
    from kittenmoe.ep import moe_ep

    peers = object.__new__(SymmetricPeers)
    asked = []
    peers.num_ranks, peers.rank, peers.max_tokens, peers.device = 1, 0, None, torch.device("cpu")
    peers.agree = lambda what, value: asked.append(what)
    gen = torch.Generator().manual_seed(0)
    w = make_weights(TINY, generator=gen)
    x = torch.randn(4, TINY.h, generator=gen)
    ids = torch.zeros(4, TINY.k, dtype=torch.int64)
    args = {"swiglu_limit": None, **kw}
    with pytest.raises(exc, match=match):
        moe_ep(x, ids, torch.ones(4, TINY.k), w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
               peers=peers, **args)
    assert not asked


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])  # zero, negative, float, bool: not a positive int
def test_symmetric_peers_rejects_bad_max_tokens(bad):
    """max_tokens is checked before anything distributed happens (so this runs on CPU without a group)."""
    with pytest.raises(ValueError, match="max_tokens must be a positive int or None"):
        SymmetricPeers(max_tokens=bad)


def _task_ep_layer(rank, world, p):
    """One rank of an expert-parallel MoELayer: loads the full layer's router, shared expert and its own
    experts, runs forward and backward on its tokens; returns its output and gradients on the CPU."""
    from kittenmoe import MoELayer

    dev = torch.device("cuda", rank_gpu(rank))
    peers = SymmetricPeers(max_tokens=p.get("max_tokens"))
    try:
        # device="cuda" (no index) must match the peers' current device, as examples/ep_layer.py spells it
        layer = MoELayer(p["shape"], dtype=torch.bfloat16, device="cuda", config=p["config"], ep=peers,
                         fp8=p.get("fp8"))
        n = layer.w13_E2IH.shape[0]
        assert layer.expert_offset == rank * n and "ep=rank" in repr(layer)
        full = p["state"]
        local = {k: (v[rank * n:(rank + 1) * n] if k in ("w13_E2IH", "w2_EHI") else v) for k, v in full.items()}
        layer.load_state_dict(local)
        x = p["x"].to(dev).requires_grad_()
        out = layer(x)
        out.backward(p["d_out"].to(dev))
        from kittenmoe import check_errors
        check_errors()
        grads = {name: q.grad.cpu() for name, q in layer.named_parameters()}
        return {"out": out.detach().cpu(), "d_x": x.grad.cpu(), **grads}
    finally:
        peers.destroy()


_TASKS["ep_layer"] = _task_ep_layer


@pytest.mark.gpu
@pytest.mark.parametrize("ts,max_tokens", [
    ([128, 128], None),  # 2 ranks, the same T
    ([128] * 4, None),  # 4 ranks, the same T
    ([128, 72], 128),  # 2 ranks with different T: rank 1 pads 56 tokens (NO_ROUTE) up to max_tokens
    ([40, 128, 1, 96], 160),  # 4 ranks, every rank padded, one with a single token
    ([0, 128], 128),  # one rank brings no tokens: it still serves its experts to the other
    ([96, 0, 0, 64], 128),  # ranks with and without tokens mixed over 4 processes
    ([0, 0], None),  # every rank empty (the same T everywhere): [0, H] and zero gradients, no launch
])
def test_gpu_ep_layer_matches_single_process_layer(gpu_worlds, ts, max_tokens):
    """MoELayer(ep=SymmetricPeers(max_tokens)) over len(ts) processes (``rank_gpu``) against one process's
    MoELayer on all the tokens: each rank's output and d_x rows, its experts' gradients, and the replicated
    router's and shared expert's gradients summed over ranks, at bf16 tolerance."""
    from kittenmoe import MoELayer

    r = len(ts)
    ref = MoELayer(SMALL, dtype=torch.bfloat16, device="cuda", config=EP_CFG, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(t, SMALL.h, generator=gen).to(torch.bfloat16) for t in ts]
    d_outs = [torch.randn(t, SMALL.h, generator=gen).to(torch.bfloat16) for t in ts]
    state = {k: v.cpu() for k, v in ref.state_dict().items()}
    got = gpu_worlds(r).run_ok("ep_layer", [dict(shape=SMALL, config=EP_CFG, state=state, x=xs[k], d_out=d_outs[k],
                                                 max_tokens=max_tokens) for k in range(r)], timeout_s=EP_TIMEOUT_S)
    _compare_ep_layer(got, ref, xs, d_outs, ts, SMALL)


@pytest.mark.gpu
def test_gpu_ep_layer_without_config_runs_the_auto_config(gpu_worlds):
    """config=None under EP: every rank resolves the tuned-or-heuristic config for the buffers' rows
    (kittenmoe.autoconfig, the same on every rank of one machine) and the layer matches one process's."""
    from kittenmoe import MoELayer

    ts = [128, 72]
    ref = MoELayer(SMALL, dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, SMALL.h, generator=gen).to(torch.bfloat16) for t in ts]
    d_outs = [torch.randn(t, SMALL.h, generator=gen).to(torch.bfloat16) for t in ts]
    state = {k: v.cpu() for k, v in ref.state_dict().items()}
    got = gpu_worlds(2).run_ok("ep_layer", [dict(shape=SMALL, config=None, state=state, x=xs[k], d_out=d_outs[k],
                                                 max_tokens=128) for k in range(2)], timeout_s=EP_TIMEOUT_S)
    _compare_ep_layer(got, ref, xs, d_outs, ts, SMALL)


def _compare_ep_layer(got, ref, xs, d_outs, ts, shape):
    """Each rank's output and d_x rows and its experts' gradients against ``ref`` (one process, all tokens), and
    the replicated router's and shared expert's gradients summed over ranks, at bf16 tolerance."""
    r = len(ts)
    x = torch.cat(xs).cuda().requires_grad_()
    out = ref(x)
    out.backward(torch.cat(d_outs).cuda())
    n = shape.e // r
    starts = [sum(ts[:k]) for k in range(r)]
    for k in range(r):
        rows = slice(starts[k], starts[k] + ts[k])
        assert_close(got[k]["out"], out[rows].detach().cpu(), torch.bfloat16, f"rank {k} out")
        assert_close(got[k]["d_x"], x.grad[rows].cpu(), torch.bfloat16, f"rank {k} d_x")
        for name in ("w13_E2IH", "w2_EHI"):
            want = dict(ref.named_parameters())[name].grad[k * n:(k + 1) * n].cpu()
            assert_close(got[k][name], want, torch.bfloat16, f"rank {k} d_{name}")
    for name in ("router_w_EH", "shared_w13_2SH", "shared_w2_HS"):
        total = sum(got[k][name].float() for k in range(r))
        assert_close(total, dict(ref.named_parameters())[name].grad.float().cpu(), torch.bfloat16,
                     f"d_{name} summed over ranks")


@pytest.mark.gpu
def test_gpu_ep_fp8_layer_matches_single_process_fp8_layer(gpu_worlds):
    """MoELayer(ep=..., fp8=FP8Config()) over 2 processes against one process's FP8 layer on all the tokens:
    the same e4m3 quantisation (per-expert weight blocks, per-row activation blocks) on both sides."""
    from kittenmoe import MoELayer
    from kittenmoe.fp8 import FP8Config

    shape = ModelShape(name="fp8-ep", e=8, h=256, i=128, k=2)
    cfg = EP_CFG.with_(block_n=128)
    ref = MoELayer(shape, dtype=torch.bfloat16, device="cuda", config=cfg, fp8=FP8Config(),
                   generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    ts = [96, 96]
    xs = [torch.randn(t, shape.h, generator=gen).to(torch.bfloat16) for t in ts]
    d_outs = [torch.randn(t, shape.h, generator=gen).to(torch.bfloat16) for t in ts]
    state = {k: v.cpu() for k, v in ref.state_dict().items()}
    got = gpu_worlds(2).run_ok("ep_layer", [dict(shape=shape, config=cfg, state=state, x=xs[k], d_out=d_outs[k],
                                                 fp8=FP8Config()) for k in range(2)], timeout_s=EP_TIMEOUT_S)
    _compare_ep_layer(got, ref, xs, d_outs, ts, shape)


def test_ep_layer_refuses_bad_peers():
    from kittenmoe import MoELayer
    from kittenmoe.peers import LocalPeers

    with pytest.raises(TypeError, match="SymmetricPeers"):
        MoELayer(TINY, ep=LocalPeers(2))


def _task_ep_mismatch(rank, world, p):
    """Rank 1 asks for another swiglu_limit than rank 0: both must raise, neither hang."""
    from kittenmoe.ep import megakernel_forward_ep

    dev = torch.device("cuda", rank_gpu(rank))
    a = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    peers = SymmetricPeers()
    try:
        megakernel_forward_ep(a["x"], a["ids"], a["w"], a["w13"], a["w2"], None, None,
                              None if rank == 0 else 7.0, peers=peers)
    except ValueError as e:
        return str(e)
    finally:
        peers.destroy()
    raise AssertionError("mismatched swiglu_limit did not raise")


_TASKS["ep_mismatch"] = _task_ep_mismatch


def _small_ep_payloads() -> list[dict]:
    """Two ranks' inputs on SMALL without a shared expert: 32 tokens each, uniform routing, 8 experts a rank."""
    from kittenmoe.testing import routing_uniform

    gen = torch.Generator().manual_seed(0)
    w = make_weights(SMALL, dtype=torch.bfloat16, generator=gen)
    payloads = []
    for k in range(2):
        x = torch.randn(32, SMALL.h, generator=gen).to(torch.bfloat16)
        ids, wts = routing_uniform(32, SMALL.e, SMALL.k, generator=gen, device="cpu")
        payloads.append(dict(x=x, ids=ids, w=wts, w13=w.w13_E2IH[k * 8:(k + 1) * 8], w2=w.w2_EHI[k * 8:(k + 1) * 8]))
    return payloads


@pytest.mark.gpu
def test_gpu_ep_mismatched_problem_raises_on_every_rank(gpu_worlds):
    payloads = _small_ep_payloads()
    for m in gpu_worlds(2).run_ok("ep_mismatch", payloads, timeout_s=EP_TIMEOUT_S):
        assert "differs across ranks" in m and "7.0" in m, m




def _task_ep_bad_ids(rank, world, p):
    """Rank 1 routes one token to id 2**31 - 1 (the padding tokens' NO_ROUTE) and one to the int64 id 2**32 + 1
    (expert 1 if cast to int32): neither may be taken for padding or wrap into range. Every rank's schedule counts
    them, so every rank's forward raises at check_errors."""
    from kittenmoe.ep import megakernel_forward_ep
    from kittenmoe.launch_common import MegakernelError

    dev = torch.device("cuda", rank_gpu(rank))
    a = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    ids = a["ids"].long()
    if rank == 1:
        ids[3, 0], ids[5, 1] = 2**31 - 1, 2**32 + 1
    peers = SymmetricPeers()
    try:
        fwd = megakernel_forward_ep(a["x"], ids, a["w"], a["w13"], a["w2"], None, None, None, peers=peers)
        try:
            fwd.check_errors()
        except MegakernelError as e:
            return str(e)
    finally:
        peers.destroy()
    raise AssertionError(f"rank {rank}: NO_ROUTE and a wrapping int64 id from a caller were not flagged")


_TASKS["ep_bad_ids"] = _task_ep_bad_ids


@pytest.mark.gpu
def test_gpu_ep_caller_ids_never_padding_or_wrapped(gpu_worlds):
    for m in gpu_worlds(2).run_ok("ep_bad_ids", _small_ep_payloads(), timeout_s=EP_TIMEOUT_S):
        assert "expert id" in m, m

_KEEP_ALIVE: list = []  # objects whose destructors must not run before a task's answer is sent


def _task_ep_peer_gone(rank, world, p):
    """Both ranks run one forward (allocations and the problem agreed); then rank 1 stops taking part, as a rank
    that died would, and rank 0 runs a second forward alone. Its device barrier must give up after
    barrier_timeout_ms (a CUDA error at the next sync) instead of spinning forever."""
    from kittenmoe.ep import megakernel_forward_ep

    dev = torch.device("cuda", rank_gpu(rank))
    a = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    peers = SymmetricPeers(barrier_timeout_ms=3000)
    args = (a["x"], a["ids"], a["w"], a["w13"], a["w2"], None, None, None)
    megakernel_forward_ep(*args, peers=peers, config=EP_CFG).check_errors()
    torch.cuda.synchronize()
    if rank == 1:
        return "gone"
    # After the timeout the CUDA context is broken (the barrier traps), and torch's symmetric-memory
    # destructors then abort the process (H200 x2: "terminate called after throwing ...
    # ~AllocationRef"). Keep the peers alive so that the answer reaches the test process first.
    _KEEP_ALIVE.append(peers)
    t0 = time.monotonic()
    try:
        megakernel_forward_ep(*args, peers=peers, config=EP_CFG)
        torch.cuda.synchronize()
    except Exception as e:  # the expected outcome, reported to the test process
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    raise AssertionError("a forward whose peer never arrived completed")


_TASKS["ep_peer_gone"] = _task_ep_peer_gone


@pytest.mark.gpu
def test_gpu_ep_rank_gone_gives_a_timeout_error_not_a_hang(tmp_path):
    """DESIGN's no-deadlock invariant across processes: a rank that stops participating leaves the other with an
    error within the barrier timeout. A fresh world (the failing process's CUDA context is lost afterwards)."""
    payloads = _small_ep_payloads()
    world = World(2, str(tmp_path / "store"), env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}, cuda=True)
    try:
        (s0, v0), (s1, v1) = world.run("ep_peer_gone", payloads, timeout_s=EP_TIMEOUT_S)
    finally:
        world.close()
    assert (s1, v1) == ("ok", "gone"), (s1, v1)
    assert s0 == "ok" and "Error" in v0, (s0, v0)
