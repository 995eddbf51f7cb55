"""The single-process runner: one problem's inputs on one device, kittenmoe's and the baselines' timed callables
(grouped_mm, and those ``--baseline`` adds: ``sonicmoe``), their checks against the fp32 reference, and
``bench_problem`` (one row per mode).

kittenmoe is timed along one of two paths (``path``):

- ``"public"`` (one rank only): ``kittenmoe.moe(..., backend="megakernel")``, the autograd entry point users
  call (input checks, the custom op, the deferred device-error flags included); forward+backward is that call
  on leaf tensors that require grad, then ``torch.autograd.grad``.
- ``"launcher"``: ``launch_forward.megakernel_forward_multirank`` (and ``megakernel_backward_multirank``) over R virtual
  ranks in ``LocalPeers``: the megakernels without the autograd layer. The only path for R > 1 in one process
  (the public API runs one rank per call; several ranks need ``kittenmoe.ep`` and torchrun), and what
  ``kittenmoe tune`` sweeps.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable, Mapping

import torch

from kittenmoe.bench.baselines import unsupported
from kittenmoe.bench.problems import FP8_QUANT_REPS, KIND, Problem, rel_l1_bar
from kittenmoe.bench.report import BaselineResult, make_row
from kittenmoe.bench.timing import measure, measure_rounds
from kittenmoe.config import KernelConfig

GRAD_NAMES = ("d_w13", "d_w2", "d_shared_w13", "d_shared_w2")


class TimedPaths:
    """What both runners (one process, and one rank under torchrun) share: ``kittenmoe(mode, config, path)``
    picks the subclass's ``public`` (the autograd entry users call) or ``launcher`` callable."""

    def kittenmoe(self, mode: str, config: KernelConfig, path: str) -> Callable[[], object]:
        """kittenmoe's callable for ``mode`` along ``path`` (``"public"`` or ``"launcher"``)."""
        if path == "public":
            return self.public(mode, config)
        if path == "launcher":
            return self.launcher(mode, config)
        raise ValueError(f"path must be 'public' or 'launcher', got {path!r}")


class Runner(TimedPaths):
    """Inputs of one problem on one device, the timed callables, and their correctness checks."""

    def __init__(self, problem: Problem, device: torch.device, seed: int = 0) -> None:
        from kittenmoe.peers import LocalPeers
        from kittenmoe.testing import make_weights

        self.problem, self.device = problem, device
        p, dt = problem, problem.torch_dtype
        R, (T, H, _, E, K) = p.ranks, p.dims
        g = torch.Generator().manual_seed(seed)
        self.w = make_weights(p.shape, dtype=dt, device=device, generator=g)
        self.xs = [torch.randn(T, H, generator=g).to(device, dt) for _ in range(R)]
        routes = [p.routing.generate(T, E, K, g, device) for _ in range(R)]
        self.ids = [r[0].contiguous() for r in routes]
        self.ws = [r[1].float().contiguous() for r in routes]
        self.d_out = [torch.randn(T, H, generator=g).to(device, dt) for _ in range(R)]
        self.peers = LocalPeers(R, device)
        # --fp8: all experts quantised once, outside the timed calls (quantize_weights times it apart)
        self.fp8 = None if p.fp8_block is None else self.quantize_weights(check_finite=True)
        # fp32 references, keyed by whether they include the shared expert (False: the routed part only)
        self._ref_fwd: dict[bool, list[torch.Tensor]] = {}
        self._ref_grads: dict[bool, dict] = {}
        self._sonic_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize_weights(self, check_finite: bool = False):
        """The routed experts in e4m3 with their transposes (``FP8ExpertWeights.quantize``), as a layer
        re-quantises them every step (without the finite check, a host sync)."""
        from kittenmoe.fp8 import FP8ExpertWeights

        return FP8ExpertWeights.quantize(self.w.w13_E2IH, self.w.w2_EHI, self.problem.fp8_config(), check_finite)

    # kittenmoe -------------------------------------------------------------
    def public(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        """``kittenmoe.moe(..., backend="megakernel")`` on rank 0's inputs (one rank only). The forward's inputs
        need no grad (the op then keeps no activations, as in inference); forward+backward returns (output,
        gradients of x, router weights and every expert weight)."""
        import kittenmoe

        if self.problem.ranks != 1:
            raise ValueError(f"the public path runs one rank (kittenmoe.moe); this problem has "
                             f"{self.problem.ranks} virtual ranks: time it with path 'launcher'")
        w = self.w
        # --fp8: the experts quantised once (self.fp8), as for the launcher path; the quantisation is timed apart
        kw = dict(swiglu_limit=self.problem.shape.swiglu_limit, backend="megakernel", config=config, fp8=self.fp8)
        x, ids, tw = self.xs[0], self.ids[0], self.ws[0]
        if mode == "forward":
            return lambda: kittenmoe.moe(x, ids, tw, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS, **kw)
        xl, twl = x.detach().requires_grad_(), tw.detach().requires_grad_()
        wl = [None if t is None else t.detach().requires_grad_()
              for t in (w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS)]
        leaves = [xl, twl] + [t for t in wl if t is not None]
        d_out = self.d_out[0]

        def fwd_bwd():
            out = kittenmoe.moe(xl, ids, twl, *wl, **kw)
            # torch.autograd.grad, not out.backward(d_out): each call's gradients come back as fresh tensors and
            # no .grad accumulates across the timed calls, which is the cost of out.backward(d_out) with every
            # .grad set to None before it (no accumulating add)
            return out.detach(), torch.autograd.grad(out, leaves, d_out)

        return fwd_bwd

    def launcher(self, mode: str, config: KernelConfig) -> Callable[[], object]:
        """The forward (and backward) launchers over ``self.peers``' R virtual ranks."""
        from kittenmoe.launch_backward import megakernel_backward_multirank
        from kittenmoe.launch_forward import megakernel_forward_multirank

        a, fp8 = self._margs(), self.fp8
        if mode == "forward":
            return lambda: megakernel_forward_multirank(*a, config=config, peers=self.peers, fp8=fp8)

        def fwd_bwd():
            # as autograd runs them: the forward keeps its activations for the backward (keep_activations)
            f = megakernel_forward_multirank(*a, config=config, peers=self.peers,
                                             save_for_backward=config.keep_activations, fp8=fp8)
            b = megakernel_backward_multirank(self.d_out, *a, config=config, peers=self.peers, saved=f.saved(),
                                              fp8=fp8)
            return f, b

        return fwd_bwd

    def _margs(self):
        w = self.w
        return (self.xs, self.ids, self.ws, w.w13_E2IH, w.w2_EHI, w.shared_w13_2SH, w.shared_w2_HS,
                self.problem.shape.swiglu_limit)

    # baseline --------------------------------------------------------------
    def grouped_mm(self, mode: str) -> Callable[[], object]:
        from kittenmoe.baselines import grouped_mm_forward

        w, lim, R = self.w, self.problem.shape.swiglu_limit, self.problem.ranks
        if mode == "forward":
            return lambda: [grouped_mm_forward(self.xs[r], self.ids[r], self.ws[r], w.w13_E2IH, w.w2_EHI,
                                               w.shared_w13_2SH, w.shared_w2_HS, lim) for r in range(R)]
        wl = [t.detach().requires_grad_() for t in w.tensors()]
        xl = [x.detach().requires_grad_() for x in self.xs]
        sl = [v.detach().requires_grad_() for v in self.ws]
        sw13, sw2 = (wl[2], wl[3]) if len(wl) == 4 else (None, None)

        def fwd_bwd():
            outs = []
            for r in range(R):
                out = grouped_mm_forward(xl[r], self.ids[r], sl[r], wl[0], wl[1], sw13, sw2, lim)
                outs.append((out.detach(), torch.autograd.grad(out, [xl[r], sl[r]] + wl, self.d_out[r])))
            return outs

        return fwd_bwd

    def sonicmoe(self, mode: str) -> Callable[[], object]:
        """SonicMoE's routed experts (``baselines_sonic.sonicmoe_forward``; no shared expert) on every rank's
        inputs, the weights converted to its layout once here (``sonicmoe_prepare``), outside the timed calls.
        Forward+backward returns per rank (output, gradients of x, router weights, interleaved w13, w2)."""
        from kittenmoe.baselines_sonic import sonicmoe_forward, sonicmoe_prepare

        if self._sonic_weights is None:
            self._sonic_weights = sonicmoe_prepare(self.w.w13_E2IH, self.w.w2_EHI)
        w13i, w2 = self._sonic_weights
        lim, R = self.problem.shape.swiglu_limit, self.problem.ranks
        if mode == "forward":
            return lambda: [sonicmoe_forward(self.xs[r], self.ids[r], self.ws[r], w13i, w2, lim) for r in range(R)]
        wl = [w13i.detach().requires_grad_(), w2.detach().requires_grad_()]
        xl = [x.detach().requires_grad_() for x in self.xs]
        sl = [v.detach().requires_grad_() for v in self.ws]

        def fwd_bwd():
            outs = []
            for r in range(R):
                out = sonicmoe_forward(xl[r], self.ids[r], sl[r], wl[0], wl[1], lim)
                outs.append((out.detach(), torch.autograd.grad(out, [xl[r], sl[r]] + wl, self.d_out[r])))
            return outs

        return fwd_bwd

    # checks ----------------------------------------------------------------
    def _with_shared(self, shared: bool) -> bool:
        """Whether a reference ``shared`` asks for differs from the routed-only one: a shared expert exists."""
        return shared and self.w.shared_w13_2SH is not None

    def reference_forward(self, shared: bool = True) -> list[torch.Tensor]:
        """fp32 reference outputs per rank; ``shared`` False: the routed experts only."""
        from kittenmoe.reference import moe_reference_multirank

        key = self._with_shared(shared)
        if key not in self._ref_fwd:
            x, ids, tw, w13, w2, sw13, sw2, lim = self._margs()
            if not key:
                sw13 = sw2 = None
            with torch.no_grad():
                self._ref_fwd[key] = moe_reference_multirank(x, ids, tw, w13, w2, sw13, sw2, lim,
                                                             compute_dtype=torch.float32)
        return self._ref_fwd[key]

    def reference_grads(self, shared: bool = True) -> dict:
        """fp32 reference gradients: d_x and d_topk_weights per rank, then the (summed) weight gradients;
        ``shared`` False: of the routed experts only (no shared-expert gradients)."""
        from kittenmoe.reference import moe_reference_multirank

        key = self._with_shared(shared)
        if key not in self._ref_grads:
            R = self.problem.ranks
            xl = [x.float().requires_grad_() for x in self.xs]
            sl = [v.float().requires_grad_() for v in self.ws]
            wl = [t.float().requires_grad_() for t in self.w.tensors()[:4 if key else 2]]
            outs = moe_reference_multirank(xl, self.ids, sl, *wl, *([None] * (4 - len(wl))),
                                           self.problem.shape.swiglu_limit, compute_dtype=torch.float32)
            grads = torch.autograd.grad(outs, xl + sl + wl, [g.float() for g in self.d_out])
            self._ref_grads[key] = dict(d_x=list(grads[:R]), d_topk_weights=list(grads[R:2 * R]),
                                        **dict(zip(GRAD_NAMES[:len(wl)], grads[2 * R:])))
            if key not in self._ref_fwd:
                self._ref_fwd[key] = [o.detach() for o in outs]
        return self._ref_grads[key]

    def check_kittenmoe(self, mode: str, result, path: str) -> dict:
        """Device error flags, then the relative L1 of every output (and gradient) vs the fp32 reference, keyed
        ``out[r]``, ``d_x[r]``, ``d_topk_weights[r]``, ``d_w13``, ... for either path."""
        if path == "public":
            return self._check_public(mode, result)
        if path == "launcher":
            return self._check_launcher(mode, result)
        raise ValueError(f"path must be 'public' or 'launcher', got {path!r}")

    def _check_launcher(self, mode: str, result) -> dict:
        from kittenmoe.testing import rel_l1

        fwd = result if mode == "forward" else result[0]
        fwd.check_errors()
        errs = {}
        if mode != "forward":
            bwd = result[1]
            bwd.check_errors()
            ref = self.reference_grads()
            for r in range(self.problem.ranks):
                errs[f"d_x[{r}]"] = rel_l1(bwd.d_x[r], ref["d_x"][r])
                errs[f"d_topk_weights[{r}]"] = rel_l1(bwd.d_topk_weights[r], ref["d_topk_weights"][r])
            for name in GRAD_NAMES:
                if name in ref:
                    errs[name] = rel_l1(getattr(bwd, name), ref[name])
        ref_out = self.reference_forward()
        for r in range(self.problem.ranks):
            errs[f"out[{r}]"] = rel_l1(fwd.outputs[r], ref_out[r])
        return errs

    def _check_public(self, mode: str, result) -> dict:
        from kittenmoe.autograd import check_errors
        from kittenmoe.testing import rel_l1

        check_errors(self.device)  # the flags the op deferred (on CUDA; on CPU each call raised already)
        out = result if mode == "forward" else result[0]
        errs = {}
        if mode != "forward":
            ref = self.reference_grads()
            d_x, d_tw, *d_ws = result[1]
            errs["d_x[0]"] = rel_l1(d_x, ref["d_x"][0])
            errs["d_topk_weights[0]"] = rel_l1(d_tw, ref["d_topk_weights"][0])
            for name, g in zip(GRAD_NAMES, d_ws):
                errs[name] = rel_l1(g, ref[name])
        errs["out[0]"] = rel_l1(out, self.reference_forward()[0])
        return errs

    def check_sonicmoe(self, mode: str, result) -> dict:
        """Relative L1 of SonicMoE's outputs (and, for forward+backward, every gradient: the interleaved w13's
        converted back to our gate-then-up rows) vs the routed-only fp32 reference, keyed as kittenmoe's."""
        from kittenmoe.baselines_sonic import deinterleave_gate_up
        from kittenmoe.testing import rel_l1

        outs = result if mode == "forward" else [o for o, _ in result]
        errs = {f"out[{r}]": rel_l1(o, ref) for r, (o, ref) in enumerate(zip(outs, self.reference_forward(False)))}
        if mode != "forward":
            ref = self.reference_grads(False)
            for r, (_, (d_x, d_tw, _, _)) in enumerate(result):
                errs[f"d_x[{r}]"] = rel_l1(d_x, ref["d_x"][r])
                errs[f"d_topk_weights[{r}]"] = rel_l1(d_tw, ref["d_topk_weights"][r])
            d_w13 = deinterleave_gate_up(sum(g[2].float() for _, g in result))
            errs["d_w13"] = rel_l1(d_w13, ref["d_w13"])
            errs["d_w2"] = rel_l1(sum(g[3].float() for _, g in result), ref["d_w2"])
        return errs

    def check_grouped_mm(self, mode: str, result) -> float:
        from kittenmoe.testing import rel_l1

        ref = self.reference_forward()
        outs = result if mode == "forward" else [o for o, _ in result]
        return max(rel_l1(o, r) for o, r in zip(outs, ref))

    def tolerance(self) -> float:
        return rel_l1_bar(self.problem, self.device)


TIMED_CALLS = {
    ("public", "forward"): "kittenmoe.moe(backend='megakernel')",
    ("public", "backward"): "kittenmoe.moe(backend='megakernel') + torch.autograd.grad",
    ("launcher", "forward"): "launch_forward.megakernel_forward_multirank",
    ("launcher", "backward"): "launch_forward.megakernel_forward_multirank + launch_backward.megakernel_backward_multirank",
}


def bench_problem(problem: Problem, config: KernelConfig, modes: list[str], device: torch.device, reps: int,
                  warmup: int, seed: int = 0, log: Callable[[str], None] = print, path: str = "public",
                  extras: Mapping[str, str | None] | None = None) -> list[dict]:
    """Time kittenmoe along ``path`` and grouped_mm for each mode; one row dict per mode (without environment
    stamps).

    ``extras`` (``--baseline``): each further baseline to time in the same rounds, mapped to None, or to why it
    does not run in this process (``"skipped: ..."``, from ``bench.baselines.unavailable``). One that does not
    run this problem (``bench.baselines.unsupported``) is skipped with a line in ``log``; one whose first call
    raises is reported (the traceback in ``log``, the reason in the rows) and left out of the timing, so the
    other providers' figures stand."""
    extras = dict(extras or {})
    for name, note in list(extras.items()):
        why = None if note is not None else unsupported(name, problem, device)
        if why is not None:
            extras[name] = f"skipped: {why}"
            log(f"{name} skipped for {problem.label}: {why}")
    # kittenmoe computes what the extra baselines do (the routed experts, in the dtype) only without a shared
    # expert and without FP8
    same_work = problem.shared_width == 0 and problem.fp8_block is None
    if extras and not same_work:
        diff = [d for d, on in ((f"also computes the shared expert (S={problem.shared_width})", problem.shared_width),
                                (f"runs the routed experts in {problem.precision}", problem.fp8_block)) if on]
        log(f"note: {', '.join(extras)}: the routed experts only, in {problem.dtype}; kittenmoe here "
            f"{' and '.join(diff)}, so the two times are of different work (--no-shared without --fp8 times the same)")
    run = Runner(problem, device, seed)
    tol = run.tolerance()
    ms_quant = None
    if run.fp8 is not None:  # once per problem: what re-quantising the expert weights adds to a training step
        ms_quant = measure(run.quantize_weights, device, min(reps, FP8_QUANT_REPS), min(warmup, 2)).p50
    rows = []
    for mode in modes:
        k_fn, b_fn = run.kittenmoe(mode, config, path), run.grouped_mm(mode)
        t0 = time.perf_counter()
        errs = run.check_kittenmoe(mode, k_fn(), path)  # first run: compile, error flags, accuracy
        first_s = time.perf_counter() - t0
        worst = max(errs.values())
        # a line per step, so that a run stopped by a time limit shows how far it got
        log(f"  {KIND[mode]}: kittenmoe's first call and check against the fp32 reference {first_s:.1f} s, "
            f"relative L1 {worst:.1e}")
        if not worst <= tol:
            log(f"WARNING: {problem.label} {KIND[mode]}: relative L1 {worst:.2e} vs the fp32 reference exceeds "
                f"{tol:.0e}")
        base_err = run.check_grouped_mm(mode, b_fn())
        fns = {"kittenmoe": k_fn, "grouped_mm": b_fn}
        results: dict[str, BaselineResult] = {}
        for name, note in extras.items():
            if note is not None:
                results[name] = BaselineResult(name, note=note, same_work=same_work)
                continue
            fn, results[name] = _first_call(run, name, mode, tol, same_work, log)
            if fn is not None:
                fns[name] = fn
                log(f"  {KIND[mode]}: {name}'s first call and check {results[name].first_call_s:.1f} s")
        log(f"  {KIND[mode]}: timing {', '.join(fns)} in interleaved rounds")
        # an extra baseline that raises in a timed round is dropped from the rounds and reported; kittenmoe and
        # grouped_mm raising there stop the run, as without extra baselines
        errors: dict[str, str] = {}
        timed = measure_rounds(fns, device, reps, warmup, errors=errors if len(fns) > 2 else None)
        for name, err in errors.items():
            if name in ("kittenmoe", "grouped_mm"):
                raise RuntimeError(f"{problem.label} {KIND[mode]}: {name} raised while timed: {err}")
            log(f"{name} failed while timed ({problem.label} {KIND[mode]}): {err}")
            results[name] = dataclasses.replace(results[name], note=f"failed while timed: {err}")
        for name in results:
            if name in timed:
                results[name] = dataclasses.replace(results[name], timing=timed[name])
        rows.append(make_row(
            problem, mode, path=path, timed_call=TIMED_CALLS[path, mode], ranks_mode="virtual",
            kittenmoe=timed["kittenmoe"], baseline="grouped_mm", baseline_timing=timed["grouped_mm"], errs=errs,
            tolerance=tol, baseline_rel_l1=base_err, first_call_s=first_s, reps=reps, warmup=warmup,
            ms_fp8_weight_quantisation=ms_quant, config=config, extra_baselines=tuple(results.values()),
            timing="interleaved with the baselines in rounds (kittenmoe.bench.timing.measure_rounds)"))
    del run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _first_call(run: Runner, name: str, mode: str, tol: float, same_work: bool,
                log: Callable[[str], None]) -> tuple[Callable[[], object] | None, BaselineResult]:
    """Extra baseline ``name``'s timed callable (``Runner.<name>``) and its first call (compile, accuracy vs
    the fp32 reference of the same math, ``Runner.check_<name>``). When that raises, the traceback goes to
    ``log``, the callable is None and the result's note says why."""
    t0 = time.perf_counter()
    try:
        fn = getattr(run, name)(mode)
        errs = getattr(run, f"check_{name}")(mode, fn())
    except Exception as e:  # reported in the log and the rows; kittenmoe's and grouped_mm's figures stand
        log(f"{name} failed on its first call ({run.problem.label} {KIND[mode]}):\n{traceback.format_exc()}")
        first_line = (str(e).strip().splitlines() or [""])[0]
        return None, BaselineResult(name, note=f"failed: {type(e).__name__}: {first_line}", same_work=same_work)
    first_s = time.perf_counter() - t0
    worst = max(errs.values())
    if not worst <= tol:
        log(f"WARNING: {run.problem.label} {KIND[mode]}: {name}'s relative L1 {worst:.2e} vs the fp32 reference "
            f"of the same math exceeds {tol:.0e} ({', '.join(f'{k} {v:.1e}' for k, v in errs.items())})")
    return fn, BaselineResult(name, errs=errs, first_call_s=first_s, same_work=same_work)
