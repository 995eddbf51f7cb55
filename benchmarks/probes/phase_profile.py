"""Where each provider's forward and forward+backward spend their GPU time, kernel by kernel.

For one problem (``--shape T,H,I,E,K``, routed experts only: SonicMoE has no shared expert), each provider runs
the same inputs under ``torch.profiler``: a few warm-up calls, then ``--iters`` profiled calls of the forward
(x and weights needing gradients, as in training) and of forward+backward. Each kernel's CUDA time is summed
by name and divided by the calls; the table lists every kernel above 1% of its pass, with the routed TFLOP/s of
the whole pass from the kernels' summed time (no host gaps in it). Providers: ``kittenmoe`` (``kittenmoe.moe``),
``grouped_mm`` (``kittenmoe.baselines.grouped_mm_forward``), ``sonicmoe`` (when importable).

    PYTHONPATH=src python3 benchmarks/probes/phase_profile.py --shape 32768,4096,512,128,8 --out $OUT

Writes ``phase-profile-<shape>.json`` under ``--out`` (kernel name, calls a pass, ms a pass) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_table(prof, iters: int) -> list[tuple[str, float, float]]:
    """(name, launches a pass, ms a pass) of every CUDA kernel in the profile, longest first."""
    acc: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = acc.setdefault(ev.name, [0, 0.0])
            a[0] += 1
            a[1] += ev.device_time_total / 1e3
    rows = [(n, c / iters, ms / iters) for n, (c, ms) in acc.items()]
    return sorted(rows, key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, help="T,H,I,E,K")
    ap.add_argument("--providers", default="kittenmoe,grouped_mm,sonicmoe")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default=None, help="KernelConfig overrides k=v,... for kittenmoe")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from kittenmoe import moe
    from kittenmoe.baselines import grouped_mm_forward
    from kittenmoe.bench.problems import apply_overrides, parse_config_overrides, parse_shape
    from kittenmoe.autoconfig import auto_config
    from kittenmoe.testing import routing_uniform

    t, h, i, e, k = parse_shape(args.shape)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=g) / h ** 0.5)
    w2 = (torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=g) / i ** 0.5)
    ids, wts = routing_uniform(t, e, k, generator=torch.Generator().manual_seed(1), device=dev)
    d_out = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
    config = None
    if args.config:
        base = auto_config(t, h, i, e, k, 0, 1, dev, torch.bfloat16, None)
        config = apply_overrides(base, parse_config_overrides(args.config))

    calls = {}
    for name in args.providers.split(","):
        if name == "kittenmoe":
            calls[name] = (lambda a, b, c, d, f: moe(a, b, c, d, f, config=config)), (w13, w2)
        elif name == "grouped_mm":
            calls[name] = grouped_mm_forward, (w13, w2)
        elif name == "sonicmoe":
            from kittenmoe.baselines_sonic import sonicmoe_forward, sonicmoe_prepare, sonicmoe_unavailable

            why = sonicmoe_unavailable()
            if why:
                print(f"sonicmoe skipped: {why}")
                continue
            calls[name] = sonicmoe_forward, sonicmoe_prepare(w13, w2)
        else:
            sys.exit(f"unknown provider {name}")

    flop = 6 * t * k * h * i
    result = {"shape": args.shape, "iters": args.iters, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "providers": {}}
    for name, (fn, (a13, a2)) in calls.items():
        a13 = a13.detach().requires_grad_()
        a2 = a2.detach().requires_grad_()
        xg = x.detach().requires_grad_()
        wg = wts.detach().requires_grad_()

        def fwd():
            return fn(xg, ids, wg, a13, a2)

        def fwdbwd():
            out = fn(xg, ids, wg, a13, a2)
            torch.autograd.backward(out, d_out)
            xg.grad = wg.grad = a13.grad = a2.grad = None

        for pas, call, mult in (("forward", fwd, 1), ("forward+backward", fwdbwd, 3)):
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    call()
                torch.cuda.synchronize()
            rows = kernel_table(prof, args.iters)
            total = sum(r[2] for r in rows)
            result["providers"].setdefault(name, {})[pas] = {"kernel_ms": total, "kernels": rows}
            print(f"\n{name} {pas}: {total:.3f} ms of kernels a pass, {mult * flop / total / 1e9:.0f} routed TFLOP/s")
            for n, c, ms in rows:
                if ms >= 0.01 * total:
                    print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{c:<4g} {n[:110]}")
    out = pathlib.Path(args.out) / f"phase-profile-{args.shape.replace(',', '-')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
