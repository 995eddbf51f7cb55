"""SonicMoE as a baseline: its routed experts for given routing, timed beside kittenmoe in ``kittenmoe bench``.

SonicMoE (pip ``sonic-moe``; CuTe DSL kernels, GEMMs from ``quack-kernels``; Hopper and Blackwell, bf16) is a
single-GPU MoE training kernel. Its public entry for routing computed elsewhere is
``sonicmoe.functional.moe_general_routing_inputs``; ``sonicmoe_forward`` calls it with our routing and weights.
Written against sonic-moe 0.1.2.post1 (``scripts/sonicmoe_wheels.sh`` pins it and its dependencies).

What it computes: ``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` with SwiGLU experts, the routed part
only. SonicMoE has no shared expert, so its output is compared against the routed-only reference, and its time
against kittenmoe's on the same work only when kittenmoe also runs without one (``kittenmoe bench --no-shared``).
It has no SwiGLU clamp either (``swiglu_limit`` must be None).

Layouts, read from sonic-moe 0.1.2.post1's ``sonicmoe/functional/__init__.py`` and ``sonicmoe/moe.py``:

- ``w1``: shape ``[2I, H, E]`` with stride order (2, 0, 1), i.e. an ``[E, 2I, H]`` contiguous tensor permuted
  ``(1, 2, 0)`` (its ``MoE`` module passes ``c_fc.weight.permute(1, 2, 0)``). Its 2I rows interleave gate and
  up: row ``2j`` is gate row ``j``, row ``2j + 1`` is up row ``j`` (``concat_layout=False``, the default, the
  layout of its ``MoE`` module and its benchmarks; the activation is ``silu(gate) * up``).
- ``w2``: shape ``[H, I, E]`` with the same stride order: our ``w2_EHI`` permuted ``(1, 2, 0)``, no copy.

Ours: ``w13_E2IH`` ``[E, 2I, H]`` holds the I gate rows, then the I up rows. ``sonicmoe_prepare`` interleaves
them once (one copy, outside any timed call): ``w13.view(E, 2, I, H).transpose(1, 2).reshape(E, 2I, H)``;
``deinterleave_gate_up`` is its inverse, for comparing a gradient of the interleaved tensor with ours.

Routing: ``moe_general_routing_inputs`` takes flat routes with their token indices sorted ascending; ours are
``[T, K]`` per token, so the routes in row-major order are already sorted by token: ``token_indices = t`` for
``K`` consecutive routes, ``expert_indices = topk_ids.reshape(-1)`` (int32), ``router_scores =
topk_weights.reshape(-1)`` (fp32). These conversions run inside each call, as they would in a user's layer.

Differentiable: gradients flow to ``x``, the router weights and both (prepared) weight tensors through
SonicMoE's own autograd functions. A call whose inputs need no gradient (or under ``torch.no_grad``) runs
SonicMoE's inference mode, which keeps no pre-activations, as kittenmoe's forward does then.

``sonicmoe`` is imported lazily; without it (or when its CUDA libraries cannot load) the import raises
ImportError with the install hint (``INSTALL_HINT``).
"""

from __future__ import annotations

import torch

INSTALL_HINT = ("install SonicMoE and its pinned dependencies: pip install sonic-moe==0.1.2.post1 "
                "quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 (Python 3.12, CUDA); on a machine without a "
                "network, scripts/sonicmoe_wheels.sh packs them on one with a network and unpacks them there")


def import_sonicmoe():
    """(``moe_general_routing_inputs``, ``ActivationType``) from sonicmoe; ImportError with ``INSTALL_HINT``
    when sonicmoe, or a library it loads (cutlass, quack, the CUDA bindings), is missing or fails to load."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
    except Exception as e:  # re-raised as ImportError, the cause chained: a missing module, a shared library that
        # would not load (OSError), CuTe DSL's own error when it cannot read the CUDA version
        raise ImportError(f"sonicmoe is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    return moe_general_routing_inputs, ActivationType


def sonicmoe_unavailable() -> str | None:
    """None when sonicmoe imports here, else why not (the ImportError's message, with the install hint)."""
    try:
        import_sonicmoe()
    except ImportError as e:
        return str(e)
    return None


def sonicmoe_unsupported(device: torch.device, dtype, swiglu_limit: float | None) -> str | None:
    """None when SonicMoE runs a problem on ``device`` in ``dtype`` (x's and both weights') with
    ``swiglu_limit``, else why not (one line)."""
    if torch.device(device).type != "cuda":
        return "SonicMoE runs on CUDA only (CuTe DSL kernels)"
    if dtype != torch.bfloat16:
        return f"SonicMoE runs bf16 (x and both weights), got {dtype}"
    if swiglu_limit is not None:
        return f"SonicMoE has no SwiGLU clamp (swiglu_limit={swiglu_limit})"
    return None


def interleave_gate_up(w13_E2IH: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` gate rows then up rows -> ``[E, 2I, H]`` with row ``2j`` gate ``j``, ``2j + 1`` up ``j``
    (a contiguous copy)."""
    e, two_i, h = w13_E2IH.shape
    return w13_E2IH.reshape(e, 2, two_i // 2, h).transpose(1, 2).reshape(e, two_i, h)


def deinterleave_gate_up(w_E2IH: torch.Tensor) -> torch.Tensor:
    """The inverse of ``interleave_gate_up``: interleaved gate/up rows back to gate rows then up rows."""
    e, two_i, h = w_E2IH.shape
    return w_E2IH.reshape(e, two_i // 2, 2, h).transpose(1, 2).reshape(e, two_i, h)


def sonicmoe_prepare(w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our expert weights in SonicMoE's layout, once, outside the timed calls: (``w13`` with gate and up rows
    interleaved ``[E, 2I, H]``, ``w2_EHI`` contiguous). ``sonicmoe_forward`` permutes both to SonicMoE's
    ``[2I, H, E]`` / ``[H, I, E]`` views itself (no copy)."""
    if w13_E2IH.dim() != 3 or w2_EHI.dim() != 3 or w13_E2IH.shape[1] % 2:
        raise ValueError(f"sonicmoe_prepare expects w13 [E, 2I, H] and w2 [E, H, I], got {tuple(w13_E2IH.shape)} "
                         f"and {tuple(w2_EHI.shape)}")
    return interleave_gate_up(w13_E2IH.detach()), w2_EHI.detach().contiguous()


def sonicmoe_forward(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_interleaved_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (x's dtype) through ``sonicmoe.functional.moe_general_routing_inputs``.

    ``w13_interleaved_E2IH`` and ``w2_EHI`` as ``sonicmoe_prepare`` returns them (gate/up rows interleaved;
    both contiguous). No shared expert (SonicMoE has none). Differentiable in x, the router weights and both
    weight tensors."""
    moe_general_routing_inputs, ActivationType = import_sonicmoe()
    if not x_TH.dtype == w13_interleaved_E2IH.dtype == w2_EHI.dtype:
        raise ValueError(f"sonicmoe_forward: x, w13 and w2 must share one dtype, got {x_TH.dtype}, "
                         f"{w13_interleaved_E2IH.dtype}, {w2_EHI.dtype}")
    why = sonicmoe_unsupported(x_TH.device, x_TH.dtype, swiglu_limit)
    if why is not None:
        raise NotImplementedError(f"sonicmoe_forward: {why}")
    T, H = x_TH.shape
    K = topk_ids_TK.shape[1]
    E, two_i, h_w = w13_interleaved_E2IH.shape
    if h_w != H or tuple(w2_EHI.shape) != (E, H, two_i // 2) or tuple(topk_weights_TK.shape) != (T, K):
        raise ValueError(f"sonicmoe_forward: x {tuple(x_TH.shape)}, topk_ids {tuple(topk_ids_TK.shape)}, topk_weights "
                         f"{tuple(topk_weights_TK.shape)}, w13 {tuple(w13_interleaved_E2IH.shape)}, w2 "
                         f"{tuple(w2_EHI.shape)} do not fit [T, H], [T, K], [T, K], [E, 2I, H], [E, H, I]")
    if not (w13_interleaved_E2IH.is_contiguous() and w2_EHI.is_contiguous()):
        raise ValueError("sonicmoe_forward: pass the weights sonicmoe_prepare returns (contiguous [E, ...])")
    dev = x_TH.device
    # routes in row-major [T, K] order are sorted by token, as moe_general_routing_inputs requires
    token_indices = torch.arange(T, dtype=torch.int32, device=dev)[:, None].expand(T, K).reshape(-1)
    expert_indices = topk_ids_TK.reshape(-1).to(torch.int32)
    router_scores = topk_weights_TK.reshape(-1).float()
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TH, topk_weights_TK, w13_interleaved_E2IH, w2_EHI))
    # the stream handle, as SonicMoE's MoE module passes it (0.1.2.post1's general-routing path does not read it;
    # 0 off CUDA, where only a stand-in for SonicMoE runs, in tests)
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    out, _ = moe_general_routing_inputs(
        x_TH.contiguous(), router_scores, token_indices, expert_indices,
        w13_interleaved_E2IH.permute(1, 2, 0), None, w2_EHI.permute(1, 2, 0), None,
        E, stream, ActivationType.SWIGLU, is_inference_mode_enabled=not needs_grad)
    return out
