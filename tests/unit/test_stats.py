"""Stats: histograms add up and give percentiles within their bucket width."""

from __future__ import annotations

import pytest

from shardgen.stats import LogHistogram, merge_shard_stats, summary_text


def test_histogram_quantiles_are_within_five_percent():
    h = LogHistogram()
    for i in range(1, 1001):
        h.add(i / 100)  # 0.01 .. 10 s
    assert h.quantile(0.5) == pytest.approx(5.0, rel=0.05)
    assert h.quantile(0.9) == pytest.approx(9.0, rel=0.05)


def test_merged_histograms_equal_one_histogram_of_all_values():
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    for i in range(100):
        (a if i % 2 else b).add(0.1 + i / 10)
        both.add(0.1 + i / 10)
    a += b
    assert a.counts == both.counts


def test_an_empty_histogram_has_no_percentiles():
    assert LogHistogram().quantile(0.5) is None


def test_shard_stats_sum_and_throughput_is_over_generation_time():
    shards = [
        {
            "rows": 10,
            "errors": 1,
            "error_reasons": {"prompt_too_long": 1},
            "prompt_tokens": 100,
            "generated_tokens": 50,
            "attempt_generated_tokens": 50,
            "attempt_prompt_tokens": 100,
            "attempt_requests": 9,
            "cached_prompt_tokens": 40,
            "generation_seconds": 5,
            "wall_seconds": 60,
            "gpu_hours": 0.5,
        },
        {
            "rows": 5,
            "errors": 0,
            "prompt_tokens": 60,
            "generated_tokens": 30,
            "attempt_generated_tokens": 30,
            "attempt_prompt_tokens": 60,
            "attempt_requests": 5,
            "cached_prompt_tokens": 0,
            "generation_seconds": 3,
            "wall_seconds": 40,
            "gpu_hours": 0.25,
        },
    ]
    s = merge_shard_stats(shards)
    assert (s["rows"], s["errors"], s["generated_tokens"]) == (15, 1, 80)
    assert s["output_tokens_per_s"] == pytest.approx(80 / 8)
    assert s["requests_per_s"] == pytest.approx(14 / 8)
    assert s["prefix_cache_hit_rate"] == pytest.approx(40 / 160)
    assert s["gpu_hours"] == pytest.approx(0.75)
    assert s["makespan_seconds"] == 60
    assert "prompt_too_long: 1" in summary_text(s)
