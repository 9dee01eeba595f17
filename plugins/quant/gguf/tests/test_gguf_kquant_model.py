"""K-quant GGUF files served packed: each family of the tiny fixtures (`tiny_families`,
`tiny_gemma`, widths multiples of 256) written as Q4_K_M by our converter with the reference
packer (`lmstack.testing.gguf_quants`), served with `quant: {weights: gguf}` against the same
file dequantized at load (`quant: {weights: none}`): greedy tokens equal, prompt log-probabilities
within the int8-activation tolerance (`test_gguf_model.py`'s), identical with fp32 activations
for every packed type; resident bytes within 5 % of the file's tensor bytes; a tp degree that
cuts a super-block refused in one line; a type no layer keeps (IQ4_NL) dequantized with one
warning line."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lmstack.model.gguf_file import read_gguf
from lmstack.model.memory import resident_weight_bytes
from lmstack.sampling_params import SamplingParams
from lmstack.testing.gguf_quants import quantize
from lmstack.testing.gguf_writer import write_gguf
from lmstack.testing.kit import one_thread, tiny_stack
from lmstack_gguf.kernel import FLOAT_TYPES, KQ_TYPES, native_kernel
from lmstack_gguf.linear import GGUFLinear

pytest.importorskip("transformers")
needs_ext = pytest.mark.skipif(
    native_kernel() is None, reason="the kernels did not build: every layer is dense"
)

T = gguf.GGMLQuantizationType
FAMILIES = ("llama3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3")
# Above KQ_MAX_ROWS: the prompt is prefilled through the slab path, decode runs kq_matmul_q8.
IDS = list(range(3, 43))
MAX_NEW = 6
SHORT_CONTEXT = 64  # max_model_len: the RoPE tables (buffers, counted as resident) stay small


@functools.cache
def _folder(family: str, root: Path) -> Path:
    if family.startswith("gemma"):
        from lmstack.testing.tiny_gemma import write_tiny_gemma

        # Widths of whole super-blocks (the tiny Gemma's defaults are 64 / 96); gemma2's GGUF ties.
        wide = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
        tie = {"tie_word_embeddings": True} if family == "gemma2" else {}
        return write_tiny_gemma(int(family[-1]), root / family, **wide, **tie)
    from lmstack.testing.tiny_families import write_tiny_family

    return write_tiny_family(family, root / family)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kquants")


def _file(family: str, kind: str, root: Path) -> Path:
    path = root / f"{family}.{kind}.gguf"
    if not path.exists():
        write_gguf(_folder(family, root), path, tensor_type=kind)
    return path


def _run(path: Path, quant: dict, **stack):
    """(greedy tokens, prompt log-probabilities, resident weight bytes, model) of one engine."""
    from lmstack.engine.llm import LLM
    from lmstack.stack.plugins import make_plugin_manager

    llm = LLM(
        {**tiny_stack(path, max_model_len=SHORT_CONTEXT), "attention": "torch", "quant": quant, **stack},
        plugin_manager=make_plugin_manager(),
    )
    try:
        runner = llm.engine.executor.runner
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
        with one_thread():
            out = llm.generate(IDS, params)[0]
        logprobs = torch.tensor([out.prompt_logprobs[i][IDS[i]] for i in range(1, len(IDS))])
        return out.outputs[0].token_ids, logprobs, resident_weight_bytes(runner.model), runner.model
    finally:
        llm.engine.shutdown()


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.data.nbytes) for t in read_gguf(path).tensors.values())


def _rope_bytes(model) -> int:
    """The RoPE tables' bytes (cos / sin buffers, counted as resident; not weights of the file)."""
    return sum(b.nbytes for m in model.modules() if "Rotary" in type(m).__name__ for b in m.buffers())


def _within_file_bytes(resident: int, model, path: Path) -> None:
    file_bytes = _file_tensor_bytes(path)
    assert resident <= 1.05 * file_bytes + _rope_bytes(model), (resident, file_bytes, _rope_bytes(model))


@needs_ext
@pytest.mark.parametrize("family", FAMILIES)
def test_q4_k_m_served_packed_as_the_dequantized_file(family, root) -> None:
    path = _file(family, "q4_k_m", root)
    expected, theirs, _, _ = _run(path, {"weights": "none"})
    # fp32 activations: the dequantized file's arithmetic up to summation order.
    tokens, ours, _, _ = _run(path, {"weights": "gguf", "activations": "fp32", "kv_cache": "none"})
    assert tokens == expected
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # Int8 activations with `kquant_batches: slabs` (x rounded per 32 values for the kq kernel and
    # the head, bfloat16 slabs for prefill on a native-bf16 CPU): packed, the layers' K-quant
    # segments and the tables from the file's bytes, nothing dense.
    slabs = {"weights": "gguf", "kv_cache": "none", "kquant_batches": "slabs"}
    tokens, ours, resident, model = _run(path, slabs)
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    kinds = {t for m in linears for t, _ in (m.segments or [])}
    assert {int(T.Q4_K), int(T.Q6_K)} <= kinds
    assert None not in kinds and all(m.dense is None and m.panels is None for m in linears)
    assert isinstance(model.lm_head, GGUFLinear)
    _within_file_bytes(resident, model, path)
    # The rounding's price on these random models (measured: mean 0.13-0.15, max 0.45-0.59 nats
    # against `none`): bounded. The first greedy token is the prompt's argmax; later ones may part
    # on near ties (an expert choice of the MoE flips), which fp32 activations above hold exactly.
    # Where AVX2 is the widest code (no native bf16: fp32 slabs, Q6_K as blocks), the MoE's prompt
    # flips the expert choice the default's rounding below flips (mean 0.45, max 10 nats): there
    # its first token holds.
    diffs = (ours - theirs).abs()
    assert diffs.max() > 1e-4  # x was rounded: the int8 path ran
    if family != "qwen3_moe" or native_kernel().best_isa() >= 2:
        assert diffs.mean() < 0.3 and diffs.max() < 1.5, (diffs.mean(), diffs.max())
    assert tokens[0] == expected[0]
    # The default (`kquant_batches: auto`: with AVX-512 VNNI the K-quant panels take the prompt
    # too, every row's x rounded to int8 as llama.cpp rounds it): the dense families within the
    # same bound. The MoE's prompt flips an expert choice on this random model when every prefill
    # row is rounded (mean 0.45, max 10 nats; `int8` through the kq kernel alone gives the same):
    # its first token holds.
    tokens, ours, _, _ = _run(path, {"weights": "gguf", "kv_cache": "none"})
    diffs = (ours - theirs).abs()
    if family != "qwen3_moe":
        assert diffs.mean() < 0.3 and diffs.max() < 1.5, (diffs.mean(), diffs.max())
    assert tokens[0] == expected[0]


@needs_ext
def test_kquant_batches_int8_computes_every_row_alike_whatever_the_chunking(root) -> None:
    """`kquant_batches: int8`: the prompt's 40 rows go through the kq kernel as one batch or in
    chunks of 8, and every row gets the same bits (the slabs would round x differently above 32
    rows: `slabs` is the default for prefill speed)."""
    path = _file("qwen3", "q4_k_m", root)
    quant = {"weights": "gguf", "kv_cache": "none", "kquant_batches": "int8"}
    attention = "cpu-paged"  # batch-invariant rows (torch's SDPA sums chunks in another order)
    tokens, whole, _, model = _run(path, quant, attention=attention)
    assert all(m.kq_max_rows > len(IDS) for m in model.modules() if isinstance(m, GGUFLinear))
    chunked = {"name": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 8}
    tokens_chunked, pieces, _, _ = _run(path, quant, attention=attention, scheduler=chunked)
    assert tokens_chunked == tokens
    assert torch.equal(pieces, whole)


@needs_ext
@pytest.mark.parametrize("kind", ["q2_k", "q3_k", "q5_k", "q6_k", "q5_0", "q5_1", "f16", "bf16"])
def test_each_kept_type_with_fp32_activations_is_the_dequantized_file(kind, root) -> None:
    """fp32 activations: every batch dequantizes a slab and multiplies in fp32, which is what
    `none` computes on the same file, up to summation order."""
    path = _file("qwen3", kind, root)
    tokens, ours, resident, model = _run(path, {"weights": "gguf", "activations": "fp32", "kv_cache": "none"})
    expected, theirs, _, _ = _run(path, {"weights": "none"})
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear) and m is not model.lm_head]
    assert {m.ggml_type for m in linears} == {int(T[kind.upper()])}
    assert tokens == expected
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    _within_file_bytes(resident, model, path)


@needs_ext
def test_a_type_no_layer_keeps_is_dequantized_with_one_warning(root, caplog) -> None:
    path = _file("llama3", "iq4_nl", root)
    with caplog.at_level(logging.WARNING, logger="lmstack_gguf"):
        tokens, ours, resident, model = _run(
            path, {"weights": "gguf", "activations": "fp32", "kv_cache": "none"}
        )
    lines = [r.getMessage() for r in caplog.records if "IQ4_NL" in r.getMessage()]
    assert len(lines) == 1 and "dequantized to fp32 at load" in lines[0] and "MB more" in lines[0], lines
    expected, theirs, _, _ = _run(path, {"weights": "none"})
    assert tokens == expected
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert resident > 3 * _file_tensor_bytes(path)  # dense fp32, and said so


def test_tp_that_cuts_a_super_block_is_refused_in_one_line(root) -> None:
    from lmstack.errors import ResolutionError
    from lmstack.exec.parallel_layout import check_tensor_parallel
    from lmstack.interfaces import BuildContext
    from lmstack.model.source import open_model_source
    from lmstack_gguf.plugin import GGUFOptions
    from lmstack_gguf.quantizer import GGUFQuantizer

    def quantizer(path: Path):
        config = open_model_source(str(path)).config
        ctx = BuildContext(config, torch.device("cpu"), torch.float32, torch.float32)
        return config, GGUFQuantizer(GGUFOptions(), ctx)

    # hidden 256 over 2 ranks: o_proj / down_proj keep 128 input columns, half a super-block.
    config, q = quantizer(_file("llama3", "q4_k_m", root))
    with pytest.raises(ResolutionError) as e:
        check_tensor_parallel(2, config, q)
    message = str(e.value)
    assert "\n" not in message and "shard alignment 256" in message and message.endswith("tp can be 1")
    # The same model in Q8_0 (32-value blocks) splits over 2 ranks.
    config, q = quantizer(_file("llama3", "q8_0", root))
    check_tensor_parallel(2, config, q)


@needs_ext
@pytest.mark.parametrize("qtype", sorted(KQ_TYPES) + sorted(FLOAT_TYPES), ids=lambda t: T(t).name)
def test_a_layer_of_each_kept_type_multiplies_and_gathers_rows(qtype) -> None:
    """One GGUFLinear per type: fp32-activation batches equal x @ dequantized W^T; int8 ones
    the rounded x times it; `rows(ids)` (an embedding lookup) gathers the dequantized rows;
    a layer whose parts are of different types keeps each in its own segment."""
    from lmstack.interfaces import LinearSpec
    from lmstack_gguf.kernel import round_q8

    torch.manual_seed(qtype)
    n, k = 40, 512
    w = torch.randn(n, k)
    if qtype in FLOAT_TYPES:
        stored = w.to(FLOAT_TYPES[qtype])
        dense = stored.float()
    else:
        raw = quantize(w.numpy(), T(qtype))
        stored = torch.from_numpy(raw)
        dense = torch.from_numpy(gguf.quants.dequantize(raw, T(qtype)).reshape(n, k).astype(np.float32))
    ids = torch.tensor([0, 39, 7, 7])
    for int8 in (False, True):
        layer = GGUFLinear(LinearSpec(k, n, False, "x"), int8_activations=int8)
        layer.set_blocks(qtype, stored.clone())
        assert layer.ggml_type == qtype and layer.dense is None
        assert torch.equal(layer.rows(ids), dense[ids])
        for m in (1, 5, 33, 70):
            x = torch.randn(m, k)
            xr = round_q8(x) if int8 and qtype in KQ_TYPES and m <= layer.kq_max_rows else x
            torch.testing.assert_close(layer(x), xr @ dense.T, atol=2e-3, rtol=1e-4)
    # Parts of two types (Q4_K_M's qkv: Q4_K then Q6_K rows): two segments, one output.
    spec = LinearSpec(k, 2 * n, False, "qkv", output_sizes=(n, n))
    layer = GGUFLinear(spec)
    q6 = quantize(w.numpy(), T.Q6_K)
    layer._parts = {0: (qtype, stored.clone()), 1: (int(T.Q6_K), torch.from_numpy(q6))}
    layer.finalize()
    dense6 = torch.from_numpy(gguf.quants.dequantize(q6, T.Q6_K).reshape(n, k).astype(np.float32))
    both = torch.cat([dense, dense6])
    if qtype != int(T.Q6_K):
        assert [t for t, _ in layer.segments] == [qtype, int(T.Q6_K)] and layer.ggml_type is None
    x = torch.randn(50, k)
    torch.testing.assert_close(layer(x), x @ both.T, atol=2e-3, rtol=1e-4)
    assert torch.equal(layer.rows(torch.tensor([1, n + 2, 2 * n - 1])), both[[1, n + 2, 2 * n - 1]])


def test_check_memory_prints_resident_bytes_and_what_was_dequantized(root, capsys) -> None:
    import re

    from lmstack import cli

    short = ["--set", f"max_model_len={SHORT_CONTEXT}", "--set", "attention=torch"]
    path = _file("llama3", "q4_k_m", root)
    assert cli.main(["check", str(path), "--memory", *short]) == 0
    out = capsys.readouterr().out
    m = re.search(r"memory    ([\d.]+) MB resident, ([\d.]+) bytes a weight .* ([\d.]+)x\)", out)
    assert m is not None, out
    if native_kernel() is not None:
        assert float(m[3]) <= 1.05 and float(m[2]) < 1.0
        assert "dequantized at load" not in out
    assert "the weights were loaded to measure memory" in out
    assert cli.main(["check", str(_file("llama3", "iq4_nl", root)), "--memory", *short]) == 0
    assert re.search(r"IQ4_NL tensors dequantized at load: \+[\d.]+ MB", capsys.readouterr().out)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_the_python_fallback_computes_what_the_extension_does(qtype, monkeypatch) -> None:
    """Where the built extension predates the kq ops, kernel.py's fallback serves the same
    layers: dequantization bit for bit, the int8-activation product within fp32 summation."""
    from lmstack_gguf import kernel

    torch.manual_seed(int(qtype))
    n, k = 24, 768
    raw = torch.from_numpy(quantize(torch.randn(n, k).numpy(), qtype))
    x = torch.randn(5, k)
    with_ext = kernel.kq_kernels() is not None
    ours = kernel.kq_dequantize(raw, qtype, k), kernel.kq_matmul_q8(x, raw, qtype)
    monkeypatch.setattr(kernel, "kq_kernels", lambda: None)
    dense, product = kernel.kq_dequantize(raw, qtype, k), kernel.kq_matmul_q8(x, raw, qtype)
    assert torch.equal(dense, torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, k)))
    torch.testing.assert_close(product, kernel.round_q8(x) @ dense.T, atol=1e-4, rtol=1e-5)
    if with_ext:
        assert torch.equal(ours[0], dense)
        torch.testing.assert_close(ours[1], product, atol=2e-3, rtol=1e-4)
