"""Build the small test models from the demo model, locally, with no download.

- ``toy``: the demo model's tokenizer and chat template on one tiny layer
  with random weights. Engine steps cost almost nothing, so a run on it is
  bound by the Python side of the feed (bench/feed.py measures that).

Run once by ``make setup``. Usage: python scripts/make_test_models.py DEMO_MODEL_DIR OUT_DIR [NAME ...]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_tokenizer(demo: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy(demo / name, out / name)


def make_toy(demo: Path, out: Path) -> None:
    """One decoder layer of width 64 (3.2 M parameters, nearly all the embedding), random weights; one
    attention head of 64 (vLLM's CPU attention has no kernels for heads of 16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(demo)
    config.update(
        {
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "head_dim": 64,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    copy_tokenizer(demo, out)


BUILDERS = {"toy": make_toy}


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    demo, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    for name in sys.argv[3:] or list(BUILDERS):
        BUILDERS[name](demo, out_root / name)
        print(f"test model '{name}' written to {out_root / name}")


if __name__ == "__main__":
    main()
