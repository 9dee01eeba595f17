"""`lmstack eval perplexity`: the engine's windowed perplexity against transformers' on the same
windows (tiny model and SmolLM2), and the command's output."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmstack.cli import main
from lmstack_calibrate.perplexity import perplexity, windows_of

TEXT = (
    "The lighthouse stood at the end of a long stone pier. Every evening the keeper climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep over the grey water. "
    "Ships passed far out, their lights small and steady, and none of them ever stopped. "
) * 3


def _hf_perplexity(model, ids: list[int], window: int) -> float:
    """transformers' perplexity over the same non-overlapping windows."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for chunk in windows_of(ids, window):
            t = torch.tensor([chunk])
            logits = model(t[:, :-1]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum").item()
            count += len(chunk) - 1
    return math.exp(nll / count)


def test_windows_predict_every_token_once():
    ids = list(range(11))
    chunks = windows_of(ids, 4)
    assert chunks == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10]]
    assert sum(len(c) - 1 for c in chunks) == len(ids) - 1


def _fp32_stack(model: str) -> dict:
    return {
        "model": model,
        "dtype": "float32",
        "scheduler": {"name": "continuous", "max_num_batched_tokens": 256},
        "allocator": {"name": "paged", "block_size": 16, "kv_cache_memory": "64MiB"},
        # The dequantized checkpoint through the reference kernels, as transformers computes it
        # (not the defaults' GGUF blocks with int8 activations and cpu-paged attention).
        "quant": {"weights": "none"},
        "attention": "torch",
    }


def test_tiny_model_matches_transformers(tiny_model_path):
    from transformers import LlamaForCausalLM

    from lmstack.engine.llm import LLM

    llm = LLM(_fp32_stack(str(tiny_model_path)))
    ids = llm.tokenizer.encode(TEXT)
    # Windows longer than a prefill chunk (256): the served path splits them, the reference not.
    ours = perplexity(llm.engine, TEXT, window=300, progress=False)
    llm.engine.shutdown()
    ref = LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    expected = _hf_perplexity(ref, ids, 300)
    assert ours.tokens == len(ids) - 1 and ours.windows == len(windows_of(ids, 300))
    assert ours.perplexity == pytest.approx(expected, rel=1e-4)


def test_smollm2_matches_transformers(smollm2_path, hf_smollm2):
    from lmstack.engine.llm import LLM

    model, _ = hf_smollm2
    llm = LLM(_fp32_stack(str(smollm2_path)))
    ids = llm.tokenizer.encode(TEXT)
    ours = perplexity(llm.engine, TEXT, window=64, progress=False)
    llm.engine.shutdown()
    assert ours.tokens == len(ids) - 1
    assert ours.perplexity == pytest.approx(_hf_perplexity(model, ids, 64), rel=2e-3)


def test_command_prints_json(tiny_model_path, tmp_path, capsys):
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"model: {tiny_model_path}\ndtype: float32\n", encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["eval", "perplexity", "--stack", str(stack), "--text", str(text), "--window", "32"]
    assert main([*args, "--max-tokens", "100", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["tokens"] == 99 and report["windows"] == 4
    assert report["quantizer"] == "none" and report["model"] == str(tiny_model_path)
    assert report["cpu_model"] and isinstance(report["cpu_flags"], list)
    assert math.isfinite(report["perplexity"]) and report["perplexity"] > 1
    assert "perplexity [" in captured.err  # the progress bar


def test_missing_text_is_one_line(tiny_model_path, tmp_path, capsys):
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"model: {tiny_model_path}\n", encoding="utf-8")
    assert main(["eval", "perplexity", "--stack", str(stack), "--text", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: text file not found: {tmp_path / 'none.txt'}"
