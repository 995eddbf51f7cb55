"""The megakernel config a public entry runs when the caller gives none: one home for that choice.

``kittenmoe.moe``, ``MoELayer``, ``kittenmoe.moe_ep`` and the transformers integration all resolve
``config=None`` here: the ``kittenmoe tune`` cache entry for the problem (shape, ranks, GPU, dtype) when one
matches, else the heuristic ``kittenmoe.config.default_config``. ``KernelConfig()``'s dataclass defaults are
a neutral starting point for the validator, not a tuned choice (on the H200 the heuristic was 16-27% faster
on the seed slices), so no public entry runs them unless asked to.

Cost on the hot path: no device work and no host sync. Eagerly, one ``stat`` of the cache file per call
(the parsed entry is memoised by file mtime, so a fresh ``kittenmoe tune`` is picked up without a restart).
Under ``torch.compile`` the choice is a constant of the graph (``assume_constant_result``: it reads the
disk, which dynamo cannot trace) made once at trace time; CUDA-graph capture sees only Python work.
"""

from __future__ import annotations

import functools

import torch

from kittenmoe.checks import canonical_device
from kittenmoe.config import KernelConfig


@torch._dynamo.assume_constant_result
def _auto_config_args(t: int, h: int, i: int, e: int, k: int, s: int, ranks: int, device: str, dtype: str) -> tuple:
    """``tune_cache.config_for``'s choice as KernelConfig field values (plain values: a graph constant)."""
    from kittenmoe.tune_cache import config_for

    cfg, _ = config_for(t, h, i, e, k, ranks, torch.device(device), getattr(torch, dtype), s)
    return tuple(getattr(cfg, f) for f in KernelConfig.__dataclass_fields__)


@functools.lru_cache(maxsize=256)
def _config_of(values: tuple) -> KernelConfig:
    """KernelConfig(*values), built and validated once a distinct config (it is frozen): ~40 us a call less."""
    return KernelConfig(*values)


def auto_config(t: int, h: int, i: int, e: int, k: int, s: int, ranks: int, device: torch.device | str,
                dtype: torch.dtype, fp8=None) -> KernelConfig:
    """The config for ``t`` tokens a rank, hidden ``h``, expert width ``i``, ``e`` experts in all over ``ranks``
    EP ranks, top-``k``, shared width ``s`` (0: none), operands of ``dtype`` on ``device``. An empty batch
    (``t`` = 0: the entries return [0, H] without launching) gets the config of one token, so that a caller
    choosing the config before the call needs no case of its own.

    ``fp8`` (an ``FP8Config`` or ``FP8ExpertWeights``): the gate|up tile width the e4m3 path needs
    (``FP8Config.tile_block_n``), applied as an override so the knobs derived from the tile follow."""
    dev = canonical_device(device)  # "cuda" and "cuda:0" one key (a graph constant per device under compile)
    cfg = _config_of(_auto_config_args(max(t, 1), h, i, e, k, s, ranks, str(dev), str(dtype).removeprefix("torch.")))
    if fp8 is None:
        return cfg
    fp8_cfg = getattr(fp8, "cfg", fp8)  # FP8ExpertWeights carries its FP8Config as .cfg
    return cfg.with_overrides(block_n=fp8_cfg.tile_block_n)
