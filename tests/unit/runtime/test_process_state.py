"""Process-wide state has one owner (runtime/process/host_memory.py, runtime/process/guard.py): the global torch
optimizer step hooks are installed for the first engine and removed when the last one is
unwrapped, closed or garbage-collected; glibc's malloc thresholds are counted per user and put
back to glibc's defaults (as far as glibc allows) when the last user releases them. Each case
runs in a fresh interpreter: this state is the process's."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_PRELUDE = textwrap.dedent("""
    import gc, json, os, sys, tempfile
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)

    def infinity_hooks():
        import torch.optim.optimizer as o
        hooks = list(o._global_optimizer_pre_hooks.values())
        hooks += list(o._global_optimizer_post_hooks.values())
        return [h for h in hooks if getattr(h, "__module__", "").startswith("infinity")]

    def wrap(**kw):
        import infinity
        from infinity.models import GPTConfig, TinyGPT, lm_loss
        model = infinity.wrap(TinyGPT(GPTConfig(n_layers=2)), nvme_path=tempfile.mkdtemp(),
                              param_tier="nvme", **kw)
        x = torch.randint(0, 512, (2, 16))
        lm_loss(model(x), x).backward()
        return model
""")


def _run(body: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body), *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_HOOKS = """
    import infinity
    from infinity.runtime.process import guard
    from infinity.runtime.core import registry
    calls = [0]
    real = registry.locate

    def counting(p):
        calls[0] += 1
        return real(p)
    guard.locate = registry.locate = counting

    def plain_step():
        lin = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        lin(torch.randn(2, 8)).sum().backward()
        before = calls[0]
        opt.step()
        return calls[0] - before

    out = {}
    model = wrap()
    out["wrapped"] = [len(infinity_hooks()), plain_step()]
    infinity.unwrap(model)
    out["unwrapped"] = [len(infinity_hooks()), plain_step()]
    model = wrap()                       # installed again for a new engine
    out["rewrapped"] = [len(infinity_hooks()), plain_step()]
    del model                            # dropped without unwrap: collected with its engine
    gc.collect()
    out["collected"] = [len(infinity_hooks()), plain_step()]
    print(json.dumps(out))
"""


def test_optimizer_hooks_are_removed_with_the_last_engine():
    r = _run(_HOOKS)
    # while a model is wrapped a torch optimizer's step looks up its parameters (pre and post
    # hook: twice per parameter of the plain Linear)
    assert r["wrapped"] == [2, 4], r
    assert r["rewrapped"] == [2, 4], r
    # afterwards nothing of infinity is left in torch.optim's global hooks, and a plain step
    # never calls into infinity
    assert r["unwrapped"] == [0, 0], r
    assert r["collected"] == [0, 0], r


_RSS = """
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def probe(nbytes):
        t = torch.empty(nbytes // 4)
        before = rss()
        t.fill_(1.0)
        peak = rss()
        del t
        return [peak - before, rss() - before]

    state = None
    if sys.argv[1] == "unwrapped":
        import infinity
        from infinity.runtime.process.host_memory import HOST_MEMORY
        model = wrap()
        state = HOST_MEMORY.state()
        infinity.unwrap(model)
        state = [state, HOST_MEMORY.state(), HOST_MEMORY.users()]
    else:
        torch.randn(4096).sum()  # torch's own lazy set-up outside the measurement
    print(json.dumps({"state": state, "64M": probe(64 << 20), "8M": probe(8 << 20)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_freed_blocks_go_back_to_the_os_after_unwrap_as_without_infinity():
    plain = _run(_RSS, "plain")
    unwrapped = _run(_RSS, "unwrapped")
    # wrapped: the heap-reusing thresholds (32 MiB); after unwrap glibc's static defaults
    # (128 KiB) and no user left
    assert unwrapped["state"] == ["reuse", None, 0], unwrapped
    for r in (plain, unwrapped):
        for size, mib in (("64M", 64), ("8M", 8)):
            peak, left = r[size]
            assert peak > (mib << 20) * 0.9, (size, r)   # the pages were touched
            # freed, they went back to the OS (a process that never wrapped: glibc's first
            # mmap'ed block of each size is unmapped; under the 32 MiB threshold an 8 MiB
            # block would have stayed in the heap). What glibc cannot undo, its dynamic
            # threshold, only changes what happens to a second block of the same size.
            assert left < 2 << 20, (size, r)


_TWO = """
    import infinity
    from infinity.runtime.process.host_memory import HOST_MEMORY

    def seen():
        return [HOST_MEMORY.state(), HOST_MEMORY.users(), len(infinity_hooks())]

    out = {}
    budget = wrap(host_budget=2**30)     # RAM constrained: wants the low threshold
    plain = wrap()                       # wants the heap-reusing one
    out["both"] = seen()
    infinity.unwrap(plain)
    out["budget_left"] = seen()
    infinity.unwrap(budget)
    out["none"] = seen()
    plain = wrap()
    budget = wrap(host_budget=2**30)
    out["again"] = seen()
    infinity.unwrap(budget)
    out["plain_left"] = seen()
    from infinity.api import _engine
    _engine(plain).close(restore=False)  # an engine closed directly, as unwrap does
    out["closed"] = seen()
    print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_two_engines_the_last_one_restores():
    r = _run(_TWO)
    # the most RAM-saving mode wins while any user wants it
    assert r["both"] == ["release", 2, 2], r
    # closing one keeps the hooks, and the mode its peer wants
    assert r["budget_left"] == ["release", 1, 2], r
    assert r["again"] == ["release", 2, 2], r
    assert r["plain_left"] == ["reuse", 1, 2], r
    # closing both: glibc's defaults, no hook
    assert r["none"] == [None, 0, 0], r
    assert r["closed"] == [None, 0, 0], r
