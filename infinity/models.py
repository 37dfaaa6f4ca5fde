"""A small GPT-style model (embedding, transformer layers in an nn.ModuleList, tied output head)
used by the demo, the tests and the benchmarks. Plain PyTorch: nothing infinity-specific."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq: int = 128
    tie_embeddings: bool = True

    @property
    def approx_params(self) -> int:
        per_layer = 12 * self.d_model * self.d_model + 13 * self.d_model
        emb = self.vocab_size * self.d_model + self.max_seq * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.n_layers * per_layer + emb + head + 2 * self.d_model


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok.weight
        self.apply(self.init_module)

    @staticmethod
    def init_module(module: nn.Module) -> None:
        """GPT-2's initialization of one module: normal(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, batch: int, seq: int, generator: torch.Generator):
    """A learnable synthetic task: the next token is a fixed function of the current one."""
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=generator)
    for t in range(seq):
        x[:, t + 1] = (x[:, t] * 7 + 3) % cfg.vocab_size
    noise = torch.rand(batch, seq + 1, generator=generator) < 0.1  # 10% random tokens
    x[noise] = torch.randint(0, cfg.vocab_size, (int(noise.sum()),), generator=generator)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()
