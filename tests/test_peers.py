"""LocalPeers: R virtual ranks' buffers and their pointer tables in one process."""

from __future__ import annotations

import pytest
import torch

from kittenmoe.peers import LocalPeers


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_alloc_gives_distinct_buffers_and_pointer_table(num_ranks):
    peers = LocalPeers(num_ranks, "cpu")
    bufs = peers.alloc("x", (5, 3), torch.float32)
    assert len(bufs) == num_ranks
    for r, b in enumerate(bufs):
        assert b.shape == (5, 3) and b.dtype == torch.float32 and b.device == peers.device
        assert peers.buffer("x", r) is b
    assert peers.buffers("x") is bufs or list(peers.buffers("x")) == bufs
    assert len({b.data_ptr() for b in bufs}) == num_ranks, "buffers must not alias"
    for r, b in enumerate(bufs):  # writing one rank's buffer leaves the others alone
        b.fill_(float(r))
    for r, b in enumerate(bufs):
        assert torch.all(b == r)
    ptrs = peers.ptrs("x")
    assert ptrs.dtype == torch.int64 and ptrs.shape == (num_ranks,) and ptrs.device == peers.device
    assert ptrs.tolist() == [b.data_ptr() for b in bufs]
    assert peers.has("x") and not peers.has("y")


def test_realloc_same_shape_keeps_buffers():
    peers = LocalPeers(2)
    bufs = peers.alloc("y", (4,), torch.int32)
    ptrs = peers.ptrs("y").clone()
    bufs[1].fill_(7)
    again = peers.alloc("y", (4,), torch.int32)
    assert all(a is b for a, b in zip(again, bufs, strict=True))
    assert torch.equal(peers.ptrs("y"), ptrs)
    assert torch.all(again[1] == 7), "re-alloc without fill must keep the contents"


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_realloc_different_shape_or_dtype_updates_pointers(change):
    peers = LocalPeers(3)
    old = peers.alloc("z", (4, 2), torch.float32)  # kept alive, so new storage cannot reuse it
    old_ptrs = peers.ptrs("z").clone()
    shape, dtype = ((8, 2), torch.float32) if change == "shape" else ((4, 2), torch.float64)
    new = peers.alloc("z", shape, dtype)
    assert all(b.shape == shape and b.dtype == dtype for b in new)
    assert all(n is not o for n, o in zip(new, old, strict=True))
    assert peers.buffers("z")[0] is new[0] and peers.buffer("z", 2) is new[2]
    ptrs = peers.ptrs("z")
    assert ptrs.tolist() == [b.data_ptr() for b in new]
    assert not set(ptrs.tolist()) & set(old_ptrs.tolist())


def test_fill():
    peers = LocalPeers(3)
    bufs = peers.alloc("f", (2, 3), torch.float32, fill=1.5)
    assert all(torch.all(b == 1.5) for b in bufs)
    bufs[0].zero_()
    again = peers.alloc("f", (2, 3), torch.float32, fill=-2)  # re-fill of kept buffers
    assert all(a is b for a, b in zip(again, bufs, strict=True))
    assert all(torch.all(b == -2) for b in again)
    ints = peers.alloc("counters", (4,), torch.int32, fill=0)
    assert all(torch.equal(b, torch.zeros(4, dtype=torch.int32)) for b in ints)


def test_bad_names_and_ranks():
    peers = LocalPeers(2)
    peers.alloc("a", (3,), torch.float32)
    with pytest.raises(KeyError):
        peers.buffer("nope", 0)
    with pytest.raises(KeyError):
        peers.buffers("nope")
    with pytest.raises(KeyError):
        peers.ptrs("nope")
    for rank in (2, 5, -1):
        with pytest.raises(IndexError):
            peers.buffer("a", rank)


@pytest.mark.parametrize("num_ranks", [0, -1, 1.0, "2", None])
def test_bad_num_ranks(num_ranks):
    with pytest.raises(ValueError):
        LocalPeers(num_ranks)


def test_device_is_normalised():
    peers = LocalPeers(2, torch.device("cpu"))
    assert peers.device == torch.device("cpu")
    assert "LocalPeers(num_ranks=2" in repr(peers)


def test_destroy_clears():
    peers = LocalPeers(2)
    peers.alloc("a", (3,), torch.float32)
    peers.alloc("b", (1,), torch.int64)
    peers.destroy()
    assert not peers.has("a") and not peers.has("b")
    with pytest.raises(KeyError):
        peers.ptrs("a")
    with pytest.raises(KeyError):
        peers.buffer("b", 0)
    bufs = peers.alloc("a", (2,), torch.float32, fill=3)  # usable again afterwards
    assert peers.ptrs("a").tolist() == [b.data_ptr() for b in bufs]
