"""infinity.trace: engine events (fetch, release, gradient offload/write, optimizer shard
read/compute/write) with timestamps and bytes, written as Parquet / Arrow."""
import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss

pq = pytest.importorskip("pyarrow.parquet")


def _train(model, opt, steps):
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()


def test_trace_records_each_kind_with_bytes_matching_stats(tmp_path):
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(GPTConfig(n_layers=3)), nvme_path=str(tmp_path),
                          param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)  # states created; the traced steps are steady-state
    out = tmp_path / "trace.parquet"
    with infinity.trace(out) as rec:
        _train(model, opt, 2)
    rows = pq.read_table(out).to_pylist()
    assert rows == rec.events
    kinds = {r["kind"] for r in rows}
    assert kinds == {"fetch", "release", "grad_offload", "grad_write", "optimizer_read",
                     "optimizer_compute", "optimizer_write", "optimizer_step"}
    # events carry the index of the step they finished in; a prefetch the last step's
    # opt.step() issued for the next forward may finish after it (step 2): only fetches may
    steps = {r["step"] for r in rows}
    assert {0, 1} <= steps <= {0, 1, 2}
    assert {r["kind"] for r in rows if r["step"] == 2} <= {"fetch"}
    for r in rows:
        # (a prefetch issued just before the trace began starts at a negative time)
        assert r["end_s"] >= r["start_s"] and r["end_s"] >= 0 and r["bytes"] >= 0
    # every block's flat was fetched (a prefetch issued after an optimizer step may complete
    # before or after that step's event, so fetches are not checked per step)
    keys = {f.key for f in infinity.api._engine(model).flats}
    assert {r["name"] for r in rows if r["kind"] == "fetch"} == keys
    assert sum(r["kind"] == "fetch" for r in rows) >= len(keys)
    # bytes written to NVMe in the last step: trace and engine stats agree
    last = [r for r in rows if r["step"] == 1]
    written = sum(r["bytes"] for r in last if r["kind"] in ("grad_write", "optimizer_write"))
    assert written == infinity.stats(model)["nvme_bytes_written"]["last_step"]
    infinity.unwrap(model)


def test_no_trace_records_nothing_and_arrow_output(tmp_path):
    model = infinity.wrap(TinyGPT(GPTConfig(n_layers=2)), param_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    assert not infinity.trace_events.active()
    out = tmp_path / "t.arrow"
    with infinity.trace(out):
        _train(model, opt, 1)
        with pytest.raises(RuntimeError, match="already active"):
            with infinity.trace(tmp_path / "other.parquet"):
                pass
    import pyarrow.feather as feather
    table = feather.read_table(out)
    kinds = set(table.column("kind").to_pylist())
    assert {"grad_offload", "optimizer_compute", "optimizer_step"} <= kinds
    assert "fetch" not in kinds  # host homes on the CPU are used in place
    infinity.unwrap(model)
