"""Calibration text for `lmstack quantize`: a text file, or the model's own answers to built-in
prompts (`--calibration self`), cut into equal-length samples of token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmstack.commands.progress import Progress
from lmstack.errors import ConfigError

SELF = "self"  # --calibration self: the model's own generations

# Prompts for `--calibration self`: varied registers (instructions, prose, code, lists) so the
# activation statistics are not those of one kind of text. Written for this project.
SELF_PROMPTS = (
    "Explain how a bicycle gear system works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for keeping houseplants healthy, with a sentence on each.",
    "Write a Python function that merges two sorted lists, and explain it.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a virus and a bacterium?",
    "Write a polite email asking a colleague to review a report by Friday.",
    "Summarise the causes of the French Revolution.",
    "Give a recipe for a simple vegetable soup.",
    "Explain what a hash table is and when to use one.",
    "Write a poem about autumn rain in a city.",
    "How do airplanes stay in the air?",
    "Describe a typical day of a software engineer.",
    "What should I pack for a week-long hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a dialogue between a teacher and a student about homework.",
)


def split_validation(
    samples: torch.Tensor, num_samples: int, wanted: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(search samples, validation samples) of `calibration_samples(ids, num_samples + wanted,
    ...)`: the last `wanted` when the text gave them all, else at most a fifth of what it gave."""
    n = samples.shape[0]
    n_val = wanted if n >= num_samples + wanted else min(wanted, n // 5)
    return samples[: n - n_val], samples[n - n_val :]


def calibration_samples(ids: list[int], num_samples: int, seq_len: int) -> torch.Tensor:
    """Consecutive chunks of `seq_len` tokens from the start of `ids`, at most `num_samples`."""
    count = min(num_samples, len(ids) // seq_len)
    if count < 1:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens, fewer than one sample of --seq-len {seq_len}"
        )
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def generate_calibration_text(stack: Any, num_tokens: int, *, seed: int = 0) -> str:
    """The stack's model's own answers to `SELF_PROMPTS` (sampled, temperature 0.8, fixed seed),
    repeated with new seeds until they hold `num_tokens` tokens."""
    from lmstack.engine.llm import LLM
    from lmstack.sampling_params import SamplingParams

    llm = LLM(stack)
    try:
        texts: list[str] = []
        total, round_ = 0, 0
        bar = Progress(num_tokens, "calibration text", "tokens")
        while total < num_tokens:
            params = [
                SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512, seed=seed + round_ * 1000 + k)
                for k in range(len(SELF_PROMPTS))
            ]
            outs = llm.chat([[{"role": "user", "content": p}] for p in SELF_PROMPTS], params)
            for out in outs:
                texts.append(out.text.strip())
                total += len(out.token_ids)
                bar.update(len(out.token_ids))
            round_ += 1
        bar.close()
        return "\n\n".join(texts) + "\n"
    finally:
        llm.engine.shutdown()


def read_text(path: str | Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"text file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read text file {path}: {exc}") from None
    if not text.strip():
        raise ConfigError(f"text file {path} is empty")
    return text
