"""estimate(link_gbps=..., comm=...): ZeRO-3's bytes on the wire per rank per step, full width
and compressed, and their time on the link (infinity/plan/comm.py)."""
import pytest
import torch

import infinity
from infinity.plan.comm import comm_per_step
from infinity.plan.probe import probe
from infinity.plan.shape import describe

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                tie_word_embeddings=False)


def test_volumes_follow_the_collectives():
    shape = describe(LLAMA_8B, bytes_per_param=2)
    n = shape.params
    full = comm_per_step(shape, 2, 10.0, infinity.CommPolicy(), compute_bytes=2)
    # forward and backward all-gathers of bf16 weights and one fp32 reduce, half crossing
    assert full.full_gather_bytes == pytest.approx(2 * n * 0.5 * 2)
    assert full.full_reduce_bytes == pytest.approx(n * 0.5 * 4)
    assert full.seconds == pytest.approx(full.full_seconds)
    assert full.full_seconds == pytest.approx((4 * n) * 8 / 10e9)
    q = comm_per_step(shape, 2, 10.0, infinity.CommPolicy("int8", "int4", True), 2)
    assert q.gather_bytes / q.full_gather_bytes == pytest.approx((1 + 4 / 256) / 2)
    assert q.reduce_bytes / q.full_reduce_bytes == pytest.approx((0.5 + 4 / 256) / 4)
    assert q.error_feedback_bytes == 4 * n
    # k micro-batches: the plain loop gathers and reduces k times, layer-major once
    k8 = comm_per_step(shape, 2, 10.0, infinity.CommPolicy(), 2, micro_batches=8)
    lm = comm_per_step(shape, 2, 10.0, infinity.CommPolicy(), 2, 8, layer_major=True)
    assert k8.full_seconds == pytest.approx(8 * full.full_seconds)
    assert lm.full_seconds == pytest.approx(full.full_seconds)
    assert q.step_s(1.0) == max(1.0, q.seconds) and q.step_s(1.0, overlap=False) == 1 + q.seconds
    with pytest.raises(ValueError, match="ranks"):
        comm_per_step(shape, 1, 10.0, infinity.CommPolicy())


def test_estimate_lists_the_traffic_per_rank_count(tmp_path):
    pr = probe(str(tmp_path), quick=True, cache=str(tmp_path / "probe.json"))
    table = infinity.estimate(LLAMA_8B, ranks=[1, 2, 4], probe=pr, link_gbps=100,
                              comm="int8", dtype=torch.bfloat16, placements=["host"])
    assert [c.ranks for c in table.comm] == [2, 4]
    assert all(c.seconds < c.full_seconds for c in table.comm)
    text = str(table)
    assert "2 ranks at 100 Gb/s" in text and "4 ranks at 100 Gb/s" in text
    assert infinity.estimate(LLAMA_8B, ranks=2, probe=pr, placements=["host"],
                             dtype=torch.bfloat16).comm == []
