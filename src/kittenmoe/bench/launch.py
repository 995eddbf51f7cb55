"""Whether this ``kittenmoe bench`` process is one rank of several (torchrun, or a process group the caller
made), which GPU that rank runs on, and the process group and ``SymmetricPeers`` it joins.

One GPU per rank (``LOCAL_RANK``, NCCL group), or every rank on cuda:0 with ``KITTENMOE_EP_SHARE_GPU=1``
(gloo group; times then test the tool, they are not EP figures). CUDA only: ``SymmetricPeers`` has no CPU form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SHARE_GPU_ENV = "KITTENMOE_EP_SHARE_GPU"


@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process bench: one EP rank."""

    world_size: int
    rank: int
    local_rank: int | None  # torchrun's LOCAL_RANK; None in a group the caller made (its current device is used)
    share_gpu: bool  # KITTENMOE_EP_SHARE_GPU=1: every rank on cuda:0, gloo group
    owns_group: bool  # bench initialises (and at the end destroys) the process group itself

    @property
    def where(self) -> str:
        return "WORLD_SIZE, from torchrun" if self.owns_group else "the process group the caller initialised"


def share_gpu_requested(environ=None) -> bool:
    """``KITTENMOE_EP_SHARE_GPU``: ``1`` every rank on cuda:0; ``0`` or unset one GPU per rank; else an error."""
    environ = os.environ if environ is None else environ
    v = environ.get(SHARE_GPU_ENV, "").strip()
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    raise ValueError(f"{SHARE_GPU_ENV}={v!r}: expected 1 (every rank on cuda:0, gloo group) or 0 / unset "
                     f"(one GPU per rank, NCCL group)")


def _env_int(environ, name: str, world: str | None) -> int:
    v = environ.get(name)
    if v is None:
        raise ValueError(f"{name} is not set but WORLD_SIZE={world} is: launch the ranks with torchrun "
                         f"(torchrun --nproc-per-node R -m kittenmoe.cli bench ...), which sets WORLD_SIZE, RANK "
                         f"and LOCAL_RANK")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer (torchrun sets it to one)") from None


def detect_launch(environ=None) -> Launch | None:
    """This process's rank when it is one of several: a process group already initialised (by the caller), or
    torchrun's ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` in ``environ`` (default ``os.environ``); else None
    (one process, virtual ranks)."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    if dist.is_available() and dist.is_initialized():
        return Launch(dist.get_world_size(), dist.get_rank(), None, share_gpu_requested(environ), owns_group=False)
    if "WORLD_SIZE" not in environ:
        return None
    raw = environ["WORLD_SIZE"]
    world = _env_int(environ, "WORLD_SIZE", raw)
    rank = _env_int(environ, "RANK", raw)
    local = _env_int(environ, "LOCAL_RANK", raw)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"WORLD_SIZE={world}, RANK={rank}, LOCAL_RANK={local}: need WORLD_SIZE >= 1, "
                         f"0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    if not dist.is_available():
        raise ValueError(f"WORLD_SIZE={world} (torchrun), but this torch build has no torch.distributed")
    return Launch(world, rank, local, share_gpu_requested(environ), owns_group=True)


def check_world(ranks: int | None, launch: Launch) -> int:
    """The number of EP ranks under torchrun: the world size; ``--ranks``, if given, must say the same."""
    if ranks is not None and ranks != launch.world_size:
        raise ValueError(f"--ranks {ranks} disagrees with world size {launch.world_size} ({launch.where}): "
                         f"under torchrun every process is one EP rank; leave --ranks out or pass "
                         f"--ranks {launch.world_size}")
    return launch.world_size


def resolve_ep_device(device: str | None, launch: Launch) -> torch.device:
    """This rank's GPU: cuda:LOCAL_RANK, cuda:0 when ranks share it, the current one in the caller's group.

    CUDA only: ``SymmetricPeers`` has no CPU form, and a CPU run is no stand-in for an EP measurement."""
    why = ("under torchrun each process is one EP rank over kittenmoe.SymmetricPeers, which needs CUDA "
           "(torch symmetric memory has no CPU backend); for virtual ranks on CPU run without torchrun "
           "(--ranks R, TRITON_INTERPRET=1)")
    dev = None
    if device:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"--device {device!r} is not a device; under torchrun give cuda or leave it out") \
                from None
        if dev.type != "cuda":
            raise ValueError(f"--device {device}: {why}")
    if not torch.cuda.is_available():
        raise ValueError(f"CUDA is not available here: {why}")
    if launch.local_rank is None:
        want, source = torch.cuda.current_device(), "the current CUDA device of the caller's process group"
    elif launch.share_gpu:
        want, source = 0, f"{SHARE_GPU_ENV}=1 puts every rank on cuda:0"
    else:
        want, source = launch.local_rank, f"LOCAL_RANK={launch.local_rank}"
        n = torch.cuda.device_count()
        if want >= n:
            raise ValueError(f"LOCAL_RANK={want}, but this machine has {n} CUDA device(s): one GPU per rank needs "
                             f"--nproc-per-node <= {n}; set {SHARE_GPU_ENV}=1 to run every rank on cuda:0")
    if dev is not None and dev.index is not None and dev.index != want:
        raise ValueError(f"--device {device}: rank {launch.rank} runs on cuda:{want} ({source}); leave --device "
                         f"out or pass cuda")
    return torch.device("cuda", want)


def init_world(launch: Launch, device: torch.device):
    """``(group, backend, peers)`` for this rank: the process group (made here when bench owns it) and
    ``SymmetricPeers`` over it. Collective."""
    import torch.distributed as dist

    from kittenmoe.peers import SymmetricPeers

    if launch.share_gpu:  # symmetric memory refuses two ranks on one GPU unless told before the first allocation
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(device)
    if launch.owns_group:
        # NCCL refuses two ranks on one GPU; symmetric memory only uses the group's store and rank numbering,
        # and gloo moves the baseline's CUDA tensors through the host (slow, but it runs)
        dist.init_process_group("gloo" if launch.share_gpu else "nccl")
    group = dist.group.WORLD
    return group, str(dist.get_backend(group)), SymmetricPeers(group)
