"""How a rank reaches the other ranks' buffers.

Kernels see the other ranks only through a device table of base pointers,
one ``uint64`` per rank for each named buffer: exactly what torch symmetric
memory's ``buffer_ptrs_dev`` gives. ``LocalPeers`` builds the same tables for
R virtual ranks living in one process on one device (CPU or one GPU), so the
whole multi-rank algorithm runs (and is tested) without a second GPU.

Pointer tables are stored as int64 tensors (torch has no uint64 arithmetic on
every device); the bits are the same and kernels cast them to pointers.
"""

from __future__ import annotations

import torch


class LocalPeers:
    """R virtual ranks in one process, each with its own copy of every buffer.

    ``alloc(name, shape, dtype)`` gives every rank a buffer of that shape;
    ``buffer(name, rank)`` is rank ``rank``'s tensor and ``ptrs(name)`` the
    ``[R]`` int64 device table of their base addresses, the same for every
    rank (in symmetric memory each rank holds that table too).
    """

    def __init__(self, num_ranks: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"LocalPeers: num_ranks must be a positive int, got {num_ranks!r}")
        self.num_ranks = num_ranks
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self._ptrs: dict[str, torch.Tensor] = {}

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill=None) -> list[torch.Tensor]:
        """Allocate (or re-allocate when the shape or dtype changed) one buffer per rank."""
        old = self._buffers.get(name)
        if old is not None and tuple(old[0].shape) == tuple(shape) and old[0].dtype == dtype:
            bufs = old
        else:
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.num_ranks)]
            self._buffers[name] = bufs
            self._ptrs[name] = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=self.device)
        if fill is not None:
            for b in bufs:
                b.fill_(fill)
        return bufs

    def has(self, name: str) -> bool:
        return name in self._buffers

    def buffer(self, name: str, rank: int) -> torch.Tensor:
        self._check(name, rank)
        return self._buffers[name][rank]

    def buffers(self, name: str) -> list[torch.Tensor]:
        self._check(name, 0)
        return self._buffers[name]

    def ptrs(self, name: str) -> torch.Tensor:
        """``[R]`` int64 table of base addresses of ``name`` on every rank."""
        self._check(name, 0)
        return self._ptrs[name]

    def destroy(self) -> None:
        self._buffers.clear()
        self._ptrs.clear()

    def _check(self, name: str, rank: int) -> None:
        if name not in self._buffers:
            raise KeyError(f"LocalPeers: no buffer named {name!r}; allocated: {sorted(self._buffers)}")
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"LocalPeers: rank {rank} outside [0, {self.num_ranks})")

    def __repr__(self) -> str:
        return f"LocalPeers(num_ranks={self.num_ranks}, device={self.device}, buffers={sorted(self._buffers)})"
