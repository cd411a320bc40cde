"""FlashInfer's precompiled kernels: found missing from package metadata, and installed by vLLM's own command."""

from __future__ import annotations

import sys

import pytest

from shardgen.base import kernels

FLASHINFER = "0.7.0.post1"  # what vLLM 0.32.0 on PyPI requires (flashinfer-python==0.7.0.post1)


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions are installed (name -> version)."""
    versions: dict[str, str] = {}
    monkeypatch.setattr(kernels, "_version", versions.get)
    monkeypatch.delenv("VLLM_HAS_FLASHINFER_CUBIN", raising=False)
    return versions


def test_the_cpu_build_has_no_flashinfer_and_needs_nothing(installed):
    assert kernels.missing_kernels("13.0") == [] and kernels.kernel_problem() is None


def test_missing_cubins_and_jit_cache_are_named_with_the_versions_they_must_match(installed):
    installed["flashinfer-python"] = FLASHINFER
    assert kernels.missing_kernels("13.0") == [
        f"flashinfer-cubin is not installed, flashinfer-python is {FLASHINFER}",
        f"flashinfer-jit-cache is not installed, flashinfer-python is {FLASHINFER} (CUDA 13.0)",
    ]
    installed["flashinfer-cubin"] = FLASHINFER
    installed["flashinfer-jit-cache"] = f"{FLASHINFER}+cu130"  # the CUDA-tagged wheel vllm download-kernels installs
    assert kernels.missing_kernels("13.0") == []
    installed["flashinfer-jit-cache"] = "0.6.9+cu130"
    assert kernels.missing_kernels("13.0") == [
        f"flashinfer-jit-cache is 0.6.9+cu130, flashinfer-python is {FLASHINFER} (CUDA 13.0)"
    ]
    # FlashInfer publishes no jit-cache below CUDA 12.9 (vllm/utils/flashinfer.py has_flashinfer_jit_cache_wheels)
    assert kernels.missing_kernels("12.8") == []


def test_the_preflight_message_says_what_to_run(installed, monkeypatch):
    installed["flashinfer-python"] = FLASHINFER
    monkeypatch.setattr(kernels, "torch_cuda", lambda: "13.0")
    message = kernels.kernel_problem()
    assert message.startswith("FlashInfer's precompiled kernels are missing (flashinfer-cubin is not installed")
    # the environment by its path: under the conda route, a hidden .snakemake/conda/<hash> one
    assert f"run `{sys.prefix}/bin/vllm download-kernels` (this environment: under .snakemake/conda/" in message
    assert "on a machine with internet access (the login node)" in message


def test_the_fetch_step_runs_vllms_own_command_when_kernels_are_missing(installed, monkeypatch, tmp_path):
    import subprocess

    installed["flashinfer-python"] = FLASHINFER
    monkeypatch.setattr(kernels, "torch_cuda", lambda: "12.8")
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        installed["flashinfer-cubin"] = FLASHINFER
        return subprocess.CompletedProcess(cmd, 0, "", "")

    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kernels.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(kernels.subprocess, "run", run)
    assert kernels.ensure_kernels() == "installed FlashInfer's precompiled kernels (vllm download-kernels)"
    assert calls == [[str(fake), "download-kernels"]]
    assert kernels.ensure_kernels() is None, "nothing to do once they are there"
