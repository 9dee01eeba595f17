"""Perplexity of SmolLM2-135M-Instruct with rtn-int4 linears (asym, g128) and each way of
holding the tied embedding / LM head (`lm_head: dense | int8 | int4` and its group size), in
transformers fp32, on a text file (default: the GPL-3 text, 512-token windows), plus the
resident bytes each choice gives against bf16. Usage: python benchmarks/quality/awq_head_modes.py [text] [modes, e.g. int4:32,int8]"""

from __future__ import annotations

import argparse
import functools
import time

WINDOW, MAX_TOKENS = 512, 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("text", nargs="?", default="/usr/share/common-licenses/GPL-3", help="text to score")
    ap.add_argument(
        "modes", nargs="?", default="dense,int8,int4:32,int4:64,int4:128", help="e.g. int4:32,int8"
    )
    args = ap.parse_args()
    TEXT, MODES = args.text, args.modes

    import gguf
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from lmstack.model.source import resolve_model_path
    from lmstack_awq.compact import Int8Rows
    from lmstack_awq.int4_math import Int4Scheme, quantize_int4

    path = resolve_model_path("smollm2-135m-instruct")
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok(open(TEXT).read(), return_tensors="pt").input_ids[:, :MAX_TOKENS]

    def ppl() -> float:
        nll, n = 0.0, 0
        with torch.no_grad():
            for s in range(0, ids.shape[1] - 1, WINDOW):
                x = ids[:, s : s + WINDOW + 1]
                logits = model(x[:, :-1]).logits
                nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
                n += x.shape[1] - 1
        return float(torch.exp(torch.tensor(nll / n)))

    state = {k: v.clone() for k, v in model.state_dict().items()}
    total = sum(v.numel() for k, v in state.items() if k != "lm_head.weight")  # tied
    linear_params = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    embed = model.model.embed_tokens.weight
    other = total - linear_params - embed.numel()
    g128 = Int4Scheme(128, False)
    # int4 g128 linears: half a byte per value + fp16 scale and uint8 zero per group.
    linear_bytes = sum(
        m.weight.numel() // 2 + m.weight.shape[0] * g128.groups(m.weight.shape[1]) * 3
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    bf16 = 2 * total
    print(f"tokens {ids.shape[1]}; bf16 weights {bf16 / 1e6:.1f} MB")
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and "lm_head" not in n:
                m.weight.copy_(quantize_int4(m.weight, g128).dequantize())
    for spec in MODES.split(","):
        mode, _, group_text = spec.partition(":")
        group = int(group_text or 0)
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(state["model.embed_tokens.weight"])
            if mode == "int8":
                rows = Int8Rows(embed)
                embed.copy_(rows.q.float() * rows.scale[:, None])
                head_bytes = embed.numel() + 4 * embed.shape[0]
            elif mode == "int4":
                scheme = Int4Scheme(group, False)
                embed.copy_(quantize_int4(embed, scheme).dequantize())
                head_bytes = embed.numel() // 2 + embed.shape[0] * scheme.groups(embed.shape[1]) * 3
            else:
                head_bytes = 2 * embed.numel()
        t = time.time()
        value = ppl()
        size = linear_bytes + head_bytes + 2 * other
        label = mode if mode != "int4" else f"int4 g{group}"
        print(
            f"lm_head {label:10s} ppl {value:7.2f}  weights {size / 1e6:6.1f} MB = {size / bf16:.3f} x bf16  ({time.time() - t:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
