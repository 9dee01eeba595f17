"""docs/plugins.md runs: every runnable code block in it is executed, and its links resolve.

Convention (stated at the top of docs/plugins.md too):

- a fenced block whose info string is exactly ``python`` is a complete program; it is run, in a
  fresh namespace, in the order of the file (blocks do not share state);
- ``python no-run`` marks a fragment or a file that needs an installed package: shown, not run;
- runnable blocks are also held to the repository's ruff rules and format (readers copy them);
- ``toml`` blocks must parse (they are pyproject.toml excerpts); other languages (``sh``,
  ``yaml``, ``text``) are not checked here.

A failure names the block's first line in docs/plugins.md, and the traceback points into the
document itself (each block is compiled under the document's file name at its own line numbers).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
RUN, NO_RUN = "python", "python no-run"
FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    info: str  # the fence's info string, e.g. "python" or "python no-run"
    line: int  # 1-based line of the block's first code line in the document
    code: str


def read_blocks(text: str) -> list[Block]:
    """Fenced code blocks at the start of a line, with the line their code starts on."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        start = i + 1
        end = start
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"docs/plugins.md:{i + 1}: code block is never closed")
        blocks.append(Block(info, start + 1, "\n".join(lines[start:end]) + "\n"))
        i = end + 1
    return blocks


BLOCKS = read_blocks(DOC.read_text(encoding="utf-8"))
RUNNABLE = [b for b in BLOCKS if b.info == RUN]


def test_the_convention_is_followed() -> None:
    """Every Python block says whether it runs; a typo in the marker would silently skip one."""
    for b in BLOCKS:
        if b.info.split(" ")[0] in ("python", "py", "python3"):
            assert b.info in (RUN, NO_RUN), (
                f"docs/plugins.md:{b.line - 1}: python block marked {b.info!r}; use ```{RUN} "
                f"(a complete program, run by this test) or ```{NO_RUN} (shown only)"
            )
    # The guide's worked examples: scheduler, capabilities, build order, attention, quantizer,
    # speculator, plugin API.
    assert len(RUNNABLE) >= 7


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line-{b.line}" for b in RUNNABLE])
def test_runnable_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # Padding with blank lines makes tracebacks show the document's own line numbers.
    # dont_inherit: a block runs as a reader runs it, without this module's `from __future__`
    # (postponed annotations would hide what msgspec must resolve from the block's own names).
    code = compile("\n" * (block.line - 1) + block.code, str(DOC), "exec", dont_inherit=True)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    try:
        exec(code, namespace)
    except BaseException as exc:
        printed = capsys.readouterr().out[-2000:]
        raise AssertionError(
            f"the code block at docs/plugins.md:{block.line} failed: {type(exc).__name__}: {exc}\n"
            f"--- its output ---\n{printed}"
        ) from exc
    finally:
        # Blocks build engines; release them even when an assertion in the block failed.
        for value in namespace.values():
            engine = getattr(value, "engine", None)
            if engine is not None and hasattr(engine, "shutdown"):
                engine.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_runnable_blocks_pass_ruff(tmp_path: Path) -> None:
    files = []
    for b in RUNNABLE:
        path = tmp_path / f"plugins_md_line_{b.line}.py"
        path.write_text(b.code, encoding="utf-8")
        files.append(str(path))
    config = str(ROOT / "pyproject.toml")
    for args in (["check", "--output-format", "concise"], ["format", "--diff"]):
        run = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--config", config, *files], capture_output=True, text=True
        )
        # The file names carry each block's first line in docs/plugins.md.
        assert run.returncode == 0, f"ruff {args[0]} on the runnable blocks:\n{run.stdout}{run.stderr}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.info == "toml"], ids=lambda b: f"line-{b.line}")
def test_toml_blocks_parse(block: Block) -> None:
    try:
        data = tomllib.loads(block.code)
    except tomllib.TOMLDecodeError as exc:
        raise AssertionError(
            f"the toml block at docs/plugins.md:{block.line} does not parse: {exc}"
        ) from None
    assert data.get("project", {}).get("entry-points", {}).get("lmstack"), (
        f"docs/plugins.md:{block.line}: a pyproject excerpt should show the `lmstack` entry point"
    )


def test_relative_links_resolve() -> None:
    text = DOC.read_text(encoding="utf-8")
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (DOC.parent / path).exists(), f"docs/plugins.md links to {target}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"docs/plugins.md links to #{anchor}, which is no heading"


def _slug(heading: str) -> str:
    # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_read_blocks_finds_info_strings_and_lines() -> None:
    text = "intro\n```python\nx = 1\n```\n\n````text\n```\n````\n```python no-run\ny\n```\n"
    blocks = read_blocks(text)
    assert [(b.info, b.line, b.code) for b in blocks] == [
        ("python", 3, "x = 1\n"),
        ("text", 7, "```\n"),
        ("python no-run", 10, "y\n"),
    ]
    with pytest.raises(AssertionError, match="never closed"):
        read_blocks("```python\nx = 1\n")
