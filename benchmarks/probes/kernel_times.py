"""GPU time per kernel of one forward+backward through ``kittenmoe.moe`` (no shared expert), one line a kernel,
for each config given: where a config change moves the time.

    PYTHONPATH=src python3 benchmarks/probes/kernel_times.py --shape T,H,I,E,K --config "k=v,...;k=v,..."
        [--routing uniform,zipf:0.8,...]

Each routing (``kittenmoe bench``'s names) runs every config; the line before a routing's rows gives its
largest and smallest expert loads.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import kittenmoe
from kittenmoe.bench.problems import parse_config_overrides, parse_routing
from kittenmoe.config import default_config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,2048,768,128,8")
    ap.add_argument("--config", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--routing", default="uniform", help="comma list: uniform | zipf[:alpha] | one-hot")
    args = ap.parse_args()
    t, h, i, e, k = (int(v) for v in args.shape.split(","))
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dev, torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dev, torch.bfloat16).requires_grad_(True)
    d_out = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
    for routing in args.routing.split(","):
        ids, wts = parse_routing(routing).generate(t, e, k, generator=torch.Generator().manual_seed(1), device=dev)
        wts = wts.float().requires_grad_(True)
        rows_E = torch.bincount(ids.flatten(), minlength=e)
        print(f"routing {routing}: rows an expert {rows_E.float().mean().item():.0f} mean, "
              f"{rows_E.max().item()} max, {rows_E.min().item()} min")
        run_configs(args, x, ids, wts, w13, w2, d_out, (t, h, i, e, k), dev)
    return 0


def run_configs(args, x, ids, wts, w13, w2, d_out, shape, dev) -> None:
    t, h, i, e, k = shape
    for spec in args.config.split(";"):
        cfg = default_config(t, h, i, e, k, device=dev, s=0, overrides=parse_config_overrides(spec))

        def step():
            out = kittenmoe.moe(x, ids, wts, w13, w2, backend="megakernel", config=cfg)
            torch.autograd.grad(out, (x, wts, w13, w2), d_out)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                step()
            torch.cuda.synchronize()
        rows = {}
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
                rows[ev.key] = ev.self_device_time_total / args.reps / 1e3
        total = sum(rows.values())
        print(f"[{spec}] total {total:.3f} ms a forward+backward")
        for name, ms in sorted(rows.items(), key=lambda r: -r[1])[:8]:
            print(f"  {ms:8.3f} ms  {name[:90]}")


if __name__ == "__main__":
    raise SystemExit(main())
