"""Model shapes, kernel knobs and their validation.

Shape legend used across the package (torchtitan's habit):
    T tokens per rank, H hidden, I expert width, E experts (global),
    K top-k, R ranks, N routed rows on this rank, L = E // R local experts.
A name such as ``w13_E2IH`` is a tensor of shape [E, 2*I, H].
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

ScoreFunc = Literal["softmax", "sigmoid"]
# KernelConfig.wgrad: the kernel of the backward's weight gradients
WgradKernel = Literal["triton", "persistent", "gluon"]
WGRAD_KERNELS: tuple[str, ...] = ("triton", "persistent", "gluon")
# KernelConfig.forward_kernel: the forward megakernel's implementation
ForwardKernel = Literal["triton", "gluon", "gluon-gather", "auto"]
FORWARD_KERNELS: tuple[str, ...] = ("triton", "gluon", "gluon-gather", "auto")
# KernelConfig.backward_kernel: the backward megakernel's implementation
BackwardKernel = Literal["triton", "gluon", "auto"]
BACKWARD_KERNELS: tuple[str, ...] = ("triton", "gluon", "auto")


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer's shape: routed experts plus one shared expert.

    ``shared_i`` is the shared expert's width; the seed models use one shared
    expert of width ``i`` (MoK's convention), so it defaults to ``i``.
    """

    name: str
    e: int  # routed experts, global
    h: int  # hidden width
    i: int  # routed expert width
    k: int  # experts per token
    shared_i: int | None = None
    score_func: ScoreFunc = "sigmoid"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        for field in ("e", "h", "i", "k"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{field} must be a positive int, got {v!r}")
        if self.k > self.e:
            raise ValueError(f"ModelShape: top-k K={self.k} exceeds the number of experts E={self.e}")
        if self.shared_i is not None and (not isinstance(self.shared_i, int) or isinstance(self.shared_i, bool)
                                          or self.shared_i < 0):
            raise ValueError(f"ModelShape.shared_i must be >= 0 (0 = no shared expert), got {self.shared_i}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelShape.score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"ModelShape.renormalize must be a bool, got {self.renormalize!r}")
        rsf = self.routed_scaling_factor
        if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real) or not math.isfinite(rsf) or rsf <= 0:
            raise ValueError(f"ModelShape.routed_scaling_factor must be a finite number > 0, got {rsf!r}")
        from kittenmoe.checks import check_swiglu_limit  # (imports torch, which this module imports where it needs it)

        check_swiglu_limit(self.swiglu_limit, "ModelShape.swiglu_limit")

    @property
    def shared_width(self) -> int:
        return self.i if self.shared_i is None else self.shared_i

    def experts_per_rank(self, ep: int) -> int:
        if ep <= 0 or self.e % ep:
            raise ValueError(f"{self.name}: E={self.e} experts cannot be split evenly over EP={ep} ranks")
        return self.e // ep

    def with_(self, **changes) -> "ModelShape":
        return dataclasses.replace(self, **changes)


# The four seed models (docs/design.md "Shapes"). DeepSeek-V4 adds the SwiGLU clamp;
# its published limit is 7.0 (gate <= 7, -7 <= up <= 7).
SEED_SHAPES: dict[str, ModelShape] = {
    "kimi-k2.7": ModelShape("kimi-k2.7", e=384, h=7168, i=2048, k=8, routed_scaling_factor=2.827),
    "glm-5.2": ModelShape("glm-5.2", e=256, h=6144, i=2048, k=8, routed_scaling_factor=2.5),
    "qwen3.5-397b-a17b": ModelShape("qwen3.5-397b-a17b", e=512, h=4096, i=1024, k=10, score_func="softmax"),
    "deepseek-v4-pro": ModelShape("deepseek-v4-pro", e=384, h=7168, i=3072, k=6, routed_scaling_factor=2.5,
                                  swiglu_limit=7.0),
}

# The one-GPU benchmark slices: tokens of each seed shape at EP8 (E_local = E / 8, R = 1, every route
# local). Qwen's fewer, narrower experts take twice the tokens for a comparable amount of work.
SLICE_TOKENS: dict[str, int] = {"kimi-k2.7": 2048, "deepseek-v4-pro": 2048, "qwen3.5-397b-a17b": 4096, "glm-5.2": 2048}

# Small shapes for CPU tests and the demo: widths that exercise tile edges
# (H and I not multiples of 64) while staying fast under the interpreter.
TEST_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", e=8, h=32, i=16, k=2, score_func="softmax"),
    "tiny-sigmoid": ModelShape("tiny-sigmoid", e=16, h=48, i=24, k=4, routed_scaling_factor=2.0,
                               swiglu_limit=1.5),
    "small": ModelShape("small", e=16, h=128, i=64, k=4, score_func="softmax"),
}

SHAPES: dict[str, ModelShape] = {**SEED_SHAPES, **TEST_SHAPES}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(SHAPES))}") from None


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def gluon_wgrad_tiles_ok(block_n: int, block_k: int, block_m: int) -> bool:
    """``KernelConfig.wgrad="gluon"``'s tile: block_n x 2 block_n = 128 x 256 outputs, 64-row steps
    (min(block_k, block_m)). One home for the condition: KernelConfig checks it, ``default_config`` picks the
    Gluon kernel only where it holds, and ``KernelConfig.with_overrides`` (``--config``, the tuner's grid, the FP8
    tile width) turns it into "persistent" where a tile change breaks it rather than building a config that is
    refused."""
    return block_n == 128 and min(block_k, block_m) == 64


def gluon_wgrad_gradient_ok(n: int, m: int) -> bool:
    """One [N, M] weight gradient the Gluon kernel takes: N rows a multiple of its 128-row tile (a tile's TMA
    store must not run into the next expert's gradient) and M columns of 16-byte rows (2-byte elements)."""
    return n % 128 == 0 and m % 8 == 0


def gluon_wgrad_shape_ok(h: int, i: int, s: int | None) -> bool:
    """``gluon_wgrad_gradient_ok`` for every gradient of the layer: d_W13 [2I, H] and d_W2 [H, I], and the shared
    expert's [2S, H] and [H, S]. ``s`` None: the shared width is not known here (assumed to fit; the backward
    refuses one that does not, saying so)."""
    grads = [(2 * i, h), (h, i)] + ([(2 * s, h), (h, s)] if s else [])
    return all(gluon_wgrad_gradient_ok(n, m) for n, m in grads)


_BOOL_KNOBS = ("combine_gather", "tma", "keep_activations")


@functools.lru_cache(maxsize=1024)
def _replaced(config: "KernelConfig", changes: tuple) -> "KernelConfig":
    """``dataclasses.replace(config, **changes)`` for ``changes`` as (name, type, value) triples, kept:
    KernelConfig is frozen, so equal inputs give equal configs, and a change that fails validation raises every
    time (exceptions are not kept)."""
    return dataclasses.replace(config, **{k: v for k, _, v in changes})


@dataclass(frozen=True)
class KernelConfig:
    """The megakernels' knobs (docs/design.md "Knobs"): what each moves, its constraint, and why its default (H200
    timings on the four seed slices, Kimi, DeepSeek, Qwen and GLM at one EP8 rank; ``default_config`` sets the
    CUDA values, the dataclass defaults are its one-rank-agnostic baseline). Knobs measured and retired:
    docs/experiments/.

    num_comm_programs_fwd: programs (SMs) of the forward that pull routed rows and push finished ones instead of
        running GEMM tiles. 0 needs ``combine_gather`` (one rank, a ring that does not wrap): every program pulls
        its share of all routed rows first, then runs tiles; the same bits. The pull limited the forward at 8
        (Kimi 6.75 ms against 4.58 at 16); ``default_config``: 16 / 12 / 8 as I grows (bytes per FLOP fall), 0
        on one rank.
    num_comm_programs_bwd: the same for the backward (pull x, d_out and router weights; push d_x and d_w). 0 needs
        ``combine_gather``. ``default_config``: 16, 12 on one rank with I > 1024 (Kimi and GLM ~3% faster), 0
        with the gather.
    minibatch_size: rows handed from communication to compute at a time; a multiple of ``block_m`` (a row tile
        never straddles two minibatches). 2048: the seed slices' optimum (Kimi forward 4.06 ms against 4.54 at
        1024).
    macrobatch_size: routed rows the ring holds at once, a multiple of ``minibatch_size``; None sizes the buffers
        for the worst case, so the ring never wraps. ``default_config`` sets a ring only where the worst-case
        buffers would pass min(8 GiB, 1/8 of the GPU's memory).
    block_m: GEMM row tile, also the padding of each expert's segment; a power of two in 16-256. 128; 64 where
        experts average under 96 rows (the padding would dominate).
    block_n, block_k: GEMM column tile and K step, powers of two in 16-256; the gate|up tile must fit 227 KB of
        shared memory at ``num_stages`` (``gate_up_smem_bytes``). 128 x 64: block_n 64 with 4 warps ran the Kimi
        forward at 5.54 ms against 4.06, block_k 32 at 5 stages at 4.45.
    num_stages: pipeline stages of the forward's GEMM loops and of the weight-gradient launch. 4: the Kimi forward
        4.06 ms against 4.20 at 3.
    num_warps: warps a program: 1, 2, 4, 8 or 16. 8: a 128 x 256 fp32 accumulator is 128 registers a thread.
    combine_gather: one rank (R=1) and a ring that does not wrap: nothing is pushed; the epilogues read each
        route's row where it was computed (the forward's y_routed, the backward's d_x rows and d_w partials)
        through an inverse of the schedule. The same bits. ``default_config`` sets it on one rank with 2-byte
        operands, with no comm programs: forward+backward 0.4-4.5% faster (the combine buffers, 2 x T*K*H, not
        allocated).
    tma: load GEMM operands through TMA descriptors where possible (a Hopper-or-newer GPU, bf16/fp16, widths that
        divide into tiles); otherwise, and always under the interpreter, pointer loads. TMA with 4 stages: the
        Kimi forward 3.88 ms against 4.20 with pointer loads.
    keep_activations: a forward that autograd will differentiate keeps its ring's routed x rows and gate|up
        pre-activations in x's dtype ((H + 2 I) x dtype bytes a row; ~0.42 GB a layer on the Kimi slice) and
        the shared expert's gate|up (2 S x dtype bytes a token), so the backward skips the gate|up replay for
        those rows (4 of phase A's 6 FLOPs an element). A wrapping ring keeps macrobatch 0 only (the forward
        runs macrobatches last to first). False: always replay.
    wgrad: the backward's weight-gradient kernel, one of "triton", "persistent", "gluon"; the same tiles
        (block_n x 2 block_n outputs, min(block_k, block_m)-row steps), order and bits in each. "triton": one
        program a tile, which pays its pipeline fill and 64 KB store alone (~450 TFLOP/s on Kimi, six 64-row
        steps a tile). "persistent": one program an SM walking its tiles, each tile stored through a TMA buffer
        that drains under the next tile's K loop: forward+backward 0.3-2.7% faster. "gluon": a warp-specialized
        Gluon kernel (``kernels/wgrad_gluon.py``) whose producer warp keeps the TMA ring full across tiles: the
        launches 1.10-1.26x faster than the Triton kernel's (Kimi d_W13 1.887 ms against 2.204), forward+
        backward medians 0.9-5.7% lower; it needs Hopper (wgmma), TMA with 2-byte operands, block_n 128 and
        64-row steps (``gluon_wgrad_tiles_ok``), and every gradient's rows a multiple of 128 with 16-byte rows
        (``gluon_wgrad_shape_ok``; the backward refuses others before launching); the interpreter refuses it
        (NotImplementedError). ``default_config``: "persistent" with 2-byte operands, "gluon" on Hopper where
        the shapes fit.
    forward_kernel: the forward megakernel, "triton" (``kernels/megakernel_fwd.py``: every role, every rank
        count, FP8, the interpreter) or "gluon" (``kernels/megakernel_fwd_gluon.py``: the same schedule, tiles
        and counters with a producer warp that keeps a TMA ring full across tiles and two math warpgroups; one
        rank with ``combine_gather``, no communication programs, 2-byte operands on Hopper, 128 x 128 x 64
        tiles (its TMA ring is 3 stages deep whatever ``num_stages``), I and S multiples of 128 and H of 256;
        ``launch_forward.forward_gluon_refusal`` says what a launch lacks, and the launch raises
        NotImplementedError then), or "gluon-gather" (the same kernel without the pull: a 4-warp producer
        gathers each gate|up tile's rows from x by cp.async, the ring ``num_stages`` deep, 2-4). The same bits.
        "auto": "gluon-gather" for each launch it can run (a Hopper GPU, Gluon's Hopper API, no interpreter, and
        ``forward_gluon_refusal`` None for it), else "triton"; the choice is per launch and changes no bits.
        ``default_config``: "auto" on CUDA with 2-byte operands (the forward 1.16-1.23x faster than the Triton
        kernel on an H100: Qwen3-30B-A3B's layer at 8,192 tokens, the fine-grained 32768 x 4096 x 512 x 128 x 8).
    backward_kernel: the backward megakernel (the data gradients; the weight gradients are ``wgrad``'s), "triton"
        (``kernels/megakernel_bwd.py``: every role, rank count, ring, FP8, the interpreter) or "gluon"
        (``kernels/megakernel_bwd_gluon.py``: the same tiles, order and counters, a 4-warp producer that gathers
        each phase-A tile's d_out rows by cp.async and keeps a TMA ring 3 stages deep across tiles (whatever
        ``num_stages``), two math warpgroups, and a partition that runs phase A's SwiGLU backward from their
        accumulators, handed over through shared memory, under their next K loops; one rank with
        ``combine_gather`` and no communication programs, every routed row's gate|up kept by the forward, 2-byte
        operands on Hopper, 128 x 128 x 64 tiles, I a multiple of 128 and H of 256, no shared expert;
        ``launch_backward.backward_gluon_refusal`` says what a launch lacks, and the launch raises
        NotImplementedError then). The same d_x and weight-gradient bits; the router-weight gradient's partial
        sums are added in another order (within 1e-5). "auto": "gluon" for each launch it can run (a Hopper
        GPU, Gluon's Hopper API, no interpreter, ``backward_gluon_refusal`` None), else "triton".
        ``default_config``: "auto" on CUDA with 2-byte operands (the backward megakernel 10% faster than the
        Triton kernel at Qwen3-30B-A3B's widths, 9% on 32768 x 4096 x 512 x 128 x 8, on an H100).
    tile_group_m: the order of a minibatch's GEMM tiles in both megakernels (the same bits in any order). 0:
        column tile by column tile, every row tile under one. G > 0: groups of G row tiles (the forward 1-3%
        slower at G = 4 and 8: fixed groups split an expert's row tiles, whose weight tiles are then read once
        a group). -1: each expert's row tiles a group, so its x rows stay in L2 over its column tiles (at 0
        DeepSeek's forward read 11.55 GB from DRAM for 6.5 GB of weights). ``default_config``: -1 with 2-byte
        operands, forward+backward 2.7-4.0% faster.
    bwd_num_stages: pipeline stages of the backward megakernel's GEMM loops; 0: min(num_stages, 3). 4 fits on sm_90
        at the default tiles (229,408 B: the loops share their buffers) and feeds phase A's long K loop over H
        (112 steps on Kimi, ~3.3 TFLOP/s a program against phase B's 5.6). ``default_config``: 4 at block_m 128
        with 2-byte operands where it fits (``bwd_phase_a_smem_bytes``); with "persistent" weight gradients
        forward+backward 2.3-4.6% faster than neither.
    """

    num_comm_programs_fwd: int = 16
    num_comm_programs_bwd: int = 16
    minibatch_size: int = 2048
    macrobatch_size: int | None = None
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 8
    combine_gather: bool = False
    tma: bool = True
    keep_activations: bool = True
    wgrad: WgradKernel = "triton"
    forward_kernel: ForwardKernel = "triton"
    backward_kernel: BackwardKernel = "triton"
    tile_group_m: int = 0
    bwd_num_stages: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            v = getattr(self, field.name)
            if field.name == "macrobatch_size" and v is None:
                continue
            if field.name == "wgrad":
                if not isinstance(v, str) or v not in WGRAD_KERNELS:
                    raise ValueError(f"KernelConfig.wgrad must be one of {', '.join(map(repr, WGRAD_KERNELS))}, "
                                     f"got {v!r}")
                continue
            if field.name in ("forward_kernel", "backward_kernel"):
                names = FORWARD_KERNELS if field.name == "forward_kernel" else BACKWARD_KERNELS
                if not isinstance(v, str) or v not in names:
                    raise ValueError(f"KernelConfig.{field.name} must be one of {', '.join(map(repr, names))}, "
                                     f"got {v!r}")
                continue
            if field.name in _BOOL_KNOBS:
                if not isinstance(v, bool):
                    raise TypeError(f"KernelConfig.{field.name} must be a bool, got {v!r}")
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"KernelConfig.{field.name} must be an int, got {type(v).__name__} {v!r}")
        if self.num_comm_programs_fwd < 0:
            raise ValueError(f"KernelConfig.num_comm_programs_fwd must be >= 0 (0: every program pulls, then "
                             f"computes), got {self.num_comm_programs_fwd}")
        if self.num_comm_programs_fwd == 0 and not self.combine_gather:
            raise ValueError("KernelConfig.num_comm_programs_fwd=0 leaves no program to push finished rows: it "
                             "needs combine_gather=True (the final epilogue reads them where they were computed)")
        if self.num_comm_programs_bwd < 0:
            raise ValueError(f"KernelConfig.num_comm_programs_bwd must be >= 0 (0: every program pulls, then "
                             f"computes), got {self.num_comm_programs_bwd}")
        if self.num_comm_programs_bwd == 0 and not self.combine_gather:
            raise ValueError("KernelConfig.num_comm_programs_bwd=0 leaves no program to push the d_x rows: it "
                             "needs combine_gather=True (the backward's epilogue reads them)")
        if self.wgrad == "gluon" and not gluon_wgrad_tiles_ok(self.block_n, self.block_k, self.block_m):
            raise ValueError(f"KernelConfig.wgrad='gluon' builds 128 x 256 weight-gradient tiles of 64-row steps: "
                             f"it needs block_n=128 and min(block_k, block_m)=64; got block_n={self.block_n}, "
                             f"block_k={self.block_k}, block_m={self.block_m}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16 (tl.dot tile), got {v}")
        if self.block_m > 256 or self.block_n > 256 or self.block_k > 256:
            raise ValueError("KernelConfig: block sizes above 256 do not fit shared memory")
        if self.minibatch_size < self.block_m or self.minibatch_size % self.block_m:
            raise ValueError(f"KernelConfig.minibatch_size={self.minibatch_size} must be a positive multiple "
                             f"of block_m={self.block_m}")
        if self.macrobatch_size is not None and (
                self.macrobatch_size < self.minibatch_size or self.macrobatch_size % self.minibatch_size):
            raise ValueError(f"KernelConfig.macrobatch_size={self.macrobatch_size} must be a positive multiple "
                             f"of minibatch_size={self.minibatch_size} (or None for no ring)")
        if self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.bwd_num_stages < 0:
            raise ValueError(f"KernelConfig.bwd_num_stages must be >= 0 (0: min(num_stages, 3)), got "
                             f"{self.bwd_num_stages}")
        if self.tile_group_m < -1:
            raise ValueError(f"KernelConfig.tile_group_m must be >= -1 (0: every row tile of a minibatch in one "
                             f"group; -1: each expert's row tiles a group), got {self.tile_group_m}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")

    def with_(self, **changes) -> "KernelConfig":
        """This config with ``changes``, each distinct result built and validated once (the launchers resolve
        their "auto" knobs with it on every call: ~15 us of validation a call saved each time)."""
        try:
            # (each value's type in the key: True == 1, and a knob that must be a bool refuses 1)
            return _replaced(self, tuple(sorted((k, type(v), v) for k, v in changes.items())))
        except TypeError:  # an unhashable value: built as it is, for the validation to name
            return dataclasses.replace(self, **changes)

    def with_overrides(self, **changes) -> "KernelConfig":
        """``with_(**changes)`` for a caller's knobs on top of a tuned or heuristic config (``--config``, the
        tuner's grid, the FP8 tile width, the transformers integration's ``knobs``). The knobs the heuristic
        derived from the ones that change follow them, so the result runs where ``with_`` would build a config
        a launch refuses; a knob ``changes`` names is never touched (and is then checked as given):

        - ``wgrad`` "gluon" becomes "persistent" where its 128 x 256 tile no longer fits
          (``gluon_wgrad_tiles_ok``) or with ``tma=False``;
        - ``bwd_num_stages`` back to 0 (``bwd_stages``' default) where the backward's phase-A tile no longer
          fits shared memory at the set depth (``bwd_phase_a_smem_bytes``, 2-byte operands: the heuristic sets
          the depth only for those);
        - ``combine_gather`` off when ``changes`` ask for a ring (``macrobatch_size``; the caller passes None
          where its ring would not wrap), or turn it off; then communication programs at 0 take
          ``KernelConfig()``'s counts, since something must push.

        ``default_config(..., overrides=...)`` applies the same rules while it builds the heuristic (and derives
        the stages and ring from pinned tiles too)."""
        # the knobs as they would merge, unvalidated: the merged config may be one KernelConfig refuses
        v = {f.name: changes.get(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        derived = {}
        if v["wgrad"] == "gluon" and "wgrad" not in changes and (
                not gluon_wgrad_tiles_ok(v["block_n"], v["block_k"], v["block_m"]) or not v["tma"]):
            derived["wgrad"] = "persistent"  # the Triton kernel, one program an SM
        if self.combine_gather and "combine_gather" not in changes and changes.get("macrobatch_size") is not None:
            derived["combine_gather"] = False
        if self.combine_gather and not derived.get("combine_gather", v["combine_gather"]):
            plain = KernelConfig()
            for knob in ("num_comm_programs_fwd", "num_comm_programs_bwd"):
                if v[knob] == 0 and knob not in changes:
                    derived[knob] = getattr(plain, knob)
        cfg = self.with_(**changes, **derived)
        if cfg.bwd_num_stages and "bwd_num_stages" not in changes \
                and bwd_phase_a_smem_bytes(cfg) > SHARED_MEMORY_LIMIT:
            cfg = cfg.with_(bwd_num_stages=0)
        return cfg

    @property
    def bwd_stages(self) -> int:
        """The backward megakernel's pipeline stages: ``bwd_num_stages``, or min(num_stages, 3) when 0."""
        return self.bwd_num_stages or min(self.num_stages, 3)


def routed_capacity(r: int, t: int, k: int, experts_per_rank: int, block_m: int) -> int:
    """Worst-case routed rows on one rank: every route of every rank lands here,
    plus the padding of each local expert's segment to ``block_m``."""
    return r * t * k + experts_per_rank * (block_m - 1)


# ----------------------------------------------------------------------------- heuristic

# Shared memory a Hopper SM gives one thread block (H100/H200: 227 KB).
SHARED_MEMORY_LIMIT = 227 * 1024


def _gate_up_bytes(bm: int, bn: int, bk: int, stages: int, elem_bytes: int) -> int:
    return stages * (bm * bk + 2 * bn * bk) * elem_bytes


def _bwd_bytes(bm: int, bn: int, bk: int, num_stages: int, bwd_stages: int, elem_bytes: int) -> int:
    bna = max(16, bn // 2)
    phase_a = bwd_stages * (2 * bm * bk + 3 * bna * bk) * elem_bytes
    # phase B: a block_m x block_k row tile and a block_k x 2 block_n weight tile per stage
    phase_b = bwd_stages * (bm + 2 * bn) * bk * elem_bytes
    # weight-gradient launch (all num_stages): block_k rows of a block_n- and a 2 block_n-wide operand
    wgrad = num_stages * (bk * 3 * bn) * elem_bytes
    return max(phase_a, phase_b, wgrad)


def gate_up_smem_bytes(config: KernelConfig, elem_bytes: int = 2) -> int:
    """Shared-memory estimate of the gate|up GEMM tile, the largest in the forward megakernel.

    Each pipeline stage holds one ``block_m x block_k`` activation tile and the
    matching gate and up weight tiles (``2 x block_n x block_k``):
    ``num_stages * (BM*BK + 2*BN*BK) * elem_bytes``. An estimate, not
    Triton's exact figure (epilogue layout conversions add some), used to
    skip tile choices that cannot fit before compiling them.
    """
    return _gate_up_bytes(config.block_m, config.block_n, config.block_k, config.num_stages, elem_bytes)


def bwd_phase_a_smem_bytes(config: KernelConfig, elem_bytes: int = 2) -> int:
    """Shared-memory estimate of the backward's largest tile: at ``config.bwd_stages`` phase A holds per stage
    the d_out and x row tiles (``2 x block_m x block_k``) and three weight tiles of half width
    (``3 x block_n/2 x block_k``), phase B ``(block_m + 2 block_n) x block_k`` (which also covers phase A's kept
    down dgrad alone, ``(block_m + block_n) x block_k``); the weight-gradient launch ``block_k x 3 block_n`` with
    all ``num_stages``."""
    return _bwd_bytes(config.block_m, config.block_n, config.block_k, config.num_stages, config.bwd_stages,
                      elem_bytes)


def check_shared_memory(config: KernelConfig, elem_bytes: int, backward: bool = False) -> None:
    """Raise a clear ``ValueError`` when the config's largest tile cannot fit a GPU's shared memory."""
    need = bwd_phase_a_smem_bytes(config, elem_bytes) if backward else gate_up_smem_bytes(config, elem_bytes)
    if need > SHARED_MEMORY_LIMIT:
        which = "backward phase-A" if backward else "forward gate|up"
        raise ValueError(
            f"{config} needs about {need // 1024} KB of shared memory for its {which} tile with "
            f"{elem_bytes}-byte operands; a GPU block has {SHARED_MEMORY_LIMIT // 1024} KB. Lower num_stages"
            f"{' or bwd_num_stages' if backward else ''}, "
            f"block_n or block_k (kittenmoe.config.default_config picks tiles that fit).")


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def _pinned_text(pinned: Mapping[str, object], names) -> str:
    """``a=1, b=2`` for the pinned knobs among ``names`` (all pinned knobs when none of them is)."""
    hit = [n for n in names if n in pinned] or list(pinned)
    return ", ".join(f"{n}={pinned[n]!r}" for n in hit)


def default_config(t: int, h: int, i: int, e: int, k: int, ranks: int = 1, device=None,
                   dtype=None, s: int | None = None, overrides: Mapping[str, object] | None = None) -> KernelConfig:
    """The heuristic ``KernelConfig`` for a problem when no tuned config is cached, around the caller's pinned
    knobs.

    ``t`` tokens per rank, hidden ``h``, expert width ``i``, ``e`` routed experts in total over ``ranks`` EP ranks
    (``e // ranks`` local experts), top-``k``; ``device`` (default: CUDA if available) and ``dtype`` (default
    bf16) of the operands; ``s`` the shared expert's width (0: none; None: not known, only the Gluon weight
    gradients read it). A balanced router sends about ``n = t * k`` rows to each rank, ``n_e = t * k * ranks / e``
    to each expert.

    ``overrides``: KernelConfig fields the caller pins. Each is honoured as given and the knobs the heuristic
    derives from it follow (the most stages that fit pinned tiles, the minibatch and the ring from a pinned
    ``block_m``, "persistent" weight gradients where pinned tiles or ``tma=False`` rule out the Gluon kernel's,
    the gather off for a pinned wrapping ring and on for pinned zero comm programs on one rank, ...); a pin the
    problem cannot run is refused with a ValueError naming it: an unknown field or bad value, tiles or stages
    past 227 KB of shared memory, ``combine_gather`` on several ranks or with a wrapping ring, ``wgrad="gluon"``
    off Hopper, off 2-byte operands, off TMA or off its widths, comm programs that leave no compute program.

    On CUDA (the H200 sweeps of the seed shapes sliced to one EP8 rank; elsewhere a guess the tuner replaces):

    - ``block_m`` 128, or 64 when experts average under 96 rows (the padding of each expert's segment to
      ``block_m`` would dominate);
    - ``minibatch_size`` 2048 (the seed slices' optimum at ``n`` = 12-40 K rows); smaller problems use ``n / 4``
      rounded down to a power of two (at least ``block_m``) so the comm/compute pipeline still has ~4 steps;
    - ``num_comm_programs_fwd`` by bytes per FLOP, which fall as ``I`` grows (a routed row moves ``H`` elements
      for ``6*H*I`` FLOPs): 16 for ``I`` <= 1024, 12 up to 2048, 8 above (Qwen I=1024 best at 16, Kimi/GLM
      I=2048 at 12, DeepSeek I=3072 at 8); ``num_comm_programs_bwd`` 16, or 12 with one rank and ``I`` > 1024
      (the backward moves x and d_out; of 8/12/16, Kimi/GLM best at 12 by ~3%, DeepSeek ~1%, Qwen at 16; with
      several ranks the pull crosses NVLink and only 16 was timed). An eighth of the SMs for both on GPUs with
      fewer than 100 SMs;
    - ``block_n`` 128, ``block_k`` 64 for 2-byte operands (32 for fp32), and the most ``num_stages`` (<= 4)
      whose gate|up tile fits 227 KB of shared memory (``gate_up_smem_bytes``);
    - with 2-byte operands ``wgrad`` "persistent" and ``bwd_num_stages`` 4 at ``block_m`` 128 where the
      backward's tiles fit (``bwd_phase_a_smem_bytes``): forward+backward 2.3-4.6% faster on the four slices;
      ``tile_group_m`` -1 (each expert's row tiles of a minibatch walked together): another 2.7-4.0%; and on
      Hopper (sm_90) ``wgrad`` "gluon" (the warp-specialized Gluon kernel, the same bits) where the widths fit
      its 128-row tiles (``gluon_wgrad_shape_ok``: H and 2I, and 2S when ``s`` is given, multiples of 128)
      and Triton's Gluon API has every name the kernel calls (``launch_common.gluon_api_missing``):
      forward+backward medians 3.6-5.7% lower on Kimi, DeepSeek and GLM, past the run's A/A gap of 1.3-1.8%
      (15 of 15 paired rounds lower), 0.9% on Qwen (within its 4.4%);
    - ``macrobatch_size`` None (no ring) unless the worst-case routed buffers (x_routed, y_routed, hidden, and
      the gate|up ``keep_activations`` holds) exceed min(8 GiB, 1/8 of the GPU's memory); then the largest
      multiple of the minibatch that fits;
    - on one rank with no ring and 2-byte operands, ``combine_gather`` (no push; the epilogues read the rows
      where they were computed) and ``num_comm_programs_fwd`` 0 (every program pulls first): forward+backward
      0.4-4.5% faster on the four slices (17 of 25 paired rounds lower); and ``num_comm_programs_bwd`` 0 (the
      backward's pull the same way): medians 1.6-3.8% lower in one run, within what the same config read
      against itself (0-3.8%): one role fewer, the same bits, not a resolved speed gain.

    On CPU (the Triton interpreter, for tests) small tiles and few programs keep the sequential interpreter
    fast: ``block_m`` 16, ``block_n`` and ``block_k`` 32, one communication program, and a minibatch of the
    worst-case capacity rounded up to a power of two (at most 1024), so few launches run.
    """
    import torch

    for name, v in (("t", t), ("h", h), ("i", i), ("e", e), ("k", k), ("ranks", ranks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"default_config: {name} must be a positive int, got {v!r}")
    if e % ranks:
        raise ValueError(f"default_config: E={e} experts cannot be split evenly over R={ranks} ranks")
    if k > e:
        raise ValueError(f"default_config: top-k K={k} exceeds the number of experts E={e}")
    pinned = dict(overrides or {})
    fields = [f.name for f in dataclasses.fields(KernelConfig)]
    unknown = sorted(set(pinned) - set(fields))
    if unknown:
        raise ValueError(f"default_config: overrides name no KernelConfig field: {', '.join(unknown)} (fields: "
                         f"{', '.join(fields)})")

    def pick(name: str, value):
        return pinned[name] if name in pinned else value

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dtype is None else dtype
    elem = dtype.itemsize
    local = e // ranks
    n = t * k
    if pinned.get("combine_gather") is True and ranks != 1:
        raise ValueError(f"default_config: the pinned combine_gather=True runs one rank (the epilogues read this "
                         f"rank's rows); this problem has {ranks} ranks")
    if dev.type != "cuda":
        bm = pick("block_m", 16)
        mb = pick("minibatch_size",
                  min(1024, max(bm, 1 << (routed_capacity(ranks, t, k, local, bm) - 1).bit_length())))
        # no ring on CPU unless pinned: zero comm programs pinned on one rank take the gather they need
        gather = pick("combine_gather", ranks == 1 and pinned.get("macrobatch_size") is None and 0 in (
            pinned.get("num_comm_programs_fwd"), pinned.get("num_comm_programs_bwd")))
        return _pinned_config(pinned, dict(
            num_comm_programs_fwd=1, num_comm_programs_bwd=1, minibatch_size=mb, block_m=bm, block_n=32, block_k=32,
            num_stages=1, num_warps=4, combine_gather=gather))
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    wide = elem == 2  # the knobs below were timed with 2-byte operands only
    comm = 16 if sms >= 100 else max(1, sms // 8)
    comm_fwd = (16 if i <= 1024 else 12 if i <= 2048 else 8) if sms >= 100 else comm
    # 12 only where it was timed (one rank, I > 1024: the docstring's sweep); over NVLink only 16 was timed.
    comm_bwd = 12 if (sms >= 100 and ranks == 1 and i > 1024) else comm
    bm = pick("block_m", 128 if n * ranks / e >= 96 else 64)
    mb = pick("minibatch_size", 2048 if n >= 8192 else max(bm, _pow2_floor(n // 4)))
    bn, bk = pick("block_n", 128), pick("block_k", 64 if elem <= 2 else 32)
    stages = pick("num_stages", next((st for st in (4, 3, 2) if _gate_up_bytes(bm, bn, bk, st, elem)
                                      <= SHARED_MEMORY_LIMIT), 1))
    tma = pick("tma", True)
    # The backward's weight gradients from persistent programs (the same bits), and its megakernel's loops at 4
    # stages where they fit: together 2.3-4.6% off forward+backward on all four slices (persistent alone
    # 0.3-2.7%, the 4 stages 0.0-2.2% more). Both were timed with 2-byte operands (bf16 experts; FP8 experts'
    # backward only checked for bits), the stages at block_m 128. The Gluon kernel on Hopper (wgmma; the same
    # bits): forward+backward medians -5.7% (Kimi), -3.6% (DeepSeek, GLM), -0.9% (Qwen), the first three past
    # the run's A/A gap (1.3-1.8%). Its tile (128 x 256, 64-row steps) is this config's at 2-byte operands.
    from kittenmoe.launch_common import gluon_api_missing  # (launch_common imports this module)

    gluon = (wide and tma and props.major == 9 and gluon_wgrad_shape_ok(h, i, s)
             and gluon_wgrad_tiles_ok(bn, bk, bm) and gluon_api_missing() is None)
    wgrad = pick("wgrad", ("gluon" if gluon else "persistent") if wide else "triton")
    bwd_stages = pick("bwd_num_stages", 4 if wide and bm == 128 and _bwd_bytes(bm, bn, bk, stages, 4, elem)
                      <= SHARED_MEMORY_LIMIT else 0)
    # Expert runs (tile_group_m = -1): forward+backward 2.7-4.0% faster on all four slices, lower in 18 of 20
    # paired rounds; the forward alone within +-1.7%. The order changes no bits.
    tgm = pick("tile_group_m", -1 if wide else 0)
    keep = pick("keep_activations", True)
    cap = routed_capacity(ranks, t, k, local, bm)
    full = -(-cap // mb) * mb
    budget = min(8 << 30, props.total_memory // 8)
    row_bytes = (2 * h + i + (2 * i if keep else 0)) * elem  # x, y, hidden rows, and the gate|up kept
    mac = pick("macrobatch_size", max(mb, budget // row_bytes // mb * mb) if full * row_bytes > budget else None)
    resident = mac is None or mac >= cap
    if "combine_gather" in pinned:
        gather = pinned["combine_gather"]
        if gather is True and not resident:
            how = ("pin macrobatch_size=None" if "macrobatch_size" not in pinned
                   else f"a macrobatch_size of at least {cap}")
            raise ValueError(f"default_config: the pinned combine_gather=True reads every route's row after the "
                             f"launch, so the ring must hold all {cap} worst-case rows; the ring here holds {mac} "
                             f"(the heuristic's, sized for memory, unless pinned): {how}")
    else:
        # One rank, resident ring: no push (the epilogues read the rows where they were computed) and no comm
        # programs (every SM pulls its share first). Forward+backward medians 0.4-4.5% lower on the four slices,
        # 17 of 25 paired rounds (the forward alone -8% to +4%, within its rounds' spread). The combine buffers
        # (2 x T*K*H) are not allocated. The backward's pull by every program too (its comm programs only pulled
        # d_out rows, idle after): medians 1.6-3.8% lower on all four slices, 12 of 20 paired rounds, but the
        # same config read against itself differed by 0-3.8%, so it rests on "not slower in any median, one role
        # fewer, the same bits", not on a measured gain. Pinned zero comm programs on one rank need the gather.
        gather = ranks == 1 and resident and (
            (wide and sms >= 100 and mac is None)
            or 0 in (pinned.get("num_comm_programs_fwd"), pinned.get("num_comm_programs_bwd")))
    values = dict(
        num_comm_programs_fwd=0 if gather else comm_fwd, num_comm_programs_bwd=0 if gather else comm_bwd,
        minibatch_size=mb, macrobatch_size=mac, block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
        combine_gather=gather, tma=tma, keep_activations=keep, wgrad=wgrad, tile_group_m=tgm,
        bwd_num_stages=bwd_stages, forward_kernel=pick("forward_kernel", "auto" if wide else "triton"),
        backward_kernel=pick("backward_kernel", "auto" if wide else "triton"))
    cfg = _pinned_config(pinned, values)
    # What the launches would refuse, checked here for the pins (the heuristic's own values were picked to pass)
    for knob in ("num_comm_programs_fwd", "num_comm_programs_bwd"):
        if knob in pinned and getattr(cfg, knob) >= sms:
            raise ValueError(f"default_config: the pinned {knob}={getattr(cfg, knob)} leaves no compute program on "
                             f"a GPU with {sms} SMs")
    for backward, names in ((False, ("num_stages", "block_m", "block_n", "block_k")),
                            (True, ("bwd_num_stages", "num_stages", "block_m", "block_n", "block_k"))):
        if any(n in pinned for n in names):
            try:
                check_shared_memory(cfg, elem, backward=backward)
            except ValueError as exc:
                raise ValueError(f"default_config: the pinned {_pinned_text(pinned, names)} do not fit: "
                                 f"{exc}") from None
    if cfg.wgrad == "gluon" and "wgrad" in pinned:
        why = ""
        if props.major != 9:
            why = f"it issues Hopper's wgmma (sm_90); this GPU is sm_{props.major}{getattr(props, 'minor', 0)}"
        elif not wide:
            why = f"it needs 2-byte operands; these are {dtype}"
        elif not cfg.tma:
            why = "it loads through TMA: it needs tma=True"
        elif not gluon_wgrad_shape_ok(h, i, s):
            why = (f"every weight gradient's rows must be a multiple of its 128-row tile, with 16-byte rows (H={h}, "
                   f"I={i}, S={s})")
        if why:
            raise ValueError(f"default_config: the pinned wgrad='gluon' cannot run here: {why}")
    return cfg


def _pinned_config(pinned: Mapping[str, object], values: dict) -> KernelConfig:
    """``KernelConfig(**values)`` with the pinned knobs over it; a config KernelConfig refuses is refused naming
    the pins (the heuristic's own values always make a valid one)."""
    try:
        return KernelConfig(**{**values, **pinned})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"default_config: the pinned {_pinned_text(pinned, pinned)} conflict: {exc}") from None
