"""Every kernel variant builds for sm_90 with the Triton the H200 runs (3.6), on a machine without a GPU.

The interpreter runs the kernels but checks neither the types on both sides of a runtime branch nor
shared memory. The FP8 backward's replay variant, green here, did not compile on the H200
("Mismatched type for acc_g between then block ... and else block"); Triton 3.9, which CI's interpreter tests
use, accepts that kernel, 3.6 refuses it. So the builds run in a subprocess whose ``sys.path`` puts the
device's Triton first: the directory ``KITTENMOE_SM90_TRITON`` names, else ``.triton-device`` at the
repository root (``pip install --no-deps --target .triton-device triton==3.6.0``, as the README's test command
does). Without either the tests skip and say how to get it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from kittenmoe.config import SHARED_MEMORY_LIMIT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")  # build tooling, outside the installed package
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
DEVICE_TRITON = "3.6"  # the H200 image's Triton (../.library/device/README)


def _triton_dir() -> str:
    d = os.environ.get("KITTENMOE_SM90_TRITON") or os.path.join(ROOT, ".triton-device")
    if not os.path.isdir(os.path.join(d, "triton")):
        pytest.skip(f"no Triton {DEVICE_TRITON} at {d}: pip install --no-deps --target .triton-device "
                    f"triton=={DEVICE_TRITON}.0 (or set KITTENMOE_SM90_TRITON) to check the sm_90 builds")
    return d


def _run_build(spec: dict, triton_dir: str | None) -> subprocess.CompletedProcess:
    """Build ``spec`` in a subprocess with the Triton in ``triton_dir`` first on its path (None: the installed one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([d for d in (triton_dir, os.path.join(ROOT, "src"), TOOLS) if d])
    return subprocess.run([sys.executable, os.path.join(TOOLS, "sm90_build.py"), json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=900)


# Builds run in subprocesses, two at a time (CI has 2 cores; each build is one mostly single-threaded
# compile): ``prefetch_builds`` submits every selected case's build when the first of them starts, and each
# test waits for its own. 30 builds of ~12 s each were ~6 minutes of CI one after another.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_FUTURES: dict[str, concurrent.futures.Future] = {}


def _submit(spec: dict) -> concurrent.futures.Future:
    key = json.dumps(spec, sort_keys=True)
    if key not in _FUTURES:
        _FUTURES[key] = _POOL.submit(_run_build, spec, _triton_dir())
    return _FUTURES[key]


def _build(spec: dict) -> dict:
    _triton_dir()  # skips here, in the test, when the device's Triton is missing
    r = _submit(spec).result()
    assert r.returncode == 0, f"sm_90 build of {spec} failed:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"].startswith(DEVICE_TRITON), f"built with Triton {out['triton']}, not {DEVICE_TRITON}"
    return out


@pytest.fixture(scope="module")
def prefetch_builds(request):
    """Submit the builds of every selected test_megakernel_builds_for_sm90 case at once (in the order pytest
    will run them), so the pool's two workers keep compiling while the tests before them check their output."""
    _triton_dir()
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_megakernel_builds_for_sm90":
            _submit(item.callspec.params["spec"])
    yield
    for f in _FUTURES.values():  # a run stopped early (-x, ^C) does not wait for builds nobody will read
        f.cancel()


FWD = ["dispatch_mlp_swiglu_combine_kernel", "combine_epilogue_kernel"]
BWD = ["combine_mlp_swiglu_dispatch_bwd_kernel", "weight_grad_kernel", "bwd_epilogue_kernel"]
BWD_PERSISTENT = [BWD[0], "weight_grad_persistent_kernel", BWD[2]]
BWD_GLUON = [BWD[0], "gluon_wgrad_kernel", BWD[2]]
FWD_GLUON = ["forward_kernel", FWD[1]]
GLUON_ONE_RANK = dict(num_comm_programs_fwd=0, combine_gather=True, tile_group_m=-1, forward_kernel="gluon")
BWD_MEGA_GLUON = ["backward_kernel", BWD[1], BWD[2]]  # the Gluon backward megakernel, the Triton weight gradients


@pytest.mark.parametrize("spec,expected", [
    (dict(which="fwd"), FWD),  # the BF16 forward, default config
    (dict(which="fwd", resident=True), FWD),  # SAVE_GU: keeps gate|up for the backward
    (dict(which="fwd", trace=True), FWD),  # the profiling build (TRACE: %globaltimer reads, event stores)
    (dict(which="bwd"), BWD),  # BF16 backward with replay (GU_MODE 0)
    (dict(which="fwd", config=dict(tile_group_m=4)), FWD),  # a minibatch's tiles in groups of 4 row tiles
    (dict(which="bwd", resident=True, config=dict(tile_group_m=4)), BWD),  # the backward's likewise
    # each expert's row tiles of a minibatch walked together (tile_group_m = -1), forward and kept backward
    (dict(which="fwd", config=dict(tile_group_m=-1)), FWD),
    # no comm programs (every program pulls first) with the gathering epilogue (KernelConfig.combine_gather)
    (dict(which="fwd", resident=True, config=dict(num_comm_programs_fwd=0, combine_gather=True)), FWD),
    (dict(which="bwd", resident=True, config=dict(combine_gather=True)), BWD),  # the backward's gathering epilogue
    # and its pull by every program (num_comm_programs_bwd = 0)
    (dict(which="bwd", resident=True, config=dict(combine_gather=True, num_comm_programs_bwd=0)), BWD),
    (dict(which="bwd", resident=True, config=dict(tile_group_m=-1)), BWD),
    # weight gradients from one persistent program per SM (its flat loop of row steps pipelines over tiles)
    (dict(which="bwd", resident=True, config=dict(wgrad="persistent")), BWD_PERSISTENT),
    # the weight gradients from the warp-specialized Gluon kernel (KernelConfig.wgrad="gluon"), kept and replaying
    (dict(which="bwd", resident=True, config=dict(wgrad="gluon")), BWD_GLUON),
    (dict(which="bwd", config=dict(wgrad="gluon")), BWD_GLUON),
    # the warp-specialized Gluon forward (KernelConfig.forward_kernel="gluon"), keeping gate|up and not
    (dict(which="fwd", resident=True, config=GLUON_ONE_RANK), FWD_GLUON),
    (dict(which="fwd", config=GLUON_ONE_RANK), FWD_GLUON),
    # its gathering form (forward_kernel="gluon-gather"): keeping at a 4-stage ring with one store buffer a math
    # group (229,784 B), not keeping at 3 stages, and keeping at its shallowest ring, 2 stages
    (dict(which="fwd", resident=True, config=dict(GLUON_ONE_RANK, forward_kernel="gluon-gather")), FWD_GLUON),
    (dict(which="fwd", config=dict(GLUON_ONE_RANK, forward_kernel="gluon-gather", num_stages=3)), FWD_GLUON),
    (dict(which="fwd", resident=True, config=dict(GLUON_ONE_RANK, forward_kernel="gluon-gather", num_stages=2)),
     FWD_GLUON),
    # the profiling builds of both forms (TRACE: math group 0's tiles, the producer's polls, the pull form's pulls)
    (dict(which="fwd", resident=True, trace=True, config=dict(GLUON_ONE_RANK, forward_kernel="gluon-gather")),
     FWD_GLUON),
    (dict(which="fwd", resident=True, trace=True, config=GLUON_ONE_RANK), FWD_GLUON),
    # the Gluon backward megakernel (KernelConfig.backward_kernel="gluon"): the one-rank kept path, no shared expert,
    # its phase-A rows tracked by the ring's barrier (d_out in L2) or signalled a step late
    (dict(which="bwd", resident=True, shared=False,
          config=dict(GLUON_ONE_RANK, forward_kernel="triton", num_comm_programs_bwd=0, backward_kernel="gluon")),
     BWD_MEGA_GLUON),
    (dict(which="bwd", resident=True, shared=False, gather_tracked=False,
          config=dict(GLUON_ONE_RANK, forward_kernel="triton", num_comm_programs_bwd=0, backward_kernel="gluon")),
     BWD_MEGA_GLUON),
    # and its profiling build (TRACE: each role's events)
    (dict(which="bwd", resident=True, shared=False, trace=True,
          config=dict(GLUON_ONE_RANK, forward_kernel="triton", num_comm_programs_bwd=0, backward_kernel="gluon")),
     BWD_MEGA_GLUON),
    # the backward megakernel at 4 stages (it fits: 229,408 B), kept and FP8-replaying
    (dict(which="bwd", resident=True, config=dict(bwd_num_stages=4)), BWD),
    (dict(which="bwd", fp8_block=128, replay=True, config=dict(block_m=64, bwd_num_stages=4)), BWD),
    (dict(which="bwd", resident=True), BWD),  # BF16 backward reading kept activations (GU_MODE 1)
    (dict(which="bwd", resident=True, trace=True), BWD),  # its profiling build (TRACE)
    (dict(which="bwd", resident=True, config=dict(minibatch_size=128, macrobatch_size=128)), BWD),  # ring wraps: GU_MODE 2
    (dict(which="fwd", fp8_block=128, config=dict(block_m=64)), FWD),  # FP8 forward, the block_m it runs at
    (dict(which="fwd", fp8_block=128, fp8_down_high=True, config=dict(block_m=64)), FWD),  # FP8, down in bf16
    (dict(which="bwd", fp8_block=128, config=dict(block_m=64)), BWD),  # FP8 backward, kept activations
    (dict(which="bwd", fp8_block=128, replay=True, config=dict(block_m=64)), BWD),  # FP8 replay: broke 12-01
    (dict(which="bwd", fp8_block=128, fp8_dx_high=True, config=dict(block_m=64)), BWD),  # FP8, d_x in bf16
    (dict(which="fwd", fp8_block=32, config=dict(block_m=64)), FWD),  # MXFP8 32-blocks
    (dict(which="bwd", fp8_block=32, replay=True, config=dict(block_m=64)), BWD),  # MXFP8 backward, replay
], ids=lambda v: json.dumps(v, separators=(",", ":")) if isinstance(v, dict) else "")
def test_megakernel_builds_for_sm90(spec, expected, prefetch_builds):
    """Compiles; every launch of the variant is there; shared memory fits a Hopper SM; the GEMM kernels
    use wgmma and TMA (a change that loses either compiles and runs, only slower)."""
    out = _build(spec)
    names = [b["name"] for b in out["builds"]]
    assert sorted(set(names)) == sorted(expected), names
    for b in out["builds"]:
        assert b["shared"] <= SHARED_MEMORY_LIMIT, b
        if b["name"] in (FWD[0], BWD[0], BWD[1], BWD_PERSISTENT[1], BWD_GLUON[1], FWD_GLUON[0], BWD_MEGA_GLUON[0]):
            assert b["wgmma"] and b["tma"], b
        # what the knobs compile to: the timer reads only in TRACE builds of the megakernels; nothing Triton
        # builds is warp-specialized (the one form that was, tl.range(warp_specialize=True) over the weight
        # gradients, computed wrong values on the H200); the Gluon kernel is, by hand, with 3 partitions of
        # 384 threads and no spills (its own GPU test holds it to the Triton kernel's bits)
        if b["name"] in (FWD[0], BWD[0]):
            assert b["timer"] == spec.get("trace", False), b
        # every wgmma's descriptor registers set on every path to it (a ptxas miscompile seen on the H200)
        assert not b["hgmma_unset"], b
        # no counter released while a TMA store of the rows it announces may still be in flight (the Gluon
        # forward's hidden rows were, behind tma.store_wait's .read form)
        assert not b["early_releases"], b
        if b["name"] == BWD_GLUON[1]:
            assert b["warp_specialized"] and b["threads"] == 384 and b["stack"] == 0 and b["local"] == 0, b
        elif b["name"] == BWD_MEGA_GLUON[0]:  # 4 partitions of 128 threads sharing the register file, none spilling
            assert b["warp_specialized"] and b["threads"] == 512 and b["stack"] == 0 and b["local"] == 0, b
        elif b["name"] == FWD_GLUON[0]:  # its 24-byte stack frame holds no spills (local 0)
            assert b["warp_specialized"] and b["threads"] == 384 and b["local"] == 0, b
        else:
            assert not b["warp_specialized"], b


# Two HGMMAs after a branch, as ptxas built wgrad_gluon's three-way short tail: the taken path
# sets UR16..UR19 only; its second wgmma reads UR8..UR11, set in the other branch alone.
_SASS_BRANCHES = """
        /*0000*/                   UMOV UR16, 0x1 ;
        /*0010*/                   UMOV UR17, 0x40000040 ;
        /*0020*/                   UMOV UR18, 0x2 ;
        /*0030*/                   UMOV UR19, 0x40000040 ;
        /*0040*/              @!P2 BRA 0xa0 ;
        /*0050*/                   UIADD3 UR8, UP0, UR16, 0x80, URZ ;
        /*0060*/                   UIADD3.64 UR10, UR18, 0x80, URZ ;
        /*0070*/                   UIADD3.X UR9, UR17, 0x0, URZ, UP0, !UPT ;
        /*0080*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24, gsb0 ;
        /*0090*/                   BRA 0xd0 ;
        /*00a0*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16].tnspA.tnspB, R24 ;
        /*00b0*/              @P3  UIADD3 UR8, UR16, 0x80, URZ ;
        /*00c0*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24, gsb0 ;
        /*00d0*/                   EXIT ;
"""


# A branch whose condition is an operand (BRA.U !UP0): when UP0 it falls through to 0x20, which jumps to the
# wgmma at 0x70 past the writes of UR8..UR11 that the taken path makes.
_SASS_OPERAND_BRANCH = """
        /*0000*/                   UMOV UR16, 0x1 ;
        /*0010*/                   BRA.U !UP0, 0x30 ;
        /*0020*/                   BRA 0x70 ;
        /*0030*/                   UMOV UR8, 0x1 ;
        /*0040*/                   UMOV UR9, 0x1 ;
        /*0050*/                   UMOV UR10, 0x1 ;
        /*0060*/                   UMOV UR11, 0x1 ;
        /*0070*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspA.tnspB, R24, gsb0 ;
        /*0080*/                   EXIT ;
"""


def test_hgmma_descriptor_check_flags_a_path_that_leaves_one_unset():
    """sm90_build.hgmma_descriptors_unset: the wgmma at 0xc0 reads UR8..UR11, set only under the other branch
    (and UR8 under a predicate, which does not count); the two others have theirs on every path. With that
    wgmma reading UR16..UR19 (set before the branch) the same code passes; a second, clean function after it in
    the listing (addresses restart at 0) does not hide it; nor does a branch whose condition is an operand."""
    from sm90_build import hgmma_descriptors_unset

    bad = hgmma_descriptors_unset(_SASS_BRANCHES)
    assert len(bad) == 1 and bad[0].startswith("0x00c0") and "[8, 9, 10, 11]" in bad[0], bad
    fixed = _SASS_BRANCHES.replace("gdesc[UR8].tnspA.tnspB, R24, gsb0 ;\n        /*00d0*/",
                                   "gdesc[UR16].tnspA.tnspB, R24, gsb0 ;\n        /*00d0*/")
    assert hgmma_descriptors_unset(fixed) == []
    two = "\n\t\tFunction : bad" + _SASS_BRANCHES + "\n\t\tFunction : good" + fixed
    assert [b[:6] for b in hgmma_descriptors_unset(two)] == ["0x00c0"]
    assert [b[:6] for b in hgmma_descriptors_unset(_SASS_OPERAND_BRANCH)] == ["0x0070"]


def test_hgmma_descriptor_check_flags_the_three_way_tail_build():
    """The SASS of the build that failed on the H200 (wgrad_gluon with a three-way short last step,
    Triton 3.6's ptxas; tests/data, encodings stripped): each math group's 32-row branch issues its second
    wgmma with descriptor registers written only in the 48-row branch. Both are flagged, nothing else; the
    warp-specialized partitions are reached through an indirect branch (BRX)."""
    import gzip

    from sm90_build import hgmma_descriptors_unset

    with gzip.open(os.path.join(ROOT, "tests", "data", "wgrad_gluon_three_way_tail.sass.gz"), "rt") as f:
        bad = hgmma_descriptors_unset(f.read())
    assert [b[:6] for b in bad] == ["0x18f0", "0x44f0"], bad


# A gate|up tile's epilogue as the Gluon forward compiled it (Triton 3.6): the hidden rows' TMA store, then
# tma.store_wait's .read form, the proxy fence, the barrier and the release of hid_ready.
_PTX_SIGNAL = """\t@%p239 cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd9, {%r3290, %r3912}], [%r3291];
\tcp.async.bulk.commit_group;
\tcp.async.bulk.wait_group.read \t0;
\tfence.proxy.async.global;
\tbar.sync \t0, 128;
\t@%p208 atom.global.gpu.release.add.u32 %r3293, [ %rd202 + 0 ], %r3294;
"""


def test_release_check_flags_a_signal_that_may_overtake_its_rows():
    """sm90_build.releases_before_stores_land: the release after a TMA store and only the .read wait is
    flagged; with ``cp.async.bulk.wait_group 0`` before the fence it is not; a release with no store before it
    in its function (a TMA load's rows, ordinary stores) is not; a store in one function does not flag the
    next function's release."""
    from sm90_build import releases_before_stores_land

    bad = releases_before_stores_land(_PTX_SIGNAL)
    assert len(bad) == 1 and bad[0].startswith("line 6:") and "TMA store at line 1" in bad[0], bad
    fixed = _PTX_SIGNAL.replace("\tfence.proxy", "\tcp.async.bulk.wait_group 0;\n\tfence.proxy")
    assert releases_before_stores_land(fixed) == []
    assert releases_before_stores_land(_PTX_SIGNAL.split("\n", 1)[1]) == []
    for header in (".visible .entry next(", ".func next(", ".visible .func next(", ".weak .func next("):
        two = _PTX_SIGNAL.split("\tcp.async.bulk.commit", 1)[0] + header + "\n" + _PTX_SIGNAL.split("\n", 1)[1]
        assert releases_before_stores_land(two) == [], header


def test_quantisers_build_for_sm90():
    """The standalone FP8 quantisers, bf16 and fp32 inputs, 128- and 32-blocks, the weights' one-pass and
    chunked forms: all compile; none spills but the one-pass form of 128-blocks (a whole 128 x 128 block in
    4 warps' registers: 255 and a 280-byte stack for bf16 with Triton 3.6), which is why the chunked form
    is the default."""
    out = _build(dict(which="quant"))
    names = [b["name"] for b in out["builds"]]
    assert len(names) == 10 and len(set(names)) == 10, names
    for b in out["builds"]:
        assert b["shared"] <= SHARED_MEMORY_LIMIT, b
        if not b["name"].endswith("SB=128,RC=128]"):
            assert b["local"] == 0 and b["stack"] == 0, b


def test_gluon_fp8_probe_builds_overlapped_for_sm90():
    """benchmarks/probes/gluon_fp8_probe.py's e4m3 GEMM loops at the Kimi/DeepSeek K (7168), as the H200 ran them
    (chunk8 1049 TFLOP/s against the Triton promote loop's 782): the pair and chunk loops build with
    wgmma waits that leave one group in flight (the promotion under the next wgmma) and no stack; the
    loop-carried lag form is serialized by ptxas (every wait leaves none), which is why chunks drain."""
    d = _triton_dir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([d, os.path.join(ROOT, "src"), TOOLS])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probes", "gluon_fp8_probe.py"), "--build", "--json",
                        "--k", "7168", "--stages", "4", "--modes", "pair,chunk4,chunk8,lag"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"].startswith(DEVICE_TRITON), out["triton"]
    builds = {b["mode"]: b for b in out["builds"]}
    # Waits leaving one group in flight: pair 1 (its first product's); chunkN the N - 1 real ones (step k issued
    # before step k-1 is waited on) and N - 1 no-op ones that order each promotion before the next wgmma
    # (waits_by_groups_left's keys are JSON strings).
    for mode, overlapped in (("pair", 1), ("chunk4", 6), ("chunk8", 14)):
        b = builds[mode]
        assert b["stack"] == 0 and b["shared"] <= SHARED_MEMORY_LIMIT, b
        assert b["waits_by_groups_left"].get("1", 0) == overlapped, b
    assert set(builds["lag"]["waits_by_groups_left"]) == {"0"}, builds["lag"]


@pytest.mark.parametrize("spec,expected,threads", [
    # the Gluon forward, both forms, keeping gate|up
    (dict(which="fwd", resident=True, config=GLUON_ONE_RANK), FWD_GLUON, 384),
    (dict(which="fwd", resident=True, config=dict(GLUON_ONE_RANK, forward_kernel="gluon-gather")), FWD_GLUON, 384),
    # the Gluon backward megakernel, one rank, kept, no shared expert
    (dict(which="bwd", resident=True, shared=False,
          config=dict(GLUON_ONE_RANK, forward_kernel="triton", num_comm_programs_bwd=0, backward_kernel="gluon")),
     BWD_MEGA_GLUON, 512),
    (dict(which="bwd", resident=True, config=dict(wgrad="gluon")), BWD_GLUON, 384),  # the Gluon weight gradients
], ids=["fwd-gluon", "fwd-gluon-gather", "bwd-gluon", "wgrad-gluon"])
def test_gluon_kernels_build_for_sm90_with_the_installed_triton(spec, expected, threads):
    """The Gluon kernels call Gluon's API through kernels/gluon_api.py, which binds the names Triton 3.9 renamed
    (CI's Triton, when it is not the device's 3.6; the builds above hold 3.6): each kernel compiles, keeps its
    wgmmas, TMA and warp specialization, spills nothing and fits shared memory."""
    import triton

    from kittenmoe.launch_common import gluon_api_missing

    if triton.__version__.startswith(DEVICE_TRITON):
        pytest.skip(f"the installed Triton is the device's {DEVICE_TRITON}: test_megakernel_builds_for_sm90 builds it")
    missing = gluon_api_missing()
    if missing is not None:
        pytest.skip(f"Triton {triton.__version__} lacks {missing}: the Gluon kernels do not run with it")
    r = _run_build(spec, None)
    assert r.returncode == 0, f"sm_90 build of {spec} failed:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"] == triton.__version__, out["triton"]
    names = [b["name"] for b in out["builds"]]
    assert sorted(set(names)) == sorted(expected), names
    for b in out["builds"]:
        assert b["shared"] <= SHARED_MEMORY_LIMIT and not b["hgmma_unset"] and not b["early_releases"], b
        if b["name"] in (FWD_GLUON[0], BWD_MEGA_GLUON[0], BWD_GLUON[1]):
            assert b["wgmma"] and b["tma"] and b["warp_specialized"], b
            assert b["threads"] == threads and b["local"] == 0, b
