"""Where a Hugging Face DeepSeek-V3 training step spends its GPU time, per kernel (torch.profiler).

    PYTHONPATH=src python3 benchmarks/probes/hf_profile.py [--impl kittenmoe] [--steps 2]

The model and batches of benchmarks/hf_round.py; prints the kernels by total CUDA time over the profiled steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# the benchmark scripts live one directory up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_round  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="kittenmoe")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    hf_round.implementations(torch.device("cuda"))
    model, cfg = hf_round.build(False, "cuda", torch.bfloat16)
    model.set_experts_implementation(args.impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (4, 2048), generator=gen).to("cuda")
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
