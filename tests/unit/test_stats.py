"""Stats: histograms add up and give percentiles within their bucket width."""

from __future__ import annotations

import pytest

from shardgen.data.stats import LogHistogram, merge_shard_stats, summary_text


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


def test_run_totals_add_up_shard_by_shard_with_stragglers_speculation_and_gpu_hours():
    shards = [
        {"shard": "00000", "rows": 4, "attempt_generated_tokens": 40, "generation_seconds": 2.0, "wall_seconds": 10,
         "gpu_hours": 0.5, "gpu_model": "NVIDIA H100", "spec_decode": {"draft_tokens": 30, "accepted_tokens": 12}},
        {"shard": "00001", "rows": 4, "attempt_generated_tokens": 60, "generation_seconds": 2.0, "wall_seconds": 30,
         "gpu_hours": 0.5, "gpu_model": "NVIDIA H100", "spec_decode": {"draft_tokens": 10, "accepted_tokens": 8},
         "histograms": {"ttft_s": {"5": 2}}},
        {"shard": "00002", "rows": 2, "attempt_generated_tokens": 20, "generation_seconds": 1.0, "wall_seconds": 12,
         "gpu_hours": 0.25, "gpu_model": "NVIDIA B200", "peak_rss_mib": 900.0},
    ]  # fmt: skip
    t = merge_shard_stats(shards)
    assert t["rows"] == 10 and t["attempt_generated_tokens"] == 120 and t["gpu_hours"] == 1.25
    assert t["output_tokens_per_s"] == 120 / 5.0 and t["output_tokens_per_gpu_hour"] == 120 / 1.25
    assert t["spec_decode"] == {"draft_tokens": 40, "accepted_tokens": 20, "acceptance_rate": 0.5}
    assert t["makespan_seconds"] == 30 and t["slowest_shard"] == "00001" and t["median_shard_seconds"] == 12
    assert t["slowest_over_median"] == 30 / 12 and t["peak_rss_mib"] == 900.0
    assert t["gpu_models"] == {"NVIDIA H100": 2, "NVIDIA B200": 1}
    assert t["num_shards"] == 3 and [s["shard"] for s in t["shards"]] == ["00000", "00001", "00002"]
    assert "histograms" not in t["shards"][1], "stats.json keeps a summary of each shard, not its histograms"


def test_a_pooling_shard_has_rows_and_prompt_token_rates_and_no_output_token_figures():
    from types import SimpleNamespace

    import pyarrow as pa

    from shardgen.data.stats import AttemptCounters, shard_stats

    table = pa.table({"row_index": [0, 1], "prompt_tokens": [5, 7], "label": ["a", "b"], "error": [None, None]})
    counters = AttemptCounters(rows=2, requests=2, prompt_tokens=12)
    counters.latency.add(0.2)
    shard = SimpleNamespace(id="00000", start=0, stop=2, rows=2)
    stats = shard_stats(shard, table, 0, counters, 1.0, 2.0, 3600.0, 1, task="classify")
    assert stats["task"] == "classify" and stats["generated_tokens"] == 0
    assert stats["output_tokens_per_s"] is None and stats["prompt_tokens_per_s"] == 6.0
    total = merge_shard_stats([stats])
    assert total["task"] == "classify" and total["output_tokens_per_gpu_hour"] is None
    assert total["rows_per_gpu_hour"] == 2.0
    text = summary_text(total)
    assert "1.00 rows/s, 6.0 prompt tok/s" in text and "2 rows per GPU-hour" in text and "output tok" not in text


def test_reasoning_tokens_add_up_over_shards_and_the_summary_splits_the_generated_tokens():
    common = {"rows": 2, "errors": 0, "prompt_tokens": 10, "generation_seconds": 1, "wall_seconds": 2, "gpu_hours": 0.1}
    s = merge_shard_stats([
        {**common, "shard": "00000", "generated_tokens": 30, "reasoning_tokens": 20},
        {**common, "shard": "00001", "generated_tokens": 12, "reasoning_tokens": 5},
        {**common, "shard": "00002", "generated_tokens": 8},  # a shard from before reasoning_tokens
    ])  # fmt: skip
    assert (s["generated_tokens"], s["reasoning_tokens"]) == (50, 25)
    assert [x["reasoning_tokens"] for x in s["shards"]] == [20, 5, None]
    assert "50 generated (25 reasoning, 25 answer)" in summary_text(s)
    assert "reasoning" not in summary_text(merge_shard_stats([{**common, "generated_tokens": 8}]))
