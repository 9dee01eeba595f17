"""`lmstack quantize`: the stack's model, dequantized to fp32, written as a quantized Hugging Face
folder through a quantizer plugin's `WeightFormat`.

Steps: build the named quantizer through the registry and ask its `weight_format()`; load every
checkpoint tensor dense (GGUF blocks decoded) into a `DenseModel`; when the format is
`Calibrated` (AWQ), cut the calibration text into samples and let it search (it rewrites
weights in place, and may add biases: bias correction); then encode each decoder linear and
write config.json (with the format's `quantization_config`, and `attention_bias` / `mlp_bias`
where biases were added), model.safetensors (Hugging Face tensor names, q/k/v and gate/up
unfused), the tokenizer with its chat template, generation_config.json and
lmstack_quantize.json (method, calibration source, the search's record).

The calibration runs the core's Llama model (`lmstack_calibrate.model`) over equal-length
samples with causal attention: only the Llama architecture (Llama, Mistral without sliding
window, SmolLM2) is supported.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmstack.commands.progress import Progress
from lmstack.errors import BuildError, ConfigError
from lmstack.model.config import ModelConfig
from lmstack.quant.formats import Calibrated, WeightFormat
from lmstack_calibrate.calibration_text import (
    SELF,
    calibration_samples,
    generate_calibration_text,
    read_text,
    split_validation,
)
from lmstack_calibrate.folder import encode_model, hf_config, prepare_out_dir, write_json, write_tokenizer
from lmstack_calibrate.model import DenseModel


def build_weight_format(
    stack: Any, method: str, group_size: int | None, model_config: ModelConfig
) -> tuple[WeightFormat, Any]:
    """The `WeightFormat` of quantizer `method`, built through the registry with the stack's
    device and dtype. Its options: those of the stack's `quant` section when that names the
    same quantizer (e.g. `quant: {weights: rtn-int4, symmetric: true}`), and `group_size`
    when given."""
    import msgspec

    from lmstack.interfaces import BuildContext
    from lmstack.stack.plugins import build_registry, make_plugin_manager
    from lmstack.stack.resolve import resolve

    quant: dict[str, Any] = {"weights": method, "kv_cache": "none"}
    if stack.quant.get("weights") == method:
        quant |= {k: v for k, v in stack.quant.items() if k not in ("weights", "kv_cache")}
    if group_size is not None:
        quant["group_size"] = group_size
    resolved = resolve(msgspec.structs.replace(stack, quant=quant), build_registry(make_plugin_manager()))
    sel = resolved.selected["quantizer"]
    ctx = BuildContext(model_config, resolved.device, resolved.dtype, resolved.kv_cache_dtype)
    try:
        quantizer = sel.component.factory(sel.options, ctx)
    except BuildError:
        raise
    except Exception as exc:  # named as the engine names a factory's failure
        c = sel.component
        raise BuildError("quantizer", c.name, c.distribution, c.version, exc) from exc
    fmt = quantizer.weight_format()
    if fmt is None:
        raise ConfigError(f"quantizer {method!r} reads checkpoints but cannot write them (no weight format)")
    return fmt, sel


def quantize(
    stack: Any,
    method: str,
    out: str | Path,
    *,
    group_size: int | None = None,
    calibration: str | None = None,
    num_samples: int = 32,
    seq_len: int = 512,
) -> Path:
    """Write the quantized folder `out` for the stack's model; returns its path."""
    from safetensors.torch import save_file

    from lmstack.kernels.hardware import cpu_description
    from lmstack.model.source import open_model_source

    started = time.perf_counter()
    source = open_model_source(stack.model)
    fmt, sel = build_weight_format(stack, method, group_size, source.config)
    out_dir = prepare_out_dir(out)
    try:
        model = DenseModel.load(source)
        record: dict[str, Any] = {
            "method": method,
            "quantizer_options": sel.describe().get("options", {}),
            "source_model": stack.model,
            "source_format": source.format,
            "compute": "float32",
            **cpu_description(),  # the search's fp32 sums, and so its choices, follow the kernels
        }
        if isinstance(fmt, Calibrated):
            # A format may validate on samples its search does not see (`validation_samples`,
            # the scale tuning's): they are cut after --num-samples and passed on their own.
            extra = int(getattr(fmt, "validation_samples", 0))
            text, origin = _calibration_text(stack, calibration, (num_samples + extra) * seq_len)
            samples = calibration_samples(source.tokenizer.encode(text), num_samples + extra, seq_len)
            kwargs: dict[str, Any] = {}
            if extra:
                samples, kwargs["validation"] = split_validation(samples, num_samples, extra)
            record["calibration"] = {
                "source": origin,
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "num_samples": int(samples.shape[0]),
                "seq_len": seq_len,
            }
            if extra:
                record["calibration"]["validation_samples"] = int(kwargs["validation"].shape[0])
            if origin == SELF:
                (out_dir / "calibration.txt").write_text(text, encoding="utf-8")
            fmt.calibrate(model, samples, progress=Progress, **kwargs)
            record["search"] = fmt.calibration_record()
        biases = model.complete_biases()  # bias correction may have added some
        tensors = encode_model(model, fmt)
        ignore = ["lm_head"]
        config = (
            hf_config(source)
            | {k: v for k, v in biases.items() if v}
            | {
                "quantization_config": fmt.quantization_config(ignore),
                "torch_dtype": "float32",
            }
        )
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        write_json(out_dir / "config.json", config)
        write_tokenizer(source, out_dir)
        record["seconds"] = round(time.perf_counter() - started, 1)
        write_json(out_dir / "lmstack_quantize.json", record)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)  # no half-written folder that looks servable
        raise
    return out_dir


def _calibration_text(stack: Any, calibration: str | None, num_tokens: int) -> tuple[str, str]:
    """(text, where it came from) for --calibration."""
    if calibration in (None, SELF):
        return generate_calibration_text(stack, num_tokens), SELF
    return read_text(calibration), str(calibration)


def run_cli(args: Any) -> int:
    stack = load_stack_with_model(args.stack, args.model, args.overrides)
    out = quantize(
        stack,
        args.method,
        args.out,
        group_size=args.group_size,
        calibration=args.calibration,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({math.ceil(size / 2**20)} MiB): serve it with `model: {out}`")
    return 0


def load_stack_with_model(path: str, model: str | None, overrides: Sequence[str] = ()) -> Any:
    """The stack at `path` (a file, or a model alone) with its `--set` overrides, its model
    replaced by `model` when given."""
    from lmstack.stack.config import load_stack
    from lmstack.stack.overrides import parse_overrides

    return load_stack(path, parse_overrides(overrides) | ({"model": model} if model else {}))
