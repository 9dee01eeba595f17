"""The flash-attention and flash-decoding plugins as installed packages: discovery, resolution
(a CPU stack needs the interpreter opt-in), and SmolLM2 end to end with both kernels in the
Triton interpreter against the reference `torch` kernels.

These need `pip install -e plugins/attention/flash-attention -e plugins/attention/flash-decoding`
(`make install` does it). The kernels themselves are checked beside each plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from lmstack import SamplingParams, cli
from lmstack.engine.llm import LLM
from lmstack.errors import ResolutionError
from lmstack.stack.config import load_stack
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve

PLUGINS = "flash-attention,flash-decoding"
COMBINED = {"prefill": "flash-attention", "decode": "flash-decoding"}
INTERPRETED = {
    "prefill": {"name": "flash-attention", "interpret": True},
    "decode": {"name": "flash-decoding", "interpret": True},
}


@pytest.fixture
def only_flash(monkeypatch):
    """Only these two entry points load."""
    monkeypatch.delenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("LMSTACK_PLUGINS", PLUGINS)


@pytest.fixture
def flash_plugins(only_flash, monkeypatch):
    """... and resolution sees no TRITON_INTERPRET (the test session sets it: conftest.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _resolve(stack: dict, **kw):
    return resolve(load_stack(stack), build_registry(make_plugin_manager()), **kw)


def test_discovered_with_their_capabilities(flash_plugins):
    registry = build_registry(make_plugin_manager())
    fa = registry.get("attention", "flash-attention")
    fd = registry.get("attention", "flash-decoding")
    assert (fa.distribution, fd.distribution) == ("lmstack-flash-attention", "lmstack-flash-decoding")
    for comp in (fa, fd):
        caps = comp.capabilities
        assert caps["devices"] == ("cuda",)
        assert set(caps["dtypes"]) == {"float32", "float16", "bfloat16"}
        assert {64, 128} <= set(caps["head_dims"]) and 16 in caps["block_sizes"]
        assert "interpret" in comp.option_names
    assert fa.capabilities["phases"] == ("prefill", "decode") and fa.capabilities["chunked_context"]
    assert fd.capabilities["phases"] == ("decode",) and "num_splits" in fd.option_names


def test_a_cuda_stack_combines_them(flash_plugins):
    r = _resolve({"device": "cuda", "attention": COMBINED}, check_device=False)
    assert (r.attention_prefill.name, r.attention_decode.name) == ("flash-attention", "flash-decoding")


@pytest.mark.parametrize(
    ("attention", "role", "key", "name"),
    [
        ({"prefill": "flash-attention"}, "prefill kernel", "attention.prefill", "flash-attention"),
        ({"decode": "flash-decoding"}, "decode kernel", "attention.decode", "flash-decoding"),
    ],
)
def test_a_cpu_stack_without_the_opt_in_is_refused(flash_plugins, attention, role, key, name):
    with pytest.raises(ResolutionError) as info:
        _resolve({"device": "cpu", "attention": attention})
    msg = str(info.value)
    assert "\n" not in msg
    dist = f"lmstack-{name}"
    assert msg.startswith(f"{role} '{name}' ({dist} ")
    assert "needs a CUDA device, but the stack sets device: cpu" in msg
    assert f"{key}: torch" in msg  # what to use instead
    assert f"{key}: {{name: {name}, interpret: true}}" in msg and "TRITON_INTERPRET=1" in msg


def test_lmstack_check_reports_it_in_one_line(flash_plugins, tmp_path, capsys):
    path = tmp_path / "stack.yaml"
    path.write_text("device: cpu\nattention: {prefill: flash-attention, decode: flash-decoding}\n")
    assert cli.main(["check", str(path), "--skip-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefill kernel 'flash-attention'" in err[0] and "needs a CUDA device" in err[0]


def test_the_interpreter_opt_in_is_accepted_on_cpu(flash_plugins):
    r = _resolve({"device": "cpu", "attention": INTERPRETED})
    assert r.attention_prefill.options.interpret and r.attention_decode.options.interpret
    described = r.describe()["components"]["attention_prefill"]["capabilities"]
    assert list(described["devices"]) == ["cuda", "cpu"]


def test_triton_interpret_in_the_environment_is_an_opt_in_too(flash_plugins, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _resolve({"device": "cpu", "attention": COMBINED}).attention_decode.name == "flash-decoding"


def test_the_example_stack_fits_smollm2(flash_plugins, smollm2_path):
    from pathlib import Path

    from lmstack.model.source import open_model_source
    from lmstack.stack.resolve import check_model

    path = Path(__file__).resolve().parent.parent / "examples" / "stacks" / "flash.yaml"
    r = resolve(load_stack(path), build_registry(make_plugin_manager()), check_device=False)
    assert (r.device.type, r.attention_prefill.name, r.attention_decode.name) == (
        "cuda",
        "flash-attention",
        "flash-decoding",
    )
    check_model(r, open_model_source(r.model).config)  # head dim 64, block size 16


def test_flash_decoding_cannot_prefill(flash_plugins):
    with pytest.raises(ResolutionError, match="handles only decode, but the stack uses it for prefill"):
        _resolve({"device": "cuda", "attention": "flash-decoding"}, check_device=False)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_the_option_switches_a_fresh_process_to_the_interpreter():
    """`interpret: true` alone (no TRITON_INTERPRET) builds working kernels on the CPU; and
    once Triton was imported in compiled mode, building says how to start the process instead."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LMSTACK_PLUGINS=PLUGINS)
    env.pop("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", None)
    proc = _python(
        """
        import torch
        from lmstack.batch import AttentionMetadata
        from lmstack.components.torch_attention import TorchAttention
        from lmstack.stack.config import load_stack
        from lmstack.stack.plugins import build_registry, make_plugin_manager
        from lmstack.stack.resolve import resolve

        attention = {"prefill": {"name": "flash-attention", "interpret": True},
                     "decode": {"name": "flash-decoding", "interpret": True}}
        r = resolve(load_stack({"device": "cpu", "attention": attention}),
                    build_registry(make_plugin_manager()))
        prefill = r.attention_prefill.component.factory(r.attention_prefill.options, None)
        decode = r.attention_decode.component.factory(r.attention_decode.options, None)
        kc, vc = torch.randn(8, 4, 1, 64), torch.randn(8, 4, 1, 64)
        meta = AttentionMetadata.build([5], [9], [[3, 1, 6, 0]], 4)
        q = torch.randn(5, 3, 64)
        ref = TorchAttention().prefill(q, None, None, kc, vc, meta, scale=0.125, sliding_window=None)
        out = prefill.prefill(q, None, None, kc, vc, meta, scale=0.125, sliding_window=None)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        meta = AttentionMetadata.build([1], [13], [[3, 1, 6, 0]], 4)
        ref = TorchAttention().decode(q[:1], kc, vc, meta, scale=0.125, sliding_window=None)
        out = decode.decode(q[:1], kc, vc, meta, scale=0.125, sliding_window=None)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        print("ok")
        """,
        env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"

    proc = _python(
        """
        import triton
        from lmstack_flash_attention.backend import FlashAttention
        try:
            FlashAttention(interpret=True)
        except RuntimeError as exc:
            print(exc)
        """,
        env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Triton was already imported in compiled mode" in proc.stdout
    assert "start the process with TRITON_INTERPRET=1" in proc.stdout


# ---------------------------------------------------------------------------------------------
# End to end: SmolLM2 in fp32, both kernels in the interpreter, against the torch kernels
# ---------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    # 25 tokens: with a 16-token budget its prefill runs in two chunks, the second over cached
    # context while the first prompt decodes in the same step (both kernels in one forward
    # pass); its own decodes then read more than one 16-token KV split. Every interpreted
    # kernel program costs time (~20 s here), so the workload is no larger than that.
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who never",
]
MAX_TOKENS = 3


def _stack(attention) -> dict:
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
        "device": "cpu",
        "scheduler": {"name": "continuous", "max_num_seqs": 4, "max_num_batched_tokens": 16},
        "allocator": {"name": "paged", "block_size": 16, "num_blocks": 24},
        "attention": attention,
    }


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_the_torch_kernels(only_flash, smollm2_path, monkeypatch):
    from lmstack_flash_attention import kernel as prefill_kernel
    from lmstack_flash_decoding import kernel as decode_kernel

    # Interpreter key steps of 16 (as short as the contexts here): prefill chunks then also
    # run unmasked steps over their cached context, and decode splits (and merges) KV ranges.
    monkeypatch.setattr(prefill_kernel, "INTERPRET_BLOCK_N", 16)
    monkeypatch.setattr(decode_kernel, "INTERPRET_BLOCK_N", 16)
    splits = []
    choose = decode_kernel.choose_splits

    def recording_choose(*args, **kwargs):
        plan = choose(*args, **kwargs)
        splits.append(plan.num_splits)
        return plan

    monkeypatch.setattr(decode_kernel, "choose_splits", recording_choose)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = LLM(_stack("torch"))
    flash = LLM(_stack(INTERPRETED))
    assert len(reference.tokenizer.encode(PROMPTS[-1])) > 16  # more than one prefill chunk
    expected = [o.token_ids for o in reference.generate(PROMPTS, params)]
    got = [o.token_ids for o in flash.generate(PROMPTS, params)]
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got)
    assert max(splits) > 1
