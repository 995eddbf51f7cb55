"""Expert parallelism across processes: the megakernels driven through ``SymmetricPeers``.

One process per rank; each holds its own tokens and its ``L = E / R`` experts. The kernels are the ones the
single-process model runs with ``LocalPeers`` (``launch_forward.launch_rank_forward`` / ``launch_rank_backward``); only
the peer-pointer tables differ, so the outputs and gradients equal a ``LocalPeers`` run bit for bit.

Per forward, on the current stream, with no host synchronisation:

1. write this rank's x and routing into its symmetric buffers;
2. ``barrier()`` (device side): every rank's x and routing are visible;
3. the routing all-gather: one small kernel pulls every rank's ``[T, K]`` ids through the pointer table;
4. the megakernel: pull rows from the owners' x, experts, push rows into the origins' combine buffers;
5. ``barrier()``: every push into this rank's combine buffer has landed (and no rank still reads x);
6. the fp32 epilogue on this rank's combine buffer.

The backward does the same with x, d_out and the router weights, then launches its weight-gradient kernels
(local work) and its epilogue. Expert gradients are this rank's experts'; the shared expert's are this
rank's tokens' contribution (the replicated weight's gradient is their sum over ranks, which data-parallel
reduction provides: ``LocalPeers`` runs sum them in rank order).

Every rank brings the same T, or, with ``SymmetricPeers(max_tokens=N)``, any T <= N: the token buffers then
hold N rows everywhere and a rank's rows past its T are padding (zero x and d_out, routing ``NO_ROUTE``, never
dispatched; the shared expert's tiles still cover them). The first call with a shape allocates the symmetric
buffers collectively, and ``SymmetricPeers.alloc`` raises on every rank when ranks disagree. The problem
itself (T or N, H, I, K, experts per rank, shared width, ``swiglu_limit``, dtype) is compared across ranks by
``SymmetricPeers.agree`` (a host collective on the first call with a new combination only). With padding the
outputs are not bitwise those of a ``LocalPeers`` run of the same tokens (the padding rows shift the row
blocks of the weight-gradient sums), only equal within rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kittenmoe import launch_backward, launch_common, launch_forward
from kittenmoe.autoconfig import auto_config
from kittenmoe.checks import check_megakernel_dtype, check_moe_inputs, check_swiglu_limit
from kittenmoe.config import KernelConfig
from kittenmoe.fp8 import FP8Config, FP8ExpertWeights, check_fp8_option, resolve_expert_weights
from kittenmoe.functional import contiguous_activations, no_tokens_output
from kittenmoe.intmath import cdiv
from kittenmoe.peers import SymmetricPeers
from kittenmoe.schedule import NO_ROUTE, ids_int32


@triton.jit
def _gather_peers_kernel(
    ptrs_ptr,  # [R] int64 -> a [N] int32 buffer on every rank
    out_ptr,  # [R, N] int32
    N,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(ptrs_ptr + r).to(tl.pointer_type(tl.int32))
    m = offs < N
    tl.store(out_ptr + r.to(tl.int64) * N + offs, tl.load(src + offs, mask=m, volatile=True), mask=m)


def all_gather_routing(peers: SymmetricPeers) -> torch.Tensor:
    """``[R, T, K]`` int32: every rank's routing, read from the symmetric ``"ids"`` buffers (call after a
    barrier that follows the writes)."""
    mine = peers.buffer("ids", peers.rank)
    T, K = mine.shape
    out = torch.empty(peers.num_ranks, T, K, dtype=torch.int32, device=peers.device)
    block = 1024
    _gather_peers_kernel[(peers.num_ranks, cdiv(T * K, block))](peers.ptrs("ids"), out, T * K, BLOCK=block)
    return out


def _check(peers, x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS, swiglu_limit,
           config, allow_empty: bool = False):
    check_swiglu_limit(swiglu_limit)
    if not isinstance(peers, SymmetricPeers):
        raise TypeError(f"peers must be a kittenmoe.SymmetricPeers (one process per rank), got "
                        f"{type(peers).__name__}; for R virtual ranks in one process use "
                        f"launch_forward.megakernel_forward_multirank with LocalPeers")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a kittenmoe.KernelConfig or None, got {type(config).__name__}")
    # Shapes and dtypes as one rank holding its L experts (ids are global; out-of-range ones are counted on
    # the device against E = R * L and raised by check_errors).
    dims = check_moe_inputs([x_TH], [topk_ids_TK], [topk_weights_TK], w13_L2IH, w2_LHI, shared_w13_2SH,
                            shared_w2_HS, expert_parallel=peers.num_ranks,
                            allow_empty=allow_empty or peers.max_tokens is not None)
    check_megakernel_dtype(w13_L2IH.dtype, "kittenmoe.moe_ep")
    if w13_L2IH.device != peers.device:
        raise ValueError(f"weights on {w13_L2IH.device}, peers on {peers.device}")
    if peers.max_tokens is not None and dims.t > peers.max_tokens:
        raise ValueError(f"this rank brings T={dims.t} tokens, more than SymmetricPeers(max_tokens="
                         f"{peers.max_tokens})")
    # What every rank must share; a mismatch raises on every rank (one host collective per new combination).
    # With max_tokens, T may differ between ranks: the token buffers' height (max_tokens) is what must agree.
    peers.agree("the EP problem (T or max_tokens, H, I, K, experts per rank, shared width, swiglu_limit, dtype)",
                (token_slots(peers, dims.t), dims.h, dims.i, dims.k, dims.e, dims.s, swiglu_limit,
                 str(w13_L2IH.dtype)))
    return dims


def token_slots(peers: SymmetricPeers, t: int) -> int:
    """Token rows of the symmetric buffers: max_tokens when set (ranks' T may differ), else T."""
    return t if peers.max_tokens is None else peers.max_tokens


def _put_tokens(buf: torch.Tensor, rows: torch.Tensor, t: int, pad) -> None:
    """buf[:t] = rows, buf[t:] = pad (this rank's padding tokens, when its T is below max_tokens)."""
    buf[:t].copy_(rows)
    if buf.shape[0] > t:
        buf[t:].fill_(pad)


@dataclass
class EPForward:
    output: torch.Tensor  # [T, H]
    state: launch_forward.ForwardState

    def check_errors(self) -> None:
        launch_common.check_errors(self.state.err)

    def saved(self) -> launch_common.Saved | None:
        """(x_routed, gate_up, shared_gate_up) when the forward kept them (``save_for_backward``), else None."""
        return self.state.saved()


def megakernel_forward_ep(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    swiglu_limit: float | None,
    peers: SymmetricPeers,
    config: KernelConfig | None = None,
    max_spin: int = launch_common.DEFAULT_MAX_SPIN,
    save_for_backward: bool = False,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
) -> EPForward:
    """This rank's MoE forward under expert parallelism (collective: every rank of ``peers`` calls it).

    ``topk_ids_TK`` holds global expert ids in ``[0, R * L)``; rank r owns experts ``[r * L, (r + 1) * L)``,
    whose weights are ``w13_L2IH`` / ``w2_LHI`` here. ``save_for_backward``: keep the routed x rows and the routed and
    shared gate|up pre-activations (``result.saved()``) for ``megakernel_backward_ep(saved=...)``, as
    ``launch_forward.launch_rank_forward`` does. ``fp8``: this rank's experts in e4m3 (``FP8ExpertWeights``). ``trace``:
    ``result.state.trace`` records what this rank's programs did and when (``kittenmoe.trace``)."""
    config = config or KernelConfig()
    dims = _check(peers, x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                  swiglu_limit, config)
    R, rank = peers.num_ranks, peers.rank
    T, H, K, L = dims.t, dims.h, dims.k, dims.e
    N = token_slots(peers, T)
    dtype = w13_L2IH.dtype
    _put_tokens(peers.alloc("x", (N, H), dtype)[rank], x_TH, T, 0.0)
    _put_tokens(peers.alloc("ids", (N, K), torch.int32)[rank], ids_int32(topk_ids_TK), T, NO_ROUTE)
    combine = peers.alloc("combine", (N * K, H), dtype)[rank]
    peers.barrier()
    ids_all = all_gather_routing(peers)
    st = launch_forward.launch_rank_forward(rank, peers, ids_all, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                                 swiglu_limit, config, max_spin, save_for_backward=save_for_backward, fp8=fp8,
                                 trace=trace)
    peers.barrier()
    out = torch.empty(T, H, dtype=dtype, device=peers.device)
    launch_forward.rank_forward_epilogue(st, combine, topk_weights_TK.float().contiguous(), ids_all[rank][:T], out, R * L,
                              shared_w13_2SH is not None)
    return EPForward(out, st)


@dataclass
class EPBackward:
    d_x: torch.Tensor  # [T, H]
    d_topk_weights: torch.Tensor  # [T, K] fp32
    d_w13: torch.Tensor  # [L, 2I, H], this rank's experts
    d_w2: torch.Tensor  # [L, H, I]
    d_shared_w13: torch.Tensor | None  # [2S, H], this rank's tokens' contribution
    d_shared_w2: torch.Tensor | None  # [H, S]
    err: torch.Tensor
    trace: torch.Tensor | None = None  # [MAXE, 5] with trace=True (kittenmoe.trace, BWD_KINDS)

    def check_errors(self) -> None:
        launch_common.check_errors(self.err)


def megakernel_backward_ep(
    d_out_TH: torch.Tensor,
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    swiglu_limit: float | None,
    peers: SymmetricPeers,
    config: KernelConfig | None = None,
    max_spin: int = launch_common.DEFAULT_MAX_SPIN,
    saved: launch_common.Saved | None = None,
    fp8: FP8ExpertWeights | None = None,
    trace: bool = False,
) -> EPBackward:
    """This rank's gradients under expert parallelism (collective). Replays the dispatch and gate|up GEMM as
    the single-process backward does, unless ``saved`` (this call's ``EPForward.saved()``) holds the forward's
    routed x rows and gate|up pre-activations (and the shared expert's). ``fp8``: the forward's
    ``FP8ExpertWeights`` (data gradients in e4m3, as ``launch_backward.launch_rank_backward``)."""
    config = config or KernelConfig()
    dims = _check(peers, x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                  swiglu_limit, config)
    R, rank = peers.num_ranks, peers.rank
    T, H, K, L = dims.t, dims.h, dims.k, dims.e
    dtype = w13_L2IH.dtype
    if tuple(d_out_TH.shape) != (T, H):
        raise ValueError(f"d_out must be [T, H] = {(T, H)}, got {tuple(d_out_TH.shape)}")
    N = token_slots(peers, T)
    # Padding tokens: zero x and d_out rows (the shared expert's backward sums them), no routes.
    _put_tokens(peers.alloc("x", (N, H), dtype)[rank], x_TH, T, 0.0)
    _put_tokens(peers.alloc("d_out", (N, H), dtype)[rank], d_out_TH, T, 0.0)
    _put_tokens(peers.alloc("w", (N * K,), torch.float32)[rank], topk_weights_TK.reshape(-1), T * K, 0.0)
    _put_tokens(peers.alloc("ids", (N, K), torch.int32)[rank], ids_int32(topk_ids_TK), T, NO_ROUTE)
    dx_comb = peers.alloc("dx_comb", (N * K, H), dtype)[rank]
    dw_comb = peers.alloc("dw_comb", (N * K,), torch.float32)[rank]
    peers.barrier()
    ids_all = all_gather_routing(peers)
    out = launch_backward.launch_rank_backward(rank, peers, ids_all, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                                   swiglu_limit, config, max_spin, saved=saved, fp8=fp8, trace=trace)
    peers.barrier()
    has_shared = shared_w13_2SH is not None
    dx, dw = launch_backward.rank_backward_epilogue(out, dx_comb, dw_comb, ids_all[rank][:T], R * L, has_shared)
    return EPBackward(dx, dw, out["dw13"], out["dw2"], out["dsw13"], out["dsw2"], out["err"], out["trace"])


# ----------------------------------------------------------------------------- autograd


class _MoEEP(torch.autograd.Function):
    """Forward and backward megakernels across processes. Both passes are collective: every rank of the
    group runs them in the same order (as data-parallel training does)."""

    @staticmethod
    def forward(ctx, x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                swiglu_limit, peers, config, fp8):
        from kittenmoe.autograd import report_device_errors

        keep = config.keep_activations and any(ctx.needs_input_grad)
        res = megakernel_forward_ep(x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI,
                                    shared_w13_2SH, shared_w2_HS, swiglu_limit, peers, config,
                                    save_for_backward=keep, fp8=fp8)
        report_device_errors(x_TH.device, [res.state.err])
        kept = res.saved() or (None, None, None)
        ctx.save_for_backward(x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                              *kept)
        ctx.swiglu_limit, ctx.peers, ctx.config, ctx.fp8 = swiglu_limit, peers, config, fp8
        return res.output

    @staticmethod
    def backward(ctx, d_out_TH):
        from kittenmoe.autograd import refuse_double_backward

        return refuse_double_backward("kittenmoe.moe_ep", _MoEEP._gradients, ctx, d_out_TH)

    @staticmethod
    def _gradients(ctx, d_out_TH):
        from kittenmoe.autograd import report_device_errors

        (x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS, x_routed,
         gate_up, shared_gate_up) = ctx.saved_tensors
        g = megakernel_backward_ep(d_out_TH.contiguous(), x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH,
                                   w2_LHI, shared_w13_2SH, shared_w2_HS, ctx.swiglu_limit, ctx.peers, ctx.config,
                                   saved=None if gate_up is None else (x_routed, gate_up, shared_gate_up),
                                   fp8=ctx.fp8)
        report_device_errors(x_TH.device, [g.err])
        return (g.d_x, None, g.d_topk_weights.to(topk_weights_TK.dtype), g.d_w13, g.d_w2, g.d_shared_w13,
                g.d_shared_w2, None, None, None, None)


def moe_ep(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    swiglu_limit: float | None,
    peers: SymmetricPeers,
    config: KernelConfig | None = None,
    fp8: FP8Config | FP8ExpertWeights | None = None,
) -> torch.Tensor:
    """Differentiable MoE under expert parallelism (collective, forward and backward): ``kittenmoe.moe`` for
    one rank that holds experts ``[rank * L, (rank + 1) * L)``. Gradients: this rank's tokens (d_x, router
    weights), this rank's experts, and this rank's tokens' share of the shared expert's. ``fp8``: as
    ``kittenmoe.moe``'s (an ``FP8Config`` quantises this rank's experts now). ``config`` None: the tuned or
    heuristic config for the rows every routed buffer is sized by (``max_tokens`` a rank when set), as
    ``kittenmoe.moe`` picks one (``kittenmoe.autoconfig``).

    ``T = 0``: with ``SymmetricPeers(max_tokens=N)`` a rank may bring no tokens while others bring some; it
    still serves its experts to the others (collective), returns ``[0, H]``, and gets zero token gradients and
    its experts' gradients from the other ranks' rows. Without ``max_tokens`` every rank brings the same T
    (checked collectively), so T = 0 on one means T = 0 on all: ``[0, H]`` and zero gradients everywhere."""
    check_fp8_option(fp8)
    x_TH, topk_ids_TK, topk_weights_TK = contiguous_activations(x_TH, topk_ids_TK, topk_weights_TK)
    # the launches check again; the dims are needed here for T = 0 and the config (the collective part of the
    # check runs once per new problem: SymmetricPeers.agree remembers what the ranks agreed on)
    dims = _check(peers, x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                  swiglu_limit, config, allow_empty=True)
    if dims.t == 0 and peers.max_tokens is None:  # every rank agreed on T = 0 in _check
        return no_tokens_output(x_TH, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS)
    if config is None:
        config = auto_config(token_slots(peers, dims.t), dims.h, dims.i, dims.e * peers.num_ranks, dims.k, dims.s,
                             peers.num_ranks, x_TH.device, x_TH.dtype, fp8)
    fp8 = resolve_expert_weights(fp8, w13_L2IH, w2_LHI)
    return _MoEEP.apply(x_TH, topk_ids_TK, topk_weights_TK, w13_L2IH, w2_LHI, shared_w13_2SH, shared_w2_HS,
                        swiglu_limit, peers, config, fp8)
