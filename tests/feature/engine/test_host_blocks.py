"""Per-block parameter tiers (host_blocks=K: the first K blocks' parameters in host RAM, the
rest on NVMe): one home per tier, each block on its own; training, state_dict, checkpoints,
unwrap and the byte accounting are those of a single-tier engine."""
import copy

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss
from infinity.runtime.homes.home import TieredHome
from infinity.tiers import BudgetExceededError, Tier

CFG = GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=2, max_seq=16)
X = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    return TinyGPT(CFG)


def wrapped(ref, tmp_path, **tiers):
    model = copy.deepcopy(ref)
    d = tmp_path / f"swap{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    infinity.wrap(model, nvme_path=str(d), placement=None, **tiers)
    return model


def train(model, steps=3):
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(X), X)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return opt, losses


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("states", ["host", "nvme"])
def test_mixed_split_trains_bitwise_like_all_host_and_all_nvme(ref, tmp_path, states):
    runs = {}
    for name, tiers in (("host", dict(param_tier="host", grad_tier="host")),
                        ("nvme", dict(param_tier="nvme", grad_tier="nvme")),
                        ("mixed", dict(param_tier="nvme", host_blocks=2, grad_tier="nvme")),
                        ("mixed_host_grads", dict(param_tier="nvme", host_blocks=3,
                                                  grad_tier="host"))):
        model = wrapped(ref, tmp_path, optimizer_tier=states, **tiers)
        _, losses = train(model)
        runs[name] = (losses, weights(model))
        infinity.unwrap(model)
    base_losses, base_w = runs["host"]
    for name, (losses, w) in runs.items():
        assert losses == base_losses, name
        for k in base_w:
            assert torch.equal(w[k], base_w[k]), (name, k)


def test_each_block_has_its_tier_home_and_residency(ref, tmp_path):
    model = wrapped(ref, tmp_path, param_tier="nvme", host_blocks=2)
    eng = infinity.api._engine(model)
    assert isinstance(eng.home, TieredHome) and set(eng.homes) == {Tier.HOST, Tier.NVME}
    assert [b.home for b in eng.blocks] == [Tier.HOST] * 2 + [Tier.NVME] * 3
    # CPU device, same dtype: the host blocks compute on their home in place; NVMe ones stream
    assert [b.resident for b in eng.blocks] == [True, True, False, False, False]
    assert infinity.stats(model)["param_blocks"] == {"host": 2, "nvme": 3}
    assert eng.working.stages(eng.blocks[0].flats[0]) is False
    assert eng.working.stages(eng.blocks[2].flats[0]) is True
    infinity.unwrap(model)


def test_bytes_per_tier_and_host_budget_follow_the_split(ref, tmp_path):
    model = wrapped(ref, tmp_path, param_tier="nvme", host_blocks=2, grad_tier="host")
    eng = infinity.api._engine(model)
    host_bytes = sum(b.home_nbytes for b in eng.blocks[:2])
    nvme_bytes = sum(b.home_nbytes for b in eng.blocks[2:])
    tiers = infinity.stats(model)["tiers"]
    assert tiers["host"]["params"] == host_bytes
    assert tiers["nvme"]["params"] == nvme_bytes
    assert tiers["nvme"]["now"] >= nvme_bytes  # the parameters' swap files (grads on host)
    needs = eng.sizing.host_needs()
    assert needs["parameter homes"] == host_bytes and "staging" in needs
    infinity.unwrap(model)
    # a host budget below those needs is refused, naming the parameter homes
    with pytest.raises(BudgetExceededError, match="parameter homes"):
        wrapped(ref, tmp_path, param_tier="nvme", host_blocks=2, grad_tier="host",
                host_budget=host_bytes)


def test_state_dict_load_state_dict_and_unwrap(ref, tmp_path):
    model = wrapped(ref, tmp_path, param_tier="nvme", host_blocks=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    torch.manual_seed(5)
    other = TinyGPT(CFG)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(X), other(X))
    _, losses = train(model, 2)
    _, ref_losses = train(_plain_like(other), 2)
    assert losses == ref_losses
    final = weights(model)
    infinity.unwrap(model)
    assert infinity.runtime.engine.engine_of(model) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k


def _plain_like(module):
    m = copy.deepcopy(module)
    return m


def test_checkpoint_round_trip_continues_exactly(ref, tmp_path):
    straight = wrapped(ref, tmp_path, param_tier="nvme", host_blocks=2)
    opt, _ = train(straight, 2)
    ckpt = infinity.save_checkpoint(str(tmp_path / "ckpt"), straight, opt)
    loss_a = []
    for _ in range(2):
        loss = lm_loss(straight(X), X)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_a.append(loss.item())
    w_a = weights(straight)
    infinity.unwrap(straight)

    torch.manual_seed(9)
    resumed = wrapped(TinyGPT(CFG), tmp_path, param_tier="nvme", host_blocks=3)
    opt2 = infinity.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    infinity.load_checkpoint(ckpt, resumed, opt2)
    loss_b = []
    for _ in range(2):
        loss = lm_loss(resumed(X), X)
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        loss_b.append(loss.item())
    assert loss_b == loss_a
    w_b = weights(resumed)
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k
    infinity.unwrap(resumed)


def test_bad_host_blocks_are_refused(ref, tmp_path):
    with pytest.raises(ValueError, match="host_blocks=2 .* needs param_tier='nvme'"):
        infinity.OffloadPolicy(param_tier="host", host_blocks=2, nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="host_blocks=2 .*nvme_path"):
        infinity.OffloadPolicy(host_blocks=2)
    with pytest.raises(ValueError, match="host_blocks must be an integer"):
        infinity.OffloadPolicy(host_blocks=-1)
    with pytest.raises(ValueError, match="host_blocks=9, but the model has 5 blocks"):
        wrapped(ref, tmp_path, param_tier="nvme", host_blocks=9)
    with pytest.raises(ValueError, match="param_tier resolved to 'host'"):
        wrapped(ref, tmp_path, host_blocks=2, host_budget=1 << 30)
