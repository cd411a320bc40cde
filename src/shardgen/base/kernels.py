"""FlashInfer's precompiled kernels, which offline GPU nodes need before the first job.

vLLM 0.32's CUDA build uses FlashInfer (its sampler on every GPU from
compute capability 8.0, attention on Blackwell and with an FP8 KV cache on
the RTX PRO 6000). FlashInfer downloads or JIT-compiles what it lacks at
engine start (``vllm/utils/flashinfer.py``: ``warn_if_flashinfer_kernels_missing``,
called from ``v1/worker/gpu_worker.py``), which on an offline compute node
takes minutes or fails. Its precompiled kernels are two wheels that
``vllm download-kernels`` installs from flashinfer.ai
(``vllm/entrypoints/cli/download_kernels.py``): ``flashinfer-cubin``, and
``flashinfer-jit-cache`` for CUDA 12.9 and newer, each at the version of
``flashinfer-python`` (a jit-cache may carry a ``+cuXYZ`` suffix).

``make setup`` on a GPU machine and the ``fetch_model`` step (on the machine
the workflow starts from, which has internet) install them; the preflight
refuses a run on the CUDA build without them. Everything here reads package
metadata: importing ``flashinfer`` would initialise CUDA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata

FIX = (
    f"run `{sys.prefix}/bin/vllm download-kernels` (this environment: under .snakemake/conda/ for the conda "
    "route, whose environment does that itself when Snakemake creates it) on a machine with internet access (the "
    "login node)"
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def torch_cuda() -> str | None:
    """The CUDA version the installed torch was built with (``torch.version.cuda``; None on the CPU build)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def _at_least(version: str | None, minimum: tuple[int, int]) -> bool:
    try:
        parts = tuple(int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return False
    return len(parts) == 2 and parts >= minimum


def missing_kernels(cuda: str | None = None) -> list[str]:
    """What FlashInfer lacks to start without downloading or compiling: one line per wheel."""
    flashinfer = _version("flashinfer-python")
    if flashinfer is None:
        return []  # no FlashInfer (the CPU build): nothing to download
    cuda = torch_cuda() if cuda is None else cuda
    problems = []
    cubin = _version("flashinfer-cubin")
    if os.environ.get("VLLM_HAS_FLASHINFER_CUBIN") != "1" and cubin != flashinfer:
        problems.append(f"flashinfer-cubin is {cubin or 'not installed'}, flashinfer-python is {flashinfer}")
    if _at_least(cuda, (12, 9)):
        jit = _version("flashinfer-jit-cache") or ""
        if jit != flashinfer and not jit.startswith(flashinfer + "+"):
            problems.append(
                f"flashinfer-jit-cache is {jit or 'not installed'}, flashinfer-python is {flashinfer} (CUDA {cuda})"
            )
    return problems


def kernel_problem() -> str | None:
    """The preflight's message when the kernels are missing, else None."""
    missing = missing_kernels()
    if not missing:
        return None
    return (
        "FlashInfer's precompiled kernels are missing (" + "; ".join(missing) + "): every job would download "
        f"or compile them at engine start, which fails on offline compute nodes or takes minutes; {FIX}"
    )


def ensure_kernels() -> str | None:
    """Install the kernels with vLLM's own command when they are missing (the fetch step, online).

    Returns what was done, or None when nothing was needed.
    """
    if not missing_kernels():
        return None
    vllm = shutil.which("vllm", path=os.path.dirname(sys.executable)) or shutil.which("vllm")
    if vllm is None:
        return f"FlashInfer's kernels are missing and the `vllm` command is not found: {FIX}"
    done = subprocess.run([vllm, "download-kernels"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return f"`vllm download-kernels` failed ({done.returncode}): {done.stderr.strip()[-500:]}; {FIX}"
    return "installed FlashInfer's precompiled kernels (vllm download-kernels)"
