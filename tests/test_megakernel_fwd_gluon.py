"""The Gluon forward megakernel (``KernelConfig.forward_kernel="gluon"``): its refusals on CPU, and on a Hopper GPU
the Triton megakernel's bits (output, kept gate|up, routed x rows) and the fp32 reference's accuracy."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from kittenmoe.config import SEED_SHAPES, KernelConfig, ModelShape
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_forward import forward_gluon_refusal, megakernel_forward_multirank, resolve_forward_kernel
from kittenmoe.reference import moe_reference
from kittenmoe.testing import (assert_bitwise_equal, make_weights, nan_scratch, rel_l1, routing_uniform, routing_zipf,
                               tolerance_for)

# the one-rank default the Gluon kernel runs (default_config's on an H200), Triton and Gluon
ONE_RANK = KernelConfig(num_comm_programs_fwd=0, num_comm_programs_bwd=0, combine_gather=True, tile_group_m=-1)
GLUON = ONE_RANK.with_(forward_kernel="gluon")
GATHER = ONE_RANK.with_(forward_kernel="gluon-gather")


AUTO = ONE_RANK.with_(forward_kernel="auto")


def test_config_names_the_forward_kernel():
    assert KernelConfig().forward_kernel == "triton"
    with pytest.raises(ValueError, match="forward_kernel must be one of 'triton', 'gluon', 'gluon-gather', 'auto'"):
        KernelConfig(forward_kernel="cuda")


@pytest.mark.parametrize("change,want", [
    (dict(), "triton"),  # a CPU device (the interpreter's): no Gluon
    (dict(config=GATHER), "gluon-gather"),  # a named kernel is never resolved away (its launch refuses instead)
    (dict(config=ONE_RANK), "triton"),
])
def test_auto_forward_kernel_off_hopper(change, want):
    args = dict(config=AUTO, dev=torch.device("cpu"), dtype=torch.bfloat16, ranks=1, h=512, i=256, s=256,
                resident=True, fp8=None, phases=mk.PH_ALL)
    assert resolve_forward_kernel(**{**args, **change}) == want


def _small_forward_args():
    """megakernel_forward_multirank's arguments for one rank, 64 tokens of a small bf16 shape (widths the Gluon
    tiles divide)."""
    sh = ModelShape("t", e=4, h=256, i=128, k=2)
    g = torch.Generator().manual_seed(0)
    w = make_weights(sh, dtype=torch.bfloat16, generator=g)
    x = torch.randn(64, sh.h, generator=g).to(torch.bfloat16)
    ids, wts = routing_uniform(64, sh.e, sh.k, generator=g)
    return [x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, None


def test_auto_forward_runs_the_triton_kernel_under_the_interpreter():
    """"auto" on the CPU path runs the Triton kernel: the same bits as forward_kernel="triton"."""
    cfg = KernelConfig(num_comm_programs_fwd=0, num_comm_programs_bwd=0, combine_gather=True, minibatch_size=64,
                       block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4)
    args = _small_forward_args()
    got = megakernel_forward_multirank(*args, config=cfg.with_(forward_kernel="auto"))
    want = megakernel_forward_multirank(*args, config=cfg)
    assert_bitwise_equal(got.outputs[0], want.outputs[0], "auto vs triton")


@pytest.mark.parametrize("change,match", [
    (dict(ranks=2), "one rank"),  # several ranks push: the Gluon kernel has no communication programs
    (dict(resident=False), "every routed row"),  # a wrapping ring
    (dict(fp8=object()), "no FP8"),  # e4m3 operands
    (dict(dtype=torch.float32), "2-byte operands"),  # fp32 rows
    (dict(config=GLUON.with_(block_n=64)), "block_n=128"),  # another tile
    (dict(config=GATHER.with_(num_stages=1)), "2-4 stages"),  # a stage goes back a K step after it is read
    (dict(i=192), "multiples of 128"),  # an expert width off the 128-column tile
    (dict(h=384), "H of 256"),  # a hidden width off the 256-column down tile
    (dict(s=64), "multiples of 128"),  # a shared width off the tile
])
def test_gluon_refusals_say_what_is_missing(change, match):
    args = dict(config=GLUON, dev=torch.device("cpu"), dtype=torch.bfloat16, ranks=1, h=512, i=256, s=256,
                resident=True, fp8=None)
    why = forward_gluon_refusal(**{**args, **change})
    assert why is not None and match in why, why
    assert forward_gluon_refusal(**args) is None


@pytest.mark.parametrize("entry,want", [
    (("triton.experimental.gluon.language", "no_such_builtin"), "triton.experimental.gluon.language.no_such_builtin"),
    (("triton.experimental.no_such_module", "anything"), "triton.experimental.no_such_module"),  # a module
    (("triton.experimental.gluon.language._core", "shared_memory_descriptor.no_such_method"),  # a method
     "triton.experimental.gluon.language._core.shared_memory_descriptor.no_such_method"),
    # two spellings, neither here; then one of them here (a renamed builtin: either name will do)
    (("triton.experimental.gluon.language", "no_such|nor_this"), "triton.experimental.gluon.language.no_such|nor_this"),
    (("triton.experimental.gluon.language", "no_such|warp_specialize"), None),
])
def test_gluon_api_missing_names_what_this_triton_lacks(entry, want, monkeypatch):
    """The Gluon kernels call Gluon's API by name, as Triton 3.6 or 3.9 spells it (kernels/gluon_api.py binds
    the renamed ones): the first entry this Triton lacks is reported, so that "auto" runs the Triton kernels and
    a named Gluon kernel raises instead of failing to compile."""
    from kittenmoe import launch_common as lc

    monkeypatch.setattr(lc, "GLUON_API", (entry,))
    assert lc.gluon_api_missing() == want


def test_gluon_refused_under_the_interpreter():
    """The CPU path (the interpreter) cannot run Gluon: the launch says so instead of running something else."""
    with pytest.raises(NotImplementedError, match="forward_kernel='gluon'.*interpreter"):
        megakernel_forward_multirank(*_small_forward_args(), config=GLUON)


@pytest.fixture
def cuda_cleanup():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# (shape, tokens, routing, shared expert): each case names the edge it covers
GPU_CASES = {
    # a seed slice (Kimi: E_local 48, H 7168, I 2048, K 8), shared expert, uniform routing
    "kimi-slice": (SEED_SHAPES["kimi-k2.7"].with_(e=48), 2048, "uniform", True),
    # DeepSeek's SwiGLU clamp (7.0) and I = 3072 (24 gate|up column tiles)
    "deepseek-slice": (SEED_SHAPES["deepseek-v4-pro"].with_(e=48), 2048, "uniform", True),
    # fine-grained experts (I = 512: 8 K steps a down tile), no shared expert, T not a multiple of 128
    "fine-no-shared": (ModelShape("fine", e=64, h=2048, i=512, k=8), 3000, "uniform", False),
    # skewed routing: empty experts and long ones, several minibatches, shared tail rows (T % 128 != 0)
    "zipf-ragged": (ModelShape("zipf", e=32, h=1024, i=256, k=4), 1500, "zipf", True),
}


@functools.cache
def _case_inputs(case: str):
    """A case's launch arguments on the GPU and its fp32 reference output, made once a session: the slices' fp32
    weights (1.4-2.1 G values) take seconds to draw on the CPU, and every form and keep of the case shares them."""
    sh, t, routing, shared = GPU_CASES[case]
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    w = make_weights(sh, dtype=torch.float32, generator=g, shared=shared)
    w13, w2 = w.w13_E2IH.to(dev, torch.bfloat16), w.w2_EHI.to(dev, torch.bfloat16)
    sw13 = w.shared_w13_2SH.to(dev, torch.bfloat16) if shared else None
    sw2 = w.shared_w2_HS.to(dev, torch.bfloat16) if shared else None
    x = torch.randn(t, sh.h, generator=g).to(dev, torch.bfloat16)
    gen = routing_uniform if routing == "uniform" else routing_zipf
    ids, wts = gen(t, sh.e, sh.k, generator=g, device=dev)
    args = ([x], [ids], [wts.float()], w13, w2, sw13, sw2, sh.swiglu_limit)
    ref = moe_reference(x, ids, wts.float(), w13, w2, sw13, sw2, sh.swiglu_limit, compute_dtype=torch.float32)
    return args, ref


@functools.cache
def _triton_forward(case: str, keep: bool):
    """The Triton megakernel's run of the case (the bits every Gluon form must give), once a session; the first
    caller runs it under ``nan_scratch``."""
    tri = megakernel_forward_multirank(*_case_inputs(case)[0], config=ONE_RANK, save_for_backward=keep)
    tri.check_errors()
    return tri


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward needs a Hopper GPU")
@pytest.mark.parametrize("config", [
    GLUON,  # every program pulls its share of the routed rows first, a 1-warp TMA producer, 3 stages
    GATHER,  # the producer gathers each tile's rows from x (4 warps, cp.async), 4 stages and one store buffer
    GATHER.with_(num_stages=3),  # two store buffers a group
    GATHER.with_(num_stages=2),  # the gathering form's shallowest ring: every stage's rows tracked in flight
    AUTO,  # "auto" on Hopper: the gathering form (resolve_forward_kernel asserted below)
], ids=["pull", "gather", "gather-3-stages", "gather-2-stages", "auto"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not-kept"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_gluon_forward_matches_triton_bits(case, keep, config, cuda_cleanup, monkeypatch):
    """The output, and with kept activations the fp32 gate|up and routed x rows, equal the Triton megakernel's bit
    for bit; the output is within the bf16 tolerance of the fp32 reference; two Gluon runs give the same bits.
    Scratch starts NaN (``nan_scratch``), so a row the kernel leaves unwritten shows."""
    args, ref = _case_inputs(case)
    shared = GPU_CASES[case][3]
    if config is AUTO:
        sh = GPU_CASES[case][0]
        assert resolve_forward_kernel(AUTO, torch.device("cuda"), torch.bfloat16, 1, sh.h, sh.i,
                                      sh.shared_width if shared else 0, True, None, mk.PH_ALL) == "gluon-gather"
    nan_scratch(monkeypatch)
    tri = _triton_forward(case, keep)
    runs = []
    for _ in range(2):
        glu = megakernel_forward_multirank(*args, config=config, save_for_backward=keep)
        glu.check_errors()
        runs.append(glu)
    err = rel_l1(runs[0].outputs[0], ref)
    assert err <= tolerance_for("bf16").rel_l1, f"{case}: relative L1 {err:.3e}"
    assert_bitwise_equal(runs[0].outputs[0], tri.outputs[0], f"{case}: out, Gluon vs Triton")
    assert_bitwise_equal(runs[1].outputs[0], runs[0].outputs[0], f"{case}: out, Gluon run to run")
    if keep:
        n = int(tri.states[0].schedule.num_rows.item())
        for name in ("x_routed", "gate_up"):
            assert_bitwise_equal(getattr(runs[0].states[0], name)[:n], getattr(tri.states[0], name)[:n],
                                 f"{case}: {name}")
        if shared:
            assert_bitwise_equal(runs[0].states[0].shared_gate_up, tri.states[0].shared_gate_up,
                                 f"{case}: shared_gate_up")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward needs a Hopper GPU")
# both forms (the pull first, the gathering producer), each on the shared expert's tiles and skewed routing
@pytest.mark.parametrize("config", [GLUON, GATHER], ids=["pull", "gather"])
def test_gpu_gluon_forward_trace_counts_every_role_and_changes_no_bit(config, cuda_cleanup):
    """A traced Gluon forward (``trace=True``, ``kittenmoe.trace.KINDS``): one event a routed gate|up and down
    tile with an expert and a shared tile, one "epilogue" each, a "counter wait" before every tile that polls a
    counter (down and shared down tiles; gate|up tiles too in the pull form), a "pull" per program and live
    minibatch in the pull form; every event's times ordered; the output and kept rows equal the untraced run's."""
    from kittenmoe.trace import KINDS, events

    case = "zipf-ragged"
    args, _ = _case_inputs(case)
    sh = GPU_CASES[case][0]
    plain = megakernel_forward_multirank(*args, config=config, save_for_backward=True)
    traced = megakernel_forward_multirank(*args, config=config, save_for_backward=True, trace=True)
    traced.check_errors()
    assert_bitwise_equal(traced.outputs[0], plain.outputs[0], "out, traced vs untraced")
    # the kept rows the backward reads: those below num_rows (the capacity rows past it hold whatever the buffer did)
    n = int(plain.states[0].schedule.num_rows.item())
    assert_bitwise_equal(traced.states[0].gate_up[:n], plain.states[0].gate_up[:n], "gate_up, traced vs untraced")
    assert plain.states[0].trace is None
    st = traced.states[0]
    rows = int(st.schedule.num_rows.item())
    tiles = int((st.schedule.tile_expert[:-(-rows // 128)] >= 0).sum())  # routed row tiles with an expert
    t = args[0][0].shape[0]
    n_gu, n_dn = tiles * (sh.i // 128), tiles * (sh.h // 256)
    n_sgu, n_sdn = -(-t // 128) * (sh.shared_width // 128), -(-t // 128) * (sh.h // 256)
    pull = config.forward_kernel == "gluon"
    live = len(st.ring.live_minibatches(rows))
    want = {"gate|up": n_gu, "down": n_dn, "shared gate|up": n_sgu, "shared down": n_sdn,
            "epilogue": n_gu + n_dn + n_sgu + n_sdn, "counter wait": n_dn + n_sdn + (n_gu if pull else 0),
            "pull": live * torch.cuda.get_device_properties(0).multi_processor_count if pull else 0}
    ev = events(st.trace)
    got = {name: int((ev[:, 1] == code).sum()) for code, name in enumerate(KINDS)}
    assert got == {name: want.get(name, 0) for name in KINDS}, (got, want)
    assert bool((ev[:, 2] <= ev[:, 3]).all() and (ev[:, 3] <= ev[:, 4]).all()), "an event's times out of order"
