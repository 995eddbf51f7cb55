"""The backward launcher: the backward megakernel, the weight-gradient launch and the epilogue over
``LocalPeers``.

``megakernel_backward_multirank`` runs the multi-rank backward for R virtual ranks on one device: copy every
rank's x, d_out and router weights into the peer buffers, then every rank's backward megakernel and its weight
gradients (``launch_rank_backward``), then every rank's epilogue (``rank_backward_epilogue``). What the forward and
backward launchers share is in ``kittenmoe.launch_common``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass

import torch
import triton

from kittenmoe import launch_common as lc
from kittenmoe.checks import check_swiglu_limit
from kittenmoe.config import KernelConfig, check_shared_memory, gluon_wgrad_gradient_ok, routed_capacity
from kittenmoe.intmath import cdiv, next_pow2
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_common import (COPY_BLOCK_H, COPY_ROWS, DEFAULT_MAX_SPIN, FP8_BLOCK, Saved, check_errors,
                                     check_fp8, check_fp8_type, fp8_dgu_block, prepare_inputs,
                                     tma_capable, trace_buffer)
from kittenmoe.peers import LocalPeers
from kittenmoe.schedule import Schedule, build_schedule, stack_ids

if TYPE_CHECKING:
    from kittenmoe.fp8 import FP8ExpertWeights


def _bwd_tma_ok(config: KernelConfig, dev: torch.device, dtype: torch.dtype, H: int, I: int, S: int) -> bool:
    """The backward's TMA path: TMA capable, and row strides (2I, H, I, 2S, S elements) that are 16-byte
    multiples; out-of-range rows and columns load as zeros."""
    if not tma_capable(config, dev, dtype):
        return False
    return all(n * dtype.itemsize % 16 == 0 for n in (H, I, max(S, 8)))


def _check_wgrad_gluon(dev: torch.device, use_tma: bool, jobs: list) -> None:
    """KernelConfig.wgrad="gluon"'s conditions, before any weight-gradient launch: a Hopper GPU (wgmma), no
    interpreter (Gluon does not run in it), the backward's TMA path, and per job (P, Q, out, N, M) 2-byte
    operands of out's dtype, N a multiple of the 128-row tile (a tile never crosses into the next expert's
    gradient), M a multiple of 8 (TMA's 16-byte rows) and a contiguous out. Each failure names itself: the knob
    is never silently replaced by the Triton kernel."""
    if lc.interpreting():
        raise NotImplementedError("KernelConfig.wgrad='gluon': Gluon kernels do not run under the Triton interpreter; "
                                  "the interpreter runs the Triton weight-gradient kernels (wgrad='persistent'), "
                                  "whose bits the Gluon kernel's GPU test holds it to")
    lc.check_gluon_device(dev)
    try:  # here, not at the launch after the megakernel: a Triton without Gluon's Hopper API is refused up front
        from kittenmoe.kernels import wgrad_gluon  # noqa: F401
    except ImportError as exc:
        raise NotImplementedError(f"KernelConfig.wgrad='gluon' needs Gluon's Hopper API (triton.experimental.gluon, "
                                  f"Triton 3.6 was timed); this Triton {triton.__version__} lacks it ({exc}): set "
                                  f"wgrad='persistent'") from exc
    if not use_tma:
        raise NotImplementedError("KernelConfig.wgrad='gluon' loads through TMA: it needs tma=True, 2-byte operands "
                                  "and 16-byte row strides (the backward's TMA path)")
    for p_op, q_op, dst, n, m in jobs:
        if not (p_op.dtype == q_op.dtype == dst.dtype and dst.element_size() == 2 and gluon_wgrad_gradient_ok(n, m)
                and dst.is_contiguous()):
            raise NotImplementedError(
                f"KernelConfig.wgrad='gluon': a weight gradient of {n} x {m} in {dst.dtype} from {p_op.dtype} x "
                f"{q_op.dtype} operands is not built (it needs one 2-byte dtype for all three, N % 128 == 0, "
                f"M % 8 == 0 and a contiguous gradient); set wgrad='persistent'")


def backward_gluon_refusal(config: KernelConfig, dev: torch.device, dtype: torch.dtype, ranks: int, h: int, i: int,
                           s: int, gu_mode: int, fp8, phases: int) -> str | None:
    """Why ``KernelConfig.backward_kernel="gluon"`` cannot run this launch (one line), or None. The Gluon backward
    (``kernels/megakernel_bwd_gluon.py``) is the one-rank default path only: one rank with ``combine_gather`` and no
    communication programs, every routed row's gate|up kept by the forward (a resident ring, ``saved``), no
    shared expert, 2-byte operands through TMA, no FP8, every phase, the 128 x 128 x 64 tile (its ring
    is 3 stages whatever ``num_stages`` says: the kernel's shared memory), and widths that divide into it. The
    device (Hopper) is checked apart."""
    from kittenmoe.kernels import megakernel_bwd as mb

    if ranks != 1 or not config.combine_gather or config.num_comm_programs_bwd != 0:
        return (f"it runs one rank with combine_gather and num_comm_programs_bwd=0 (got {ranks} ranks, "
                f"combine_gather={config.combine_gather}, num_comm_programs_bwd={config.num_comm_programs_bwd})")
    if gu_mode != 1:
        return ("it reads every routed row's gate|up as the forward kept them (a forward with "
                "keep_activations and a ring that holds every routed row, passed as saved)")
    if s:
        return f"it has no shared expert (got shared width {s})"
    if fp8 is not None:
        return "it has no FP8 path"
    if phases & ~(mb.PB_WGRAD | mb.PB_SHARED_WGRAD) != mb.PB_ALL & ~(mb.PB_WGRAD | mb.PB_SHARED_WGRAD):
        return f"it runs every phase of the megakernel (got phases={phases:#x})"
    if dtype not in (torch.bfloat16, torch.float16) or not config.tma:
        return f"it loads 2-byte operands through TMA (got {dtype}, tma={config.tma})"
    if (config.block_m, config.block_n, config.block_k) != (128, 128, 64):
        return (f"its tile is block_m=128, block_n=128, block_k=64 (got {config.block_m}, {config.block_n}, "
                f"{config.block_k})")
    if i % 128 or h % 256:
        return f"it needs I a multiple of 128 and H of 256 (got H={h}, I={i})"
    return None


def resolve_backward_kernel(config: KernelConfig, dev: torch.device, dtype: torch.dtype, ranks: int, h: int,
                            i: int, s: int, gu_mode: int, fp8, phases: int) -> str:
    """The backward kernel a launch runs: ``config.backward_kernel``, or for "auto" "gluon" where this launch can
    run it (a Hopper GPU, no interpreter, Gluon's Hopper API importable, ``backward_gluon_refusal`` None), else
    "triton"."""
    if config.backward_kernel != "auto":
        return config.backward_kernel
    if not lc.gluon_runs_here(dev, "megakernel_bwd_gluon"):
        return "triton"
    if backward_gluon_refusal(config, dev, dtype, ranks, h, i, s, gu_mode, fp8, phases) is not None:
        return "triton"
    return "gluon"


def gather_tracked(d_out_bytes: int, dev: torch.device) -> bool:
    """Whether the Gluon backward's phase-A gather has the ring's barrier track its copies (every stage in flight)
    rather than signal each step's rows one step late (two in flight). Measured both ways on an H200 with bits
    equal (docs/experiments/gluon-backward-tracked-gather.md): tracked won ~0.17 ms of the backward at
    Qwen3-30B-A3B's widths, where d_out (8,192 x 2,048 bf16, 34 MB) stays in the 50 MB L2 while its rows are
    gathered, and lost ~0.4 ms on the fine-grained problem, whose 268 MB of d_out rows come from HBM. So: tracked
    where this rank's d_out fits in the L2."""
    return d_out_bytes <= torch.cuda.get_device_properties(dev).L2_cache_size


def _launch_gluon(sched, peers: LocalPeers, rank: int, bufs: dict, gate_up: torch.Tensor, w13_L2IH: torch.Tensor,
                  w2_LHI: torch.Tensor, swiglu_limit: float | None, config: KernelConfig, max_spin: int, err,
                  NMB: int, NI: int, T: int, H: int, I: int, K: int, L: int, trace: bool):
    """``kernels.megakernel_bwd_gluon.backward_kernel`` over the backward's buffers (``backward_gluon_refusal``
    passed): d(gate|up), w h, the d_w partials, the routed d_x rows and the gathered d_out rows (``dor``, for the
    weight gradients) land where the Triton kernel puts them. Returns the compiled kernel and, with ``trace``,
    its events ([4 x its tile count, 5] int64, unused rows -1: ``kittenmoe.trace.BWD_KINDS``), else None."""
    from kittenmoe.kernels import megakernel_bwd_gluon as mbg
    from kittenmoe.kernels.gluon_api import tensor_desc as desc

    bm, bn, bk, half = (int(v.value) for v in (mbg.BM, mbg.BN, mbg.BK, mbg.HALF))

    cnt = torch.zeros(max(NMB, 1), dtype=torch.int32, device=w13_L2IH.device)  # a_ready[p]
    MB = config.minibatch_size
    total = (NMB + 1) * (MB // bm) * (I // bn + H // (2 * bn))  # the kernel's tile sequence (LAG 1)
    events = (torch.full((4 * total, 5), -1, dtype=torch.int64, device=w13_L2IH.device) if trace
              else None)  # one slot family a role: math tiles, hand-overs and stores, epilogues, a_ready polls
    compiled = mbg.backward_kernel[(lc.num_programs(w13_L2IH.device, 0),)](
        sched.peer_rank, sched.peer_token_idx, sched.tile_expert, sched.expert_offsets, sched.num_rows,
        peers.buffer("d_out", rank), peers.buffer("w", rank), gate_up, bufs["dgu"], bufs["hw"], bufs["dwp"],
        desc(bufs["dor"], [bm, bk]), desc(bufs["dgu"], [bm, bk]), desc(w13_L2IH.view(L * 2 * I, H), [bk, bn]),
        desc(w2_LHI.view(L * H, I), [bk, bn]), desc(bufs["dxr"], [half, bn]), cnt, err,
        err if events is None else events,
        H, I, K, NMB, NI, float(swiglu_limit) if swiglu_limit is not None else 0.0, max_spin,
        LAG=1, MB=MB, TGM=config.tile_group_m, HAS_LIMIT=swiglu_limit is not None,
        # 3 stages: a fourth does not fit beside the epilogue's hand-over buffers (the kernel's docstring)
        STAGES=3, TRACKED=gather_tracked(T * H * w13_L2IH.element_size(), w13_L2IH.device), TRACE=trace,
        num_warps=4, maxnreg=128,
    )
    return compiled, events


@dataclass
class MultirankBackward:
    d_x: list[torch.Tensor]  # [R] x [T, H], x's dtype
    d_topk_weights: list[torch.Tensor]  # [R] x [T, K] fp32
    d_w13: torch.Tensor  # [E, 2I, H]
    d_w2: torch.Tensor  # [E, H, I]
    d_shared_w13: torch.Tensor | None  # [2S, H], summed over ranks
    d_shared_w2: torch.Tensor | None  # [H, S]
    errs: list[torch.Tensor]
    peers: LocalPeers
    traces: list[torch.Tensor | None] | None = None  # [R] x [MAXE, 5] with trace=True (kittenmoe.trace)

    def check_errors(self) -> None:
        for e in self.errs:
            check_errors(e)


def _backward_rows(R: int, T: int, K: int, L: int, config: KernelConfig) -> int:
    """Routed rows the backward holds resident (it has no ring): the capacity in whole minibatches."""
    MB = config.minibatch_size
    return cdiv(routed_capacity(R, T, K, L, config.block_m), MB) * MB


def _check_saved(saved: Saved, NR: int, bm: int, T: int, H: int, I: int, S: int, dtype: torch.dtype,
                 dev: torch.device) -> tuple[int, int]:
    """Refuse a ``saved`` entry that is not one rank's forward ``(x_routed, gate_up, shared_gate_up)`` for this
    problem (``NR`` resident routed rows, ``T`` tokens, shared width ``S``, 0 without); return the backward's
    (GU_MODE, rows kept): (1, NR) every row kept, (2, MAC) a wrapping ring's macrobatch 0. Separate from the
    launch so that ``megakernel_backward_multirank`` checks every rank's entry before any rank launches."""
    if not isinstance(saved, tuple) or len(saved) != 3:
        n = f" of {len(saved)}" if isinstance(saved, (tuple, list)) else ""
        raise ValueError("saved must be the forward's (x_routed, gate_up, shared_gate_up) "
                         f"(ForwardState.saved()), got a {type(saved).__name__}{n}")
    mac = saved[0].shape[0] if saved[0].dim() == 2 else -1
    if not (0 < mac <= NR and mac % bm == 0):
        raise ValueError(f"saved x_routed must be the forward's [MAC, H] ring with 0 < MAC <= {NR} rows, a "
                         f"multiple of block_m={bm} (same routing and config), got {tuple(saved[0].shape)}")
    # (an FP8 forward keeps its rows in x's dtype beside the e4m3 ring its GEMMs read)
    for name, t, shape, dt in (("saved x_routed", saved[0], (mac, H), dtype),
                               ("saved gate_up", saved[1], (mac, 2 * I), dtype)):
        if tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != dt or t.device != dev:
            raise ValueError(f"{name} must be a contiguous {dt} tensor of shape {shape} on {dev} (the "
                             f"forward's, same routing and config), got {tuple(t.shape)} {t.dtype} on {t.device}")
    sgu = saved[2]
    if sgu is not None and (S == 0 or tuple(sgu.shape) != (T, 2 * S) or not sgu.is_contiguous()
                            or sgu.dtype != dtype or sgu.device != dev):
        want = (f"None or a contiguous {dtype} tensor of shape {(T, 2 * S)} on {dev}" if S > 0
                else "None without a shared expert")
        raise ValueError(f"saved shared_gate_up must be {want} (the forward's, same inputs), got "
                         f"{tuple(sgu.shape)} {sgu.dtype} on {sgu.device}")
    # Mode 1 also reads the forward's x rows for the weight gradients.
    return (1, NR) if mac == NR else (2, mac)


def launch_rank_backward(
    rank: int,
    peers: LocalPeers,
    ids_all_RTK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    swiglu_limit: float | None,
    config: KernelConfig,
    max_spin: int = DEFAULT_MAX_SPIN,
    phases: int | None = None,
    dw13_out: torch.Tensor | None = None,
    dw2_out: torch.Tensor | None = None,
    saved: Saved | None = None,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
    schedule: Schedule | None = None,
) -> dict:
    """Run rank ``rank``'s backward megakernel; its d_x rows and d_w values land in the peers' buffers.

    ``dw13_out`` / ``dw2_out`` ([L, 2I, H] / [L, H, I], contiguous): where to write this rank's expert weight
    gradients (a slice of the all-expert gradient, sparing a 4 GB concatenation on the Kimi slice).
    ``saved``: ``(x_routed, gate_up, shared_gate_up)`` of this rank's forward with the same routing and config
    (``launch_rank_forward(save_for_backward=True)``). From a resident ring (``[NR, H]``, ``[NR, 2I]`` in x's dtype)
    phase A runs the down dgrad only (no gate|up replay, 4 of its 6 FLOPs per element) and the pull skips
    x rows; from a wrapping ring (``[MAC, H]``, ``[MAC, 2I]``: macrobatch 0) the rows below MAC skip the
    replay and the others replay it. ``shared_gate_up`` (``[T, 2S]`` in x's dtype; always None without a shared
    expert): the shared phase A runs its down dgrad alone, on tiles twice as wide; None replays it.

    ``fp8``: the forward's ``FP8ExpertWeights`` (this rank's experts): the data-gradient GEMMs (down dgrad,
    gate|up dgrad) run on e4m3 operands: d_out rows quantised 1 x B in the pull, d(gate|up) 1 x
    ``fp8_dgu_block`` (min(block_n / 2, B)) in the SwiGLU backward's epilogue, the weights' B x B blocks
    (square: the transpose keeps them). The weight gradients stay in x's dtype. Rows whose gate|up the
    forward did not keep are replayed in e4m3 as the forward computed them: the pull quantises their x rows
    with the forward's rule and phase A runs the forward's gate|up tile code on them (same bits as keeping
    them). ``trace``: ``out["trace"]`` records every tile and copy (``kittenmoe.trace.BWD_KINDS``); the
    weight-gradient launch is not traced. ``schedule``: rank ``rank``'s schedule of this routing as its forward
    built it (``ForwardState.schedule``, same ``block_m``), read instead of built again (three launches)."""
    from kittenmoe.kernels import megakernel_bwd as mb

    phases = mb.PB_ALL if phases is None else phases
    R, T, K = ids_all_RTK.shape
    L, two_i, H = w13_L2IH.shape
    I = two_i // 2
    S = 0 if shared_w13_2SH is None else shared_w13_2SH.shape[0] // 2
    dev, dtype, bm = w13_L2IH.device, w13_L2IH.dtype, config.block_m
    if dev.type == "cuda":
        check_shared_memory(config, dtype.itemsize, backward=True)
    if schedule is None:
        sched = build_schedule(ids_all_RTK, rank, L, bm)
    elif ((schedule.rank, schedule.num_ranks, schedule.tokens, schedule.topk, schedule.experts_per_rank,
           schedule.block_m) != (rank, R, T, K, L, bm)):
        raise ValueError(f"schedule was built for rank {schedule.rank} of {schedule.num_ranks}, T={schedule.tokens}, "
                         f"K={schedule.topk}, L={schedule.experts_per_rank}, block_m={schedule.block_m}; this "
                         f"backward runs rank {rank} of {R}, T={T}, K={K}, L={L}, block_m={bm}")
    else:
        sched = schedule
    MB = config.minibatch_size
    NR = _backward_rows(R, T, K, L, config)
    NMB = NR // MB
    # Phase A holds three fp32 accumulators (down dgrad, gate, up): half-width
    # tiles keep them at 96 registers a thread with 8 warps, and 3 stages of
    # its five operand tiles (57 KB each) fit the 227 KB of shared memory.
    bn = max(16, config.block_n // 2)
    # Phase B (gate|up dgrad, one accumulator) takes full-width output tiles, 2 x block_n as the forward's
    # down GEMM: 128 x 256 on the defaults, twice the FLOPs per operand byte of
    # block_n-wide tiles.
    bn2 = 2 * config.block_n
    e = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt, device=dev)  # noqa: E731
    has_shared = S > 0
    Sx = max(S, 8)  # placeholder widths keep 16-byte row strides (TMA descriptors) without a shared expert
    for name, t, shape in (("dw13_out", dw13_out, (L, 2 * I, H)), ("dw2_out", dw2_out, (L, H, I))):
        if t is not None and (tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != dtype
                              or t.device != dev):
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {dev}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")
    gu_mode, gu_rows = 0, 0  # the kernel's GU_MODE: 0 replay, 1 every row kept, 2 the leading gu_rows rows
    if fp8 is not None:
        check_fp8(fp8, config, L, H, I, dev)
    if saved is not None:
        gu_mode, gu_rows = _check_saved(saved, NR, bm, T, H, I, S, dtype, dev)
    if resolve_backward_kernel(config, dev, dtype, R, H, I, S, gu_mode, fp8, phases) == "gluon":
        config = config.with_(backward_kernel="gluon")  # ("auto" resolved: the launch below reads it)
        knob = "backward_kernel='gluon'"
        if lc.interpreting():
            raise NotImplementedError(f"KernelConfig.{knob}: Gluon kernels do not run under the Triton interpreter; "
                                      f"set backward_kernel='triton'")
        why = backward_gluon_refusal(config, dev, dtype, R, H, I, S, gu_mode, fp8, phases)
        if why is not None:
            raise NotImplementedError(f"KernelConfig.{knob}: {why}; set backward_kernel='triton'")
        lc.check_gluon_device(dev, knob, "backward_kernel='triton'")
    # Routed phase A with every row kept holds one accumulator (the down dgrad; g and u are loaded), so its
    # GEMM takes tiles of 2 bn (the epilogue still works bn columns at a time): at bn its K loop over H read
    # each d_out row tile from L2 once per 64 columns of I (Kimi: 32 times) and ran at 1.8 TFLOP/s a program
    # against phase B's 5.7 (H200 trace).
    bna = 2 * bn if gu_mode == 1 and I % (2 * bn) == 0 else bn
    # The shared phase A with its gate|up kept likewise holds the down dgrad alone: tiles of 2 bn when S allows.
    shared_kept = gu_mode > 0 and saved[2] is not None
    bns = 2 * bn if shared_kept and S % (2 * bn) == 0 else bn
    NI = cdiv(I, bn)  # d_w partial columns: one per bn-wide slice of I, whatever bna
    out = dict(
        dw13=e(L, 2 * I, H) if dw13_out is None else dw13_out, dw2=e(L, H, I) if dw2_out is None else dw2_out,
        dsw13=e(2 * S, H) if has_shared else None, dsw2=e(H, S) if has_shared else None,
        # Routes with expert ids outside [0, E) were never computed: flagged as the forward does, on the device
        # (num_invalid >= 0, int32: clamped to 0 or 1, then the flag's bit; two small kernels where zeros, a
        # compare, a cast, a product and a copy were five).
        err=sched.num_invalid.clamp(max=1).mul_(mk.ERR_BAD_EXPERT_ID),
    )
    gluon_bwd = config.backward_kernel == "gluon"  # ("auto" resolved above)
    bufs = dict(
        xr=saved[0] if gu_mode == 1 else e(NR, H), dor=e(NR, H), dgu=e(NR, 2 * I),
        hw=e(NR, I), dwp=e(NR, NI, dt=torch.float32), dxr=e(NR, H), sdgu=e(T, 2 * Sx), sh=e(T, Sx), sdx=e(T, H),
        # the Triton kernel's pulled router weights, padding rows zero; the Gluon kernel reads them where they are
        # (a zero fill less a call)
        wr=e(1, dt=torch.float32) if gluon_bwd else torch.zeros(NR, dtype=torch.float32, device=dev),
    )
    sb = FP8_BLOCK if fp8 is None else fp8.cfg.scale_block
    dgb = fp8_dgu_block(config, sb)  # (a placeholder constexpr without FP8)
    # Phase B (d_x = d(gate|up) W13) on e4m3, unless FP8Config.dx_high keeps it in x's dtype
    fp8_b = fp8 is not None and not fp8.cfg.dx_high
    if fp8 is not None:
        # d_out rows and scales, d(gate|up) rows and scales (phase B on e4m3 only), and for a replay (rows the
        # forward did not keep) the x rows quantised again, as the forward's pull did
        replay_rows = NR if gu_mode != 1 else 1
        dgu_q = ((e(NR, 2 * I, dt=torch.uint8), e(NR, 2 * I // dgb, dt=torch.float32)) if fp8_b
                 else (bufs["dor"], bufs["dor"]))  # placeholders, never touched
        fp8_bufs = (e(NR, H, dt=torch.uint8), e(NR, H // sb, dt=torch.float32), *dgu_q,
                    e(replay_rows, H, dt=torch.uint8), e(replay_rows, H // sb, dt=torch.float32))
        # The data-gradient GEMMs multiply by W13 and W2 un-transposed (d_x = d(gate|up) W13, d_hidden = dO W2):
        # their K is the weights' row dimension, and e4m3 wgmma takes B only K-major from shared memory, so
        # the kernel reads transposed copies (W13^T [L, H, 2I], W2^T [L, I, H], K contiguous); the square
        # B x B scale blocks serve them unchanged. Reading W13 / W2 as they are made every K step transpose B
        # through registers (sm_90 TTGIR): FP8 forward+backward 32.4 ms vs 13.3 ms in BF16 on the Kimi slice
        # (H200). FP8ExpertWeights.quantize writes the copies as it quantises; weights built without them are
        # transposed here, each call.
        # phase B in x's dtype reads no W13^T: none is made then (w13_q stands in, never read)
        w13_qt = fp8.w13_transposed() if fp8_b else fp8.w13_q
        w2_qt = fp8.w2_transposed()
        fp8_w = (fp8.w13_q.view(torch.uint8), w13_qt.view(torch.uint8), w2_qt.view(torch.uint8), fp8.w13_scale,
                 fp8.w2_scale)
    else:
        fp8_bufs = (bufs["dor"],) * 6  # placeholders, never touched
        fp8_w = (w13_L2IH, w13_L2IH, w2_LHI, bufs["dwp"], bufs["dwp"])
    # the Triton kernel's minibatch counters (the Gluon launch zeroes its own, fewer)
    cnt = None if gluon_bwd else torch.zeros(3 * NMB + 1, dtype=torch.int32, device=dev)
    sw13 = shared_w13_2SH if has_shared else w13_L2IH
    sw2 = shared_w2_HS if has_shared else w2_LHI
    dsw13 = out["dsw13"] if has_shared else out["dw13"]
    dsw2 = out["dsw2"] if has_shared else out["dw2"]
    # Weight-gradient tiles: block_n x 2 block_n outputs, min(block_k, block_m) rows a step (Kimi: 128 x 256 x 64,
    # one fp32 accumulator of 128 registers a thread with 8 warps; 85 FLOP per operand byte against 43 for
    # 64 x 128 tiles). Routed segments start and end on block_m rows and both are powers of two, so whole row
    # steps never cross into the next expert.
    wn, wm, wk = config.block_n, 2 * config.block_n, min(config.block_k, bm)
    use_tma = _bwd_tma_ok(config, dev, dtype, H, I, S)
    # Weight-gradient operands: left ones ([rows, N], tiles block_k x wn), right ones ([rows, M], block_k x wm).
    operands = dict(dgu=bufs["dgu"], xr=bufs["xr"], dor=bufs["dor"], hw=bufs["hw"], sdgu=bufs["sdgu"],
                    xl=peers.buffer("x", rank), dol=peers.buffer("d_out", rank), sh=bufs["sh"])
    # Descriptors only for the kernels that read them: the Gluon backward and weight-gradient kernels build
    # their own and never read these ~20.
    descs = {}
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor as TD
    if use_tma and config.wgrad != "gluon":
        descs = {k: TD.from_tensor(v, [wk, wn if k in ("dgu", "dor", "sdgu", "dol") else wm])
                 for k, v in operands.items()}
    if use_tma and not gluon_bwd:
        # phase B: d(gate|up) row tiles [block_m, block_k] and weight tiles [block_k, 2 block_n]
        b_descs = (TD.from_tensor(bufs["dgu"], [bm, config.block_k]),
                   TD.from_tensor(w13_L2IH.view(L * 2 * I, H), [config.block_k, bn2]),
                   TD.from_tensor(bufs["sdgu"], [bm, config.block_k]),
                   TD.from_tensor(sw13.reshape(-1, H), [config.block_k, bn2]))
    else:
        b_descs = (bufs["dgu"], w13_L2IH, bufs["sdgu"], sw13)
    # Phase A through TMA needs gate tiles that end where the up rows start: I and S multiples of its width.
    use_tma_a = use_tma and I % bn == 0 and (S % bn == 0)
    if use_tma_a and not gluon_bwd:
        bk = config.block_k
        a_descs = (TD.from_tensor(bufs["dor"], [bm, bk]),
                   TD.from_tensor(bufs["xr"], [bm, bk]),
                   TD.from_tensor(w2_LHI.view(L * H, I), [bk, bna]),
                   TD.from_tensor(w13_L2IH.view(L * 2 * I, H), [bn, bk]),
                   TD.from_tensor(peers.buffer("d_out", rank), [bm, bk]),
                   TD.from_tensor(peers.buffer("x", rank), [bm, bk]),
                   TD.from_tensor(sw2.reshape(-1, sw2.shape[-1]), [bk, bns]),
                   TD.from_tensor(sw13.reshape(-1, H), [bn, bk]))
    else:
        a_descs = (bufs["dor"],) * 8  # placeholders, never loaded
    if fp8 is not None and use_tma and not gluon_bwd:  # the routed GEMMs' operands in e4m3 (the bf16 ones go unused)
        f8 = torch.float8_e4m3fn
        if fp8_b:
            b_descs = (TD.from_tensor(fp8_bufs[2].view(f8), [bm, dgb]),
                       TD.from_tensor(w13_qt.reshape(L * H, 2 * I), [bn2, dgb]), *b_descs[2:])
        if use_tma_a:  # d_out rows, the replay's x rows, W2^T, and W13 for the replay
            a_descs = (TD.from_tensor(fp8_bufs[0].view(f8), [bm, sb]),
                       TD.from_tensor(fp8_bufs[4].view(f8), [min(bm, fp8_bufs[4].shape[0]), sb]),
                       TD.from_tensor(w2_qt.reshape(L * I, H), [bna, sb]),
                       TD.from_tensor(fp8.w13_q.reshape(L * 2 * I, H), [bn, sb]), *a_descs[4:])
    num_comm = config.num_comm_programs_bwd
    self_pull = num_comm == 0  # KernelConfig checked combine_gather: nothing is pushed
    grid = (lc.num_programs(dev, num_comm),)
    interp = lc.interpreting()
    dot = dict(DOT_FP32=interp, PRECISION="ieee" if (interp or dtype == torch.float32) else "tf32")
    trace_meta = {}
    out["trace"] = None
    if trace and not gluon_bwd:  # (the Gluon kernel's buffer: _launch_gluon)
        n_a = cdiv(I, bna)  # routed phase-A column tiles
        per_mb = (MB // bm) * (n_a + cdiv(H, bn2))
        n_srt = cdiv(T, bm)
        n_gemm = (n_srt * (cdiv(S, bns) + cdiv(H, bn2)) if has_shared else 0) + (NMB + 1) * per_mb
        # processing indices < 2 NMB: every pull runs ahead
        n_epi = (NMB + 1) * (MB // bm) * n_a if bna != bn else 0  # one per wide phase-A tile
        out["trace"], trace_meta = trace_buffer(n_gemm, 2 * NMB + 1, grid[0] if self_pull else num_comm, dev,
                                                 n_epi)
    meta = dict(
        LAG=1, MB=MB, TGM=config.tile_group_m, BM=bm, BN=bn, BNA=bna, BN2=bn2, BK=config.block_k,
        ROWS=math.gcd(COPY_ROWS, MB), BLOCK_H=min(COPY_BLOCK_H, next_pow2(H)),
        HAS_LIMIT=swiglu_limit is not None, HAS_SHARED=has_shared, USE_TMA=use_tma, USE_TMA_A=use_tma_a,
        GU_MODE=gu_mode, FP8=fp8 is not None, FP8_B=fp8_b, SB=sb, DGB=dgb,
        SHARED_KEPT=shared_kept, BNS=bns,
        POW2=fp8 is not None and fp8.cfg.pow2_scales, SELF_PULL=self_pull, **dot, **trace_meta,
    )
    # The weight-gradient launch has the whole shared memory: num_stages stages of block_k x 3 block_n
    # operands (4 x 48 KB on the defaults).
    # (A warp-specialized K loop, tl.range(warp_specialize=True) from a 4-warp launch, computed wrong weight
    # gradients on the H200 with Triton 3.6: rel L1 9.5e-2 on the Kimi slice, NaN losses in the HF step;
    # docs/experiments/wgrad-warp-specialize.md.)
    wmeta = dict(WN=wn, WM=wm, WK=wk, USE_TMA=use_tma, **dot)
    if not interp:
        meta.update(num_warps=config.num_warps, num_stages=config.bwd_stages)
        wmeta.update(num_warps=config.num_warps, num_stages=config.num_stages)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0

    def launch(phase: int, p_lo: int, p_hi: int, pull_ahead: int):
        return mb.combine_mlp_swiglu_dispatch_bwd_kernel[grid](
            sched.peer_rank, sched.peer_token_idx, sched.tile_expert, sched.expert_offsets, sched.num_rows,
            peers.ptrs("x"), peers.ptrs("d_out"), peers.ptrs("w"),
            # combine_gather pushes nothing: d_out's and w's tables stand in (never dereferenced)
            peers.ptrs("d_out" if config.combine_gather else "dx_comb"),
            peers.ptrs("w" if config.combine_gather else "dw_comb"),
            peers.buffer("x", rank), peers.buffer("d_out", rank),
            bufs["xr"], bufs["dor"], bufs["wr"], bufs["dgu"], bufs["hw"], bufs["dwp"], bufs["dxr"],
            bufs["sdgu"], bufs["sh"], bufs["sdx"], bufs["dor"] if saved is None else saved[1],
            # (the placeholders are in x's dtype: a replay rounds g and u to the kept buffers' dtype)
            saved[2] if shared_kept else bufs["sh"], *fp8_bufs,
            w13_L2IH, w2_LHI, *fp8_w, sw13, sw2, *b_descs, *a_descs, cnt, out["err"],
            out["err"] if out["trace"] is None else out["trace"],
            T, H, I, S, K, L, NMB, limit, phase, p_lo, p_hi, pull_ahead, num_comm, max_spin, gu_rows, **meta)

    # The weight-gradient jobs, launched after the megakernel (below); listed first so that the Gluon kernel's
    # conditions are checked before the megakernel launches (the schedule's kernels have run, as for every
    # check here that needs the routed buffers).
    jobs = []  # (group order, row offsets, real rows a group, groups, P, Q, out, N, M)
    if phases & mb.PB_WGRAD:
        # The experts' tiles are taken most rows first (the schedule's expert_order, a stable sort: the same
        # order every run; the bits do not depend on it, each tile sums its rows in order whoever takes it): with
        # the kernels' snake over waves the programs end together under skewed routing, and an expert's tiles
        # run side by side while its rows are in L2. Each sums its expert's real rows rounded up to wk (the
        # kernels' _wgrad_tile_at), all from the schedule on the device: no op here.
        jobs += [(sched.expert_order, sched.expert_offsets, sched.expert_counts, L, "dgu", "xr", out["dw13"], 2 * I,
                  H),
                 (sched.expert_order, sched.expert_offsets, sched.expert_counts, L, "dor", "hw", out["dw2"], H, I)]
    if phases & mb.PB_SHARED_WGRAD and has_shared:
        # [0, T], built on the device by one kernel (capturable; an EP rank with no tokens: [0, 0])
        whole = (torch.arange(0, 2 * T, T, dtype=torch.int32, device=dev) if T
                 else torch.zeros(2, dtype=torch.int32, device=dev))
        jobs += [(whole[:1], whole, whole[1:], 1, "sdgu", "xl", dsw13, 2 * S, H),
                 (whole[:1], whole, whole[1:], 1, "dol", "sh", dsw2, H, S)]
    if config.wgrad == "gluon" and jobs:
        _check_wgrad_gluon(dev, use_tma, [(operands[p], operands[q], dst, n, m) for *_, p, q, dst, n, m in jobs])
    mk_phases = phases & ~(mb.PB_WGRAD | mb.PB_SHARED_WGRAD)
    out["route_row"] = None
    if config.combine_gather:  # nothing is pushed: the epilogue reads d_x rows and d_w partials at each route's row
        if R != 1:
            raise NotImplementedError(
                f"KernelConfig.combine_gather runs one rank (the epilogue reads this rank's routed d_x rows); got "
                f"R={R} ranks, whose routes' rows live on other ranks (a cross-rank gather is not built)")
        mk_phases &= ~mb.PB_PUSH
        out["route_row"] = sched.route_row  # (one rank: [T * K])
        out["dxr"], out["dwp"] = bufs["dxr"], bufs["dwp"]
    if gluon_bwd:  # (its conditions were checked before any launch, below the buffers)
        out["compiled"], out["trace"] = _launch_gluon(sched, peers, rank, bufs, saved[1], w13_L2IH, w2_LHI,
                                                      swiglu_limit, config, max_spin, out["err"], NMB, NI, T, H, I, K,
                                                      L, trace)
    elif not interp:
        # No ring in the backward: pulls never wait, so pull everything first
        # (compute starts on the first minibatch) and push while the last tiles run.
        out["compiled"] = launch(mk_phases, 0, NMB, NMB)
    else:
        if mk_phases & mb.PB_SHARED_A:
            launch(mb.PB_SHARED_A, 0, 0, 0)
        n_live = cdiv(int(sched.num_rows.item()), MB)
        for p in range(n_live):
            for ph in (mb.PB_PULL, mb.PB_A, mb.PB_B, mb.PB_PUSH):
                if mk_phases & ph:
                    launch(ph, p, p + 1, 0)
        if mk_phases & mb.PB_SHARED_B:
            launch(mb.PB_SHARED_B, 0, 0, 0)
    # Weight gradients: same stream, after the megakernel, so every pulled row and phase-A output exists.
    for order, offsets, counts, groups, p_name, q_name, dst, n, m in jobs:
        p_op, q_op = operands[p_name], operands[q_name]
        p_arg, q_arg = (descs[p_name], descs[q_name]) if descs else (p_op, q_op)  # (the Triton kernels')
        tiles = groups * cdiv(n, wn) * cdiv(m, wm)
        if config.wgrad == "gluon":  # the same tiles and bits from a warp-specialized Gluon kernel (checked above)
            from kittenmoe.kernels import wgrad_gluon

            out["compiled_wgrad"] = wgrad_gluon.launch(order, offsets, counts, p_op, q_op, dst, n, m, wk, wm,
                                                         lc.num_programs(dev, 0))
        elif config.wgrad == "persistent":  # one program per SM (3 under the interpreter)
            progs = lc.num_programs(dev, 0)
            # The store through shared memory and TMA, drained under the next tile's K loop: the output viewed
            # as [G * N, M] must not let a tile cross into the next group's rows (N % wn) and a 2-byte dtype (an
            # fp32 tile's 128 KB buffer does not fit beside the operands); at 3 stages (3 x 48 KB + 64 KB =
            # 213,016 B on sm_90).
            tma_store = (use_tma and n % wn == 0 and m % 8 == 0 and dst.element_size() == 2
                         and dst.is_contiguous())
            out_desc = TD.from_tensor(dst.view(-1, m), [wn, wm]) if tma_store else dst
            pmeta = dict(wmeta)
            if tma_store and not interp:
                pmeta["num_stages"] = min(config.num_stages, 3)
            out["compiled_wgrad"] = mb.weight_grad_persistent_kernel[(min(tiles, progs),)](
                order, offsets, counts, p_arg, q_arg, dst, out_desc, n, m, p_op.stride(0), q_op.stride(0), tiles,
                TMA_STORE=tma_store, **pmeta)
        else:
            out["compiled_wgrad"] = mb.weight_grad_kernel[(tiles,)](
                order, offsets, counts, p_arg, q_arg, dst, n, m, p_op.stride(0), q_op.stride(0), **wmeta)
    out["sdx"] = bufs["sdx"]
    return out


def launch_bwd_epilogue(sdx_TH, dx_comb_TKH, dw_comb_TK, ids_TK, num_experts: int, has_shared: bool,
                        route_row_TK: torch.Tensor | None = None):
    """d_x = shared d_x + the K pushed d_x rows of each token in slot order (fp32); d_w from its combine buffer.
    With ``route_row_TK`` (``KernelConfig.combine_gather``) ``dx_comb_TKH`` is the routed d_x rows [NR, H] and
    ``dw_comb_TK`` the d_w partials [NR, NI], read at each route's row. Returns (d_x [T, H] in the rows' dtype,
    d_w [T, K] fp32)."""
    from kittenmoe.kernels import megakernel_bwd as mb

    T, K = ids_TK.shape
    H = dx_comb_TKH.shape[-1]
    dx = torch.empty(T, H, dtype=dx_comb_TKH.dtype, device=dx_comb_TKH.device)
    dw = torch.empty(T, K, dtype=torch.float32, device=dx_comb_TKH.device)
    if T == 0:  # an EP rank that brought no tokens: empty gradients, no launch
        return dx, dw
    bt, bh = 16, min(256, next_pow2(H))
    gather = route_row_TK is not None
    mb.bwd_epilogue_kernel[(cdiv(T, bt), cdiv(H, bh))](
        sdx_TH, dx_comb_TKH, dw_comb_TK, route_row_TK if gather else ids_TK, ids_TK, dx, dw, T, H, num_experts,
        dw_comb_TK.shape[-1] if gather else 1, K=K, HAS_SHARED=has_shared, BT=bt, BH=bh, GATHER=gather)
    return dx, dw


def rank_backward_epilogue(launched: dict, dx_comb_NKH: torch.Tensor | None, dw_comb_NK: torch.Tensor | None,
                           ids_TK: torch.Tensor, num_experts: int, has_shared: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's backward epilogue on its T = ``ids_TK.shape[0]`` tokens, from ``launched`` (what
    ``launch_rank_backward`` returned). The one place that picks where the routed d_x rows and d_w partials are,
    as ``rank_forward_epilogue`` does for the forward: under ``KernelConfig.combine_gather``
    (``launched["route_row"]`` set; one rank, nothing pushed, the combine buffers may be None) they stay where
    the backward computed them (``dxr`` / ``dwp``); otherwise they are in the pushed ``dx_comb_NKH`` /
    ``dw_comb_NK``. Only the first T tokens' (T*K routes') are read. Returns (d_x [T, H], d_w [T, K] fp32)."""
    T, K = ids_TK.shape
    route_row = launched["route_row"]
    if route_row is not None:
        # dxr / dwp are indexed by row, not by route: passed whole, route_row says which row each route reads
        return launch_bwd_epilogue(launched["sdx"][:T], launched["dxr"], launched["dwp"], ids_TK, num_experts,
                                   has_shared, route_row[:T * K])
    return launch_bwd_epilogue(launched["sdx"][:T], dx_comb_NKH[:T * K], dw_comb_NK[:T * K], ids_TK, num_experts,
                               has_shared)


def megakernel_backward_multirank(
    d_out_RTH: list[torch.Tensor],
    x_RTH: list[torch.Tensor],
    topk_ids_RTK: list[torch.Tensor],
    topk_weights_RTK: list[torch.Tensor],
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    config: KernelConfig | None = None,
    peers: LocalPeers | None = None,
    max_spin: int = DEFAULT_MAX_SPIN,
    phases: int | None = None,
    saved: list[Saved | None] | None = None,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
    schedules: list[Schedule | None] | None = None,
) -> MultirankBackward:
    """Gradients of the multi-rank forward w.r.t. every input, through the backward megakernel.

    Recomputes (replays) the schedule, the dispatch and the gate|up GEMM, except
    for ranks whose entry of ``saved`` (``MultirankForward.saved()`` of this
    call's forward: same inputs and config, run with ``save_for_backward=True``)
    holds their routed x rows and gate|up pre-activations: those are read instead.
    ``fp8``: the forward's ``FP8ExpertWeights`` (all experts): data gradients on e4m3 operands (see
    ``launch_rank_backward``). ``phases`` (a mask of ``megakernel_bwd.PB_*``,
    default all) runs a subset of the roles, for timing one phase against
    another; a subset whose consumers lack their producers times out by design. Gradients of the shared expert are summed
    over ranks in rank order (the replicated weight's total gradient). ``trace``: ``result.traces[r]`` records
    what every program of rank r's backward megakernel did and when (``kittenmoe.trace``, ``BWD_KINDS``).
    ``schedules``: per rank, the forward's schedule (``ForwardState.schedule``) or None to build it again.
    """
    config = config or KernelConfig()
    check_fp8_type(fp8)
    swiglu_limit = check_swiglu_limit(swiglu_limit)
    dims, peers = prepare_inputs(x_RTH, topk_ids_RTK, topk_weights_RTK, w13_E2IH, w2_EHI, shared_w13_2SH,
                           shared_w2_HS, peers)
    dev, dtype = w13_E2IH.device, w13_E2IH.dtype
    R, T, K, H, L = dims.r, dims.t, dims.k, dims.h, dims.experts_per_rank
    if len(d_out_RTH) != R or any(tuple(g.shape) != (T, H) for g in d_out_RTH):
        raise ValueError(f"d_out must be {R} tensors of shape {(T, H)}")
    peers.stage("x", list(x_RTH), (T, H), dtype)
    peers.stage("d_out", list(d_out_RTH), (T, H), dtype)
    peers.stage("w", list(topk_weights_RTK), (T * K,), torch.float32)
    dx_comb, dw_comb = [None] * R, [None] * R  # under combine_gather rank_backward_epilogue reads dxr / dwp
    if not config.combine_gather:  # which pushes nothing: no d_x / d_w combine buffers (as the forward's)
        dx_comb = peers.alloc("dx_comb", (T * K, H), dtype)
        dw_comb = peers.alloc("dw_comb", (T * K,), torch.float32)
    ids_all = stack_ids(topk_ids_RTK)
    # each rank writes its experts' slice
    d_w13 = torch.empty(w13_E2IH.shape, dtype=dtype, device=dev)
    d_w2 = torch.empty(w2_EHI.shape, dtype=dtype, device=dev)
    if saved is not None and len(saved) != R:
        raise ValueError(f"saved holds {len(saved)} ranks' activations, the backward runs {R} ranks")
    saved = [None] * R if saved is None else saved
    if schedules is not None and len(schedules) != R:
        raise ValueError(f"schedules holds {len(schedules)} ranks' schedules, the backward runs {R} ranks")
    schedules = [None] * R if schedules is None else schedules
    # every rank's entry before any rank launches (launch_rank_backward checks its own again: the EP path's)
    S = 0 if shared_w13_2SH is None else shared_w13_2SH.shape[0] // 2
    NR, I = _backward_rows(R, T, K, L, config), w13_E2IH.shape[1] // 2
    for entry in saved:
        if entry is not None:
            _check_saved(entry, NR, config.block_m, T, H, I, S, dtype, dev)
    outs = [
        launch_rank_backward(d, peers, ids_all, w13_E2IH[d * L:(d + 1) * L], w2_EHI[d * L:(d + 1) * L],
                             shared_w13_2SH, shared_w2_HS, swiglu_limit, config, max_spin, phases,
                             dw13_out=d_w13[d * L:(d + 1) * L], dw2_out=d_w2[d * L:(d + 1) * L], saved=saved[d],
                             fp8=None if fp8 is None else fp8.experts(d * L, (d + 1) * L), trace=trace,
                             schedule=schedules[d])
        for d in range(R)
    ]
    has_shared = shared_w13_2SH is not None
    d_x, d_w = [], []
    for r in range(R):
        dx, dw = rank_backward_epilogue(outs[r], dx_comb[r], dw_comb[r], ids_all[r], dims.e, has_shared)
        d_x.append(dx)
        d_w.append(dw)
    d_sw13 = d_sw2 = None
    if has_shared and R == 1:
        d_sw13, d_sw2 = outs[0]["dsw13"], outs[0]["dsw2"]
    elif has_shared:
        d_sw13 = outs[0]["dsw13"].float()
        d_sw2 = outs[0]["dsw2"].float()
        for o in outs[1:]:
            d_sw13 = d_sw13 + o["dsw13"].float()
            d_sw2 = d_sw2 + o["dsw2"].float()
        d_sw13, d_sw2 = d_sw13.to(dtype), d_sw2.to(dtype)
    return MultirankBackward(
        d_x=d_x, d_topk_weights=d_w,
        d_w13=d_w13, d_w2=d_w2,
        d_shared_w13=d_sw13, d_shared_w2=d_sw2, errs=[o["err"] for o in outs], peers=peers,
        traces=[o["trace"] for o in outs] if trace else None)
