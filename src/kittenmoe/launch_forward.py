"""The forward launcher: check, allocate, launch. The megakernel forward over ``LocalPeers``.

``megakernel_forward_multirank`` runs the whole multi-rank forward the way docs/design.md lays it out for R virtual
ranks on one device: copy every rank's x into its peer buffer, all-gather the routing, then every rank's
megakernel (``launch_rank_forward``), then every rank's epilogue (``rank_forward_epilogue``). What the forward and
backward launchers share is in ``kittenmoe.launch_common``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass

import torch

from kittenmoe import launch_common as lc
from kittenmoe.checks import check_swiglu_limit
from kittenmoe.config import KernelConfig, check_shared_memory, routed_capacity
from kittenmoe.intmath import cdiv, next_pow2
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.launch_common import (COPY_BLOCK_H, COPY_ROWS, DEFAULT_MAX_SPIN, FP8_BLOCK, RingGeometry, Saved,
                                     check_errors, check_fp8, check_fp8_type, prepare_inputs,
                                     tma_capable, trace_buffer)
from kittenmoe.peers import LocalPeers
from kittenmoe.schedule import Schedule, build_schedule, stack_ids

if TYPE_CHECKING:
    from kittenmoe.fp8 import FP8ExpertWeights


@dataclass
class ForwardState:
    """What one rank's forward leaves behind (the backward will read it)."""

    schedule: Schedule
    ring: RingGeometry
    x_routed: torch.Tensor  # [MAC, H]
    hidden: torch.Tensor  # [MAC, I]
    y_routed: torch.Tensor  # [MAC, H]
    shared_hidden: torch.Tensor  # [T, S]
    y_shared: torch.Tensor  # [T, H]
    counters: torch.Tensor  # [4 * NMB + 1] int32
    err: torch.Tensor  # [1] int32
    # [MAC, 2I] gate|up pre-activations (x's dtype) of the rows the ring holds at the end, kept for the backward
    # (save_for_backward), else None
    gate_up: torch.Tensor | None = None
    # [T, 2S] the shared expert's gate|up pre-activations (x's dtype), kept beside them (save_for_backward with a
    # shared expert), else None
    shared_gate_up: torch.Tensor | None = None
    x_scale: torch.Tensor | None = None  # [MAC, H / B] fp32 under FP8 (x_routed then holds e4m3 bits)
    # [MAC, H] x's dtype under FP8 with save_for_backward: the routed rows unquantised, for the weight gradients
    x_kept: torch.Tensor | None = None
    hidden_scale: torch.Tensor | None = None  # [MAC, I / B] fp32 under FP8
    # [T*K] int32 with KernelConfig.combine_gather: the y_routed row of each of this (only) rank's routes, -1 for
    # routes it does not hold (out-of-range ids); the epilogue reads rows through it. Else None.
    route_row: torch.Tensor | None = None
    compiled: object = None  # the launched CompiledKernel on a GPU (registers, spills, PTX for inspection)
    # [MAXE, 5] int64 events (kind, program, start, wait returned, end; %globaltimer ns, 0 under the
    # interpreter; unused slots -1) with trace=True, else None: kittenmoe.trace reads it
    trace: torch.Tensor | None = None

    def saved(self) -> Saved | None:
        """What ``launch_rank_backward(saved=...)`` reads: (x_routed, gate_up, shared_gate_up) when this forward
        kept them (``save_for_backward``; under FP8 the rows in x's dtype, not the e4m3 ring; shared_gate_up
        None without a shared expert), else None (the backward replays)."""
        if self.gate_up is None:
            return None
        return (self.x_routed if self.x_kept is None else self.x_kept), self.gate_up, self.shared_gate_up


def _tma_ok(config: KernelConfig, dev: torch.device, dtype: torch.dtype, H: int, I: int, S: int) -> bool:
    """The forward's TMA path: TMA capable, and tile-divisible widths (a gate tile must not run into the up
    rows of the stacked [2I, H] weight)."""
    if not tma_capable(config, dev, dtype):
        return False
    bn, bn2, bk = config.block_n, 2 * config.block_n, config.block_k
    return I % bn == 0 and S % bn == 0 and H % bn2 == 0 and H % bk == 0 and I % bk == 0 and S % bk == 0


def forward_gluon_refusal(config: KernelConfig, dev: torch.device, dtype: torch.dtype, ranks: int, h: int, i: int,
                          s: int, resident: bool, fp8) -> str | None:
    """Why ``KernelConfig.forward_kernel="gluon"`` cannot run this launch (one line), or None. The Gluon forward
    (``kernels/megakernel_fwd_gluon.py``) is the one-rank default path only: one rank with ``combine_gather`` and
    no communication programs (so a resident ring), 2-byte operands through TMA, no FP8, the 128 x 128
    x 64 tile, and widths that divide into it. The device (Hopper) is checked apart."""
    if ranks != 1 or not config.combine_gather or config.num_comm_programs_fwd != 0:
        return (f"it runs one rank with combine_gather and num_comm_programs_fwd=0 (got {ranks} ranks, "
                f"combine_gather={config.combine_gather}, num_comm_programs_fwd={config.num_comm_programs_fwd})")
    if not resident:
        return "it needs a ring that holds every routed row (macrobatch_size None)"
    if fp8 is not None:
        return "it has no FP8 path"
    if dtype not in (torch.bfloat16, torch.float16) or not config.tma:
        return f"it loads 2-byte operands through TMA (got {dtype}, tma={config.tma})"
    if config.forward_kernel == "gluon-gather" and config.num_stages < 2:
        # the math groups hand a stage back one K step after reading it, once the next step's wgmmas are issued
        return f"its ring is 2-4 stages deep (num_stages={config.num_stages})"
    if (config.block_m, config.block_n, config.block_k) != (128, 128, 64):
        return (f"its tile is block_m=128, block_n=128, block_k=64 (got {config.block_m}, {config.block_n}, "
                f"{config.block_k})")
    if i % 128 or h % 256 or s % 128:
        return f"it needs I and S multiples of 128 and H of 256 (got H={h}, I={i}, S={s})"
    return None


def resolve_forward_kernel(config: KernelConfig, dev: torch.device, dtype: torch.dtype, ranks: int, h: int, i: int,
                           s: int, resident: bool, fp8, phases: int) -> str:
    """The forward kernel a launch runs: ``config.forward_kernel``, or for "auto" "gluon-gather" where this launch
    can run it (a Hopper GPU, no interpreter, Gluon's Hopper API importable, ``forward_gluon_refusal`` None and
    every role in the one launch), else "triton"."""
    if config.forward_kernel != "auto":
        return config.forward_kernel
    if not lc.gluon_runs_here(dev, "megakernel_fwd_gluon"):
        return "triton"
    if phases & ~mk.PH_PUSH != mk.PH_ALL & ~mk.PH_PUSH:
        return "triton"
    if forward_gluon_refusal(config.with_(forward_kernel="gluon-gather"), dev, dtype, ranks, h, i, s, resident,
                             fp8) is not None:
        return "triton"
    return "gluon-gather"


def launch_rank_forward(
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
    phases: int = mk.PH_ALL,
    save_for_backward: bool = False,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
) -> ForwardState:
    """Build rank ``rank``'s schedule and run its megakernel (pull, experts, push into the peers' combine).

    ``save_for_backward``: also keep the gate|up pre-activations of the rows in the ring (``state.gate_up``,
    in x's dtype) and write padding rows of ``state.x_routed`` as zeros (under FP8, whose ring holds e4m3 bits: the
    rows in x's dtype, padding zeroed, into ``state.x_kept``), for ``launch_rank_backward(saved=...)``. A
    resident ring (``macrobatch_size`` None or at least the capacity) then holds every routed row: the
    backward skips the gate|up replay and the x pull. A wrapping ring ends holding macrobatch 0 (processed
    last): the backward reads those rows' gate|up and replays the others. The shared expert's gate|up
    (``state.shared_gate_up``, every token's) is kept either way: the backward's shared phase A then runs its
    down dgrad alone.

    ``fp8``: this rank's routed experts quantised (``kittenmoe.fp8.FP8ExpertWeights``, experts matching
    ``w13_L2IH``'s): the routed GEMMs run on e4m3 operands with fp32 accumulation, x rows quantised (1 x B)
    in the pull and hidden rows in the gate|up epilogue; the shared expert stays in x's dtype.

    ``trace``: every program records what it did and when (``state.trace``; ``kittenmoe.trace.summarize``):
    a profiling build of the kernel (a timer read around each wait and tile, one small store a tile)."""
    R, T, K = ids_all_RTK.shape
    L, two_i, H = w13_L2IH.shape
    I = two_i // 2
    S = 0 if shared_w13_2SH is None else shared_w13_2SH.shape[0] // 2
    dev = w13_L2IH.device
    dtype = w13_L2IH.dtype
    bm = config.block_m
    if fp8 is not None:
        check_fp8(fp8, config, L, H, I, dev)
    if dev.type == "cuda":
        check_shared_memory(config, dtype.itemsize)
    sched = build_schedule(ids_all_RTK, rank, L, bm)
    ring = RingGeometry.make(routed_capacity(R, T, K, L, bm), config)
    row_dtype = dtype if fp8 is None else torch.uint8  # FP8: the routed rows are e4m3 bits
    fp8_down = fp8 is not None and not fp8.cfg.down_high  # else the down projection in x's dtype
    # the error flag and the ring's counters, zeroed by one fill: the flag at 0, the counters from 4 (each from a
    # 16-byte boundary, as two allocations would be: the kernels keep their pointer specialisations)
    flags = torch.zeros(4 + 4 * ring.num_minibatches + 1, dtype=torch.int32, device=dev)
    st = ForwardState(
        schedule=sched,
        ring=ring,
        x_routed=torch.empty(ring.macrobatch, H, dtype=row_dtype, device=dev),
        hidden=torch.empty(ring.macrobatch, I, dtype=row_dtype if fp8_down else dtype, device=dev),
        y_routed=torch.empty(ring.macrobatch, H, dtype=dtype, device=dev),
        shared_hidden=torch.empty(T, max(S, 1), dtype=dtype, device=dev),
        y_shared=torch.empty(T, H, dtype=dtype, device=dev),
        counters=flags[4:],
        err=flags[:1],
    )
    save_gu = save_for_backward
    if save_gu:
        # In x's dtype (bf16: half of fp32's bytes, 0.2 GB a layer at Qwen3-30B-A3B's 8192 tokens), as a bf16
        # autograd graph keeps its matmul outputs; the hidden rows are still computed from the fp32
        # accumulators. A replay rounds g and u the same way, so kept and replayed gradients agree bit for bit.
        st.gate_up = torch.empty(ring.macrobatch, 2 * I, dtype=dtype, device=dev)
        if S > 0:  # every token's, whatever the ring (17 MB on the Kimi slice)
            st.shared_gate_up = torch.empty(T, 2 * S, dtype=dtype, device=dev)
    sb = FP8_BLOCK if fp8 is None else fp8.cfg.scale_block
    if fp8 is not None:
        st.x_scale = torch.empty(ring.macrobatch, H // sb, dtype=torch.float32, device=dev)
        st.hidden_scale = torch.empty(ring.macrobatch, I // sb, dtype=torch.float32, device=dev)
        if save_gu:
            st.x_kept = torch.empty(ring.macrobatch, H, dtype=dtype, device=dev)
        w13_rows, w2_rows = fp8.w13_q.view(torch.uint8), fp8.w2_q.view(torch.uint8) if fp8_down else w2_LHI
        fp8_args = (st.x_scale, st.hidden_scale, w13_rows, w2_rows, fp8.w13_scale, fp8.w2_scale)
    else:
        w13_rows, w2_rows = w13_L2IH, w2_LHI
        fp8_args = (st.y_shared, st.y_shared, w13_L2IH, w2_LHI, st.y_shared, st.y_shared)  # scales: placeholders
    has_shared = S > 0
    sw13 = shared_w13_2SH if has_shared else w13_L2IH
    sw2 = shared_w2_HS if has_shared else w2_LHI
    kernel = resolve_forward_kernel(config, dev, dtype, R, H, I, S, ring.resident, fp8, phases)
    # The Triton kernel's TMA descriptors; a Gluon launch builds its own (_launch_gluon)
    use_tma = kernel == "triton" and _tma_ok(config, dev, dtype, H, I, S)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor as TD

        bn, bn2, bk = config.block_n, 2 * config.block_n, config.block_k
        xl_desc = TD.from_tensor(peers.buffer("x", rank), [bm, bk])
        if fp8 is None:
            routed = (TD.from_tensor(st.x_routed, [bm, bk]), TD.from_tensor(st.hidden, [bm, bk]),
                      TD.from_tensor(w13_L2IH.view(L * 2 * I, H), [bn, bk]),
                      TD.from_tensor(w2_LHI.view(L * H, I), [bn2, bk]))
        else:  # e4m3 operands, one scale block per K step
            f8 = torch.float8_e4m3fn
            hid_desc = (TD.from_tensor(st.hidden.view(f8), [bm, sb]) if fp8_down
                        else TD.from_tensor(st.hidden, [bm, bk]))
            routed = (TD.from_tensor(st.x_routed.view(f8), [bm, sb]), hid_desc,
                      TD.from_tensor(fp8.w13_q.reshape(L * 2 * I, H), [bn, sb]),
                      TD.from_tensor(fp8.w2_q.reshape(L * H, I), [bn2, sb]) if fp8_down
                      else TD.from_tensor(w2_LHI.view(L * H, I), [bn2, bk]))
        # Without a shared expert its descriptors are never loaded: stand-ins.
        descs = (
            xl_desc,
            routed[0],
            routed[1],
            TD.from_tensor(st.shared_hidden, [bm, bk]) if has_shared else xl_desc,
            routed[2],
            routed[3],
            TD.from_tensor(sw13, [bn, bk]) if has_shared else TD.from_tensor(w13_L2IH.view(L * 2 * I, H), [bn, bk]),
            TD.from_tensor(sw2, [bn2, bk]) if has_shared else TD.from_tensor(w2_LHI.view(L * H, I), [bn2, bk]),
        )
    else:
        descs = (peers.buffer("x", rank), st.x_routed, st.hidden, st.shared_hidden, w13_rows, w2_rows, sw13, sw2)
    num_comm = config.num_comm_programs_fwd
    self_pull = num_comm == 0  # KernelConfig checked combine_gather: nothing is pushed; this needs no wrap
    if self_pull and not ring.resident:
        raise ValueError(f"num_comm_programs_fwd=0 pulls every routed row before any tile runs, so the ring must "
                         f"hold them all: macrobatch_size={config.macrobatch_size} is below the worst case of "
                         f"{ring.capacity} rows (use None, or at least that many; or, for a ring, comm programs, "
                         f"e.g. num_comm_programs_fwd=12 and num_comm_programs_bwd=16, with combine_gather=False)")
    if config.combine_gather:
        if R != 1:
            raise NotImplementedError(
                f"KernelConfig.combine_gather runs one rank (the epilogue reads this rank's y_routed); got R={R} "
                f"ranks, whose routes' rows live on other ranks (a cross-rank gather is not built)")
        if not ring.resident:
            raise ValueError(f"KernelConfig.combine_gather reads every route's row from y_routed after the launch, "
                             f"so the ring must hold them all: macrobatch_size={config.macrobatch_size} is below "
                             f"the worst case of {ring.capacity} rows (use None or at least that many; or, for a "
                             f"ring, combine_gather=False with comm programs, e.g. num_comm_programs_fwd=12 and "
                             f"num_comm_programs_bwd=16)")
        phases &= ~mk.PH_PUSH  # nothing is pushed: the epilogue gathers
        st.route_row = sched.route_row  # (one rank: [T * K])
    grid = (lc.num_programs(dev, num_comm),)
    interp = lc.interpreting()
    trace_meta = {}
    if trace and config.forward_kernel == "triton":  # (a Gluon form's buffer: _launch_gluon)
        bn, lag = config.block_n, min(ring.slots - 1, 1)
        n_sh_rt = cdiv(T, bm)
        per_mb = (ring.minibatch // bm) * (cdiv(I, bn) + cdiv(H, 2 * bn))
        n_gemm = ((n_sh_rt * (cdiv(S, bn) + cdiv(H, 2 * bn)) if S > 0 else 0)
                  + (ring.num_minibatches + lag) * per_mb)  # every GEMM tile of the forward (the kernel's total)
        # processing indices < NMB + pull_ahead <= NMB + 2
        # without comm programs every program records a pull event per minibatch
        st.trace, trace_meta = trace_buffer(n_gemm, ring.num_minibatches + 2, grid[0] if self_pull else num_comm,
                                             dev)
    meta = dict(
        LAG=min(ring.slots - 1, 1), MAC=ring.macrobatch, MB=ring.minibatch, BM=bm, BN=config.block_n, BN2=2 * config.block_n,
        BK=config.block_k, TGM=config.tile_group_m, ROWS=math.gcd(COPY_ROWS, ring.minibatch), BLOCK_H=min(COPY_BLOCK_H, next_pow2(H)),
        HAS_LIMIT=swiglu_limit is not None, HAS_SHARED=has_shared,
        USE_TMA=use_tma, SAVE_GU=save_gu, FP8=fp8 is not None, SB=sb, FP8_DOWN=fp8_down,
        POW2=fp8 is not None and fp8.cfg.pow2_scales, SELF_PULL=self_pull,
        DOT_FP32=interp, PRECISION="ieee" if (interp or dtype == torch.float32) else "tf32", **trace_meta,
    )
    if not interp:
        meta.update(num_warps=config.num_warps, num_stages=config.num_stages)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0

    def launch(phase: int, p_lo: int, p_hi: int, pull_ahead: int):
        return mk.dispatch_mlp_swiglu_combine_kernel[grid](
            sched.peer_rank, sched.peer_token_idx, sched.tile_expert, sched.expert_offsets, sched.num_rows,
            sched.num_invalid,
            # combine_gather pushes nothing: x's table stands in for the combine buffers' (never dereferenced)
            peers.ptrs("x"), peers.ptrs("x" if config.combine_gather else "combine"), peers.buffer("x", rank),
            st.x_routed, st.hidden, st.y_routed, st.gate_up if save_gu else st.y_routed,
            st.y_routed if st.shared_gate_up is None else st.shared_gate_up,
            st.y_routed if st.x_kept is None else st.x_kept, fp8_args[0], fp8_args[1],
            st.shared_hidden, st.y_shared, fp8_args[2], fp8_args[3], fp8_args[4], fp8_args[5], sw13, sw2, *descs,
            st.counters, st.err, st.err if st.trace is None else st.trace,
            T, H, I, S, K, ring.num_minibatches, ring.slots, limit,
            phase, p_lo, p_hi, pull_ahead, num_comm, max_spin,
            **meta,
        )

    if kernel in ("gluon", "gluon-gather"):
        config = config.with_(forward_kernel=kernel)  # ("auto" resolved: the launch below reads the form)
        knob = f"forward_kernel={config.forward_kernel!r}"
        why = forward_gluon_refusal(config, dev, dtype, R, H, I, S, ring.resident, fp8)
        if interp:
            why = "Gluon kernels do not run under the Triton interpreter"
        if why is not None:
            raise NotImplementedError(f"KernelConfig.{knob}: {why}; set forward_kernel='triton'")
        lc.check_gluon_device(dev, knob, "forward_kernel='triton'")
        if phases & ~mk.PH_PUSH != mk.PH_ALL & ~mk.PH_PUSH:
            raise NotImplementedError(f"KernelConfig.{knob} runs every role in one launch")
        st.compiled, st.trace = _launch_gluon(st, sched, peers.buffer("x", rank), w13_L2IH, w2_LHI, sw13, sw2,
                                              has_shared, swiglu_limit, config, max_spin, T, H, I, S, K, L, trace)
        return st
    if not interp:
        # One launch, every role concurrent. Comm programs stay at most
        # pull_ahead minibatches ahead of their pushes; it must stay below the
        # slot count or a pull would wait on a push that comes after it.
        st.compiled = launch(phases, 0, ring.num_minibatches,
                             0 if config.combine_gather else min(ring.slots - 1, 2))
    else:
        # Programs run one after another: one role over one minibatch per
        # launch keeps every producer ahead of its consumers. Reading
        # num_rows on the host is free on CPU.
        if phases & mk.PH_SHARED_GU:
            launch(mk.PH_SHARED_GU, 0, 0, 0)
        for p in ring.live_minibatches(int(sched.num_rows.item())):
            for ph in (mk.PH_PULL, mk.PH_GATEUP, mk.PH_DOWN, mk.PH_PUSH):
                if phases & ph:
                    launch(ph, p, p + 1, 0)
        if phases & mk.PH_SHARED_DOWN:
            launch(mk.PH_SHARED_DOWN, 0, 0, 0)
    return st


def _launch_gluon(st: ForwardState, sched: Schedule, x_TH: torch.Tensor, w13_L2IH: torch.Tensor,
                  w2_LHI: torch.Tensor, sw13: torch.Tensor, sw2: torch.Tensor, has_shared: bool,
                  swiglu_limit: float | None, config: KernelConfig, max_spin: int, T: int, H: int, I: int, S: int,
                  K: int, L: int, trace: bool):
    """``kernels.megakernel_fwd_gluon.forward_kernel`` over ``st``'s buffers (``forward_gluon_refusal`` passed).
    Returns the compiled kernel and, with ``trace``, its events (``kittenmoe.trace.KINDS``; unused rows -1), else
    None."""
    from kittenmoe.kernels import megakernel_fwd_gluon as mkg
    from kittenmoe.kernels.gluon_api import tensor_desc as desc

    bm, bn, bk, half = (int(v.value) for v in (mkg.BM, mkg.BN, mkg.BK, mkg.HALF))

    ring = st.ring
    xl = desc(x_TH, [bm, bk])
    w13 = desc(w13_L2IH.view(L * 2 * I, H), [bn, bk])
    w2 = desc(w2_LHI.view(L * H, I), [bn, bk])
    # Without a shared expert its descriptors are never loaded: stand-ins.
    shid = desc(st.shared_hidden, [bm, bk]) if has_shared else xl
    sw13_d = desc(sw13, [bn, bk]) if has_shared else w13
    sw2_d = desc(sw2, [bn, bk]) if has_shared else w2
    save_gu = st.gate_up is not None
    gather = config.forward_kernel == "gluon-gather"
    # The gate|up tiles' stores, [half, bn] blocks; stand-ins where nothing is stored (SAVE_GU 0, no shared expert)
    hid_st = desc(st.hidden, [half, bn])
    gu_st = desc(st.gate_up, [half, bn]) if save_gu else hid_st
    shid_st = desc(st.shared_hidden, [half, bn]) if has_shared else hid_st
    sgu_st = desc(st.shared_gate_up, [half, bn]) if has_shared and st.shared_gate_up is not None else hid_st
    grid = (lc.num_programs(x_TH.device, 0),)
    events = None
    if trace:  # slots: a tile's K loop, its epilogue, the producer's poll before it, then a pull a minibatch
        n_sh_rt = cdiv(T, bm)
        total = ((n_sh_rt * (S // bn + H // (2 * bn)) if has_shared else 0)
                 + (ring.num_minibatches + min(ring.slots - 1, 1)) * (ring.minibatch // bm) * (I // bn + H // (2 * bn)))
        events = torch.full((3 * total + ring.num_minibatches * grid[0], 5), -1, dtype=torch.int64,
                            device=x_TH.device)
    compiled = mkg.forward_kernel[grid](
        sched.peer_rank, sched.peer_token_idx, sched.tile_expert, sched.expert_offsets, sched.num_rows,
        sched.num_invalid, x_TH, st.x_routed, hid_st, gu_st, shid_st, sgu_st,
        xl, desc(st.x_routed, [bm, bk]), desc(st.hidden, [bm, bk]), shid, w13, w2, sw13_d, sw2_d,
        desc(st.y_routed, [half, bn]), desc(st.y_shared, [half, bn]),
        st.counters, st.err, st.err if events is None else events,
        T, H, I, S, K, ring.num_minibatches, ring.slots, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        max_spin, int(save_gu),
        LAG=min(ring.slots - 1, 1), MAC=ring.macrobatch, MB=ring.minibatch, TGM=config.tile_group_m,
        ROWS=math.gcd(COPY_ROWS, ring.minibatch), BLOCK_H=min(COPY_BLOCK_H, next_pow2(H)),
        HAS_LIMIT=swiglu_limit is not None, HAS_SHARED=has_shared, ZERO_PADDING=save_gu,
        # gather: the ring's depth is num_stages (2-4); 4 x 48 KB leave room for one 16 KB store buffer a math
        # group. The pull form keeps its 3 stages and two buffers a group.
        **(dict(STAGES=min(config.num_stages, 4), ONE_BUF=config.num_stages >= 4, GATHER=True) if gather
           else dict(STAGES=3, ONE_BUF=False, GATHER=False)),
        TRACE=trace, num_warps=4, maxnreg=168,
    )
    return compiled, events


def launch_epilogue(y_shared_TH, combine_TKH, w_TK, ids_TK, out_TH, num_experts: int, has_shared: bool,
                    route_row_TK: torch.Tensor | None = None) -> None:
    """out = y_shared + sum_j w[t, j] * combine[t*K + j] (fp32, fixed j order). With ``route_row_TK``
    (``KernelConfig.combine_gather``) ``combine_TKH`` is y_routed and route t*K + j reads its row there."""
    T, H = out_TH.shape
    K = w_TK.shape[1]
    if T == 0:  # an EP rank that brought no tokens (it still served its experts): nothing to sum, no launch
        return
    bt, bh = 16, min(256, next_pow2(H))
    gather = route_row_TK is not None
    mk.combine_epilogue_kernel[(cdiv(T, bt), cdiv(H, bh))](
        y_shared_TH, combine_TKH, route_row_TK if gather else ids_TK, w_TK, ids_TK, out_TH, T, H, num_experts,
        K=K, HAS_SHARED=has_shared, BT=bt, BH=bh, GATHER=gather)


def rank_forward_epilogue(st: ForwardState, combine_NKH: torch.Tensor | None, w_TK: torch.Tensor,
                          ids_TK: torch.Tensor, out_TH: torch.Tensor, num_experts: int, has_shared: bool) -> None:
    """One rank's forward epilogue on its T = ``ids_TK.shape[0]`` tokens: out = y_shared + the K routed rows of
    each token. The one place that picks where those rows are, for the single-process and the per-process
    drivers: under ``KernelConfig.combine_gather`` (``st.route_row`` set; one rank, nothing pushed,
    ``combine_NKH`` may be None) they stay in ``st.y_routed``; otherwise they are in the pushed combine buffer
    ``combine_NKH``. The rank's buffers may hold N >= T token slots (``SymmetricPeers(max_tokens=N)``'s
    padding); only the first T tokens' (T*K routes') are read."""
    T, K = ids_TK.shape
    if st.route_row is not None:
        # y_routed is indexed by row, not by route: it is passed whole, route_row says which row each route reads
        launch_epilogue(st.y_shared[:T], st.y_routed, w_TK, ids_TK, out_TH, num_experts, has_shared,
                        st.route_row[:T * K])
    else:
        launch_epilogue(st.y_shared[:T], combine_NKH[:T * K], w_TK, ids_TK, out_TH, num_experts, has_shared)


@dataclass
class MultirankForward:
    outputs: list[torch.Tensor]  # [R] x [T, H]
    states: list[ForwardState]
    peers: LocalPeers

    def check_errors(self) -> None:
        for st in self.states:
            check_errors(st.err)

    def saved(self) -> list[Saved | None]:
        """Per rank, what ``megakernel_backward_multirank(saved=...)`` reads: (x_routed, gate_up,
        shared_gate_up) when this forward kept them (``save_for_backward``), else None (the backward replays)."""
        return [st.saved() for st in self.states]


def megakernel_forward_multirank(
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
    phases: int = mk.PH_ALL,
    save_for_backward: bool = False,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
) -> MultirankForward:
    """Forward of R virtual ranks on one device through the megakernel (no autograd).

    ``phases`` (a mask of ``megakernel_fwd.PH_*``, default all) runs a subset of
    the roles, for timing one phase against another. ``save_for_backward``: keep
    the routed activations for the backward (``result.saved()``; see
    ``launch_rank_forward``). ``fp8``: all E experts quantised
    (``FP8ExpertWeights.quantize(w13_E2IH, w2_EHI)``): the routed GEMMs in e4m3. ``trace``: each rank's
    ``states[r].trace`` records what every program did and when (``kittenmoe.trace``).

    Same contract as ``torch_backend.moe_forward_multirank``; outputs are in
    x's dtype. Call ``.check_errors()`` on the result to surface device-side
    errors (it reads a flag, a sync on CUDA).
    """
    config = config or KernelConfig()
    check_fp8_type(fp8)
    swiglu_limit = check_swiglu_limit(swiglu_limit)
    dims, peers = prepare_inputs(x_RTH, topk_ids_RTK, topk_weights_RTK, w13_E2IH, w2_EHI, shared_w13_2SH,
                           shared_w2_HS, peers)
    dev, dtype = w13_E2IH.device, w13_E2IH.dtype
    R, T, K, H, L = dims.r, dims.t, dims.k, dims.h, dims.experts_per_rank
    peers.stage("x", list(x_RTH), (T, H), dtype)
    # combine_gather pushes nothing: no [T*K, H] combine buffer (235 MB on the Kimi slice) is allocated. (Not a
    # smaller one either: buffers keyed by name are re-allocated whenever their shape changes, which a workspace
    # shared by layers of different configs would then do on every call.)
    # (A None per rank then: rank_forward_epilogue reads y_routed instead.)
    cb = [None] * R if config.combine_gather else peers.alloc("combine", (T * K, H), dtype)
    ids_all = stack_ids(topk_ids_RTK)  # the routing all-gather
    states = [
        launch_rank_forward(d, peers, ids_all, w13_E2IH[d * L:(d + 1) * L], w2_EHI[d * L:(d + 1) * L],
                            shared_w13_2SH, shared_w2_HS, swiglu_limit, config, max_spin, phases,
                            save_for_backward, None if fp8 is None else fp8.experts(d * L, (d + 1) * L),
                            trace=trace)
        for d in range(R)
    ]
    outs = []
    for r in range(R):
        out = torch.empty(T, H, dtype=dtype, device=dev)
        rank_forward_epilogue(states[r], cb[r], topk_weights_RTK[r].float().contiguous(), ids_all[r], out, dims.e,
                              shared_w13_2SH is not None)
        outs.append(out)
    return MultirankForward(outs, states, peers)
