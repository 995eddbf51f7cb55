"""The backward's weight gradients as a warp-specialized Gluon kernel (``KernelConfig.wgrad="gluon"``; Hopper only).

The same tiles, order and sums as ``megakernel_bwd.weight_grad_persistent_kernel``: out[g] = P[seg_g]^T Q[seg_g]
in 128 x WM output tiles (block_n x 2 block_n), one program an SM walking slots pid, pid + nprog, ..., each
element one fp32 sum over the group's rows in order, WK rows a step and 16 a wgmma. What differs is who waits:

- a producer warp keeps a STAGES-deep TMA ring full *across tile boundaries*, so the next tile's first row steps
  load while this tile's last wgmmas, its drain and its epilogue run. A routed tile has few steps (Kimi slice:
  six 64-row steps over an expert's ~341 rows), and Triton 3.6 pipelines loads only within one K loop: the
  Triton form (``wgrad="persistent"``) paid each tile's fill (docs/experiments/wgrad-persistent-fused-loop.md:
  why it cannot take the tutorial's fused persistent loop);
- two 4-warp math groups each own 64 of the tile's 128 rows (A = P^T straight from shared memory, B = Q; one
  wgmma group in flight) and store their half through their own shared-memory buffer and a TMA bulk store that
  drains under the next tile.

H200 (``benchmarks/probes/gluon_wgrad_probe.py``, the slices' ragged expert rows, ms, this kernel against
the Triton kernel's and cutlass's (torch._grouped_mm)): Kimi d_W13 1.887 / 2.204 / 2.180, d_W2 0.958 / 1.153 /
1.100; DeepSeek 2.329 / 2.826 / 2.818, 1.220 / 1.540 / 1.444; Qwen 1.189 / 1.310 / 1.326, 0.588 / 0.647 / 0.692;
every output equal bit for bit to the Triton kernel's (and to cutlass's). Deeper rings of shorter steps
(32 x 6, 16 x 12) were no faster.

Gluon kernels do not run under the Triton interpreter: on CPU only the Triton kernel runs (with the knob on, the
backward refuses it there, before launching), and GPU tests hold this kernel to the Triton kernel's bits. Imported only when the knob is on, so a
Triton without Gluon's Hopper API fails there with the reason, not at ``import kittenmoe``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

from kittenmoe.intmath import cdiv
from kittenmoe.kernels.gluon_api import barrier, tensor_desc, tma_load, tma_store

HALF_N = 64  # rows of an output tile a math group owns (one m64 wgmma); a tile is 2 * HALF_N = 128 rows
STAGES_BY_WK = {64: 3}  # 3 x 48 KB of operands + 2 x 32 KB store buffers = 213,232 B on sm_90 (4 stages: 262 KB)


@gluon.jit
def _tile_at(t, order_ptr, offsets_ptr, counts_ptr, N, M, WN: gl.constexpr, WM: gl.constexpr, WK: gl.constexpr):
    """megakernel_bwd._wgrad_tile_at in Gluon: tile t's group g, output origin (n0, m0), rows [seg0, seg1)."""
    n_n = (N + WN - 1) // WN
    n_m = (M + WM - 1) // WM
    g = gl.load(order_ptr + t // (n_n * n_m))
    q = t % (n_n * n_m)
    seg0 = gl.load(offsets_ptr + g)
    seg1 = gl.minimum(seg0 + (gl.load(counts_ptr + g) + WK - 1) // WK * WK, gl.load(offsets_ptr + g + 1))
    return g, (q // n_m) * WN, (q % n_m) * WM, seg0, seg1


@gluon.jit
def _slot_tile(s, nprog, tiles):
    """megakernel_bwd._wgrad_slot_tile in Gluon: the tile taken at slot s (odd full waves reversed)."""
    w = s // nprog
    lane = s - w * nprog
    flip = ((w % 2) == 1) & ((w + 1) * nprog <= tiles)
    return s + flip.to(gl.int32) * (nprog - 1 - 2 * lane)


@gluon.jit
def _consume(p_s, q_s, c_s, ready, empty, out_desc, order_ptr, offsets_ptr, counts_ptr, N, M, tiles,
             HALF: gl.constexpr, STAGES: gl.constexpr):
    """One math group: output rows n0 + HALF * 64 .. + 64 of each tile. acc += P^T Q one WK-row step at a time,
    one wgmma group in flight; a ring stage goes back to the producer (``empty``, count 2: both groups read
    it) once the wgmma that read it is done. The previous tile's TMA store must have read ``c_s`` before the
    epilogue refills it."""
    WK: gl.constexpr = p_s.shape[1]
    HN: gl.constexpr = p_s.shape[2]
    WM: gl.constexpr = q_s.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, WM, 256 // p_s.dtype.primitive_bitwidth])
    it = 0
    for s in range(gl.program_id(0), tiles, gl.num_programs(0)):
        t = _slot_tile(s, gl.num_programs(0), tiles)
        g, n0, m0, seg0, seg1 = _tile_at(t, order_ptr, offsets_ptr, counts_ptr, N, M, 2 * HN, WM, WK)
        acc = gl.zeros((HN, WM), dtype=gl.float32, layout=layout)
        for r in range(seg0, seg1, WK):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            acc = warpgroup_mma(p_s.index(st).permute((1, 0)), q_s.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's wgmma is done, so its stage is free (a predicate, not a branch, between a
            # wgmma and its wait)
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=r > seg0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=seg1 > seg0)
        tma.store_wait(pendings=0)
        barrier()  # every thread past the wait before any writes c_s
        c_s.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma_store(out_desc, [g * N + n0 + HALF * HN, m0], c_s)
    tma.store_wait(pendings=0)


@gluon.jit
def _partition(ROLE: gl.constexpr, STAGES: gl.constexpr, p_desc, q_desc, out_desc, p0_s, p1_s, q_s, c0_s, c1_s,
               ready, empty, order_ptr, offsets_ptr, counts_ptr, N, M, tiles):
    """ROLE 0 / 1: the math groups of each tile's rows 0-63 / 64-127; ROLE 2: the producer warp, walking the
    same tiles and row steps as the math groups (so the ring's order is theirs). STAGES comes beside ROLE in each
    partition's literal tuple: inside the shared argument tuple, warp_specialize would hand it over as a runtime
    value."""
    WK: gl.constexpr = p_desc.block_type.shape[0]
    HN: gl.constexpr = p_desc.block_type.shape[1]
    WM: gl.constexpr = q_desc.block_type.shape[1]
    if ROLE == 2:
        it = 0
        for s in range(gl.program_id(0), tiles, gl.num_programs(0)):
            t = _slot_tile(s, gl.num_programs(0), tiles)
            g, n0, m0, seg0, seg1 = _tile_at(t, order_ptr, offsets_ptr, counts_ptr, N, M, 2 * HN, WM, WK)
            for r in range(seg0, seg1, WK):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                mbarrier.expect(ready.index(st), 2 * p_desc.block_type.nbytes + q_desc.block_type.nbytes)
                tma_load(p_desc, [r, n0], ready.index(st), p0_s.index(st))
                tma_load(p_desc, [r, n0 + HN], ready.index(st), p1_s.index(st))
                tma_load(q_desc, [r, m0], ready.index(st), q_s.index(st))
                it += 1
    elif ROLE == 0:
        _consume(p0_s, q_s, c0_s, ready, empty, out_desc, order_ptr, offsets_ptr, counts_ptr, N, M, tiles, 0, STAGES)
    else:
        _consume(p1_s, q_s, c1_s, ready, empty, out_desc, order_ptr, offsets_ptr, counts_ptr, N, M, tiles, 1, STAGES)


@gluon.jit
def gluon_wgrad_kernel(
    order_ptr,  # [G] int32, the groups in the order their tiles are taken (as weight_grad_persistent_kernel's)
    offsets_ptr,  # [G + 1] int32, first row of each group's segment (as weight_grad_persistent_kernel's)
    counts_ptr,  # [G] int32, real rows of each group (as weight_grad_persistent_kernel's; the shared group's last
    # step reads past T, as TMA zeros)
    p_desc,  # P [rows, N] bf16/fp16 descriptor, blocks [WK, 64] (each math group loads its own 64 columns)
    q_desc,  # Q [rows, M] descriptor, blocks [WK, WM]
    out_desc,  # out [G * N, M] descriptor (N % 128 == 0: a tile never crosses groups), blocks [64, WM]
    N, M, tiles,
    STAGES: gl.constexpr,
):
    """out[g] = P[seg_g]^T Q[seg_g], 128 x WM tiles, one program an SM. Launched with num_warps=4 (the default
    partition is math group 0) and maxnreg=168: 12 warps are launched (the producer's warp group is padded to
    4), 168 x 384 fits the register file, and the partitions then take 256 / 224 / 24 registers a thread."""
    p0_s = gl.allocate_shared_memory(p_desc.dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    p1_s = gl.allocate_shared_memory(p_desc.dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    c0_s = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    c1_s = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    args = (p_desc, q_desc, out_desc, p0_s, p1_s, q_s, c0_s, c1_s, ready, empty, order_ptr, offsets_ptr, counts_ptr, N,
            M, tiles)
    gl.warp_specialize([(_partition, (0, STAGES) + args), (_partition, (1, STAGES) + args),
                        (_partition, (2, STAGES) + args)], [4, 1], [224, 24])


def launch(order, offsets, counts, p_op, q_op, out, N: int, M: int, wk: int, wm: int, progs: int):
    """out [G, N, M] (or [N, M] for one group) = P[seg_g]^T Q[seg_g] for each group, the groups' tiles taken in
    ``order``'s order (kittenmoe.launch_backward checks the conditions and says which failed; this asserts
    them). P [rows, N], Q [rows, M] and out share a 2-byte dtype; N % 128 == 0; out contiguous."""
    import torch

    G = out.numel() // (N * M)
    assert out.is_contiguous() and out.numel() == G * N * M
    assert out.dtype in (torch.bfloat16, torch.float16)
    assert p_op.dtype == q_op.dtype == out.dtype and N % (2 * HALF_N) == 0 and wk in STAGES_BY_WK
    p_desc = tensor_desc(p_op, [wk, HALF_N])
    q_desc = tensor_desc(q_op, [wk, wm])
    out_desc = tensor_desc(out.view(G * N, M), [HALF_N, wm])
    tiles = G * (N // (2 * HALF_N)) * cdiv(M, wm)
    return gluon_wgrad_kernel[(min(tiles, progs),)](order, offsets, counts, p_desc, q_desc, out_desc, N, M, tiles,
                                                     STAGES=STAGES_BY_WK[wk], num_warps=4, maxnreg=168)
