"""Can the Gluon forward's operand ring deadlock? A model of its barrier protocol, run on CPU.

    python3 benchmarks/probes/ring_protocol.py [--trials 3000]

The model follows kernels/megakernel_fwd_gluon.py: a producer fills a ring of STAGES stages, tile after tile;
two math groups consume every stage (``empty`` counts two arrivals) and release a step's stage one step later.
In the gathering form a stage's ``ready`` barrier counts two arrivals: the weight tiles' TMA bytes and the
gathered rows', which the barrier itself tracks (``_copy_rows``: each producer thread's cp.async copies hold
the phase open until they land), so both complete without the producer waiting; a tile loaded whole through
TMA gives the second at once. ``late=True`` models the other protocol, the Gluon backward's, where the producer
signals a stage's rows one K step late, after waiting for its own copies and for the stage it fills next. The mbarrier
model: a count of completed phases c and the arrivals of the current phase; ``wait(p)`` passes while
``c % 2 != p`` (a fresh barrier passes parity 1). The actors run in random interleavings over random tile
sequences (kinds, K steps 0-8); a state where every live actor waits is a deadlock.

Answer: the forward's pull and gathering forms run at any depth; with the late signal the gathering form
deadlocks at 2 stages (it waits on a release that needs it) and runs at 3 and 4.

The Gluon backward's protocol (``run_backward``: its gathered phase-A tiles, signalled late, its a_ready wait
before phase-B tiles, and the phase-A accumulators handed to the epilogue partition through one buffer a math
group) likewise runs at 3 and 4 stages and deadlocks at 2; its kernel runs 3 (``tests/test_megakernel_bwd_gluon.py``
runs both). With its rows tracked by the barrier (``late=False``, the kernel's form where d_out fits in the L2:
``launch_backward.gather_tracked``) it runs at 2 as well.
"""

from __future__ import annotations

import argparse
import random


class Barrier:
    def __init__(self, count: int):
        self.count, self.arrivals, self.phases = count, 0, 0

    def arrive(self) -> None:
        self.arrivals += 1
        if self.arrivals == self.count:
            self.arrivals = 0
            self.phases += 1

    def passes(self, parity: int) -> bool:
        return self.phases % 2 != parity


def fill_tile(ks, it, S, ready, empty, second, late):
    """The producer's K steps of one tile into the ring from ring use ``it``; returns the next use. ``second``:
    each stage's ``ready`` takes a second arrival (a gathering ring), at once (a whole-TMA tile, or gathered rows
    the barrier tracks) or, with ``late``, one step late (gathered rows signalled after the producer's wait)."""
    for k in range(ks):
        st = it % S
        while not empty[st].passes(((it // S) & 1) ^ 1):
            yield "wait empty"
        ready[st].arrive()  # expect + the TMA bytes (their completion modelled at once)
        if second and not late:
            ready[st].arrive()  # a whole-TMA tile's second arrival, or the tracked rows', at once
        elif second and k > 0:
            ready[(it + S - 1) % S].arrive()  # late: the previous step's gathered rows
        it += 1
    if second and late and ks > 0:
        ready[(it + S - 1) % S].arrive()
    return it


def consume_tile(ks, it, S, ready, empty):
    """A math group's K steps of one tile from ring use ``it``, a step's stage released one step later;
    returns the next use."""
    for k in range(ks):
        st = it % S
        while not ready[st].passes((it // S) & 1):
            yield "wait ready"
        if k > 0:
            empty[(it + S - 1) % S].arrive()
        it += 1
    if ks > 0:
        empty[(it + S - 1) % S].arrive()
    return it


def producer(tiles, S, ready, empty, gather, late=False):
    it = 0
    for kind, ks in tiles:
        it = yield from fill_tile(ks, it, S, ready, empty, gather, late and kind == "gu")
        yield "tile done"


def math_group(tiles, S, ready, empty):
    it = 0
    for _, ks in tiles:
        it = yield from consume_tile(ks, it, S, ready, empty)
        yield "tile done"


def interleave(actors: dict, rng: random.Random) -> bool:
    """Step randomly chosen actors (generators yielding "wait ..." while blocked) until all finish: True, or until
    no actor has progressed for far longer than their count could take: a deadlock, False."""
    idle = 0
    while actors:
        name = rng.choice(list(actors))
        try:
            what = next(actors[name])
        except StopIteration:
            del actors[name]
            idle = 0
            continue
        idle = idle + 1 if what.startswith("wait") else 0
        if idle > 2000:  # far more than the actors' count of consecutive waits without progress
            return False
    return True


def run(tiles, S: int, gather: bool, seed: int, late: bool = False) -> bool:
    """True when every actor finishes; False on a deadlock."""
    rng = random.Random(seed)
    ready = [Barrier(2 if gather else 1) for _ in range(S)]
    empty = [Barrier(2) for _ in range(S)]
    actors = {"producer": producer(tiles, S, ready, empty, gather, late),
              "group 0": math_group(tiles, S, ready, empty),
              "group 1": math_group(tiles, S, ready, empty)}
    return interleave(actors, rng)


# ---- the Gluon backward (kernels/megakernel_bwd_gluon.py): phase-A tiles gathered (signalled one step late, or
# with ``late=False`` tracked by the barrier), phase-B tiles
# through TMA after the producer's a_ready wait, and the phase-A accumulators handed to an epilogue partition
# through one shared-memory buffer a math group (dh_full / dh_free, one arrival each), which a phase-B tile's d_x
# stores also use (they wait on dh_free too). a_ready is modelled within one program: a phase-B tile waits for
# the epilogue signals of every phase-A tile before it (the kernel's minibatch p - 1 precedes its B tiles in every
# program's sequence, so one program's view is the binding one).

def bwd_producer(tiles, S, ready, empty, signals, late=True):
    it = 0
    a_before = 0
    for kind, ks in tiles:
        if kind == "b":
            while signals[0] < a_before:
                yield "wait a_ready"
            it = yield from fill_tile(ks, it, S, ready, empty, True, False)  # whole through TMA
        elif kind == "a":
            it = yield from fill_tile(ks, it, S, ready, empty, True, late)  # gathered rows
        if kind in ("a", "ae"):
            a_before += 1
        yield "tile done"


def bwd_math(tiles, S, ready, empty, dh_full, dh_free):
    it = 0
    nh = 0
    for kind, ks in tiles:
        if kind == "ae":
            continue
        it = yield from consume_tile(ks, it, S, ready, empty)
        while not dh_free.passes((nh & 1) ^ 1):  # the last accumulator handed over has been taken
            yield "wait dh_free"
        if kind == "a":
            dh_full.arrive()
            nh += 1
        yield "tile done"


def bwd_epilogue(tiles, dh_full, dh_free, signals):
    n = 0
    for kind, _ in tiles:
        if kind == "a":
            for g in (0, 1):
                while not dh_full[g].passes(n & 1):
                    yield "wait dh_full"
                dh_free[g].arrive()
            n += 1
        if kind in ("a", "ae"):
            signals[0] += 1
        yield "tile done"


def run_backward(tiles, S: int, seed: int, late: bool = True) -> bool:
    """True when every actor of the Gluon backward's protocol finishes; False on a deadlock."""
    rng = random.Random(seed)
    ready = [Barrier(2) for _ in range(S)]
    empty = [Barrier(2) for _ in range(S)]
    dh_full, dh_free = [Barrier(1), Barrier(1)], [Barrier(1), Barrier(1)]
    signals = [0]
    actors = {"producer": bwd_producer(tiles, S, ready, empty, signals, late),
              "group 0": bwd_math(tiles, S, ready, empty, dh_full[0], dh_free[0]),
              "group 1": bwd_math(tiles, S, ready, empty, dh_full[1], dh_free[1]),
              "epilogue": bwd_epilogue(tiles, dh_full, dh_free, signals)}
    return interleave(actors, rng)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3000)
    args = ap.parse_args()
    print(f"{'form':<22}{'stages':>7}{'deadlocked':>12}  (of {args.trials} random tile sequences)")
    for late in (True, False):
        for S in (2, 3, 4):
            bad = 0
            for trial in range(args.trials):
                rng = random.Random(trial)
                tiles = [(rng.choice(["a", "ae", "b"]), rng.choice([1, 2, 3, 4, 8]))
                         for _ in range(rng.randint(0, 8))]
                bad += not run_backward(tiles, S, trial, late)
            print(f"{'backward' + (', late' if late else ', tracked'):<22}{S:>7}{bad:>12}")
    for gather, late in ((False, False), (True, False), (True, True)):
        for S in (2, 3, 4):
            bad = 0
            for trial in range(args.trials):
                rng = random.Random(trial)
                tiles = [(rng.choice(["gu", "dn", "sh"]), rng.choice([0, 1, 2, 3, 4, 8]))
                         for _ in range(rng.randint(0, 6))]
                bad += not run(tiles, S, gather, trial, late)
            form = ("forward, gather" + (", late" if late else "")) if gather else "forward, pull"
            print(f"{form:<22}{S:>7}{bad:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
