"""The engine rooms: the step loop (`LLMEngine`), the async front (`AsyncEngine`), the offline
`LLM`, and what they read and write around a step (input and output processing, the step plan,
the measured step cost)."""

from __future__ import annotations

__all__ = ["LLMEngine", "StackSource"]


def __getattr__(name: str):
    # Lazy: importing a light sibling (say `lmstack.engine.step_cost`) must not load torch.
    if name in __all__:
        from lmstack.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)
