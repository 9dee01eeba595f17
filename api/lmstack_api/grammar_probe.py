"""The child side of the grammar compile guard: `python -m lmstack_api.grammar_probe`.

Reads length-prefixed JSON frames on stdin and answers each on stdout. The first frame is the
xgrammar tokenizer description; every later one is ``{"kind": "json" | "regex" | "ebnf", "text":
the source, "strict": bool}``, answered with ``{"ok": true, "nbytes": ..., "peak_rss": ...}`` once
it compiled, or ``{"ok": false, "error": ...}`` when xgrammar rejected it. The compiled grammar is dropped: this
process only proves that a schema compiles within the bounds the parent enforces (by killing
it); compiled grammars are too large to ship back (a 400-property schema serialises to 110 MB).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from typing import BinaryIO

_HEADER = struct.Struct(">I")


def write_frame(out: BinaryIO, payload: dict) -> None:
    data = json.dumps(payload).encode()
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _read_exact(inp: BinaryIO, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = inp.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(inp: BinaryIO) -> bytes | None:
    head = _read_exact(inp, _HEADER.size)
    if head is None:
        return None
    return _read_exact(inp, _HEADER.unpack(head)[0])


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> int:
    # Frames go to a private copy of stdout; anything a library prints lands on stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    import xgrammar as xgr

    from lmstack.sample.grammar import compile_source, error_reason

    info_json = read_frame(inp)
    if info_json is None:
        return 0
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json(info_json.decode()), cache_enabled=False
    )
    write_frame(out, {"ready": True, "peak_rss": _peak_rss()})
    while (frame := read_frame(inp)) is not None:
        req = json.loads(frame)
        try:
            g = compile_source(compiler, req.get("kind", "json"), req["text"], req["strict"])
            reply = {"ok": True, "nbytes": int(g.memory_size_bytes), "peak_rss": _peak_rss()}
            del g
        except Exception as exc:  # xgrammar's verdict on the schema, sent back as text
            reply = {"ok": False, "error": error_reason(exc)}
        write_frame(out, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
