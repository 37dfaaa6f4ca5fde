"""infinity.estimate and the planner with frozen_format: the homes count the stored format
(0.5625 bytes per NF4 parameter of the layers, the rest in its dtype), gradients and optimizer
states only the trainable parameters; checked against what the engine really holds."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_frozen_nf4 import _lora_model  # noqa: E402

import infinity  # noqa: E402
from infinity.plan import estimate, plan  # noqa: E402
from infinity.plan.probe import probe  # noqa: E402
from infinity.runtime.engine import engine_of  # noqa: E402


@pytest.fixture(scope="module")
def pr(tmp_path_factory):
    d = tmp_path_factory.mktemp("est")
    return probe(str(d), quick=True, cache=str(d / "probe.json"))


def test_estimate_of_a_lora_model_matches_the_engine(pr):
    model = _lora_model(vocab=4096)
    plain = estimate(model, probe=pr, placements=["host"], batch=1, seq=8)
    t = estimate(model, probe=pr, placements=["host"], batch=1, seq=8, frozen_format="nf4")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert t.shape.trainable_params == trainable
    infinity.wrap(model, param_tier="host", frozen_format="nf4")
    held = infinity.stats(model)["tiers"]["host"]["params"]
    # the engine pads each quantized flat to a page and each parameter to a block
    n_flats = 2 * len(model.base_model.model.model.layers) + 2
    assert 0 <= held - t.shape.stored_bytes <= n_flats * 4096 + 64 * 4 * 100, \
        (held, t.shape.stored_bytes)
    assert t.rows[0].host_bytes < plain.rows[0].host_bytes
    infinity.unwrap(model)


def test_estimate_of_the_8b_config_counts_nf4_layers(pr):
    dims = dict(d_model=4096, ffn=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                vocab_size=128256, tied=False)
    t = estimate(None, probe=pr, batch=1, seq=256, frozen_format="nf4",
                 trainable_params=41_943_040, **dims)
    shape = t.shape
    layer = sum(p for p, k in zip(shape.block_params, shape.kinds) if k == "layer")
    rest = shape.params - layer
    assert shape.stored_bytes == int(layer * 0.5625 + rest * 4)
    assert {r.placement for r in t.rows}.isdisjoint({"device", "optim_host"})
    host = next(r for r in t.rows if r.placement == "host")
    # homes + fp32 gradients and moments of the adapters only (fp32 adapters homed on host
    # are their own master weights)
    assert host.host_bytes == pytest.approx(shape.stored_bytes + 41_943_040 * (4 + 8),
                                            rel=1e-6)


def test_planner_with_frozen_format_wraps(pr):
    model = _lora_model()
    chosen = plan(model, probe=pr, frozen_format="nf4", host_budget="2GiB")
    assert chosen.param_tier in ("host", "nvme")
    assert chosen.estimate.host_bytes < plan(model, probe=pr, host_budget="2GiB"
                                             ).estimate.host_bytes
    infinity.wrap(model, frozen_format="nf4", host_budget="2GiB")
    assert any(f.category.endswith(".nf4") for f in engine_of(model).flats)
    infinity.unwrap(model)
