"""One device run for the FP8 forward: check, time against our BF16 forward, a short table last.

    PYTHONPATH=src python3 benchmarks/fp8_round.py [--shapes kimi-k2.7,...] [--reps 10] [--out DIR]

Per seed shape sliced to one EP8 rank (R=1): the FP8 megakernel forward (e4m3 routed experts, weights
quantised once beforehand, x and hidden quantised inside the kernel) against ``moe_reference_fp8`` and the
unquantised fp32 reference, and the FP8 backward's gradients against ``moe_backward_reference_fp8``; then, in
the same run, the median latency of the FP8 forward, our BF16 forward (its heuristic config), the grouped_mm
baseline, and FP8 vs BF16 forward+backward (kept activations, as autograd runs them). Beside them the matmul ceilings of this GPU: a dense
8192^3 bf16 ``torch.matmul`` and the e4m3 ``torch._scaled_mm`` (per-tensor scales), in TFLOP/s. One JSON row
per shape (kind "forward-fp8") in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import torch
import triton

from kittenmoe.baselines import grouped_mm_forward
from kittenmoe.bench import measure_interleaved
from kittenmoe.config import SEED_SHAPES, SLICE_TOKENS, default_config
from kittenmoe.fp8 import FP8Config, FP8ExpertWeights
from kittenmoe.launch_backward import megakernel_backward_multirank
from kittenmoe.launch_common import fp8_dgu_block
from kittenmoe.launch_forward import megakernel_forward_multirank
from kittenmoe.peers import LocalPeers
from kittenmoe.reference import moe_backward_reference_fp8, moe_reference, moe_reference_fp8
from kittenmoe.testing import make_weights, rel_l1, routing_uniform

SLICES = SLICE_TOKENS  # kittenmoe.config: the one-GPU slices (tokens at EP8)


def ceilings(reps: int) -> dict:
    """Dense matmul rates of this GPU, TFLOP/s: bf16 and e4m3 (torch._scaled_mm, bf16 out)."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    ms_bf16 = triton.testing.do_bench(lambda: a @ b, warmup=20, rep=reps * 20, return_mode="median")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms_fp8 = triton.testing.do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16),
                                     warmup=20, rep=reps * 20, return_mode="median")
    flop = 2 * n ** 3
    return dict(bf16_tflops=flop / ms_bf16 / 1e9, fp8_tflops=flop / ms_fp8 / 1e9)


def with_flags(fp8: FP8ExpertWeights, **flags) -> FP8ExpertWeights:
    """The same e4m3 weights with ``FP8Config`` precision flags (``dx_high``, ``down_high``) set."""
    return dataclasses.replace(fp8, cfg=dataclasses.replace(fp8.cfg, **flags))


def a_args(x, ids, wts, w, shape):
    """The multirank launchers' positional arguments for one rank."""
    return ([x], [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SLICES))
    ap.add_argument("--reps", type=int, default=10, help="time budget: reps x 20 ms of timed runs a variant")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the budget is split over")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--comm", default="",
                    help="communication program counts to try for the FP8 forward (e.g. 12,16,24; default: the BF16 "
                         "heuristic's); the fastest, with block_m 128 or 64, is the FP8 config of the row")
    ap.add_argument("--scale-block", type=int, default=128, choices=(32, 128),
                    help="FP8 scale block: 128 (DeepSeek-V3) or 32 (MXFP8, power-of-two scales)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time subsets of the FP8 and BF16 forwards' phases (pull, +gate|up, +down, all)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    ceil = ceilings(args.reps)
    print(env, {k: round(v) for k, v in ceil.items()}, flush=True)
    rows = []
    for name in args.shapes.split(","):
        base = SEED_SHAPES[name]
        shape = base.with_(e=base.e // 8)
        T = SLICES[name]
        g = torch.Generator().manual_seed(0)
        w = make_weights(shape, dtype=torch.bfloat16, device=dev, generator=g)
        x = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
        ids, wts = routing_uniform(T, shape.e, shape.k, generator=g, device=dev)
        fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI, FP8Config(args.scale_block, args.scale_block == 32))
        fp8_down = with_flags(fp8, down_high=True)  # FP8Config.down_high: the forward's down projection in bf16
        fp8_dx = with_flags(fp8, dx_high=True)  # FP8Config.dx_high: d_x = d(gate|up) W13 in bf16
        fp8_both = with_flags(fp8, dx_high=True, down_high=True)
        peers = LocalPeers(1, dev)
        cfg = default_config(T, shape.h, shape.i, shape.e, shape.k, device=dev)
        a = a_args(x, ids, wts, w, shape)
        cfg8 = cfg.with_(block_n=max(128, fp8.cfg.scale_block))
        # block_m 64 as well: the per-step promotion holds each K step's fp32 product beside the accumulators,
        # and at 128 x 128 tiles (gate and up) that spills on sm_90 (scripts/sm90_compile.py --fp8: a 232-byte
        # stack; 0 at block_m 64). The faster forward decides the config of the rest of the row.
        comms = [int(v) for v in args.comm.split(",")] if args.comm else [cfg.num_comm_programs_fwd]
        cands = {f"bm{bm}-comm{nc}": cfg8.with_(block_m=bm, num_comm_programs_fwd=nc)
                 for bm in (128, 64) for nc in comms}
        # The candidates, FP8Config.down_high at both row tiles (without the down GEMM's promotions block_m 128
        # spills far less: Triton 3.6 sm_90 build, a 64-byte stack against 256, so it may win where it lost
        # before; at the first --comm count), timed together in interleaved rounds.
        cand_fns = {}
        for label, c, q in ([(k, c, fp8) for k, c in cands.items()]
                            + [(f"down_high-bm{bm}", cfg8.with_(block_m=bm, num_comm_programs_fwd=comms[0]), fp8_down)
                               for bm in (128, 64)]):
            megakernel_forward_multirank(*a, config=c, peers=peers, fp8=q)  # compile outside the timing
            cand_fns[label] = lambda c=c, q=q: megakernel_forward_multirank(*a, config=c, peers=peers, fp8=q)
        cand_ms = {k: t.ms for k, t in measure_interleaved(cand_fns, dev, rounds=args.rounds,
                                                           rep_ms=args.reps * 10 / args.rounds).items()}
        ms_alt = {k: v for k, v in cand_ms.items() if k in cands}
        print(f"  fp8 forward by config: { {k: round(v, 3) for k, v in ms_alt.items()} }", flush=True)
        cfg8 = cands[min(ms_alt, key=ms_alt.get)]
        down_ms = {bm: cand_ms[f"down_high-bm{bm}"] for bm in (128, 64)}
        print(f"  down_high forward by block_m: { {k: round(v, 3) for k, v in down_ms.items()} }", flush=True)
        down_bm = min(down_ms, key=down_ms.get)
        phase_ms = {}
        if args.breakdown:  # where the FP8 forward's time goes, beside the BF16 forward's
            from kittenmoe.kernels import megakernel_fwd as mk

            masks = {"pull": mk.PH_PULL, "+gateup": mk.PH_PULL | mk.PH_GATEUP,
                     "+down": mk.PH_PULL | mk.PH_GATEUP | mk.PH_DOWN, "all": mk.PH_ALL}
            for prec, c, q in (("fp8", cfg8, fp8), ("bf16", cfg, None)):
                for label, m in masks.items():
                    phase_ms[f"{prec} {label}"] = triton.testing.do_bench(
                        lambda c=c, q=q, m=m: megakernel_forward_multirank(*a, config=c, peers=peers, fp8=q, phases=m),
                        warmup=20, rep=args.reps * 10, return_mode="median")
                    print(f"  {prec} forward phases {label:<8} {phase_ms[f'{prec} {label}']:.3f} ms", flush=True)
            from kittenmoe.kernels import megakernel_bwd as mb

            d_out0 = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)
            bmasks = {"pull": mb.PB_PULL, "+A": mb.PB_PULL | mb.PB_A,
                      "+B+push": mb.PB_PULL | mb.PB_A | mb.PB_B | mb.PB_PUSH,
                      "+wgrad": mb.PB_PULL | mb.PB_A | mb.PB_B | mb.PB_PUSH | mb.PB_WGRAD, "all": mb.PB_ALL}
            for prec, c, q in (("fp8", cfg8, fp8), ("bf16", cfg, None)):
                kept = megakernel_forward_multirank(*a, config=c, peers=peers, fp8=q, save_for_backward=True)
                for label, m in bmasks.items():
                    key = f"{prec} backward {label}"
                    phase_ms[key] = triton.testing.do_bench(
                        lambda c=c, q=q, m=m, kept=kept: megakernel_backward_multirank(
                            [d_out0], *a, config=c, peers=peers, saved=kept.saved(), fp8=q, phases=m),
                        warmup=10, rep=args.reps * 10, return_mode="median")
                    print(f"  {key:<22} {phase_ms[key]:.3f} ms", flush=True)
                del kept

        cfg8d = cfg8.with_(block_m=down_bm)

        def run_fp8_down_high():  # FP8Config.down_high: the forward's down projection in bf16
            return megakernel_forward_multirank(*a, config=cfg8d, peers=peers, fp8=fp8_down).outputs[0]

        def run_fp8():
            return megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8).outputs[0]

        def run_bf16():
            return megakernel_forward_multirank(*a, config=cfg, peers=peers).outputs[0]

        res = megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8)
        res.check_errors()
        out = res.outputs[0].clone()
        ck = res.states[0].compiled
        emu = moe_reference_fp8(x, ids, wts, fp8, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit,
                                compute_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, shape.swiglu_limit,
                            torch.float32)
        row = dict(kind="forward-fp8", shape=name, fp8_ms_by_config=ms_alt, phase_ms=phase_ms or None, ep_slice=8, experts_local=shape.e, tokens=T, h=shape.h, i=shape.i,
                   k=shape.k, dtype="fp8-e4m3/bf16", ranks=1, config=str(cfg8.__dict__), config_bf16=str(cfg.__dict__),
                   scale_block=fp8.cfg.scale_block, **env, **ceil,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="PYTHONPATH=src python3 " + " ".join(sys.argv),
                   rel_l1_vs_emulation=rel_l1(out, emu), rel_l1_fp8=rel_l1(out, ref),
                   deterministic=all(torch.equal(run_fp8(), out) for _ in range(3)),
                   regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                   shared_bytes=ck.metadata.shared if ck is not None else None)
        del emu, ref
        print(f"{name}: rel L1 vs emulation {row['rel_l1_vs_emulation']:.2e}, vs fp32 reference "
              f"{row['rel_l1_fp8']:.2e}, deterministic {row['deterministic']}, {row['regs']} regs, "
              f"{row['spills']} spills", flush=True)
        d_out = torch.randn(T, shape.h, generator=g).to(dev, torch.bfloat16)

        def run_fp8_fb():  # as autograd would: the forward keeps gate|up, the backward reads it
            f = megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8, save_for_backward=True)
            return megakernel_backward_multirank([d_out], *a, config=cfg8, peers=peers, saved=f.saved(), fp8=fp8)

        def run_fp8_fb_replay():  # nothing kept: the backward replays gate|up in e4m3
            megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8)
            return megakernel_backward_multirank([d_out], *a, config=cfg8, peers=peers, fp8=fp8)

        def run_fp8_fb_dx_high():  # FP8Config.dx_high: d_x = d(gate|up) W13 in bf16, the rest e4m3
            f = megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8_dx, save_for_backward=True)
            return megakernel_backward_multirank([d_out], *a, config=cfg8, peers=peers, saved=f.saved(), fp8=fp8_dx)

        def run_fp8_fb_both_high():  # both: e4m3 gate|up and down dgrad, the rest bf16 (+ bf16 wgrad)
            f = megakernel_forward_multirank(*a, config=cfg8, peers=peers, fp8=fp8_both, save_for_backward=True)
            return megakernel_backward_multirank([d_out], *a, config=cfg8, peers=peers, saved=f.saved(),
                                                 fp8=fp8_both)

        def run_bf16_fb():
            f = megakernel_forward_multirank(*a, config=cfg, peers=peers, save_for_backward=True)
            return megakernel_backward_multirank([d_out], *a, config=cfg, peers=peers, saved=f.saved())

        fb = run_fp8_fb()
        fb.check_errors()
        emu_g = moe_backward_reference_fp8(d_out, x, ids, wts, fp8, w.shared_w13_2SH, w.shared_w2_HS,
                                           shape.swiglu_limit, dgu_block=fp8_dgu_block(cfg8, fp8.cfg.scale_block),
                                           compute_dtype=torch.float32)
        row["grad_rel_l1_vs_emulation"] = {n: rel_l1(got, emu_g[key]) for n, got, key in (
            ("d_x", fb.d_x[0], "d_x"), ("d_w", fb.d_topk_weights[0], "d_topk_weights"), ("d_w13", fb.d_w13, "d_w13"),
            ("d_w2", fb.d_w2, "d_w2"))}
        del emu_g, fb
        print(f"  fp8 gradients vs emulation (rel L1): "
              f"{ {k: f'{v:.1e}' for k, v in row['grad_rel_l1_vs_emulation'].items()} }", flush=True)
        fb = run_fp8_fb_dx_high()
        fb.check_errors()
        emu_g = moe_backward_reference_fp8(d_out, x, ids, wts, fp8_dx, w.shared_w13_2SH, w.shared_w2_HS,
                                           shape.swiglu_limit, dgu_block=fp8_dgu_block(cfg8, fp8.cfg.scale_block),
                                           compute_dtype=torch.float32, dx_w13_E2IH=w.w13_E2IH)
        row["dx_high_d_x_rel_l1_vs_emulation"] = rel_l1(fb.d_x[0], emu_g["d_x"])
        del emu_g, fb
        print(f"  dx_high: d_x vs its emulation rel L1 {row['dx_high_d_x_rel_l1_vs_emulation']:.1e}", flush=True)
        bench = dict(fp8=run_fp8, bf16=run_bf16,
                     grouped_mm=lambda: grouped_mm_forward(x, ids, wts, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH,
                                                           w.shared_w2_HS, shape.swiglu_limit),
                     fp8_fwd_bwd=run_fp8_fb, bf16_fwd_bwd=run_bf16_fb, fp8_fwd_bwd_replay=run_fp8_fb_replay,
                     fp8_fwd_bwd_dx_high=run_fp8_fb_dx_high, fp8_down_high=run_fp8_down_high,
                     fp8_fwd_bwd_both_high=run_fp8_fb_both_high)
        for fn in bench.values():  # compiled (and caches warm) before any round
            fn()
        # Interleaved rounds (kittenmoe.bench.measure_interleaved): under the 700 W power cap the clock falls
        # over a long loop, so timing the variants back to back favoured whichever ran first after a pause.
        timed = measure_interleaved(bench, dev, rounds=args.rounds, rep_ms=args.reps * 20 / args.rounds)
        for label, t in timed.items():
            row[f"ms_{label}"] = t.ms
        row["round_ms"] = {label: list(t.round_ms) for label, t in timed.items()}
        row["timing"] = f"measure_interleaved, {args.rounds} rounds"
        routed = 6 * T * shape.k * shape.h * shape.i
        row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_fp8"]
        row["fwd_bwd_speedup_vs_bf16"] = row["ms_bf16_fwd_bwd"] / row["ms_fp8_fwd_bwd"]
        row["fwd_bwd_dx_high_speedup_vs_bf16"] = row["ms_bf16_fwd_bwd"] / row["ms_fp8_fwd_bwd_dx_high"]
        row["down_high_speedup_vs_bf16"] = row["ms_bf16"] / row["ms_fp8_down_high"]
        row["fwd_bwd_both_high_speedup_vs_bf16"] = row["ms_bf16_fwd_bwd"] / row["ms_fp8_fwd_bwd_both_high"]
        row["speedup_vs_grouped_mm"] = row["ms_grouped_mm"] / row["ms_fp8"]
        row["routed_tflops"] = routed / row["ms_fp8"] / 1e9
        print(f"  fp8 {row['ms_fp8']:.3f} ms, bf16 {row['ms_bf16']:.3f} ms ({row['speedup_vs_bf16']:.2f}x), "
              f"grouped_mm {row['ms_grouped_mm']:.3f} ms; {row['routed_tflops']:.0f} routed TF/s; fwd+bwd fp8 "
              f"{row['ms_fp8_fwd_bwd']:.3f} ms, bf16 {row['ms_bf16_fwd_bwd']:.3f} ms "
              f"({row['fwd_bwd_speedup_vs_bf16']:.2f}x); fp8 replaying gate|up {row['ms_fp8_fwd_bwd_replay']:.3f} ms; "
              f"fp8 with d_x in bf16 (dx_high) {row['ms_fp8_fwd_bwd_dx_high']:.3f} ms "
              f"({row['fwd_bwd_dx_high_speedup_vs_bf16']:.2f}x); down_high forward {row['ms_fp8_down_high']:.3f} "
              f"ms ({row['down_high_speedup_vs_bf16']:.2f}x); both high fwd+bwd {row['ms_fp8_fwd_bwd_both_high']:.3f} ms "
              f"({row['fwd_bwd_both_high_speedup_vs_bf16']:.2f}x)", flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"fp8-{stamp}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nceilings: bf16 {ceil['bf16_tflops']:.0f} TF/s, fp8 {ceil['fp8_tflops']:.0f} TF/s")
    print(f"{'shape':<20}{'fp8 ms':>8}{'bf16 ms':>9}{'x bf16':>8}{'base ms':>9}{'routed TF':>10}{'relL1 emu':>11}"
          f"{'relL1 ref':>11}{'det':>6}{'fb fp8':>9}{'fb bf16':>9}{'x':>6}")
    for r in rows:
        print(f"{r['shape']:<20}{r['ms_fp8']:>8.3f}{r['ms_bf16']:>9.3f}{r['speedup_vs_bf16']:>8.2f}"
              f"{r['ms_grouped_mm']:>9.3f}{r['routed_tflops']:>10.0f}{r['rel_l1_vs_emulation']:>11.1e}"
              f"{r['rel_l1_fp8']:>11.1e}{str(r['deterministic']):>6}{r['ms_fp8_fwd_bwd']:>9.3f}"
              f"{r['ms_bf16_fwd_bwd']:>9.3f}{r['fwd_bwd_speedup_vs_bf16']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
