"""Shared by the layer-major tests: tiny real configs, micro-batches, the plain loop."""
import copy
from typing import Dict, List

import torch

import infinity
import infinity.optim

NVME = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")


def llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False, use_cache=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kw))


def qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=500, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, head_dim=16, use_cache=False, output_router_logits=False))


def batches(k: int, vocab: int, seed: int, rows: int = 1, tokens: int = 16) -> List[Dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.randint(0, vocab, (rows, tokens), generator=g)
        out.append(dict(input_ids=ids, labels=ids.clone()))
    return out


def plain_backward(model, mbs) -> List[float]:
    """The plain loop: (loss / k).backward() per micro-batch."""
    losses = []
    for mb in mbs:
        loss = model(**mb).loss
        losses.append(float(loss.detach()))
        (loss / len(mbs)).backward()
    return losses


def grads_of(model) -> Dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (through infinity.gradient on a wrapped model)."""
    out = {}
    for name, p in model.named_parameters():
        g = infinity.gradient(p)
        if g is not None:
            out[name] = g.detach().clone()
    return out


def wrapped(model, tmp_path, **settings):
    twin = copy.deepcopy(model)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return infinity.wrap(twin, nvme_path=str(tmp_path), **settings)


def tiny_decoder(arch: str, seed: int = 0):
    """A tiny config of another Hugging Face decoder family (vocab 500, width 64, 2 layers;
    Gemma-3 with alternating sliding-window and full-attention layers, a window shorter than
    the sequence so the masks differ)."""
    import transformers as tf
    common = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    configs = {
        "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])),
        "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)),
        "olmoe": lambda: (tf.OlmoeForCausalLM, tf.OlmoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, output_router_logits=False)),
        "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**common)),
        "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**common, head_dim=16)),
    }
    cls, cfg = configs[arch]()
    torch.manual_seed(seed)
    return cls(cfg)
