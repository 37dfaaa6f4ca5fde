"""What the estimates need to know about a model: parameter count and bytes, its blocks (the
unit of offload) and the GPT-like shape that sets its FLOPs. Works on meta-device models (no
memory is touched), on a Hugging Face ``config.json`` of a Llama-style decoder (or the same
dimensions given one by one: :class:`DecoderDims`) and on a bare parameter count."""

from __future__ import annotations

import json
import numbers
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from torch import nn

from ..policy import OffloadPolicy
from ..runtime.build.split import LAYER, OUTER, ROOT, partition

# what an outer block holds (ModelShape.block_roles): the input embedding, the LM head, or both
# (a tied embedding and head: one block); "" for anything else
EMBEDDING, HEAD, TIED = "embedding", "head", "tied"

# modules outside the layers holding at least this many elements are blocks of their own
# (the engine's default: OffloadPolicy.param_persistence_threshold)
PERSISTENCE_THRESHOLD: int = OffloadPolicy.param_persistence_threshold


@dataclass(frozen=True)
class ModelShape:
    params: int  # parameter count (tied weights once)
    param_bytes: int  # home bytes (the model's own dtypes)
    # parameters per block in the engine's order: layer blocks, outer blocks (modules outside
    # the layers: embedding, head), the root block last
    block_params: Tuple[int, ...]
    block_bytes: Tuple[int, ...]
    n_layers: int
    d_model: int
    name: str = "model"
    vocab_size: Optional[int] = None
    n_heads: Optional[int] = None
    # parameters that keep fp32 moments when the optimizer's states are "8bit" (embeddings,
    # tensors under min_8bit_size: infinity.optim.step.formats' safeguards)
    full_moment_params: int = 0
    # each block's kind ("layer", "outer", "root"); empty: layers, then the root block last
    block_kinds: Tuple[str, ...] = ()
    # with a frozen base (frozen_format, LoRA): the homes' bytes in their stored format and the
    # parameters the optimizer steps (None: param_bytes, and every parameter trainable)
    stored_bytes: Optional[int] = None
    trainable_params: Optional[int] = None
    # per block: EMBEDDING, HEAD, TIED or "" (empty: no block holds the embedding or the head);
    # tied: one parameter for the embedding and the head (None: unknown); the MLP width and the
    # key/value width of a layer (None: 4 * d_model and d_model), for the activations' bytes
    block_roles: Tuple[str, ...] = ()
    tied: Optional[bool] = None
    ffn: Optional[int] = None
    kv_dim: Optional[int] = None

    def role_bytes(self, role: str) -> int:
        """The bytes of the outer block holding ``role`` (0 without one)."""
        return sum(b for b, r in zip(self.block_bytes, self.block_roles) if r == role)

    @property
    def kinds(self) -> Tuple[str, ...]:
        if self.block_kinds:
            return self.block_kinds
        n = len(self.block_bytes)
        return (LAYER,) * (n - 1) + (ROOT,) if n > 1 else (LAYER,)

    def _bytes_of(self, kind: str) -> Tuple[int, ...]:
        return tuple(b for b, k in zip(self.block_bytes, self.kinds) if k == kind)

    @property
    def largest_block_bytes(self) -> int:
        return max(self.block_bytes)

    @property
    def largest_block_params(self) -> int:
        return max(self.block_params)

    @property
    def layer_block_bytes(self) -> int:
        """The largest layer block (what streams), else the largest block."""
        return max(self._bytes_of(LAYER) or self.block_bytes)

    @property
    def outer_block_bytes(self) -> int:
        """The largest outer block (embedding, head: fetched when it runs), 0 without one."""
        return max(self._bytes_of(OUTER), default=0)

    @property
    def streamed_block_bytes(self) -> int:
        """The largest block fetched and released during a step (layer or outer)."""
        return max(self.layer_block_bytes, self.outer_block_bytes)

    @property
    def root_bytes(self) -> int:
        """The root block, materialized for the whole step (0 without one)."""
        return sum(self._bytes_of(ROOT))

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


def shape_of(
    model: nn.Module, block_rule=None, persistence_threshold: Optional[int] = PERSISTENCE_THRESHOLD
) -> ModelShape:
    """The blocks ``infinity.wrap`` makes of ``model`` (``block_rule``,
    ``param_persistence_threshold``) and its size."""
    specs = partition(model, block_rule, persistence_threshold)
    if not specs:
        raise ValueError("infinity.estimate: the model has no parameters")
    params, nbytes = [], []
    for s in specs:
        params.append(sum(p.numel() for _, _, _, p in s.params))
        nbytes.append(sum(p.numel() * p.element_size() for _, _, _, p in s.params))
    layers = sum(1 for s in specs if s.kind == LAYER)
    embs = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    from ..optim.step.formats import formats_for  # pure: the safeguards' choice per parameter

    chosen = formats_for(model, "8bit")
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    full = sum(sizes.get(name, 0) for name, fmt in chosen.items() if fmt != "8bit")
    emb, head = _io_embeddings(model)
    tied = (
        emb is not None
        and head is not None
        and getattr(head, "weight", None) is getattr(emb, "weight", False)
    )
    roles = tuple(_role(s, emb, head) for s in specs)
    d_model = _guess_d_model(model)
    ffn = _cfg_int(cfg, "intermediate_size", "n_inner", "ffn_dim")
    kv_heads = _cfg_int(cfg, "num_key_value_heads")
    head_dim = _cfg_int(cfg, "head_dim") or (
        d_model // heads if isinstance(heads, int) and heads > 0 else None
    )
    return ModelShape(
        sum(params),
        sum(nbytes),
        tuple(params),
        tuple(nbytes),
        max(1, layers),
        d_model,
        type(model).__name__,
        max(embs) if embs else None,
        heads if isinstance(heads, int) else None,
        full,
        tuple(s.kind for s in specs),
        block_roles=roles,
        tied=tied if emb is not None else None,
        ffn=ffn,
        kv_dim=kv_heads * head_dim if kv_heads and head_dim else None,
    )


def _cfg_int(cfg: Any, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _io_embeddings(model: nn.Module) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
    """The model's input embedding and LM head (transformers' get_input_embeddings /
    get_output_embeddings); without those, its only nn.Embedding (a GPT with a tied head)."""
    emb = head = None
    for attr in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, attr, None)
        try:
            found = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, nn.Module):
            if attr == "get_input_embeddings":
                emb = found
            else:
                head = found
    if emb is None:
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        emb = embs[0] if len(embs) == 1 else None
        if emb is not None and head is None:
            head = next(
                (m for m in model.modules() if isinstance(m, nn.Linear) and m.weight is emb.weight),
                None,
            )
    return emb, head


def _role(spec: Any, emb: Optional[nn.Module], head: Optional[nn.Module]) -> str:
    if spec.kind != OUTER:
        return ""
    has_emb = emb is not None and any(m is emb for m in spec.modules)
    has_head = head is not None and any(m is head for m in spec.modules)
    return TIED if has_emb and has_head else EMBEDDING if has_emb else HEAD if has_head else ""


def shape_of_count(
    params: int,
    *,
    n_layers: Optional[int] = None,
    d_model: Optional[int] = None,
    bytes_per_param: int = 4,
    vocab_size: int = 50304,
) -> ModelShape:
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
    # the embedding (tied head) is a block of its own from the persistence threshold on
    outer = emb >= PERSISTENCE_THRESHOLD
    kinds = (LAYER,) * n_layers + ((OUTER,) if outer else (ROOT,))
    return ModelShape(
        params,
        params * bytes_per_param,
        blocks,
        tuple(b * bytes_per_param for b in blocks),
        n_layers,
        d_model,
        f"GPT {params / 1e6:.0f}M",
        vocab_size,
        max(1, d_model // 64),
        block_kinds=kinds,
        block_roles=("",) * n_layers + (TIED if outer else "",),
        tied=True,
        ffn=4 * d_model,
        kv_dim=d_model,
    )


# The decoder dimensions, each as (DecoderDims field and estimate() keyword, config.json key,
# CLI flag). Keywords and flags override what a config says.
DECODER_KEYS = (
    ("d_model", "hidden_size", "--d-model"),
    ("n_layers", "num_hidden_layers", "--layers"),
    ("n_heads", "num_attention_heads", "--heads"),
    ("n_kv_heads", "num_key_value_heads", "--kv-heads"),
    ("ffn", "intermediate_size", "--ffn"),
    ("vocab_size", "vocab_size", "--vocab"),
    ("tied", "tie_word_embeddings", "--tied"),
    ("head_dim", "head_dim", "--head-dim"),
)
DECODER_OPTIONS = tuple(k for k, _, _ in DECODER_KEYS)
# Keys of mixture-of-experts configs: their MLPs are not one gate/up/down per layer.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# model_types whose transformers config class ties the head by default (when config.json has
# no tie_word_embeddings, transformers builds them tied; the others untied)
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class DecoderDims:
    """A Llama-style decoder (Llama, Mistral, Qwen2/3, Gemma): per layer q/k/v/o projections
    with grouped-query attention (``n_kv_heads`` key/value heads of ``head_dim``, default
    ``d_model // n_heads``), a gate/up/down MLP of width ``ffn`` and two RMSNorm weights; then
    a final norm, the embedding and an lm_head (the embedding itself when ``tied``). Biases:
    ``attention_bias`` on q/k/v/o (Llama's key), ``qkv_bias`` on q/k/v only (Qwen2),
    ``mlp_bias`` on gate/up/down; ``qk_norm``: a head_dim RMSNorm on q and on k (Qwen3,
    Gemma 3); ``norms_per_layer``: 4 for Gemma 2 and 3 (pre/post attention and MLP). Other
    model_types with these config keys are counted as Llama."""

    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    vocab_size: int
    n_kv_heads: Optional[int] = None
    tied: bool = False
    head_dim: Optional[int] = None
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    name: str = "decoder"

    def __post_init__(self) -> None:
        for f in ("d_model", "n_layers", "n_heads", "ffn", "vocab_size", "n_kv_heads", "head_dim"):
            v = getattr(self, f)
            if v is None and f in ("n_kv_heads", "head_dim"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(
                    f"infinity.estimate: {f}={v!r} must be a positive int ({_flag_help(f)})"
                )
        kv = self.kv_heads
        if self.n_heads % kv:
            raise ValueError(
                f"infinity.estimate: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={kv} (grouped-query attention shares each key/value "
                "head among a whole number of query heads); fix --heads/--kv-heads"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"infinity.estimate: d_model={self.d_model} is not a multiple of "
                f"n_heads={self.n_heads}; give head_dim (config.json 'head_dim')"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def layer_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_size, self.kv_heads * self.head_size
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv + d
        elif self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_size
        mlp = 3 * d * self.ffn + ((2 * self.ffn + d) if self.mlp_bias else 0)
        return attn + mlp + self.norms_per_layer * d  # RMSNorm weights (input, post-attention)

    @property
    def root_params(self) -> int:
        """The parameters outside the layers: embedding, final norm, untied lm_head."""
        emb = self.vocab_size * self.d_model
        return emb + self.d_model + (0 if self.tied else emb)

    @property
    def params(self) -> int:
        return self.n_layers * self.layer_params + self.root_params

    def shape(
        self, bytes_per_param: int = 4, persistence_threshold: Optional[int] = PERSISTENCE_THRESHOLD
    ) -> ModelShape:
        """The engine's blocks, as ``partition`` makes them for the transformers model: one
        per layer; the embedding (with a tied head) and an untied head as outer blocks when
        they hold at least ``persistence_threshold`` elements; the root block last (the final
        norm and whatever stayed under the threshold)."""
        emb = self.vocab_size * self.d_model
        outer = [emb] + ([] if self.tied else [emb])
        big = [n for n in outer if persistence_threshold is not None and n >= persistence_threshold]
        root = self.root_params - sum(big)
        blocks = (self.layer_params,) * self.n_layers + tuple(big) + ((root,) if root else ())
        kinds = (LAYER,) * self.n_layers + (OUTER,) * len(big) + ((ROOT,) if root else ())
        names = [TIED if self.tied else EMBEDDING] + ([] if self.tied else [HEAD])
        roles = tuple(
            r
            for r, n in zip(names, outer)
            if persistence_threshold is not None and n >= persistence_threshold
        )
        return ModelShape(
            self.params,
            self.params * bytes_per_param,
            blocks,
            tuple(b * bytes_per_param for b in blocks),
            self.n_layers,
            self.d_model,
            self.name,
            self.vocab_size,
            self.n_heads,
            self.full_moment_params,
            kinds,
            block_roles=("",) * self.n_layers + roles + (("",) if root else ()),
            tied=self.tied,
            ffn=self.ffn,
            kv_dim=self.kv_heads * self.head_size,
        )

    @property
    def full_moment_params(self) -> int:
        """Parameters that keep fp32 moments under states="8bit": the embedding (tied with the
        head or not; an untied head is a Linear and goes 8-bit) and every tensor under
        min_8bit_size (4096 elements: norm weights and biases of narrow models)."""
        from ..optim.step.formats import MIN_8BIT_SIZE

        d, hs = self.d_model, self.head_size
        small = [d] * (self.norms_per_layer * self.n_layers + 1)  # RMSNorm weights
        q, kv = self.n_heads * hs, self.kv_heads * hs
        if self.attention_bias:
            small += [q, kv, kv, d] * self.n_layers
        elif self.qkv_bias:
            small += [q, kv, kv] * self.n_layers
        if self.qk_norm:
            small += [hs, hs] * self.n_layers
        if self.mlp_bias:
            small += [self.ffn, self.ffn, d] * self.n_layers
        return self.vocab_size * d + sum(n for n in small if n < MIN_8BIT_SIZE)


def _flag_help(field_name: str) -> str:
    for f, key, flag in DECODER_KEYS:
        if f == field_name:
            return f"config.json {key!r}" + (f", flag {flag}" if flag else "")
    return field_name


def load_config(config: Any) -> Dict[str, Any]:
    """A model config as a dict: a dict, an object with ``to_dict()`` (transformers'
    PretrainedConfig), or the path of a ``config.json`` or of a folder holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"infinity.estimate: a model config must be a dict, a transformers "
            f"config or the path of a config.json, got {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"infinity.estimate: no model config at {path!r}; pass the path "
            "of a Hugging Face config.json (or of the model folder holding "
            "it)"
        )
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"infinity.estimate: cannot read {path!r} as a JSON config: {exc}; "
            "pass a Hugging Face config.json"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"infinity.estimate: {path!r} holds a JSON {type(data).__name__}, not "
            "a config object; pass a Hugging Face config.json"
        )
    return data


def decoder_dims(config: Any = None, **overrides: Any) -> DecoderDims:
    """The :class:`DecoderDims` of a Hugging Face config (see :func:`load_config`; None: only
    the keyword dimensions), keywords (``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
    ``ffn``, ``vocab_size``, ``tied``, ``head_dim``; None: from the config) overriding it. A
    config without ``tie_word_embeddings`` is untied unless it is a Gemma (as transformers
    builds them); without ``num_key_value_heads``, one key/value head per query head."""
    unknown = sorted(set(overrides) - set(DECODER_OPTIONS))
    if unknown:
        raise TypeError(
            f"infinity.estimate: unknown decoder dimension(s) {unknown}; use "
            f"{list(DECODER_OPTIONS)}"
        )
    cfg = load_config(config) if config is not None else {}
    where = "the config" if config is not None else "the dimensions"
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        raise ValueError(
            "infinity.estimate: this config describes a multimodal model (its "
            "decoder is under 'text_config', next to other towers); build the "
            "model on the meta device (with infinity.empty_init()) and pass it "
            "instead"
        )
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe:
        raise ValueError(
            f"infinity.estimate: the config is a mixture-of-experts model "
            f"({moe[0]}={cfg[moe[0]]}); its MLPs are not one gate/up/down per layer. "
            "Build the model on the meta device (with infinity.empty_init()) and "
            "pass it instead"
        )
    values: Dict[str, Any] = {}
    for f, key, _ in DECODER_KEYS:
        v = overrides.get(f)
        values[f] = cfg.get(key) if v is None else v
    missing = [
        f"{key!r} ({flag})" if flag else repr(key)
        for f, key, flag in DECODER_KEYS
        if values[f] is None and f not in ("n_kv_heads", "tied", "head_dim")
    ]
    if missing:
        raise ValueError(
            f"infinity.estimate: {where} lack(s) {', '.join(missing)} to describe "
            "a Llama-style decoder; add them (config.json keys, or the flags / "
            "keywords), or estimate a parameter count (e.g. 8B) instead"
        )
    model_type = str(cfg.get("model_type") or "")
    arch = cfg.get("architectures")
    name = (
        arch[0]
        if isinstance(arch, list) and arch and isinstance(arch[0], str)
        else model_type or "Llama-style decoder"
    )
    if values["tied"] is None:
        values["tied"] = model_type in _TIED_BY_DEFAULT
    values["tied"] = bool(values["tied"])
    return DecoderDims(
        **values,
        name=name,
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=model_type == "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3", "gemma3_text"),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
    )


def _is_config(obj: Any) -> bool:
    if isinstance(obj, Mapping) or (hasattr(obj, "to_dict") and not isinstance(obj, nn.Module)):
        return True
    if isinstance(obj, os.PathLike):
        return True
    return isinstance(obj, str) and (
        obj.endswith(".json") or os.path.sep in obj or os.path.exists(obj)
    )


def describe(model_or_count: Any = None, **kw: Any) -> ModelShape:
    """The :class:`ModelShape` of: a ModelShape; an nn.Module (``block_rule``,
    ``param_persistence_threshold``: the blocks as the engine makes them); a Hugging Face
    config (a dict, a transformers config, a ``config.json`` path or a model folder), the
    keyword dimensions of :func:`decoder_dims` overriding it; None with those keywords alone
    (a Llama-style decoder); or a parameter count (``2e9``, ``"2B"``: a GPT, refined by
    ``n_layers``, ``d_model``, ``vocab_size``). ``bytes_per_param``: the home dtype's size for
    a config or a count (default 4: fp32, as the model built from it)."""
    dims = {k: kw[k] for k in DECODER_OPTIONS if kw.get(k) is not None}
    bpp = kw.get("bytes_per_param") or 4
    if isinstance(model_or_count, (ModelShape, nn.Module)) and dims:
        raise ValueError(
            f"infinity.estimate: {', '.join(sorted(dims))} describe a config or a "
            f"parameter count; a {type(model_or_count).__name__} has its own shape "
            "(leave them out, or pass the config instead of the model)"
        )
    if isinstance(model_or_count, ModelShape):
        return model_or_count
    threshold = kw.get("param_persistence_threshold", PERSISTENCE_THRESHOLD)
    if isinstance(model_or_count, nn.Module):
        return shape_of(model_or_count, kw.get("block_rule"), threshold)
    if model_or_count is None or _is_config(model_or_count):
        return decoder_dims(model_or_count, **dims).shape(bpp, threshold)
    llama_only = sorted(set(dims) - {"n_layers", "d_model", "vocab_size"})
    if llama_only:
        raise ValueError(
            f"infinity.estimate: the dimension(s) {', '.join(llama_only)} describe "
            "a Llama-style decoder, not a parameter count (which is estimated as "
            "a GPT); give the decoder's dimensions (or a config.json) without a "
            "count"
        )
    count = parse_count(model_or_count) if isinstance(model_or_count, str) else model_or_count
    return shape_of_count(
        count,
        n_layers=kw.get("n_layers"),
        d_model=kw.get("d_model"),
        bytes_per_param=bpp,
        vocab_size=kw.get("vocab_size") or 50304,
    )


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
