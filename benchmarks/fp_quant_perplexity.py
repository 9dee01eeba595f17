"""Perplexity cost of the fp8 and nvfp4 weight formats on SmolLM2-135M-Instruct, measured in
transformers (fp32) with every decoder linear fake-quantized by the plugins' own functions
(lm_head dense). The numbers in plugins/quant/fp8/README.md and plugins/quant/nvfp4/README.md.

    python benchmarks/fp_quant_perplexity.py [--text /usr/share/common-licenses/GPL-3] [VARIANT ...]

Variants: fp8-w8a8 (per-channel weights + per-token activations), fp8-w8a16, nvfp4-rtn,
nvfp4-46 (the default: absmax/6 or absmax/4 per group), nvfp4-up (six candidates 1 ... 1.5),
nvfp4-clip (candidates 0.8 ... 1.1). Text: the first 8,192 tokens, 512-token windows. Prints
one line per variant: perplexity and the change against the unquantized model.
"""

from __future__ import annotations

import argparse
import functools

import torch

from lmstack_fp8 import fp8
from lmstack_nvfp4 import nvfp4

VARIANTS = {
    "fp8-w8a8": ("fp8", True),
    "fp8-w8a16": ("fp8", False),
    "nvfp4-rtn": ((1.0,), False),
    "nvfp4-46": ((1.0, 1.5), False),
    "nvfp4-up": ((1.0, 1.05, 1.1, 1.2, 1.33, 1.5), False),
    "nvfp4-clip": ((1.0, 0.95, 0.9, 0.85, 0.8, 1.05, 1.1), False),
}


def perplexity(model, ids: torch.Tensor, window: int = 512) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.shape[1] - 1, window):
            x = ids[:, s : s + window + 1]
            if x.shape[1] < 2:
                break
            logits = model(x[:, :-1]).logits
            nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            n += x.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / n)))


def fp8_weight(w: torch.Tensor) -> torch.Tensor:
    q, scale = fp8.quantize_weight(w)
    return q.float() * scale


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    from lmstack.model.source import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with open(args.text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, :8192]
    base = perplexity(model, ids)
    print(f"tokens {ids.shape[1]} unquantized {base:.4f}", flush=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    for name in args.variants:
        kind, activations = VARIANTS[name]
        quantize = fp8_weight if kind == "fp8" else functools.partial(nvfp4.fake_quantize, search=kind)
        model.load_state_dict(state)
        hooks = []
        with torch.no_grad():
            for layer in linears:
                layer.weight.copy_(quantize(layer.weight))
                if activations:
                    hooks.append(
                        layer.register_forward_pre_hook(
                            lambda _, a: (fp8.fake_quantize_activations(a[0], None),)
                        )
                    )
        value = perplexity(model, ids)
        for h in hooks:
            h.remove()
        print(f"{name} {value:.4f} ({100 * (value / base - 1):+.2f} %)", flush=True)


if __name__ == "__main__":
    main()
