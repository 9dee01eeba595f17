"""`lmstack_bench.roofline`: the model's matmul parameters from GGUF shapes (against a hand count),
the figures of a hand-made load point (against a request-by-request count) and the calibration."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from lmstack_bench.metrics import RequestRecord, summarize
from lmstack_bench.roofline import (
    calibrate,
    gguf_shapes,
    matmul_flops,
    peak_for,
    point_figures,
    step_weight_bytes,
)

HIDDEN, FFN, VOCAB, LAYERS = 64, 96, 128, 2


def write_tiny(path, tied: bool = True, experts: int = 0, used: int = 0) -> None:
    """A llama-shaped GGUF: norms (1-D), q/k/v/o and a gated FFN per layer (or `experts` experts
    of which `used` run per token), the token embedding and, untied, an output head."""
    w = gguf.GGUFWriter(str(path), "llama")
    if experts:
        w.add_uint32("llama.expert_count", experts)
        w.add_uint32("llama.expert_used_count", used)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:  # numpy order: (out, in); ggml stores (in, out)
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    add("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN)
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_k.weight", 16, HIDDEN)
        add(f"blk.{i}.attn_v.weight", 16, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        if experts:
            add(f"blk.{i}.ffn_gate_exps.weight", experts, FFN, HIDDEN)
            add(f"blk.{i}.ffn_up_exps.weight", experts, FFN, HIDDEN)
            add(f"blk.{i}.ffn_down_exps.weight", experts, HIDDEN, FFN)
        else:
            add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
            add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
            add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    add("output_norm.weight", HIDDEN)
    if not tied:
        add("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# By hand: per layer q, k, v, o and three FFN matrices.
ATTN = HIDDEN * HIDDEN * 2 + 16 * HIDDEN * 2
FFN3 = 3 * HIDDEN * FFN
BODY = LAYERS * (ATTN + FFN3)
BODY_ROWS = LAYERS * (HIDDEN * 2 + 16 * 2 + FFN * 2 + HIDDEN)
HEAD = VOCAB * HIDDEN
NORMS = (LAYERS + 1) * HIDDEN  # attn_norm per layer, output_norm


def test_shapes_of_a_tied_and_an_untied_model(tmp_path):
    write_tiny(tmp_path / "tied.gguf")
    s = gguf_shapes(tmp_path / "tied.gguf")
    assert (s.body_params, s.head_params, s.embedding_params, s.tied) == (BODY, HEAD, HEAD, True)
    assert (s.body_rows, s.head_rows) == (BODY_ROWS, VOCAB) and s.matmul_params == BODY + HEAD
    # All fp32: a decode step reads the layers, the norms and the embedding once, as the head.
    assert s.file_step_bytes == 4 * (BODY + NORMS + HEAD)
    write_tiny(tmp_path / "untied.gguf", tied=False)
    u = gguf_shapes(tmp_path / "untied.gguf")
    assert (u.body_params, u.head_params, u.tied) == (BODY, HEAD, False)
    assert u.file_step_bytes == 4 * (BODY + NORMS + HEAD)  # the head, not the embedding lookup
    # The forms a server may hold them in.
    assert step_weight_bytes(s, "file") == s.file_step_bytes
    assert step_weight_bytes(s, "bf16") == 2 * (BODY + HEAD)
    assert step_weight_bytes(s, "int8") == BODY + HEAD + 4 * (BODY_ROWS + VOCAB)
    assert step_weight_bytes(s, "int4") == (BODY + HEAD) // 2
    with pytest.raises(ValueError, match="unknown weight form"):
        step_weight_bytes(s, "int3")


def test_moe_experts_count_for_the_ones_a_token_uses(tmp_path):
    write_tiny(tmp_path / "moe.gguf", experts=4, used=2)
    s = gguf_shapes(tmp_path / "moe.gguf")
    assert s.body_params == LAYERS * (ATTN + 2 * FFN3)  # 2 of the 4 experts' FFNs
    assert s.file_step_bytes == 4 * (LAYERS * (ATTN + 4 * FFN3) + NORMS + HEAD)  # the file holds all 4


def test_smollm2_parameters_by_hand(smollm2_path):
    s = gguf_shapes(smollm2_path)
    h, kv, ffn, layers, vocab = 576, 192, 1536, 30, 49152
    assert s.body_params == layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) == 106_168_320
    assert s.head_params == s.embedding_params == h * vocab and s.tied
    reader = gguf.GGUFReader(str(smollm2_path))
    assert s.file_step_bytes == sum(int(t.n_bytes) for t in reader.tensors)  # tied: every tensor


def records(n: int, prompt: int, out: int, ttft: float, itl: float) -> list[RequestRecord]:
    """n requests one after another, `out` tokens each, `itl` seconds apart after `ttft`."""
    rows, t = [], 0.0
    for _ in range(n):
        chunks = [t + ttft + k * itl for k in range(out)]
        rows.append(RequestRecord(start=t, end=chunks[-1], prompt_tokens=prompt, output_tokens=out,
                                  first_token=chunks[0], chunk_times=chunks))  # fmt: skip
        t = chunks[-1]
    return rows


def test_point_figures_of_a_hand_made_run(tmp_path):
    write_tiny(tmp_path / "m.gguf")
    shapes = gguf_shapes(tmp_path / "m.gguf")
    summary = summarize(records(n=3, prompt=100, out=11, ttft=0.5, itl=0.020))
    # Request by request: the prompt through the layers and the head at its last position (the
    # first token), then each further token through both.
    flops = 3 * (2 * (100 * BODY + HEAD) + 10 * 2 * (BODY + HEAD))
    assert matmul_flops(shapes, 300, 33, 3) == flops
    duration = 3 * (0.5 + 10 * 0.020)
    cal = {"gflops": {"fp32": 50.0, "bf16": 100.0, "int8": None}, "memory_gb_s": 20.0}
    fig = point_figures(summary, shapes, "bf16", 2_000_000, cal)
    assert fig["gflops"] == pytest.approx(flops / duration / 1e9)
    assert fig["prefill_gflops"] == pytest.approx(2 * (100 * BODY + HEAD) / 0.5 / 1e9)
    assert fig["decode_bytes_per_s"] == pytest.approx(2_000_000 / 0.020)  # 100 MB/s
    assert fig["peak"] == "bf16" and fig["gflops_fraction"] == pytest.approx(fig["gflops"] / 100.0)
    assert fig["prefill_fraction"] == pytest.approx(fig["prefill_gflops"] / 100.0)
    assert fig["decode_fraction"] == pytest.approx(0.1e9 / 20e9)
    # int8 not measured: the highest measured peak, named.
    assert peak_for(cal, "int8") == ("max=bf16", 100.0) and peak_for(cal, "fp32") == ("fp32", 50.0)
    assert point_figures(summary, shapes, "int8", None, cal)["peak"] == "max=bf16"
    # No calibration, no weight bytes: absolute figures only.
    bare = point_figures(summary, shapes, "fp32", None, None)
    assert bare["gflops"] == pytest.approx(fig["gflops"]) and bare["decode_bytes_per_s"] is None
    assert bare["peak"] is None and bare["gflops_fraction"] is None and bare["decode_fraction"] is None


def test_calibrate_measures_positive_peaks_and_restores_threads():
    before = torch.get_num_threads()
    cal = calibrate(1, 0.5, size=64, mem_mb=4, repeats=2)
    assert torch.get_num_threads() == before and cal["threads"] == 1
    assert cal["gflops"]["fp32"] > 0 and cal["gflops"]["bf16"] > 0 and cal["memory_gb_s"] > 0
    if cal["gflops"]["int8"] is None:  # this torch lacks torch._int_mm on the CPU: said why
        assert "int8" in cal["skipped"]
    else:
        assert cal["gflops"]["int8"] > 0 and not cal["skipped"]
    for key in ("fp32", "bf16"):
        assert cal["gflops_median"][key] <= cal["gflops"][key]  # the peak is the best call
    assert "64x64" in cal["method"] and "best" in cal["method"]
