"""`lmstack eval perplexity`: the engine's windowed perplexity against transformers' on the same
windows (tiny model and SmolLM2), llama-perplexity's chunks (`--method chunks`) against a plain
torch computation of the same NLL, and the command's output."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmstack.cli import main
from lmstack.errors import ConfigError
from lmstack_calibrate.perplexity import (
    chunk_first_scored,
    chunks_of,
    llama_cpp_perplexity,
    llama_cpp_tokens,
    perplexity,
    windows_of,
)

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


def test_chunks_are_llama_perplexity_s():
    ids = list(range(10, 31))  # 21 tokens: two chunks of 8, the last 5 tokens dropped
    assert chunks_of(ids, 8, None) == [list(range(10, 18)), list(range(18, 26))]
    assert chunks_of(ids, 8, 1) == [[1, *range(11, 18)], [1, *range(19, 26)]]
    assert chunks_of(ids, 8, None, max_chunks=1) == [list(range(10, 18))]
    assert ids == list(range(10, 31))  # the caller's tokens are not touched
    # Logits from position ctx/2 on, each predicting the next token: ctx - ctx/2 - 1 per chunk.
    assert chunk_first_scored(8) == 5 and chunk_first_scored(512) == 257 and chunk_first_scored(7) == 4
    with pytest.raises(ConfigError, match="tokenizes to 15 tokens; .* needs at least 16"):
        chunks_of(ids[:15], 8, None)


def _add_bos(tokenizer) -> None:
    """Make the tokenizer add its BOS (id 1 here) to every text, as a Llama-2 GGUF's add_bos does."""
    from tokenizers import processors

    bos = tokenizer.id_to_token(1)
    tokenizer.backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 1)]
    )


def test_llama_cpp_tokens_as_llama_perplexity_reads_the_text(tiny_model_path):
    from lmstack.model.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_folder(tiny_model_path)
    text = "a <|im_end|> b\n"
    # One trailing newline dropped (llama.cpp's -f); a special token's string read as text.
    ids, bos = llama_cpp_tokens(tok, text + "\n")
    assert bos is None and 2 not in ids and tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text).count(2) == 1  # the usual encoding parses it (and is left so)
    _add_bos(tok)
    ids, bos = llama_cpp_tokens(tok, "a b")
    assert bos == 1 and ids == [1, *tok.encode("a b")]


def _torch_chunks_perplexity(model, ids: list[int], ctx: int, bos: int | None, n_chunks: int) -> float:
    """llama-perplexity's NLL written out plainly: chunk i = ids[i*ctx:(i+1)*ctx] (BOS first when
    the model adds one), logits at positions ctx/2 .. ctx-2 against the tokens after them."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(n_chunks):
            chunk = list(ids[i * ctx : (i + 1) * ctx])
            if bos is not None:
                chunk[0] = bos
            logits = model(torch.tensor([chunk])).logits[0].float()
            logp = torch.log_softmax(logits[ctx // 2 : ctx - 1], dim=-1)
            targets = torch.tensor(chunk[ctx // 2 + 1 :])
            nll -= logp.gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return math.exp(nll / count)


@pytest.mark.parametrize("adds_bos", [False, True])
def test_tiny_model_chunks_match_torch(tiny_model_path, adds_bos):
    from transformers import LlamaForCausalLM

    from lmstack.engine.llm import LLM

    llm = LLM(_fp32_stack(str(tiny_model_path)))
    if adds_bos:
        _add_bos(llm.tokenizer)
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=True)
    ctx = 96
    n = len(ids) // ctx
    assert n >= 3 and (ids[0] == 1) == adds_bos
    ours = llama_cpp_perplexity(llm.engine, TEXT + "\n", ctx=ctx, progress=False)
    capped = llama_cpp_perplexity(llm.engine, TEXT, ctx=ctx, max_chunks=2, progress=False)
    llm.engine.shutdown()
    ref = LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    bos = 1 if adds_bos else None
    assert ours.windows == n and ours.tokens == n * (ctx - ctx // 2 - 1) and ours.method == "chunks"
    assert ours.perplexity == pytest.approx(_torch_chunks_perplexity(ref, ids, ctx, bos, n), rel=1e-4)
    assert capped.windows == 2 and capped.tokens == 2 * (ctx - ctx // 2 - 1)
    assert capped.perplexity == pytest.approx(_torch_chunks_perplexity(ref, ids, ctx, bos, 2), rel=1e-4)


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


def test_command_chunks_method(tiny_model_path, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["eval", "perplexity", str(tiny_model_path), "--text", str(text), "--set", "dtype=float32"]
    assert main([*args, "--method", "chunks", "--ctx", "32", "--chunks", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "chunks" and report["chunks"] == 2 and report["ctx"] == 32
    assert report["tokens"] == 2 * (32 - 16 - 1) and "windows" not in report
    # The other method's options are refused with one line, before the model loads.
    for extra, option in ((["--method", "chunks", "--window", "8"], "--window"), (["--ctx", "64"], "--ctx")):
        assert main([*args, *extra]) == 2
        method = "chunks" if "chunks" in extra else "windows"
        assert capsys.readouterr().err.strip() == f"error: {option} does not apply to --method {method}"
