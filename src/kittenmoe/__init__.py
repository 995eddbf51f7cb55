"""kittenmoe: Mixture-of-Experts layers with one persistent Triton megakernel per rank.

The API:

- ``moe(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, ...)``: one differentiable MoE layer call with
  your own routing (``kittenmoe.functional``);
- ``MoELayer(shape, ...)``: router, routed experts and shared expert as an ``nn.Module``;
- ``moe_ep(..., peers)`` with ``SymmetricPeers()``: expert parallelism, one process per rank;
- ``KernelConfig`` (the megakernel's knobs; None everywhere picks the tuned or heuristic one), ``FP8Config``
  (e4m3 experts), ``ModelShape`` / ``get_shape`` (layer shapes, the seed models among them);
- ``check_errors()`` / ``set_error_check(mode)``: device-side errors (spin-wait timeouts, expert ids out of
  range) raised as ``MegakernelError``.

Shape legend: T tokens per rank, H hidden, I expert width, S shared-expert width, E experts (global), K top-k,
R ranks, L = E // R experts per rank, N routed rows on a rank.
"""

from kittenmoe.config import KernelConfig, ModelShape, get_shape
from kittenmoe.peers import SymmetricPeers

__version__ = "0.1.0"

# The layer stack imports the Triton kernels; load it on first use so that `import kittenmoe` stays light
# and TRITON_INTERPRET may still be set after it (but before the first layer is built).
_LAZY = {
    "MoELayer": "kittenmoe.layer",
    "moe": "kittenmoe.functional",
    "moe_ep": "kittenmoe.ep",
    "FP8Config": "kittenmoe.fp8",
    "set_error_check": "kittenmoe.autograd",
    "check_errors": "kittenmoe.autograd",
    "MegakernelError": "kittenmoe.launch_common",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kittenmoe' has no attribute {name!r}")


__all__ = [
    "FP8Config",
    "KernelConfig",
    "MegakernelError",
    "MoELayer",
    "ModelShape",
    "SymmetricPeers",
    "check_errors",
    "get_shape",
    "moe",
    "moe_ep",
    "set_error_check",
]
