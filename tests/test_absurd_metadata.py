"""Absurd model metadata (issue 60, item 2): a checkpoint claiming 2^32 positions, 10^6 layers,
0 or "four" heads, or a tensor of 2^31 dimensions is refused in one line, exit status 2, at
`lmstack check` and at load, before anything is sized by the claim (peak RSS and time of the
real command measured per process); RoPE tables follow the context served, not the claim."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmstack import cli
from lmstack.errors import ConfigError
from lmstack.model.bounds import DEFAULT_MAX_POSITIONS, MAX_CONTEXT, ModelConfigError, table_positions
from lmstack.model.gguf_file import GGUFFormatError, read_gguf
from lmstack.model.source import ModelSource
from lmstack.testing.gguf_writer import write_gguf

I32 = 2**32


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_path, tmp_path_factory) -> Path:
    return write_gguf(tiny_model_path, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _hf(tiny_model_path: Path, folder: Path, **overrides: Any) -> Path:
    """A copy of the tiny Llama folder whose config.json has `overrides`; the weights are
    linked, not copied."""
    folder.mkdir()
    for f in tiny_model_path.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **overrides}))
    return folder


def _gguf(src: Path, out: Path, **overrides: Any) -> Path:
    """`src` rewritten by the gguf package's writer with `llama.<key>` values replaced (dots
    in keys as double underscores): an int keeps the field's type unless it does not fit a
    u32 (then u64); a string is written as a string."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), "llama")
    wanted = {"llama." + k.replace("__", "."): v for k, v in overrides.items()}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        if key in wanted:
            value = wanted.pop(key)
            if isinstance(value, str):
                vtype = gguf.GGUFValueType.STRING
            elif value >= I32:
                vtype = gguf.GGUFValueType.UINT64
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    assert not wanted, f"not in the file: {wanted}"
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _patch_tensor_info(src: Path, out: Path, name: str, n_dims: int | None = None, dims=None) -> Path:
    """`src` with tensor `name`'s info edited in place: its u32 n_dims, or its u64 dims (the
    writer refuses to write either)."""
    raw = bytearray(src.read_bytes())
    encoded = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(encoded) + len(encoded)
    if n_dims is not None:
        raw[at : at + 4] = struct.pack("<I", n_dims)
    if dims is not None:
        (old,) = struct.unpack_from("<I", raw, at)
        assert old == len(dims)
        raw[at + 4 : at + 4 + 8 * old] = struct.pack(f"<{old}Q", *dims)
    out.write_bytes(bytes(raw))
    return out


# (case id, how to make the model from (tiny folder, tiny gguf, tmp dir), words the line has)
CASES = [
    (
        "hf-context-2^32",
        lambda hf, g, d: _hf(hf, d / "m", max_position_embeddings=I32),
        "max_position_embeddings = 4294967296 is outside",
    ),
    (
        "hf-layers-10^6",
        lambda hf, g, d: _hf(hf, d / "m", num_hidden_layers=10**6),
        "num_hidden_layers = 1000000 is outside",
    ),
    ("hf-heads-0", lambda hf, g, d: _hf(hf, d / "m", num_attention_heads=0), "num_attention_heads = 0"),
    (
        "hf-heads-four",
        lambda hf, g, d: _hf(hf, d / "m", num_attention_heads="four"),
        "num_attention_heads must be an integer, got 'four'",
    ),
    ("hf-vocab-float", lambda hf, g, d: _hf(hf, d / "m", vocab_size=275.5), "vocab_size must be an integer"),
    (
        "hf-kv-heads-not-dividing",
        lambda hf, g, d: _hf(hf, d / "m", num_key_value_heads=3),
        "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3",
    ),
    (
        "gguf-context-2^32-1",
        lambda hf, g, d: _gguf(g, d / "m.gguf", context_length=I32 - 1),
        "llama.context_length = 4294967295 is outside",
    ),
    (
        "gguf-layers-10^6",
        lambda hf, g, d: _gguf(g, d / "m.gguf", block_count=10**6),
        "llama.block_count = 1000000 is outside",
    ),
    (
        "gguf-layers-beyond-tensors",
        lambda hf, g, d: _gguf(g, d / "m.gguf", block_count=900),
        "block_count = 900, but the file stores tensors for 2 layers",
    ),
    (
        "gguf-heads-0",
        lambda hf, g, d: _gguf(g, d / "m.gguf", attention__head_count=0),
        "llama.attention.head_count = 0 is outside",
    ),
    (
        "gguf-heads-four",
        lambda hf, g, d: _gguf(g, d / "m.gguf", attention__head_count="four"),
        "llama.attention.head_count must be an integer, got 'four'",
    ),
    (
        "gguf-embedding-not-the-tensors",
        lambda hf, g, d: _gguf(g, d / "m.gguf", embedding_length=4096),
        "embedding_length = 4096, but token_embd.weight is 64 wide",
    ),
    (
        "gguf-tensor-2^31-dims",
        lambda hf, g, d: _patch_tensor_info(g, d / "m.gguf", "token_embd.weight", n_dims=2**31),
        "has 2147483648 dimensions; GGUF tensors have at most 4",
    ),
    (
        "gguf-tensor-of-2^31-x-2^31",
        lambda hf, g, d: _patch_tensor_info(g, d / "m.gguf", "token_embd.weight", dims=[2**31, 2**31]),
        "runs past the end of the file",
    ),
]


@pytest.mark.parametrize("make, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_and_load_refuse_in_one_line(
    make, words, tiny_model_path, tiny_gguf, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    model = make(tiny_model_path, tiny_gguf, tmp_path)
    for argv in (["check", str(model)], ["generate", "--max-tokens", "1", str(model), "hi"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert words in lines[0], lines[0]
        assert "Traceback" not in err and out == ""


def test_the_errors_are_model_config_errors(tiny_model_path, tmp_path):
    bad = _hf(tiny_model_path, tmp_path / "m", num_hidden_layers=10**6)
    with pytest.raises(ModelConfigError) as info:
        _ = ModelSource(bad).config
    assert isinstance(info.value, ConfigError)  # what every caller already reports in one line


def test_the_reader_refuses_counts_the_file_cannot_hold(tiny_gguf, tmp_path):
    raw = bytearray(tiny_gguf.read_bytes())
    raw[16:24] = struct.pack("<Q", 2**60)  # key/value count
    (tmp_path / "kv.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError, match="metadata keys cannot fit"):
        read_gguf(tmp_path / "kv.gguf")
    # An array of 2^40 strings (the tokenizer's list claims it): refused before a string is read.
    raw = bytearray(tiny_gguf.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4  # after type, elem type
    raw[at : at + 8] = struct.pack("<Q", 2**40)
    (tmp_path / "arr.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError, match="array values cannot fit"):
        read_gguf(tmp_path / "arr.gguf")


def test_a_sane_file_still_reads(tiny_model_path, tiny_gguf, tmp_path):
    """The rewrite itself is faithful: without overrides both fixtures load the same config."""
    same = _gguf(tiny_gguf, tmp_path / "same.gguf")
    assert ModelSource(same, "tiny").config == ModelSource(tiny_gguf, "tiny").config
    hf = ModelSource(tiny_model_path).config
    assert (hf.num_layers, hf.num_heads, hf.max_position_embeddings) == (2, 4, 1024)


# --- the real command, one process per fixture: exit 2, one line, peak RSS and time ---------

MEASURED = ["hf-context-2^32", "gguf-layers-10^6", "gguf-tensor-2^31-dims"]


def test_the_command_stays_small_and_quick(tiny_model_path, tiny_gguf, tmp_path):
    """`lmstack check MODEL` as a process: exit 2, one line on stderr, peak RSS below 500 MB.
    Each check runs as the only child of a small parent that reports
    getrusage(RUSAGE_CHILDREN).ru_maxrss (that child's peak). The seconds are printed, not
    asserted (the test machine's cores are shared); a hang fails on the timeout."""
    env = {**os.environ, "LMSTACK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    makers = {c[0]: c[1] for c in CASES}
    for case in MEASURED:
        folder = tmp_path / case
        folder.mkdir()
        model = makers[case](tiny_model_path, tiny_gguf, folder)
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE, sys.executable, "-m", "lmstack.cli", "check", str(model)],
            capture_output=True,
            text=True,
            env=env,
            cwd=folder,
            timeout=120,
        )
        seconds = time.monotonic() - start
        result = json.loads(proc.stdout)
        assert result["rc"] == 2, (case, result)
        assert result["stdout"] == "" and len(result["stderr"].strip().splitlines()) == 1, (case, result)
        peak_mb = result["maxrss_kib"] * 1024 / 1e6
        print(f"{case}: exit 2 in {seconds:.1f} s, peak RSS {peak_mb:.0f} MB: {result['stderr'].strip()}")
        assert peak_mb < 500, (case, peak_mb)
        shutil.rmtree(folder)


# The parent that measures one child: its exit status, output and peak RSS (KiB on Linux).
_MEASURE = (
    "import json, resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(json.dumps({'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr, 'maxrss_kib': peak}))\n"
)


def test_rope_tables_follow_the_context_served(tiny_model_path, tmp_path):
    """A checkpoint claiming the largest sane context builds a RoPE table of the default cap
    without a configured max_model_len, and of max_model_len with one."""
    import dataclasses

    from lmstack.model.llama import LlamaModel

    assert table_positions(MAX_CONTEXT, None) == DEFAULT_MAX_POSITIONS
    assert table_positions(MAX_CONTEXT, 4096) == 4096
    assert table_positions(1024, None) == 1024 and table_positions(1024, 4096) == 1024
    cfg = dataclasses.replace(ModelSource(tiny_model_path).config, max_position_embeddings=MAX_CONTEXT)
    assert LlamaModel(cfg).rope.cos.shape[0] == DEFAULT_MAX_POSITIONS
