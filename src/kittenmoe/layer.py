"""``MoELayer``: router, routed SwiGLU experts and a shared expert as one ``nn.Module`` (one rank).

The module holds parameters and routing; the layer math is ``kittenmoe.functional.moe``.

Parameters (shape-suffix names; shapes from a ``kittenmoe.config.ModelShape``):

- ``router_w_EH`` [E, H]: logits = x @ router_w^T, computed in fp32;
- ``w13_E2IH`` [E, 2I, H] (gate rows then up rows) and ``w2_EHI`` [E, H, I]: the routed experts;
- ``shared_w13_2SH`` [2S, H] and ``shared_w2_HS`` [H, S]: the shared expert, ``None`` when
  ``shape.shared_width == 0``;
- buffer ``correction_bias_E`` [E] fp32 (``correction_bias=True``): DeepSeek-V3's auxiliary-loss-free
  balancing bias, added to the scores for expert selection only. The layer never updates it; a training
  loop that balances load does.

Routing is ``kittenmoe.reference.route`` with the shape's ``score_func``, ``renormalize`` and
``routed_scaling_factor``; the router weights reach the experts as fp32 ``topk_weights``, so the router
trains through the layer's ``d_topk_weights``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kittenmoe import launch_common
from kittenmoe.autoconfig import auto_config
from kittenmoe.config import KernelConfig, ModelShape
from kittenmoe.functional import Backend, check_config, moe, resolve_backend
from kittenmoe.checks import FLOAT_DTYPES, canonical_device, check_megakernel_dtype
from kittenmoe.reference import route

if TYPE_CHECKING:
    from kittenmoe.fp8 import FP8Config
    from kittenmoe.peers import SymmetricPeers


def check_backend_runs(backend: str, device: torch.device | str) -> str:
    """Resolve ``backend`` for ``device`` and raise (``ValueError`` for an unknown name, ``RuntimeError`` for
    a backend that cannot run there) instead of letting a later forward fail or fall back."""
    which = resolve_backend(backend, device)
    if which == "megakernel":
        try:
            launch_common.check_device(torch.device(device))
        except RuntimeError as e:
            raise RuntimeError(f"MoE backend 'megakernel' cannot run on {device}: {e} With the layer API, "
                               f"backend='torch' (or 'auto') runs there.") from e
    return which


class MoELayer(nn.Module):
    """DeepSeek-V3-style MoE layer: top-k routed SwiGLU experts plus an optional shared expert.

    ``forward(x)`` takes ``[..., H]`` in the layer's dtype and returns the same shape and dtype.

    backend: ``"auto"`` (megakernel on CUDA, torch elsewhere), ``"torch"`` or ``"megakernel"`` (CUDA, or CPU
        under ``TRITON_INTERPRET=1``); see ``kittenmoe.functional``. Checked against ``device`` here.
    config: the megakernel's ``KernelConfig``; None picks the tuned or heuristic one per forward
        (``config_for_tokens``); unused by the torch backend.
    generator: seeds the initialisation (``reset_parameters``).
    fp8: a ``kittenmoe.fp8.FP8Config`` to run the routed experts in e4m3 (megakernel only; H and I multiples
        of 128): the bf16 weights are quantised every forward, forward and data gradients run in e4m3,
        weight gradients in bf16 (``kittenmoe.moe(fp8=...)``).
    ep: a ``kittenmoe.SymmetricPeers`` for expert parallelism across processes (one per rank, every rank
        building its layers in the same order): this rank then holds experts ``[rank * L, (rank + 1) * L)``
        with ``L = E / R`` (``w13_E2IH`` is ``[L, 2I, H]``, ``w2_EHI`` ``[L, H, I]``), routes its own tokens over
        all E experts, and runs ``kittenmoe.ep.moe_ep`` (the megakernels; forward and backward are collective).
        The router and shared expert are replicated: their gradients are this rank's tokens' share, for
        data-parallel reduction to sum.
    """

    def __init__(
        self,
        shape: ModelShape,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        config: KernelConfig | None = None,
        correction_bias: bool = False,
        generator: torch.Generator | None = None,
        ep: "SymmetricPeers | None" = None,
        fp8: "FP8Config | None" = None,
    ) -> None:
        super().__init__()
        if not isinstance(shape, ModelShape):
            raise TypeError(f"MoELayer needs a kittenmoe.ModelShape, got {type(shape).__name__}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"MoELayer: dtype must be one of {', '.join(map(str, FLOAT_DTYPES))} (the parameters'; "
                            f"e4m3 experts take fp8=kittenmoe.FP8Config()), got {dtype!r}")
        if fp8 is not None:
            from kittenmoe.fp8 import FP8Config

            if not isinstance(fp8, FP8Config):
                raise TypeError(f"fp8 must be a kittenmoe.fp8.FP8Config or None, got {type(fp8).__name__}")
            if shape.h % 128 or shape.i % 128:
                raise ValueError(f"MoELayer: fp8 needs H and I multiples of 128 (the scale block), got H={shape.h}, "
                                 f"I={shape.i}")
        check_config(config)
        device = torch.device("cpu") if device is None else canonical_device(device)
        if check_backend_runs(backend, device) == "megakernel":
            check_megakernel_dtype(dtype, "MoELayer")
        self.shape = shape
        self.backend = backend
        self.config = config
        self.fp8 = fp8
        if fp8 is not None and resolve_backend(backend, device) != "megakernel":
            raise NotImplementedError(f"MoELayer: fp8 runs the megakernel only; backend={backend!r} on {device} "
                                      f"resolves to the torch backend (pass backend='megakernel')")
        e, h, i, s = shape.e, shape.h, shape.i, shape.shared_width
        self.ep = ep
        self.expert_offset, n_local = 0, e
        if ep is not None:
            from kittenmoe.peers import SymmetricPeers

            if not isinstance(ep, SymmetricPeers):
                raise TypeError(f"ep must be a kittenmoe.SymmetricPeers (one process per rank), got "
                                f"{type(ep).__name__}")
            if resolve_backend(backend, device) != "megakernel":
                raise ValueError(f"expert parallelism runs the megakernels; backend={backend!r} on {device} "
                                 f"does not (kittenmoe.distributed runs the torch backend across processes)")
            if device != ep.device:
                raise ValueError(f"the layer's device {device} is not the peers' device {ep.device}")
            if e % ep.num_ranks:
                raise ValueError(f"E={e} experts cannot be split evenly over {ep.num_ranks} ranks")
            n_local = e // ep.num_ranks
            self.expert_offset = ep.rank * n_local
        kw = dict(dtype=dtype, device=device)
        self.router_w_EH = nn.Parameter(torch.empty(e, h, **kw))
        self.w13_E2IH = nn.Parameter(torch.empty(n_local, 2 * i, h, **kw))
        self.w2_EHI = nn.Parameter(torch.empty(n_local, h, i, **kw))
        if s:
            self.shared_w13_2SH = nn.Parameter(torch.empty(2 * s, h, **kw))
            self.shared_w2_HS = nn.Parameter(torch.empty(h, s, **kw))
        else:
            self.register_parameter("shared_w13_2SH", None)
            self.register_parameter("shared_w2_HS", None)
        if correction_bias:
            self.register_buffer("correction_bias_E", torch.zeros(e, dtype=torch.float32, device=device))
        else:
            self.register_buffer("correction_bias_E", None)
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """std 1/sqrt(fan_in) normals (like a trained layer: outputs O(1)); drawn in fp32 on the CPU so a
        seeded ``generator`` gives the same weights on every device."""
        h, i, s = self.shape.h, self.shape.i, self.shape.shared_width
        for p, fan_in in ((self.router_w_EH, h), (self.w13_E2IH, h), (self.w2_EHI, i),
                          (self.shared_w13_2SH, h), (self.shared_w2_HS, s)):
            if p is None:
                continue
            if self.ep is not None and (p is self.w13_E2IH or p is self.w2_EHI):
                # Expert parallel: with a generator, draw all E experts one by one and keep this rank's, so
                # every rank consumes the same stream; without one, draw only this rank's.
                lo, n = self.expert_offset, p.shape[0]
                if generator is None:
                    p.copy_(torch.randn(p.shape) / math.sqrt(fan_in))
                else:
                    for idx in range(self.shape.e):
                        w = torch.randn(p.shape[1:], generator=generator)
                        if lo <= idx < lo + n:
                            p[idx - lo].copy_(w / math.sqrt(fan_in))
                continue
            p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
        if self.correction_bias_E is not None:
            self.correction_bias_E.zero_()

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, K] int64, topk_weights [T, K] fp32) for flattened tokens ``x_TH``."""
        sh = self.shape
        logits_TE = F.linear(x_TH.float(), self.router_w_EH.float())
        return route(logits_TE, sh.k, sh.score_func, sh.renormalize, sh.routed_scaling_factor,
                     self.correction_bias_E, compute_dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shape.h
        if x.dim() < 1 or x.shape[-1] != h:
            raise ValueError(f"MoELayer expects [..., H={h}] input, got shape {tuple(x.shape)}")
        x_TH = x.reshape(-1, h).contiguous()
        topk_ids_TK, topk_weights_TK = self.route(x_TH)
        if self.ep is not None:
            from kittenmoe.ep import moe_ep, token_slots

            # the config for the rows the kernels size every routed buffer by (max_tokens a rank when set): a
            # rank bringing fewer tokens would otherwise pick a config without the ring those rows need
            out_TH = moe_ep(x_TH, topk_ids_TK, topk_weights_TK, self.w13_E2IH, self.w2_EHI, self.shared_w13_2SH,
                            self.shared_w2_HS, self.shape.swiglu_limit, self.ep,
                            self.config_for_tokens(token_slots(self.ep, x_TH.shape[0]), x_TH.device), fp8=self.fp8)
            return out_TH.reshape(x.shape)
        out_TH = moe(x_TH, topk_ids_TK, topk_weights_TK, self.w13_E2IH, self.w2_EHI, self.shared_w13_2SH,
                     self.shared_w2_HS, self.shape.swiglu_limit, backend=self.backend,
                     config=self.config_for_tokens(x_TH.shape[0], x_TH.device), fp8=self.fp8)
        return out_TH.reshape(x.shape)

    def config_for_tokens(self, t: int, device: torch.device) -> KernelConfig | None:
        """The megakernel config a forward of ``t`` tokens uses: the constructor's ``config`` when given; else
        the ``kittenmoe tune`` cache entry for this shape, GPU and dtype, or the documented heuristic
        (``kittenmoe.config.default_config``) when none matches or ``KITTENMOE_AUTOTUNE=0``. None for the torch
        backend (no knobs)."""
        if self.config is not None or resolve_backend(self.backend, device) != "megakernel":
            return self.config
        sh = self.shape
        ranks = 1 if self.ep is None else self.ep.num_ranks
        return auto_config(t, sh.h, sh.i, sh.e, sh.k, sh.shared_width, ranks, device, self.w13_E2IH.dtype, self.fp8)

    def extra_repr(self) -> str:
        sh = self.shape
        ep = "" if self.ep is None else (f", ep=rank {self.ep.rank} of {self.ep.num_ranks} (experts "
                                         f"{self.expert_offset}..{self.expert_offset + self.w13_E2IH.shape[0] - 1})")
        return (f"shape={sh.name!r}, E={sh.e}, H={sh.h}, I={sh.i}, K={sh.k}, shared_width={sh.shared_width}, "
                f"score_func={sh.score_func!r}, backend={self.backend!r}{ep}"
                + ("" if self.fp8 is None else f", fp8=e4m3/{self.fp8.scale_block}"))
