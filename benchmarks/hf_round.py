"""Whole training steps of a Hugging Face DeepSeek-V3-style model: kittenmoe vs grouped_mm experts.

    PYTHONPATH=src python3 benchmarks/hf_round.py [--out DIR]           # the mid-size model on the GPU
    PYTHONPATH=src python3 benchmarks/hf_round.py --tiny --device cpu   # a seconds-long smoke run on CPU

The model: a few DeepSeek-V3 layers, H 2048, I 1408, E 64, top-6, one shared
expert, 8 k tokens a step, bf16, randomly initialised from its config (no download). Each
``experts_implementation`` (grouped_mm, kittenmoe, kittenmoe-fp8 on CUDA, sonicmoe when importable) trains from the same weights on
the same batches; a step is forward + backward + AdamW, timed with CUDA events after warm-up, median of the
timed steps. The timed steps go in rounds (every implementation a few steps in turn, all models kept), so that
drift between the start and the end of a run is shared by every row. A third run with the routed experts computing nothing gives the step's floor (the most any
experts kernel could gain) and each implementation's routed-expert milliseconds. Rows (with the losses, so a wrong implementation shows) go to ``benchmarks/results/`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

import kittenmoe.integrations.transformers  # noqa: F401  (registers "kittenmoe")
from kittenmoe.bench import environment


def build(tiny: bool, device: str, dtype: torch.dtype):
    import transformers

    if tiny:
        kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2,
                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    else:
        kw = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                  num_hidden_layers=4, n_routed_experts=64, num_experts_per_tok=6, num_attention_heads=16,
                  num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128)
    cfg = transformers.DeepseekV3Config(first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1,
                                        q_lora_rank=None, max_position_embeddings=4096, **kw)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).to(device, dtype), cfg


NO_EXPERTS = "no-routed-experts"


def register_no_experts() -> None:
    """An experts implementation that computes nothing (its output is ``hidden_states * 0``, which keeps the
    graph connected): the step time without the routed experts, i.e. the floor under any implementation's
    step, so that ``grouped_mm / no-routed-experts`` bounds the whole-step speed-up an experts kernel can give.
    One element of each expert weight joins the output (times 0) so the weights still get (zero) gradients and
    AdamW still updates them: every real implementation pays that optimizer work (1.6 G expert parameters in
    the mid-size model, most of the step's multi_tensor_apply time), so the floor must too."""
    from transformers.integrations.moe import ExpertsInterface

    def forward(self, hidden_states, top_k_index, top_k_weights):
        touch = (self.gate_up_proj[0, 0, 0] + self.down_proj[0, 0, 0]).to(hidden_states.dtype)
        return hidden_states * 0 + touch * 0

    ExpertsInterface.register(NO_EXPERTS, forward)


FP8_NAME = "kittenmoe-fp8"


def implementations(device: torch.device) -> list[str]:
    register_no_experts()
    impls = ["grouped_mm", "kittenmoe", NO_EXPERTS]
    if device.type == "cuda":  # e4m3 experts (1 x 128 / 128 x 128 scales): megakernel only, so not on CPU
        from kittenmoe.fp8 import FP8Config
        from kittenmoe.integrations.transformers import Options, register

        register(Options(fp8=FP8Config()), name=FP8_NAME)
        impls.append(FP8_NAME)
        # FP8 with its down GEMM and d_x GEMM in bf16 (the e4m3 forms were slower than BF16's on the H200)
        register(Options(fp8=FP8Config(dx_high=True, down_high=True)), name="kittenmoe-fp8-high")
        impls += ["kittenmoe-fp8-high"]
    try:
        import sonicmoe  # noqa: F401
        impls.append("sonicmoe")
    except ImportError:
        print("sonicmoe not importable: skipped", flush=True)
    return impls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048, help="tokens a sequence (batch x seq tokens a step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each implementation a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each implementation in turn")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    seq = 16 if args.tiny else args.seq
    # Every implementation's model lives through the whole run and the timed steps go in rounds, each round
    # a few steps of every implementation in turn: drift in the host or the GPU (the floor moved 69.8 -> 63.8 ms
    # between two runs) then lands on all rows alike instead of on whichever ran at the time.
    runs = {}
    for impl in implementations(dev):
        model, cfg = build(args.tiny, args.device, dtype)
        model.set_experts_implementation(impl)
        runs[impl] = dict(model=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-4),
                          gen=torch.Generator().manual_seed(1), times=[], rounds=[], losses=[])

    def steps(run: dict, n: int) -> list[float]:
        model, opt, gen = run["model"], run["opt"], run["gen"]
        out = []
        for _ in range(n):
            ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=gen).to(dev)
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                out.append((time.perf_counter() - t0) * 1e3)
            run["losses"].append(loss.item())
        return out

    for run in runs.values():
        steps(run, args.warmup)
    for _ in range(args.rounds):
        for run in runs.values():
            t = steps(run, args.steps)
            run["times"] += t
            run["rounds"].append(statistics.median(t))
    rows = []
    for impl, run in runs.items():
        times, losses = run["times"], run["losses"]
        row = dict(kind="hf-train-step", model="deepseek-v3-tiny" if args.tiny else "deepseek-v3-mid",
                   experts_implementation=impl, tokens_per_step=args.batch * seq, layers=cfg.num_hidden_layers,
                   h=cfg.hidden_size, i=cfg.moe_intermediate_size, e=cfg.n_routed_experts, k=cfg.num_experts_per_tok,
                   dtype=str(dtype).removeprefix("torch."), ms_median=statistics.median(times), ms_all=times,
                   ms_round_medians=run["rounds"], rounds=args.rounds, steps_per_round=args.steps,
                   losses=losses, **environment(dev),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="PYTHONPATH=src python3 " + " ".join(sys.argv))
        rows.append(row)
        print(f"{impl:<12} {row['ms_median']:9.2f} ms/step (rounds {min(run['rounds']):.2f}-{max(run['rounds']):.2f})"
              f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    base = next(r for r in rows if r["experts_implementation"] == "grouped_mm")
    floor = next(r for r in rows if r["experts_implementation"] == NO_EXPERTS)
    for r in rows:
        r["speedup_vs_grouped_mm"] = base["ms_median"] / r["ms_median"]
        # the routed experts' share of the step (forward + backward + their optimizer share is not separated)
        r["ms_routed_experts"] = r["ms_median"] - floor["ms_median"]
    print(f"\nwithout routed experts: {floor['ms_median']:.2f} ms/step, so no experts kernel can make the step more "
          f"than {base['ms_median'] / floor['ms_median']:.2f}x faster than grouped_mm's "
          f"(routed experts: grouped_mm {base['ms_routed_experts']:.2f} ms, kittenmoe "
          f"{next(r for r in rows if r['experts_implementation'] == 'kittenmoe')['ms_routed_experts']:.2f} ms)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hf-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print("\nimplementation   ms/step  x grouped_mm")
    for r in rows:
        print(f"{r['experts_implementation']:<14}{r['ms_median']:9.2f}{r['speedup_vs_grouped_mm']:9.2f}")
    print(f"rows: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
