"""What the estimates need to know about a model: parameter count and bytes, its blocks (the
unit of offload) and the GPT-like shape that sets its FLOPs. Works on meta-device models (no
memory is touched) and on a bare parameter count."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from torch import nn

from ..runtime.partition import partition


@dataclass(frozen=True)
class ModelShape:
    params: int                  # parameter count (tied weights once)
    param_bytes: int             # home bytes (the model's own dtypes)
    block_params: Tuple[int, ...]  # parameters per block, root block last
    block_bytes: Tuple[int, ...]
    n_layers: int
    d_model: int
    name: str = "model"
    vocab_size: Optional[int] = None
    n_heads: Optional[int] = None

    @property
    def largest_block_bytes(self) -> int:
        return max(self.block_bytes)

    @property
    def largest_block_params(self) -> int:
        return max(self.block_params)

    @property
    def layer_block_bytes(self) -> int:
        """The largest non-root block (what streams), or the root when it is the only one."""
        return max(self.block_bytes[:-1] or self.block_bytes)

    @property
    def root_bytes(self) -> int:
        return self.block_bytes[-1]

    @property
    def bytes_per_param(self) -> float:
        return self.param_bytes / max(1, self.params)


def _guess_d_model(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    for attr in ("d_model", "hidden_size", "n_embd"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    widths = Counter(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
    return widths.most_common(1)[0][0] if widths else 512


def shape_of(model: nn.Module, block_rule=None) -> ModelShape:
    specs = partition(model, block_rule)
    if not specs:
        raise ValueError("infinity.estimate: the model has no parameters")
    params, nbytes = [], []
    for s in specs:
        params.append(sum(p.numel() for _, _, _, p in s.params))
        nbytes.append(sum(p.numel() * p.element_size() for _, _, _, p in s.params))
    layers = sum(1 for s in specs if not s.is_root)
    embs = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    cfg = getattr(model, "cfg", None)
    return ModelShape(sum(params), sum(nbytes), tuple(params), tuple(nbytes), max(1, layers),
                      _guess_d_model(model), type(model).__name__,
                      max(embs) if embs else None, getattr(cfg, "n_heads", None))


def shape_of_count(params: int, *, n_layers: Optional[int] = None,
                   d_model: Optional[int] = None, bytes_per_param: int = 4,
                   vocab_size: int = 50304) -> ModelShape:
    """A GPT of ``params`` parameters: ``n_layers`` of 12·d² each plus an embedding of
    ``vocab_size``·d (tied head). Missing dimensions follow GPT-3's aspect (d ≈ 128·layers)."""
    if isinstance(params, bool) or not isinstance(params, (int, float)) or params <= 0:
        raise ValueError(f"infinity.estimate: a parameter count must be positive, got {params!r}")
    params = int(params)
    if d_model is None:
        if n_layers is not None:
            d_model = max(64, int(((params / (12 * n_layers)) ** 0.5) // 64 * 64))
        else:
            d_model = max(64, int(((params * 128 / 12) ** (1 / 3)) // 64 * 64))
    emb = vocab_size * d_model
    per_layer = 12 * d_model * d_model + 13 * d_model
    if n_layers is None:
        n_layers = max(1, round((params - emb) / per_layer))
    emb = max(0, params - n_layers * per_layer)
    blocks = (per_layer,) * n_layers + (emb,)
    return ModelShape(params, params * bytes_per_param, blocks,
                      tuple(b * bytes_per_param for b in blocks), n_layers, d_model,
                      f"GPT {params / 1e6:.0f}M", vocab_size, max(1, d_model // 64))


def describe(model_or_count: Union[nn.Module, int, float, ModelShape], **kw) -> ModelShape:
    if isinstance(model_or_count, ModelShape):
        return model_or_count
    if isinstance(model_or_count, nn.Module):
        return shape_of(model_or_count, kw.get("block_rule"))
    return shape_of_count(model_or_count, n_layers=kw.get("n_layers"),
                          d_model=kw.get("d_model"))


def parse_count(text: Union[str, int, float]) -> int:
    """``"125M"``, ``"2B"``, ``"1.3e9"`` or a number -> an int count."""
    if isinstance(text, (int, float)):
        return int(text)
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], None)
    try:
        return int(float(t[:-1]) * scale) if scale else int(float(t))
    except ValueError:
        raise ValueError(f"infinity: {text!r} is not a parameter count (e.g. 125M, 2B)") from None


def parse_bytes(text: Union[str, int]) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1.5G"`` or a number -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units: Sequence[Tuple[str, int]] = (("TIB", 1 << 40), ("GIB", 1 << 30), ("MIB", 1 << 20),
                                        ("KIB", 1 << 10), ("TB", 10**12), ("GB", 10**9),
                                        ("MB", 10**6), ("KB", 10**3), ("T", 1 << 40),
                                        ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10),
                                        ("B", 1))
    for suffix, scale in units:
        if t.endswith(suffix):
            try:
                return int(float(t[:-len(suffix)]) * scale)
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise ValueError(f"infinity: {text!r} is not a size (e.g. 8GiB, 500MB)") from None
