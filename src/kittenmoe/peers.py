"""How a rank reaches the other ranks' buffers.

Kernels see the other ranks only through a device table of base pointers,
one ``uint64`` per rank for each named buffer: exactly what torch symmetric
memory's ``buffer_ptrs_dev`` gives. ``LocalPeers`` builds the same tables for
R virtual ranks living in one process on one device (CPU or one GPU), so the
whole multi-rank algorithm runs (and is tested) without a second GPU.
``SymmetricPeers`` is real expert parallelism: one process per rank, buffers
in torch symmetric memory, the same tables.

Pointer tables are stored as int64 tensors (torch has no uint64 arithmetic on
every device); the bits are the same and kernels cast them to pointers.
"""

from __future__ import annotations

import math
import warnings

import torch

from kittenmoe.checks import canonical_device


# The megakernels' copy loops tell Triton every peer buffer starts on a 16-byte boundary
# (``tl.multiple_of(base, 16)``) so that rows move as 16-byte vectors instead of 2-byte scalars (8x fewer
# memory instructions; the communication programs were capped at ~32 GB/s per SM by issue). Every table
# entry is checked against that promise where it is built.
PEER_ALIGN_BYTES = 16


def check_peer_alignment(name: str, addrs: list[int]) -> None:
    bad = [hex(a) for a in addrs if a % PEER_ALIGN_BYTES]
    if bad:
        raise RuntimeError(f"peer buffer {name!r}: base addresses {bad} are not {PEER_ALIGN_BYTES}-byte aligned; the "
                           f"megakernels' vectorised copies need that (torch and symmetric-memory allocations are)")


class LocalPeers:
    """R virtual ranks in one process, each with its own copy of every buffer.

    ``alloc(name, shape, dtype)`` gives every rank a buffer of that shape;
    ``buffer(name, rank)`` is rank ``rank``'s tensor and ``ptrs(name)`` the
    ``[R]`` int64 device table of their base addresses, the same for every
    rank (in symmetric memory each rank holds that table too). ``stage(name,
    tensors, ...)`` gives buffers that hold the caller's tensors, by taking
    the tensors themselves where it can (no copy).
    """

    def __init__(self, num_ranks: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"LocalPeers: num_ranks must be a positive int, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self.device = canonical_device(device)
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self._ptrs: dict[str, torch.Tensor] = {}
        self._taken: dict[str, list[int]] = {}  # names whose buffers are a caller's tensors -> their addresses

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill=None) -> list[torch.Tensor]:
        """Allocate (or re-allocate when the shape or dtype changed) one buffer per rank. Buffers that ``stage``
        took from a caller are never handed out here: they are the caller's tensors."""
        old = None if self._taken.pop(name, None) is not None else self._buffers.get(name)
        if old is not None and tuple(old[0].shape) == tuple(shape) and old[0].dtype == dtype:
            bufs = old
        else:
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.num_ranks)]
            self._buffers[name] = bufs
            check_peer_alignment(name, [b.data_ptr() for b in bufs])
            self._ptrs[name] = self._address_table([b.data_ptr() for b in bufs])
        if fill is not None:
            for b in bufs:
                b.fill_(fill)
        return bufs

    def stage(self, name: str, tensors: list[torch.Tensor], shape: tuple[int, ...],
              dtype: torch.dtype) -> list[torch.Tensor]:
        """Buffer ``name`` of every rank holding ``tensors[r]`` (as ``shape`` in ``dtype``), for buffers the
        kernels only read. Where every tensor already is such a buffer (``dtype``, contiguous, on this device,
        16-byte aligned) and no CUDA graph is being captured, the buffers are the tensors themselves: no copy
        (with one rank the forward copied its x and the backward its x, d_out and router weights, 0.5 ms of a
        32768 x 4096 forward+backward on an H100). Else the tensors are copied into the workspace's own buffers.
        The address table is rebuilt only when the addresses change (``_address_table``: no host sync). Under
        CUDA graph capture the graph reads the tensors it was captured with, as any captured kernel does."""
        shape = tuple(int(v) for v in shape)
        numel = math.prod(shape)
        if len(tensors) == self.num_ranks and all(
                t.dtype == dtype and t.device == self.device and t.is_contiguous() and t.numel() == numel
                and t.data_ptr() % PEER_ALIGN_BYTES == 0 for t in tensors):
            bufs = [t.view(shape) for t in tensors]
            addrs = [b.data_ptr() for b in bufs]
            if self._taken.get(name) != addrs:
                self._ptrs[name] = self._address_table(addrs)
                self._taken[name] = addrs
            self._buffers[name] = bufs
            return bufs
        bufs = self.alloc(name, shape, dtype)
        for b, t in zip(bufs, tensors):
            b.copy_(t.reshape(shape))
        return bufs

    def _address_table(self, addrs: list[int]) -> torch.Tensor:
        """The ``[R]`` int64 device table of ``addrs``, without a host sync: on a GPU copied from pinned memory
        (non_blocking; the host allocator keeps the pinned block until the copy is done), and under CUDA graph
        capture or with one rank written by one fill kernel an entry, the addresses baked into the graph (a
        captured copy would read host memory at every replay, long after this call freed it). One rank's table
        is rebuilt whenever a caller's tensor moves (``stage``: a training step's activations, every call): one
        fill kernel there instead of a pinned allocation, a host-to-device copy and its event."""
        if self.device.type != "cuda":
            return torch.tensor(addrs, dtype=torch.int64, device=self.device)
        if len(addrs) == 1:
            return torch.full((1,), addrs[0], dtype=torch.int64, device=self.device)
        if torch.cuda.is_current_stream_capturing():
            table = torch.empty(len(addrs), dtype=torch.int64, device=self.device)
            for r, a in enumerate(addrs):
                table[r].fill_(a)
            return table
        return torch.tensor(addrs, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)

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
        self._taken.clear()

    def _check(self, name: str, rank: int) -> None:
        if name not in self._buffers:
            raise KeyError(f"LocalPeers: no buffer named {name!r}; allocated: {sorted(self._buffers)}")
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"LocalPeers: rank {rank} outside [0, {self.num_ranks})")

    def __repr__(self) -> str:
        return f"LocalPeers(num_ranks={self.num_ranks}, device={self.device}, buffers={sorted(self._buffers)})"


class PeerBufferNotAddressable(RuntimeError):
    """Another rank's buffer was asked for from Python; it lives in another process."""


class _OwnRankOnly:
    """What ``SymmetricPeers.alloc``/``buffers`` return: indexable by rank like ``LocalPeers``' list,
    but only this process's rank holds a tensor here; any other rank raises."""

    def __init__(self, peers: "SymmetricPeers", name: str) -> None:
        self._peers, self._name = peers, name

    def __len__(self) -> int:
        return self._peers.num_ranks

    def __getitem__(self, rank: int) -> torch.Tensor:
        return self._peers.buffer(self._name, rank)

    def __iter__(self):
        raise PeerBufferNotAddressable(
            f"SymmetricPeers: cannot iterate over every rank's {self._name!r} buffer; only rank "
            f"{self._peers.rank}'s is in this process (buffer({self._name!r}, {self._peers.rank}))")


class SymmetricPeers:
    """Real expert parallelism: one process per rank, named buffers in torch symmetric memory.

    The interface of ``LocalPeers`` (``alloc``, ``has``, ``buffer``,
    ``buffers``, ``ptrs``, ``destroy``, ``num_ranks``, ``device``) plus
    ``rank`` and a device-side ``barrier()``. What differs:

    - Only this process's rank is local: ``buffer(name, rank)`` is the local
      tensor; any other rank raises ``PeerBufferNotAddressable`` (kernels reach
      peers through ``ptrs(name)``, never Python).
    - ``alloc`` is collective whenever it allocates (first use of a name, or a
      new shape/dtype): every rank of the group must make the same calls in
      the same order. It first compares (name, shape, dtype) across ranks, so
      a mismatch raises on every rank instead of hanging in the rendezvous.
      Re-alloc with the same shape and dtype is local and costs nothing (no
      collective, no sync), as with ``LocalPeers``. Allocate before CUDA-graph
      capture; ``fill`` is a local write, so ``barrier()`` before peers read it.
    - ``ptrs(name)``: ``[R]`` int64 device table of the buffer's address on
      every rank, built once at allocation from the rendezvous handle's host
      list ``buffer_ptrs`` plus this tensor's offset in its symmetric
      allocation (recent torch, e.g. 2.13, carves symmetric tensors out of a
      memory pool, and ``buffer_ptrs``/``buffer_ptrs_dev`` give the base of
      the pool block, not the tensor; the handle's ``offset``, where torch has
      it, must agree). Offsets are compared across ranks at allocation; the
      table's entry for this rank is checked against ``data_ptr()``. Building
      it once at allocation keeps the hot path free of host work and
      graph-safe.
    - ``barrier(channel)``: torch symmetric memory's device-side barrier (a
      kernel on the current stream, release/acquire at system scope: writes
      before it on any rank are visible after it on every rank). No host
      sync; capturable in a CUDA graph. It spins at most
      ``barrier_timeout_ms`` (0 = forever); on timeout the kernel traps (a CUDA
      error, not a hang). The process's CUDA context is then unusable: exit it.
      torch prints "[FATAL] CUDASymmetricMemory::barrier: rank r failed to
      receive signal from rank p", the next synchronising call raises, and
      torch's symmetric-memory destructors abort the process when they run
      (seen with torch 2.11 on 2 H200s): report the error before
      the ``SymmetricPeers`` object is released.
    - ``destroy()`` is collective: a barrier and a stream sync so that no peer
      is still reading, then every buffer is released.

    Needs CUDA tensors: torch has no CPU symmetric memory (on CPU, use
    ``kittenmoe.distributed`` with gloo, or ``LocalPeers``). One GPU per rank
    normally (``torch.cuda.set_device(local_rank)`` before construction);
    several ranks may share one GPU (tests) when every process sets
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` before the first
    allocation. NCCL refuses two ranks on one GPU, so such tests use a gloo
    group: symmetric memory only uses the group's store and rank numbering.
    Constructing it is collective (it allocates the barrier's buffer).

    ``max_tokens``: None, every rank brings the same number of tokens T to each
    call (checked). An int: each rank may bring any T <= max_tokens; the token
    buffers hold max_tokens rows on every rank and a rank's missing tokens are
    padding (routing entry ``schedule.NO_ROUTE``: never dispatched or computed;
    the shared expert runs over the zero rows).
    """

    def __init__(self, group=None, device: torch.device | str | None = None,
                 barrier_timeout_ms: int = 60_000, max_tokens: int | None = None) -> None:
        import torch.distributed as dist

        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f"SymmetricPeers: max_tokens must be a positive int or None, got {max_tokens!r}")
        self.max_tokens = max_tokens

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SymmetricPeers: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group(...) on every rank first")
        if not isinstance(barrier_timeout_ms, int) or isinstance(barrier_timeout_ms, bool) or barrier_timeout_ms < 0:
            raise ValueError(f"SymmetricPeers: barrier_timeout_ms must be an int >= 0, got {barrier_timeout_ms!r}")
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise RuntimeError("SymmetricPeers: this process is not a member of the given process group")
        self.num_ranks = dist.get_world_size(self.group)
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError(self._cpu_message("no CUDA device is available"))
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(self._cpu_message(f"got device {device}"))
        device = canonical_device(device)
        if device.index != torch.cuda.current_device():
            raise RuntimeError(f"SymmetricPeers: device {device} is not the current CUDA device "
                               f"(cuda:{torch.cuda.current_device()}); call torch.cuda.set_device({device.index}) "
                               f"first (collectives and symmetric memory use the current device)")
        self.device = device
        self.barrier_timeout_ms = barrier_timeout_ms

        from torch.distributed import _symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        # Older torch needs the group registered for symmetric memory; newer torch deprecates the call
        # (it only adds a store-based check that every rank rendezvouses the same allocation).
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group.group_name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group.group_name)
        self._buffers: dict[str, torch.Tensor] = {}
        self._agreed: dict[str, object] = {}
        self._handles: dict[str, object] = {}
        self._ptrs: dict[str, torch.Tensor] = {}
        # The barrier's handle (its signal pads) lives as long as this object.
        self._sync_buf, self._sync_handle, _ = self._allocate("__kittenmoe_barrier__", (1,), torch.int32)

    @staticmethod
    def _cpu_message(why: str) -> str:
        return (f"SymmetricPeers needs CUDA tensors ({why}): torch symmetric memory has no CPU backend. "
                f"On CPU use kittenmoe.distributed.moe_forward_distributed (gloo collectives) or LocalPeers.")

    def _same_everywhere(self, what: str, value) -> None:
        """All-gather ``value`` (host objects) and raise on every rank if any rank differs."""
        import torch.distributed as dist

        values = [None] * self.num_ranks
        dist.all_gather_object(values, value, group=self.group)
        if any(v != values[0] for v in values):
            raise ValueError(f"SymmetricPeers (rank {self.rank}): {what} differs across ranks, in rank order: "
                             f"{values}; every rank must make the same allocations in the same order")

    def agree(self, what: str, value) -> None:
        """Raise ``ValueError`` on every rank unless every rank passes the same ``value`` for ``what``.

        A host collective the first time (and whenever this rank's ``value`` changes); afterwards free. A rank
        that passes a value it passed before while another passes a new one skips the collective, so the other
        waits out the group's timeout and the first the device barrier's: an error on both, not a hang."""
        self._check_alive()
        if what in self._agreed and self._agreed[what] == value:
            return
        self._same_everywhere(what, value)
        self._agreed[what] = value

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        """Collective: symmetric tensor, its rendezvous handle and its [R] int64 peer-address table."""
        self._same_everywhere("alloc(name, shape, dtype)", (name, shape, str(dtype)))
        t = self._symm_mem.empty(shape, dtype=dtype, device=self.device)
        handle = self._symm_mem.rendezvous(t, self.group)
        base = [int(p) for p in handle.buffer_ptrs]
        if len(base) != self.num_ranks:
            raise RuntimeError(f"SymmetricPeers: rendezvous gave {len(base)} peer pointers for {self.num_ranks} ranks")
        offset = t.data_ptr() - base[self.rank]
        torch_offset = getattr(handle, "offset", None)
        if offset < 0 or (torch_offset is not None and int(torch_offset) != offset):
            raise RuntimeError(f"SymmetricPeers: {name!r} sits at {t.data_ptr():#x}, its symmetric block at "
                               f"{base[self.rank]:#x} (torch reports offset {torch_offset}); cannot build the "
                               f"peer-pointer table")
        # The table assumes the tensor sits at the same offset in every rank's block (true when every
        # rank allocates the same sizes in the same order); check rather than assume.
        self._same_everywhere(f"the offset of {name!r} in its symmetric block", offset)
        addrs = [b + offset for b in base]
        check_peer_alignment(name, addrs)
        addrs = [a - (1 << 64) if a >= 1 << 63 else a for a in addrs]  # uint64 bits as int64
        ptrs = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        return t, handle, ptrs

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill=None) -> _OwnRankOnly:
        """Allocate (collectively) or reuse this rank's buffer ``name``; see the class docstring."""
        if not isinstance(name, str) or name.startswith("__kittenmoe"):
            raise ValueError(f"SymmetricPeers: buffer names must be str and not start with '__kittenmoe', "
                             f"got {name!r}")
        self._check_alive()
        shape = tuple(int(s) for s in shape)
        old = self._buffers.get(name)
        if old is None or tuple(old.shape) != shape or old.dtype != dtype:
            t, handle, ptrs = self._allocate(name, shape, dtype)
            self._buffers[name], self._handles[name], self._ptrs[name] = t, handle, ptrs
        if fill is not None:
            self._buffers[name].fill_(fill)
        return _OwnRankOnly(self, name)

    def has(self, name: str) -> bool:
        return name in self._buffers

    def buffer(self, name: str, rank: int) -> torch.Tensor:
        self._check(name, rank)
        if rank != self.rank:
            raise PeerBufferNotAddressable(
                f"SymmetricPeers: rank {rank}'s {name!r} buffer lives in another process; this process is rank "
                f"{self.rank}. Reach peers from a kernel through ptrs({name!r}).")
        return self._buffers[name]

    def buffers(self, name: str) -> _OwnRankOnly:
        self._check(name, self.rank)
        return _OwnRankOnly(self, name)

    def ptrs(self, name: str) -> torch.Tensor:
        """``[R]`` int64 device table of the address of ``name`` on every rank."""
        self._check(name, self.rank)
        return self._ptrs[name]

    def barrier(self, channel: int = 0) -> None:
        """Device-side barrier across the group on the current stream (see the class docstring)."""
        self._check_alive()
        self._sync_handle.barrier(channel=channel, timeout_ms=self.barrier_timeout_ms)

    def destroy(self) -> None:
        """Collective: wait until no rank can still be using a buffer, then release them all."""
        if self._sync_handle is None:
            return
        self.barrier()
        torch.cuda.current_stream(self.device).synchronize()
        self._buffers.clear()
        self._handles.clear()
        self._ptrs.clear()
        self._sync_buf = self._sync_handle = None

    def _check_alive(self) -> None:
        if self._sync_handle is None:
            raise RuntimeError("SymmetricPeers: used after destroy()")

    def _check(self, name: str, rank: int) -> None:
        self._check_alive()
        if name not in self._buffers:
            raise KeyError(f"SymmetricPeers: no buffer named {name!r}; allocated: {sorted(self._buffers)}")
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"SymmetricPeers: rank {rank} outside [0, {self.num_ranks})")

    def __repr__(self) -> str:
        return (f"SymmetricPeers(rank={self.rank}, num_ranks={self.num_ranks}, device={self.device}, "
                f"buffers={sorted(self._buffers)})")
