"""infinity.ops.all_finite: the native scan and the torch path agree, at every position."""
import pytest
import torch

import infinity._native as native
from infinity.ops import all_finite


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 65536, 200_003])
def test_all_finite_detects_each_kind_anywhere(fallback, n):
    with native.force_fallback(fallback):
        x = torch.randn(n)
        assert all_finite(x)
        for pos in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y[pos] = bad
                assert not all_finite(y), (pos, bad)
        big = torch.full((n,), 3.0e38)  # huge but finite: a sum would overflow
        assert all_finite(big)


def test_all_finite_other_dtypes_and_views():
    x = torch.randn(1000, dtype=torch.bfloat16)
    assert all_finite(x)
    x[3] = float("inf")
    assert not all_finite(x)
    y = torch.randn(100, 100)[:, ::2]  # non-contiguous: torch path
    assert all_finite(y)
    assert all_finite(torch.empty(0))
    with pytest.raises(TypeError):
        all_finite([1.0])
