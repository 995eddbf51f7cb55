"""The torchrun runner: this process is one EP rank over ``SymmetricPeers``; its inputs, kittenmoe's and the
NCCL + PyTorch baseline's collective callables, their checks, and ``bench_problem_ep`` (one row per mode, the
same on every rank).

kittenmoe is timed along one of two paths (``path``): ``"public"``, ``kittenmoe.ep.moe_ep`` (the autograd
entry point users call under EP; forward+backward is that call on leaf tensors that require grad, then
``torch.autograd.grad``), or ``"launcher"``, ``ep.megakernel_forward_ep`` (and ``megakernel_backward_ep``).
The baseline (``--ep-baseline``) is ``baselines.all_to_all_forward`` (grouped_mm experts) or
``distributed.moe_forward_distributed`` (the torch backend's semantic model), same weights and routing. The
check is against the fp32 semantic model across the same processes (``moe_forward_distributed`` on fp32
copies).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from kittenmoe.bench.problems import FP8_QUANT_REPS, KIND, Problem, rel_l1_bar
from kittenmoe.bench.report import make_row
from kittenmoe.bench.runner import TimedPaths
from kittenmoe.bench.timing import measure, measure_ranks_rounds
from kittenmoe.config import KernelConfig

# --ep-baseline -> the function the rows name as their baseline
EP_BASELINES = {"all-to-all": "all_to_all_forward", "distributed": "moe_forward_distributed"}
DEFAULT_EP_BASELINE = "all-to-all"
# The fp32 reference (moe_forward_distributed) runs one GEMM per local expert over its rows (torch_backend.
# expert_rows), so block_m only sets its padding: the routed buffers are R*T*K + L*(block_m - 1) rows and each
# expert's rows are padded to a multiple of it (the padding rows are zero: they change no result beyond fp32
# GEMM rounding).
REFERENCE_BLOCK_M = 128
GRAD_NAMES = ("d_x", "d_topk_weights", "d_w13", "d_w2", "d_shared_w13", "d_shared_w2")
TIMED_CALLS = {
    ("public", "forward"): "kittenmoe.ep.moe_ep",
    ("public", "backward"): "kittenmoe.ep.moe_ep + torch.autograd.grad",
    ("launcher", "forward"): "ep.megakernel_forward_ep",
    ("launcher", "backward"): "ep.megakernel_forward_ep + ep.megakernel_backward_ep",
}


def _stream_seed(seed: int, stream: int, rank: int) -> int:
    """One generator seed per (--seed, what is drawn, rank), so that no two streams coincide."""
    return (((seed * 3 + stream) << 24) + rank) & ((1 << 63) - 1)


def _scaled_randn(size: tuple[int, ...], fan_in: int, g: torch.Generator, device, dtype) -> torch.Tensor:
    """std 1/sqrt(fan_in), as ``kittenmoe.testing.make_weights`` scales weights (outputs stay O(1))."""
    return (torch.randn(size, generator=g, device=device) / fan_in ** 0.5).to(dtype)


def gather_or_raise(group, what: str, fn: Callable[[], object]) -> list:
    """``fn()`` on every rank, its results in rank order on every rank; if it raised anywhere, every rank
    raises (so that no rank waits in a later collective for one that has stopped). Collective."""
    import torch.distributed as dist

    err, value = None, None
    try:
        value = fn()
    except Exception as e:  # re-raised below, once every rank has heard of it
        err = e
    got = [None] * dist.get_world_size(group)
    mine = (None if err is None else f"{type(err).__name__}: {err}", value)
    try:
        dist.all_gather_object(got, mine, group=group)
    except Exception as gather_err:
        if err is None:
            raise
        raise err from gather_err
    if err is not None:
        raise err
    failed = {r: m for r, (m, _) in enumerate(got) if m is not None}
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)}: "
                           + "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
    return [v for _, v in got]


def agree_config(group, config: KernelConfig) -> None:
    """Every rank must run the same KernelConfig (the tune cache is per machine); raise on every rank if not."""
    cfgs = gather_or_raise(group, "reading the config", lambda: dataclasses.asdict(config))
    if any(c != cfgs[0] for c in cfgs):
        raise ValueError(f"the ranks chose different KernelConfigs (a tune cache that differs between machines? "
                         f"pass --config or KITTENMOE_AUTOTUNE=0), in rank order: {cfgs}")


class EPRunner(TimedPaths):
    """One rank's inputs of a problem under torchrun, the timed callables and their checks.

    Each rank makes only what it holds (the whole model may not fit one process): its E_local experts from its
    own generator stream on the GPU, the replicated shared expert from a stream every rank shares, its T tokens,
    routes over all E experts and output gradient from its own."""

    def __init__(self, problem: Problem, device: torch.device, peers, group, seed: int = 0) -> None:
        self.problem, self.device, self.peers, self.group = problem, device, peers, group
        dt, rank = problem.torch_dtype, peers.rank
        T, H, I, E, K = problem.dims
        L, S = problem.experts_local, problem.shared_width
        g_experts = torch.Generator(device=device).manual_seed(_stream_seed(seed, 0, rank))
        g_shared = torch.Generator(device=device).manual_seed(_stream_seed(seed, 1, 0))
        g_tokens = torch.Generator().manual_seed(_stream_seed(seed, 2, rank))
        self.w13 = _scaled_randn((L, 2 * I, H), H, g_experts, device, dt)
        self.w2 = _scaled_randn((L, H, I), I, g_experts, device, dt)
        self.sw13 = _scaled_randn((2 * S, H), H, g_shared, device, dt) if S else None
        self.sw2 = _scaled_randn((H, S), S, g_shared, device, dt) if S else None
        self.x = torch.randn(T, H, generator=g_tokens).to(device, dt)
        ids, w = problem.routing.generate(T, E, K, g_tokens, device)
        self.ids, self.w = ids.contiguous(), w.float().contiguous()
        self.d_out = torch.randn(T, H, generator=g_tokens).to(device, dt)
        # --fp8: this rank's experts quantised once, outside the timed calls (quantize_weights times it apart)
        self.fp8 = None if problem.fp8_block is None else self.quantize_weights(check_finite=True)
        self._ref: dict | None = None

    def quantize_weights(self, check_finite: bool = False):
        """This rank's experts in e4m3 with their transposes (``FP8ExpertWeights.quantize``), as a layer
        re-quantises them every step (without the finite check, a host sync). Local: no collective."""
        from kittenmoe.fp8 import FP8ExpertWeights

        return FP8ExpertWeights.quantize(self.w13, self.w2, self.problem.fp8_config(), check_finite)

    def _weights(self) -> list[torch.Tensor | None]:
        return [self.w13, self.w2, self.sw13, self.sw2]

    # kittenmoe -------------------------------------------------------------
    def public(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        """``kittenmoe.ep.moe_ep``. The forward's inputs need no grad (no activations kept, as in inference);
        forward+backward returns (this rank's output, its gradients of x, router weights, its experts' weights
        and its tokens' share of the shared expert's)."""
        from kittenmoe.ep import moe_ep

        lim, peers, fp8 = self.problem.shape.swiglu_limit, self.peers, self.fp8
        if mode == "forward":
            return lambda: moe_ep(self.x, self.ids, self.w, *self._weights(), lim, peers, config, fp8)
        wl = [None if t is None else t.detach().requires_grad_() for t in self._weights()]
        xl, sl = self.x.detach().requires_grad_(), self.w.detach().requires_grad_()
        leaves = [xl, sl] + [t for t in wl if t is not None]

        def fwd_bwd():
            out = moe_ep(xl, self.ids, sl, *wl, lim, peers, config, fp8)
            # torch.autograd.grad, not out.backward(d_out): fresh gradients each call and nothing accumulated in
            # .grad, the cost of out.backward(d_out) with every .grad set to None before it
            return out.detach(), torch.autograd.grad(out, leaves, self.d_out)

        return fwd_bwd

    def launcher(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        from kittenmoe.ep import megakernel_backward_ep, megakernel_forward_ep

        a, fp8 = (self.x, self.ids, self.w, *self._weights(), self.problem.shape.swiglu_limit), self.fp8
        if mode == "forward":
            return lambda: megakernel_forward_ep(*a, peers=self.peers, config=config, fp8=fp8)

        def fwd_bwd():
            f = megakernel_forward_ep(*a, peers=self.peers, config=config, fp8=fp8)
            b = megakernel_backward_ep(self.d_out, *a, peers=self.peers, config=config, fp8=fp8)
            return f, b

        return fwd_bwd

    # baseline --------------------------------------------------------------
    def baseline(self, mode: str, name: str, config: KernelConfig, checked: bool) -> Callable[[], object]:
        """``--ep-baseline`` ``name``; ``checked``: compare every rank's inputs first (a host all-gather that
        all_to_all_forward can leave out of its timed calls; moe_forward_distributed always does it)."""
        from kittenmoe.baselines import all_to_all_forward
        from kittenmoe.distributed import moe_forward_distributed

        lim, group = self.problem.shape.swiglu_limit, self.group
        if name == "all-to-all":
            def fn(x, w, ws):
                return all_to_all_forward(x, self.ids, w, *ws, lim, group, check_ranks=checked)
        else:  # the torch backend's semantic model, tiled like the megakernel
            def fn(x, w, ws):
                return moe_forward_distributed(x, self.ids, w, *ws, lim, group, block_m=config.block_m)
        if mode == "forward":
            return lambda: fn(self.x, self.w, self._weights())
        wl = [None if t is None else t.detach().requires_grad_() for t in self._weights()]
        xl, sl = self.x.detach().requires_grad_(), self.w.detach().requires_grad_()
        leaves = [xl, sl] + [t for t in wl if t is not None]

        def fwd_bwd():
            out = fn(xl, sl, wl)
            return out.detach(), torch.autograd.grad(out, leaves, self.d_out)

        return fwd_bwd

    # checks ----------------------------------------------------------------
    def reference(self, grads: bool) -> dict:
        """This rank's output (and with ``grads`` its gradients) from the fp32 semantic model run across the
        same processes: ``moe_forward_distributed`` on fp32 copies of the same values. Collective."""
        from kittenmoe.distributed import moe_forward_distributed

        if self._ref is not None and (not grads or "d_x" in self._ref):
            return self._ref

        def f32(t):
            return None if t is None else t.detach().float().requires_grad_(grads)

        x, w, ws = f32(self.x), f32(self.w), [f32(t) for t in self._weights()]
        with torch.set_grad_enabled(grads):
            out = moe_forward_distributed(x, self.ids, w, *ws, self.problem.shape.swiglu_limit, self.group,
                                          block_m=REFERENCE_BLOCK_M)
        ref = {"out": out.detach()}
        if grads:
            named = [(n, t) for n, t in zip(GRAD_NAMES, [x, w, *ws]) if t is not None]
            gs = torch.autograd.grad(out, [t for _, t in named], self.d_out.float())
            ref.update({n: g for (n, _), g in zip(named, gs)})
        self._ref = ref
        return ref

    def check_kittenmoe(self, mode: str, result, path: str) -> dict:
        """This rank's device error flags, then the relative L1 of its output (and gradients) vs the reference;
        keys carry the rank (``d_w13[r]``: rank r's experts; ``d_shared_w13[r]``: rank r's tokens' share)."""
        from kittenmoe.testing import rel_l1

        r, ref = self.peers.rank, self._ref
        if path == "public":
            from kittenmoe.autograd import check_errors

            check_errors(self.device)  # the flags moe_ep deferred
            out = result if mode == "forward" else result[0]
            grads = {} if mode == "forward" else dict(zip([n for n in GRAD_NAMES if n in ref], result[1]))
        elif path == "launcher":
            fwd = result if mode == "forward" else result[0]
            fwd.check_errors()
            out, grads = fwd.output, {}
            if mode != "forward":
                result[1].check_errors()
                grads = {n: getattr(result[1], n) for n in GRAD_NAMES if n in ref}
        else:
            raise ValueError(f"path must be 'public' or 'launcher', got {path!r}")
        errs = {f"out[{r}]": rel_l1(out, ref["out"])}
        for name, g in grads.items():
            errs[f"{name}[{r}]"] = rel_l1(g, ref[name])
        return errs

    def check_baseline(self, mode: str, result) -> float:
        from kittenmoe.testing import rel_l1

        return rel_l1(result if mode == "forward" else result[0], self._ref["out"])


def bench_problem_ep(problem: Problem, config: KernelConfig, modes: list[str], device: torch.device, peers,
                     group, baseline: str, reps: int, warmup: int, seed: int = 0,
                     log: Callable[[str], None] = print, path: str = "public") -> list[dict]:
    """Time kittenmoe.ep along ``path`` and the EP baseline for each mode, every rank one process; the same rows
    on every rank (errors gathered from all of them). Collective."""
    run = EPRunner(problem, device, peers, group, seed)
    rows = _bench_modes_ep(run, config, modes, baseline, reps, warmup, log, path)
    del run  # the inputs and the callables holding them go before empty_cache
    torch.cuda.empty_cache()
    return rows


def _bench_modes_ep(run: EPRunner, config: KernelConfig, modes: list[str], baseline: str, reps: int, warmup: int,
                    log: Callable[[str], None], path: str) -> list[dict]:
    """The rows of ``bench_problem_ep``: per mode, reference, first call and check, then the timings."""
    problem, device, group = run.problem, run.device, run.group
    tol = rel_l1_bar(problem, device)
    run.reference(grads="backward" in modes)  # before any kittenmoe call: collective, so every rank gets here
    ms_quant = None
    if run.fp8 is not None:  # once per problem, each rank its own experts; the slowest rank's p50
        ms_quant = max(gather_or_raise(group, "timing the FP8 weight quantisation", lambda: measure(
            run.quantize_weights, device, min(reps, FP8_QUANT_REPS), min(warmup, 2)).p50))
    rows = []
    for mode in modes:
        k_fn = run.kittenmoe(mode, config, path)

        def first_kittenmoe():
            t0 = time.perf_counter()
            errs = run.check_kittenmoe(mode, k_fn(), path)  # first run: compile, error flags, accuracy
            return errs, time.perf_counter() - t0

        got = gather_or_raise(group, f"kittenmoe.ep {KIND[mode]} (first call and check)", first_kittenmoe)
        errs = {k: v for e, _ in got for k, v in e.items()}
        first_s = max(s for _, s in got)
        worst = max(errs.values())
        if not worst <= tol:
            log(f"WARNING: {problem.label} {KIND[mode]}: relative L1 {worst:.2e} vs the fp32 reference exceeds "
                f"{tol:.0e}")
        b_first = run.baseline(mode, baseline, config, checked=True)
        base_err = max(gather_or_raise(group, f"the {EP_BASELINES[baseline]} baseline (first call and check)",
                                       lambda: run.check_baseline(mode, b_first())))
        # both timed together in interleaved rounds: the GPUs' clocks fall under sustained load (power caps)
        timed = measure_ranks_rounds({"kittenmoe": k_fn,
                                      "baseline": run.baseline(mode, baseline, config, checked=False)},
                                     device, group, reps, warmup)
        rows.append(make_row(
            problem, mode, path=path, timed_call=TIMED_CALLS[path, mode], ranks_mode="processes",
            kittenmoe=timed["kittenmoe"], baseline=EP_BASELINES[baseline], baseline_timing=timed["baseline"],
            errs=errs, tolerance=tol, baseline_rel_l1=base_err, first_call_s=first_s, reps=reps, warmup=warmup,
            ms_fp8_weight_quantisation=ms_quant, config=config,
            timing="interleaved with the baseline in rounds (kittenmoe.bench.timing.measure_ranks_rounds)"))
    return rows
