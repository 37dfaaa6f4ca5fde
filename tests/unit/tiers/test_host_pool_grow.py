"""HostPool.grow / shrink: a pool that holds more buffers for a while (a layer-major step
holding a whole layer's gradients), within the host budget, then gives them back."""
from infinity.tiers.budget import ByteBudget
from infinity.tiers.host_pool import HostPool

KIB = 4096


def test_grows_within_the_budget_keeping_the_spare_then_shrinks_as_buffers_return():
    budget = ByteBudget("host", 10 * KIB)
    pool = HostPool(2, KIB, budget)
    try:
        assert budget.used == 2 * KIB
        # room for 8 more, but 3 buffers' worth must stay free: 5 added
        assert pool.grow(20, spare=3 * KIB) == 7
        assert pool.count == 7 and budget.used == 7 * KIB
        held = [pool.acquire() for _ in range(7)]
        assert len({b.data_ptr() for b in held}) == 7
        pool.shrink(2)  # none free: they leave as they come back
        assert pool.count == 7
        for buf in held[:4]:
            pool.release(buf)
        assert pool.count == 3 and budget.used == 3 * KIB
        for buf in held[4:]:
            pool.release(buf)
        assert pool.count == 2 and budget.used == 2 * KIB
        again = [pool.acquire() for _ in range(2)]  # the two left are usable
        for buf in again:
            pool.release(buf)
    finally:
        pool.close()
    assert budget.used == 0


def test_grow_adds_nothing_when_the_budget_is_full():
    budget = ByteBudget("host", 3 * KIB)
    pool = HostPool(3, KIB, budget)
    try:
        assert pool.grow(6) == 3 and budget.used == 3 * KIB
        pool.shrink(3)
        assert pool.count == 3
    finally:
        pool.close()
    assert budget.used == 0
