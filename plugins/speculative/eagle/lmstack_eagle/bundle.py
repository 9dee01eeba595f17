"""Copy a trained head into the distribution's bundled heads, stored in float16.

    python -m lmstack_eagle.bundle --head DIR --name smollm2-135m-instruct

float16 halves the folder (the head is ~4.2 M parameters: 8.4 MB) at a rounding far below what
`head_weights: int8` applies at load; the config keeps the training record (`eagle_*` keys)
without the machine's folder paths, and says which recipe made it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lmstack_eagle.head import BUNDLED_HEADS, CONFIG_FILE, VOCAB_FILE, load_head, save_head


def _without_folders(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_folders(v) if isinstance(v, dict) else v for k, v in cfg.items() if k != "folder"}


def bundle_head(head: str | Path, name: str, recipe: str = "", into: Path = BUNDLED_HEADS) -> Path:
    """Write `into / name` from the head folder `head`; returns the folder."""
    src = Path(head).expanduser()
    out = into / name
    cfg = json.loads((src / CONFIG_FILE).read_text())
    extra = {k: v for k, v in _without_folders(cfg).items() if k.startswith("eagle_")}
    if recipe:
        extra["eagle_recipe"] = recipe
    save_head(load_head(src, torch.float32), out, extra, dtype=torch.float16)
    if (src / VOCAB_FILE).is_file():
        shutil.copyfile(src / VOCAB_FILE, out / VOCAB_FILE)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="a trained head folder")
    ap.add_argument("--name", required=True, help="the target's known model name")
    ap.add_argument("--recipe", default="", help="the commands that trained it, for the config")
    args = ap.parse_args()
    out = bundle_head(args.head, args.name, args.recipe)
    print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
