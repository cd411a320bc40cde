"""The throughput benchmark runs, in a smoke size, and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.engine


def test_the_benchmark_compares_raw_vllm_and_shardgen_and_writes_results(tmp_path, model_dir):
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "throughput.py"),
        "--rows",
        "16",
        "--max-tokens",
        "4",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "throughput.json").read_text())
    assert result["raw_vllm_tokens_per_s"] > 0 and result["shardgen_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["shardgen_tokens_per_s"] / result["raw_vllm_tokens_per_s"], rel=0.01)
    assert "| **ratio** |" in (tmp_path / "throughput.md").read_text()
