"""Input checking shared by every backend: clear errors before any work.

Shape, dtype, device and contiguity problems raise ``TypeError`` /
``ValueError`` here, on the host, from metadata only (no device sync).
Expert ids out of range are data, so they are found on device
(``Schedule.num_invalid``) and reported by ``raise_if_invalid_routes``.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The megakernels' operand dtypes: what their configs (heuristic and tuned) and GPU tests cover. float64 is the
# torch backend's (the reference precision), never the megakernels'.
MEGAKERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_megakernel_dtype(dtype: torch.dtype, who: str) -> None:
    """TypeError naming ``who`` unless the megakernels run operands of ``dtype`` (``MEGAKERNEL_DTYPES``)."""
    if dtype not in MEGAKERNEL_DTYPES:
        raise TypeError(f"{who}: the megakernel runs {', '.join(str(d) for d in MEGAKERNEL_DTYPES)} operands, "
                        f"got {dtype}; backend='torch' runs the layer in {dtype}")


def check_swiglu_limit(swiglu_limit, name: str = "swiglu_limit") -> float | None:
    """The SwiGLU clamp as a float, or None (no clamp): a real number > 0 (inf clamps nothing), never a bool,
    a string or NaN; ValueError naming ``name`` otherwise."""
    if swiglu_limit is None:
        return None
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, numbers.Real) or math.isnan(swiglu_limit) \
            or not swiglu_limit > 0:
        raise ValueError(f"{name} must be a positive number or None, got {swiglu_limit!r}")
    return float(swiglu_limit)


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), which takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(device: torch.device, who: str) -> None:
    """A Triton launch's tensors must be on CUDA, or on CPU under the interpreter: a clear error otherwise
    (Triton's own for CPU tensors on a machine with a GPU is "Pointer argument (at 0) cannot be accessed")."""
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    if device.type == "cpu":
        raise RuntimeError(f"{who}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before "
                           f"kittenmoe.kernels is imported); move them to CUDA or use impl='torch'")
    raise RuntimeError(f"{who}: Triton kernels run on CUDA tensors (or CPU ones under the interpreter), "
                       f"got tensors on {device}")


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in: ``"cuda"`` means the current CUDA device, so that two spellings of
    one device compare equal (``torch.device("cuda") != torch.device("cuda:0")``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device

@dataclass(frozen=True)
class MoEDims:
    """Dimensions read off validated inputs."""

    r: int  # ranks
    t: int  # tokens per rank
    h: int  # hidden
    i: int  # routed expert width
    e: int  # routed experts, global
    k: int  # top-k
    s: int  # shared expert width, 0 without one

    @property
    def experts_per_rank(self) -> int:
        return self.e // self.r


def _tensor(name: str, v, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device | None):
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(v.shape)}")
    if v.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {v.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if device is not None and v.device != device:
        raise ValueError(f"{name} is on {v.device} but the inputs are on {device}; move every tensor to one device")
    if not v.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); got strides {v.stride()}")


def check_moe_inputs(
    x_RTH: list[torch.Tensor],
    topk_ids_RTK: list[torch.Tensor],
    topk_weights_RTK: list[torch.Tensor],
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    shared_w13_2SH: torch.Tensor | None,
    shared_w2_HS: torch.Tensor | None,
    expert_parallel: int = 1,
    allow_empty: bool = False,
) -> MoEDims:
    """Validate every rank's inputs and the (global) weights; return the dimensions.

    ``expert_parallel``: the number of processes the experts are split over when this call sees one rank's
    share of them (``kittenmoe.ep``); the top-k bound then applies to all ``expert_parallel * E`` experts.
    ``allow_empty``: T = 0 is valid (the public entries return an empty output); the launchers refuse it."""
    for name, v in (("x", x_RTH), ("topk_ids", topk_ids_RTK), ("topk_weights", topk_weights_RTK)):
        if not isinstance(v, (list, tuple)) or not v:
            raise TypeError(f"{name} must be a non-empty list with one tensor per rank, got {type(v).__name__}")
    r = len(x_RTH)
    if len(topk_ids_RTK) != r or len(topk_weights_RTK) != r:
        raise ValueError(f"one tensor per rank expected: got {r} x, {len(topk_ids_RTK)} topk_ids, "
                         f"{len(topk_weights_RTK)} topk_weights")
    _tensor("w13", w13_E2IH, 3, FLOAT_DTYPES, None)
    device = w13_E2IH.device
    _tensor("w2", w2_EHI, 3, FLOAT_DTYPES, device)
    e, two_i, h = w13_E2IH.shape
    if two_i % 2:
        raise ValueError(f"w13 must be [E, 2*I, H] (gate rows then up rows); dim 1 = {two_i} is odd")
    i = two_i // 2
    if i < 1 or h < 1:  # as ModelShape: a zero width is no layer (and the kernels would tile it by zero)
        raise ValueError(f"w13 must be [E, 2*I, H] with I >= 1 and H >= 1, got {tuple(w13_E2IH.shape)}")
    if tuple(w2_EHI.shape) != (e, h, i):
        raise ValueError(f"w2 must be [E, H, I] = {(e, h, i)} to match w13 {tuple(w13_E2IH.shape)}, "
                         f"got {tuple(w2_EHI.shape)}")
    if w2_EHI.dtype != w13_E2IH.dtype:
        raise TypeError(f"w13 ({w13_E2IH.dtype}) and w2 ({w2_EHI.dtype}) must share a dtype")
    if e % r:
        raise ValueError(f"E={e} experts cannot be split evenly over R={r} ranks")

    t = k = None
    for rank in range(r):
        x, ids, w = x_RTH[rank], topk_ids_RTK[rank], topk_weights_RTK[rank]
        at = f"[{rank}]" if r > 1 else ""  # which rank's tensor, when there are several ("x[0]" reads as a row)
        _tensor(f"x{at}", x, 2, FLOAT_DTYPES, device)
        _tensor(f"topk_ids{at}", ids, 2, INDEX_DTYPES, device)
        _tensor(f"topk_weights{at}", w, 2, FLOAT_DTYPES, device)
        if x.dtype != w13_E2IH.dtype:
            raise TypeError(f"x{at} has dtype {x.dtype} but the expert weights are {w13_E2IH.dtype}")
        if x.shape[1] != h:
            raise ValueError(f"x{at} has hidden size {x.shape[1]}, the weights expect H={h}")
        if t is None:
            t, k = x.shape[0], ids.shape[1]
        if x.shape[0] != t:
            raise ValueError(f"x[{rank}] has {x.shape[0]} tokens but x[0] has {t}; every rank needs the same T")
        if tuple(ids.shape) != (t, k) or tuple(w.shape) != (t, k):
            raise ValueError(f"topk_ids{at} {tuple(ids.shape)} and topk_weights{at} {tuple(w.shape)} "
                             f"must both be [T, K] = {(t, k)}")
    if t == 0 and not allow_empty:
        raise ValueError("x has no tokens (T=0); kittenmoe.moe and MoELayer accept an empty batch, the "
                         "launchers do not")
    if k < 1:
        raise ValueError("topk_ids has K=0 columns; at least one expert per token is needed")
    if k > e * expert_parallel:
        raise ValueError(f"top-k K={k} exceeds the number of experts E={e * expert_parallel}")
    routes = r * expert_parallel * t * k  # what one rank's schedule may receive, every rank's routes
    if routes >= 2**31 - 1:  # (schedule.NO_ROUTE: routes and routed rows are indexed in int32)
        raise ValueError(f"{r * expert_parallel} rank(s) x T={t} x K={k} = {routes} routes; routes and routed rows "
                         f"are indexed in int32, so fewer than 2**31 - 1: split the batch into smaller calls")

    s = check_shared_expert(shared_w13_2SH, shared_w2_HS, h, w13_E2IH.dtype, device)
    return MoEDims(r=r, t=t, h=h, i=i, e=e, k=k, s=s)


def check_shared_expert(shared_w13_2SH, shared_w2_HS, h: int, dtype: torch.dtype, device: torch.device,
                        min_width: int = 0) -> int:
    """The shared expert's width S (0: none) once its weights check out: both or neither, 2-D, [2S, H] and
    [H, S], the routed weights' ``dtype``, on ``device``, contiguous; ``min_width`` refuses a narrower one."""
    if (shared_w13_2SH is None) != (shared_w2_HS is None):
        raise ValueError("shared_w13 and shared_w2 must be given together (or both None for no shared expert)")
    if shared_w13_2SH is None:
        return 0
    _tensor("shared_w13", shared_w13_2SH, 2, FLOAT_DTYPES, device)
    _tensor("shared_w2", shared_w2_HS, 2, FLOAT_DTYPES, device)
    two_s, hs = shared_w13_2SH.shape
    if two_s % 2 or hs != h or two_s < 2 * min_width:
        at_least = f" with S >= {min_width}" if min_width else ""
        raise ValueError(f"shared_w13 must be [2*S, H={h}]{at_least}, got {tuple(shared_w13_2SH.shape)}")
    s = two_s // 2
    if tuple(shared_w2_HS.shape) != (h, s):
        raise ValueError(f"shared_w2 must be [H, S] = {(h, s)}, got {tuple(shared_w2_HS.shape)}")
    if shared_w13_2SH.dtype != dtype or shared_w2_HS.dtype != dtype:
        raise TypeError("the shared expert weights must have the routed weights' dtype "
                        f"{dtype}, got {shared_w13_2SH.dtype} / {shared_w2_HS.dtype}")
    return s


def raise_if_invalid_routes(num_invalid: torch.Tensor, num_experts: int) -> None:
    """Raise if any route named an expert outside [0, E). Reads one device int (a sync on CUDA).

    Under ``torch.compile`` the check becomes an asynchronous assert in the graph (no host read, so a
    ``fullgraph`` trace does not break; on CUDA a failure is a device-side assert)."""
    if torch.compiler.is_compiling():
        torch._assert_async(num_invalid.eq(0).all(), "routes name an expert id outside [0, E)")
        return
    n = int(num_invalid.item())
    if n:
        raise ValueError(f"{n} routes name an expert id outside [0, E={num_experts}); every id in topk_ids "
                         f"must be a valid global expert index")
