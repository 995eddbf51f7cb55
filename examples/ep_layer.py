"""Expert parallelism across processes: one MoELayer per rank over torch symmetric memory.

    torchrun --nproc-per-node 2 examples/ep_layer.py                 # one GPU per rank (NCCL group)
    KITTENMOE_EP_SHARE_GPU=1 torchrun --nproc-per-node 2 examples/ep_layer.py   # ranks sharing GPU 0 (gloo)

Each rank routes its own tokens over all E experts, holds E/R of them, and runs the megakernels; the output
is compared with a single-process MoELayer holding every expert (same weights, rank 0's tokens).
"""

import os

import torch
import torch.distributed as dist

from kittenmoe import MoELayer, SymmetricPeers, check_errors, get_shape
from kittenmoe.testing import assert_close


def main() -> None:
    share = os.environ.get("KITTENMOE_EP_SHARE_GPU") == "1"
    if share:  # symmetric memory on one GPU needs this before the first allocation; NCCL refuses it, gloo not
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(0 if share else local_rank)
    dist.init_process_group("gloo" if share else "nccl")
    rank = dist.get_rank()
    peers = SymmetricPeers()
    shape = get_shape("small")  # E=16 H=128 I=64 K=4, shared expert
    # The same generator on every rank: identical router and shared expert, each rank keeping its experts.
    layer = MoELayer(shape, dtype=torch.bfloat16, device="cuda", ep=peers, generator=torch.Generator().manual_seed(0))
    x = torch.randn(256, shape.h, generator=torch.Generator().manual_seed(rank)).to("cuda", torch.bfloat16)
    x.requires_grad_()
    out = layer(x)
    out.float().square().mean().backward()  # collective: every rank runs its backward
    check_errors()
    if rank == 0:
        full = MoELayer(shape, dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(0))
        assert_close(out.detach(), full(x.detach()), torch.bfloat16, "EP layer vs one process")
        print(f"rank 0 of {dist.get_world_size()}: {layer}\nEP output matches the single-process layer")
    peers.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
