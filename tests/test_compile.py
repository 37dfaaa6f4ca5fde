"""torch.compile on a wrapped model: the engine's hooks are kept out of dynamo's tracing (as
FSDP2's are), so a compiled wrapped model gives the compiled plain model's losses and gradients
and dynamo raises no warning about the hooks' own code (time.perf_counter, ctypes). Dynamo's
"eager" backend: what is checked is the tracing, not a code generator."""
from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_compiled_wrapped_model_equals_compiled_plain(tmp_path, tier):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = TinyGPT(CFG)
    plain, wrapped = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(param_tier="host") if tier == "host" else dict(param_tier="nvme",
                                                             nvme_path=str(tmp_path))
    infinity.wrap(wrapped, **kw)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("torch").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cp = torch.compile(plain, backend="eager")
            cw = torch.compile(wrapped, backend="eager")
            for step in range(3):
                x, y = synthetic_batch(CFG, 2, 16, torch.Generator().manual_seed(step))
                lp, lw = lm_loss(cp(x), y), lm_loss(cw(x), y)
                lp.backward()
                lw.backward()
                assert torch.equal(lp, lw), step
                for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
                    assert torch.equal(p.grad, q.grad), (step, name)
                for m in (plain, wrapped):
                    m.zero_grad()
    finally:
        logging.getLogger("torch").removeHandler(handler)
    messages = [str(w.message) for w in caught] + log.getvalue().splitlines()
    bad = [m for m in messages if "perf_counter" in m or "ctypes" in m]
    assert not bad, bad[:3]
    infinity.unwrap(wrapped)
