"""What every benchmark shares: the machine it ran on, and writing ``<name>.json`` (every figure)
and ``<name>.md`` (the table) under ``--out``."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> str:
    """The GPU the engine ran on, or the CPU (its instruction set) for vLLM's CPU build."""
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    isa = torch.backends.cpu.get_cpu_capability()
    return f"CPU: {platform.machine()} ({isa}), {os.cpu_count()} cores, vLLM's CPU build"


def write_results(out: Path, name: str, result: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
