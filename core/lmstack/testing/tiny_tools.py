"""A tiny model whose chat template takes tools: the tiny Llama (`tiny_model.write_tiny_model`)
with a ChatML template in the Hermes / Qwen2.5 manner, for end-to-end tests of tool calling
through a template that renders `tools`, assistant `tool_calls` and `tool` results itself.

The template lists the functions as JSON inside ``<tools></tools>`` in the system turn and asks
for each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; tool results
come back in a user turn inside ``<tool_response></tool_response>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmstack.testing.tiny_model import write_tiny_model

# Rendered with trim_blocks (as transformers does): a newline right after a block tag is dropped,
# so newlines there are written as expressions.
HERMES_TOOLS_TEMPLATE = (
    # The system turn: the caller's system text, then (with tools) the functions and the format.
    "{% set first = messages[0] if messages else none %}"
    "{% if tools or (first and first.role == 'system') %}<|im_start|>system\n"
    "{% if first and first.role == 'system' %}{{ first.content }}{% if tools %}{{ '\n\n' }}{% endif %}{% endif %}"
    "{% if tools %}# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "Write each call as a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{% endif %}<|im_end|>\n{% endif %}"
    # The turns.
    "{% for message in messages %}"
    "{% if loop.first and message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tool_model(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """The tiny Llama in `path` with `HERMES_TOOLS_TEMPLATE` as its chat template (a longer
    context than the plain one: the function list makes long prompts for a byte-level vocabulary)."""
    overrides.setdefault("max_position_embeddings", 4096)
    folder = write_tiny_model(path, seed=seed, **overrides)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = HERMES_TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
