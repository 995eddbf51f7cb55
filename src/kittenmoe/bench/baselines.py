"""``kittenmoe bench --baseline``: the baselines a single-process bench times beside kittenmoe, and whether each
can run here and on a given problem.

``grouped_mm`` (``kittenmoe.baselines.grouped_mm_forward``) is always timed: it is every row's primary baseline
(``baseline``, ``ms_baseline``, ``speedup``; the fields ``scripts/perf_table.py`` reads). Each other name given
(``--baseline grouped_mm,sonicmoe``, or ``--baseline sonicmoe``) is timed too, in the same interleaved rounds,
and adds its own fields to the rows (``report.make_row``): ``ms_<name>``, ``speedup_vs_<name>``,
``rel_l1_<name>``. One that cannot run here (not importable) or on a problem (its dtype, its SwiGLU clamp) is
skipped with a line in the output and a ``<name>_note`` in the rows; that is not an error.

``sonicmoe`` (``kittenmoe.baselines_sonic.sonicmoe_forward``) computes the routed experts only (SonicMoE has no
shared expert); its accuracy is checked against the routed-only fp32 reference, and its time compares with
kittenmoe's on the same work when kittenmoe runs without a shared expert too (``--no-shared``; the rows'
``sonicmoe_same_work``).
"""

from __future__ import annotations

import torch

PRIMARY = "grouped_mm"
# --baseline name -> what it times (the rows' "<name>_timed_call")
BASELINES = {
    "grouped_mm": "baselines.grouped_mm_forward (torch._grouped_mm experts, shared expert included)",
    "sonicmoe": "baselines_sonic.sonicmoe_forward (sonicmoe.functional.moe_general_routing_inputs, routed "
                "experts only)",
}


def parse_baselines(spec: str | None) -> tuple[str, ...]:
    """The baselines timed besides grouped_mm, in the order given: ``grouped_mm``, ``sonicmoe`` or several
    comma-separated (repeats count once); ``grouped_mm`` itself is always timed, named or not."""
    names = [] if spec is None else [s.strip() for s in spec.split(",") if s.strip()]
    if spec is not None and not names:
        raise ValueError(f"bad --baseline {spec!r}: name one or more of {', '.join(BASELINES)}, comma-separated")
    extras: list[str] = []
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"bad --baseline {name!r}: known baselines are {', '.join(BASELINES)} (grouped_mm "
                             f"is always timed)")
        if name != PRIMARY and name not in extras:
            extras.append(name)
    return tuple(extras)


def unavailable(name: str) -> str | None:
    """None when baseline ``name`` can run in this process, else why not (one line)."""
    if name == "sonicmoe":
        from kittenmoe.baselines_sonic import sonicmoe_unavailable

        return sonicmoe_unavailable()
    if name == PRIMARY:
        return None
    raise ValueError(f"unknown baseline {name!r}")


def unsupported(name: str, problem, device: torch.device) -> str | None:
    """None when baseline ``name`` runs ``problem`` on ``device``, else why not (one line)."""
    if name == "sonicmoe":
        from kittenmoe import baselines_sonic

        return baselines_sonic.sonicmoe_unsupported(device, problem.torch_dtype, problem.shape.swiglu_limit)
    if name == PRIMARY:
        return None
    raise ValueError(f"unknown baseline {name!r}")
