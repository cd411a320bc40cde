"""The throughput benchmark runs, in a smoke size, and writes its results."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.workflow import run_bounded

# Smoke runs: their figures are not asserted (and a feed step short of requests is none by construction, not
# by speed), so they run beside other tests in `make test`; the benchmarks themselves run alone (make bench).
pytestmark = pytest.mark.engine


def test_the_benchmark_compares_raw_vllm_caching_and_order_and_writes_results(tmp_path, model_dir):
    # one engine for both comparisons (the same KV cache): a smoke run
    cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--rows", "12", "--max-tokens", "4",
           "--repeats", "1", "--docs", "4", "--questions", "2", "--kv-cache-mib", "128", "--order-kv-cache-mib", "128",
           "--out", str(tmp_path)]  # fmt: skip
    r = run_bounded(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "throughput.json").read_text())
    s, o = result["overhead"], result["order"]
    assert s["raw_vllm_tokens_per_s"] > 0 and s["shardgen_tokens_per_s"] > 0
    assert s["ratio"] == pytest.approx(s["shardgen_tokens_per_s"] / s["raw_vllm_tokens_per_s"], rel=0.01)
    assert s["cache_on_tokens_per_s"] > 0 and s["cache_off_tokens_per_s"] > 0
    assert 0 < s["hit_rate"] <= s["hit_rate_max"] < 1, "a long shared system prompt is cached, within the maximum"
    assert o["rows"] == 8 and o["same_text"] and o["prefix"]["hit_rate"] > 0
    md = (tmp_path / "throughput.md").read_text()
    assert "| **ratio** |" in md and "of the maximum" in md and "`prompt.order`" in md


def test_the_feed_benchmark_compares_shardgen_with_llm_chat_and_generate_on_the_toy_model_with_the_same_text(
    tmp_path, model_dir
):
    toy = ROOT / "models" / "toy" / "config.json"
    assert toy.exists(), "the toy model is made by `make setup`"
    cmd = [sys.executable, str(ROOT / "bench" / "feed.py"), "--size", "smoke", "--out", str(tmp_path)]
    r = run_bounded(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "feed.json").read_text())
    assert set(result["max_num_seqs"]) == {"256"}
    for kinds in result["max_num_seqs"].values():
        assert set(kinds) == {"text", "choice", "json", "n4"}
        for kind, m in kinds.items():
            assert min(m[f"{p}_rows_per_s"] for p in ("vllm_chat", "vllm_generate", "shardgen")) > 0
            assert m["same_text"] is (None if kind == "n4" else True), f"{kind}: the three paths differ"
            assert m["steps_short"] == 0, "the feed kept the engine's queue full"
    assert result["profile_top"][0]["total_s"] > 0
    assert "| 256 | text |" in (tmp_path / "feed.md").read_text()


def test_the_pooling_benchmark_compares_shardgen_with_llm_classify_and_embed_on_the_same_values(tmp_path, model_dir):
    cmd = [sys.executable, str(ROOT / "bench" / "pooling.py"), "--size", "smoke", "--out", str(tmp_path)]
    r = run_bounded(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "pooling.json").read_text())
    assert set(result["tasks"]) == {"classify", "embed"}
    for m in result["tasks"].values():
        assert m["vllm_rows_per_s"] > 0 and m["shardgen_rows_per_s"] > 0
        assert m["max_abs_diff"] < 1e-3, "shardgen and vLLM's own call pool the same values"
    assert "| classify | `LLM.classify` |" in (tmp_path / "pooling.md").read_text()
