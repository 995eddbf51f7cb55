"""How much of the forward megakernel's span is down tiles waiting for their minibatch's gate|up tiles? A CPU model.

    python3 benchmarks/probes/forward_lag_model.py [--tokens 8192 --h 2048 --i 768 --k 8 --jitter 0.25]

The model follows the forward's tile order (kernels/megakernel_fwd_gluon.py ``_decode``, the resident ring): round r
is minibatch r's gate|up tiles, then minibatch (r - LAG)'s down tiles; program k of P takes tiles k, k + P, ... in
that order; a down tile of minibatch p starts once every gate|up tile of p has finished (``hid_ready[p]`` counts the
whole minibatch). A tile's time is its measured mean times a lognormal factor of spread ``--jitter`` (its sigma), drawn
per tile; tile times scale with their K steps from the calibration. LAG is ``KernelConfig.forward_lag`` (None:
min(ring slots - 1, 1)).

Calibration (H200, Triton 3.6, the Gluon gathering forward's TRACE build at 8192 x 2048 x 768 x 128 x 8, minibatches
of 2,048 rows, 132 programs; ``benchmarks/fwd_round.py --trace``): a gate|up tile 19.97 us of K loop and a down
tile 7.15 us, each plus a 1.78 us epilogue; span 1.143 ms against 0.88 ms of work a program, the producers 27.2 ms
(0.21 ms a program) polling counters. With no spread the model puts the wait at 0.03 ms a program; with a 25% spread
it gives 0.23 ms and a 1.15 ms span, as measured. Out of sample, at 32768 x 4096 x 512 x 128 x 8 (same minibatch,
LAG 1) it gives a 6.47 ms span, where the whole forward measured 6.54 ms (schedule and combine included).

What it predicts (25% spread): at 8192 x 2048 x 768, LAG 2 1.02 ms and 4,096-row minibatches 1.00 (against 1.15);
at 32768 x 4096 x 512, 4,096-row minibatches 4.99 ms and with LAG 2 4.79 (against 6.47): the down tiles of a
2,048-row minibatch there wait on 64 gate|up tiles of 40 us each, most of a round. Unmeasured on the GPU: a lead
for the knobs ``minibatch_size`` and ``forward_lag`` on one rank, not a result.
"""

from __future__ import annotations

import argparse
import random

# The calibration trace's per-tile means (see above), per 64-deep K step: gate|up 19.97 us over K = H = 2048 (32
# steps), down 7.15 us over K = I = 768 (12 steps); the epilogue's 1.78 us a tile
GU_STEP_US, DN_STEP_US, EPI_US = 19.97 / 32, 7.15 / 12, 1.78


def simulate(nmb: int, row_tiles: int, h: int, i: int, lag: int, programs: int, jitter: float,
             seed: int = 0) -> tuple[float, float, float]:
    """(span, work a program, wait a program) in us for ``nmb`` minibatches of ``row_tiles`` 128-row tiles at hidden
    ``h`` and expert width ``i`` (gate|up tiles: i / 128 a row tile, K = h; down: h / 256, K = i), the given LAG,
    programs and spread."""
    rng = random.Random(seed)
    gu_cols, dn_cols = i // 128, h // 256
    tile_us = {"gu": GU_STEP_US * h / 64 + EPI_US, "dn": DN_STEP_US * i / 64 + EPI_US}
    order = []
    for r in range(nmb + lag):
        if r < nmb:
            order += [("gu", r)] * (row_tiles * gu_cols)
        if 0 <= r - lag < nmb:
            order += [("dn", r - lag)] * (row_tiles * dn_cols)
    free = [0.0] * programs  # when each program's previous tile ends
    gu_done = [0.0] * nmb  # when each minibatch's last gate|up tile ends
    waited = work = 0.0
    for j, (kind, p) in enumerate(order):  # a tile's dependencies have lower indices: index order is causal
        k = j % programs
        start = free[k]
        if kind == "dn" and gu_done[p] > start:
            waited += gu_done[p] - start
            start = gu_done[p]
        t = tile_us[kind] * rng.lognormvariate(0.0, jitter)
        work += t
        free[k] = start + t
        if kind == "gu":
            gu_done[p] = max(gu_done[p], free[k])
    return max(free), work / programs, waited / programs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--i", type=int, default=768)
    ap.add_argument("--e", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--jitter", type=float, default=0.25, help="lognormal sigma of a tile's time")
    ap.add_argument("--minibatches", default="1024,2048,4096", help="minibatch sizes (rows), comma-separated")
    ap.add_argument("--lags", default="1,2,3,4")
    args = ap.parse_args()
    rows = args.tokens * args.k + args.e * 64  # routed rows plus about half a tile of padding an expert
    print(f"T {args.tokens}, H {args.h}, I {args.i}, E {args.e}, K {args.k}, {args.programs} programs, "
          f"spread {args.jitter}")
    for mb in (int(v) for v in args.minibatches.split(",")):
        nmb = -(-rows // mb)
        for lag in (int(v) for v in args.lags.split(",")):
            span, work, wait = simulate(nmb, mb // 128, args.h, args.i, lag, args.programs, args.jitter)
            print(f"  minibatch {mb:5d} ({nmb:3d})  LAG {lag}: span {span / 1e3:.3f} ms, work {work / 1e3:.3f} ms "
                  f"a program, waiting {wait / 1e3:.3f} ms a program")


if __name__ == "__main__":
    main()
