"""kittenmoe: Mixture-of-Experts layers with one persistent Triton megakernel per rank.

Shape legend: T tokens per rank, H hidden, I expert width, S shared-expert
width, E experts (global), K top-k, R ranks, L = E // R experts per rank,
N routed rows on a rank, C the routed-row capacity.
"""

from kittenmoe.config import SEED_SHAPES, SHAPES, TEST_SHAPES, KernelConfig, ModelShape, get_shape
from kittenmoe.peers import LocalPeers
from kittenmoe.schedule import Schedule, build_schedule

__version__ = "0.1.0"

__all__ = [
    "KernelConfig",
    "LocalPeers",
    "ModelShape",
    "Schedule",
    "SEED_SHAPES",
    "SHAPES",
    "TEST_SHAPES",
    "build_schedule",
    "get_shape",
]
