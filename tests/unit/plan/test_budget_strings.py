"""Budgets written as sizes ("6GiB", "24GB", "512MiB", "1.5 GiB"), as accelerate's max_memory
and ``infinity bench --ram-budget`` take them: one parser (infinity.sizes) behind the policy,
wrap, the planner and the command line; the policy keeps ints; bad sizes are clear errors."""
import shutil

import pytest

import infinity
from infinity import cli
from infinity.models import GPTConfig, TinyGPT
from infinity.plan import plan
from infinity.plan.probe import probe
from infinity.runtime.engine import engine_of
from infinity.sizes import parse_budget, parse_size

GiB, MiB = 1 << 30, 1 << 20
CFG = GPTConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, max_seq=16)


@pytest.mark.parametrize("text, n", [
    ("6GiB", 6 * GiB), ("24GB", 24 * 10**9), ("512MiB", 512 * MiB), ("1.5 GiB", 3 * GiB // 2),
    (" 8gib ", 8 * GiB), ("8G", 8 * GiB), ("500MB", 500 * 10**6), ("4096", 4096),
    ("1.1GiB", int(1.1 * GiB)), ("1e3KB", 10**6), ("2 TiB", 2 << 40), ("64KiB", 64 << 10),
    ("7B", 7), (4096, 4096), (6e9, 6 * 10**9)])
def test_sizes_parse_exactly(text, n):
    got = parse_size(text)
    assert got == n and type(got) is int


@pytest.mark.parametrize("bad, why", [
    ("6 parsecs", "is not a size"), ("", "is not a size"), ("GiB", "is not a size"),
    ("1.5.3GB", "is not a size"), ("nan", "is not a size"), ("inf GB", "is not a size"),
    ("-1GiB", "is negative"), (-5, "is negative"), (0, "at least 1"), ("0.2B", "at least 1"),
    (1.5, "whole number"), (True, "is not a size"), ([1], "is not a size")])
def test_bad_budgets_name_infinity_the_value_and_the_remedy(bad, why):
    with pytest.raises(ValueError) as err:
        parse_budget(bad, "host_budget")
    msg = str(err.value)
    assert msg.startswith("infinity: host_budget=") and repr(bad) in msg and why in msg
    assert "e.g. 6GiB" in msg  # how to write one


def test_policy_normalises_sizes_to_ints():
    p = infinity.OffloadPolicy(host_budget="6GiB", device_budget="24GB")
    assert (p.host_budget, p.device_budget) == (6 * GiB, 24 * 10**9)
    assert type(p.host_budget) is int and type(p.device_budget) is int
    assert infinity.OffloadPolicy(host_budget=123456).host_budget == 123456
    assert infinity.OffloadPolicy().host_budget is None
    # dataclasses.replace (the planner's) runs __post_init__ again on the int
    import dataclasses
    assert dataclasses.replace(p, prefetch_window=1).host_budget == 6 * GiB


@pytest.mark.parametrize("field, bad", [("host_budget", "6 parsecs"), ("device_budget", "-2GB"),
                                        ("host_budget", ""), ("device_budget", 0)])
def test_policy_refuses_bad_sizes(field, bad):
    with pytest.raises(ValueError, match=rf"infinity: {field}=.*e\.g\. 6GiB"):
        infinity.OffloadPolicy(**{field: bad})


def test_wrap_takes_size_strings_and_the_engine_sees_ints():
    model = infinity.wrap(TinyGPT(CFG), param_tier="host", grad_tier="host",
                          optimizer_tier="host", host_budget="512MiB", device_budget="1.5 GiB")
    try:
        engine = engine_of(model)
        assert engine.policy.host_budget == 512 * MiB
        assert engine.host_budget.limit == 512 * MiB and type(engine.host_budget.limit) is int
        assert engine.device_budget.limit == 3 * GiB // 2
    finally:
        infinity.unwrap(model)
    model = TinyGPT(CFG)
    with pytest.raises(ValueError, match="host_budget='6 parsecs'"):
        infinity.wrap(model, param_tier="host", host_budget="6 parsecs")
    assert engine_of(model) is None


def test_planner_takes_size_strings(tmp_path, monkeypatch):
    pr = probe(str(tmp_path), quick=True)
    # the planner reads the swap disk's free space at each call: hold it still, so that other
    # writers on this disk between the two plans cannot change the second one
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    p = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), host_budget="1GiB",
             device_budget="768MiB")
    assert p.budgets["host"] == GiB and p.budgets["device"] == 768 * MiB
    same = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), host_budget=GiB,
                device_budget=768 * MiB)
    assert (same.placement, same.budgets, same.estimate) == (p.placement, p.budgets, p.estimate)
    with pytest.raises(ValueError, match="host_budget='-1GiB' is negative"):
        plan(TinyGPT(CFG), probe=pr, host_budget="-1GiB")


def test_the_command_line_uses_the_same_parser(tmp_path, capsys):
    assert cli.main(["estimate", "1M", "--plan", "--ram-budget", "6 parsecs"]) == 1
    assert "infinity: --ram-budget='6 parsecs' is not a size" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--ram-budget=-1GB", "--out",
                     str(tmp_path / "out")]) == 1
    assert "infinity: --ram-budget='-1GB' is negative" in capsys.readouterr().err
    from infinity.plan import shape
    assert not hasattr(shape, "parse_bytes")  # one parser: infinity.sizes
