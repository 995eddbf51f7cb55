"""What the megakernel launchers share (``kittenmoe.launch_forward``, ``kittenmoe.launch_backward``): the device
checks, the error flags and ``MegakernelError``, the routed-row ring's geometry, the FP8 weights' checks, the
program count, trace buffers, the one-rank route inverse, and the inputs' validation.

No host sync on a GPU: sizes come from shapes and the config, never from data; errors found on device
(timeouts, expert ids out of range) land in an error flag read by ``check_errors``. The launchers call
``interpreting``, ``check_device``, ``check_gluon_device`` and ``num_programs`` through this module, so that one
patch here (``tools/sm90_build.py``'s compile-only builds, the tests' meta-tensor harness) reaches both.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from dataclasses import dataclass

import torch
import triton

from kittenmoe.checks import check_moe_inputs, interpreting
from kittenmoe.config import KernelConfig
from kittenmoe.intmath import cdiv
from kittenmoe.kernels import megakernel_fwd as mk
from kittenmoe.peers import LocalPeers

if TYPE_CHECKING:
    from kittenmoe.fp8 import FP8ExpertWeights

__all__ = ["COPY_BLOCK_H", "COPY_ROWS", "DEFAULT_MAX_SPIN", "FP8_BLOCK", "MegakernelError", "RingGeometry", "Saved",
           "check_device", "check_errors", "check_fp8", "check_fp8_type", "check_gluon_device", "fp8_dgu_block",
           "interpreting", "num_programs", "prepare_inputs", "tma_capable", "trace_buffer"]


# Polls before a wait gives up and flags a timeout. One poll is an atomic
# load (~0.5-1 us on an H200), so 2^22 polls is a few seconds: far beyond any
# legitimate wait (a whole seed-shape forward is a few ms).
DEFAULT_MAX_SPIN = 1 << 22


# Rows each communication step moves, and columns per load: 32 x 512 bf16 is
# a 32 KiB chunk in flight per program per step (more bytes in flight per SM
# is what raises a copy program's bandwidth).
COPY_ROWS = 32
COPY_BLOCK_H = 512


class MegakernelError(RuntimeError):
    """A device-side failure reported through the megakernel's error flag."""


def check_errors(err: torch.Tensor, num_invalid: torch.Tensor | None = None, num_experts: int | None = None) -> None:
    """Raise ``MegakernelError`` if a megakernel flagged an error (reads the flag: a sync on CUDA). With the
    schedule's ``num_invalid`` and the expert count, a bad-id message says how many routes and what E is."""
    code = int(err.max().item())
    if code == 0:
        return
    what = []
    if code & mk.ERR_TIMEOUT:
        what.append("a spin-wait timed out (a producer never signalled: programs not co-resident, or a bug)")
    if code & mk.ERR_BAD_EXPERT_ID:
        if num_invalid is not None and num_experts is not None:
            n = int(num_invalid.sum().item())
            what.append(f"topk_ids held expert ids outside [0, E={num_experts}) in {n} route(s); those routes were "
                        f"not computed")
        else:
            what.append("topk_ids held expert ids outside [0, E); those routes were not computed")
    raise MegakernelError("megakernel error: " + "; ".join(what))


def check_device(device: torch.device) -> None:
    """The megakernels run on CUDA devices, or on CPU tensors under the Triton interpreter: refuse any other
    device with a RuntimeError that says so (the layer checks its device with this before any launch)."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise RuntimeError(
        f"the megakernel runs on CUDA devices, or on CPU tensors under the Triton interpreter "
        f"(TRITON_INTERPRET=1 set before kittenmoe is imported); got tensors on {device}. "
        f"Use kittenmoe.torch_backend for a CPU path without the interpreter.")


@dataclass(frozen=True)
class RingGeometry:
    """Sizes of the routed-row ring of one rank, all from shapes and config."""

    capacity: int  # C: worst-case routed rows
    minibatch: int  # MB
    macrobatch: int  # MAC: rows the ring buffers hold
    slots: int  # NSLOT = MAC // MB
    num_minibatches: int  # NMB: worst-case processing indices

    @staticmethod
    def make(capacity: int, config: KernelConfig) -> "RingGeometry":
        mb = config.minibatch_size
        full = cdiv(capacity, mb) * mb
        mac = full if config.macrobatch_size is None else min(config.macrobatch_size, full)
        slots = mac // mb
        return RingGeometry(capacity, mb, mac, slots, cdiv(capacity, mac) * slots)

    @property
    def resident(self) -> bool:
        """The ring never wraps: every routed row keeps its own slot until the forward ends, so the backward
        can read all the forward's routed activations instead of replaying them (a wrapping ring leaves
        macrobatch 0 only)."""
        return self.macrobatch >= self.capacity

    def live_minibatches(self, num_rows: int) -> list[int]:
        """Processing indices that hold rows (host mirror of the kernel's ``_mb_rows``)."""
        nmac = cdiv(num_rows, self.macrobatch)
        out = []
        for p in range(self.num_minibatches):
            m = nmac - 1 - p // self.slots
            if m >= 0 and m * self.macrobatch + (p % self.slots) * self.minibatch < num_rows:
                out.append(p)
        return out


# What a forward keeps for its backward (ForwardState.saved): the ring's x rows [MAC, H], their gate|up
# [MAC, 2I] and the shared expert's gate|up [T, 2S] (None without a shared expert), all in x's dtype.
Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def tma_capable(config: KernelConfig, dev: torch.device, dtype: torch.dtype) -> bool:
    """TMA descriptors are asked for (``config.tma``) and possible: a Hopper-or-newer GPU, 2-byte operands."""
    if not config.tma or dev.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9 and dtype in (torch.bfloat16, torch.float16)


def check_gluon_device(dev: torch.device, knob: str = "wgrad='gluon'", instead: str = "wgrad='persistent'") -> None:
    """The Gluon kernels issue wgmma, which only sm_90 (Hopper) has, and call Gluon's API as Triton 3.6 to 3.9
    spell it (``gluon_api_missing``): NotImplementedError naming the knob (``KernelConfig.<knob>``) and what to set
    instead, elsewhere."""
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    if cap is None or cap[0] != 9:
        raise NotImplementedError(f"KernelConfig.{knob} issues Hopper's wgmma (sm_90); this device is {dev}"
                                  f"{'' if cap is None else f' (sm_{cap[0]}{cap[1]})'}: set {instead}")
    missing = gluon_api_missing()
    if missing is not None:
        raise NotImplementedError(f"KernelConfig.{knob}'s Gluon kernel calls Gluon's API as Triton 3.6 to 3.9 "
                                  f"spell it; Triton {triton.__version__} has no {missing}: set {instead}")


# What the Gluon kernels (kernels/*_gluon.py) call by name: (module, attribute), where "a|b" means either name
# (kernels/gluon_api.py binds each such pair to the one this Triton has: 3.9 renamed what 3.6 calls
# gl.thread_barrier, the TMA and cp.async copies, and the shared-memory descriptor's _reinterpret). A Triton
# that lacks any entry does not run them.
GLUON_API = (
    ("triton.experimental.gluon.language", "barrier|thread_barrier"),
    ("triton.experimental.gluon.language", "warp_specialize"),
    ("triton.experimental.gluon.language", "inline_asm_elementwise"),
    ("triton.experimental.gluon.language", "NVMMADistributedLayout"),
    ("triton.experimental.gluon.language._core", "shared_memory_descriptor.reinterpret|_reinterpret"),
    ("triton.experimental.gluon.language.nvidia.hopper", "warpgroup_mma"),
    ("triton.experimental.gluon.language.nvidia.hopper", "fence_async_shared"),
    ("triton.experimental.gluon.language.nvidia.hopper.tma", "async_load|async_copy_global_to_shared"),
    ("triton.experimental.gluon.language.nvidia.hopper.tma", "async_store|async_copy_shared_to_global"),
    ("triton.experimental.gluon.language.nvidia.hopper.tma", "store_wait"),
    ("triton.experimental.gluon.language.nvidia.hopper.mbarrier", "expect"),
    ("triton.experimental.gluon.language.nvidia.ampere.async_copy", "async_load|async_copy_global_to_shared"),
    ("triton.experimental.gluon.language.nvidia.ampere.async_copy", "mbarrier_arrive"),
    ("triton.experimental.gluon.nvidia.hopper", "TensorDescriptor"),
)


def gluon_api_missing() -> str | None:
    """The first entry of ``GLUON_API`` this Triton lacks (``module.attribute``, alternatives as ``a|b``), or None
    when it has them all. Asked by every launch's kernel choice (three times a forward+backward), so the answer
    is kept a table: the installed Triton does not change within a process."""
    return _api_missing(GLUON_API)


@functools.cache
def _api_missing(api: tuple[tuple[str, str], ...]) -> str | None:
    for module, attr in api:
        try:
            root = importlib.import_module(module)
        except ImportError:
            return module
        *path, last = attr.split(".")
        for part in path:
            root = getattr(root, part, None)
            if root is None:
                return f"{module}.{attr}"
        if not any(hasattr(root, name) for name in last.split("|")):
            return f"{module}.{attr}"
    return None


def gluon_runs_here(dev: torch.device, module: str) -> bool:
    """Whether a Gluon kernel module (``kittenmoe.kernels.<module>``) can run a launch on ``dev``: a Hopper GPU
    (wgmma), outside the interpreter, with a Triton whose Gluon API has every name the kernels use
    (``gluon_api_missing``). What the kernel knobs' "auto" values ask before their per-launch conditions."""
    if interpreting() or dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
        return False
    if gluon_api_missing() is not None:
        return False
    try:
        importlib.import_module(f"kittenmoe.kernels.{module}")
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return True


FP8_BLOCK = 128  # the K step of the FP8 routed GEMMs (kernel constexpr SB; a placeholder without FP8)


def check_fp8_type(fp8) -> None:
    from kittenmoe.fp8 import FP8ExpertWeights

    if fp8 is not None and not isinstance(fp8, FP8ExpertWeights):
        raise TypeError(f"fp8 must be a kittenmoe.fp8.FP8ExpertWeights or None, got {type(fp8).__name__}")


def fp8_dgu_block(config: KernelConfig, scale_block: int) -> int:
    """The FP8 backward's d(gate|up) quantisation block (1 x this along 2I), also its gate|up dgrad's K step:
    phase A's tile width (block_n / 2), or the scale block when that is narrower (MXFP8's 32)."""
    return min(max(16, config.block_n // 2), scale_block)


def check_fp8(fp8, config: KernelConfig, L: int, H: int, I: int, dev: torch.device):
    check_fp8_type(fp8)
    b = fp8.cfg.scale_block
    if config.block_n % b:
        raise ValueError(f"FP8 megakernel: block_n must be a multiple of the scale block ({b}) so each gate|up "
                         f"tile's hidden rows hold whole scale blocks; got block_n={config.block_n}")
    dgb = fp8_dgu_block(config, b)
    # e4m3 tensor-core dots need K >= 32 (Triton refuses to compile less); with FP8Config.dx_high nothing is
    # quantised in d(gate|up) blocks
    if dgb < 32 and not fp8.cfg.dx_high:
        raise ValueError(f"FP8 megakernel: block_n={config.block_n} makes the backward's d(gate|up) blocks {dgb} "
                         f"wide, its gate|up dgrad's K step, under the 32 an e4m3 dot needs: use block_n >= 64")
    if H % b or I % b:
        raise ValueError(f"FP8 megakernel: H={H} and I={I} must be multiples of the scale block {b}")
    if I % config.block_n:  # the e4m3 gate|up tiles are not masked at I: a partial tile would read up rows as gate
        raise ValueError(f"FP8 megakernel: I={I} must be a multiple of block_n={config.block_n} (whole gate|up "
                         f"tiles)")
    if tuple(fp8.w13_q.shape) != (L, 2 * I, H) or tuple(fp8.w2_q.shape) != (L, H, I):
        raise ValueError(f"FP8 megakernel: fp8 weights {tuple(fp8.w13_q.shape)} / {tuple(fp8.w2_q.shape)} do not "
                         f"match this rank's experts {(L, 2 * I, H)} / {(L, H, I)}")
    # (the transposes, when given: the kernels index them as contiguous [L, H, 2I] / [L, I, H])
    parts = [t for t in (fp8.w13_q, fp8.w13_scale, fp8.w2_q, fp8.w2_scale, fp8.w13_qt, fp8.w2_qt) if t is not None]
    if any(t.device != dev or not t.is_contiguous() for t in parts):
        raise ValueError(f"FP8 megakernel: the fp8 weights, their transposes and scales must be contiguous tensors "
                         f"on {dev}, got {[(str(t.device), t.is_contiguous()) for t in parts]}")


def num_programs(device: torch.device, num_comm: int) -> int:
    if device.type == "cuda":
        n = torch.cuda.get_device_properties(device).multi_processor_count
        if num_comm >= n:
            raise ValueError(f"num_comm_programs_fwd={num_comm} leaves no compute program on a GPU with {n} SMs")
        return n
    return num_comm + 3  # interpreter: a few compute programs exercise the round-robin


def trace_buffer(n_gemm: int, comm_iters: int, num_comm: int, dev: torch.device, extra: int = 0
                  ) -> tuple[torch.Tensor, dict]:
    """A traced launch's event buffer ([MAXE, 5] int64, unused rows -1) and its kernel constexprs: one slot per
    GEMM tile (``n_gemm``, the kernel's tile count), then a pull and a push slot per comm program and
    processing index (``comm_iters`` of them), then ``extra`` (the backward's wide phase-A epilogues)."""
    maxe = n_gemm + 2 * comm_iters * num_comm + extra
    return torch.full((maxe, 5), -1, dtype=torch.int64, device=dev), dict(TRACE=True, MAXE=maxe)


def prepare_inputs(x_RTH, topk_ids_RTK, topk_weights_RTK, w13_E2IH, w2_EHI, shared_w13_2SH, shared_w2_HS,
             peers: LocalPeers | None):
    """Validate the inputs and the device; return the dimensions and the peers to use."""
    dims = check_moe_inputs(x_RTH, topk_ids_RTK, topk_weights_RTK, w13_E2IH, w2_EHI, shared_w13_2SH,
                            shared_w2_HS)
    dev = w13_E2IH.device
    check_device(dev)
    if peers is None:
        peers = LocalPeers(dims.r, dev)
    elif peers.num_ranks != dims.r or peers.device != dev:
        raise ValueError(f"peers has {peers.num_ranks} ranks on {peers.device}; the inputs need {dims.r} on {dev}")
    return dims, peers
