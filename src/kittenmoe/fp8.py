"""FP8 (e4m3fn) block-scaled quantisation: config, torch reference, Triton launcher, and the routed-expert
weights the FP8 megakernels read (``FP8ExpertWeights``).

Layouts (DeepSeek-V3's fine-grained scaling; MXFP8 when ``scale_block=32`` with power-of-two scales):

- activations ``x_MK``: one scale per 1 x B block along K (the last dim): ``scale_MKb`` is
  ``[M, cdiv(K, B)]`` (leading dims other than M are kept as they are);
- weights ``w_NK`` or ``w_ENK``: one scale per B x B block over (N, K): ``scale`` is
  ``[(E,) cdiv(N, B), cdiv(K, B)]``.

Scale rule, per block (B = ``cfg.scale_block``):

    scale = max(amax(|block|) / 448, 2^-126)          # fp32 division, correctly rounded
    if cfg.pow2_scales: scale = 2^ceil(log2(scale))   # round UP, so |x| / scale <= 448: no overflow
    q = e4m3fn(x * (1 / scale))                       # one correctly rounded fp32 reciprocal a block, an fp32
                                                      # multiply an element, then round to nearest even

448 is the e4m3fn maximum. The clamp to 2^-126 (the smallest normal fp32, itself a power of two and
E8M0-representable) is the one rule for degenerate blocks: an all-zero block gets scale 2^-126 and
quantises to zeros, and a block of fp32 subnormals never gets a subnormal (or zero) scale, which a GPU
may flush. A partial last block (K or N not a multiple of B) is scaled over the elements it has.
Dequantisation is ``q.float() * scale`` in fp32. The multiply by the reciprocal (rather than dividing each
element) is for the GPU: a correctly rounded fp32 division is a multi-instruction sequence, and in the FP8
forward's pull, which quantises every routed row, dividing made the quantiser 2.4x slower on an H200
(``benchmarks/probes/quant_probe.py``, Kimi slice, 16 programs: 1.40 ms dividing, 0.60 ms multiplying, 0.34 ms for
the plain bf16 copy). The two differ in one e4m3 value in ~2,000 (57,112 of 117 M on that problem); with
power-of-two scales the reciprocal is exact and they agree. ``x * inv`` stays below 464 (the e4m3fn
rounding limit): amax * RN(1 / RN(amax / 448)) <= 448 (1 + 2^-22).

Inputs must be finite: inf/nan raise ``ValueError``. That check reads a flag on the host (a sync); the
fused hot-path versions (dispatch pull, epilogues) will report through the device error flag instead.

``impl="torch"`` is the reference; ``impl="triton"`` runs ``kernels/quant.py`` and matches it bit for bit
(checked on CPU under the Triton interpreter; on a GPU see that file's note on the e4m3 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kittenmoe.checks import check_triton_device

E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # smallest normal fp32; the scale of an all-zero block
FP8_DTYPE = torch.float8_e4m3fn
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch parameters of the standalone quantisers by scale block (also what tools/sm90_build.py compiles).
# Activations: 16 rows of a 128-block or 64 rows of a 32-block a program (2,048 values). Weights: a block in
# 32-row chunks (an amax pass, then a quantise pass), 4 warps for 128-blocks; one 32-block in one pass with one
# warp. The one-pass form of a 128-block (RC = 128) needs 255 registers and a 280-byte stack (Triton 3.6, bf16)
# against the chunked form's 55: on the H200 the chunked form quantises the Kimi slice's weights in 3.13 ms
# against 10.82 (bf16; fp32 5.16 against 17.48), the same bits (benchmarks/probes/wquant_time.py).
ACT_QUANT_LAUNCH = {128: dict(BLOCK_M=16), 32: dict(BLOCK_M=64)}
WEIGHT_QUANT_LAUNCH = {128: dict(RC=32, num_warps=4), 32: dict(RC=32, num_warps=1)}


@dataclass(frozen=True)
class FP8Config:
    """Block scaling of the FP8 path, and which of the megakernels' GEMMs stay in x's dtype.

    scale_block: block edge B along K (activations: 1 x B; weights: B x B). 128 (DeepSeek-V3) or 32 (MXFP8).
    pow2_scales: round every scale up to a power of two (E8M0-representable). Required for B = 32.
    dx_high: the backward's routed d_x GEMM (d(gate|up) W13) runs in x's dtype, from the d(gate|up) rows as the
        backward stores them and the master W13, instead of on e4m3; the rest of the FP8 path is unchanged. In
        e4m3 that GEMM promotes every 64 of its K (d(gate|up) is quantised 1 x 64, phase A's tile width) and
        was the FP8 backward's critical path on the H200: +4.5 ms against +2.0 ms for BF16's on the Kimi slice.
        Needs the master weights (the layer, ``kittenmoe.moe`` and the transformers integration pass them).
    down_high: the forward's down projection runs in x's dtype: hidden rows stored in x's dtype (not quantised)
        and multiplied by the master W2; gate|up and the backward's data gradients stay e4m3. The e4m3 down GEMM
        was slower than BF16's on the H200 (Kimi slice, forward phases: +1.47 ms against +1.17). Needs the
        master weights.
    """

    scale_block: int = 128
    pow2_scales: bool = False
    dx_high: bool = False
    down_high: bool = False

    def __post_init__(self):
        if isinstance(self.scale_block, bool) or not isinstance(self.scale_block, int) \
                or self.scale_block not in (32, 128):
            raise ValueError(f"FP8Config: scale_block must be 32 or 128, got {self.scale_block!r}")
        for name in ("pow2_scales", "dx_high", "down_high"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8Config: {name} must be a bool, got {getattr(self, name)!r}")
        if self.scale_block == 32 and not self.pow2_scales:
            raise ValueError("FP8Config: scale_block=32 (the MXFP8 family) needs pow2_scales=True "
                             "(E8M0-representable power-of-two scales)")

    @property
    def tile_block_n(self) -> int:
        """The gate|up tile width (``KernelConfig.block_n``) the FP8 path gets from ``MoELayer``, ``kittenmoe
        bench --fp8`` and the transformers integration: 128 for both scale blocks. A tile's hidden rows must hold
        whole scale blocks (a multiple of ``scale_block``), and the backward's d(gate|up) blocks, half a tile
        wide, must stay >= 32 for e4m3 dots: a 32-wide tile would give 16 (``launch_common.check_fp8`` refuses it,
        unless ``dx_high`` keeps d(gate|up) unquantised)."""
        return max(128, self.scale_block)


# ---------------------------------------------------------------- checks and scale rule

def _check_input(t: torch.Tensor, name: str, min_dim: int, max_dim: int | None = None,
                 check_finite: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: dtype must be one of fp32/bf16/fp16, got {t.dtype}")
    if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
        want = f"{min_dim}" if max_dim == min_dim else f"{min_dim}..{max_dim or 'any'}"
        raise ValueError(f"{name}: expected {want} dims, got shape {tuple(t.shape)}")
    if check_finite and t.numel() and not bool(torch.isfinite(t).all()):
        n = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name}: {n} non-finite (inf/nan) values; FP8 quantisation needs finite inputs")


def _check_q_scale(q: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: q must be {FP8_DTYPE}, got {q.dtype}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be fp32, got {scale.dtype}")


def scale_from_amax(amax: torch.Tensor, cfg: FP8Config) -> torch.Tensor:
    """The scale rule on fp32 block maxima (see the module docstring)."""
    # Divide by a tensor, not the Python float: CUDA torch turns `t / scalar` into `t * (1 / scalar)`, one
    # ulp off the correctly rounded quotient for some amax (H200: 3.0625 / 448 gave 6.83593797e-03, not
    # 6.8359375e-03), which then differs from the kernels' div.rn in every byte of the block.
    scale = torch.clamp_min(amax.float() / amax.new_full((), E4M3_MAX, dtype=torch.float32), MIN_SCALE)
    if cfg.pow2_scales:
        # round up to a power of two on the bits: a nonzero mantissa bumps the exponent (exact for normals)
        bits = scale.view(torch.int32)
        scale = ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)
    return scale


def apply_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The rule's last step: ``e4m3fn(x * (1 / scale))`` in fp32, ``scale`` broadcast against ``x``."""
    inv = torch.ones_like(scale) / scale  # a tensor division: correctly rounded on CPU and CUDA (see above)
    return (x.float() * inv).to(FP8_DTYPE)


def _expand(scale: torch.Tensor, dim: int, b: int, size: int) -> torch.Tensor:
    return scale.repeat_interleave(b, dim=dim).narrow(dim, 0, size)


# ---------------------------------------------------------------- activations: 1 x B along K

def quantize_activations(x_MK: torch.Tensor, cfg: FP8Config = FP8Config(),
                         impl: Literal["torch", "triton"] = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK float8_e4m3fn, scale_MKb fp32 [..., M, cdiv(K, B)]): 1 x B blocks along the last dim."""
    _check_input(x_MK, "quantize_activations: x", min_dim=1)
    if impl == "triton":
        return _quantize_activations_triton(x_MK, cfg)
    if impl != "torch":
        raise ValueError(f"quantize_activations: impl must be 'torch' or 'triton', got {impl!r}")
    b, k = cfg.scale_block, x_MK.shape[-1]
    kb = -(-k // b)
    x = x_MK.float()
    pad = torch.nn.functional.pad(x, (0, kb * b - k))  # zeros do not change a block's amax
    amax = pad.abs().unflatten(-1, (kb, b)).amax(dim=-1)
    scale = scale_from_amax(amax, cfg)
    return apply_scale(x, _expand(scale, -1, b, k)), scale


def dequantize_activations(q_MK: torch.Tensor, scale_MKb: torch.Tensor, cfg: FP8Config = FP8Config()
                           ) -> torch.Tensor:
    """fp32 ``q * scale`` for 1 x B blocks along the last dim."""
    _check_q_scale(q_MK, scale_MKb, "dequantize_activations")
    b, k = cfg.scale_block, q_MK.shape[-1]
    want = (*q_MK.shape[:-1], -(-k // b))
    if tuple(scale_MKb.shape) != want:
        raise ValueError(f"dequantize_activations: scale shape {tuple(scale_MKb.shape)} != {want} for q "
                         f"{tuple(q_MK.shape)} and scale_block {b}")
    return q_MK.float() * _expand(scale_MKb, -1, b, k)


def _quantize_activations_triton(x_MK: torch.Tensor, cfg: FP8Config) -> tuple[torch.Tensor, torch.Tensor]:
    from kittenmoe.intmath import cdiv
    from kittenmoe.kernels import quant

    check_triton_device(x_MK.device, "quantize_activations(impl='triton')")
    x = x_MK.contiguous()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    b = cfg.scale_block
    kb = -(-k // b)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((*x.shape[:-1], kb), dtype=torch.float32, device=x.device)
    if m and k:
        block_m = ACT_QUANT_LAUNCH[b]["BLOCK_M"]
        quant.quantize_act_1xb_kernel[(cdiv(m, block_m), kb)](
            x2, q.view(torch.uint8).reshape(m, k), scale.reshape(m, kb), m, k, kb,
            SB=b, POW2=cfg.pow2_scales, **ACT_QUANT_LAUNCH[b])
    return q, scale


# ---------------------------------------------------------------- weights: B x B over (N, K)

def quantize_weights(w: torch.Tensor, cfg: FP8Config = FP8Config(),
                     check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_NK`` or ``w_ENK`` -> (q float8_e4m3fn, scale fp32 ``[(E,) cdiv(N, B), cdiv(K, B)]``).

    ``check_finite=False`` skips the inf/nan check, a host sync: for the training step's re-quantisation
    (no host sync on the hot path; a non-finite weight shows up as a non-finite loss instead)."""
    _check_input(w, "quantize_weights: w", min_dim=2, max_dim=3, check_finite=check_finite)
    b = cfg.scale_block
    n, k = w.shape[-2:]
    nb, kb = -(-n // b), -(-k // b)
    x = w.float()
    pad = torch.nn.functional.pad(x, (0, kb * b - k, 0, nb * b - n))
    blocks = pad.abs().unflatten(-1, (kb, b)).unflatten(-3, (nb, b))  # [(E,) nb, B, kb, B]
    amax = blocks.amax(dim=(-3, -1))
    scale = scale_from_amax(amax, cfg)
    return apply_scale(x, _expand(_expand(scale, -1, b, k), -2, b, n)), scale


def quantize_weights_and_transpose(w: torch.Tensor, cfg: FP8Config = FP8Config(), check_finite: bool = True,
                                   impl: Literal["torch", "triton", "auto"] = "auto"
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_weights`` plus ``q`` transposed over its last two dims (contiguous): (q, scale, q_t).

    The FP8 backward's data-gradient GEMMs read the e4m3 weights transposed (e4m3 wgmma takes its B operand
    K-major only). ``impl="triton"`` writes both layouts from one read of ``w`` (``kernels/quant.py``,
    ``quantize_weights_bxb_kernel``; bit for bit the torch rule); ``"torch"`` quantises and then copies;
    ``"auto"`` is triton for CUDA tensors (through the ``kittenmoe::quantize_weights_fp8`` op, which
    ``torch.compile`` traces) and torch otherwise."""
    _check_input(w, "quantize_weights: w", min_dim=2, max_dim=3, check_finite=check_finite)
    if impl == "auto":
        impl = "triton" if w.is_cuda else "torch"
    if impl == "torch":
        q, scale = quantize_weights(w, cfg, check_finite=False)
        return q, scale, q.transpose(-1, -2).contiguous()
    if impl != "triton":
        raise ValueError(f"quantize_weights_and_transpose: impl must be 'torch', 'triton' or 'auto', got {impl!r}")
    check_triton_device(w.device, "quantize_weights_and_transpose(impl='triton')")
    return torch.ops.kittenmoe.quantize_weights_fp8(w, cfg.scale_block, cfg.pow2_scales)


@torch.library.custom_op("kittenmoe::quantize_weights_fp8", mutates_args=())
def _quantize_weights_fp8_op(w: torch.Tensor, scale_block: int, pow2_scales: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op over ``launch_weight_quant`` (its default launch parameters)."""
    return launch_weight_quant(w, scale_block, pow2_scales)


def launch_weight_quant(w: torch.Tensor, scale_block: int, pow2_scales: bool, rows_per_chunk: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher of ``quantize_weights_bxb_kernel``: (q, scale, q_t) of ``w`` [N, K] or [E, N, K].
    ``rows_per_chunk``: the kernel's RC (None: ``WEIGHT_QUANT_LAUNCH``'s); benchmarks/probes/wquant_time.py compares."""
    from kittenmoe.kernels import quant

    n, k = w.shape[-2:]
    e = w.shape[0] if w.dim() == 3 else 1
    w3 = w.contiguous().view(e, n, k)  # (view, not reshape(-1, ...): N or K may be 0)
    b = scale_block
    nb, kb = -(-n // b), -(-k // b)
    q = torch.empty(w3.shape, dtype=torch.uint8, device=w.device)
    q_t = torch.empty((e, k, n), dtype=torch.uint8, device=w.device)
    scale = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    launch = dict(WEIGHT_QUANT_LAUNCH[b])
    if rows_per_chunk is not None:
        if rows_per_chunk not in (16, 32, 64, 128) or b % rows_per_chunk:
            raise ValueError(f"rows_per_chunk must be a power of two in [16, {b}], got {rows_per_chunk}")
        launch["RC"] = rows_per_chunk
    if q.numel():
        quant.quantize_weights_bxb_kernel[(kb, nb, e)](w3, q, q_t, scale, n, k, nb, kb, SB=b, POW2=pow2_scales,
                                                      TRANSPOSED=True, **launch)
    lead = w.shape[:-2]
    return (q.view(FP8_DTYPE).reshape(w.shape), scale.reshape(*lead, nb, kb),
            q_t.view(FP8_DTYPE).reshape(*lead, k, n))


@_quantize_weights_fp8_op.register_fake
def _(w, scale_block, pow2_scales):
    b = scale_block
    n, k = w.shape[-2:]
    lead = w.shape[:-2]
    return (w.new_empty(w.shape, dtype=FP8_DTYPE), w.new_empty((*lead, -(-n // b), -(-k // b)), dtype=torch.float32),
            w.new_empty((*lead, k, n), dtype=FP8_DTYPE))


def dequantize_weights(q: torch.Tensor, scale: torch.Tensor, cfg: FP8Config = FP8Config()) -> torch.Tensor:
    """fp32 ``q * scale`` for B x B blocks over the last two dims."""
    _check_q_scale(q, scale, "dequantize_weights")
    if q.dim() not in (2, 3):
        raise ValueError(f"dequantize_weights: expected [N, K] or [E, N, K], got shape {tuple(q.shape)}")
    b = cfg.scale_block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // b), -(-k // b))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_weights: scale shape {tuple(scale.shape)} != {want} for q "
                         f"{tuple(q.shape)} and scale_block {b}")
    return q.float() * _expand(_expand(scale, -1, b, k), -2, b, n)


# ---------------------------------------------------------------- routed-expert weights for the FP8 megakernel

@dataclass(frozen=True)
class FP8ExpertWeights:
    """Routed-expert weights quantised for the FP8 forward megakernel: e4m3 with ``B x B`` block scales.

    Keep these beside the BF16 master weights and re-quantise after each optimizer step
    (:meth:`quantize`), or hold FP8 weights yourself and build one directly. ``w13_q`` stacks gate rows then
    up rows as ``w13_E2IH`` does, so with ``I`` a multiple of ``B`` no scale block straddles gate and up.
    """

    w13_q: torch.Tensor  # [E, 2I, H] float8_e4m3fn
    w13_scale: torch.Tensor  # [E, 2I / B, H / B] fp32
    w2_q: torch.Tensor  # [E, H, I] float8_e4m3fn
    w2_scale: torch.Tensor  # [E, H / B, I / B] fp32
    cfg: FP8Config = FP8Config()
    # The same e4m3 weights transposed, contiguous: the backward's data-gradient GEMMs read these (e4m3 wgmma
    # takes B K-major only). ``quantize`` makes them; without them each backward transposes (``transposed``).
    w13_qt: torch.Tensor | None = None  # [E, H, 2I] float8_e4m3fn
    w2_qt: torch.Tensor | None = None  # [E, I, H] float8_e4m3fn

    def __post_init__(self):
        b = self.cfg.scale_block
        if self.w13_q.dim() != 3 or self.w2_q.dim() != 3:
            raise ValueError(f"FP8ExpertWeights: w13_q and w2_q must be [E, 2I, H] and [E, H, I], got "
                             f"{tuple(self.w13_q.shape)} and {tuple(self.w2_q.shape)}")
        e, two_i, h = self.w13_q.shape
        if tuple(self.w2_q.shape) != (e, h, two_i // 2):
            raise ValueError(f"FP8ExpertWeights: w2_q shape {tuple(self.w2_q.shape)} != {(e, h, two_i // 2)}")
        _check_q_scale(self.w13_q, self.w13_scale, "FP8ExpertWeights w13")
        _check_q_scale(self.w2_q, self.w2_scale, "FP8ExpertWeights w2")
        for name, q, sc in (("w13", self.w13_q, self.w13_scale), ("w2", self.w2_q, self.w2_scale)):
            want = (e, -(-q.shape[1] // b), -(-q.shape[2] // b))
            if tuple(sc.shape) != want:
                raise ValueError(f"FP8ExpertWeights: {name}_scale shape {tuple(sc.shape)} != {want} "
                                 f"(scale_block {b})")
        for name, qt, q in (("w13_qt", self.w13_qt, self.w13_q), ("w2_qt", self.w2_qt, self.w2_q)):
            if qt is not None and (qt.dtype != FP8_DTYPE or tuple(qt.shape) != (e, q.shape[2], q.shape[1])):
                raise ValueError(f"FP8ExpertWeights: {name} must be {FP8_DTYPE} {(e, q.shape[2], q.shape[1])} (the "
                                 f"transpose of {name[:-1]}), got {qt.dtype} {tuple(qt.shape)}")

    @staticmethod
    def quantize(w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, cfg: FP8Config = FP8Config(),
                 check_finite: bool = True) -> "FP8ExpertWeights":
        """Both weights quantised, with their transposes (``quantize_weights_and_transpose``, impl "auto")."""
        q13, s13, q13t = quantize_weights_and_transpose(w13_E2IH, cfg, check_finite)
        q2, s2, q2t = quantize_weights_and_transpose(w2_EHI, cfg, check_finite)
        return FP8ExpertWeights(q13, s13, q2, s2, cfg, q13t, q2t)

    def experts(self, lo: int, hi: int) -> "FP8ExpertWeights":
        """The experts [lo, hi) (one rank's share), as views."""
        return FP8ExpertWeights(self.w13_q[lo:hi], self.w13_scale[lo:hi], self.w2_q[lo:hi], self.w2_scale[lo:hi],
                                self.cfg, None if self.w13_qt is None else self.w13_qt[lo:hi],
                                None if self.w2_qt is None else self.w2_qt[lo:hi])

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13_qt, w2_qt), transposing now (a pass over the e4m3 weights) where they were not given."""
        return self.w13_transposed(), self.w2_transposed()

    def w13_transposed(self) -> torch.Tensor:
        """w13_qt, or W13 transposed now when it was not given."""
        return self.w13_q.transpose(1, 2).contiguous() if self.w13_qt is None else self.w13_qt

    def w2_transposed(self) -> torch.Tensor:
        """w2_qt, or W2 transposed now when it was not given."""
        return self.w2_q.transpose(1, 2).contiguous() if self.w2_qt is None else self.w2_qt

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13, w2) as the kernel sees them."""
        return dequantize_weights(self.w13_q, self.w13_scale, self.cfg), dequantize_weights(self.w2_q, self.w2_scale,
                                                                                          self.cfg)


def expert_weight_operands(fp8, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor):
    """The ``fp8`` argument of the differentiable entry points as the kernels take it: None (x's dtype), or the
    tuple ``(w13_q, w13_scale, w2_q, w2_scale, cfg, w13_qt, w2_qt)`` from an ``FP8Config`` (quantise
    ``w13_E2IH`` / ``w2_EHI`` now, with their transposes, as a layer with bf16 master weights does every step;
    without the finite check, a host sync on the hot path) or from ``FP8ExpertWeights`` (as given; the
    transposes may be None).

    A plain tuple, not an ``FP8ExpertWeights``: ``torch.compile(fullgraph=True)`` traces this (the layer
    quantises inside the compiled graph) and dynamo cannot build that dataclass (torch 2.11 on the H200:
    "SourcelessBuilder.create does not know how to wrap FP8Config", from its default field value)."""
    if isinstance(fp8, FP8Config):
        with torch.no_grad():
            q13, s13, q13t = quantize_weights_and_transpose(w13_E2IH.detach(), fp8, False)
            q2, s2, q2t = quantize_weights_and_transpose(w2_EHI.detach(), fp8, False)
        return q13, s13, q2, s2, fp8, q13t, q2t
    if isinstance(fp8, FP8ExpertWeights):
        return fp8.w13_q, fp8.w13_scale, fp8.w2_q, fp8.w2_scale, fp8.cfg, fp8.w13_qt, fp8.w2_qt
    check_fp8_option(fp8)
    return None


def check_fp8_option(fp8) -> None:
    """The ``fp8`` argument of the differentiable entry points is None, an ``FP8Config`` or ``FP8ExpertWeights``:
    TypeError otherwise (checked before anything reads it, the config choice included)."""
    if fp8 is not None and not isinstance(fp8, (FP8Config, FP8ExpertWeights)):
        raise TypeError(f"fp8 must be None, a kittenmoe.fp8.FP8Config or FP8ExpertWeights, got {type(fp8).__name__}")


def resolve_expert_weights(fp8, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor) -> FP8ExpertWeights | None:
    """``expert_weight_operands`` as an ``FP8ExpertWeights`` (for the paths dynamo does not trace: EP)."""
    operands = expert_weight_operands(fp8, w13_E2IH, w2_EHI)
    return FP8ExpertWeights(*operands) if isinstance(fp8, FP8Config) else fp8
