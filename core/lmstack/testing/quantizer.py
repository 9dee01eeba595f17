"""Quantizer conformance: linear layers built through `linear_factory` compute what the plain
dense layer computes (within the error the format costs), and the tiny model served with the
quantizer scores text like the unquantized one.

The layer check feeds the layer what an unquantized Hugging Face checkpoint holds — dense fp32
`weight` (and `bias`) tensors, one per part of a fused projection — through the parameters'
weight loaders, as the model loader does. A quantizer that quantizes on load is tested as is;
one that only reads pre-quantized tensors (e.g. GPTQ's `qweight`) needs checkpoints this kit
does not make.

A quantizer with a `weight_format()` is also checked against it: its layers compute what the
format's `fake_quantize` says (on fresh random shapes), and tensors its `encode` writes, loaded
by the quantizer that reads that checkpoint format (`reader`), compute the same. With
`tensor_parallel = True` the kit checks that layers built for tp_size=2 hold the rows (column)
or input columns (row) of the whole layer.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lmstack.interfaces import LinearSpec, Quantizer
from lmstack.testing.attention import _DTYPES, rel_error
from lmstack.testing.kit import (
    KIT_PROMPTS,
    ComponentKit,
    generate,
    greedy,
    kit_llm,
    reference_llm,
    tiny_stack,
)

# Shapes a model asks for: odd sizes, fused projections of unequal parts, with and without bias.
LINEAR_SHAPES: tuple[tuple[int, tuple[int, ...], bool], ...] = (
    (37, (53,), True),
    (64, (32, 16, 16), False),  # qkv_proj with GQA
    (48, (40, 40), True),  # gate_up_proj
    (128, (64,), False),
    (1, (3,), True),
)


class QuantizerConformance(ComponentKit):
    """Set `component` (a registered quantizer name or Component) and optionally `options`.

    The dtypes tested are the declared `dtypes` (all three float dtypes when none are declared),
    narrowed by the class attribute `dtypes` if set. A layer passes when its relative error
    against the fp32 reference is at most 2x that of the plain dense layer in the same dtype,
    plus a quarter of the dtype's epsilon, plus `quantization_error` — the relative error the
    format itself costs (0 for a lossless quantizer; e.g. 0.01 for int8 with per-channel
    scales). The model-level check compares the probability the model gives each prompt token
    (teacher-forced, so both engines see the same inputs) with the unquantized engine's, within
    `probability_tolerance` (when None: 1e-4, plus 5 x `quantization_error`, plus 50 epsilons
    of the KV-cache dtype and, below fp32, of the model dtype)."""

    kind = "quantizer"
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    quantization_error: ClassVar[float] = 0.0
    probability_tolerance: ClassVar[float | None] = None
    # The quantizer (name or Component) that serves checkpoints `weight_format()` writes, with
    # its options; None: this one. Layers of both must compute the same from the same weights.
    reader: ClassVar[Any] = None
    reader_options: ClassVar[dict[str, Any]] = {}
    # Check tensor-parallel shards (LinearSpec.tp_rank / tp_size) against the whole layer.
    tensor_parallel: ClassVar[bool] = False
    # The written format's input granularity (NVFP4: groups of 16): the written-tensor check
    # rounds its layers' input sizes up to a multiple of it.
    input_multiple: ClassVar[int] = 1
    # False for kernels that also quantize activations (W8A8): the layer then does not compute
    # x @ fake_quantize(W)^T, and that check is skipped (the model-level check still runs).
    weight_only: ClassVar[bool] = True
    # Serving dtype -> the precision its activations may be rounded to inside a kernel (int4 on
    # the CPU runs fp32 activations through the op's bf16 path): the layer checks then allow
    # that dtype's rounding. Empty: activations are computed in the serving dtype.
    activation_dtypes: ClassVar[dict[torch.dtype, torch.dtype]] = {}

    def quantizer(self, dtype: torch.dtype = torch.float32) -> Quantizer:
        return self.build(dtype=dtype)

    def kit_dtypes(self) -> tuple[torch.dtype, ...]:
        declared = self.capabilities().get("dtypes")
        declared_dtypes = None if declared is None else tuple(_DTYPES[n] for n in declared if n in _DTYPES)
        return self.narrowed("dtypes", declared_dtypes, _DTYPES.values())

    def test_kv_cache_dtype_as_declared(self) -> None:
        """The instance's `kv_cache_dtype` is the declared `kv_cache_dtype` capability (the
        resolver agrees the KV-cache dtype from the declaration, the runner from the instance)."""
        caps = self.capabilities()
        if "kv_cache_dtype" not in caps:
            return
        declared, actual = caps["kv_cache_dtype"], self.quantizer().kv_cache_dtype
        actual_name = None if actual is None else str(actual).removeprefix("torch.")
        assert actual_name == declared, (
            f"the quantizer declares kv_cache_dtype {declared!r}, its instance has {actual_name!r}"
        )

    # --- one linear layer ------------------------------------------------------------------------

    def _load(self, layer: nn.Module, parts: list[torch.Tensor], name: str, fused: bool) -> None:
        params = dict(layer.named_parameters())
        assert name in params, (
            f"the layer has no parameter {name!r} (has {sorted(params)}); the kit loads the dense "
            "`weight` / `bias` tensors of an unquantized checkpoint"
        )
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        assert loader is not None, f"parameter {name!r} has no weight_loader (lmstack.model.weight_loader)"
        for i, part in enumerate(parts):
            loader(param, part.clone(), i if fused else None)

    def test_linear_layers_match_dense_reference(self) -> None:
        rng = random.Random()
        for dtype in self.kit_dtypes():
            make = self.quantizer(dtype).linear_factory()
            for n, (in_features, sizes, bias) in enumerate(LINEAR_SHAPES):
                spec = LinearSpec(
                    in_features,
                    sum(sizes),
                    bias,
                    f"layers.{n}.kit_proj",
                    sizes,
                    rng.choice(("column", "row", "replicated")),
                    dtype,
                )
                layer = make(spec)
                assert isinstance(layer, nn.Module), f"linear_factory returned {type(layer).__name__}"
                weights = [torch.randn(s, in_features) * in_features**-0.5 for s in sizes]
                biases = [torch.randn(s) for s in sizes] if bias else []
                fused = len(sizes) > 1
                self._load(layer, weights, "weight", fused)
                if bias:
                    self._load(layer, biases, "bias", fused)
                x = torch.randn(rng.randint(1, 9), in_features)
                w, b = torch.cat(weights), torch.cat(biases) if bias else None
                with torch.no_grad():
                    x_in = x.to(dtype)
                    out = layer(x_in)
                    again = layer(x_in)
                    ref = nn.functional.linear(x, w, b)
                    plain = self._plain(x, w, b, dtype)
                where = f"{dtype} linear {spec.name} ({in_features} -> {sizes}, bias={bias})"
                # The model rotates and adds residuals into a projection's output in place.
                shared = [t for t in (x_in, again, *layer.parameters(), *layer.buffers()) if _aliases(out, t)]
                assert not shared, (
                    f"{where}: the output shares memory with the input, the layer's tensors or the "
                    "next call's output; a linear must return a new tensor the caller owns"
                )
                assert tuple(out.shape) == tuple(ref.shape), f"{where}: output shape {tuple(out.shape)}"
                assert out.dtype == dtype, f"{where}: output dtype {out.dtype}"
                err = rel_error(out, ref)
                compute = self.activation_dtypes.get(dtype, dtype)
                bound = 2 * rel_error(plain, ref) + torch.finfo(compute).eps / 4 + self.quantization_error
                if dtype == torch.float32:
                    bound += 1e-6  # summation order
                assert err <= bound, f"{where}: relative error {err:.2e} > {bound:.2e}"

    def _plain(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The dense layer in `dtype`, its activations rounded as `activation_dtypes` says."""
        compute = self.activation_dtypes.get(dtype, dtype)
        out = nn.functional.linear(x.to(compute), w.to(compute), None if b is None else b.to(compute))
        return out.to(dtype)

    # --- against the quantizer's own weight format --------------------------------------------------

    def _random_shapes(self, rng: random.Random) -> list[tuple[int, tuple[int, ...], bool]]:
        """Three fresh shapes per run (odd sizes included) besides the fixed ones."""
        shapes = list(LINEAR_SHAPES)
        for _ in range(3):
            parts = tuple(rng.randint(1, 80) for _ in range(rng.choice((1, 2, 3))))
            shapes.append((rng.randint(1, 300), parts, rng.random() < 0.5))
        return shapes

    def _fill(self, layer: nn.Module, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> None:
        fused = len(weights) > 1
        self._load(layer, weights, "weight", fused)
        if biases:
            self._load(layer, biases, "bias", fused)

    def test_linear_matches_weight_format(self) -> None:
        """Each layer computes x @ fake_quantize(W)^T (+ b), up to the rounding of the serving
        dtype, on fixed and fresh random shapes."""
        fmt = self.quantizer().weight_format()
        if fmt is None:
            pytest.skip("the quantizer writes no checkpoint format")
        if not self.weight_only:
            pytest.skip("weight_only = False: activations are quantized too")
        rng = random.Random()
        for dtype in self.kit_dtypes():
            make = self.quantizer(dtype).linear_factory()
            for n, (in_features, sizes, bias) in enumerate(self._random_shapes(rng)):
                spec = LinearSpec(
                    in_features, sum(sizes), bias, f"layers.{n}.kit_proj", sizes, "column", dtype
                )
                weights = [torch.randn(s, in_features) * in_features**-0.5 for s in sizes]
                biases = [torch.randn(s) for s in sizes] if bias else []
                layer = make(spec)
                self._fill(layer, weights, biases)
                x = torch.randn(rng.randint(1, 40), in_features)
                w = torch.cat([fmt.fake_quantize(p) for p in weights])
                b = torch.cat(biases) if bias else None
                with torch.no_grad():
                    out = layer(x.to(dtype))
                    ref = nn.functional.linear(x, w, b)
                    plain = self._plain(x, w, b, dtype)
                err = rel_error(out, ref)
                compute = self.activation_dtypes.get(dtype, dtype)
                # Plus the dequantized weight's own rounding to the serving dtype (up to half an
                # ulp a weight), which the fp32 reference never does: at one input feature
                # nothing averages it out (fp16, 1 -> 3: 4.6e-4 against 4.0e-4 without it).
                bound = (
                    2 * rel_error(plain, ref)
                    + torch.finfo(compute).eps / 4
                    + torch.finfo(dtype).eps / 2
                    + 1e-6
                )
                where = f"{dtype} linear {in_features} -> {sizes} (bias={bias})"
                assert err <= bound, f"{where}: relative error {err:.2e} vs fake_quantize > {bound:.2e}"

    def test_written_tensors_load_back(self) -> None:
        """`encode`'s tensors, fed to the reader's layer as a checkpoint of `quantization_config`,
        compute exactly what this quantizer's layer computes from the dense weights."""
        from lmstack.testing.components import TINY_MODEL_CONFIG, build_component

        fmt = self.quantizer().weight_format()
        if fmt is None:
            pytest.skip("the quantizer writes no checkpoint format")
        config = dataclasses.replace(TINY_MODEL_CONFIG, quantization=fmt.quantization_config([]))
        reader = self.reader if self.reader is not None else self.registered()
        read = build_component(reader, "quantizer", self.reader_options, model_config=config).linear_factory()
        make = self.quantizer().linear_factory()
        rng = random.Random()
        for n, (in_features, sizes, bias) in enumerate(self._random_shapes(rng)):
            in_features = -(-in_features // self.input_multiple) * self.input_multiple
            spec = LinearSpec(in_features, sum(sizes), bias, f"layers.{n}.kit_proj", sizes, "column")
            weights = [torch.randn(s, in_features) * in_features**-0.5 for s in sizes]
            biases = [torch.randn(s) for s in sizes] if bias else []
            direct, loaded = make(spec), read(spec)
            self._fill(direct, weights, biases)
            params = dict(loaded.named_parameters())
            for i, w in enumerate(weights):
                for suffix, tensor in fmt.encode(f"kit.{n}", w).items():
                    assert suffix in params, (
                        f"the reader's layer has no parameter {suffix!r} (has {sorted(params)})"
                    )
                    params[suffix].weight_loader(params[suffix], tensor, i if len(sizes) > 1 else None)
            if bias:
                self._load(loaded, biases, "bias", len(sizes) > 1)
            x = torch.randn(rng.randint(1, 9), in_features)
            with torch.no_grad():
                a, b = direct(x), loaded(x)
            err = rel_error(b, a)
            assert err <= 1e-5, f"linear {in_features} -> {sizes}: written and reloaded differs by {err:.2e}"

    def test_tensor_parallel_shards_match_whole(self) -> None:
        """tp_size=2: a column layer's ranks give the whole layer's outputs of their rows of
        each part; a row layer's ranks, given their input columns, sum to the whole's output."""
        if not self.tensor_parallel:
            pytest.skip("tensor_parallel = False")
        quantizer = self.quantizer()
        make = quantizer.linear_factory()
        rng = random.Random()
        for parallel in ("column", "row"):
            for n in range(3):
                probe = LinearSpec(64, 64, False, f"layers.{n}.kit_proj", (64,), parallel)
                align = quantizer.shard_alignment(probe)
                sizes = tuple(2 * rng.randint(1, 40) for _ in range(rng.choice((1, 3))))
                in_features = rng.randint(1, 200)
                if parallel == "column":
                    sizes = tuple(s * align for s in sizes)
                else:
                    in_features = 2 * align * rng.randint(1, 3)
                bias = rng.random() < 0.5
                weights = [torch.randn(s, in_features) * in_features**-0.5 for s in sizes]
                biases = [torch.randn(s) for s in sizes] if bias else []
                x = torch.randn(rng.randint(1, 9), in_features)
                args = (in_features, sum(sizes), bias, f"layers.{n}.kit_proj", sizes, parallel)
                whole = make(LinearSpec(*args))
                self._fill(whole, weights, biases)
                with torch.no_grad():
                    want = whole(x)
                    outs = []
                    for rank in range(2):
                        layer = make(LinearSpec(*args, tp_rank=rank, tp_size=2))
                        self._fill(layer, weights, biases)
                        xs = x.chunk(2, dim=1)[rank] if parallel == "row" else x
                        outs.append(layer(xs))
                where = f"tp=2 {parallel} linear {in_features} -> {sizes} (bias={bias})"
                if parallel == "row":
                    got = outs[0] + outs[1]
                else:
                    parts = [o.split([s // 2 for s in sizes], dim=1) for o in outs]
                    got = torch.cat(
                        [torch.cat([parts[0][i], parts[1][i]], dim=1) for i in range(len(sizes))], dim=1
                    )
                assert tuple(got.shape) == tuple(want.shape), (
                    f"{where}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
                )
                err = rel_error(got, want)
                # A kernel that rounds fp32 activations (`activation_dtypes`) also rounds each
                # shard's partial sum: allow that dtype's epsilon.
                compute = self.activation_dtypes.get(torch.float32, torch.float32)
                bound = 1e-5 + (torch.finfo(compute).eps if compute != torch.float32 else 0.0)
                assert err <= bound, f"{where}: shards differ from the whole layer by {err:.2e}"

    # --- the tiny model served with the quantizer -----------------------------------------------

    def test_model_scores_like_unquantized(self, tiny_model_path) -> None:
        dtypes = self.kit_dtypes()
        dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
        dname = str(dtype).removeprefix("torch.")
        llm = kit_llm(self, tiny_model_path, dtype=dname)
        assert isinstance(llm.engine.quantizer, Quantizer)
        ref = reference_llm(tiny_stack(tiny_model_path, dtype=dname))
        tol = self.probability_tolerance
        if tol is None:
            kv_dtype = llm.engine.stack.kv_cache_dtype
            tol = 1e-4 + 5 * self.quantization_error + 50 * torch.finfo(kv_dtype).eps
            if dtype != torch.float32:
                tol += 50 * torch.finfo(dtype).eps
        from lmstack.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        ours, theirs = generate(llm, list(KIT_PROMPTS), sp), generate(ref, list(KIT_PROMPTS), sp)
        for prompt, a, b in zip(KIT_PROMPTS, ours, theirs, strict=True):
            ids = b.prompt_token_ids
            for pos in range(1, len(ids)):
                got, want = (
                    math.exp(a.prompt_logprobs[pos][ids[pos]]),
                    math.exp(b.prompt_logprobs[pos][ids[pos]]),
                )
                assert abs(got - want) <= tol, (
                    f"prompt {prompt!r} token {pos}: probability {got:.4f} with the quantizer, "
                    f"{want:.4f} without (tolerance {tol:.1e})"
                )
        llm.engine.shutdown()

    def test_greedy_text_matches_unquantized(self, tiny_model_path) -> None:
        """A lossless quantizer (`quantization_error` 0) gives the unquantized engine's greedy
        tokens exactly."""
        if self.quantization_error > 0:
            pytest.skip("a lossy format may flip near ties; the logprob check bounds its error")
        llm = kit_llm(self, tiny_model_path)
        ref = reference_llm(tiny_stack(tiny_model_path))
        ours, theirs = greedy(llm, list(KIT_PROMPTS), 8), greedy(ref, list(KIT_PROMPTS), 8)
        for prompt, a, b in zip(KIT_PROMPTS, ours, theirs, strict=True):
            assert a.token_ids == b.token_ids, f"prompt {prompt!r}: {a.text!r} != {b.text!r}"
        llm.engine.shutdown()


def write_quantized_folder(src, dst, weight_format, ignore: tuple[str, ...] = ("lm_head",)):
    """A copy of the Hugging Face folder `src` (one model.safetensors) at `dst` with every
    decoder linear's `weight` replaced by `weight_format.encode`'s tensors and config.json
    carrying its `quantization_config`: what `lmstack quantize` writes, without calibration, for
    load round-trip tests of a quantizer's checkpoint reader."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            prefix = name.removesuffix("weight")
            for suffix, value in weight_format.encode(prefix.rstrip("."), tensor.float()).items():
                tensors[prefix + suffix] = value.contiguous()
        else:
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = weight_format.quantization_config(list(ignore))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
