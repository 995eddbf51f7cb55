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


@dataclass(frozen=True)
class KernelConfig:
    """The megakernel's knobs (DESIGN.md "Knobs").

    num_comm_programs_fwd/bwd: programs (SMs) that pull and push rows instead
        of running GEMM tiles.
    minibatch_size: rows handed from communication to compute at a time; a
        multiple of ``block_m`` so a GEMM row tile never straddles two
        minibatches.
    macrobatch_size: rows of routed activations held at once (the ring
        window); ``None`` sizes the buffers for the worst case, so the ring
        never wraps. A multiple of ``minibatch_size``.
    block_m: GEMM row tile, also the padding of each expert's segment.
    block_n, block_k, num_stages, num_warps: Triton tile choices.
    push_in_epilogue: the down GEMM's epilogue writes each finished row
        straight into its origin's combine buffer (no y_routed round trip
        through HBM; communication programs only pull). False: compute
        programs write y_routed and communication programs push it, as in
        MoK's role split.
    tma: load GEMM operands through TMA descriptors where possible (a
        Hopper-or-newer GPU, bf16/fp16, I, S multiples of block_n, H a
        multiple of 2*block_n, widths multiples of block_k); otherwise, and
        always under the interpreter, pointer loads.
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
    push_in_epilogue: bool = False
    tma: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            v = getattr(self, field.name)
            if field.name == "macrobatch_size" and v is None:
                continue
            if field.name in ("push_in_epilogue", "tma"):
                if not isinstance(v, bool):
                    raise TypeError(f"KernelConfig.{field.name} must be a bool, got {v!r}")
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"KernelConfig.{field.name} must be an int, got {type(v).__name__} {v!r}")
        for name in ("num_comm_programs_fwd", "num_comm_programs_bwd"):
            if getattr(self, name) < 1:
                raise ValueError(f"KernelConfig.{name} must be >= 1 (communication needs at least one "
                                 f"program), got {getattr(self, name)}")
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
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")

    def with_(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)


def routed_capacity(r: int, t: int, k: int, experts_per_rank: int, block_m: int) -> int:
    """Worst-case routed rows on one rank: every route of every rank lands here,
    plus the padding of each local expert's segment to ``block_m``."""
    return r * t * k + experts_per_rank * (block_m - 1)
