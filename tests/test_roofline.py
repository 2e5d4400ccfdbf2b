"""`nanoserve bench roofline` (roofline.py) on tiny-llama: its byte counts and what it reports (never its times).

* the weights a step reads are every parameter once: a tied embedding counted once, an untied one not at all;
* the K/V per step agrees with the runner's bytes per block;
* each batch gets a point whose floor is its bytes over the measured bandwidth;
* the command prints the table and draws the figure; a bad --batches is refused by its flag.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import cli, roofline
from nanoserve.runner import kv_bytes_per_block


def test_weight_bytes_count_each_storage_once(tiny_llama):
    model = tiny_llama.model
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    want = sum(params.values()) + sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())
    if embed.data_ptr() != head.data_ptr():      # untied: a step reads a few rows of the table, not all of it
        want -= embed.numel() * embed.element_size()
    assert roofline.weight_bytes(model) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_agree_with_the_runners_blocks(tiny_llama, dtype):
    model = tiny_llama.model
    per_token = kv_bytes_per_block(model, 16, dtype) // 16
    assert roofline.kv_bytes(model, dtype, batch=3, context=40) == 3 * 41 * per_token


def test_measure_reports_a_point_per_batch(tiny_llama):
    result = roofline.measure("tiny-llama", batches=(1, 3), prompt_len=12, steps=2, bandwidth_mb=8)
    assert [p.batch for p in result.points] == [1, 3]
    assert result.bandwidth.best_gbs > 0 and result.weight_bytes == roofline.weight_bytes(tiny_llama.model)
    for p in result.points:
        assert p.bytes == result.weight_bytes + roofline.kv_bytes(tiny_llama.model, torch.float32, p.batch, p.context)
        assert p.floor_s == pytest.approx(p.bytes / (result.bandwidth.best_gbs * 1e9))
        assert p.fraction == pytest.approx(p.floor_s / p.step_s)
        assert p.tokens_per_s == pytest.approx(p.batch / p.step_s)
    assert "forward.c" in result.implementation or "fast path" in result.implementation
    assert len(result.table().splitlines()) == 5 + len(result.points)


def test_the_command_prints_and_draws(tmp_path, capsys):
    out = tmp_path / "roofline.png"
    assert cli.main(["bench", "roofline", "--model", "tiny-llama", "--batches", "1,2", "--steps", "2",
                     "--prompt-len", "8", "--threads", "1", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "of roofline" in text and f"wrote {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("batches", ["0", "1,x", ""])
def test_bad_batches_are_refused_by_flag(batches, capsys):
    assert cli.main(["bench", "roofline", "--model", "tiny-llama", "--batches", batches]) == 2
    assert "--batches" in capsys.readouterr().err
