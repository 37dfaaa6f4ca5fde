"""The optimizer's public faces that ZeRO state dicts and checkpoints use (engines, shards,
current_states, load_shard, unwrapped_states, checked_entries, load_unwrapped_states) agree
with its torch-format state_dict, bitwise, in one process: host and NVMe states, mixed moment
formats, a parameter outside the wrapped model."""
from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_optimizer_states_equal
from torch import nn

import infinity
from infinity.runtime import engine_of

VOCAB, DIM = 64, 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def _setup(tmp_path, tier: str):
    torch.manual_seed(0)
    model = infinity.wrap(Net(), nvme_path=str(tmp_path), param_tier="host", grad_tier="host",
                          optimizer_tier=tier)
    scale = nn.Parameter(torch.ones(()))  # outside the wrapped model
    states = {"default": "fp32", model.layers[1]: "8bit", model.head: "bf16"}
    opt = infinity.optim.AdamW([{"params": list(model.parameters())}, {"params": [scale]}],
                               lr=1e-2, states=states, min_8bit_size=16)
    return model, scale, opt


def _steps(model, scale, opt, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (4, 8), generator=gen)
        loss = F.cross_entropy((model(x) * scale).flatten(0, 1), ((3 * x + 1) % VOCAB).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _index(opt) -> Dict[int, int]:
    return {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_shard_faces_agree_with_state_dict(tmp_path, tier):
    model, scale, opt = _setup(tmp_path, tier)
    assert opt.engines() == [engine_of(model)]
    before = {id(s.flat): opt.state_dicts.current_states(s) for s in opt.shards()}
    assert all(v is None for v in before.values())  # no state before the first step
    _steps(model, scale, opt, 3, seed=1)
    saved = opt.state_dict()
    index = _index(opt)
    seen = set()
    for shard in opt.shards():
        master, m, v = opt.state_dicts.current_states(shard)
        assert master.dtype == m.dtype == v.dtype == torch.float32
        for i, s in enumerate(shard.flat.slots):
            want = saved["state"][index[id(s.param)]]
            assert shard.steps[i] == int(want["step"])
            sl = slice(s.offset, s.offset + s.numel)
            for name, got in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
                assert torch.equal(got[sl].view(s.shape), want[name]), (s.qualname, name)
            seen.add(index[id(s.param)])
    unwrapped = opt.state_dicts.unwrapped_states()
    assert set(unwrapped) == set(saved["state"]) - seen == {index[id(scale)]}
    for i, e in unwrapped.items():
        for name, t in e.items():
            assert torch.equal(t, saved["state"][i][name]), name

    # load the saved states back through the faces after more steps changed them
    _steps(model, scale, opt, 2, seed=2)
    entries = opt.state_dicts.checked_entries(saved)
    opt.state_dicts.load_unwrapped_states(entries)
    for shard in opt.shards():
        opt.state_dicts.load_shard(shard, {id(s.param): entries[index[id(s.param)]]
                               for s in shard.flat.slots})
    assert_optimizer_states_equal(saved, opt.state_dict())
    opt.close()
    infinity.unwrap(model)


def test_checked_entries_names_a_wrong_shape_and_changes_nothing(tmp_path):
    model, scale, opt = _setup(tmp_path, "host")
    _steps(model, scale, opt, 1, seed=1)
    saved = opt.state_dict()
    bad = {**saved, "state": dict(saved["state"])}
    i = _index(opt)[id(model.head.weight)]
    bad["state"][i] = {**saved["state"][i], "exp_avg": torch.zeros(3)}
    with pytest.raises(ValueError, match="different model"):
        opt.state_dicts.checked_entries(bad)
    assert_optimizer_states_equal(saved, opt.state_dict())
    opt.close()
    infinity.unwrap(model)
