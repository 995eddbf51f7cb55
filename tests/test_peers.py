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


def test_stage_takes_the_callers_tensors_without_a_copy():
    """Tensors that already are such buffers become them: same storage, and the table holds their addresses."""
    peers = LocalPeers(2)
    xs = [torch.randn(6, 4), torch.randn(6, 4)]
    bufs = peers.stage("x", xs, (6, 4), torch.float32)
    assert [b.data_ptr() for b in bufs] == [t.data_ptr() for t in xs]
    assert peers.ptrs("x").tolist() == [t.data_ptr() for t in xs]
    ws = [torch.rand(3, 2), torch.rand(3, 2)]  # [T, K] router weights staged flat as [T*K]
    flat = peers.stage("w", ws, (6,), torch.float32)
    assert flat[1].shape == (6,) and flat[1].data_ptr() == ws[1].data_ptr()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 6).t(),  # not contiguous: a transposed view
    lambda: torch.randn(6, 4).double(),  # another dtype: converted in the copy
    lambda: torch.randn(6 * 4 + 1)[1:].view(6, 4),  # contiguous but 4 bytes past a 16-byte boundary
])
def test_stage_copies_what_cannot_be_a_buffer(make):
    peers = LocalPeers(1)
    t = make()
    bufs = peers.stage("x", [t], (6, 4), torch.float32)
    assert bufs[0].data_ptr() != t.data_ptr() and bufs[0].is_contiguous()
    assert torch.equal(bufs[0], t.float()) and peers.ptrs("x").tolist() == [bufs[0].data_ptr()]


def test_a_staged_callers_tensor_is_never_handed_out_again():
    """After a call that took the caller's tensor, a call that must copy (or an alloc) gets fresh storage: the
    copy would otherwise land in the earlier caller's tensor."""
    peers = LocalPeers(1)
    mine = torch.randn(6, 4)
    keep = mine.clone()
    peers.stage("x", [mine], (6, 4), torch.float32)
    other = torch.randn(4, 6).t()  # must be copied
    bufs = peers.stage("x", [other], (6, 4), torch.float32)
    assert bufs[0].data_ptr() != mine.data_ptr() and torch.equal(mine, keep)
    assert torch.equal(bufs[0], other)
    again = peers.stage("x", [mine], (6, 4), torch.float32)  # taken again: a new table for the new address
    assert again[0].data_ptr() == mine.data_ptr() and peers.ptrs("x").tolist() == [mine.data_ptr()]
    assert peers.alloc("x", (6, 4), torch.float32)[0].data_ptr() != mine.data_ptr()
