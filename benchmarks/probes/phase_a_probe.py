"""Why does the backward's phase-A GEMM run at ~2/3 of phase B's rate a program (GPU probe)?

Phase A's kept tiles compute d_hidden = d_out_rows [BM, H] @ W2[e] [H, I] over K = H (Kimi: 7,168) on
128 x 128 tiles, and reached ~3.9 TFLOP/s a program inside the backward megakernel against phase B's 5.8
(128 x 256, K = 2I). This probe runs the same TMA K loop alone, persistent over 116 programs as the megakernel's
compute programs were, on the Kimi slice's phase-A problem (144 row tiles of 128, three an expert, 16 column
tiles), and varies one thing at a time:

- ``bn``: 128 (phase A's tile) or 256 (phase B's shape);
- ``stages``: the K loop's pipeline depth;
- ``l2``: every row tile reads the rows and weights of expert 0 (5.5 + 29 MB: L2-resident after the first
  touch) instead of its own expert's (the first touch of 48 experts' 1.4 GB of weights from HBM).

Each row prints ms, TFLOP/s and TFLOP/s a program, beside torch.mm of the same FLOPs (dense, one GEMM).
H200 (Triton 3.6), TFLOP/s a program at bn 128: 2.33 / 3.90 / 4.70 / 4.78 / 4.74 at 2 / 3 / 4 / 5 / 6 stages, 5.74
at 4 with L2-resident operands; bn 256 at 4 stages 5.13 (6.10 resident); torch.mm 5.63 a SM (6.05 in another run).
So the loop is latency-bound below 4 stages, depth past 4 buys nothing, and operands on first touch from HBM cost
18-22% against L2-resident ones: what later made each expert's row tiles run together (``KernelConfig.tile_group_m``
-1). Two K steps an iteration and deeper phase-A loops were tried in the megakernel and dropped
(docs/experiments/phase-a-k-unroll.md, phase-a-pipeline-depth.md).

    PYTHONPATH=src python3 benchmarks/probes/phase_a_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _k_loop(a_desc, a_row0, b_desc, b_row0, n0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            NS: tl.constexpr):
    """The backward's phase-A K loop through TMA: a_desc blocks [BM, BK], b_desc blocks [BK, BN], NS stages."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        acc = tl.dot(a_desc.load([a_row0, k0]), b_desc.load([b_row0 + k0, n0]), acc)
    return acc


@triton.jit
def _phase_a_probe(a_desc,  # d_out rows [NR, H] bf16, blocks [BM, BK]
                   b_desc,  # W2 viewed [L * H, I] bf16, blocks [BK, BN]
                   out_ptr,  # [NR, I] bf16
                   n_rt, H, I, L2: tl.constexpr, RT_PER_E: tl.constexpr, RT_PER_MB: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nt_n = I // BN
    per_mb = RT_PER_MB * nt_n
    for tile in range(pid, n_rt * nt_n, nprog):
        # the megakernel's order: minibatch by minibatch, each walked column tile by column tile
        mb = tile // per_mb
        i = tile % per_mb
        nt = i // RT_PER_MB
        rt = mb * RT_PER_MB + i % RT_PER_MB
        if L2:
            rt_in = rt % RT_PER_E  # expert 0's rows and weights, whatever the tile
            e = 0
        else:
            rt_in = rt
            e = rt // RT_PER_E
        acc = _k_loop(a_desc, rt_in * BM, b_desc, e * H, nt * BN, H, BM, BN, BK, NS)
        rm = rt * BM + tl.arange(0, BM)
        rn = nt * BN + tl.arange(0, BN)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * I + rn[None, :], acc.to(tl.bfloat16))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--programs", type=int, default=116, help="persistent programs (the megakernel's compute ones)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, I, L, RT_PER_E, BM, BK = 7168, 2048, 48, 3, 128, 64  # the Kimi slice, 384 padded rows an expert
    NR = L * RT_PER_E * BM
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(NR, H, device=dev, generator=g).to(torch.bfloat16)
    w2 = (torch.randn(L, H, I, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
    out = torch.empty(NR, I, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * NR * H * I

    def desc_a():
        return TensorDescriptor.from_tensor(a, [BM, BK])

    rows = []
    dense_ms = triton.testing.do_bench(lambda: torch.mm(a, w2[0]), warmup=25, rep=200)
    rows.append(dict(variant="torch.mm dense [NR, H] x [H, I]", ms=dense_ms))
    ref = None
    for bn, stages, l2 in [(128, 4, False), (128, 4, True), (128, 3, False), (256, 4, False), (256, 3, False),
                           (256, 4, True), (128, 2, False), (128, 5, False), (128, 6, False), (128, 6, True)]:
        bdesc = TensorDescriptor.from_tensor(w2.view(L * H, I), [BK, bn])

        def run():
            _phase_a_probe[(args.programs,)](desc_a(), bdesc, out, NR // BM, H, I, L2=l2, RT_PER_E=RT_PER_E,
                                             RT_PER_MB=2048 // BM, BM=BM, BN=bn, BK=BK, NS=stages,
                                             num_warps=8, num_stages=stages)
        run()
        torch.cuda.synchronize()
        if not l2:  # the same sums whatever the tile: check one row tile of every variant against the first
            if ref is None:
                ref = out.clone()
                want = (a[:BM].float() @ w2[0].float())
                err = ((out[:BM].float() - want).abs().sum() / want.abs().sum()).item()
                assert err < 1e-2, f"probe wrong: rel L1 {err:.2e}"
                same = True
            else:
                same = torch.equal(out, ref)
        else:
            same = None  # other rows by design
        ms = triton.testing.do_bench(run, warmup=25, rep=200)
        rows.append(dict(variant=f"bn={bn} stages={stages} l2={'yes' if l2 else 'no'}", ms=ms,
                         same_bits_as_first=same))
        print(rows[-1], flush=True)
    print(f"\n{'variant':40s} {'ms':>8s} {'TFLOP/s':>8s} {'a program':>10s}")
    for r in rows:
        r["tflops"] = flops / r["ms"] / 1e9
        r["tflops_a_program"] = r["tflops"] / (args.programs if r["variant"][:3] == "bn=" else
                                               torch.cuda.get_device_properties(dev).multi_processor_count)
        print(f"{r['variant']:40s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['tflops_a_program']:10.2f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"phase-a-probe-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(path, "w") as f:
        json.dump(dict(kind="phase-a-probe", gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                       triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       command="PYTHONPATH=src python3 benchmarks/probes/phase_a_probe.py", h=H, i=I, experts=L,
                       rows_padded=NR, programs=args.programs, rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
