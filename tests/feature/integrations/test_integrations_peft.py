"""PEFT LoRA with a wrapped base model, in both orders:

* ``wrap_then_peft``: ``infinity.wrap(base)`` then ``get_peft_model(base, cfg)``. PEFT inserts
  the LoRA Linears into the wrapped layers (plain, not offloaded parameters) and freezes the
  base parameters *after* wrap.
* ``peft_then_wrap``: ``get_peft_model(base, cfg)`` then ``infinity.wrap(peft_model)``: the LoRA
  parameters are offloaded with the frozen base weights of their layer.

Each trains like the unwrapped PEFT model (losses, LoRA weights: 1e-6 relative), leaves the base
weights bit-for-bit untouched, and ``save_pretrained`` -> ``PeftModel.from_pretrained`` on a
plain base reloads the trained adapter exactly. The Trainer test checks the usual SFT setup
(Trainer + LoRA + checkpoint resume, which reloads the adapter with ``load_adapter``).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from integrations_helpers import (  # noqa: E402
    TIERS,
    WRAP_HOST,
    TokenDataset,
    assert_changed,
    assert_losses,
    assert_weights,
    llama,
    run_example,
    weights,
    wrap_settings,
)
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import infinity  # noqa: E402

# peft 0.21 asks transformers 5 for the deprecated is_gradient_checkpointing
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

STEPS = 4
CLIP = 0.1
LR = 1e-2
DATA = TokenDataset(2 * STEPS)
ORDERS = ["wrap_then_peft", "peft_then_wrap"]


def _lora_config() -> LoraConfig:
    # init_lora_weights=False: B is random too, so every LoRA matrix gets a gradient at step 1
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")


def _peft_model(order, settings=None, tmp_path=None, lora_seed=1):
    base = llama(seed=0)
    wrap = wrap_settings(settings, tmp_path) if settings is not None else None
    if order == "wrap_then_peft":
        infinity.wrap(base, **wrap)
    torch.manual_seed(lora_seed)  # the same LoRA initialisation in every variant
    model = get_peft_model(base, _lora_config())
    if order == "peft_then_wrap":
        infinity.wrap(model, **wrap)
    return model


def _train(model):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = infinity.optim.AdamW(trainable, lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for i in range(STEPS):
        batch = DATA[2 * i], DATA[2 * i + 1]
        ids = torch.stack([b["input_ids"] for b in batch])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _base_weights(model):
    return {k: v for k, v in weights(model).items() if "lora_" not in k}


@pytest.fixture(scope="module")
def reference():
    model = _peft_model(None)
    init = weights(model)
    losses, norms = _train(model)
    assert min(norms) > CLIP, norms
    return {"init": init, "losses": losses, "norms": norms,
            "lora": weights(model, trainable_only=True)}


@pytest.mark.parametrize("settings", TIERS)
@pytest.mark.parametrize("order", ORDERS)
def test_lora_on_wrapped_base_trains_like_unwrapped(order, settings, reference, tmp_path):
    model = _peft_model(order, settings, tmp_path)
    assert sorted(weights(model, trainable_only=True)) == sorted(reference["lora"])
    losses, norms = _train(model)
    assert_losses(norms, reference["norms"], what="pre-clip norms")
    assert_losses(losses, reference["losses"], what="losses")
    lora = weights(model, trainable_only=True)
    assert_changed({k: reference["init"][k] for k in lora}, lora)
    assert_weights(lora, reference["lora"], what="trained LoRA weights")
    base = _base_weights(model)
    assert_weights(base, {k: reference["init"][k] for k in base}, exact=True,
                   what="frozen base weights")

    # save the adapter, load it onto a plain base: same LoRA weights, same logits
    model.save_pretrained(str(tmp_path / "adapter"))
    plain = PeftModel.from_pretrained(llama(seed=0), str(tmp_path / "adapter"))
    assert_weights({k: v for k, v in weights(plain).items() if "lora_" in k},
                   {k: v for k, v in weights(model).items() if "lora_" in k}, exact=True,
                   what="reloaded adapter")
    ids = DATA.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("settings", TIERS)
def test_lora_merge_and_unload_on_wrapped_base(settings, tmp_path):
    """merge_and_unload() adds B@A into the base weights (PEFT writes ``weight.data += delta``,
    which bypasses the parameter's version counter, so infinity.integrations.peft's
    merge_and_unload tells the engine) and puts the base Linears back: the wrapped model then
    computes with the merged weights, like the unwrapped one."""
    ref = _peft_model(None)
    model = _peft_model("wrap_then_peft", settings, tmp_path)
    for m in (ref, model):
        _train(m)
    from infinity.integrations.peft import merge_and_unload

    merged_ref, merged = ref.merge_and_unload(), merge_and_unload(model)
    assert_weights(weights(merged), weights(merged_ref), what="merged weights")
    ids = DATA.ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, merged_ref(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-6)


def test_lora_with_trainer_resumes_identically(tmp_path):
    """HF Trainer + LoRA on a wrapped base: checkpoint-2 resumed on a fresh wrapped PEFT model
    (adapter reloaded by the Trainer with load_adapter) continues exactly like the full run."""
    from transformers import Trainer, TrainingArguments

    def run(model, out, resume=None):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2,
                                 max_steps=STEPS, learning_rate=LR, max_grad_norm=CLIP,
                                 logging_steps=1, report_to="none", use_cpu=True,
                                 disable_tqdm=True, seed=0, save_strategy="steps", save_steps=2)
        opt = infinity.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        trainer = Trainer(model=model, args=args, train_dataset=DATA, optimizers=(opt, sched))
        trainer.train(resume_from_checkpoint=resume)
        first = 2 if resume else 0
        return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > first]

    order = "wrap_then_peft"  # the other order trains the same (test above)
    full_model = _peft_model(order, WRAP_HOST, tmp_path / "a")
    full = run(full_model, tmp_path / "full")
    resumed_model = _peft_model(order, WRAP_HOST, tmp_path / "b", lora_seed=2)  # other LoRA
    resumed = run(resumed_model, tmp_path / "resumed",
                  resume=str(tmp_path / "full" / "checkpoint-2"))
    assert_losses(resumed, full[2:], exact=True, what="losses after resume")
    assert_weights(weights(resumed_model, trainable_only=True),
                   weights(full_model, trainable_only=True), exact=True, what="LoRA after resume")


def test_example_peft_lora_runs(tmp_path):
    out = run_example("peft_lora", "--steps", "2", "--output-dir", str(tmp_path))
    assert math.isfinite(out["loss"]) and (tmp_path / "adapter_model.safetensors").exists()
