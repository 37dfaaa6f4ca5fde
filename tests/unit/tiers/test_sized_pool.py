"""SizedPool, the buffers by size behind the compute pool and the activation pools: reuse by
size, one bound (a ByteBudget that refuses, or a soft limit that only evicts), kept bytes
capped, close."""
import pytest

from infinity.tiers import BudgetExceededError, ByteBudget
from infinity.tiers.sized_pool import SizedPool

K = 4096


def test_reuses_by_size_and_counts_in_the_budget():
    budget = ByteBudget("host", 10 * K)
    pool = SizedPool("test", budget=budget)
    a = pool.take(2 * K)
    assert a.numel() == 2 * K and a.data_ptr() % K == 0
    pool.give_back(a)
    assert pool.held == budget.used == 2 * K and pool.cached == 2 * K
    b = pool.take(2 * K)
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1  # the same buffer again
    assert pool.cached == 0


def test_budget_evicts_kept_buffers_of_other_sizes_then_refuses():
    budget = ByteBudget("host", 10 * K)
    pool = SizedPool("test", budget=budget)
    pool.give_back(pool.take(6 * K))  # kept: 6 pages of the 10
    big = pool.take(8 * K)  # needs the kept one freed
    assert pool.held == budget.used == 8 * K and pool.cached == 0
    with pytest.raises(BudgetExceededError, match="a test buffer"):
        pool.take(4 * K)
    assert pool.held == budget.used == 8 * K  # nothing leaked by the refusal
    pool.give_back(big)
    pool.close()
    assert pool.held == budget.used == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.take(K)


def test_soft_limit_and_keep_bytes():
    pool = SizedPool("test", limit=4 * K, keep_bytes=3 * K)
    pool.give_back(pool.take(3 * K))
    assert pool.cached == 3 * K
    a = pool.take(2 * K)  # over the limit with the kept one: it goes, the new one is made
    b = pool.take(4 * K)  # over the limit on its own: made anyway (the limit is soft)
    assert pool.held == 6 * K and pool.cached == 0
    pool.give_back(b)  # more than keep_bytes: freed, not kept
    pool.give_back(a)
    assert pool.cached == 2 * K and pool.held == 2 * K
    pool.trim()
    assert pool.held == pool.cached == 0


def test_sets_are_counted_all_or_none_and_try_take_keeps_the_spare():
    budget = ByteBudget("host", 10 * K)
    pool = SizedPool("staging", budget=budget, keep_bytes=0)
    with pytest.raises(BudgetExceededError, match="11 staging buffer"):
        pool.take_set(11, K)
    assert budget.used == pool.held == 0 and pool.allocations == 0
    bufs = pool.take_set(4, K)
    assert len({b.data_ptr() for b in bufs}) == 4 and budget.used == pool.held == 4 * K
    assert pool.try_take(K, spare=6 * K) is None  # 6 pages free, the spare wants them all
    extra = pool.try_take(K, spare=5 * K)
    assert extra is not None and budget.used == 5 * K
    for buf in bufs + [extra]:
        pool.give_back(buf)  # keep_bytes=0: each one leaves, its bytes with it
    assert budget.used == pool.held == pool.cached == 0
