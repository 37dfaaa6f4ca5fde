"""Per-parameter moment formats on the optimizer (``infinity.optim.AdamW(..., states=...,
min_8bit_size=...)``): bitsandbytes' safeguards for 8-bit states as defaults, and shards
(FlatParams) whose slots have different formats.

The model: an nn.Embedding (300 x 64), a projection, two layers of Linear + LayerNorm and an
untied head. Wrapped, its root block (embedding, projection, final norm, head) and each layer
are one shard holding fp32 and 8-bit slots side by side (mixed layouts).

Reference for the fp32 slots: ``torch.optim.AdamW(fused=True)`` (bitwise equal to our fp32
kernel, see test_optim.py) stepped with the very gradients our run saw (captured before each
``opt.step()``): the other parameters take 8-bit steps, so a plain torch run of the whole model
would see other gradients after the first step; replaying the gradients checks exactly that a
slot's update is fp32 Adam. The same replay differs for 8-bit slots (checked too), so the check
sees a slot stepped in the wrong format.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_optimizer_states_equal, assert_tensors_equal
from torch import nn

import infinity
from infinity import ops
from infinity.optim import format_summary, formats_for, moment_nbytes
from infinity.optim.step.layout import layout_for, state_views
from infinity.runtime import engine_of
from infinity.runtime.port import OptimizerPort

VOCAB, DIM, HIDDEN = 300, 64, 128
LR = 1e-2


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)      # weight 8192: 8-bit; bias fp32 (min_8bit_size)
        self.norm = nn.LayerNorm(HIDDEN)       # fp32 (min_8bit_size)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)  # 19200 elements: fp32 by the embedding default
        self.proj = nn.Linear(DIM, DIM)        # weight 4096 = min_8bit_size: 8-bit
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)  # untied: 8-bit

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class TiedNet(nn.Module):
    """The head is registered before the embedding and shares its weight (the engine's slot
    then names the head: the embedding must be found among all the weight's modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head.weight = self.embed.weight
        self.layers = nn.ModuleList(Layer() for _ in range(1))
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


EXPECTED_8BIT = {  # states="8bit", defaults: what each parameter of Net gets, and why
    "embed.weight": "fp32",                                    # nn.Embedding
    "proj.weight": "8bit", "proj.bias": "fp32",                # bias: < min_8bit_size
    **{f"layers.{i}.{n}": ("8bit" if n.endswith("weight") and n.startswith("fc") else "fp32")
       for i in range(2) for n in ("fc1.weight", "fc1.bias", "norm.weight", "norm.bias",
                                   "fc2.weight", "fc2.bias")},
    "norm.weight": "fp32", "norm.bias": "fp32",
    "head.weight": "8bit",
}


def _net(seed: int = 0, cls=Net) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def _batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (4, 12), generator=gen) for _ in range(n)]
    return [(x, (7 * x + 3) % VOCAB) for x in xs]  # a learnable map of each token


def _wrap(model: nn.Module, path, tier: str, **kw) -> nn.Module:
    settings = dict(param_tier="host", grad_tier="host", optimizer_tier=tier)
    settings.update(kw)
    return infinity.wrap(model, nvme_path=str(path), **settings)


def _train(model, opt, batches, grads: Optional[Dict[str, List[torch.Tensor]]] = None
           ) -> List[float]:
    """``grads``: filled with each parameter's gradient before each step (by name)."""
    named = dict(model.named_parameters())
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if grads is not None:
            for name, p in named.items():
                grads.setdefault(name, []).append(infinity.gradient(p).detach().clone())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    ctx = infinity.materialized(model) if engine_of(model) is not None else _null()
    with ctx:
        return {k: v.detach().clone() for k, v in model.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _replay(initial: torch.Tensor, grads: List[torch.Tensor]) -> torch.Tensor:
    """torch.optim.AdamW (fp32 moments) on ``initial`` stepped with ``grads``."""
    p = nn.Parameter(initial.clone())
    opt = torch.optim.AdamW([p], lr=LR, fused=True)  # weight_decay 1e-2, as ours
    for g in grads:
        p.grad = g.clone().view_as(p)
        opt.step()
    return p.detach()


# =========================================================================================
# (a) defaults: embedding and small parameters fp32, large weights 8-bit
# =========================================================================================
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_8bit_defaults_keep_embedding_and_small_params_fp32(tmp_path, tier):
    base = _net()
    initial = {k: v.detach().clone() for k, v in base.named_parameters()}
    model = _wrap(base, tmp_path, tier)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states="8bit")
    assert opt.state_formats() == EXPECTED_8BIT
    grads: Dict[str, List[torch.Tensor]] = {}
    losses = _train(model, opt, _batches(6), grads)
    assert set(opt.state_tiers.values()) == {tier}
    assert losses[-1] < losses[0]
    # the shards really are mixed: fp32 and 8-bit regions in one state buffer
    store = opt.core.wrapped.store(OptimizerPort.of(engine_of(model)))
    layouts = {s.key: store.layout(s) for s in opt.shards()}
    assert all(lay.fmt == "mixed" and lay.formats == ("fp32", "8bit")
               for lay in layouts.values()), layouts
    got = _weights(model)
    for name, fmt in EXPECTED_8BIT.items():
        want = _replay(initial[name], grads[name])
        if fmt == "fp32":  # fp32 moments: exactly torch's AdamW on these gradients
            assert torch.equal(got[name], want), name
        else:  # 8-bit moments: a visibly different update
            assert (got[name] - want).abs().max() > 1e-6, name
    opt.close()
    infinity.unwrap(model)


def test_min_8bit_size_threshold_and_zero(tmp_path):
    model = _wrap(_net(), tmp_path, "host")
    f = infinity.optim.AdamW(model.parameters(), states="8bit",
                             min_8bit_size=8192).state_formats()
    assert f["proj.weight"] == "fp32" and f["layers.0.fc1.weight"] == "8bit"  # 4096 < 8192
    f = infinity.optim.AdamW(model.parameters(), states="8bit", min_8bit_size=0).state_formats()
    assert f["proj.bias"] == "8bit" and f["norm.weight"] == "8bit"
    assert f["embed.weight"] == "fp32"  # the embedding default does not depend on the size
    infinity.unwrap(model)


# =========================================================================================
# (b) a weight tied between the embedding and the head
# =========================================================================================
def test_tied_embedding_and_head_keep_fp32(tmp_path):
    base = _net(cls=TiedNet)
    initial = base.embed.weight.detach().clone()
    model = _wrap(base, tmp_path, "host")
    tied = model.embed.weight
    assert tied is model.head.weight
    slot = next(s for f in engine_of(model).flats for s in f.slots if s.param is tied)
    assert isinstance(slot.module, nn.Linear)  # the engine names it by the head
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states="8bit")
    formats = opt.state_formats()
    assert formats[slot.qualname] == "fp32"
    assert formats["proj.weight"] == "8bit" and formats["layers.0.fc1.weight"] == "8bit"
    grads: Dict[str, List[torch.Tensor]] = {}
    _train(model, opt, _batches(4), grads)
    assert torch.equal(_weights(model)[slot.qualname], _replay(initial, grads[slot.qualname]))
    opt.close()
    # opted in by naming the embedding module (or the head: it holds the same weight)
    for key in (model.embed, model.head, tied):
        f = infinity.optim.AdamW(model.parameters(), states={"default": "8bit", key: "8bit"}
                                 ).state_formats()
        assert f[slot.qualname] == "8bit", key
    infinity.unwrap(model)
    meta = formats_for(_net(cls=TiedNet), "8bit")
    assert meta[slot.qualname] == "fp32" and meta["proj.weight"] == "8bit"


# =========================================================================================
# (c) explicit overrides and errors
# =========================================================================================
def test_dict_overrides_param_module_default(tmp_path):
    base = _net()
    initial = base.embed.weight.detach().clone()
    model = _wrap(base, tmp_path, "host")
    l0, l1 = model.layers[0], model.layers[1]
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states={
        "default": "bf16",
        l0: "8bit",                   # a module: its parameters, recursively
        l0.fc1.weight: "fp32",        # a parameter beats its module
        l1.fc2: "8bit", l1: "fp32",   # the innermost module wins whatever the order
        model.embed: "8bit",          # named: the embedding default does not apply
    })
    f = opt.state_formats()
    assert f["layers.0.fc2.weight"] == "8bit" and f["layers.0.fc1.weight"] == "fp32"
    assert f["layers.0.fc2.bias"] == "fp32"    # named 8-bit, but under min_8bit_size
    assert f["layers.1.fc2.weight"] == "8bit" and f["layers.1.fc1.weight"] == "fp32"
    assert f["layers.1.norm.weight"] == "fp32"
    assert f["embed.weight"] == "8bit"
    assert f["proj.weight"] == "bf16" and f["head.weight"] == "bf16" and f["proj.bias"] == "bf16"
    grads: Dict[str, List[torch.Tensor]] = {}
    _train(model, opt, _batches(3), grads)
    sd = opt.state_dict()
    assert sd["states"] == "bf16"
    assert sorted(set(sd["state_formats"].values())) == ["8bit", "bf16", "fp32"]
    store = opt.core.wrapped.store(OptimizerPort.of(engine_of(model)))
    root = next(s for s in opt.shards() if any(x.param is model.embed.weight
                                                        for x in s.flat.slots))
    assert store.layout(root).formats == ("bf16", "8bit")
    # the explicitly 8-bit embedding is not stepped like fp32 Adam: (a)'s check can fail
    assert (_weights(model)["embed.weight"] - _replay(initial, grads["embed.weight"])
            ).abs().max() > 1e-6
    opt.close()
    infinity.unwrap(model)


def test_callable_states(tmp_path):
    model = _wrap(_net(), tmp_path, "host")
    seen = []

    def choose(p):
        seen.append(p)
        return "8bit" if p.dim() == 2 else None  # None: the default (fp32)

    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states=choose)
    f = opt.state_formats()
    assert f["head.weight"] == "8bit" and f["layers.1.fc1.weight"] == "8bit"
    assert f["proj.bias"] == "fp32" and f["norm.weight"] == "fp32"
    # a callable names nothing: the 8-bit it returns for the embedding is still overridden
    assert f["embed.weight"] == "fp32"
    assert len(seen) == len({id(p) for p in seen}) == len(f)  # asked once per parameter
    _train(model, opt, _batches(2))
    opt.close()
    f = infinity.optim.AdamW(model.parameters(), states=lambda p: "bf16").state_formats()
    assert set(f.values()) == {"bf16"}
    infinity.unwrap(model)


@pytest.mark.parametrize("states,err,match", [
    ({"default": "int8"}, ValueError, r"infinity\.optim: states\['default'\] must be 'fp32'"),
    ("8-bit", ValueError, r"infinity\.optim: states must be 'fp32'.*'bf16'.*'8bit'"),
    (["8bit"], ValueError, r"infinity\.optim: states must be .*a dict .*callable"),
    ({3: "8bit"}, TypeError, r"infinity\.optim: a states= dict key must be an nn\.Parameter, "
                             r"an nn\.Module or 'default'; got int"),
    ({"embed": "8bit"}, ValueError, r"infinity\.optim: the only string key of states= is "
                                    r"'default'"),
    (lambda p: "int4", ValueError, r"infinity\.optim: the format returned by the states= "
                                   r"callable .* must be 'fp32'"),
])
def test_bad_states_raise_naming_infinity(states, err, match):
    model = _net()
    with pytest.raises(err, match=match):
        infinity.optim.AdamW(model.parameters(), states=states)


def test_bad_dict_values_and_min_8bit_size_raise():
    model = _net()
    with pytest.raises(ValueError, match=r"infinity\.optim: the states= value of a parameter "
                                         r"of shape \(300, 64\) must be 'fp32'"):
        infinity.optim.AdamW(model.parameters(), states={model.embed.weight: "4bit"})
    with pytest.raises(ValueError, match=r"infinity\.optim: the states= value of module "
                                         r"Linear must be"):
        infinity.optim.AdamW(model.parameters(), states={model.head: None})
    for bad in (-1, "4096", 1.5, True):
        with pytest.raises(ValueError, match=r"infinity\.optim: min_8bit_size must be an int"):
            infinity.optim.AdamW(model.parameters(), states="8bit", min_8bit_size=bad)


def test_unwrapped_parameters_get_their_own_formats():
    """No module information without a wrapped model: only min_8bit_size and explicit keys
    apply (the embedding weight is 8-bit unless named)."""
    model = _net()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states="8bit")
    f = opt.state_formats()
    names = [n for n, _ in model.named_parameters()]
    by_name = {names[i]: fmt for i, fmt in f.items()}  # unwrapped: keyed by index
    assert by_name["embed.weight"] == "8bit" and by_name["proj.bias"] == "fp32"
    grads: Dict[str, List[torch.Tensor]] = {}
    for x, y in _batches(4):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        for n, p in model.named_parameters():
            grads.setdefault(n, []).append(p.grad.clone())
        opt.step()
        opt.zero_grad()
    state = dict(zip(names, (opt.state[p] for p in model.parameters())))
    assert "exp_avg_codes" in state["embed.weight"]
    assert state["proj.bias"]["exp_avg"].dtype == torch.float32
    for n, p in model.named_parameters():
        same = torch.equal(p.detach(), _replay(initial[n], grads[n]))
        assert same == (by_name[n] == "fp32"), n
    sd = opt.state_dict()
    opt2 = infinity.optim.AdamW(model.parameters(), lr=LR,
                                states={"default": "8bit", model.embed: "fp32"})
    opt2.load_state_dict(sd)
    assert opt2.state_formats()[0] == "fp32"
    assert opt2.state[model.embed.weight]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt2.state[model.embed.weight]["exp_avg"], sd["state"][0]["exp_avg"])


# =========================================================================================
# (d) state_dict round trip right after a step
# =========================================================================================
def _mixed3(model) -> Dict:
    """fp32, bf16 and 8-bit slots in one shard (layers.1: fc1 bf16, norm/biases fp32, fc2
    8-bit)."""
    return {"default": "8bit", model.layers[1].fc1: "bf16"}


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_state_dict_round_trip_resumes_bitwise(tmp_path, tier):
    batches = _batches(6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = _wrap(_net(), tmp_path / "a", tier)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states=_mixed3(model))
    _train(model, opt, batches[:3])
    saved = opt.state_dict()
    saved_weights = _weights(model)
    assert all(e["exp_avg"].dtype == torch.float32 for e in saved["state"].values())
    store = opt.core.wrapped.store(OptimizerPort.of(engine_of(model)))
    layer1 = next(s for s in opt.shards() if any(x.qualname.startswith("layers.1.")
                                                          for x in s.flat.slots))
    assert store.layout(layer1).formats == ("fp32", "bf16", "8bit")
    _train(model, opt, batches[3:])
    want = _weights(model)
    want_sd = opt.state_dict()
    opt.close()
    infinity.unwrap(model)

    base = _net(seed=5)
    with torch.no_grad():
        for k, p in base.named_parameters():
            p.copy_(saved_weights[k])
    model2 = _wrap(base, tmp_path / "b", tier)
    opt2 = infinity.optim.AdamW(model2.parameters(), lr=LR, states=_mixed3(model2))
    opt2.load_state_dict(saved)
    assert_optimizer_states_equal(saved, opt2.state_dict())  # re-quantized to the same state
    _train(model2, opt2, batches[3:])
    assert_tensors_equal(_weights(model2), want)
    assert_optimizer_states_equal(want_sd, opt2.state_dict())
    opt2.close()
    infinity.unwrap(model2)


# =========================================================================================
# (e) NVMe states (and the step overlapping backward) equal host states
# =========================================================================================
@pytest.mark.parametrize("case", ["nvme", "nvme_all_overlap", "nvme_bf16_master"])
def test_mixed_shards_on_nvme_equal_host(tmp_path, case):
    batches = _batches(5)
    kw = dict(master="bf16_sr") if case == "nvme_bf16_master" else {}
    runs = {}
    for name, tier, extra, overlap in (
            ("host", "host", {}, False),
            (case, "nvme", dict(param_tier="nvme", grad_tier="nvme")
             if case == "nvme_all_overlap" else {}, case == "nvme_all_overlap")):
        (tmp_path / name).mkdir()
        model = _wrap(_net(), tmp_path / name, tier, **extra)
        opt = infinity.optim.AdamW(model.parameters(), lr=LR, states=_mixed3(model),
                                   overlap=overlap, **kw)
        losses = _train(model, opt, batches)
        assert set(opt.state_tiers.values()) == {tier}
        if overlap:
            assert opt._overlap.kept_total > 0  # updates computed during backward were kept
        runs[name] = (losses, _weights(model), opt.state_dict(), opt.state_bytes)
        opt.close()
        infinity.unwrap(model)
    a, b = runs["host"], runs[case]
    assert a[0] == b[0]
    assert_tensors_equal(b[1], a[1])
    assert_optimizer_states_equal(a[2], b[2])


# =========================================================================================
# (f) infinity's checkpoints
# =========================================================================================
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_checkpoint_round_trip_with_mixed_formats(tmp_path, tier):
    batches = _batches(6)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    model = _wrap(_net(), tmp_path / "a", tier, param_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states=_mixed3(model))
    _train(model, opt, batches[:3])
    infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _train(model, opt, batches[3:])
    want = _weights(model)
    want_sd = opt.state_dict()
    opt.close()
    infinity.unwrap(model)

    model2 = _wrap(_net(seed=9), tmp_path / "b", tier, param_tier="nvme")
    opt2 = infinity.optim.AdamW(model2.parameters(), lr=LR, states=_mixed3(model2))
    infinity.load_checkpoint(str(tmp_path / "ckpt"), model2, opt2)
    _train(model2, opt2, batches[3:])
    assert_tensors_equal(_weights(model2), want)
    assert_optimizer_states_equal(want_sd, opt2.state_dict())
    opt2.close()
    infinity.unwrap(model2)


# =========================================================================================
# layout, bytes, reports
# =========================================================================================
def test_uniform_layouts_are_unchanged_and_mixed_regions_are_disjoint():
    model = infinity.wrap(_net())
    root = max(engine_of(model).flats, key=lambda f: len(f.slots))
    n = len(root.slots)
    for fmt in ("fp32", "bf16", "8bit"):
        for master in ("fp32", "bf16_sr"):
            # one format in every slot: exactly the one-format layout
            assert layout_for(root, (fmt,) * n, True, master) == layout_for(root, fmt, True,
                                                                             master)
    assert layout_for(root, "fp32", True).nbytes == 12 * root.numel
    formats = ("fp32", "8bit", "bf16", "fp32", "8bit", "8bit")[:n]
    formats = formats + ("fp32",) * (n - len(formats))
    lay = layout_for(root, formats, True)
    assert lay.fmt == "mixed" and lay.formats == ("fp32", "bf16", "8bit")
    sizes = dict(lay.region_sizes)
    want = 4 * root.numel + 8 * sizes["fp32"] + 4 * sizes["bf16"] + 2 * sizes["8bit"] \
        + 8 * lay.blocks
    assert lay.nbytes == -(-want // 4096) * 4096
    assert lay.blocks == sum(-(-s.numel // 256) for s, f in zip(root.slots, formats)
                             if f == "8bit")
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    v = state_views(lay, buf)
    parts = [v.master] + [t for r in v.regions.values() for t in
                          (r.exp_avg, r.exp_avg_sq, r.exp_avg_absmax, r.exp_avg_sq_absmax)
                          if t is not None]
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # no overlap
    assert ranges[-1][1] - buf.data_ptr() <= lay.nbytes
    # each slot's moments are its own: writing one slot leaves the others' untouched. Values
    # of the format come back bitwise (8-bit: i + 1 as the format stores it)
    def stored(i: int, signed: bool) -> float:
        if formats[i] != "8bit":
            return float(i + 1)
        c, a = ops.quantize_8bit(torch.tensor([float(i + 1)]), signed=signed)
        return ops.dequantize_8bit(c, a, signed=signed).item()
    for i in range(n):
        v.set_slot_moments(root, i, torch.full((root.slots[i].numel,), stored(i, True)),
                           torch.full((root.slots[i].numel,), stored(i, False)))
    for i in range(n):
        m, s = v.slot_moments(root, i)
        assert torch.equal(m, torch.full_like(m, stored(i, True))), i
        assert torch.equal(s, torch.full_like(s, stored(i, False))), i
    m, s = v.moments_fp32(root)
    for i, slot in enumerate(root.slots):
        assert bool((m[slot.offset:slot.offset + slot.numel] == stored(i, True)).all())
    infinity.unwrap(model)


def test_stats_and_pure_functions_report_formats(tmp_path):
    with infinity.empty_init():
        meta = Net()
    assert formats_for(meta, "8bit") == EXPECTED_8BIT  # on meta, before any wrap
    model = _wrap(_net(), tmp_path, "nvme")
    assert "optimizer_states" not in infinity.stats(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, states="8bit")
    _train(model, opt, _batches(1))
    report = infinity.stats(model)["optimizer_states"]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert report == format_summary((sizes[n], f) for n, f in EXPECTED_8BIT.items())
    eight = [sizes[n] for n, f in EXPECTED_8BIT.items() if f == "8bit"]
    assert report["8bit"]["params"] == len(eight) == 6
    assert report["8bit"]["moment_bytes"] == sum(2 * k + 8 * -(-k // 256) for k in eight)
    assert report["fp32"]["moment_bytes"] == 8 * report["fp32"]["numel"]
    assert moment_nbytes(1000, "bf16") == 4000 and moment_nbytes(257, "8bit") == 514 + 16
    # the NVMe extents shrink with the 8-bit slots: less than the fp32 layout
    store = opt.core.wrapped.store(OptimizerPort.of(engine_of(model)))
    for s in opt.shards():
        assert store.layout(s).nbytes < layout_for(s.flat, "fp32", True).nbytes
    assert opt.state_dict()["state_formats"] == dict(enumerate(EXPECTED_8BIT[n] for n in
                                                               sizes))
    opt.close()
    infinity.unwrap(model)


def test_state_formats_keys_for_two_models():
    a, b = infinity.wrap(_net()), infinity.wrap(_net())
    opt = infinity.optim.AdamW(list(a.parameters()) + list(b.parameters()), states="8bit")
    f = opt.state_formats()
    n = len(EXPECTED_8BIT)
    assert {k: f[k] for k in EXPECTED_8BIT} == EXPECTED_8BIT  # the first model's by name
    assert [f[i] for i in range(n, 2 * n)] == list(EXPECTED_8BIT.values())  # then by index
    assert list(opt.state_formats(by="index")) == list(range(2 * n))
    opt.close()
    infinity.unwrap(a)
    infinity.unwrap(b)
