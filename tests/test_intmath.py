"""The launchers' integer helpers give Triton's answers (they replace ``triton.cdiv`` / ``next_power_of_2``
in host code, where those cost microseconds a call)."""

import pytest
import triton

from kittenmoe.intmath import cdiv, next_pow2

# every small value, powers of two and their neighbours, and values past int32 (route and row counts)
VALUES = list(range(0, 1100)) + [2**k + d for k in range(10, 41) for d in (-1, 0, 1)]


def test_next_pow2_matches_triton():
    assert [next_pow2(n) for n in VALUES] == [triton.next_power_of_2(n) for n in VALUES]


@pytest.mark.parametrize("y", [1, 3, 16, 64, 128, 1000])  # unit, odd, and the tile widths the launchers divide by
def test_cdiv_matches_triton(y):
    assert [cdiv(n, y) for n in VALUES] == [triton.cdiv(n, y) for n in VALUES]
