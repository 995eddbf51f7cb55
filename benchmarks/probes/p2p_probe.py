"""GPU-to-GPU bandwidth through torch symmetric memory, beside NCCL and local HBM copies.

    torchrun --nproc-per-node 2 benchmarks/probes/p2p_probe.py [--mib 1024] [--programs 16,132] --out DIR

One process per GPU (NCCL group). Every rank allocates a ``--mib`` MiB symmetric buffer (``SymmetricPeers``)
and a local one. Measured, each a median of ``do_bench`` (CUDA events), every rank timing its own side:

- ``pull``: a Triton copy kernel that reads the next rank's buffer through the peer-pointer table (as the
  megakernels' dispatch does) and writes local memory; ``push``: reads local memory, writes the next rank's
  buffer (as the combine does). Each with one rank active (unidirectional) and with every rank at once
  (each rank's own direction), and with ``--programs`` CTAs: 16 is what the megakernels give communication,
  the SM count is the link's ceiling.
- ``local``: the same kernel between two local buffers (HBM read + write, bytes counted once).
- ``nccl a2a``: ``all_to_all_single`` of the whole buffer; bytes per rank that cross to peers over time.
- ``<what> 8K`` / ``32K`` [``pf``]: at 16 CTAs, the bytes a program moves a step, and whether the next step's
  load is issued before this step's store (``pf``: two steps in flight). A remote read's latency is several
  local ones', so pulling needs more bytes in flight than pushing.

GB/s are 1e9 bytes moved over the link per second (one direction, per rank). Rank 0 prints a table and
writes ``p2p-<date>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kittenmoe.peers import SymmetricPeers


@triton.jit
def _copy(src_ptrs,  # [R] int64: every rank's symmetric buffer address
          src_rank,  # which entry of src_ptrs to read; -1: read local_src_ptr
          local_src_ptr,  # [N] bf16
          dst_ptrs,  # [R] int64: every rank's symmetric buffer address
          dst_rank,  # which entry of dst_ptrs to write; -1: write local_dst_ptr
          local_dst_ptr,  # [N] bf16
          n, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    if src_rank >= 0:
        src = tl.multiple_of(tl.load(src_ptrs + src_rank).to(tl.pointer_type(tl.bfloat16)), 16)
    else:
        src = local_src_ptr
    if dst_rank >= 0:
        dst = tl.multiple_of(tl.load(dst_ptrs + dst_rank).to(tl.pointer_type(tl.bfloat16)), 16)
    else:
        dst = local_dst_ptr
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    if PREFETCH:
        # the next block's load is issued before this block's store waits on its data: two blocks in flight
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + offs, mask=offs < n)
        for start in range(pid * BLOCK + step, n + step, step):
            nxt_offs = start + tl.arange(0, BLOCK)
            nxt = tl.load(src + nxt_offs, mask=nxt_offs < n)
            tl.store(dst + offs, v, mask=offs < n)
            offs = nxt_offs
            v = nxt
    else:
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="buffer size per rank in MiB (default 1024)")
    ap.add_argument("--programs", default="16,132", help="CTA counts of the copy kernel (default 16,132)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("p2p_probe needs at least 2 ranks (torchrun --nproc-per-node 2 ...)")
    dev = torch.device("cuda", local_rank)
    n = args.mib * 2**20 // 2  # bf16 elements
    nbytes = n * 2
    peers = SymmetricPeers()
    sym = peers.alloc("buf", (n,), torch.bfloat16)
    sym[rank].copy_(torch.randn(n, device=dev).to(torch.bfloat16))
    local = torch.empty(n, dtype=torch.bfloat16, device=dev)
    ptrs = peers.ptrs("buf")
    nxt = (rank + 1) % world
    torch.cuda.synchronize()
    peers.barrier()
    torch.cuda.synchronize()

    def time_ms(fn) -> float:
        return triton.testing.do_bench(fn, warmup=5, rep=args.reps * 5, return_mode="median")

    def copier(programs: int, src_rank: int, dst_rank: int, block: int = 4096, prefetch: bool = False):
        mine = sym[rank]
        return lambda: _copy[(programs,)](ptrs, src_rank, mine, ptrs, dst_rank, local, n, BLOCK=block,
                                          PREFETCH=prefetch)

    rows = []

    def record(what: str, programs: int | None, active: str, ms: float | None, bytes_moved: int) -> None:
        gbs = None if ms is None else bytes_moved / ms / 1e6
        rows.append(dict(what=what, programs=programs, active=active, ms=ms, gb_per_s=gbs))

    # Bytes in flight per program, at the megakernels' 16 communication CTAs, rank 0 alone: the block a step
    # (8 KB as below; 32 KB as the megakernels' 32 x 512 chunks) and one block prefetched ahead or not.
    for what, src, dst in (("pull", nxt, -1), ("push", -1, nxt), ("local", -1, -1)):
        for block in (4096, 16384):
            for prefetch in (False, True):
                fn = copier(16, src, dst, block, prefetch)
                fn()
                torch.cuda.synchronize()
                dist.barrier()
                ms = time_ms(fn) if rank == 0 else None
                torch.cuda.synchronize()
                dist.barrier()
                record(f"{what} {block * 2 // 1024}K{' pf' if prefetch else ''}", 16, "rank 0", ms, nbytes)

    progs = [int(p) for p in args.programs.split(",")]
    for programs in progs:
        for what, src, dst in (("pull", nxt, -1), ("push", -1, nxt), ("local", -1, -1)):
            fn = copier(programs, src, dst)
            fn()  # compile on every rank before anyone times
            torch.cuda.synchronize()
            dist.barrier()
            ms = time_ms(fn) if rank == 0 else None  # unidirectional: rank 0 alone
            torch.cuda.synchronize()
            dist.barrier()
            record(what, programs, "rank 0", ms, nbytes)
            if what == "local":
                continue
            ms_all = time_ms(fn)  # every rank at once, each its own direction
            torch.cuda.synchronize()
            dist.barrier()
            t = torch.tensor([ms_all], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            record(what, programs, "every rank", t.item(), nbytes)

    send = sym[rank]
    recv = torch.empty_like(local)
    dist.all_to_all_single(recv, send)
    torch.cuda.synchronize()
    dist.barrier()
    ms = time_ms(lambda: dist.all_to_all_single(recv, send))
    t = torch.tensor([ms], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    record("nccl a2a", None, "every rank", t.item(), nbytes * (world - 1) // world)

    if rank == 0:
        date = datetime.datetime.now(datetime.timezone.utc)
        info = dict(kind="p2p", date=date.isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(dev),
                    gpus=world, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                    mib=args.mib, command="torchrun --nproc-per-node %d benchmarks/probes/p2p_probe.py %s"
                    % (world, " ".join(sys.argv[1:])), nccl_env={k: v for k, v in os.environ.items()
                                                                  if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))})
        print(f"{world} x {info['gpu']}, {args.mib} MiB per rank")
        print(f"{'what':10s} {'CTAs':>5s} {'active':11s} {'ms':>8s} {'GB/s':>8s}")
        for r in rows:
            ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
            gbs = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}"
            print(f"{r['what']:10s} {str(r['programs'] or '-'):>5s} {r['active']:11s} {ms:>8s} {gbs:>8s}")
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"p2p-{date.strftime('%Y%m%d-%H%M%S')}.json")
        with open(path, "w") as f:
            json.dump(dict(info, rows=rows), f, indent=1)
        print(f"wrote {path}")
    peers.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
