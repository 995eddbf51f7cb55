"""kittenmoe: Mixture-of-Experts layers with one persistent Triton megakernel per rank.

Shape legend: T tokens per rank, H hidden, I expert width, S shared-expert
width, E experts (global), K top-k, R ranks, L = E // R experts per rank,
N routed rows on a rank, C the routed-row capacity.
"""

from kittenmoe.config import SEED_SHAPES, SHAPES, TEST_SHAPES, KernelConfig, ModelShape, get_shape
from kittenmoe.peers import LocalPeers, SymmetricPeers
from kittenmoe.schedule import Schedule, build_schedule

__version__ = "0.1.0"

# The layer stack imports the Triton kernels; load it on first use so that `import kittenmoe` stays light
# and TRITON_INTERPRET may still be set after it (but before the first layer is built).
_LAZY = {
    "MoELayer": "kittenmoe.layer",
    "moe": "kittenmoe.functional",
    "set_error_check": "kittenmoe.autograd",
    "check_errors": "kittenmoe.autograd",
    "moe_ep": "kittenmoe.ep",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kittenmoe' has no attribute {name!r}")


__all__ = [
    "KernelConfig",
    "LocalPeers",
    "MoELayer",
    "ModelShape",
    "Schedule",
    "SEED_SHAPES",
    "SymmetricPeers",
    "SHAPES",
    "TEST_SHAPES",
    "build_schedule",
    "check_errors",
    "get_shape",
    "moe",
    "moe_ep",
    "set_error_check",
]
