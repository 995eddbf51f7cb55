"""Model shapes, kernel knobs and their validation.

Shape legend used across the package (torchtitan's habit):
    T tokens per rank, H hidden, I expert width, E experts (global),
    K top-k, R ranks, N routed rows on this rank, L = E // R local experts.
A name such as ``w13_E2IH`` is a tensor of shape [E, 2*I, H].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

ScoreFunc = Literal["softmax", "sigmoid"]


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
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"ModelShape.swiglu_limit must be > 0 or None, got {self.swiglu_limit}")

    @property
    def shared_width(self) -> int:
        return self.i if self.shared_i is None else self.shared_i

    def experts_per_rank(self, ep: int) -> int:
        if ep <= 0 or self.e % ep:
            raise ValueError(f"{self.name}: E={self.e} experts cannot be split evenly over EP={ep} ranks")
        return self.e // ep

    def with_(self, **changes) -> "ModelShape":
        return dataclasses.replace(self, **changes)


# The four seed models (DESIGN.md "Shapes"). DeepSeek-V4 adds the SwiGLU clamp;
# its published limit is 7.0 (gate <= 7, -7 <= up <= 7).
SEED_SHAPES: dict[str, ModelShape] = {
    "kimi-k2.7": ModelShape("kimi-k2.7", e=384, h=7168, i=2048, k=8, routed_scaling_factor=2.827),
    "glm-5.2": ModelShape("glm-5.2", e=256, h=6144, i=2048, k=8, routed_scaling_factor=2.5),
    "qwen3.5-397b-a17b": ModelShape("qwen3.5-397b-a17b", e=512, h=4096, i=1024, k=10, score_func="softmax"),
    "deepseek-v4-pro": ModelShape("deepseek-v4-pro", e=384, h=7168, i=3072, k=6, routed_scaling_factor=2.5,
                                  swiglu_limit=7.0),
}

# The issues' one-GPU benchmark slices: tokens of each seed shape at EP8 (E_local = E / 8, R = 1, every route
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
    """``KernelConfig.wgrad_gluon``'s tile: block_n x 2 block_n = 128 x 256 outputs, 64-row steps
    (min(block_k, block_m)). One home for the condition: KernelConfig checks it, ``default_config`` sets the
    knob only where it holds, and ``KernelConfig.with_overrides`` (``--config``, the tuner's grid, the FP8 tile
    width) turns the knob off where a tile change breaks it rather than building a config that is refused."""
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


_BOOL_KNOBS = ("combine_gather", "tma", "keep_activations", "wgrad_persistent", "wgrad_gluon")


@dataclass(frozen=True)
class KernelConfig:
    """The megakernel's knobs (DESIGN.md "Knobs").

    num_comm_programs_fwd/bwd: programs (SMs) that pull and push rows instead
        of running GEMM tiles. ``num_comm_programs_fwd`` 0 (with
        ``combine_gather``, so one rank and a ring that does not wrap): no
        dedicated programs; every program first pulls its share of
        all routed rows, then runs GEMM tiles. The same bits.
        ``num_comm_programs_bwd`` 0 likewise (with ``combine_gather``).
    minibatch_size: rows handed from communication to compute at a time; a
        multiple of ``block_m`` so a GEMM row tile never straddles two
        minibatches.
    macrobatch_size: rows of routed activations held at once (the ring
        window); ``None`` sizes the buffers for the worst case, so the ring
        never wraps. A multiple of ``minibatch_size``.
    block_m: GEMM row tile, also the padding of each expert's segment.
    block_n, block_k, num_stages, num_warps: Triton tile choices.
    combine_gather: one rank only (R=1), ring not wrapping: nothing is
        pushed; the final epilogue reads each route's row from y_routed
        through an inverse of the schedule (route t*K + j -> row). The same
        bits; communication programs only pull.
    tma: load GEMM operands through TMA descriptors where possible (a
        Hopper-or-newer GPU, bf16/fp16, I, S multiples of block_n, H a
        multiple of 2*block_n, widths multiples of block_k); otherwise, and
        always under the interpreter, pointer loads.
    keep_activations: a forward that autograd will differentiate keeps its
        ring's routed x rows and fp32 gate|up pre-activations (H x dtype +
        8 I bytes a row; Kimi EP8 slice without a ring: ~0.58 GB a layer)
        for the backward, which skips the gate|up replay for those rows (4
        of phase A's 6 FLOPs per element). A ring that does not wrap holds
        every row (the backward also skips the x pull); a wrapping ring
        ends holding macrobatch 0 (the forward runs macrobatches last to
        first) and the backward replays only the rest. The shared expert's
        fp32 gate|up (8 S bytes a token, 34 MB on Kimi) is kept too, ring or
        not: the backward's shared phase A runs its down dgrad alone. False:
        always replay.
    wgrad_persistent: the backward's weight gradients in one program per SM, each walking its tiles in one
        flat loop of row steps, so the next tile's loads overlap this tile's last steps and its store
        (``weight_grad_persistent_kernel``). One program per tile paid its pipeline fill and 64 KB store
        alone: Kimi's tiles have six 64-row steps, and the launch ran at ~450 TFLOP/s. The same bits.
        Off in the dataclass, on in ``default_config``'s CUDA configs: in its nested-loop form (each tile
        stored through one TMA buffer that drains under the next tile's K loop) forward+backward was
        0.3-2.7% faster on the four slices (H200, interleaved rounds, 2026-12-01); the earlier flat-loop
        form had been slower (DeepSeek backward 11.50 ms against 10.71).
    wgrad_gluon: the weight gradients from a warp-specialized Gluon kernel (``kernels/wgrad_gluon.py``): the
        same tiles, order and bits as ``wgrad_persistent``'s, with a producer warp that keeps the TMA ring full
        across tile boundaries (the next tile's first row steps load while this one's last wgmmas and epilogue
        run) and two 64-row math groups. H200, the launches alone (2026-12-03): 1.10-1.26x faster than the
        Triton kernel on the Kimi, DeepSeek and Qwen slices (Kimi d_W13 1.887 ms against 2.204, cutlass 2.180),
        every output equal bit for bit. Hopper only (wgmma), 2-byte operands through TMA, block_n 128 and
        64-row steps (min(block_k, block_m) = 64; ``gluon_wgrad_tiles_ok``), every gradient's rows (2I, H, 2S)
        a multiple of 128 and its columns of 16-byte rows (``gluon_wgrad_shape_ok``; the backward refuses other
        widths before launching). Gluon does not run under the
        Triton interpreter: there the knob is refused (NotImplementedError), never silently replaced. Takes
        precedence over ``wgrad_persistent``. Off in the dataclass; ``default_config`` sets it on Hopper with
        2-byte operands: forward+backward medians -5.7% Kimi, -3.6% DeepSeek and GLM (15 of 15 paired rounds
        lower, past the run's A/A gap of 1.3-1.8%), -0.9% Qwen (within its 4.4%) (H200, 2026-12-03).
    tile_group_m: the order of a minibatch's GEMM tiles in both megakernels. 0: column tile by column tile,
        every row tile of the minibatch under one (the order timed so far): a weight tile serves its
        expert's 2-3 row tiles at once, but each 128-row x tile is read again for every column tile, after
        the whole minibatch's rows (Kimi 29 MB a minibatch) and the weights streaming by have passed
        through L2. G > 0: groups of G row tiles, each walked column tile by column tile, so a wave of
        ~116 programs reads ~G row tiles' x many times while it is in L2 (Triton's GROUP_M swizzle). The
        same bits in any order. Off: on the H200 the forward was 1-3% slower at G = 4 and 8 on every slice
        (2026-12-01): fixed groups split an expert's row tiles, whose weight tiles are then read once per
        group. G = -1: each expert's row tiles in the minibatch are one group, walked column tile by column
        tile, so its x rows stay in L2 over its column tiles and each weight tile still serves all of them at
        once (Nsight Compute, DeepSeek forward, default order: 11.55 GB read from DRAM for 6.5 GB of weights,
        L2 hit rate 39%, 2026-12-02).
    bwd_num_stages: pipeline stages of the backward megakernel's GEMM loops; 0 (default): min(num_stages, 3),
        the build timed so far. 4 fits on sm_90 with the default tiles (229,408 B of shared memory, replaying,
        kept and FP8 builds alike; the loops share their buffers), for phase A's 112-step K loop over H
        (Kimi), which runs at ~3.3 TFLOP/s a program against phase B's 5.6. ``default_config`` sets 4 at
        block_m 128 with 2-byte operands: with ``wgrad_persistent`` forward+backward went from 0.3-2.7% to
        2.3-4.6% faster than without either (H200, 2026-12-01); alone, one earlier run gave -1.5% (Kimi) and
        -0.4% (DeepSeek).
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
    wgrad_persistent: bool = False
    wgrad_gluon: bool = False
    tile_group_m: int = 0
    bwd_num_stages: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            v = getattr(self, field.name)
            if field.name == "macrobatch_size" and v is None:
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
        if self.wgrad_gluon and not gluon_wgrad_tiles_ok(self.block_n, self.block_k, self.block_m):
            raise ValueError(f"KernelConfig.wgrad_gluon builds 128 x 256 weight-gradient tiles of 64-row steps: it "
                             f"needs block_n=128 and min(block_k, block_m)=64; got block_n={self.block_n}, "
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
        return dataclasses.replace(self, **changes)

    def with_overrides(self, **changes) -> "KernelConfig":
        """``with_(**changes)`` for a caller's knobs on top of a tuned or heuristic config (``--config``, the
        tuner's grid, the FP8 tile width, the transformers integration's ``knobs``). The knobs the heuristic
        derived from the ones that change follow them, so the result runs where ``with_`` would build a config
        a launch refuses; a knob ``changes`` names is never touched (and is then checked as given):

        - ``wgrad_gluon`` off where its 128 x 256 tile no longer fits (``gluon_wgrad_tiles_ok``), or with
          ``tma=False`` (the Triton weight gradients run instead);
        - ``bwd_num_stages`` back to 0 (``bwd_stages``' default) where the backward's phase-A tile no longer
          fits shared memory at the set depth (``bwd_phase_a_smem_bytes``, 2-byte operands: the heuristic sets
          the depth only for those);
        - ``combine_gather`` off when ``changes`` ask for a ring (``macrobatch_size``; the caller passes None
          where its ring would not wrap), or turn it off; then communication
          programs at 0 take ``KernelConfig()``'s counts, since something must push."""
        # the knobs as they would merge, unvalidated: the merged config may be one KernelConfig refuses
        v = {f.name: changes.get(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        derived = {}
        if v["wgrad_gluon"] and "wgrad_gluon" not in changes and (
                not gluon_wgrad_tiles_ok(v["block_n"], v["block_k"], v["block_m"])
                or not v["tma"]):
            derived["wgrad_gluon"] = False  # the Triton weight-gradient kernel
        if self.combine_gather and "combine_gather" not in changes and (
                changes.get("macrobatch_size") is not None):
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


def gate_up_smem_bytes(config: KernelConfig, elem_bytes: int = 2) -> int:
    """Shared-memory estimate of the gate|up GEMM tile, the largest in the forward megakernel.

    Each pipeline stage holds one ``block_m x block_k`` activation tile and the
    matching gate and up weight tiles (``2 x block_n x block_k``):
    ``num_stages * (BM*BK + 2*BN*BK) * elem_bytes``. An estimate, not
    Triton's exact figure (epilogue layout conversions add some), used to
    skip tile choices that cannot fit before compiling them.
    """
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return config.num_stages * (bm * bk + 2 * bn * bk) * elem_bytes


def bwd_phase_a_smem_bytes(config: KernelConfig, elem_bytes: int = 2) -> int:
    """Shared-memory estimate of the backward's largest tile: at ``config.bwd_stages`` phase A holds per stage
    the d_out and x row tiles (``2 x block_m x block_k``) and three weight tiles of half width
    (``3 x block_n/2 x block_k``), phase B ``(block_m + 2 block_n) x block_k`` (which also covers phase A's kept
    down dgrad alone, ``(block_m + block_n) x block_k``); the weight-gradient launch ``block_k x 3 block_n`` with
    all ``num_stages``."""
    bn = max(16, config.block_n // 2)
    stages = config.bwd_stages
    phase_a = stages * (2 * config.block_m * config.block_k + 3 * bn * config.block_k) * elem_bytes
    # phase B: a block_m x block_k row tile and a block_k x 2 block_n weight tile per stage
    phase_b = stages * (config.block_m + 2 * config.block_n) * config.block_k * elem_bytes
    # weight-gradient launch (all num_stages): block_k rows of a block_n- and a 2 block_n-wide operand
    wgrad = config.num_stages * (config.block_k * 3 * config.block_n) * elem_bytes
    return max(phase_a, phase_b, wgrad)


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


def default_config(t: int, h: int, i: int, e: int, k: int, ranks: int = 1, device=None,
                   dtype=None, s: int | None = None) -> KernelConfig:
    """The heuristic ``KernelConfig`` for a problem when no tuned config is cached.

    ``t`` tokens per rank, hidden ``h``, expert width ``i``, ``e`` routed
    experts in total over ``ranks`` EP ranks (``e // ranks`` local experts),
    top-``k``; ``device`` (default: CUDA if available) and ``dtype`` (default
    bf16) of the operands; ``s`` the shared expert's width (0: none; None: not
    known, only ``wgrad_gluon`` reads it). A balanced router sends about ``n = t * k`` rows to
    each rank, ``n_e = t * k * ranks / e`` to each expert.

    On CUDA (measured on the H200 for the seed shapes sliced to one EP8 rank,
    where these values won the sweeps in docs/perf-notes.md;
    elsewhere a guess the tuner replaces):

    - ``block_m`` 128, or 64 when experts average under 96 rows (the padding of
      each expert's segment to ``block_m`` would dominate);
    - ``minibatch_size`` 2048 (the seed slices' optimum at ``n`` = 12-40 K
      rows); smaller problems use ``n / 4`` rounded down to a power of two
      (at least ``block_m``) so the comm/compute pipeline still has ~4 steps;
    - ``num_comm_programs_fwd`` by bytes per FLOP, which fall as ``I`` grows (a
      routed row moves ``H`` elements for ``6*H*I`` FLOPs): 16 for ``I`` <= 1024,
      12 up to 2048, 8 above (H200 sweep after the vectorised copies, 2026-11-29:
      Qwen I=1024 best at 16, Kimi/GLM I=2048 at 12, DeepSeek I=3072 at 8);
      ``num_comm_programs_bwd`` 16, or 12 with one rank and ``I`` > 1024 (the
      backward moves x and d_out; H200 sweep of 8/12/16 on today's backward,
      2026-12-02: Kimi/GLM best at 12 by ~3%, DeepSeek ~1%, Qwen at 16; with
      several ranks the pull crosses NVLink and only 16 was timed). An eighth
      of the SMs for both on GPUs with fewer than 100 SMs;
    - ``block_n`` 128, ``block_k`` 64 for 2-byte operands (32 for fp32), and the
      most ``num_stages`` (<= 4) whose gate|up tile fits 227 KB of shared
      memory (``gate_up_smem_bytes``);
    - with 2-byte operands ``wgrad_persistent`` on, and ``bwd_num_stages`` 4 at
      ``block_m`` 128 when the backward's tiles fit (``bwd_phase_a_smem_bytes``):
      forward+backward 2.3-4.6% faster on the four slices (H200, 2026-12-01);
      and ``tile_group_m`` -1 (each expert's row tiles of a minibatch walked
      together): forward+backward another 2.7-4.0% (H200, 2026-12-02);
      on Hopper (sm_90) also ``wgrad_gluon`` (the weight gradients from the
      warp-specialized Gluon kernel, the same bits) where the widths fit its
      128-row tiles (``gluon_wgrad_shape_ok``: H and 2I, and 2S when ``s`` is
      given, multiples of 128): forward+backward medians 3.6-5.7% lower on
      Kimi, DeepSeek and GLM, past the run's A/A gap, 0.9% on Qwen (H200,
      2026-12-03);
    - ``macrobatch_size`` None (no ring) unless the worst-case routed buffers
      (x_routed, y_routed, hidden, and the fp32 gate|up ``keep_activations``
      holds) exceed min(8 GiB, 1/8 of the GPU's memory); then the largest
      multiple of the minibatch that fits;
    - on one rank with no ring and 2-byte operands, ``combine_gather`` (no
      push; the epilogues read the rows where they were computed) and
      ``num_comm_programs_fwd`` 0 (every program pulls first): forward+backward
      0.4-4.5% faster on the four slices (H200, 2026-12-03); and
      ``num_comm_programs_bwd`` 0 (the backward's pull the same way): medians
      1.6-3.8% lower in one run, within what the same config read against
      itself (0-3.8%; H200, 2026-12-03, session 14): one role fewer, the same
      bits, not a resolved speed gain.

    On CPU (the Triton interpreter, for tests) small tiles and few programs
    keep the sequential interpreter fast: ``block_m`` 16, ``block_n`` and
    ``block_k`` 32, one communication program, and a minibatch of the
    worst-case capacity rounded up to a power of two (at most 1024), so few
    launches run.
    """
    import torch

    for name, v in (("t", t), ("h", h), ("i", i), ("e", e), ("k", k), ("ranks", ranks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"default_config: {name} must be a positive int, got {v!r}")
    if e % ranks:
        raise ValueError(f"default_config: E={e} experts cannot be split evenly over R={ranks} ranks")
    if k > e:
        raise ValueError(f"default_config: top-k K={k} exceeds the number of experts E={e}")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dtype is None else dtype
    elem = torch.empty((), dtype=dtype).element_size()
    local = e // ranks
    n = t * k
    if dev.type != "cuda":
        bm = 16
        mb = min(1024, max(bm, 1 << (routed_capacity(ranks, t, k, local, bm) - 1).bit_length()))
        return KernelConfig(num_comm_programs_fwd=1, num_comm_programs_bwd=1, minibatch_size=mb, block_m=bm,
                            block_n=32, block_k=32, num_stages=1, num_warps=4)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    comm = 16 if sms >= 100 else max(1, sms // 8)
    comm_fwd = (16 if i <= 1024 else 12 if i <= 2048 else 8) if sms >= 100 else comm
    # 12 only where it was timed (one rank, I > 1024: the docstring's sweep); over NVLink only 16 was timed.
    comm_bwd = 12 if (sms >= 100 and ranks == 1 and i > 1024) else comm
    bm = 128 if n * ranks / e >= 96 else 64
    mb = 2048 if n >= 8192 else max(bm, _pow2_floor(n // 4))
    bn, bk = 128, (64 if elem <= 2 else 32)
    cfg = KernelConfig(num_comm_programs_fwd=comm_fwd, num_comm_programs_bwd=comm_bwd, minibatch_size=mb, block_m=bm,
                       block_n=bn, block_k=bk, num_stages=1)
    stages = next((s for s in (4, 3, 2) if gate_up_smem_bytes(cfg.with_(num_stages=s), elem) <= SHARED_MEMORY_LIMIT), 1)
    cfg = cfg.with_(num_stages=stages)
    # The backward's weight gradients from persistent programs (the same bits), and its megakernel's loops at 4
    # stages where they fit: together 2.3-4.6% off forward+backward on all four slices (H200, interleaved rounds,
    # fwdbwd-20261201-211440.json: persistent alone 0.3-2.7%, the 4 stages 0.0-2.2% more). Both were timed with
    # 2-byte operands (bf16 experts; FP8 experts' backward only checked for bits), the stages at block_m 128.
    if elem == 2:
        # Expert runs (tile_group_m = -1): forward+backward 2.7-4.0% faster on all four slices, lower in 18 of 20
        # paired rounds (H200, 2026-12-02, fwdbwd-20261202-161055.json / -161232.json); the forward alone
        # within +-1.7%. The order changes no bits.
        cfg = cfg.with_(wgrad_persistent=True, tile_group_m=-1)
        # The weight gradients from the warp-specialized Gluon kernel on Hopper (wgmma; the same bits): forward+
        # backward medians -5.7% (Kimi), -3.6% (DeepSeek, GLM), -0.9% (Qwen), the first three past the same
        # run's A/A gap (1.3-1.8%) and lower in 15 of 15 paired rounds (H200, 2026-12-03, session 15,
        # fwdbwd-20261203-145107.json). Its tile (128 x 256, 64-row steps) is this config's at 2-byte operands.
        if props.major == 9 and gluon_wgrad_shape_ok(h, i, s) and gluon_wgrad_tiles_ok(bn, bk, bm):
            cfg = cfg.with_(wgrad_gluon=True)
        if bm == 128 and bwd_phase_a_smem_bytes(cfg.with_(bwd_num_stages=4), elem) <= SHARED_MEMORY_LIMIT:
            cfg = cfg.with_(bwd_num_stages=4)
    cap = routed_capacity(ranks, t, k, local, bm)
    full = -(-cap // mb) * mb
    budget = min(8 << 30, props.total_memory // 8)
    row_bytes = (2 * h + i) * elem + 8 * i  # x, y, hidden rows, and the fp32 gate|up kept for the backward
    if full * row_bytes > budget:
        cfg = cfg.with_(macrobatch_size=max(mb, budget // row_bytes // mb * mb))
    elif ranks == 1 and elem == 2 and sms >= 100:
        # One rank, resident ring: no push (the epilogues read the rows where they were computed) and no comm
        # programs (every SM pulls its share first). Forward+backward medians 0.4-4.5% lower on the four slices,
        # 17 of 25 paired rounds (H200, 2026-12-03, fwdbwd-20261203-084744.json / -085055.json; the forward alone
        # -8% to +4%, within its rounds' spread). The combine buffers (2 x T*K*H) are not allocated.
        # The backward's pull by every program too (its comm programs only pulled d_out rows, idle after):
        # medians 1.6-3.8% lower on all four slices (fwdbwd-20261203-114826.json, 12 of 20 paired rounds), but
        # an accidental A/A run (fwdbwd-20261203-121535.json: this config against itself) differed by 0-3.8%,
        # so it rests on "not slower in any median, one role fewer, the same bits", not on a measured gain.
        cfg = cfg.with_(combine_gather=True, num_comm_programs_fwd=0, num_comm_programs_bwd=0)
    return cfg
