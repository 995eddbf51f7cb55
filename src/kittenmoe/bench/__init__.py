"""``kittenmoe bench``: time the megakernel layer against the PyTorch grouped_mm baseline, same run.

    kittenmoe bench --model kimi-k2.7 --ep 8 --tokens 2048 --mode both
    kittenmoe bench --shape 4096,7168,2048,48,8 --routing zipf:1.2 --ranks 2 --plot bench.png
    torchrun --nproc-per-node 8 -m kittenmoe.cli bench --model kimi-k2.7 --ep 8 --mode both

Modules, one job each: ``problems`` (the problem, ``--config`` overrides, FLOPs, accuracy bar), ``environment``
(device and stamps), ``timing`` (latency, interleaved rounds, across ranks), ``runner`` (one process),
``launch`` (torchrun ranks, GPU, process group), ``ep_runner`` (one torchrun rank), ``report`` (rows, table,
JSON, plot), ``main`` (arguments and ``run_bench``). ``kittenmoe tune`` builds on ``problems``, ``timing`` and
``runner``; nothing here imports the tuner.

Problem: ``--model NAME`` slices a registered shape to one EP rank (E_local = E / ep experts; default ep 8),
``--shape T,H,I,E,K`` gives the dimensions directly (default ep 1). With ``--ranks R`` (default 1) R virtual
ranks run on one device through ``LocalPeers``, each holding E_local experts, so the problem has R * E_local
experts in total and each rank's T tokens are routed over all of them; the timed call runs every rank (the
slowest rank's latency does not exist apart from the sum there), and the baseline runs once per rank, its times
summed. With R = 1 every route lands on the one rank.

What kittenmoe's time covers (``--path``, recorded in each row's ``"path"``): ``public`` (the default), the
autograd entry point users call, ``kittenmoe.moe(..., backend="megakernel", config=cfg, fp8=...)`` for one rank,
its forward+backward that call on leaf tensors that require grad (x, router weights, every expert weight)
followed by ``torch.autograd.grad(out, leaves, d_out)``; under torchrun ``kittenmoe.ep.moe_ep``. ``launcher``:
the megakernel launchers without the autograd layer (``launch_forward.megakernel_forward_multirank`` /
``megakernel_backward_multirank``; under torchrun ``ep.megakernel_forward_ep`` / ``megakernel_backward_ep``).
R > 1 virtual ranks in one process run only the launchers (the public API is one rank per call): the default
there is ``launcher`` and ``--path public`` is an error.

Method on CUDA: the first call of each provider compiles and is checked (the megakernel's device error flags,
relative L1 of the output and, for forward+backward, every gradient against the fp32 reference in
``kittenmoe.reference``); then kittenmoe and the baseline are timed together in interleaved rounds
(``timing.measure_rounds``: each round ``triton.testing.do_bench`` of each, CUDA events, L2 flushed between runs,
in rotated order; about ``--warmup`` warm-up and ``--reps`` timed runs each over all rounds), reporting the
medians over rounds of p20 / p50 / p80: the GPU's clock falls under its power cap during sustained runs, which
would favour whichever provider ran first. Schedule construction, the routing all-gather and the epilogue are
inside the timed call. ``backward`` times forward and backward together against grouped_mm forward + autograd
backward.

More baselines (``--baseline grouped_mm,sonicmoe``; ``bench.baselines``): grouped_mm is always timed and stays the
rows' ``baseline`` and ``speedup``; ``sonicmoe`` (SonicMoE's ``moe_general_routing_inputs`` through
``kittenmoe.baselines_sonic``; bf16, CUDA, the routed experts only) is timed in the same rounds and checked against
the routed-only fp32 reference (output and, for forward+backward, every gradient), adding ``ms_sonicmoe``,
``speedup_vs_sonicmoe`` and ``rel_l1_sonicmoe`` to the rows; when it is not importable, or cannot run a problem,
it is skipped with a line saying why. ``--no-shared`` drops the shared expert (width 0, labels ``-S0``), so that
kittenmoe computes the same as SonicMoE, which has none (the rows' ``sonicmoe_same_work``).

On CPU the megakernel runs only under the Triton interpreter (``TRITON_INTERPRET=1``); this is for tests: times
are ``time.perf_counter`` medians of a few runs and rows carry ``"device": "cpu-interpreter"`` and ``"gpu":
"cpu"`` so nobody mistakes them for GPU figures.

Real ranks: under ``torchrun --nproc-per-node R -m kittenmoe.cli bench ...`` (WORLD_SIZE set, or a process
group the caller initialised) each process is one rank holding E_local experts and its own T tokens routed over
all R * E_local: kittenmoe is ``kittenmoe.ep`` over ``SymmetricPeers``, the baseline NCCL + PyTorch under EP
(``--ep-baseline``: ``all-to-all``, ``baselines.all_to_all_forward``, the default; or ``distributed``,
``distributed.moe_forward_distributed``), same weights and routing. Each iteration starts after an L2 flush and
a barrier; its latency is the slowest rank's (CUDA events, all-reduce MAX); kittenmoe and the baseline run in
interleaved rounds (``timing.measure_ranks_rounds``), p20 / p50 / p80 the medians over rounds of each round's,
about ``--reps`` iterations each in all. The check is against the fp32 semantic model across the same processes
(``moe_forward_distributed`` on fp32 copies). ``--ranks``, if given, must equal the world size; CUDA only (no
CPU symmetric memory). One GPU per rank (``LOCAL_RANK``, NCCL group), or every rank on cuda:0 with
``KITTENMOE_EP_SHARE_GPU=1`` (gloo group; times then test the tool, they are not EP figures). TFLOP/s there are
the whole world's. Only rank 0 prints and writes; rows carry ``"ranks_mode": "processes"`` (``"virtual"``
otherwise).

FP8 (``--fp8 128``, DeepSeek-V3's 1 x 128 / 128 x 128 block scales; ``--fp8 32``, MXFP8's 32-blocks with
power-of-two scales): kittenmoe runs the routed experts in e4m3 (``kittenmoe.fp8``; bf16 inputs and outputs,
``--dtype bf16`` only; H and I multiples of the scale block; ``block_n`` the FP8 tile width unless ``--config``
says otherwise) against the same BF16 baseline, so the speedup is FP8 kittenmoe over BF16 grouped_mm (or NCCL +
PyTorch); rows say ``"precision": "fp8-e4m3/128"`` and ``"baseline_precision": "bf16"``. The expert weights are
quantised once per problem, outside the timed calls (both paths get the ``FP8ExpertWeights``); that
quantisation's own time (what a training step adds, re-quantising its weights) is in
``ms_fp8_weight_quantisation``. The accuracy bar is then FP8's (``kittenmoe.testing.tolerance_for("fp8")``),
against the same fp32 reference of the unquantised weights.

Output: a table on the terminal, one JSON file of rows (``bench-<date>.json`` in ``--out``, the fields
``scripts/perf_table.py`` reads plus more), and optionally a PNG plot (needs matplotlib).

The names below are re-exported for scripts that import them from ``kittenmoe.bench``; their homes are the
modules named.
"""

from kittenmoe.bench.environment import environment, resolve_device
from kittenmoe.bench.main import add_bench_args, add_problem_args, run_bench
from kittenmoe.bench.problems import apply_overrides, make_problems, parse_config_overrides, parse_problem
from kittenmoe.bench.report import format_table
from kittenmoe.bench.timing import Timing, interleaved_order, measure, measure_interleaved, measure_rounds

__all__ = [
    "Timing",
    "add_bench_args",
    "add_problem_args",
    "apply_overrides",
    "environment",
    "format_table",
    "interleaved_order",
    "make_problems",
    "measure",
    "measure_interleaved",
    "measure_rounds",
    "parse_config_overrides",
    "parse_problem",
    "resolve_device",
    "run_bench",
]
