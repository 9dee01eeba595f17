"""`server.chat_template`: a chat template that replaces the model's own for chat requests.

The value is a path to a Jinja file, read once at startup, or the template text itself when it
contains a Jinja statement (``{%``). Rendering goes through a copy of the engine's tokenizer that
carries the override, so the template sees the same variables and sandbox as the model's own.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jinja2

from lmstack.errors import ConfigError
from lmstack.model.tokenizer import compile_chat_template

PARAM = "server.chat_template"


def load_chat_template(value: str | None) -> str | None:
    """The template text `value` names (None: the model's own). ConfigError (one line) when the
    file cannot be read or the template does not compile."""
    if value is None:
        return None
    if "{%" in value or "{{" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template file {value!r}: {exc}", path=PARAM) from None
    try:
        compile_chat_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}", path=PARAM) from None
    return text


def with_chat_template(tokenizer: Any, template: str | None) -> Any:
    """`tokenizer`, or a shallow copy of it rendering chats with `template`."""
    if template is None:
        return tokenizer
    clone = copy.copy(tokenizer)
    clone.chat_template = template
    clone.__dict__.pop("_compiled_template", None)  # the original's compiled template, if cached
    return clone
