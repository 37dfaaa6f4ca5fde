"""infinity.estimate of real model shapes: a Hugging Face config.json (or the same dimensions as
keywords / CLI flags) of a Llama-style decoder counts exactly the parameters, and the blocks, of
the transformers model built from it on the meta device."""
import json
import os
import subprocess
import sys

import pytest
import torch

import infinity
from infinity.plan import estimate
from infinity.plan.probe import probe
from infinity.plan.shape import describe, shape_of

transformers = pytest.importorskip("transformers")

# published sizes: Llama-3.2-3B (tied) and Llama-3.1-8B (untied)
LLAMA_3B = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True)
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                tie_word_embeddings=False)
FLAGS = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
         "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
         "intermediate_size": "ffn", "vocab_size": "vocab_size", "tie_word_embeddings": "tied"}


@pytest.fixture(scope="module")
def pr():
    return probe(None, quick=True)  # the suite's cached quick probe: no disk, no measuring


def _meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


@pytest.mark.parametrize("dims, approx", [(LLAMA_3B, 3.21e9), (LLAMA_8B, 8.03e9)],
                         ids=["llama-3.2-3b", "llama-3.1-8b"])
def test_llama_config_counts_the_meta_model_exactly(tmp_path, pr, dims, approx):
    cfg = transformers.LlamaConfig(**dims)
    model = _meta(transformers.LlamaForCausalLM, cfg)
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e7) == round(approx / 1e7)
    real = shape_of(model)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dims))
    for source in (cfg, cfg.to_dict(), str(path), tmp_path):  # config, dict, file, model folder
        t = estimate(source, probe=pr, placements=["host"])
        assert t.shape.params == n
        assert t.shape.block_params == real.block_params  # 1 block a layer + the root block
        assert t.shape.param_bytes == 4 * n and t.shape.n_layers == dims["num_hidden_layers"]
    # the same shape from keywords alone
    t = estimate(None, probe=pr, placements=["host"],
                 **{FLAGS[k]: v for k, v in dims.items()})
    assert t.shape.params == n and t.shape.block_params == real.block_params
    assert f"{n:,} parameters" in str(t)


def test_overrides_and_tied_default(pr):
    dims = dict(LLAMA_8B, num_hidden_layers=2)
    small = _meta(transformers.LlamaForCausalLM, transformers.LlamaConfig(**dims))
    # a config with fewer layers: the overrides replace what the config says
    assert describe(LLAMA_8B, n_layers=2).params == sum(p.numel() for p in small.parameters())
    tied = describe(LLAMA_8B, n_layers=2, tied=True)
    assert tied.params == describe(LLAMA_8B, n_layers=2).params - 128256 * 4096
    untied = {k: v for k, v in LLAMA_3B.items() if k != "tie_word_embeddings"}
    assert describe(untied).params == describe(dict(LLAMA_3B, tie_word_embeddings=False)).params
    no_gqa = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    assert describe(no_gqa).params == describe(LLAMA_8B, n_kv_heads=32).params


@pytest.mark.parametrize("name, extra", [
    ("Llama", dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    ("Mistral", {}), ("Qwen2", {}), ("Qwen3", dict(head_dim=32)), ("Gemma", dict(head_dim=32)),
    ("Gemma2", dict(head_dim=32))])
def test_other_llama_style_configs_count_exactly(name, extra):
    cfg = getattr(transformers, f"{name}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=300, **extra)
    real = shape_of(_meta(getattr(transformers, f"{name}ForCausalLM"), cfg))
    got = describe(cfg.to_dict())
    assert (got.params, got.block_params) == (real.params, real.block_params)


def test_bad_shapes_name_infinity_the_value_and_the_remedy(tmp_path):
    partial = {k: v for k, v in LLAMA_3B.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"infinity\.estimate: the config lack.*"
                                         r"'intermediate_size' \(--ffn\)"):
        describe(partial)
    with pytest.raises(ValueError, match=r"n_heads=24 is not a multiple of n_kv_heads=5"):
        describe(LLAMA_3B, n_kv_heads=5)
    with pytest.raises(ValueError, match="mixture-of-experts.*num_local_experts=8.*meta device"):
        describe(dict(LLAMA_3B, num_local_experts=8))
    with pytest.raises(ValueError, match="dimension.*ffn.*not a parameter count"):
        describe("2B", ffn=1024)
    with pytest.raises(FileNotFoundError, match=r"infinity\.estimate: no model config at"):
        describe(str(tmp_path / "missing" / "config.json"))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .* as a JSON config"):
        describe(str(bad))
    with pytest.raises(ValueError, match="has its own shape"):
        describe(infinity.models.TinyGPT(infinity.models.GPTConfig(
            vocab_size=16, d_model=8, n_layers=1, n_heads=1, max_seq=4)), ffn=3)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cli_estimates_a_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                **LLAMA_8B}))
    r = subprocess.run([sys.executable, "-m", "infinity", "estimate", "--config", str(path),
                        "--quick-probe", "--placement", "host"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM: 8,030,261,248 parameters (8.03B" in r.stdout


def test_cli_flags_describe_the_shape_and_override_a_config(tmp_path, capsys):
    from infinity import cli
    flags = ["--quick-probe", "--placement", "host"]
    assert cli.main(["estimate", "--d-model", "3072", "--layers", "28", "--heads", "24",
                     "--kv-heads", "8", "--ffn", "8192", "--vocab", "128256", "--tied",
                     *flags]) == 0
    assert "3,212,749,824 parameters (3.21B" in capsys.readouterr().out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3B))
    assert cli.main(["estimate", "--config", str(path), "--layers", "2", "--no-tied",
                     *flags]) == 0
    layer = 2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192 + 2 * 3072
    assert f"{2 * layer + 2 * 128256 * 3072 + 3072:,} parameters" in capsys.readouterr().out
    assert cli.main(["estimate", "--d-model", "3072", "--layers", "28", *flags]) == 1
    err = capsys.readouterr().err
    assert "infinity.estimate" in err and "'intermediate_size' (--ffn)" in err
    assert cli.main(["estimate", "2B", "--config", str(path), *flags]) == 1
    assert "not both" in capsys.readouterr().err


def test_8bit_states_count_the_safeguards_fp32_moments():
    """With states="8bit" the estimate counts the embedding (and tensors under 4096 elements)
    at fp32 moments, as infinity.optim's defaults keep them, from a config and from a meta
    model alike; the table names that cost."""
    import torch
    import transformers

    from infinity.optim.step.formats import formats_for
    from infinity.plan.estimate import _state_bpp
    from infinity.plan.placements import placement, state_bytes_per_param
    from infinity.plan.shape import decoder_dims, shape_of
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                   num_hidden_layers=28, num_attention_heads=24,
                                   num_key_value_heads=8, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    full = sum(p.numel() for n, p in model.named_parameters()
               if formats_for(model, "8bit")[n] != "8bit")
    assert full == 128256 * 3072 + 3072 * (2 * 28 + 1)  # embedding + RMSNorm weights
    shape = decoder_dims(cfg).shape()
    assert shape.full_moment_params == full == shape_of(model).full_moment_params
    pl = [p for p in __import__("infinity.plan.placements", fromlist=["PLACEMENTS"]).PLACEMENTS
          if p.states == "8bit"][0]
    s8, s32 = state_bytes_per_param("8bit"), state_bytes_per_param("fp32")
    want = (s8 * (shape.params - full) + s32 * full) / shape.params
    assert abs(_state_bpp(shape, pl) - want) < 1e-9
    assert placement(pl.name).states == "8bit"


def test_published_bf16_weights_halve_the_homes_and_compute_at_the_bf16_rate(pr, capsys):
    from infinity import cli
    fp32 = estimate(LLAMA_3B, probe=pr, placements=["host"])
    bf16 = estimate(LLAMA_3B, probe=pr, placements=["host"], dtype=torch.bfloat16)
    assert bf16.shape.params == fp32.shape.params
    assert bf16.shape.param_bytes * 2 == fp32.shape.param_bytes
    ratio = pr.flops_at(3072) / pr.flops_at(3072, torch.bfloat16)
    assert bf16.rows[0].compute_s == pytest.approx(fp32.rows[0].compute_s * ratio, rel=1e-9)
    with pytest.raises(ValueError, match="infinity.estimate: dtype describes a config"):
        estimate(_meta(transformers.LlamaForCausalLM,
                       transformers.LlamaConfig(**{**LLAMA_3B, "num_hidden_layers": 1})),
                 probe=pr, dtype=torch.bfloat16)
    flags = ["--d-model", "3072", "--layers", "28", "--heads", "24", "--kv-heads", "8",
             "--ffn", "8192", "--vocab", "128256", "--tied", "--quick-probe",
             "--placement", "host"]
    assert cli.main(["estimate", *flags, "--dtype", "bf16"]) == 0
    assert "3,212,749,824 parameters" in capsys.readouterr().out


def test_cli_tiled_head_and_whole_embedding_match_the_python_api(pr, tmp_path, capsys,
                                                                 monkeypatch):
    from infinity import cli
    from infinity.plan import plan
    # the CLI's probe is the fixture's (infinity.plan.probe the module, not the function)
    monkeypatch.setattr(sys.modules["infinity.plan.probe"], "probe", lambda *a, **k: pr)
    flags = ["--d-model", "3072", "--layers", "2", "--heads", "24", "--kv-heads", "8",
             "--ffn", "8192", "--vocab", "128256", "--tied", "--dtype", "bf16", "--batch", "1",
             "--seq", "256", "--quick-probe", "--placement", "host"]
    dims = dict(d_model=3072, n_layers=2, n_heads=24, n_kv_heads=8, ffn=8192,
                vocab_size=128256, tied=True, dtype=torch.bfloat16, batch=1, seq=256,
                probe=pr, placements=["host"])
    outputs = {}
    for extra, kw in (([], {}), (["--tiled-head"], dict(tiled_head=True)),
                      (["--whole-embedding"], dict(embedding_rows=False))):
        assert cli.main(["estimate", *flags, *extra]) == 0
        outputs[tuple(extra)] = out = capsys.readouterr().out
        assert out == str(estimate(None, **dims, **kw))
    # the knobs change what the table counts: one tile of the head instead of the logits
    assert "head tile" in outputs[("--tiled-head",)] and "logits" in outputs[()]
    assert "head tile" not in outputs[()]
    # --plan passes them on to the planner
    assert cli.main(["estimate", *flags, "--tiled-head", "--plan", "--ram-budget", "16GiB"]) == 0
    out = capsys.readouterr().out
    shape = estimate(None, **dims).shape
    want = plan(shape, probe=pr, host_budget=16 << 30, batch=1, seq=256, tiled_head=True)
    assert str(want) in out
