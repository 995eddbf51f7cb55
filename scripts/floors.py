"""The two floors of each phase of a seed slice's forward and backward: FLOPs over the matmul rate, bytes over
the copy rate (docs/performance.md, "Floors").

    PYTHONPATH=src python3 scripts/floors.py [--tflops 795,714] [--tbs 4.25] [--seeds 20]

Per seed model sliced to one EP8 rank (E_local = E / 8 experts holding all T*K routes, R = 1; T from
kittenmoe.config.SLICE_TOKENS) and per phase, in markdown:

- useful TFLOP: the routed GEMMs' 2*rows*K*N for the T*K real routes, plus the shared expert's for T tokens;
- executed TFLOP: the same with each expert's rows padded to the row tile (128 in the megakernels; the weight
  gradients stop at the real rows rounded up to their 64-row step), averaged over ``--seeds`` routings of the
  benchmarks' kind (kittenmoe.testing.routing_uniform: top-k of standard-normal logits);
- ms at each ``--tflops`` rate (useful FLOPs; the dense bf16 matmul rates measured on the H200);
- GB: every weight (or weight gradient) once plus each activation the phase reads or writes once, bf16, except
  the gate|up pre-activations (bf16) the backward reads (keep_activations); ms at ``--tbs`` TB/s.

CPU only; no GPU is needed.
"""

from __future__ import annotations

import argparse

import torch

from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS
from kittenmoe.testing import routing_uniform


def padded_rows(t: int, e: int, k: int, tile: int, seeds: int) -> float:
    """Mean over routings of sum over experts of the expert's rows rounded up to ``tile``."""
    total = 0
    for s in range(seeds):
        ids, _ = routing_uniform(t, e, k, generator=torch.Generator().manual_seed(s))
        counts = torch.bincount(ids.flatten(), minlength=e)
        total += int(((counts + tile - 1) // tile * tile).sum())
    return total / seeds


def phases(name: str, seeds: int) -> list[tuple[str, float, float, float]]:
    """(phase, useful FLOPs, executed FLOPs, bytes) of the slice's forward and backward phases."""
    sh = SEED_SHAPES[name]
    T, H, I, K, L, S = SLICE_TOKENS[name], sh.h, sh.i, sh.k, sh.e // 8, sh.shared_width
    n = T * K  # routed rows
    n128 = padded_rows(T, L, K, 128, seeds)
    n64 = padded_rows(T, L, K, 64, seeds)
    b = 2  # bf16
    w13, w2 = L * 2 * I * H * b, L * H * I * b  # routed weights
    s13, s2 = 2 * S * H * b, H * S * b  # shared expert's

    def f(rows: float, units: int) -> float:  # units x (rows x H x I) FLOPs: 4 for gate|up, 2 for down
        return units * rows * H * I

    shared = lambda units: units * T * H * S  # noqa: E731
    return [
        # forward: the pull and gate|up with SwiGLU read x once and write hidden
        ("forward gate|up (+ pull, SwiGLU)", f(n, 4) + shared(4), f(n128, 4) + shared(4),
         w13 + s13 + T * H * b + (n * I + T * S) * b),
        ("forward down", f(n, 2) + shared(2), f(n128, 2) + shared(2),
         w2 + s2 + (n * I + T * S) * b + (n * H + T * H) * b),
        ("forward combine epilogue", 0.0, 0.0, (n * H + T * H) * b + T * H * b),
        # backward phase A: d_hidden = d_out W2, the SwiGLU backward reading the kept gate|up, writing
        # d(gate|up) and the weighted hidden rows the weight gradients read
        ("backward phase A (down dgrad, SwiGLU bwd)", f(n, 2) + shared(2), f(n128, 2) + shared(2),
         w2 + s2 + T * H * b + (n * 2 * I + T * 2 * S) * b + (n * 3 * I + T * 3 * S) * b),
        ("backward phase B (gate|up dgrad)", f(n, 4) + shared(4), f(n128, 4) + shared(4),
         w13 + s13 + (n * 2 * I + T * 2 * S) * b + (n * H + T * H) * b),
        ("backward combine epilogue", 0.0, 0.0, (n * H + T * H) * b + T * H * b),
        # weight gradients: dW13 = d(gate|up)^T x, dW2 = (w d_out)^T h; every gradient stored once, the operands
        # read once
        ("weight gradients", f(n, 6) + shared(6), f(n64, 6) + shared(6),
         w13 + w2 + s13 + s2 + (n + T) * (2 * I + H + H + I) * b),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tflops", default="795,714", help="matmul rates, TFLOP/s, comma-separated")
    ap.add_argument("--tbs", type=float, default=4.25, help="copy rate, TB/s (read + write)")
    ap.add_argument("--seeds", type=int, default=20, help="routings averaged for the padding")
    args = ap.parse_args()
    rates = [float(v) for v in args.tflops.split(",")]
    for name in SEED_SHAPES:
        sh = SEED_SHAPES[name]
        T, L = SLICE_TOKENS[name], sh.e // 8
        print(f"\n{name}: T {T}, H {sh.h}, I {sh.i}, K {sh.k}, E_local {L}, shared width {sh.shared_width}\n")
        print("| phase | useful TFLOP | executed TFLOP | " + " | ".join(f"ms at {r:g} TF/s" for r in rates)
              + f" | GB | ms at {args.tbs:g} TB/s |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in rates) + " | ---: | ---: |")
        tot = [0.0, 0.0, 0.0]
        for phase, useful, executed, nbytes in phases(name, args.seeds):
            tot = [tot[0] + useful, tot[1] + executed, tot[2] + nbytes]
            cell = phase.replace("|", "\\|")  # a markdown cell
            print(f"| {cell} | {useful / 1e12:.3f} | {executed / 1e12:.3f} | "
                  + " | ".join(f"{useful / r / 1e9:.3f}" for r in rates)
                  + f" | {nbytes / 1e9:.2f} | {nbytes / args.tbs / 1e9:.3f} |")
        print(f"| forward + backward | {tot[0] / 1e12:.3f} | {tot[1] / 1e12:.3f} | "
              + " | ".join(f"{tot[0] / r / 1e9:.3f}" for r in rates)
              + f" | {tot[2] / 1e9:.2f} | {tot[2] / args.tbs / 1e9:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
