"""The GPT ladder of ``infinity bench``: a size name -> a GPT config, built on meta when large."""

from __future__ import annotations

from typing import List, Tuple

from torch import nn

from ..models import GPTConfig, TinyGPT
from ..plan.shape import parse_count

VOCAB = 8192
QUICK_LADDER = ("tiny",)
QUICK_PLACEMENTS = ("device", "host", "nvme")
# Steps of 0.3-3 s at batch 2 x seq 128 on a 2-core CPU (long enough to time, against the
# engine's fixed costs of a few ms per block), the whole ladder (7 placements + the planner,
# 2 runs each) in about 15 minutes there. Larger rungs: --size 125M --size 1B --size 2B.
DEFAULT_LADDER = ("10M", "25M", "50M")


def config_for(size: str, seq: int) -> GPTConfig:
    """``size``: "tiny" (~0.2M), "small" (~1M) or a parameter count ("125M", "2B"). Width
    follows the count (d ≈ 64·layers, a multiple of 64), vocabulary 8192, tied head."""
    if size == "tiny":
        return GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=1, max_seq=seq)
    if size == "small":
        return GPTConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=2, max_seq=seq)
    n = parse_count(size)
    best: Tuple[float, int, int] = (float("inf"), 64, 1)
    for d in range(64, 8193, 64):
        per_layer = 12 * d * d + 13 * d
        layers = round((n - VOCAB * d - seq * d) / per_layer)
        if layers < 1:
            continue
        total = layers * per_layer + VOCAB * d + seq * d
        aspect = abs((d / layers) / 64 - 1)  # GPT-like aspect: d ≈ 64 x layers
        err = abs(total - n) / n + 0.05 * aspect
        if err < best[0]:
            best = (err, d, layers)
    _, d, layers = best
    return GPTConfig(
        vocab_size=VOCAB, d_model=d, n_layers=layers, n_heads=max(1, d // 64), max_seq=seq
    )


def init_weights(module: nn.Module) -> None:
    """TinyGPT's own initialization, module by module (for ``wrap(..., init=...)``)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and not isinstance(module, (nn.Linear, nn.Embedding)):
        reset()
    TinyGPT.init_module(module)


def ladder(sizes: List[str], seq: int) -> List[Tuple[str, GPTConfig]]:
    return [(s, config_for(s, seq)) for s in sizes]
