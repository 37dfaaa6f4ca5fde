"""Staging and NVMe gradient pools bounded by the chunk, not the largest flat.

Flats many chunks long (``chunk_bytes`` of 8-64 KiB) stream through chunk-sized buffers:
training (gradient accumulation, clipping, state dicts, a failed write) equals the same run
with a chunk larger than every flat, bitwise; the pools' host bytes are count x chunk; a
corrupted chunk of a swap file is found and named; peak RSS does not grow with the largest
flat (subprocess).
"""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from engine_helpers import batches, loss_of

import infinity
from infinity.io import clear_faults, inject_fault
from infinity.models import GPTConfig, TinyGPT
from infinity.runtime.core.registry import engine_of
from infinity.runtime.grads.sink import GradientWriteError, grad_key
from infinity.tiers import BudgetExceededError, SwapCorruptionError

# a layer's flat is ~50k fp32 elements (200 KB): 25 chunks of 8 KiB; its 64x64 weights (16 KiB)
# are larger than an 8 KiB chunk and straddle 64 KiB chunks
CFG = GPTConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, max_seq=32)
LARGE = 4 << 20   # larger than every flat: one buffer per flat (the unchunked path)
SMALL_CHUNKS = [8 << 10, 64 << 10]


def _wrap(path: Path, chunk: int, bf16: bool = False, **kw) -> torch.nn.Module:
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    settings = dict(param_tier="nvme", grad_tier="nvme", chunk_bytes=chunk)
    if bf16:
        model = model.to(torch.bfloat16)
        # computing as stored (fetched without a cast) unless a test says otherwise: "auto"
        # computes bf16 homes in fp32 on a CPU without fast bf16
        settings["compute_dtype"] = torch.bfloat16
    settings.update(kw)
    return infinity.wrap(model, nvme_path=str(path), **settings)


def _weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(path: Path, chunk: int, *, fault: bool = False, reload: bool = False,
         outside: bool = False, user_grads: bool = False,
         **kw) -> Tuple[List[float], Dict[str, torch.Tensor], Dict]:
    """4 steps of 2 micro-batches each, clipped; optionally a failed gradient write in step
    2 (zero_grad, backward again), a state_dict/load_state_dict round trip after step 1,
    in-place writes to parameters outside forward (``outside``), or ``p.grad`` set to None
    and replaced between micro-batches (``user_grads``). Returns the losses, the final
    weights and the optimizer's state dict."""
    model = _wrap(path, chunk, **kw)
    engine = engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(CFG, 8, batch=2, seq=16, seed=3)
    losses: List[float] = []
    for step in range(4):
        for micro in range(2):
            x, y = data[2 * step + micro]
            if fault and step == 2 and micro == 1:
                # the second micro-batch's gradient writes fail: redo the whole step's backward
                inject_fault("write", errno.ENOSPC, after_bytes=20_000)
                with pytest.raises(GradientWriteError):
                    loss_of(model, x, y).backward()
                clear_faults()
                opt.zero_grad()
                for xx, yy in data[2 * step:2 * step + 2]:
                    loss_of(model, xx, yy).backward()
                losses.append(-1.0)  # same marker in both runs
                continue
            loss = loss_of(model, x, y)
            loss.backward()
            losses.append(loss.item())
            if user_grads and micro == 0:
                named = dict(model.named_parameters())
                # larger than the chunks (64 KiB) and straddling them, next to other slots
                assert named["layers.0.fc.weight"].grad is not None
                named["layers.0.fc.weight"].grad = None
                p = named["layers.1.out.weight"]
                p.grad = torch.full_like(p.grad, 1e-3)
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        if outside and step == 1:
            with torch.no_grad():
                params = sorted(model.named_parameters())
                for name, p in params[::3]:
                    p.mul_(0.5)  # through the memory-mapped home: re-checksummed per chunk
                for name, p in params[1::5]:
                    p.data = p.detach() * 0.25 + 0.01  # rebound: written to the home's chunks
            with infinity.materialized(model):  # written back from the compute buffers
                with torch.no_grad():
                    for name, p in sorted(model.named_parameters())[2::4]:
                        p.add_(0.125)
        if reload and step == 1:
            sd_model = _weights(model)
            sd_opt = opt.state_dict()
            # train one throw-away step, then put the saved state back
            x, y = data[0]
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            model.load_state_dict(sd_model)
            opt.load_state_dict(sd_opt)
    host = engine.tier_bytes()["host"]
    weights = _weights(model)
    opt_state = opt.state_dict()
    opt.close()
    infinity.unwrap(model)
    return losses, weights, {"opt": opt_state, "host": host}


def _assert_same(a, b) -> None:
    losses_a, w_a, extra_a = a
    losses_b, w_b, extra_b = b
    assert losses_a == losses_b
    assert w_a.keys() == w_b.keys()
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k
    sa, sb = extra_a["opt"]["state"], extra_b["opt"]["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for name, t in sa[i].items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, sb[i][name]), (i, name)


_REF: Dict[str, tuple] = {}


def _reference(tmp_path: Path, **kw):
    key = repr(sorted(kw.items()))
    if key not in _REF:
        _REF[key] = _run(tmp_path / "reference", LARGE, **kw)
    return _REF[key]


CASES = {"plain": {}, "reload": {"reload": True}, "fault": {"fault": True},
         "outside": {"outside": True}, "user_grads": {"user_grads": True},
         # a compute dtype other than the home's: fetches stage each chunk and cast it
         "compute_bf16": {"compute_dtype": torch.bfloat16},
         "states_nvme": {"optimizer_tier": "nvme"}}


@pytest.mark.parametrize("chunk", SMALL_CHUNKS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_through_chunks_equals_one_buffer_per_flat(tmp_path, chunk, case):
    kw = CASES[case]
    ref = _reference(tmp_path, **kw)
    got = _run(tmp_path / "chunked", chunk, **kw)
    _assert_same(got, ref)
    host = got[2]["host"]
    # every staging and gradient buffer is one chunk
    assert host["chunk"] == chunk
    assert host["staging"] == host["staging_buffers"] * chunk > 0
    assert host["grads"] == host["grad_buffers"] * chunk > 0
    ref_host = ref[2]["host"]
    assert host["staging"] + host["grads"] < ref_host["staging"] + ref_host["grads"]


@pytest.mark.parametrize("chunk", [8 << 10])
@pytest.mark.parametrize("compute", ["bf16", "auto"])
def test_bf16_homes_states_on_nvme_equal(tmp_path, chunk, compute):
    """bf16 parameter homes (2-byte elements per chunk) and optimizer states on NVMe; computing
    in bf16 (fetched as stored), and as "auto" chooses (in fp32 on a CPU without fast bf16:
    each chunk staged and cast)."""
    kw = dict(optimizer_tier="nvme", bf16=True)
    if compute == "auto":
        kw["compute_dtype"] = "auto"
    ref = _run(tmp_path / "ref", LARGE, **kw)
    _assert_same(_run(tmp_path / "chunked", chunk, **kw), ref)


def test_tied_embedding_norms_are_those_of_the_written_gradients(tmp_path):
    """A tied embedding's slot receives two gradients in one backward, and the sums of two
    micro-batches: each norm the sink hands the optimizer (where it measured one) equals the
    norm of the gradient it wrote; the run equals the unchunked one."""
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq=32,
                    tie_embeddings=True)
    results = []
    for chunk in (LARGE, 8 << 10, 64 << 10):
        path = tmp_path / f"t{chunk}"
        path.mkdir()
        torch.manual_seed(0)
        model = infinity.wrap(TinyGPT(cfg), nvme_path=str(path), param_tier="nvme",
                              grad_tier="nvme", chunk_bytes=chunk)
        engine = engine_of(model)
        sink = engine.grads
        checked = 0
        for x, y in batches(cfg, 2, batch=2, seq=16, seed=5):
            loss_of(model, x, y).backward()
            for flat in engine.home_flats:
                norms = sink.slot_norms(flat)
                if not flat.trainable or norms is None:
                    continue
                for i, s in enumerate(flat.slots):
                    g = sink.gradient(flat, i)
                    if g is None:
                        assert norms[i] is None
                        continue
                    want = torch.linalg.vector_norm(g.reshape(-1), 2.0, dtype=torch.float32)
                    assert torch.equal(norms[i], want), s.qualname
                    checked += 1
        assert checked > 0
        results.append({n: sink.gradient(f, i).clone() for f in engine.home_flats
                        for i, n in enumerate(s.qualname for s in f.slots)
                        if f.grad_ready[i]})
        infinity.unwrap(model)
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for k in other:
            assert torch.equal(other[k], results[0][k]), k


def test_pool_bytes_are_count_times_chunk_and_independent_of_the_largest_flat(tmp_path):
    chunk = 16 << 10
    model = _wrap(tmp_path / "a", chunk)
    engine = engine_of(model)
    host = engine.tier_bytes()["host"]
    largest = max(f.numel * 4 for f in engine.flats)
    assert largest > 8 * chunk
    assert engine.pool.nbytes == chunk and engine.grads.pool.nbytes == chunk
    assert host["staging"] + host["grads"] == (host["staging_buffers"]
                                               + host["grad_buffers"]) * chunk
    needs = engine.sizing.host_needs()
    assert needs["staging"] == host["staging"] and needs["gradient buffers"] == host["grads"]
    # the gradient files are checksummed per chunk
    flat = next(f for f in engine.flats if f.numel * 4 > chunk)
    assert engine.store.piece_bytes(grad_key(flat)) == chunk
    assert engine.store.piece_bytes(flat.key) == chunk
    infinity.unwrap(model)


def test_budget_minimum_and_counts_that_adapt(tmp_path):
    """Below the true minimum (1 staging + 2 gradient chunks on top of the rest) wrap is
    refused, naming that minimum; at the minimum it wraps with 2 gradient buffers and trains;
    each chunk more buys one more buffer, up to the default count."""
    chunk = 64 << 10
    with pytest.raises(BudgetExceededError, match=r"gradient buffers [\d,]+") as exc:
        _wrap(tmp_path / "small", chunk, host_budget=2 * chunk)
    text = str(exc.value)
    assert f"staging {chunk:,}" in text and f"gradient buffers {2 * chunk:,}" in text
    minimum = int(re.search(r"at least ([\d,]+) bytes", text).group(1).replace(",", ""))
    counts = []
    for extra in range(4):
        model = _wrap(tmp_path / f"b{extra}", chunk, host_budget=minimum + extra * chunk)
        host = engine_of(model).tier_bytes()["host"]
        assert host["now"] <= minimum + extra * chunk and host["staging_buffers"] >= 1
        counts.append(host["grad_buffers"])
        if extra == 0:
            x, y = batches(CFG, 1, batch=2, seq=16)[0]
            loss_of(model, x, y).backward()  # trains within the minimum
        infinity.unwrap(model)
    unbudgeted = _wrap(tmp_path / "d", chunk)
    default = engine_of(unbudgeted).tier_bytes()["host"]["grad_buffers"]
    infinity.unwrap(unbudgeted)
    assert counts[0] == 2
    assert counts == [min(default, 2 + k) for k in range(4)], counts


def test_corrupted_chunk_of_a_swap_file_is_found_and_named(tmp_path):
    chunk = 8 << 10
    model = _wrap(tmp_path / "c", chunk)
    engine = engine_of(model)
    flat = max(engine.flats, key=lambda f: f.numel)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    loss_of(model, x, y).backward()
    # a gradient chunk in the middle of the flat's file: its ranged read names the piece
    path = engine.store.path(grad_key(flat))
    k = 3
    with open(path, "r+b") as f:
        f.seek(k * chunk + 100)
        byte = f.read(1)
        f.seek(k * chunk + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    per = engine.grads.reads.range_elems(flat)
    assert per == chunk // 4
    dst = infinity.io.aligned_empty(per, torch.float32)
    engine.grads.reads.read_range(flat, k * per, (k + 1) * per, dst).wait()
    with pytest.raises(SwapCorruptionError, match=rf"bytes {k * chunk:,}-{(k + 1) * chunk:,}"):
        engine.grads.reads.verify_range(flat, k * per, dst)
    # its neighbours are intact
    engine.grads.reads.read_range(flat, (k + 1) * per, (k + 2) * per, dst).wait()
    engine.grads.reads.verify_range(flat, (k + 1) * per, dst)
    # a whole read finds it too
    full = infinity.io.aligned_empty(flat.numel, torch.float32)
    engine.grads.reads.read(flat, full).wait()
    with pytest.raises(SwapCorruptionError, match="is corrupted"):
        engine.grads.reads.verify(flat, full)
    # a parameter home: the fetch refuses the corrupted chunk
    opt_path = engine.store.path(flat.key)
    with open(opt_path, "r+b") as f:
        f.seek(2 * chunk + 8)
        byte = f.read(1)
        f.seek(2 * chunk + 8)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(SwapCorruptionError, match=rf"bytes {2 * chunk:,}-{3 * chunk:,}"):
        engine.home.read_into(flat, torch.empty(flat.numel, dtype=flat.home_dtype))
    engine.close(restore=False)


def test_ranged_home_write_and_gradient_reads(tmp_path):
    """write_range_async changes only its chunks; read_range returns what read gives."""
    chunk = 8 << 10
    model = _wrap(tmp_path / "r", chunk)
    engine = engine_of(model)
    flat = max(engine.flats, key=lambda f: f.numel)
    per = engine.home.range_elems(flat)
    assert per == engine.home.chunk_elems(flat)  # chunks up to 4 MiB are one piece
    before = engine.home.snapshot(flat)
    new = infinity.io.aligned_empty(2 * per, flat.home_dtype)
    new.copy_(torch.arange(2 * per, dtype=torch.float32).to(flat.home_dtype))
    engine.home.write_range_async(flat, 3 * per, new).wait()
    after = engine.home.snapshot(flat)
    want = before.clone()
    want[3 * per:5 * per] = new
    assert torch.equal(after, want)
    with pytest.raises(ValueError, match="whole pieces"):
        engine.home.write_range_async(flat, per + 1, new[:per]).wait()
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    loss_of(model, x, y).backward()
    full = infinity.io.aligned_empty(flat.numel, torch.float32)
    engine.grads.reads.read(flat, full).wait()
    engine.grads.reads.verify(flat, full)
    gper = engine.grads.reads.range_elems(flat)
    last = (flat.numel - 1) // gper * gper  # the last range ends at the end of the flat
    part = infinity.io.aligned_empty(flat.numel - last, torch.float32)
    engine.grads.reads.read_range(flat, last, flat.numel, part).wait()
    engine.grads.reads.verify_range(flat, last, part)
    assert torch.equal(part, full[last:])
    assert engine.grads.in_ram(flat) is None  # larger than a buffer: the optimizer reads it
    infinity.unwrap(model)


_RSS_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    from torch import nn
    import infinity
    from infinity.runtime.core.registry import engine_of

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32768, 2048)          # 64M elements: 256 MiB fp32
            self.layers = nn.ModuleList([nn.Linear(2048, 2048) for _ in range(2)])
        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return h.float().pow(2).mean()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Model()
    gc.collect()
    base = kib("VmRSS")
    infinity.wrap(model, nvme_path=sys.argv[1], param_tier="nvme", grad_tier="nvme",
                  chunk_bytes=int(sys.argv[2]))
    engine = engine_of(model)
    x = torch.randint(0, 32768, (2, 16))
    for _ in range(2):
        model(x).backward()
    host = engine.tier_bytes()["host"]
    out = {"base": base, "hwm": kib("VmHWM"), "staging": host["staging"],
           "grads": host["grads"],
           "largest": max(f.numel * 4 for f in engine.flats),
           "grad_buffers": host["grad_buffers"], "staging_buffers": host["staging_buffers"]}
    print(json.dumps(out))
    engine.close(restore=False)
""")


def test_peak_rss_does_not_grow_with_the_largest_flat(tmp_path):
    """A 64M-element embedding (256 MiB fp32) with a 4 MiB chunk, parameters and gradients on
    NVMe: the pools hold a few chunks, and peak RSS over forward+backward grows by what
    autograd and the compute buffers need, not by (window + 2) x the embedding."""
    chunk = 4 << 20
    script = tmp_path / "rss.py"
    script.write_text(_RSS_SCRIPT)
    swap = tmp_path / "swap"
    swap.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(infinity.__file__).parent.parent))
    proc = subprocess.run([sys.executable, str(script), str(swap), str(chunk)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = out["largest"]
    assert largest >= 256 << 20
    assert out["staging"] == out["staging_buffers"] * chunk
    assert out["grads"] == out["grad_buffers"] * chunk
    # sized from the largest flat, the pools would hold these bytes
    old_pools = (out["grad_buffers"] + out["staging_buffers"]) * largest
    growth = out["hwm"] - out["base"]
    # what remains: the embedding's compute buffer and its dense gradient from autograd
    # (one flat each) plus activations and the layers; well below the old pools alone
    assert growth < 3 * largest, (growth, largest)
    assert growth < old_pools - largest, (growth, old_pools)


def test_swap_store_ranged_io_checksums_per_piece(tmp_path):
    """Ranged writes and reads of whole pieces; the whole file's CRC is combined from the
    pieces'; a range that splits a piece is refused; a corrupted piece is named."""
    from infinity.tiers import SwapStore
    from infinity.tiers.pool_plan import piece_bytes
    for chunk in (8192, 4 << 20, 6 << 20, 256 << 20, 4096 * 1031 * 2):
        assert chunk % piece_bytes(chunk) == 0 and piece_bytes(chunk) <= max(chunk, 4 << 20)
    store = SwapStore(str(tmp_path))
    try:
        piece = 8192
        nbytes = 5 * piece + 4096  # a shorter last piece
        store.create("k", nbytes)
        store.use_pieces("k", piece)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        whole = infinity.io.aligned_empty(nbytes)
        whole.copy_(data)
        store.write("k", whole).wait()
        assert store.recorded_crc("k") == infinity.io.crc32c(data)
        # rewrite pieces 1-2 only
        new = infinity.io.aligned_empty(2 * piece)
        new.fill_(7)
        store.write_at("k", piece, new).wait()
        data[piece:3 * piece] = 7
        assert store.recorded_crc("k") == infinity.io.crc32c(data)
        back = infinity.io.aligned_empty(nbytes)
        store.read_sync("k", back)
        assert torch.equal(back, data)
        tail = infinity.io.aligned_empty(nbytes - 4 * piece)
        store.read_at_sync("k", 4 * piece, tail)  # ends at the end of the file
        assert torch.equal(tail, data[4 * piece:])
        with pytest.raises(ValueError, match="whole pieces"):
            store.read_at("k", 4096, infinity.io.aligned_empty(piece))
        with pytest.raises(ValueError, match="whole pieces"):
            store.write_at("k", 0, infinity.io.aligned_empty(piece + 4096))
        with open(store.path("k"), "r+b") as f:
            f.seek(3 * piece + 5)
            f.write(b"\x00\x01")
        part = infinity.io.aligned_empty(2 * piece)
        store.read_at("k", 2 * piece, part).wait()
        with pytest.raises(SwapCorruptionError, match=rf"bytes {3 * piece:,}-{4 * piece:,}"):
            store.verify_read_at("k", 2 * piece, part)
        with pytest.raises(RuntimeError, match="written already"):
            store.use_pieces("k", 4096)
    finally:
        store.close()


def test_zero3_nvme_shards_through_chunks_equal_one_buffer(tmp_path):
    """ZeRO-3 on 3 ranks, everything on NVMe, 2 micro-batches per step: each rank's shard
    flats (parameters straddling the parts, starting inside a parameter) stream through
    4 KiB chunks; the run equals the
    same one with one buffer per flat, bitwise, on every rank."""
    from dist_helpers import run_ranks
    runs = []
    for chunk in (None, 4096):
        settings = dict(nvme=True, param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
        if chunk is not None:
            settings["chunk_bytes"] = chunk
        opts = {"steps": 4, "batch": 12, "clip": 1.0, "settings": settings, "micro": 2,
                "big": 96}  # layers of ~18k elements: ~6k per rank, 6 chunks of 4 KiB
        results = run_ranks("train", 3, opts, tmp_path / f"c{chunk}")
        for r, res in enumerate(results):
            if "error" in res:
                raise AssertionError(f"rank {r}: {res['error']}\n{res['log'][-3000:]}")
        runs.append(results)
    for ref, got in zip(*runs):
        assert got["losses"] == ref["losses"]
        for name, value in ref["params"].items():
            assert torch.equal(got["params"][name], value), name
