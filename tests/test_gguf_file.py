"""Our GGUF header reader against the `gguf` package's reader: the same metadata values (and
Python types) and the same tensor views, on a written file with every value type and several
tensor types, and on the real SmolLM2 file; broken files are a one-line error."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest

from lmstack.errors import ConfigError
from lmstack.model.gguf_file import GGUFFormatError, read_gguf
from lmstack.model.gguf_loader import open_gguf


def _theirs(path: Path):
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, reader.tensors


def _assert_same(path: Path) -> None:
    ours = read_gguf(path)
    meta, tensors = _theirs(path)
    assert list(ours.metadata) == list(meta)
    for key, value in meta.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
        if isinstance(value, list) and value:
            assert type(ours.metadata[key][0]) is type(value[0]), key
    assert list(ours.tensors) == [t.name for t in tensors]
    for t in tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type, t.name
        assert mine.shape == tuple(int(n) for n in reversed(t.shape)), t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data, t.data), t.name


def _write(path: Path, rng: random.Random, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [rng.randint(-1000, 1000) for _ in range(50)])
    w.add_array("t.floats", [rng.random() for _ in range(7)])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_tensor("f32", np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16_1d", np.arange(7, dtype=np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.BF16,
    ):
        dense = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
        packed = gguf.quants.quantize(dense, qtype)
        w.add_tensor(f"q_{qtype.name}", packed, raw_shape=packed.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_as_the_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    _write(path, random.Random(), alignment)
    _assert_same(path)
    f = read_gguf(path)
    assert f.metadata["t.str"] == "héllo ✓" and f.metadata["t.u64"] == 2**63 + 5
    assert f.tensors["q_Q8_0"].is_quantized and f.tensors["q_Q8_0"].data.shape == (3, 68)


def test_the_real_model_reads_as_the_gguf_reader_reads_it(smollm2_path):
    _assert_same(smollm2_path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"GGUX" + b[4:], "no GGUF magic"),
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version 7 is not supported"),
        (lambda b: b[:4] + (3 << 24).to_bytes(4, "little") + b[8:], "big-endian"),
        (lambda b: b[:60], "ends inside the header"),
        (lambda b: b[: len(b) - 40], "runs past the end of the file"),
    ],
)
def test_a_damaged_file_is_one_clear_error(tmp_path, damage, message):
    good = tmp_path / "good.gguf"
    _write(good, random.Random(0))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf(bad)
    with pytest.raises(ConfigError, match=f"cannot read GGUF file {bad}"):
        open_gguf(bad)
