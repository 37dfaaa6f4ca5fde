"""torch.compile on a wrapped model. The engine's hooks are kept out of dynamo's tracing, as
FSDP2 keeps its own: a compiled model runs them eagerly between its graphs. Checked here:

- a compiled wrapped model (parameters and optimizer states on host, or on NVMe, there also
  with embeddings whose forward reads only the batch's rows) trains as the compiled plain
  model does: same losses, gradients and, after ``infinity.optim.AdamW`` against
  ``torch.optim.AdamW(fused=True)``, weights, bitwise in fp32 over three steps;
- a compiled Llama with ``tiled_head=True`` trains as the same wrapped model run eagerly, and
  dynamo traces none of the tiled head's code (its forward and loss run eagerly, as the hooks);
- dynamo warns and logs nothing about the hooks' own code (``time.perf_counter``,
  ``ctypes.byref``) and compiles no frame of the engine's runtime but compile_guard's
  three-line dispatcher;
- keeping them out imports no ``torch._dynamo``, neither with ``import infinity`` nor in a
  forward and backward: importing it raises glibc's mmap threshold, so a model built after it
  lies in the heap and the peak RSS of NVMe streaming grows (runtime/process/compile_guard.py).

The backend records dynamo's graphs and runs them as they are (no code generator): what is
checked is the tracing."""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import subprocess
import sys
import warnings
from typing import List

import pytest
import torch
from engine_helpers import (
    SMALL,
    assert_params_bitwise,
    batches,
    check_grads_then_step,
    loss_of,
    pair,
)

import infinity

_RUNTIME_DIR = os.path.dirname(infinity.runtime.__file__)
_TIERS = {"host": dict(param_tier="host", optimizer_tier="host"),
          "nvme": dict(param_tier="nvme", optimizer_tier="nvme"),
          # untied embeddings, each a block of its own: their forward reads only the batch's
          # rows from the swap file (runtime/vocab/rows.py)
          "nvme-rows": dict(param_tier="nvme", optimizer_tier="nvme",
                            param_persistence_threshold=1000)}
_UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)


class _Graphs:
    """A torch.compile backend that counts the graphs dynamo hands over and the calls in them."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[torch.Tensor]):
        self.graphs += 1
        self.calls += sum(n.op in ("call_function", "call_method", "call_module")
                          for n in gm.graph.nodes)
        return gm.forward


_TRACING = re.compile(r"torchdynamo start tracing \S+ (\S+):\d+")
_GUARD = os.path.join(_RUNTIME_DIR, "process", "compile_guard.py")


def _suspect(message: str) -> bool:
    """A message of dynamo's about the hooks' code: a call it cannot trace, or a frame of the
    engine's runtime it compiles. The one frame allowed is compile_guard's dispatcher: run
    eagerly after a graph break, dynamo compiles it to the call that leaves tracing."""
    if "perf_counter" in message or "ctypes" in message:
        return True
    traced = _TRACING.search(message)
    return traced is not None and traced.group(1).startswith(_RUNTIME_DIR) \
        and traced.group(1) != _GUARD


@pytest.mark.parametrize("tier", sorted(_TIERS))
def test_compiled_wrapped_model_trains_as_compiled_plain(tmp_path, tier):
    torch._dynamo.reset()
    cfg = _UNTIED if tier == "nvme-rows" else SMALL
    ref, model = pair(cfg, nvme_path=str(tmp_path), host_budget="1GiB", **_TIERS[tier])
    if tier == "nvme-rows":
        rows = [b.name for b in model._infinity_engine.blocks if b.row_lookup]
        assert rows == ["tok", "pos"], rows
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    plain_graphs, wrapped_graphs = _Graphs(), _Graphs()
    compiled_ref = torch.compile(ref, backend=plain_graphs)
    compiled = torch.compile(model, backend=wrapped_graphs)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.DEBUG)
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.addHandler(handler)
    dynamo_log.setLevel(logging.INFO)   # graph breaks and skipped frames are logged at INFO+
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, (x, y) in enumerate(batches(cfg, 3)):
                l_ref, loss = loss_of(compiled_ref, x, y), loss_of(compiled, x, y)
                assert torch.equal(l_ref.detach(), loss.detach()), (step, l_ref, loss)
                l_ref.backward()
                loss.backward()
                check_grads_then_step(ref, model, opt_ref, opt, step)
    finally:
        dynamo_log.removeHandler(handler)
        dynamo_log.setLevel(level)
        torch._dynamo.reset()
    assert_params_bitwise(ref, model)
    stats = infinity.stats(model)
    if tier != "host":
        assert stats["moved"]["nvme_to_host"] > 0, stats["moved"]
    if tier == "nvme-rows":  # two embeddings, three forwards
        assert model._infinity_engine.stats.rows_lookups == 6
    opt.close()
    infinity.unwrap(model)
    # both models were really compiled: dynamo handed over graphs holding the model's ops
    assert plain_graphs.graphs > 0 and plain_graphs.calls > 0, vars(plain_graphs)
    assert wrapped_graphs.graphs > 0 and wrapped_graphs.calls > 0, vars(wrapped_graphs)
    messages = [str(w.message) for w in caught] + log.getvalue().splitlines()
    bad = [m for m in messages if _suspect(m)]
    assert not bad, bad[:3]


_NO_DYNAMO = """
import sys, torch, infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
loaded = ["torch._dynamo" in sys.modules]
cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
model = TinyGPT(cfg)
infinity.wrap(model, param_tier="nvme", nvme_path=sys.argv[1])
x, y = synthetic_batch(cfg, 2, 16, torch.Generator().manual_seed(0))
lm_loss(model(x), y).backward()
loaded.append("torch._dynamo" in sys.modules)
print(loaded)
"""


def test_hooks_do_not_import_dynamo(tmp_path):
    """Neither ``import infinity`` nor a wrapped model's forward and backward import
    ``torch._dynamo`` (torch.optim's optimizers do, when they are built: after the model)."""
    out = subprocess.run([sys.executable, "-c", _NO_DYNAMO, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[False, False]", out.stdout


def test_compiled_tiled_head_trains_as_eager(tmp_path):
    """torch.compile on a Llama wrapped with ``tiled_head=True`` (the head's weight streamed in
    vocabulary tiles, the loss over the tiles; runtime/vocab/tiled_head.py): dynamo traces the model
    around the tiled head, which runs eagerly, and the compiled model trains as the same wrapped
    model run eagerly: losses, gradients and weights after ``infinity.optim.AdamW`` bitwise over
    three steps; the logits are never materialized in either."""
    transformers = pytest.importorskip("transformers")
    from infinity.runtime.engine import engine_of
    torch._dynamo.reset()
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    models, opts = [], []
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).float()
        (tmp_path / name).mkdir()
        infinity.wrap(m, nvme_path=str(tmp_path / name), host_budget="1GiB",
                      chunk_bytes="256KiB", tiled_head=True, param_tier="nvme",
                      grad_tier="nvme", optimizer_tier="nvme")
        models.append(m)
        opts.append(infinity.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1))
    eager, model = models
    head = next(b for b in engine_of(model).blocks if model.lm_head in b.modules)
    assert head.row_lookup  # the head is tiled
    graphs = _Graphs()
    compiled = torch.compile(model, backend=graphs)
    gen = torch.Generator().manual_seed(1)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.addHandler(handler)
    dynamo_log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train_pair(eager, compiled, model, opts, cfg, gen)
    finally:
        dynamo_log.removeHandler(handler)
        dynamo_log.setLevel(level)
        torch._dynamo.reset()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    assert graphs.graphs > 0 and graphs.calls > 0, vars(graphs)  # really compiled
    # dynamo traced none of the tiled head's own code (its tile reads time themselves and
    # take locks: dynamo warned about time.monotonic and locks when it traced them)
    messages = [str(w.message) for w in caught] + log.getvalue().splitlines()
    bad = [m for m in messages if _suspect(m) or "monotonic" in m or "allocate_lock" in m]
    assert not bad, bad[:3]
    for m, opt in zip(models, opts):
        opt.close()
        infinity.unwrap(m)


def _train_pair(eager, compiled, model, opts, cfg, gen) -> None:
    """Three steps of the eager and the compiled wrapped model on the same batches: losses and
    gradients bitwise equal at every step."""
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
        out_e = eager(input_ids=ids, labels=ids)
        out_c = compiled(input_ids=ids, labels=ids)
        assert out_e.logits is None and out_c.logits is None
        assert torch.equal(out_e.loss.detach(), out_c.loss.detach()), (step, out_e.loss,
                                                                     out_c.loss)
        out_e.loss.backward()
        out_c.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(infinity.gradient(p), infinity.gradient(q)), (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
