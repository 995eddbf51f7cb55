"""Where an expert-parallel forward and backward spend their time, per rank, from the megakernels' own
timestamps. One process per GPU, as `kittenmoe bench --ep`:

    torchrun --nproc-per-node 2 benchmarks/probes/ep_trace.py [--model kimi-k2.7] [--tokens 2048] [--ep 8] [--out DIR]

Each rank holds one EP slice of the model's experts (E / ep of them, as `kittenmoe bench --ep` sizes them) and
its own tokens; the routing is uniform over all R slices' experts. After warm-up, one traced forward and one
traced backward run (`trace=True`); every rank prints `kittenmoe.trace`'s summary and writes Chrome/Perfetto
timelines (`trace-ep-{fwd,bwd}-rank{r}.json`) under --out. Compare the pull's wait and work with one GPU's
(`benchmarks/fwd_round.py --trace`) to see what the link costs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from kittenmoe import KernelConfig, SymmetricPeers
from kittenmoe.config import SEED_SHAPES
from kittenmoe.ep import megakernel_backward_ep, megakernel_forward_ep
from kittenmoe.testing import make_weights, routing_uniform
from kittenmoe.trace import BWD_KINDS, KINDS, chrome_trace, summarize


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kimi-k2.7")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ep", type=int, default=8, help="the EP degree whose slice each rank holds (E / ep experts)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = SEED_SHAPES[args.model]
    L = base.e // args.ep
    shape = base.with_(e=L * world)  # R slices of L experts: every rank routes over all of them
    g = torch.Generator().manual_seed(0)  # the same weights everywhere; each rank keeps its slice
    w = make_weights(shape, dtype=torch.bfloat16, device="cuda", generator=g)
    gt = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, shape.h, generator=gt).to("cuda", torch.bfloat16)
    ids, wts = routing_uniform(args.tokens, shape.e, shape.k, generator=gt, device="cuda")
    d_out = torch.randn(args.tokens, shape.h, generator=gt).to("cuda", torch.bfloat16)
    mine = slice(rank * L, (rank + 1) * L)
    a = (x, ids, wts, w.w13_E2IH[mine].contiguous(), w.w2_EHI[mine].contiguous(), w.shared_w13_2SH,
         w.shared_w2_HS, shape.swiglu_limit)
    peers = SymmetricPeers()
    cfg = KernelConfig()
    for i in range(3):  # compile and warm up; the last pair is read
        f = megakernel_forward_ep(*a, peers=peers, config=cfg, save_for_backward=True, trace=i == 2)
        b = megakernel_backward_ep(d_out, *a, peers=peers, config=cfg, saved=f.saved(), trace=i == 2)
    torch.cuda.synchronize()
    f.check_errors()
    b.check_errors()
    os.makedirs(args.out, exist_ok=True)
    for label, tr, kinds, ncomm in (("forward", f.state.trace, KINDS, cfg.num_comm_programs_fwd),
                                    ("backward", b.trace, BWD_KINDS, cfg.num_comm_programs_bwd)):
        text = summarize(tr, ncomm, kinds, torch.cuda.get_device_properties().multi_processor_count).table()
        path = os.path.join(args.out, f"trace-ep-{label[:3]}-rank{rank}.json")
        with open(path, "w") as fh:
            json.dump(chrome_trace(tr, ncomm, kinds), fh)
        for r in range(world):  # one rank at a time, so the tables do not interleave
            if r == rank:
                print(f"== rank {rank} of {world}, {args.model} EP{args.ep} slice, {args.tokens} tokens, {label}\n"
                      f"{text}\n  timeline: {path}", flush=True)
            dist.barrier()
    peers.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
