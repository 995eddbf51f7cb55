"""Training demo: a small MoE transformer language model on byte-level tokens of real text.

    python examples/train_lm.py                        # CPU, torch backend: 200 steps, ~20 s on 2 idle cores
    python examples/train_lm.py --device cuda          # GPU, megakernel backend
    python examples/train_lm.py --steps 50 --hidden 64 --experts 4 --untied   # (-h lists every flag)

The text is the Python standard library's own source (``*.py`` under ``os.path.dirname(os.__file__)``
in a fixed sorted walk, the first ``data_bytes`` bytes concatenated): present on every machine, no download. The
model: token + learned position embeddings, ``layers`` pre-norm blocks of causal self-attention
(``scaled_dot_product_attention``) and a ``MoELayer`` FFN, RMSNorm, output head tied to the embedding
(or not). AdamW, linear warm-up then cosine decay, gradient clipping.

Deterministic: parameters, batch offsets and everything random come from ``seed``, the data order is fixed,
``torch.use_deterministic_algorithms(True)`` is on for the run (restored afterwards; on CUDA in warn-only
mode, so an op without a deterministic kernel warns instead of aborting) and attention uses the math SDPA
kernel on CUDA (the fused kernels' backward is not bitwise repeatable). Two runs with one config on one
machine give bitwise-identical loss curves.

``train(TrainConfig(...))`` returns the per-step training losses; ``main(argv)`` is the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kittenmoe.config import KernelConfig, ModelShape
from kittenmoe.functional import check_backend
from kittenmoe.layer import MoELayer, check_backend_runs

VOCAB = 256  # bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The megakernel's knobs for the demo when TrainConfig.kernel_config is None: 64-row tiles (the demo routes
# batch_size * seq_len * topk = 2048 rows per layer), 256-row minibatches, and tiles small enough that fp32
# operands fit in shared memory (KernelConfig()'s 128x128x64 tiles with 4 stages are sized for bf16).
DEMO_KERNEL_CONFIG = KernelConfig(num_comm_programs_fwd=8, num_comm_programs_bwd=8, minibatch_size=256,
                                  block_m=64, block_n=64, block_k=32, num_stages=2, num_warps=4)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run depends on. Defaults: a small model (0.6M parameters) whose 200 steps take
    about 20 s on 2 idle CPU cores with the torch backend."""

    steps: int = 200
    device: str = "cpu"
    backend: str = "auto"  # MoE backend: auto | torch | megakernel
    dtype: str = "float32"  # float32 | bfloat16 (parameters and activations)
    layers: int = 2
    hidden: int = 128  # H
    heads: int = 4
    experts: int = 8  # E
    topk: int = 2  # K
    expert_width: int = 64  # I
    shared_width: int = 64  # S (0: no shared expert)
    score_func: str = "softmax"
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    tie_embeddings: bool = True
    data_bytes: int = 1 << 20
    seed: int = 0
    log_every: int = 10
    kernel_config: KernelConfig | None = None  # the megakernel's knobs (DEMO_KERNEL_CONFIG when None)

    def __post_init__(self) -> None:
        for name in ("steps", "layers", "hidden", "heads", "experts", "topk", "expert_width", "seq_len",
                     "batch_size", "data_bytes", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        if self.shared_width < 0 or self.warmup_steps < 0 or self.seed < 0:
            raise ValueError("TrainConfig: shared_width, warmup_steps and seed must be >= 0")
        if self.hidden % self.heads:
            raise ValueError(f"TrainConfig: hidden={self.hidden} is not a multiple of heads={self.heads}")
        if self.topk > self.experts:
            raise ValueError(f"TrainConfig: topk={self.topk} exceeds experts={self.experts}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        check_backend(self.backend)
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("TrainConfig: lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.data_bytes < self.seq_len + 2:
            raise ValueError(f"TrainConfig: data_bytes={self.data_bytes} must exceed seq_len + 1")

    def moe_shape(self) -> ModelShape:
        return ModelShape("train-demo", e=self.experts, h=self.hidden, i=self.expert_width, k=self.topk,
                          shared_i=self.shared_width, score_func=self.score_func)


# ----------------------------------------------------------------------------- data


def stdlib_dir() -> Path:
    return Path(os.path.dirname(os.__file__))


def _stdlib_sources():
    """The standard library's ``*.py`` files in a fixed order: a top-down walk, directories and files sorted
    by name, installed third-party packages (``site-packages``, ``dist-packages``) skipped."""
    for dirpath, dirnames, filenames in os.walk(stdlib_dir()):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def load_stdlib_bytes(num_bytes: int) -> torch.Tensor:
    """The first ``num_bytes`` bytes of the standard library's Python source (``_stdlib_sources`` order,
    files concatenated), as uint8."""
    chunks, n = [], 0
    for path in _stdlib_sources():
        if not path.is_file():
            continue
        chunks.append(path.read_bytes()[: num_bytes - n])
        n += len(chunks[-1])
        if n >= num_bytes:
            break
    if n < num_bytes:
        raise ValueError(f"the standard library under {stdlib_dir()} holds only {n} bytes of *.py source; "
                         f"asked for {num_bytes}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


# ----------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, **kw) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.proj = nn.Linear(hidden, hidden, bias=False, **kw)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        b, s, h = x_BSH.shape
        q, k, v = self.qkv(x_BSH).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, generator: torch.Generator, **kw) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, **kw)
        self.attn = Attention(cfg.hidden, cfg.heads, **kw)
        self.norm2 = nn.RMSNorm(cfg.hidden, **kw)
        kcfg = DEMO_KERNEL_CONFIG if cfg.kernel_config is None else cfg.kernel_config
        self.moe = MoELayer(cfg.moe_shape(), backend=cfg.backend, config=kcfg, generator=generator, **kw)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.norm1(x_BSH))
        return x_BSH + self.moe(self.norm2(x_BSH))


class MoETransformer(nn.Module):
    """Byte-level causal language model with MoE FFNs."""

    def __init__(self, cfg: TrainConfig, generator: torch.Generator, device: torch.device | str = "cpu") -> None:
        super().__init__()
        kw = dict(dtype=_DTYPES[cfg.dtype], device=torch.device(device))
        self.embed = nn.Embedding(VOCAB, cfg.hidden, **kw)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden, **kw)
        self.blocks = nn.ModuleList(Block(cfg, generator, **kw) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, **kw)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, VOCAB, bias=False, **kw)
        # Everything not in a MoELayer: normals from the same generator (MoELayer drew its own above).
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".moe." in name:
                    continue
                if p.dim() == 1:  # RMSNorm gains
                    p.fill_(1.0)
                else:
                    std = 0.02 if name.startswith(("embed", "pos")) else 1 / math.sqrt(p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        s = tokens_BS.shape[1]
        x = self.embed(tokens_BS) + self.pos.weight[:s]
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return F.linear(x, self.embed.weight if self.head is None else self.head.weight)


# ----------------------------------------------------------------------------- training loop


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(cfg: TrainConfig, log: Callable[[str], None] | None = print) -> list[float]:
    """Train ``cfg.steps`` steps; return the training loss (mean next-byte cross-entropy, nats) of every step."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} requested but torch sees no CUDA device")
    if device.type == "cuda":
        # cuBLAS needs this before its first use for deterministic GEMMs (no effect if already initialised).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    backend = check_backend_runs(cfg.backend, device)
    data = load_stdlib_bytes(cfg.data_bytes).to(device=device, dtype=torch.long)

    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    with ExitStack() as stack:
        cuda_index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        stack.enter_context(torch.random.fork_rng(devices=[] if cuda_index is None else [cuda_index]))
        stack.callback(torch.use_deterministic_algorithms, prev_det, warn_only=prev_warn)
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        torch.manual_seed(cfg.seed)
        g = torch.Generator().manual_seed(cfg.seed)
        model = MoETransformer(cfg, g, device)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        n_params = sum(p.numel() for p in model.parameters())
        if log:
            log(f"train_lm: {cfg.layers} layers, H={cfg.hidden}, E={cfg.experts} K={cfg.topk} "
                f"I={cfg.expert_width} S={cfg.shared_width}, {n_params / 1e6:.2f}M params, MoE backend "
                f"{backend} on {device}, {cfg.dtype}; {data.numel()} bytes of stdlib source, "
                f"batch {cfg.batch_size} x {cfg.seq_len} tokens")
        offsets = torch.arange(cfg.seq_len + 1, device=device)
        losses = []
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            start = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
            window = data[start.to(device)[:, None] + offsets]
            inputs, targets = window[:, :-1], window[:, 1:]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
            opt.step()
            losses.append(loss.detach())
            if log and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                if backend == "megakernel":  # the log line syncs anyway: surface deferred device errors here
                    from kittenmoe.autograd import check_errors

                    check_errors(device)
                log(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, cfg):.2e}  "
                    f"{time.perf_counter() - t0:6.1f} s")
        if backend == "megakernel":
            from kittenmoe.autograd import check_errors

            check_errors(device)  # deferred device errors, if that mode was chosen
        curve = torch.stack(losses).tolist()
    return curve


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a ``TrainConfig`` (its validation raises ``ValueError``)."""
    td = TrainConfig()
    p = argparse.ArgumentParser(prog="train_lm.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=td.steps)
    p.add_argument("--device", default=td.device, help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--backend", default=td.backend, choices=("auto", "torch", "megakernel"),
                   help="MoE backend (auto: megakernel on CUDA, torch on CPU)")
    p.add_argument("--dtype", default=td.dtype, choices=tuple(_DTYPES))
    p.add_argument("--layers", type=int, default=td.layers)
    p.add_argument("--hidden", type=int, default=td.hidden, help="model width H")
    p.add_argument("--heads", type=int, default=td.heads)
    p.add_argument("--experts", type=int, default=td.experts, help="routed experts E")
    p.add_argument("--topk", type=int, default=td.topk, help="experts per token K")
    p.add_argument("--expert-width", type=int, default=td.expert_width, help="routed expert width I")
    p.add_argument("--shared-width", type=int, default=td.shared_width, help="shared expert width (0: none)")
    p.add_argument("--seq-len", type=int, default=td.seq_len)
    p.add_argument("--batch-size", type=int, default=td.batch_size)
    p.add_argument("--lr", type=float, default=td.lr)
    p.add_argument("--untied", action="store_true", help="separate output head instead of the tied embedding")
    p.add_argument("--data-bytes", type=int, default=td.data_bytes, help="bytes of stdlib source to train on")
    p.add_argument("--seed", type=int, default=td.seed)
    p.add_argument("--log-every", type=int, default=td.log_every)
    a = p.parse_args(argv)
    return TrainConfig(
        steps=a.steps, device=a.device, backend=a.backend, dtype=a.dtype, layers=a.layers, hidden=a.hidden,
        heads=a.heads, experts=a.experts, topk=a.topk, expert_width=a.expert_width, shared_width=a.shared_width,
        seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr, tie_embeddings=not a.untied, data_bytes=a.data_bytes,
        seed=a.seed, log_every=a.log_every)


def main(argv: list[str] | None = None) -> int:
    """Train with the command line's config and print the loss curve's start and end; exit status 2 (one line
    on stderr) for a bad config or a backend that cannot run on the device."""
    try:
        cfg = parse_args(argv)
        check_backend_runs(cfg.backend, cfg.device)
    except (ValueError, RuntimeError) as e:  # a bad flag value or a backend that cannot run here: one clear line
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        return 2
    curve = train(cfg)
    k = max(1, min(10, len(curve) // 4))
    first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
    print(f"mean loss of the first {k} steps {first:.4f}, of the last {k} steps {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
