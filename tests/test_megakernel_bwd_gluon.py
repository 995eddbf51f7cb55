"""The Gluon backward megakernel (``KernelConfig.backward_kernel="gluon"``): its refusals on CPU, and on a Hopper GPU
the Triton backward's bits (every gradient) and the fp32 reference's accuracy."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from kittenmoe import launch_backward
from kittenmoe.config import KernelConfig, ModelShape
from kittenmoe.kernels import megakernel_bwd as mb
from kittenmoe.launch_backward import backward_gluon_refusal, megakernel_backward_multirank, resolve_backward_kernel
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.reference import moe_reference
from kittenmoe.testing import (assert_bitwise_equal, make_weights, nan_scratch, rel_l1, routing_uniform, routing_zipf,
                               tolerance_for)

# the one-rank default the Gluon kernel runs (default_config's on an H200), Triton and Gluon
ONE_RANK = KernelConfig(num_comm_programs_fwd=0, num_comm_programs_bwd=0, combine_gather=True, tile_group_m=-1)
GLUON = ONE_RANK.with_(backward_kernel="gluon")
AUTO = ONE_RANK.with_(backward_kernel="auto")


def test_config_names_the_backward_kernel():
    assert KernelConfig().backward_kernel == "triton"
    with pytest.raises(ValueError, match="backward_kernel must be one of 'triton', 'gluon', 'auto'"):
        KernelConfig(backward_kernel="cuda")


@pytest.mark.parametrize("change,want", [
    (dict(), "triton"),  # a CPU device (the interpreter's): no Gluon
    (dict(config=GLUON), "gluon"),  # a named kernel is never resolved away (its launch refuses instead)
    (dict(config=ONE_RANK), "triton"),
])
def test_auto_backward_kernel_off_hopper(change, want):
    args = dict(config=AUTO, dev=torch.device("cpu"), dtype=torch.bfloat16, ranks=1, h=512, i=256, s=0, gu_mode=1,
                fp8=None, phases=mb.PB_ALL)
    assert resolve_backward_kernel(**{**args, **change}) == want


def _small_backward_args():
    """A small bf16 problem on the CPU without a shared expert (widths the Gluon tiles divide): the launchers'
    arguments after d_out, and d_out."""
    sh = ModelShape("t", e=4, h=256, i=128, k=2)
    g = torch.Generator().manual_seed(0)
    w = make_weights(sh, dtype=torch.bfloat16, generator=g, shared=False)
    x = torch.randn(64, sh.h, generator=g).to(torch.bfloat16)
    d_out = torch.randn(64, sh.h, generator=g).to(torch.bfloat16)
    ids, wts = routing_uniform(64, sh.e, sh.k, generator=g)
    return ([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, None, None, None), d_out


def test_auto_backward_runs_the_triton_kernel_under_the_interpreter():
    """"auto" on the CPU path runs the Triton kernel: the same bits as backward_kernel="triton"."""
    cfg = KernelConfig(num_comm_programs_fwd=0, num_comm_programs_bwd=0, combine_gather=True, minibatch_size=64,
                       block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4)
    args, d_out = _small_backward_args()
    fwd = megakernel_forward_multirank(*args, config=cfg, save_for_backward=True)
    got = megakernel_backward_multirank([d_out], *args, config=cfg.with_(backward_kernel="auto"), saved=fwd.saved())
    want = megakernel_backward_multirank([d_out], *args, config=cfg, saved=fwd.saved())
    for name, t in _grads(want).items():
        assert_bitwise_equal(_grads(got)[name], t, f"auto vs triton: {name}")


@pytest.mark.parametrize("change,match", [
    (dict(ranks=2), "one rank"),  # several ranks push their d_x rows: the Gluon kernel has no communication programs
    (dict(config=GLUON.with_(num_comm_programs_bwd=4)), "num_comm_programs_bwd=0"),  # communication programs
    (dict(gu_mode=0), "kept"),  # a forward that kept no activations: the gate|up replay
    (dict(gu_mode=2), "kept"),  # a wrapping ring's forward kept macrobatch 0 only
    (dict(s=256), "shared expert"),  # a shared expert's phases
    (dict(fp8=object()), "no FP8"),  # e4m3 operands
    (dict(phases=mb.PB_A | mb.PB_PULL), "every phase"),  # a phase subset, for timing one phase
    (dict(dtype=torch.float32), "2-byte operands"),  # fp32 rows
    (dict(config=GLUON.with_(block_n=64)), "block_n=128"),  # another tile
    (dict(i=192), "I a multiple of 128"),  # an expert width off the 128-column phase-A tile
    (dict(h=384), "H of 256"),  # a hidden width off the 256-column phase-B tile
])
def test_gluon_refusals_say_what_is_missing(change, match):
    args = dict(config=GLUON, dev=torch.device("cpu"), dtype=torch.bfloat16, ranks=1, h=512, i=256, s=0, gu_mode=1,
                fp8=None, phases=mb.PB_ALL)
    why = backward_gluon_refusal(**{**args, **change})
    assert why is not None and match in why, why
    assert backward_gluon_refusal(**args) is None


def test_gluon_refused_under_the_interpreter():
    """The CPU path (the interpreter) cannot run Gluon: the launch says so instead of running something else."""
    args, d_out = _small_backward_args()
    with pytest.raises(NotImplementedError, match="backward_kernel='gluon'.*interpreter"):
        megakernel_backward_multirank([d_out], *args, config=GLUON)


@pytest.mark.parametrize("stages,late,deadlocks", [
    (3, True, False),  # the kernel's ring, rows signalled a step late: every random tile sequence finishes
    (2, True, True),  # too shallow for the late signal: some sequence deadlocks (the model can fail)
    (3, False, False),  # the kernel's ring, rows tracked by the barrier (launch_backward.gather_tracked)
    (2, False, False),  # tracked rows need no spare stage
])
def test_backward_barrier_protocol_model(stages, late, deadlocks, ring_protocol):
    """The Gluon backward's barriers (operand ring, a_ready, the epilogue hand-over) in random interleavings over
    random sequences of phase-A, empty phase-A and phase-B tiles, for both forms of the phase-A gather."""
    import random

    rp = ring_protocol
    bad = 0
    for trial in range(300):
        rng = random.Random(trial)
        tiles = [(rng.choice(["a", "ae", "b"]), rng.choice([1, 2, 3, 4, 8])) for _ in range(rng.randint(0, 8))]
        bad += not rp.run_backward(tiles, stages, trial, late=late)
    assert (bad > 0) == deadlocks, f"{bad} of 300 sequences deadlocked at {stages} stages"


@pytest.fixture
def cuda_cleanup():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# (shape, tokens, routing): each case names the edge it covers; no shared expert (the Gluon backward has none)
GPU_CASES = {
    # fine-grained experts (I = 512, 4 phase-A column tiles; K of phase B = 1024), T not a multiple of 128
    "fine": (ModelShape("fine", e=64, h=2048, i=512, k=8), 3000, "uniform"),
    # Qwen3-30B-A3B's layer: I = 768, an odd number of 128-column tiles; 16 minibatches
    "qwen3-30b": (ModelShape("qwen3", e=128, h=2048, i=768, k=8), 4096, "uniform"),
    # Moonlight's width I = 1408 (11 column tiles), top-6
    "moonlight": (ModelShape("moonlight", e=64, h=2048, i=1408, k=6), 2048, "uniform"),
    # skewed routing (empty experts, long ones), the SwiGLU clamp's masks, several minibatches, H = 1024
    "zipf-clamp": (ModelShape("zipf", e=32, h=1024, i=256, k=4, swiglu_limit=7.0), 1500, "zipf"),
}


@functools.cache
def _case(case: str):
    """A case's inputs on the GPU, its kept forward and the Triton backward's gradients, once a session."""
    sh, t, routing = GPU_CASES[case]
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    w = make_weights(sh, dtype=torch.float32, generator=g, shared=False)
    w13, w2 = w.w13_E2IH.to(dev, torch.bfloat16), w.w2_EHI.to(dev, torch.bfloat16)
    x = torch.randn(t, sh.h, generator=g).to(dev, torch.bfloat16)
    d_out = torch.randn(t, sh.h, generator=g).to(dev, torch.bfloat16)
    gen = routing_uniform if routing == "uniform" else routing_zipf
    ids, wts = gen(t, sh.e, sh.k, generator=g, device=dev)
    args = ([x], [ids], [wts.float()], w13, w2, None, None, sh.swiglu_limit)
    fwd = megakernel_forward_multirank(*args, config=ONE_RANK, save_for_backward=True)
    fwd.check_errors()
    tri = megakernel_backward_multirank([d_out], *args, config=ONE_RANK, saved=fwd.saved())
    tri.check_errors()
    return args, d_out, fwd, tri


def _grads(res) -> dict[str, torch.Tensor]:
    return dict(d_x=res.d_x[0], d_topk_weights=res.d_topk_weights[0], d_w13=res.d_w13, d_w2=res.d_w2)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon backward needs a Hopper GPU")
def test_gpu_auto_backward_resolves_per_launch():
    """"auto" (default_config's on CUDA with 2-byte operands) runs the Gluon backward where a launch can run it and
    the Triton kernel elsewhere, never refusing."""
    args = dict(config=AUTO, dev=torch.device("cuda"), dtype=torch.bfloat16, ranks=1, h=2048, i=768, s=0, gu_mode=1,
                fp8=None, phases=mb.PB_ALL)
    assert resolve_backward_kernel(**args) == "gluon"
    assert resolve_backward_kernel(**{**args, "s": 768}) == "triton"  # a shared expert
    assert resolve_backward_kernel(**{**args, "gu_mode": 0}) == "triton"  # a forward that kept nothing: the replay
    assert resolve_backward_kernel(**{**args, "ranks": 2}) == "triton"  # several ranks push their d_x rows


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon backward needs a Hopper GPU")
def test_gpu_gather_tracked_where_d_out_fits_in_l2():
    """The phase-A gather's form follows d_out's bytes against this GPU's L2 (50 MB on the H100 and H200): the
    two problems it was measured on land on the sides they won on."""
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    assert launch_backward.gather_tracked(8192 * 2048 * 2, dev) == (8192 * 2048 * 2 <= l2)  # Qwen3-30B-A3B: 34 MB
    assert not launch_backward.gather_tracked(32768 * 4096 * 2, dev)  # the fine-grained problem: 268 MB
    assert launch_backward.gather_tracked(l2, dev) and not launch_backward.gather_tracked(l2 + 1, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon backward needs a Hopper GPU")
# the config's num_stages (4: the default's, 2: under the gather's minimum) does not reach the Gluon kernel's ring
@pytest.mark.parametrize("stages", [4, 2], ids=["4-stages", "2-stages"])
# both forms of the phase-A gather, whichever launch_backward.gather_tracked picks for the case's d_out
@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "late"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_gluon_backward_matches_triton_bits(case, tracked, stages, cuda_cleanup, monkeypatch):
    """Every gradient equals the Triton backward's bit for bit (same kept forward); two Gluon runs give the same
    bits; d_x is within the bf16 tolerance of the fp32 reference's. Scratch starts NaN (``nan_scratch``), so a
    row the kernel leaves unwritten shows."""
    args, d_out, fwd, tri = _case(case)
    nan_scratch(monkeypatch)
    monkeypatch.setattr(launch_backward, "gather_tracked", lambda d_out_bytes, dev: tracked)
    runs = []
    for _ in range(2):
        glu = megakernel_backward_multirank([d_out], *args, config=GLUON.with_(num_stages=stages),
                                            saved=fwd.saved())
        glu.check_errors()
        runs.append(_grads(glu))
    want = _grads(tri)
    for name, g in runs[0].items():
        assert_bitwise_equal(runs[1][name], g, f"{case}: {name}, Gluon run to run")
        if name != "d_topk_weights":
            assert_bitwise_equal(g, want[name], f"{case}: {name}, Gluon vs Triton")
    # the router-weight gradient's 64-column partial sums are added in another order than the Triton kernel's
    d = (runs[0]["d_topk_weights"] - want["d_topk_weights"]).abs()
    assert d.max() <= 1e-5 * want["d_topk_weights"].abs().max(), f"{case}: d_topk_weights max diff {d.max():.3e}"
    monkeypatch.undo()
    x, ids, wts = args[0][0], args[1][0], args[2][0]
    xl = x.float().requires_grad_(True)
    ref = moe_reference(xl, ids, wts, args[3].float(), args[4].float(), None, None, args[7],
                        compute_dtype=torch.float32)
    (ref * d_out.float()).sum().backward()
    err = rel_l1(runs[0]["d_x"], xl.grad)
    assert err <= tolerance_for("bf16").rel_l1, f"{case}: d_x relative L1 {err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon backward needs a Hopper GPU")
# uniform routing at Qwen's widths (16 minibatches) and skewed routing with empty experts (empty phase-A tiles)
@pytest.mark.parametrize("case", ["qwen3-30b", "zipf-clamp"])
def test_gpu_gluon_backward_trace_counts_every_role_and_changes_no_bit(case, cuda_cleanup):
    """A traced Gluon backward (``trace=True``, ``kittenmoe.trace.BWD_KINDS``): per routed row tile and column
    tile one "A", "A hand-over" and "A epilogue" event, per phase-B tile one "B", "B store" and "a_ready wait";
    every event's times ordered (start <= ready <= end); the gradients equal the untraced run's bit for bit."""
    from kittenmoe.trace import BWD_KINDS, events, summarize

    args, d_out, fwd, tri = _case(case)
    plain = megakernel_backward_multirank([d_out], *args, config=GLUON, saved=fwd.saved())
    traced = megakernel_backward_multirank([d_out], *args, config=GLUON, saved=fwd.saved(), trace=True)
    traced.check_errors()
    for name, g in _grads(plain).items():
        assert_bitwise_equal(_grads(traced)[name], g, f"{case}: {name}, traced vs untraced")
    assert plain.traces is None
    ev = events(traced.traces[0])
    sh = GPU_CASES[case][0]
    sched = fwd.states[0].schedule
    rows = int(sched.num_rows.item())
    tiles = int((sched.tile_expert[:-(-rows // 128)] >= 0).sum())  # routed row tiles of 128 with an expert
    n_a, n_b = tiles * (sh.i // 128), tiles * (sh.h // 256)
    want = {"A": n_a, "A hand-over": n_a, "A epilogue": n_a, "B": n_b, "B store": n_b, "a_ready wait": n_b}
    got = {name: int((ev[:, 1] == code).sum()) for code, name in enumerate(BWD_KINDS)}
    assert got == {name: want.get(name, 0) for name in BWD_KINDS}, (got, want)
    assert bool((ev[:, 2] <= ev[:, 3]).all() and (ev[:, 3] <= ev[:, 4]).all()), "an event's times out of order"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s = summarize(traced.traces[0], 0, BWD_KINDS, num_programs=sms)
    assert s.span_ns > 0 and {k.kind for k in s.kinds} == {n for n, c in want.items() if c}
