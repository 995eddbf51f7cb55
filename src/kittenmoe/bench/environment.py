"""Where a benchmark runs and what stamps its results: the device (``--device``), the software versions, the
date and command line, and the optional baselines that could not run here."""

from __future__ import annotations

import datetime
import importlib.util
import platform
import sys
from typing import Callable

import torch

from kittenmoe.checks import interpreting

# Baselines that need packages we do not depend on: reported as skipped when not importable.
OPTIONAL_BASELINES = ("deep_ep",)


def resolve_device(device: str | None) -> torch.device:
    """``--device`` (default: cuda if available, else cpu); a CPU device needs the Triton interpreter."""
    dev = torch.device(device if device else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {dev} asked for, but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "cpu":
        if not interpreting():
            raise ValueError("on CPU the megakernel runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
                             "in the environment (for tests; CPU times are not GPU figures)")
    else:
        raise ValueError(f"--device must be cpu or cuda[:N], got {dev}")
    return dev


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def environment(device: torch.device) -> dict:
    """The stamps of every row: GPU name, ``cuda`` or ``cpu-interpreter``, versions, SM count on CUDA."""
    import triton

    import kittenmoe

    env = dict(gpu=device_name(device), device="cuda" if device.type == "cuda" else "cpu-interpreter",
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               kittenmoe=kittenmoe.__version__)
    if device.type == "cuda":
        env["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return env


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "kittenmoe " + " ".join(args)


def skipped_baselines(log: Callable[[str], None] = print, processes: bool = False) -> list[str]:
    """One line per optional baseline: skipped because not importable, or not run here."""
    notes = []
    for mod in OPTIONAL_BASELINES:
        if importlib.util.find_spec(mod) is None:
            notes.append(f"skipped: {mod} not importable")
        elif processes:
            notes.append(f"skipped: {mod} is importable, but kittenmoe bench has no {mod} baseline yet")
        else:
            notes.append(f"skipped: {mod} is importable, but its baseline needs one process per rank "
                         f"(torchrun); this single-process bench does not run it")
    for n in notes:
        log(n)
    return notes
