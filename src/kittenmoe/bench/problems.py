"""What ``kittenmoe bench`` and ``kittenmoe tune`` run: the problem (shape, ranks, dtype, routing, FP8), the
``--config`` overrides on top of the config the layer would pick, the FLOPs of a timed call and the accuracy bar.

``--model NAME`` slices a registered shape to one EP rank (E_local = E / ep experts; default ep 8), ``--shape
T,H,I,E,K`` gives the dimensions directly (default ep 1). With R ranks (virtual, or torchrun processes) each
holds E_local experts, so the problem has R * E_local experts in total and each rank's T tokens are routed over
all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kittenmoe.config import SHAPES, KernelConfig, ModelShape, get_shape

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FP8_BLOCKS = (128, 32)  # --fp8: the scale block (128: DeepSeek-V3's; 32: MXFP8, power-of-two scales)
FP8_QUANT_REPS = 10  # timed runs of the weight quantisation (measured once per problem)
KIND = {"forward": "forward", "backward": "forward+backward"}  # --mode -> the rows' "kind"
DEFAULT_EP_MODEL = 8


@dataclass(frozen=True)
class RoutingSpec:
    """A routing distribution from ``kittenmoe.testing``: uniform, zipf (with exponent alpha) or one-hot."""

    name: str  # "uniform" | "zipf" | "one-hot"
    alpha: float | None = None

    def __str__(self) -> str:
        return f"zipf:{self.alpha:g}" if self.name == "zipf" else self.name

    def generate(self, t: int, e: int, k: int, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
        from kittenmoe.testing import routing_one_hot, routing_uniform, routing_zipf

        if self.name == "uniform":
            return routing_uniform(t, e, k, generator=generator, device=device)
        if self.name == "zipf":
            return routing_zipf(t, e, k, alpha=self.alpha, generator=generator, device=device)
        return routing_one_hot(t, e, k, hot=0, generator=generator, device=device)


def parse_routing(spec: str) -> RoutingSpec:
    """``uniform``, ``zipf`` (alpha 1.2), ``zipf:ALPHA`` (ALPHA > 0) or ``one-hot`` (also ``one_hot``)."""
    s = spec.strip().lower()
    if s == "uniform":
        return RoutingSpec("uniform")
    if s in ("one-hot", "one_hot", "onehot"):
        return RoutingSpec("one-hot")
    if s == "zipf" or s.startswith("zipf:"):
        alpha = 1.2
        if ":" in s:
            try:
                alpha = float(s.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad --routing {spec!r}: the Zipf exponent after 'zipf:' must be a number, "
                                 f"e.g. zipf:1.2") from None
            if not (alpha > 0 and alpha < float("inf")):
                raise ValueError(f"bad --routing {spec!r}: the Zipf exponent must be a finite number > 0")
        return RoutingSpec("zipf", alpha)
    raise ValueError(f"bad --routing {spec!r}: expected uniform, zipf, zipf:ALPHA (e.g. zipf:1.2) or one-hot")


def parse_shape(spec: str) -> tuple[int, int, int, int, int]:
    """``T,H,I,E,K``: five positive integers, K <= E."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 5:
        raise ValueError(f"bad --shape {spec!r}: expected five comma-separated integers T,H,I,E,K "
                         f"(tokens, hidden, expert width, experts, top-k), e.g. 2048,7168,2048,384,8")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"bad --shape {spec!r}: T,H,I,E,K must all be integers") from None
    for name, v in zip("THIEK", vals):
        if v < 1:
            raise ValueError(f"bad --shape {spec!r}: {name}={v} must be a positive integer")
    t, h, i, e, k = vals
    if k > e:
        raise ValueError(f"bad --shape {spec!r}: top-k K={k} exceeds the number of experts E={e}")
    return t, h, i, e, k


def parse_problem(spec: str) -> tuple[int, ModelShape]:
    """``TxHxIxExK`` (e.g. 32768x4096x512x128x8): T tokens of that problem on one rank with no shared expert, as
    the benchmark scripts name a problem that is not a seed model's slice; checked as ``parse_shape``."""
    try:
        t, h, i, e, k = parse_shape(spec.replace("x", ","))
    except ValueError as exc:  # the same checks, said of the form given
        raise ValueError(f"bad problem {spec!r}: expected TxHxIxExK, five positive integers with K <= E, e.g. "
                         f"32768x4096x512x128x8 ({exc})") from None
    return t, ModelShape(spec, e=e, h=h, i=i, k=k, shared_i=0)


_CONFIG_LITERALS = {"none": None, "true": True, "false": False}


# each knob's dataclass default: its type tells how a command-line value reads
_KNOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelConfig)}


def parse_knob_value(key: str, val: str, flag: str = "--config"):
    """One KernelConfig knob's value from the command line: an int, ``None``, ``True`` or ``False``, or for a
    knob that picks an implementation by name (``wgrad``) the name. Shared by ``--config`` and ``tune --grid``."""
    if isinstance(_KNOB_DEFAULTS[key], str):
        return val
    low = val.lower()
    if low in _CONFIG_LITERALS:
        return _CONFIG_LITERALS[low]
    try:
        return int(val)
    except ValueError:
        raise ValueError(f"bad {flag} value {key}={val!r}: expected an integer, None, True or False") from None


def parse_config_overrides(spec: str | None) -> dict:
    """``k=v,k=v`` with KernelConfig field names (values as ``parse_knob_value`` reads them)."""
    if not spec:
        return {}
    fields = set(_KNOB_DEFAULTS)
    out = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"bad --config item {item!r}: expected key=value (keys: {', '.join(sorted(fields))})")
        key, val = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            raise ValueError(f"bad --config key {key!r}: KernelConfig has no such field; "
                             f"known: {', '.join(sorted(fields))}")
        out[key] = parse_knob_value(key, val)
    return out


def apply_overrides(base: KernelConfig, overrides: dict) -> KernelConfig:
    """``base`` with ``overrides``; KernelConfig's own validation gives the error for a bad value. Through
    ``KernelConfig.with_overrides``: the heuristic's derived knobs follow the overrides (on Hopper, tiles off
    the Gluon kernel's 128 x 256 take the Triton weight gradients; a ring turns the one-rank gather off), as
    the tuner's grid does; a knob the overrides name is checked as given."""
    try:
        return base.with_overrides(**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad --config: {e}") from None


@dataclass(frozen=True)
class Problem:
    """One benchmarked layer: ``shape.e`` is the problem's total experts (ranks * experts_local)."""

    label: str  # the model name, or "H..-I..-E..-K.." for an explicit shape
    shape: ModelShape
    tokens: int  # T per rank
    ranks: int  # R ranks (virtual, or processes under torchrun)
    ep: int  # the EP degree the model was sliced for
    experts_local: int  # E_local = E_model / ep
    dtype: str  # "bf16" | "fp32"
    routing: RoutingSpec
    fp8_block: int | None = None  # --fp8: routed experts in e4m3 with this scale block; None: in dtype

    @property
    def precision(self) -> str:
        """What kittenmoe computes the routed experts in: the dtype, or ``fp8-e4m3/<scale block>``."""
        return self.dtype if self.fp8_block is None else f"fp8-e4m3/{self.fp8_block}"

    def fp8_config(self):
        """The ``kittenmoe.fp8.FP8Config`` of ``--fp8`` (32: MXFP8, power-of-two scales), or None."""
        from kittenmoe.fp8 import FP8Config

        return None if self.fp8_block is None else FP8Config(self.fp8_block, pow2_scales=self.fp8_block == 32)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """(T, H, I, E, K) of the problem as run: E = ranks * experts_local."""
        s = self.shape
        return self.tokens, s.h, s.i, s.e, s.k

    @property
    def shared_width(self) -> int:
        return self.shape.shared_width

    def describe(self) -> str:
        t, h, i, e, k = self.dims
        return (f"{self.label}: T={t} H={h} I={i} E={e} (E_local={self.experts_local} x R={self.ranks}) K={k} "
                f"S={self.shared_width} {self.dtype}"
                f"{'' if self.fp8_block is None else f' (routed experts in {self.precision})'} routing={self.routing}")


def make_problems(model: str | None, shape: str | None, ep: int | None, tokens: int | None, ranks: int | None,
                  dtype: str, routing: str, fp8: int | None = None, shared: bool = True) -> list[Problem]:
    """Validate the shape arguments (clear ``ValueError`` on any mistake) and build the problems.

    ``model`` may name several registered shapes, comma-separated. ``ranks`` None (``--ranks`` not given) is 1.
    ``fp8``: ``--fp8``'s scale block (None: no FP8); needs bf16 and H, I multiples of it. ``shared`` False
    (``--no-shared``): no shared expert (width 0), the label suffixed ``-S0`` so that such rows never stand in
    for the shape's rows with one.
    """
    if (model is None) == (shape is None):
        raise ValueError("give exactly one of --model NAME or --shape T,H,I,E,K")
    ranks = 1 if ranks is None else ranks
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks}")
    if ep is not None and ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be a positive integer, got {tokens}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fp8 is not None:
        if fp8 not in FP8_BLOCKS:
            raise ValueError(f"--fp8 must be one of {', '.join(map(str, FP8_BLOCKS))} (the scale block), got {fp8!r}")
        if dtype != "bf16":
            raise ValueError(f"--fp8 {fp8} needs --dtype bf16 (the FP8 megakernels take bf16 inputs and write bf16 "
                             f"outputs), got --dtype {dtype}")
    spec = parse_routing(routing)
    bases: list[tuple[str, ModelShape, int]] = []
    if model is not None:
        ep = DEFAULT_EP_MODEL if ep is None else ep
        for name in (m.strip() for m in model.split(",")):
            if name not in SHAPES:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SHAPES))}")
            bases.append((name, get_shape(name), 2048 if tokens is None else tokens))
    else:
        if tokens is not None:
            raise ValueError("--tokens goes with --model; with --shape T,H,I,E,K the token count is T")
        ep = 1 if ep is None else ep
        t, h, i, e, k = parse_shape(shape)
        bases.append((f"H{h}-I{i}-E{e}-K{k}", ModelShape("custom", e=e, h=h, i=i, k=k), t))
    out = []
    for label, base, t in bases:
        if base.e % ep:
            raise ValueError(f"{label}: E={base.e} experts are not divisible by --ep {ep}")
        local = base.e // ep
        e_total = local * ranks
        if base.k > e_total:
            raise ValueError(f"{label}: top-k K={base.k} exceeds the {e_total} experts of the sliced problem "
                             f"(E/ep={local} per rank x {ranks} ranks); use a smaller --ep or more --ranks")
        if fp8 is not None and (base.h % fp8 or base.i % fp8):
            raise ValueError(f"{label}: --fp8 {fp8} needs H and I multiples of the scale block {fp8}, got H={base.h} "
                             f"I={base.i}")
        if not shared:
            label, base = f"{label}-S0", base.with_(shared_i=0)
        out.append(Problem(label, base.with_(e=e_total), t, ranks, ep, local, dtype, spec, fp8))
    return out


def config_for_problem(problem: Problem, device: torch.device, overrides: dict) -> tuple[KernelConfig, str]:
    """The config the layer would use (tuned cache, else the heuristic) with ``--config`` overrides on top.

    FP8: a gate|up tile must hold whole scale blocks, so ``block_n`` becomes the FP8 tile width
    (``FP8Config.tile_block_n``), as ``MoELayer`` does, unless ``--config`` sets it (then it must be a multiple
    of the scale block)."""
    from kittenmoe.tune_cache import config_for

    t, h, i, e, k = problem.dims
    cfg, source = config_for(t, h, i, e, k, problem.ranks, device, problem.torch_dtype, s=problem.shared_width)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
        source += " + --config overrides"
    b = problem.fp8_block
    if b is not None:
        tile_n = problem.fp8_config().tile_block_n
        if "block_n" in overrides:
            if cfg.block_n % b:
                raise ValueError(f"bad --config block_n={cfg.block_n} with --fp8 {b}: block_n must be a multiple of "
                                 f"the scale block {b} (each gate|up tile holds whole scale blocks); leave it out "
                                 f"for {tile_n}")
        elif cfg.block_n != tile_n:
            cfg = cfg.with_overrides(block_n=tile_n)
            source += f" + block_n {cfg.block_n} for --fp8 {b}"
    return cfg, source


def flops(problem: Problem, mode: str) -> tuple[float, float]:
    """(routed, effective) FLOPs of one timed call: every rank's tokens; fwd+bwd counts 3x the forward."""
    t, h, i, _, k = problem.dims
    mult = 1 if mode == "forward" else 3
    routed = 6 * problem.ranks * t * k * h * i * mult
    total = 6 * problem.ranks * t * h * (k * i + problem.shared_width) * mult
    return routed, total


def rel_l1_bar(problem: Problem, device: torch.device) -> float:
    """Relative-L1 bar (``kittenmoe.testing.tolerance_for``): FP8 experts fp8's; else bf16 1e-2; fp32 3e-3 on a
    GPU (tensor cores round to tf32), 1e-5 interpreted."""
    from kittenmoe.testing import tolerance_for

    if problem.fp8_block is not None:
        return tolerance_for("fp8").rel_l1
    if problem.dtype == "bf16":
        return tolerance_for("bf16").rel_l1
    return tolerance_for("tf32" if device.type == "cuda" else "fp32").rel_l1
