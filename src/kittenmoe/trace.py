"""Where a megakernel launch spends its time, from its own timestamps.

``megakernel_forward_multirank(..., trace=True)`` (or ``launch_rank_forward(trace=True)``) builds the forward
megakernel with ``TRACE``: every GEMM tile, and every comm program's pull and push of a minibatch, records one
event ``[kind, program, start, ready, end]`` in the GPU's global nanosecond timer (``%globaltimer``, shared by
all SMs): ``start`` when the program took the work, ``ready`` when its wait for the inputs returned, ``end``
when it signalled the result. ``summarize`` turns the ``[MAXE, 5]`` buffer into per-kind totals:

- **work**: ``end - ready`` summed (the tile's compute or the chunk's copies);
- **wait**: ``ready - start`` summed (spinning on a counter: a producer was late);
- **busy** of a role: its work over (its programs x the launch's span), the rest being waits and idle gaps
  (compute programs: all of them when ``summarize`` is told the launch's program count, else those that
  recorded work).

Kernel-side timestamps show what the phase-subset runs (``--breakdown``) cannot: how long compute programs
spin on the pull, when the first gate|up tile starts, how long the tail after the last down tile is. Under the
interpreter every timestamp is 0; the event counts are still right (tests check them). ``%globaltimer``
may tick in steps of up to ~1 us outside a profiler on some GPUs: events of a few microseconds are resolved
coarsely, sums over many events less so.
"""

from __future__ import annotations

import dataclasses

import torch

# Event kinds by code, as the kernels write them (kernels/megakernel_fwd.py TR_*, tests/test_trace.py checks).
# The Gluon forward (kernels/megakernel_fwd_gluon.py, warp-specialized) records its math group 0's tiles as
# those codes (ready: the first K step's operands in; end: the last wgmma) and, in the codes after, each tile's
# "epilogue" (its stores issued and its counter bumped) and the producer's "counter wait" before a tile that
# polls one (all wait).
KINDS = ("shared gate|up", "gate|up", "down", "shared down", "pull", "push", "epilogue", "counter wait")
# The backward megakernel's (launch_rank_backward(trace=True)), same codes: phase A is the down dgrad with the
# SwiGLU backward, phase B the gate|up dgrad. "A epilogue" (code 6, kernels/megakernel_bwd.py TR_A_EPILOGUE) is
# part of an "A" event, not more work: the SwiGLU backward of a phase-A tile that every kept row made 2 x wide,
# from the end of its GEMM to the tile's end.
# The Gluon backward (kernels/megakernel_bwd_gluon.py, warp-specialized) records what its roles do apart, in
# the codes after: "A" and "B" are math group 0's K loops (ready: the first step's operands in), "A epilogue"
# the epilogue partition's SwiGLU backward of a tile (wait: for the accumulator), "A hand-over" and "B store"
# the math group's wait for the hand-over buffer (wait) and its write into it (work), "a_ready wait" the
# producer's poll before a phase-B tile (all wait). Partitions of one program overlap in time, so "busy"
# is per role.
BWD_KINDS = ("shared A", "A", "B", "shared B", "pull", "push", "A epilogue", "A hand-over", "B store",
             "a_ready wait")
COMM_KINDS = ("pull", "push")


@dataclasses.dataclass(frozen=True)
class KindStats:
    """Totals of one event kind over a launch (ns)."""

    kind: str
    events: int
    programs: int
    work_ns: int
    wait_ns: int
    first_start_ns: int
    last_end_ns: int


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    span_ns: int  # first start to last end, over every event
    num_comm: int  # communication programs (rows 0..num_comm-1 of the buffer)
    num_compute: int
    kinds: tuple[KindStats, ...]

    def table(self) -> str:
        """A fixed-width text table: per kind, events, work and wait (ms, summed over programs), busy (%)."""
        lines = [f"span {self.span_ns / 1e6:.3f} ms; {self.num_comm} comm + {self.num_compute} compute programs",
                 f"{'kind':<15}{'events':>8}{'work ms':>10}{'wait ms':>10}{'busy %':>8}{'first ms':>10}"
                 f"{'last ms':>9}"]
        for k in self.kinds:
            # without comm programs (num_comm_programs_* = 0) every compute program pulls
            role = (self.num_comm or self.num_compute) if k.kind in COMM_KINDS else self.num_compute
            busy = 100.0 * k.work_ns / max(1, role * self.span_ns)
            lines.append(f"{k.kind:<15}{k.events:>8}{k.work_ns / 1e6:>10.3f}{k.wait_ns / 1e6:>10.3f}{busy:>8.1f}"
                         f"{k.first_start_ns / 1e6:>10.3f}{k.last_end_ns / 1e6:>9.3f}")
        return "\n".join(lines)


def events(trace: torch.Tensor) -> torch.Tensor:
    """The recorded events of a ``[MAXE, 5]`` buffer as ``[n, 5]`` int64 rows (program, kind, start, ready,
    end), in slot order; unused slots (kind -1) dropped."""
    if trace.dim() != 2 or trace.shape[-1] != 5 or trace.dtype != torch.int64:
        raise ValueError(f"trace must be the [MAXE, 5] int64 buffer a traced launch fills, got "
                         f"{tuple(trace.shape)} {trace.dtype}")
    t = trace.cpu()
    t = t[t[:, 0] >= 0]
    return t[:, [1, 0, 2, 3, 4]]


def _recorded(trace: torch.Tensor) -> torch.Tensor:
    """``events(trace)``, refusing a trace without any."""
    ev = events(trace)
    if ev.shape[0] == 0:
        raise ValueError("the trace holds no events (was the launch built with trace=True, and did it run?)")
    return ev


def summarize(trace: torch.Tensor, num_comm: int, kinds: tuple[str, ...] = KINDS,
              num_programs: int | None = None) -> TraceSummary:
    """Per-kind totals of one traced launch (``state.trace``); ``num_comm``: the launch's communication
    programs (``KernelConfig.num_comm_programs_fwd`` / ``_bwd``; programs below it are comm programs);
    ``kinds``: the names of the codes (``KINDS``, or ``BWD_KINDS`` for a backward trace); ``num_programs``: the
    launch's programs (one per SM on a GPU), else the compute programs that recorded work are counted."""
    ev = _recorded(trace)
    bad = ev[(ev[:, 1] >= len(kinds))]
    if bad.shape[0]:
        raise ValueError(f"unknown event kinds {sorted(set(bad[:, 1].tolist()))} (known: {kinds})")
    t0 = int(ev[:, 2].min())
    span = int(ev[:, 4].max()) - t0
    stats = []
    for code, name in enumerate(kinds):
        k = ev[ev[:, 1] == code]
        if k.shape[0] == 0:
            continue
        stats.append(KindStats(
            kind=name, events=int(k.shape[0]), programs=int(k[:, 0].unique().numel()),
            work_ns=int((k[:, 4] - k[:, 3]).sum()), wait_ns=int((k[:, 3] - k[:, 2]).sum()),
            first_start_ns=int(k[:, 2].min()) - t0, last_end_ns=int(k[:, 4].max()) - t0))
    compute = (num_programs - num_comm if num_programs is not None
               else ev[ev[:, 0] >= num_comm, 0].unique().numel())  # else the compute programs that did work
    return TraceSummary(span_ns=span, num_comm=num_comm, num_compute=int(compute), kinds=tuple(stats))


def chrome_trace(trace: torch.Tensor, num_comm: int, kinds: tuple[str, ...] = KINDS) -> dict:
    """The events as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one row per program
    (comm programs first), a slice per event's work and, before it, a "wait" slice when its wait took time.
    Times in microseconds from the launch's first event. ``json.dump`` the result to a file to view it."""
    ev = _recorded(trace)
    t0 = int(ev[:, 2].min())
    out = []
    for prog, kind, start, ready, end in ev.tolist():
        role = "comm" if prog < num_comm else "compute"
        name = kinds[kind] if 0 <= kind < len(kinds) else f"kind {kind}"
        if ready > start:
            out.append(dict(name="wait", cat=role, ph="X", pid=0, tid=prog, ts=(start - t0) / 1e3,
                            dur=(ready - start) / 1e3, args=dict(before=name)))
        out.append(dict(name=name, cat=role, ph="X", pid=0, tid=prog, ts=(ready - t0) / 1e3, dur=(end - ready) / 1e3))
    names = [dict(name="thread_name", ph="M", pid=0, tid=p,
                  args=dict(name=f"{'comm' if p < num_comm else 'compute'} {p}"))
             for p in sorted(set(ev[:, 0].tolist()))]
    return dict(traceEvents=names + out, displayTimeUnit="ns")
