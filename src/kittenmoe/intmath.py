"""Integer helpers for host code (grids, tile counts, block widths).

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects (Triton 3.6, 3.9): called from
the host each unwraps its arguments through the code generator's path, 2-3.4 us a call against ~0.03 us for the
arithmetic (CPU core, Triton 3.6 and 3.9). A forward+backward through ``kittenmoe.moe`` made ~30 such calls.
Kernels keep calling ``tl.cdiv`` / ``triton.next_power_of_2`` on constexprs; these are for launchers.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints, y > 0."""
    return -(-x // y)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, as ``triton.next_power_of_2`` (0 for n = 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
