"""Tiny models whose chat templates take tools: the tiny Llama (`tiny_model.write_tiny_model`) with
a short template in the manner of each tool-calling family, for end-to-end tests of tool calling
through a template that renders `tools`, assistant `tool_calls` and `tool` results itself.

- ``hermes`` (Hermes / Qwen2.5): the functions as JSON inside ``<tools></tools>`` in the system
  turn; each call ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; results in a
  user turn inside ``<tool_response></tool_response>``.
- ``llama3_json`` (Llama 3.1 / 3.2): ``Environment: ipython`` in the system turn; the functions
  and Llama's instruction (``{"name": function name, "parameters": ...}``) in the first user turn;
  calls as ``{"name": ..., "parameters": {...}}`` separated by ``; ``; results in an ``ipython`` turn.
- ``mistral`` (Mistral v3 tokenizers): ``[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`` before the
  last ``[INST]``; calls as ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``;
  results as ``[TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS]``.
- ``pythonic`` (Llama 4, Llama 3.2 pythonic): the format (``[func_name1(params_name1=...``) and
  the functions in the system turn; calls as ``[get_weather(city="Paris"), ping()]``; results in
  an ``ipython`` turn. (Forced calls of this style are lmstack's generic JSON array.)

The tiny tokenizer's only special tokens are ChatML's, so the turns of every style use
``<|im_start|>`` / ``<|im_end|>`` (its bos / eos) and the families' markers are plain text here.
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

LLAMA3_TOOLS_TEMPLATE = (
    # The system turn: the ipython environment when there are tools, then the caller's text.
    "{% set first = messages[0] if messages else none %}"
    "{% set ns = namespace(tools_shown=false) %}"
    "{% if tools or (first and first.role == 'system') %}<|im_start|>system\n"
    "{% if tools %}Environment: ipython\n{% endif %}"
    "{% if first and first.role == 'system' %}{{ first.content }}{% endif %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message.role == 'system' %}"
    # The first user turn carries the functions and the format, as Llama 3.1's template does.
    "{% elif message.role == 'user' %}<|im_start|>user\n"
    "{% if tools and not ns.tools_shown %}{% set ns.tools_shown = true %}"
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n\n' }}{% endfor %}"
    "{% endif %}{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>ipython\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MISTRAL_TOOLS_TEMPLATE = (
    # Mistral shows the functions, and the system text, with the last user message only.
    "{% set ns = namespace(last=-1, system='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% if loop.first and m.role == 'system' %}{% set ns.system = m.content %}{% endif %}"
    "{% endfor %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{% if ns.system and loop.index0 == ns.last %}{{ ns.system }}{{ '\n\n' }}{% endif %}"
    "{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' %}"
    "{% if message.tool_calls %}[TOOL_CALLS]["
    "{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, '
    '"id": "{{ call.id }}"}'
    "{% endfor %}]"
    "{% else %}{{ message.content }}{% endif %}{{ eos_token }}"
    "{% elif message.role == 'tool' %}"
    '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{% endif %}"
    "{% endfor %}"
)

PYTHONIC_TOOLS_TEMPLATE = (
    # The system turn: the format and the functions, then the caller's text.
    "{% set first = messages[0] if messages else none %}"
    "{% if tools or (first and first.role == 'system') %}<|im_start|>system\n"
    "{% if tools %}If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n"
    "Here is a list of functions in JSON format that you can invoke.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% if first and first.role == 'system' %}{{ first.content }}{% endif %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.tool_calls %}["
    "{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}{{ call.function.name }}("
    "{% for key, value in call.function.arguments.items() %}{% if not loop.first %}, {% endif %}"
    "{{ key }}={{ value | tojson }}{% endfor %})"
    "{% endfor %}]"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>ipython\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Style -> template; the style is also the name of the tool-call parser the template selects.
TOOL_TEMPLATES = {
    "hermes": HERMES_TOOLS_TEMPLATE,
    "llama3_json": LLAMA3_TOOLS_TEMPLATE,
    "mistral": MISTRAL_TOOLS_TEMPLATE,
    "pythonic": PYTHONIC_TOOLS_TEMPLATE,
}


def write_tiny_tool_model(
    path: str | Path, *, style: str = "hermes", seed: int = 0, **overrides: Any
) -> Path:
    """The tiny Llama in `path` with the `style` template of `TOOL_TEMPLATES` as its chat template
    (a longer context than the plain one: the function list makes long prompts for a byte-level
    vocabulary)."""
    if style not in TOOL_TEMPLATES:
        raise ValueError(f"unknown tool template style {style!r}; known: {', '.join(TOOL_TEMPLATES)}")
    overrides.setdefault("max_position_embeddings", 4096)
    folder = write_tiny_model(path, seed=seed, **overrides)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = TOOL_TEMPLATES[style]
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
