"""A degree the model does not split over is an error before any worker starts or weight loads,
naming the model's sizes and the degrees that would work; a quantizer's shard alignment counts."""

from __future__ import annotations

import multiprocessing

import pytest

from lmstack.engine.llm import LLM
from lmstack.errors import ConfigError, ResolutionError
from lmstack.exec.parallel_layout import check_tensor_parallel
from lmstack.interfaces import LinearSpec, Quantizer
from lmstack.model.config import ModelConfig
from lmstack.testing.kit import tiny_stack

# SmolLM2-135M's sizes (config.json of HuggingFaceTB/SmolLM2-135M-Instruct).
SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    name="smollm2-135m-instruct",
)


def test_smollm2_tp2_lists_the_degrees_that_divide():
    with pytest.raises(ResolutionError) as info:
        check_tensor_parallel(2, SMOLLM2)
    message = str(info.value)
    assert message == (
        "parallel.tp: tp=2 does not divide model 'smollm2-135m-instruct' (9 query heads); tp can be 1 or 3"
    )
    assert "\n" not in message
    check_tensor_parallel(3, SMOLLM2)  # 3 query heads and 1 KV head per rank


class _Grouped(Quantizer):
    """A quantizer whose tensors split in groups of 128 along either dimension."""

    def linear_factory(self):  # pragma: no cover - never built here
        raise NotImplementedError

    def shard_alignment(self, spec: LinearSpec) -> int:
        return 128


def test_quantizer_shard_alignment_narrows_the_degrees():
    # Dense SmolLM2 splits 3 ways; in groups of 128 it cannot: 576 query rows / 3 = 192.
    check_tensor_parallel(3, SMOLLM2)
    with pytest.raises(ResolutionError) as info:
        check_tensor_parallel(3, SMOLLM2, _Grouped())
    assert str(info.value).endswith(
        "(qkv_proj would keep 192 of 576 rows per rank, not a multiple of the quantizer's shard "
        "alignment 128); tp can be 1"
    )


def test_bad_degree_fails_before_workers_start(tiny_model_path):
    before = {p.pid for p in multiprocessing.active_children()}
    # resolve.check_model: right after the config is read, before any component is built.
    with pytest.raises(ResolutionError) as info:
        LLM(tiny_stack(tiny_model_path, parallel={"name": "tp", "tp": 3}))
    assert str(info.value).startswith("parallel.tp: tp=3 does not divide model")
    assert str(info.value).endswith("(4 query heads); tp can be 1, 2 or 4")
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_quantizer_alignment_fails_the_layout_factory():
    """At build time the layout's factory sees the quantizer (check_model cannot)."""
    from lmstack.testing import build_component

    ctx_parts = {"model_config": SMOLLM2, "components": {"quantizer": _Grouped()}}
    with pytest.raises(AssertionError, match="shard alignment 128"):
        build_component("tp", "parallel", {"tp": 3}, **ctx_parts)


def test_other_axes_name_the_plugin_that_composes_them(tiny_model_path):
    with pytest.raises(ConfigError, match=r"parallel.pp: .*`pp` plugin"):
        LLM(tiny_stack(tiny_model_path, parallel={"name": "tp", "tp": 2, "pp": 2}))


def test_a_cache_that_moves_blocks_off_the_device_is_refused(tiny_model_path, tmp_path):
    pytest.importorskip("lmstack_tiered_cache")
    with pytest.raises(ResolutionError, match=r"parallel layout 'tp' .*cache 'tiered' moves blocks to"):
        LLM(
            tiny_stack(
                tiny_model_path,
                parallel={"name": "tp", "tp": 2},
                cache={"name": "tiered", "disk_path": str(tmp_path)},
            )
        )
