"""Shared pieces of the trainer-integration tests (transformers, accelerate, Lightning, PEFT).

Every test trains the same tiny model twice (or more) from one initialisation: once plain, once
wrapped by ``infinity.wrap``, and compares losses and weights. Models are built from configs
(never downloaded): a Llama with hidden size 32, 2 layers, vocabulary 128.

Tolerances (fp32 everywhere):
* wrapped vs. unwrapped, same optimizer class: the same arithmetic on the same numbers, so the
  results are expected to be bitwise equal; asserted to ``RTOL``/``ATOL`` (1e-6 relative) to
  leave room for a SIMD tail computed with or without FMA.
* a resumed run vs. the uninterrupted run of the same setup: asserted bitwise equal.
* saved -> reloaded weights vs. the weights in memory: bitwise equal.
"""
from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Mapping, Optional

import pytest
import torch

import infinity

RTOL = 1e-6
ATOL = 1e-7
VOCAB = 128
SEQ = 8

# wrap settings the integrations run under; "nvme" needs nvme_path (the test's tmp_path)
WRAP_HOST = {"param_tier": "host"}
WRAP_NVME = {"param_tier": "nvme", "grad_tier": "host"}
TIERS = [pytest.param(WRAP_HOST, id="host"), pytest.param(WRAP_NVME, id="nvme")]


def wrap_settings(settings: Mapping, tmp_path) -> Dict:
    out = dict(settings)
    if out.get("param_tier") == "nvme" or out.get("grad_tier") == "nvme":
        swap = tmp_path / "swap"
        swap.mkdir(parents=True, exist_ok=True)
        out["nvme_path"] = str(swap)
    return out


def llama_config(**overrides):
    from transformers import LlamaConfig
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def gpt2_config(**overrides):
    from transformers import GPT2Config
    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # tied lm_head by default
    kw.update(overrides)
    return GPT2Config(**kw)


def llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides))


def wrapped_copy(model: torch.nn.Module, settings: Mapping, tmp_path) -> torch.nn.Module:
    """A deep copy of ``model`` (same initial weights) wrapped with ``settings``."""
    twin = copy.deepcopy(model)
    infinity.wrap(twin, **wrap_settings(settings, tmp_path))
    return twin


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic causal-LM samples: dicts of input_ids / labels (HF style)."""

    def __init__(self, n: int, seq: int = SEQ, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(n, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for t in range(1, seq):  # a learnable rule plus some noise
            x[:, t] = (x[:, t - 1] * 7 + 3) % VOCAB
        noise = torch.rand(n, seq, generator=g) < 0.2
        x[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
        self.ids = x

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def weights(model: torch.nn.Module, *, trainable_only: bool = False) -> Dict[str, torch.Tensor]:
    """A detached copy of every state_dict entry (or of the trainable parameters)."""
    if trainable_only:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *,
                   exact: bool = False, what: str = "") -> None:
    assert sorted(actual) == sorted(expected), (
        f"{what}: keys differ: missing {sorted(set(expected) - set(actual))}, "
        f"unexpected {sorted(set(actual) - set(expected))}")
    for k in expected:
        a, e = actual[k].detach().cpu(), expected[k].detach().cpu()
        if exact:
            assert torch.equal(a, e), (f"{what}: {k} differs, max abs diff "
                                       f"{(a.float() - e.float()).abs().max().item():.3g}")
        else:
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"{what}: {k}: {m}")


def assert_losses(actual: Iterable[float], expected: Iterable[float], *, exact: bool = False,
                  what: str = "") -> None:
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected) and actual, f"{what}: {actual} vs {expected}"
    if exact:
        assert actual == expected, f"{what}: losses {actual} != {expected}"
    else:
        torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_changed(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                   names: Optional[List[str]] = None) -> None:
    """Training really changed the (named) weights: guards against a silent no-op step."""
    names = names if names is not None else list(before)
    unchanged = [n for n in names if torch.equal(before[n], after[n])]
    assert not unchanged, f"training left these weights unchanged: {unchanged}"


def reset_accelerate() -> None:
    """accelerate keeps process-wide singletons; each Accelerator() of a test starts clean."""
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_example(name: str, *argv: str) -> dict:
    """Runs ``examples/<name>.py``'s main(argv) in this process (the examples stay runnable)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"infinity_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))
