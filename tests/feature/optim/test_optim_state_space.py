"""Disk bytes of the NVMe optimizer states: the formats' bytes once, plus the units in flight.

Measured on the state file itself (``os.stat(...).st_blocks``: blocks the filesystem holds,
holes left out) after every step, against what the layouts need, and the peak of live extents
during the steps against the units the pipeline can have in flight. A step that overlaps
backward keeps the old states of every unit it stepped until ``opt.step()`` confirms: its
peak is what that costs."""
from __future__ import annotations

import os

import pytest
import torch
from optim_helpers import assert_equal, weights
from optim_helpers import states as opt_states

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.optim.states.extents import STATE_FILE
from infinity.optim.step.layout import state_nbytes
from infinity.tiers.swap_store import KEEP_FREED_EXTENTS

CFG = GPTConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, max_seq=16)


# st_blocks also counts the filesystem's own blocks for a file of many extents (ext4's extent
# tree): a few pages beyond the data
FS_META = 4 * 4096


def _disk(store) -> int:
    return os.stat(store.extents.store.path(STATE_FILE)).st_blocks * 512


def _train(model, opt, steps, seed=1, each=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = synthetic_batch(CFG, 2, 8, gen)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if each is not None:
            each()


@pytest.mark.parametrize("states", ["fp32", "8bit"])
@pytest.mark.parametrize("chunk", [64 << 10, 1 << 30])
def test_swap_holds_the_states_once_plus_units_in_flight(tmp_path, states, chunk):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk, states=states,
                               min_8bit_size=0)
    store = next(iter(opt.core.wrapped.stores())) if opt.core.wrapped.stores() else None
    seen = []

    def check():
        nonlocal store
        store = next(iter(opt.core.wrapped.stores()))
        sets = next(iter(opt.core.wrapped.sets()))
        need = sum(state_nbytes(s.flat, s.formats) for s in opt.shards())
        plans = [store.plan(s) for s in opt.shards()]
        units = sum(len(p.units) for p in plans)
        in_flight = sets.count * max(p.buffer_nbytes for p in plans)
        sw = store.swap_bytes()
        committed = sw["master"] + sw["moments"]
        assert committed == sum(p.nbytes for p in plans)
        # one extent per unit: the layout's bytes plus at most a page per unit
        assert need <= committed <= need + units * 4096
        disk = _disk(store)
        assert disk == sw["disk"]
        # after a step nothing is pending; the freed extents' blocks kept for the next step's
        # writes are free space of the file, at most KEEP_FREED_EXTENTS largest extents
        ext = store.extents
        kept = ext.store.kept_bytes(STATE_FILE)
        largest = max(e.nbytes for units in ext.committed.values() for e in units)
        assert kept <= min(ext.space.free_bytes, KEEP_FREED_EXTENTS * largest)
        assert disk <= committed + in_flight + FS_META
        assert ext.peak_bytes <= committed + in_flight  # during it: the units in flight
        assert store.nbytes == committed
        seen.append((need, disk, ext.peak_bytes, ext.space.capacity, in_flight, kept,
                     largest, ext.store.allocated_bytes, ext.store.released_bytes))

    _train(model, opt, 6, each=check)
    need, disk, peak, capacity, in_flight, kept, largest = seen[-1][:7]
    if chunk < need // 8:  # many units: far below the two extents per shard of before
        assert disk <= 1.10 * need + kept
        assert disk <= 1.10 * need + KEEP_FREED_EXTENTS * largest < 1.5 * need
        assert peak <= 1.10 * need + in_flight < 2 * need
        assert capacity <= 1.25 * need + in_flight  # fragmentation of the file's space
    disks = [s[1] for s in seen]  # steady: no growth step after step
    assert max(disks) - min(disks) <= in_flight + FS_META
    if chunk < need // 8:
        # freed blocks are not given back and allocated again unit by unit (which moved every
        # unit's bytes each step): over the last 3 steps, a fifth of that at most
        # (fragmentation of the units' sizes settling). With one unit per shard (a chunk
        # larger than every shard) the few extents differ in size and which free range each
        # lands in follows the order their writes complete in: not checked there
        moved = 3 * need
        fresh, punched = seen[-1][7] - seen[-4][7], seen[-1][8] - seen[-4][8]
        assert fresh <= 0.2 * moved and punched <= 0.2 * moved, (fresh, punched, need)
    opt.close()
    infinity.unwrap(model)


def test_overlap_keeps_old_states_of_the_stepped_units_until_the_step(tmp_path):
    """overlap=True (gradients and states on NVMe): the updates during backward write new
    extents and keep the old ones until opt.step() confirms them, so the peak of live extents
    grows by the stepped set (here most of the model: at least 1.5x the states, against at
    most 1.25x without overlap); after the step the old extents are freed, and their blocks
    are kept for the next step's new extents (at most that stepped set), so steady steps
    punch no holes and allocate next to no blocks; give_back returns the disk to the states once.
    The results equal a run without overlap bitwise."""
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        d = tmp_path / str(overlap)
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), optimizer_tier="nvme", grad_tier="nvme",
                      param_tier="host")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=16 << 10,
                                   overlap=overlap)
        disks, moved = [], []

        def each():
            swap = next(iter(opt.core.wrapped.stores())).extents.store
            disks.append(_disk(next(iter(opt.core.wrapped.stores()))))
            moved.append((swap.allocated_bytes, swap.released_bytes))

        _train(model, opt, 5, each=each)
        store = next(iter(opt.core.wrapped.stores()))
        sw = store.swap_bytes()
        committed = sw["master"] + sw["moments"]
        swap = store.extents.store
        spare = store.extents.peak_bytes - committed  # what a step holds at its peak
        in_flight = 4 * max(store.plan(s).buffer_nbytes for s in opt.shards())
        if overlap:
            assert opt._overlap.kept_total > 0
            assert spare >= 0.5 * committed  # the stepped set's old extents
        else:
            assert spare <= 0.25 * committed
        kept = swap.kept_bytes(STATE_FILE)
        largest = max(e.nbytes for units in store.extents.committed.values() for e in units)
        assert kept <= max(spare, KEEP_FREED_EXTENTS * largest) and disks[-1] <= committed + max(kept, in_flight) + FS_META
        # the last two steps: no hole punched, and new blocks only where the order writes
        # complete in lands a unit past the free ranges (a page here and there)
        fresh, punched = (moved[-1][0] - moved[-3][0], moved[-1][1] - moved[-3][1])
        assert punched == 0 and fresh <= 0.05 * committed, moved
        swap.give_back(STATE_FILE)
        assert swap.kept_bytes(STATE_FILE) == 0 and _disk(store) <= committed + FS_META
        runs.append((weights(model), opt_states(opt), store.extents.peak_bytes / committed))
        opt.close()
        infinity.unwrap(model)
    assert_equal(runs[0][0], runs[1][0])
    assert_equal(runs[0][1], runs[1][1])


def test_a_load_keeps_no_more_freed_blocks_than_a_step(tmp_path):
    """load_state_dict rewrites each shard whole and frees its old extents: that is not a
    step's spare, so the state file keeps at most KEEP_FREED_EXTENTS largest extents of them,
    then trains on within the same bound."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=64 << 10,
                               overlap=False)
    _train(model, opt, 2)
    bounds = []

    def check():
        store = next(iter(opt.core.wrapped.stores()))
        ext = store.extents
        largest = max(e.nbytes for units in ext.committed.values() for e in units)
        units = max(len(store.plan(s).units) for s in opt.shards())
        kept = ext.store.kept_bytes(STATE_FILE)
        assert units > KEEP_FREED_EXTENTS  # a shard frees more than the bound when rewritten
        assert kept <= min(ext.space.free_bytes, KEEP_FREED_EXTENTS * largest), (kept, largest)
        bounds.append(kept)

    opt.load_state_dict(opt.state_dict())
    check()
    _train(model, opt, 2, each=check)
    assert len(bounds) == 3
    opt.close()
    infinity.unwrap(model)


def test_a_checkpoint_first_gives_the_kept_blocks_back_then_training_goes_on(tmp_path):
    """The blocks a step that overlaps backward keeps between steps (its stepped set's old
    states) are disk a checkpoint written to the same disk may need: save_checkpoint gives
    them back first (opt.give_back_disk(), also public). The next steps allocate them again
    and train on bitwise as a run without the checkpoint."""
    runs = []
    for save in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        d = tmp_path / str(save)
        (d / "swap").mkdir(parents=True)
        infinity.wrap(model, nvme_path=str(d / "swap"), optimizer_tier="nvme",
                      grad_tier="nvme", param_tier="host")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=16 << 10,
                                   overlap=True)
        _train(model, opt, 3)
        store = next(iter(opt.core.wrapped.stores()))
        swap = store.extents.store
        sw = store.swap_bytes()
        committed = sw["master"] + sw["moments"]
        kept = swap.kept_bytes(STATE_FILE)
        if save:
            assert kept >= 0.5 * committed  # the stepped set's old states, kept
            assert _disk(store) >= committed + kept
            infinity.save_checkpoint(str(d / "ck"), model, opt)
            assert swap.kept_bytes(STATE_FILE) == 0 and _disk(store) <= committed + FS_META
            assert opt.give_back_disk() == 0  # nothing left to give back
        _train(model, opt, 3, seed=2)
        assert swap.kept_bytes(STATE_FILE) >= 0.5 * committed  # kept again for the next step
        runs.append((weights(model), opt_states(opt)))
        opt.close()
        infinity.unwrap(model)
    assert_equal(runs[0][0], runs[1][0])
    assert_equal(runs[0][1], runs[1][1])
