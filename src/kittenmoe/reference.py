"""The plain-PyTorch MoE layer: the truth every backend and kernel is checked against.

Everything is computed in fp32 (or fp64 on request) from upcast inputs, with
loops that favour obviousness over speed. Gradients flow through autograd to
the original (possibly bf16) tensors.

Legend: T tokens, H hidden, I expert width, S shared-expert width, E experts,
K top-k, R ranks, L = E // R experts per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kittenmoe.config import ScoreFunc


def route(
    logits_TE: torch.Tensor,
    k: int,
    score_func: ScoreFunc = "softmax",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    correction_bias_E: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: scores from logits, top-k selection, weights.

    ``correction_bias_E`` (DeepSeek-V3's auxiliary-loss-free balancing) shifts
    the scores used for selection only; the weights come from the unbiased
    scores. Returns (topk_ids_TK int64, topk_weights_TK in compute_dtype).
    """
    if k > logits_TE.shape[-1]:
        raise ValueError(f"route: top-k K={k} exceeds the number of experts E={logits_TE.shape[-1]}")
    logits_TE = logits_TE.to(compute_dtype)
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    elif score_func == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
    else:
        raise ValueError(f"route: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    select_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.to(compute_dtype)
    topk_ids_TK = torch.topk(select_TE.detach(), k, dim=-1).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if renormalize:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
    return topk_ids_TK, topk_weights_TK * routed_scaling_factor


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, with DeepSeek-V4's optional clamp (gate <= L, -L <= up <= L)."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def swiglu_ffn(x_NH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor,
               swiglu_limit: float | None = None) -> torch.Tensor:
    """One SwiGLU expert; ``w13_2IH`` stacks the gate rows then the up rows."""
    i = w2_HI.shape[1]
    gu_N2I = x_NH @ w13_2IH.t()
    return swiglu(gu_N2I[:, :i], gu_N2I[:, i:], swiglu_limit) @ w2_HI.t()


def moe_reference(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out[t] = shared(x[t]) + sum_{j<K} w[t, j] * expert_{ids[t, j]}(x[t]), j in order.

    Returns [T, H] in ``compute_dtype``.
    """
    t, k = topk_ids_TK.shape
    h = x_TH.shape[1]
    x = x_TH.to(compute_dtype)
    w_TK = topk_weights_TK.to(compute_dtype)
    y_TKH = x.new_zeros(t, k, h)
    for e in range(w13_E2IH.shape[0]):
        tok, slot = (topk_ids_TK == e).nonzero(as_tuple=True)
        if tok.numel():
            y_TKH = y_TKH.index_put(
                (tok, slot),
                swiglu_ffn(x[tok], w13_E2IH[e].to(compute_dtype), w2_EHI[e].to(compute_dtype), swiglu_limit))
    if shared_w13_2SH is not None:
        out = swiglu_ffn(x, shared_w13_2SH.to(compute_dtype), shared_w2_HS.to(compute_dtype), swiglu_limit)
    else:
        out = x.new_zeros(t, h)
    for j in range(k):  # fixed order, as every backend must
        out = out + w_TK[:, j, None] * y_TKH[:, j]
    return out


def moe_reference_multirank(
    x_RTH: list[torch.Tensor],
    topk_ids_RTK: list[torch.Tensor],
    topk_weights_RTK: list[torch.Tensor],
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Every rank's outputs from every rank's inputs, under expert parallelism.

    Expert ``e`` lives on rank ``e // L``; which rank computes a route changes
    nothing mathematically, so rank r's output is the single-rank layer on its
    own tokens with the global expert weights. The shared expert is replicated
    (one tensor, so its gradient is the sum over ranks, as after DP all-reduce).
    """
    return [
        moe_reference(x, ids, w, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS, swiglu_limit, compute_dtype)
        for x, ids, w in zip(x_RTH, topk_ids_RTK, topk_weights_RTK, strict=True)
    ]


def moe_reference_fp8(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    fp8_weights,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    down_w2_EHI: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 forward's arithmetic in ``compute_dtype``: ``moe_reference`` with each routed expert reading x
    quantised to e4m3 (1 x B blocks along H, per token row) and its own e4m3 weights (``fp8_weights``, a
    ``kittenmoe.fp8.FP8ExpertWeights``), and its hidden row quantised (1 x B along I) before the down
    projection; the shared expert unquantised. What the kernel computes, up to fp32 summation order.

    ``fp8_weights.cfg.down_high`` (``FP8Config.down_high``): the down projection from ``down_w2_EHI``, the master
    weights (required then, refused otherwise), on the hidden row rounded to their dtype, as the kernel stores
    it, instead of the e4m3 product."""
    from kittenmoe.fp8 import dequantize_activations, quantize_activations

    cfg = fp8_weights.cfg
    _check_master(cfg.down_high, down_w2_EHI, "down_high", "down_w2_EHI")
    w13, w2 = (w.to(compute_dtype) for w in fp8_weights.dequantized())
    xq = dequantize_activations(*quantize_activations(x_TH.float(), cfg), cfg).to(compute_dtype)
    t, k = topk_ids_TK.shape
    h, i = x_TH.shape[1], w2.shape[2]
    y_TKH = xq.new_zeros(t, k, h)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids_TK == e).nonzero(as_tuple=True)
        if tok.numel():
            gu = xq[tok] @ w13[e].t()
            hid = swiglu(gu[:, :i], gu[:, i:], swiglu_limit)
            if down_w2_EHI is None:
                hq = dequantize_activations(*quantize_activations(hid.float(), cfg), cfg).to(compute_dtype)
                y_TKH = y_TKH.index_put((tok, slot), hq @ w2[e].t())
            else:
                hh = hid.to(down_w2_EHI.dtype).to(compute_dtype)
                y_TKH = y_TKH.index_put((tok, slot), hh @ down_w2_EHI[e].to(compute_dtype).t())
    x = x_TH.to(compute_dtype)
    if shared_w13_2SH is not None:
        out = swiglu_ffn(x, shared_w13_2SH.to(compute_dtype), shared_w2_HS.to(compute_dtype), swiglu_limit)
    else:
        out = x.new_zeros(t, h)
    w_TK = topk_weights_TK.to(compute_dtype)
    for j in range(k):
        out = out + w_TK[:, j, None] * y_TKH[:, j]
    return out


def _check_master(high: bool, master: torch.Tensor | None, flag: str, arg: str) -> None:
    """An FP8 reference's master weights: given exactly when ``FP8Config.<flag>`` reads them."""
    if high and master is None:
        raise ValueError(f"FP8Config.{flag} runs that GEMM on the master weights: pass them as {arg}")
    if not high and master is not None:
        raise ValueError(f"{arg} is read only with FP8Config.{flag}=True (the fp8 weights' cfg has it False)")


def _qdq_blocks(x: torch.Tensor, block: int, cfg) -> torch.Tensor:
    """x (fp32/fp64 [N, C], C a multiple of ``block``) quantised to e4m3 in 1 x ``block`` blocks along C by
    ``cfg``'s scale rule, then dequantised (fp32)."""
    from kittenmoe.fp8 import apply_scale, scale_from_amax

    xb = x.float().unflatten(-1, (x.shape[-1] // block, block))
    scale = scale_from_amax(xb.abs().amax(dim=-1), cfg)
    return (apply_scale(xb, scale[..., None]).float() * scale[..., None]).flatten(-2)


def moe_backward_reference_fp8(
    d_out_TH: torch.Tensor,
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    fp8_weights,
    shared_w13_2SH: torch.Tensor | None = None,
    shared_w2_HS: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    dgu_block: int = 64,
    compute_dtype: torch.dtype = torch.float64,
    dx_w13_E2IH: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Gradients of ``sum <out, d_out>`` as the FP8 megakernels compute them, in ``compute_dtype``.

    ``fp8_weights.cfg.dx_high`` (``FP8Config.dx_high``): the route's d_x row is ``d_gu W13[e]`` from
    ``dx_w13_E2IH``, the master weights (required then, refused otherwise), with d(gate|up) unquantised, instead
    of the e4m3 product below.

    The forward as ``moe_reference_fp8`` (g, u from e4m3 x and weights, kept unquantised in x's dtype: the
    backward's g and u are rounded to it). Data gradients on
    e4m3 operands: ``dh_u = q(d_out) W2[e]`` with d_out quantised 1 x B along H, and the route's d_x row
    ``q(d_gu) W13[e]`` with d(gate|up) quantised 1 x ``dgu_block`` along 2I (the backward's phase-A tile
    width). The router-weight gradient ``<dh_u, h>``; weight gradients from unquantised operands
    (``d_gu^T x``, ``(w d_out)^T h``); the shared expert unquantised. Keys: d_x, d_topk_weights, d_w13, d_w2
    and, with a shared expert, d_shared_w13, d_shared_w2."""
    from kittenmoe.fp8 import dequantize_activations, quantize_activations

    cfg = fp8_weights.cfg
    _check_master(cfg.dx_high, dx_w13_E2IH, "dx_high", "dx_w13_E2IH")
    w13, w2 = (w.to(compute_dtype) for w in fp8_weights.dequantized())
    cd = compute_dtype
    xq = dequantize_activations(*quantize_activations(x_TH.float(), cfg), cfg).to(cd)
    dq = dequantize_activations(*quantize_activations(d_out_TH.float(), cfg), cfg).to(cd)
    x, d_out = x_TH.to(cd), d_out_TH.to(cd)
    w_TK = topk_weights_TK.to(cd)
    t, k = topk_ids_TK.shape
    i = w2.shape[2]
    d_x = torch.zeros_like(x)
    d_w = torch.zeros(t, k, dtype=cd, device=x.device)
    d_w13, d_w2 = torch.zeros_like(w13), torch.zeros_like(w2)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids_TK == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        gu = (xq[tok] @ w13[e].t()).to(x_TH.dtype).to(cd)  # kept (or replayed) rounded to x's dtype
        dh_u = dq[tok] @ w2[e]
        wv = w_TK[tok, slot][:, None]
        dgu, h = _swiglu_backward(gu, wv * dh_u, swiglu_limit)
        d_w[tok, slot] = (dh_u * h).sum(1)
        if dx_w13_E2IH is None:
            d_x.index_add_(0, tok, _qdq_blocks(dgu, dgu_block, cfg).to(cd) @ w13[e])
        else:  # the d(gate|up) rows as the backward stores them, in x's dtype
            d_x.index_add_(0, tok, dgu.to(x_TH.dtype).to(cd) @ dx_w13_E2IH[e].to(cd))
        d_w13[e] = dgu.t() @ x[tok]
        d_w2[e] = (wv * d_out[tok]).t() @ h
    out = dict(d_x=d_x, d_topk_weights=d_w, d_w13=d_w13, d_w2=d_w2)
    if shared_w13_2SH is not None:  # unquantised, its gate|up kept in x's dtype too
        sw13, sw2 = shared_w13_2SH.to(cd), shared_w2_HS.to(cd)
        dgu, h = _swiglu_backward((x @ sw13.t()).to(x_TH.dtype).to(cd), d_out @ sw2, swiglu_limit)
        out.update(d_x=d_x + dgu @ sw13, d_shared_w13=dgu.t() @ x, d_shared_w2=d_out.t() @ h)
    return out


def _swiglu_backward(gu_N2I: torch.Tensor, dh_NI: torch.Tensor,
                     swiglu_limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """d(gate|up) [N, 2I] of SwiGLU at the pre-activations ``gu_N2I`` given d(hidden) ``dh_NI``, and the hidden
    [N, I]; with a clamp, no gradient where the clamp cut (gate above the limit, up outside +-limit)."""
    i = dh_NI.shape[1]
    g, u = gu_N2I[:, :i], gu_N2I[:, i:]
    gc, uc = (g, u) if swiglu_limit is None else (g.clamp(max=swiglu_limit),
                                                   u.clamp(min=-swiglu_limit, max=swiglu_limit))
    sg = torch.sigmoid(gc)
    dgc = dh_NI * uc * sg * (1 + gc * (1 - sg))
    duc = dh_NI * gc * sg
    if swiglu_limit is not None:
        dgc = torch.where(g <= swiglu_limit, dgc, 0.0)
        duc = torch.where((u >= -swiglu_limit) & (u <= swiglu_limit), duc, 0.0)
    return torch.cat([dgc, duc], dim=1), gc * sg * uc


def moe_layer_reference(
    x_TH: torch.Tensor,
    router_w_EH: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    k: int,
    score_func: ScoreFunc = "softmax",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    swiglu_limit: float | None = None,
    correction_bias_E: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The whole layer: router then experts, in ``compute_dtype``."""
    logits_TE = x_TH.to(compute_dtype) @ router_w_EH.to(compute_dtype).t()
    ids_TK, w_TK = route(logits_TE, k, score_func, renormalize, routed_scaling_factor, correction_bias_E,
                         compute_dtype)
    return moe_reference(x_TH, ids_TK, w_TK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS, swiglu_limit,
                         compute_dtype)
