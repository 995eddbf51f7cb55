"""Compile the kernels for sm_90 (Hopper) on a machine without a GPU, and read what the builds use.

Build tooling, not library: it lives in the repository's ``tools/`` (not in the installed package) and imports
``kittenmoe`` from ``src/``. Two users: ``scripts/sm90_compile.py`` (registers, spills and shared memory of a tile
or stage change, in a minute instead of a device call) and ``tests/test_sm90_build.py`` (CI: every kernel variant must build for
the H200 with the Triton the device runs). The second exists because the interpreter checks neither types
across branches nor shared memory: the FP8 backward's replay variant, green in CI, did not
compile on the H200 (Triton 3.6: "Mismatched type for acc_g between then block ... and else block").

How: the launchers run on small CPU tensors of a shape's widths (H, I, S; few tokens and experts, which are
runtime values) with the GPU code path forced (TMA descriptors, no interpreter); every ``kernel[grid](...)``
compiles through ``JITFunction.run(warmup=True)`` for a fake sm_90 driver instead of launching. The figures
are those of the installed Triton, which CI pins to the device's (3.6) so that they match it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from kittenmoe import launch_backward, launch_common, launch_forward
from kittenmoe.config import SEED_SHAPES, TEST_SHAPES, KernelConfig
from kittenmoe.testing import make_weights, routing_uniform



class _FakeSm90Driver:
    """Just enough of a driver for ``JITFunction.run(warmup=True)`` to compile for sm_90."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Build:
    """One compiled kernel: its name, registers a thread, stack and local (spill) bytes, shared memory, threads
    a program, and what the code holds: wgmma, TMA, warp specialization (``ttg.warp_specialize``), timer
    reads (``%globaltimer``, the TRACE builds); ``hgmma_unset``: the SASS's wgmmas whose descriptor registers
    some path leaves unset (``hgmma_descriptors_unset``; empty in a sound build); ``early_releases``: the PTX's
    release atomics that may overtake a TMA store of the same thread (``releases_before_stores_land``; empty in
    a sound build)."""

    name: str
    regs: int
    stack: int
    local: int
    shared: int
    wgmma: bool
    tma: bool
    threads: int = 0
    warp_specialized: bool = False
    timer: bool = False
    hgmma_unset: tuple[str, ...] = ()
    early_releases: tuple[str, ...] = ()
    kernel: object = dataclasses.field(default=None, repr=False, compare=False)

    def line(self) -> str:
        return (f"{self.name:<40} regs {self.regs:>3} stack {self.stack:>4} local {self.local:>4}  "
                f"shared {self.shared:>7} B  wgmma {self.wgmma}  TMA {self.tma}")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump FLAG on a cubin, with the cuobjdump shipped in Triton's NVIDIA backend."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> str:
    """The SASS of a cubin (``cuobjdump -sass``)."""
    return _cuobjdump(cubin, "-sass")


_SASS_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def hgmma_descriptors_unset(sass_text: str) -> list[str]:
    """The HGMMAs (wgmma) of a SASS listing whose shared-memory descriptor registers (``gdesc[URk]``: URk..URk+3)
    are not written on every path from the function's entry: a forward must-define analysis over each function's
    branches, where a predicated write does not count.

    Why: Triton 3.6's ptxas built a Gluon branch that issued a 32-row wgmma with the descriptor of its second half
    computed only in a sibling branch (three branches of 16 / 32 / 32 + 16-row wgmmas in a short last step tried in
    ``wgrad_gluon`` and dropped, docs/experiments/wgrad-gluon-short-last-step.md;
    ``tests/data/wgrad_gluon_three_way_tail.sass.gz``); the H200 then summed garbage and hit illegal addresses, and
    ptxas said nothing.

    Coarse, in the safe direction mostly: uniform registers only; writes it does not see (vote, elect,
    complementary predicated pairs) give false alarms; calls are not followed; an indirect branch is taken to reach
    every instruction no direct edge reaches; a register set on every path by an earlier, stale write passes."""
    bad = []
    for func in re.split(r"\n\s*Function : ", sass_text):
        insns = [(int(m[1], 16), m[2] is not None, m[3], m[4]) for m in _SASS_INSN.finditer(func)]
        bad += _hgmma_unset_in(insns)
    return bad


def _sass_successors(insns: list[tuple], index: dict[int, int], i: int) -> list[int]:
    """Where control goes after instruction i: a branch's target, and the next instruction unless the branch is
    unconditional (no ``@P`` guard, no predicate operand such as ``BRA.U !UP0, 0x..``, not ``.DIV``)."""
    n = len(insns)
    _a, guarded, op, args = insns[i]
    nxt = [i + 1] if i + 1 < n else []
    if op.startswith(("RET", "EXIT")):
        return nxt if guarded else []
    if not op.startswith(("BRA", "JMP")):
        return nxt
    t = re.search(r"0x([0-9a-f]+)\s*$", args.strip())
    target = [index[int(t[1], 16)]] if t and int(t[1], 16) in index else []
    conditional = guarded or ".DIV" in op or re.search(r"(^|,)\s*!?U?P[T0-9]+\s*,", args) is not None
    return target + (nxt if conditional else [])


def _hgmma_unset_in(insns: list[tuple]) -> list[str]:
    """hgmma_descriptors_unset for one function's instructions ((address, guarded, opcode, operands))."""
    n = len(insns)
    if not n:
        return []
    index = {a: i for i, (a, *_) in enumerate(insns)}

    def written(i: int) -> set[int]:
        _a, guarded, op, args = insns[i]
        if guarded or not op.startswith(("U", "R2UR", "S2UR")) or op.startswith(("UTMA", "USETMAXREG")):
            return set()
        m = re.fullmatch(r"UR(\d+)", args.split(",")[0].strip())
        return {int(m[1]) + j for j in range(2 if ".64" in op or ".WIDE" in op else 1)} if m else set()

    writes = [written(i) for i in range(n)]  # once, not on every pass to the fixed point
    succ = [_sass_successors(insns, index, i) for i in range(n)]
    # An indirect branch (BRX / JMX: gl.warp_specialize dispatches its partitions through one) may go to any
    # instruction that no direct edge reaches: give it those as successors.
    orphans = sorted(set(range(1, n)) - {j for js in succ for j in js})
    for i, (_a, _g, op, _args) in enumerate(insns):
        if op.startswith(("BRX", "JMX")):
            succ[i] = sorted(set(succ[i]) | set(orphans))
    reached, todo = {0}, [0]
    while todo:  # only paths from the entry count: dead code does not make a register unset
        for j in succ[todo.pop()]:
            if j not in reached:
                reached.add(j)
                todo.append(j)
    preds: list[list[int]] = [[] for _ in range(n)]
    for i in reached:
        for j in succ[i]:
            preds[j].append(i)
    every = frozenset(range(256))
    set_in, set_out = [every] * n, [every] * n  # the must-analysis starts from "all set" and only shrinks
    changed = True
    while changed:  # to the fixed point: a register is set at i when it is set at the end of every predecessor
        changed = False
        for i in sorted(reached):
            new_in = frozenset.intersection(*[set_out[p] for p in preds[i]]) if i and preds[i] else frozenset()
            new_out = new_in | writes[i]
            if (new_in, new_out) != (set_in[i], set_out[i]):
                set_in[i], set_out[i] = new_in, new_out
                changed = True
    bad = []
    for i in sorted(reached):
        a, _g, op, args = insns[i]
        m = re.search(r"gdesc\[UR(\d+)\]", args) if op.startswith("HGMMA") else None
        missing = [int(m[1]) + j for j in range(4) if int(m[1]) + j not in set_in[i]] if m else []
        if missing:
            bad.append(f"{a:#06x} {op}{args.strip()[:48]}: UR{missing} unset on some path")
    return bad


_BULK_STORE = re.compile(r"\bcp\.async\.bulk\.tensor\.\w+\.global\.shared")
_BULK_WRITTEN = re.compile(r"\bcp\.async\.bulk\.wait_group\s+0\s*;")  # not the .read form
_RELEASE = re.compile(r"\b(atom|red)\.[\w.]*\brelease\b")
_FUNCTION = re.compile(r"^\s*(\.(visible|weak|extern)\s+)*\.(entry|func)\b")  # a kernel's or a function's header


def releases_before_stores_land(ptx: str) -> list[str]:
    """The release atomics of a PTX listing reached, in program order, after a TMA store (``cp.async.bulk.tensor``
    to global) with no ``cp.async.bulk.wait_group 0`` in between: such a release can publish a counter before
    the stored rows are in global memory, where another program's load would read them stale.

    Why: the Gluon forward signalled a gate|up tile's hidden rows after ``tma.store_wait``, which Triton 3.6
    lowers to the ``.read`` form (the shared-memory source is read, nothing said about the global write).
    Coarse: the listing is read straight through, not along its branches (each function's text in order)."""
    bad, pending = [], None
    for n, line in enumerate(ptx.splitlines(), 1):
        if _FUNCTION.match(line):
            pending = None
        if _BULK_STORE.search(line):
            pending = n
        elif _BULK_WRITTEN.search(line):
            pending = None
        elif pending is not None and _RELEASE.search(line):
            bad.append(f"line {n}: {line.strip()[:60]} (TMA store at line {pending})")
    return bad


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(REG, STACK, LOCAL) from cuobjdump, shipped with Triton's NVIDIA backend."""
    out = _cuobjdump(cubin, "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK/LOCAL line: {out.strip()[-200:]}")
    return int(m[1]), int(m[2]), int(m[4])


def _build(name: str, k) -> Build:
    ptx = k.asm.get("ptx", "")
    regs, stack, local = _resource_usage(k.asm["cubin"])
    m = re.search(r"\.reqntid (\d+)", ptx)
    wgmma = "wgmma.mma_async" in ptx
    return Build(name, regs, stack, local, k.metadata.shared, wgmma, "cp.async.bulk.tensor" in ptx,
                 int(m[1]) if m else 0, "ttg.warp_specialize" in k.asm.get("ttgir", ""), "%globaltimer" in ptx,
                 tuple(hgmma_descriptors_unset(sass(k.asm["cubin"]))) if wgmma else (),
                 tuple(releases_before_stores_land(ptx)), k)


@contextlib.contextmanager
def gpu_path_on_cpu(run, gather_tracked: bool = True, gluon_auto: bool = False):
    """Within: the launchers take the GPU code path on CPU tensors (TMA descriptors, no interpreter) and every
    ``kernel[grid](...)`` goes to ``run(original_run, jit_function, *args, grid=, warmup=, **kwargs)`` with a fake
    sm_90 driver active. ``gather_tracked``: what ``launch_backward.gather_tracked`` answers (it reads the GPU's
    L2 size); ``gluon_auto``: the kernel knobs' "auto" values pick the Gluon kernels, as on a Hopper GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("sm90_build compiles real kernels: unset TRITON_INTERPRET before kittenmoe.kernels "
                           "is imported (run it in its own process)")
    orig_run = JITFunction.run

    def jit_run(self, *args, grid, warmup, **kwargs):
        return run(orig_run, self, *args, grid=grid, warmup=warmup, **kwargs)

    prev_driver = driver._active
    # The GPU code path on CPU tensors: the launchers read these through their modules (launch_common's device
    # checks and program count serve both directions), so each is patched in one place.
    patches = [
        (launch_common, "interpreting", lambda: False),
        (launch_common, "check_device", lambda device: None),
        (launch_common, "check_gluon_device", lambda *a_, **k_: None),
        (launch_common, "num_programs", lambda dev, num_comm: 132),
        (launch_forward, "_tma_ok", lambda config, *a_, **k_: config.tma),
        (launch_backward, "_bwd_tma_ok", lambda config, *a_, **k_: config.tma),
        (launch_backward, "gather_tracked", lambda d_out_bytes, dev: gather_tracked),
    ]
    if gluon_auto:
        patches.append((launch_common, "gluon_runs_here", lambda dev, module: True))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    driver.set_active(_FakeSm90Driver())
    JITFunction.run = jit_run
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        JITFunction.run = orig_run
        driver._active = prev_driver
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def compile_only_sm90(gather_tracked: bool = True):
    """Within: kernel launches compile for sm_90 and do not run; yields the list they append Builds to.
    ``gather_tracked``: what ``launch_backward.gather_tracked`` answers (it reads the GPU's L2 size)."""
    built: list[Build] = []

    def run(orig_run, self, *args, grid, warmup, **kwargs):
        try:
            k = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # marked, so that build_megakernels never mistakes it for a post-launch failure
            exc.kittenmoe_compile_failed = True
            raise
        built.append(_build(self.fn.__name__, k))
        return k

    with gpu_path_on_cpu(run, gather_tracked):
        yield built


def build_megakernels(which: str, shape: str = "kimi-k2.7", config: KernelConfig = KernelConfig(),
                      fp8_block: int | None = None, replay: bool = False, resident: bool = False,
                      trace: bool = False, fp8_dx_high: bool = False, fp8_down_high: bool = False,
                      shared: bool = True, gather_tracked: bool = True) -> list[Build]:
    """Compile the forward (``which="fwd"``) or backward (``"bwd"``) launch's kernels for sm_90.

    ``fp8_block``: e4m3 routed experts with that scale block (32: MXFP8, pow2 scales), with
    ``FP8Config.dx_high`` / ``down_high`` as ``fp8_dx_high`` / ``fp8_down_high`` say; ``replay``: the FP8
    backward without the forward's kept activations; ``resident``: the variants that keep the forward's
    activations for the backward (SAVE_GU / RESIDENT); ``trace``: the profiling build (TRACE); ``shared``: the
    shape's shared expert (False: none); ``gather_tracked``: the Gluon backward's phase-A gather form
    (``launch_backward.gather_tracked``)."""
    if which not in ("fwd", "bwd"):
        raise ValueError(f"which must be 'fwd' or 'bwd', got {which!r}")
    sh = {**SEED_SHAPES, **TEST_SHAPES}[shape]
    sh = sh.with_(e=4, k=2)  # widths as the shape has them; experts and tokens are runtime values
    T = 64
    g = torch.Generator().manual_seed(0)
    w = make_weights(sh, dtype=torch.bfloat16, device="cpu", generator=g, shared=shared)
    x = [torch.randn(T, sh.h, generator=g).to(torch.bfloat16)]
    ids, wts = routing_uniform(T, sh.e, sh.k, generator=g, device="cpu")
    d_out = [torch.randn(T, sh.h, generator=g).to(torch.bfloat16)]
    a = (x, [ids], [wts], w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, sh.swiglu_limit)
    fp8 = None
    if fp8_block is not None:
        from kittenmoe.fp8 import FP8Config, FP8ExpertWeights

        fp8 = FP8ExpertWeights.quantize(w.w13_E2IH, w.w2_EHI, FP8Config(fp8_block, fp8_block == 32, fp8_dx_high,
                                                                        fp8_down_high))
    with compile_only_sm90(gather_tracked) as built:
        try:
            if which == "fwd":
                launch_forward.megakernel_forward_multirank(*a, config=config, save_for_backward=resident, fp8=fp8,
                                                            trace=trace)
            else:
                fwd = None
                if resident or (fp8 is not None and not replay):
                    # the forward's states carry the buffers the backward reads; its kernels are not reported
                    fwd = launch_forward.megakernel_forward_multirank(*a, config=config, save_for_backward=True,
                                                                      fp8=fp8)
                    built.clear()
                launch_backward.megakernel_backward_multirank(d_out, *a, config=config,
                                                              saved=fwd.saved() if fwd else None,
                                                  fp8=fp8, trace=trace)
        except Exception as exc:
            # The launchers read results after the (fake) launches and may fail there, once the kernels have
            # compiled: that is expected. A compile failure, or a failure before any compile, is not.
            if getattr(exc, "kittenmoe_compile_failed", False) or not built:
                raise
        return list(built)


def build_quantisers() -> list[Build]:
    """Compile the standalone FP8 quantisers (activations 1 x B, weights B x B with their transposes) for
    sm_90, for bf16 and fp32 inputs and both scale blocks, as ``kittenmoe.fp8``'s launchers call them."""
    from kittenmoe.fp8 import ACT_QUANT_LAUNCH, WEIGHT_QUANT_LAUNCH
    from kittenmoe.kernels import quant

    with compile_only_sm90() as built:
        def label(what: str) -> None:  # name the build just made by its variant
            built[-1] = dataclasses.replace(built[-1], name=f"{built[-1].name}[{what}]")

        for dt in (torch.bfloat16, torch.float32):
            dn = str(dt).removeprefix("torch.")
            for b in (128, 32):
                x = torch.empty(64, 256, dtype=dt)
                quant.quantize_act_1xb_kernel[(1, 256 // b)](
                    x, torch.empty(64, 256, dtype=torch.uint8), torch.empty(64, 256 // b), 64, 256, 256 // b,
                    SB=b, POW2=b == 32, **ACT_QUANT_LAUNCH[b])
                label(f"{dn},SB={b}")
                w = torch.empty(2, 256, 384, dtype=dt)
                nb, kb = 256 // b, 384 // b
                for rc in sorted({WEIGHT_QUANT_LAUNCH[b]["RC"], b}):  # the default form and the one-pass one
                    quant.quantize_weights_bxb_kernel[(kb, nb, 2)](
                        w, torch.empty(2, 256, 384, dtype=torch.uint8), torch.empty(2, 384, 256, dtype=torch.uint8),
                        torch.empty(2, nb, kb), 256, 384, nb, kb, SB=b, POW2=b == 32, TRANSPOSED=True,
                        **{**WEIGHT_QUANT_LAUNCH[b], "RC": rc})
                    label(f"{dn},SB={b},RC={rc}")
        return list(built)


def _main(argv: list[str]) -> int:
    """``PYTHONPATH=src python tools/sm90_build.py '{"which": "bwd", "fp8_block": 128, ...}'`` (or ``'{"which":
    "quant"}'``): one JSON list of the builds on stdout, for tests/test_sm90_build.py's subprocess."""
    import json

    spec = json.loads(argv[0])
    which = spec.pop("which")
    if which == "quant":
        builds = build_quantisers()
    else:
        config = KernelConfig(**spec.pop("config", {}))
        builds = build_megakernels(which, config=config, **spec)
    print(json.dumps(dict(triton=triton.__version__, builds=[
        {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "kernel"} for b in builds])))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
