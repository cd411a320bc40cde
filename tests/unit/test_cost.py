"""What a run cost (shardgen.base.cost), from known tokens and GPU-hours, through the run totals, the
summary and the report."""

from __future__ import annotations

import pytest

from shardgen import config as cfg
from shardgen.base.cost import earlier_attempts, run_cost
from shardgen.commands.report import totals
from shardgen.data.stats import merge_shard_stats, summary_text
from shardgen.errors import ConfigError
from tests.conftest import TEST_MODEL_CFG

BASE = {"input": {"parquet": ["x.parquet"]}, "prompt": {"template": "{{ text }}"}, "model": dict(TEST_MODEL_CFG)}


def cost_config(**cost) -> cfg.CostConfig:
    return cfg.RunConfig.from_dict({**BASE, "cost": cost}).cost


def attempt(started: str, ended: str | None, outcome: str | None) -> dict:
    return {
        "started": f"2026-01-01T{started}+00:00",
        "ended": ended and f"2026-01-01T{ended}+00:00",
        "outcome": outcome,
    }


def shard(i: int, gpus: int, wall_s: float, prompt: int, generated: int, rows: int, attempts: list[dict]) -> dict:
    return {"shard": f"{i:05d}", "task": "generate", "rows": rows, "prompt_tokens": prompt,
            "generated_tokens": generated, "wall_seconds": wall_s, "gpus": gpus, "gpu_hours": wall_s * gpus / 3600,
            "attempts": attempts, "prefix_cache_hit_rate": None, "error_reasons": {}}  # fmt: skip


def test_every_attempt_is_billed_but_the_queue_and_a_killed_attempt_without_an_end_record():
    s = shard(0, 2, 1800, 0, 0, 1, [
        attempt("10:00:00", "10:30:00", "interrupted"),  # 0.5 h on 2 GPUs
        attempt("11:00:00", None, None),  # killed outright: no measured time
        attempt("12:00:00", "12:30:00", "committed"),  # the finishing attempt: gpu_hours
    ])  # fmt: skip
    assert earlier_attempts(s) == (1.0, 1)
    stats = merge_shard_stats([s])
    assert stats["gpu_hours"] == 1.0 and stats["billed_gpu_hours"] == 2.0 and stats["attempts_unmeasured"] == 1
    assert stats["shards"][0]["billed_gpu_hours"] == 2.0


def test_the_cost_from_known_tokens_and_gpu_hours_per_token_per_row_and_against_a_hosted_price():
    # two shards: 1.5 + 0.5 GPU-hours billed, 1,000,000 prompt and 500,000 generated tokens, 1,000 rows
    failed, committed = attempt("09:30:00", "10:00:00", "failed"), attempt("10:00:00", "11:00:00", "committed")
    shards = [
        shard(0, 1, 3600, 600_000, 300_000, 600, [failed, committed]),
        shard(1, 1, 1800, 400_000, 200_000, 400, [attempt("10:00:00", "10:30:00", "committed")]),
    ]
    stats = merge_shard_stats(shards)
    c = run_cost(
        stats, cost_config(gpu_hour=3.5, currency="EUR", compare={"input_per_mtok": 1.25, "output_per_mtok": 5})
    )
    assert c["total"] == pytest.approx(7.0) and c["currency"] == "EUR" and c["billed_gpu_hours"] == pytest.approx(2.0)
    assert c["per_million_input_tokens"] == pytest.approx(7.0) and c["per_million_output_tokens"] == pytest.approx(14.0)
    assert c["per_thousand_rows"] == pytest.approx(7.0)
    assert c["compare"]["hosted_total"] == pytest.approx(1.25 + 2.5) and c["compare"]["ratio"] == pytest.approx(
        7 / 3.75
    )
    assert "not the time jobs waited in the queue" in c["includes"]

    stats["cost"] = c
    line = summary_text(stats).splitlines()[-1]
    assert line.startswith("cost ") and "7.00 EUR" in line and "2.0000 GPU-hours at 3.5 EUR" in line
    assert "14.0000 EUR per million output tokens" in line and "3.75 EUR (this run: ×1.87)" in line
    report = dict(totals(stats, []))
    assert report["cost"].startswith("7.00 EUR (2.0000 GPU-hours billed at 3.5 EUR each: every attempt's")
    assert report["cost per million input / output tokens"] == "7.0000 EUR / 14.0000 EUR"
    assert report["cost per thousand rows"] == "7.0000 EUR"
    assert report["the same tokens at the hosted batch price"].startswith("3.75 EUR (1.25 EUR per million input")


def test_no_price_no_cost_and_a_price_never_changes_the_fingerprint():
    stats = merge_shard_stats([shard(0, 1, 3600, 10, 10, 1, [attempt("10:00:00", "11:00:00", "committed")])])
    assert run_cost(stats, cost_config()) is None
    stats["cost"] = None
    assert not any(line.startswith("cost") for line in summary_text(stats).splitlines())
    assert "cost" not in dict(totals(stats, []))
    priced = cfg.RunConfig.from_dict({**BASE, "cost": {"gpu_hour": 2.0, "compare": None}})
    assert priced.fingerprint == cfg.RunConfig.from_dict(BASE).fingerprint


@pytest.mark.parametrize(
    ("cost", "said"),
    [
        ({"gpu_hour": -1}, "cost.gpu_hour"),
        ({"gpu_hour": 2, "compare": {"input_per_mtok": 1}}, "cost.compare"),
        ({"gpu_hours": 2}, "gpu_hours"),
    ],
)
def test_a_wrong_price_is_refused_naming_the_key(cost, said):
    with pytest.raises(ConfigError, match=said):
        cfg.RunConfig.from_dict({**BASE, "cost": cost})
