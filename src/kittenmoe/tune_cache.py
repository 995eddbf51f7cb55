"""The tuned-config cache the library reads on its hot path: ``config_for`` (tuned entry, else the heuristic).

``MoELayer``, the functional API's callers and ``kittenmoe bench`` ask ``config_for`` for every new problem,
so this module imports only ``torch`` and ``kittenmoe.config`` (no kernels, no benchmark or tuner code);
``kittenmoe tune`` writes the entries (``store_config``).

Cache: one JSON file per key under ``$KITTENMOE_CACHE_DIR/tune/`` (default ``~/.cache/kittenmoe/tune/``); the
key is the problem's dims (T, H, I, E, K, shared width S), R ranks, the GPU name, the dtype and the kittenmoe
version. ``lookup_config`` returns the cached ``KernelConfig`` or None; a file written by another kittenmoe
version or with another set of ``KernelConfig`` knobs (stale), or one that cannot be read (corrupt), is
ignored with a ``TuneCacheWarning``, never an exception. ``KITTENMOE_AUTOTUNE=0`` makes every lookup return
None, pinning the heuristic; ``kittenmoe tune`` still writes the cache then.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from pathlib import Path

import torch

from kittenmoe.config import KernelConfig, default_config

ENV_CACHE_DIR = "KITTENMOE_CACHE_DIR"
ENV_AUTOTUNE = "KITTENMOE_AUTOTUNE"
CACHE_FORMAT = 1


class TuneCacheWarning(RuntimeWarning):
    """A tuned-config cache file was ignored (stale, corrupt or unreadable); the heuristic is used instead."""


def _dtype_key(dtype) -> str:
    names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
             "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16"}
    try:
        return names[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {dtype!r}; expected bf16, fp32 or fp16") from None


def cache_dir() -> Path:
    """``$KITTENMOE_CACHE_DIR`` or ``~/.cache/kittenmoe``."""
    d = os.environ.get(ENV_CACHE_DIR)
    return Path(d).expanduser() if d else Path.home() / ".cache" / "kittenmoe"


def autotune_enabled() -> bool:
    """False when ``KITTENMOE_AUTOTUNE`` is 0 / false / no / off: lookups return None."""
    return os.environ.get(ENV_AUTOTUNE, "1").strip().lower() not in ("0", "false", "no", "off")


def _package_version() -> str:
    import kittenmoe

    return kittenmoe.__version__


def cache_key(t: int, h: int, i: int, e: int, k: int, ranks: int, device_name: str, dtype, s: int | None = None
              ) -> dict:
    """The cache key: dims (S defaults to I: one shared expert of the routed width), R, GPU, dtype, version."""
    dims = dict(t=t, h=h, i=i, e=e, k=k, s=i if s is None else s, ranks=ranks)
    for name, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "s" else 1):
            raise ValueError(f"cache key: {name} must be a positive int, got {v!r}")
    return dict(**dims, device=str(device_name), dtype=_dtype_key(dtype), version=_package_version())


def cache_path(key: dict) -> Path:
    """One file per key, the version left out of the name so that a stale file is found (and reported)."""
    dev = re.sub(r"[^A-Za-z0-9_.-]+", "_", key["device"]).strip("_") or "device"
    name = f"{dev}-{key['dtype']}-T{key['t']}-H{key['h']}-I{key['i']}-E{key['e']}-K{key['k']}-S{key['s']}" \
           f"-R{key['ranks']}.json"
    return _path_in(os.environ.get(ENV_CACHE_DIR, ""), os.environ.get("HOME", ""), name)


@functools.lru_cache(maxsize=256)
def _path_in(env_dir: str, home: str, name: str) -> Path:
    """The file ``name`` under ``cache_dir()``, kept a table by what that reads ($KITTENMOE_CACHE_DIR, $HOME):
    building the Path took ~10 us of every forward's config lookup."""
    return cache_dir() / "tune" / name


def store_config(key: dict, config: KernelConfig, extra: dict | None = None) -> Path:
    """Write ``config`` as the winner for ``key`` (atomically: a reader never sees half a file)."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = dict(format=CACHE_FORMAT, kittenmoe_version=key["version"], key=key, config=dataclasses.asdict(config),
                 **(extra or {}))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(entry, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    _memo.clear()
    return path


_memo: dict[tuple, KernelConfig | None] = {}


def _read_entry(path: Path, key: dict) -> KernelConfig | None:
    def ignore(why: str) -> None:
        warnings.warn(f"kittenmoe: ignoring the tuned-config cache file {path}: {why}; using the heuristic "
                      f"config (re-run `kittenmoe tune` to refresh it)", TuneCacheWarning, stacklevel=4)

    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        ignore(f"it cannot be read as JSON ({type(exc).__name__}: {exc})")
        return None
    if not isinstance(entry, dict) or entry.get("format") != CACHE_FORMAT:
        ignore(f"unknown format {entry.get('format') if isinstance(entry, dict) else type(entry).__name__!r} "
               f"(expected {CACHE_FORMAT})")
        return None
    if entry.get("kittenmoe_version") != key["version"]:
        ignore(f"stale: written by kittenmoe {entry.get('kittenmoe_version')!r}, this is {key['version']!r}")
        return None
    if entry.get("key") != key:
        ignore(f"its key {entry.get('key')!r} does not match {key!r}")
        return None
    cfg = entry.get("config")
    if isinstance(cfg, dict):
        # A knob added since the entry was tuned would take its dataclass default, silently replacing what
        # the heuristic now sets (the package version has not moved, so the check above cannot see it).
        fields = {f.name for f in dataclasses.fields(KernelConfig)}
        if set(cfg) != fields:
            ignore(f"stale: tuned with another set of KernelConfig knobs (missing: "
                   f"{', '.join(sorted(fields - set(cfg))) or 'none'}; unknown: "
                   f"{', '.join(sorted(set(cfg) - fields)) or 'none'})")
            return None
    try:
        if not isinstance(cfg, dict):
            raise TypeError(f"config is a {type(cfg).__name__}, not an object")
        return KernelConfig(**cfg)
    except (TypeError, ValueError) as exc:
        ignore(f"its config is not a valid KernelConfig ({exc})")
        return None


def lookup_config(t: int, h: int, i: int, e: int, k: int, ranks: int, device_name: str, dtype, s: int | None = None
                  ) -> KernelConfig | None:
    """The tuned ``KernelConfig`` cached for this problem, or None.

    ``t`` tokens per rank, ``h`` hidden, ``i`` expert width, ``e`` routed
    experts in total over ``ranks`` ranks, top-``k``, ``device_name`` as
    ``torch.cuda.get_device_name`` gives it (``"cpu"`` for the interpreter),
    ``dtype`` (torch dtype or "bf16"/"fp32"), ``s`` the shared expert's width
    (default ``i``). None when nothing is cached, when ``KITTENMOE_AUTOTUNE=0``,
    or when the file is stale or corrupt (with a warning). Results are
    memoised per file state, so calling it on every forward is cheap.
    """
    if not autotune_enabled():
        return None
    key = cache_key(t, h, i, e, k, ranks, device_name, dtype, s)
    path = cache_path(key)
    try:
        st = path.stat()
    except OSError:
        return None
    memo_key = (str(path), st.st_mtime_ns, st.st_size, key["version"])
    if memo_key not in _memo:
        _memo[memo_key] = _read_entry(path, key)
    return _memo[memo_key]


def config_for(t: int, h: int, i: int, e: int, k: int, ranks: int, device, dtype, s: int | None = None
               ) -> tuple[KernelConfig, str]:
    """(config, source) the layer should use: the tuned cache entry when one matches, else the heuristic."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    cfg = lookup_config(t, h, i, e, k, ranks, name, dtype, s)
    if cfg is not None:
        return cfg, "tuned cache"
    why = "KITTENMOE_AUTOTUNE=0" if not autotune_enabled() else "no tuned config cached"
    tdtype = dtype if isinstance(dtype, torch.dtype) else {"bf16": torch.bfloat16, "fp32": torch.float32,
                                                           "fp16": torch.float16}[_dtype_key(dtype)]
    return _heuristic(t, h, i, e, k, ranks, dev, tdtype, s), f"heuristic ({why})"


@functools.lru_cache(maxsize=256)
def _heuristic(t: int, h: int, i: int, e: int, k: int, ranks: int, device: torch.device, dtype: torch.dtype,
               s: int | None) -> KernelConfig:
    """``default_config`` without overrides, once a problem: a function of the problem and the device's fixed
    properties, and 60 us a call on a CPU core, which a public entry would otherwise pay every forward."""
    return default_config(t, h, i, e, k, ranks, device, dtype, s)
