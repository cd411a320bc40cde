"""The preflight's estimate of a shard's minutes (issue 51): prompt and output tokens at the stated rates,
scaled to the jobs' GPU type, and the warnings for a shard past the time limit or too short to pay for
the engine's start."""

from __future__ import annotations

import itertools

from shardgen.base.gpus import relative_speed
from shardgen.data.manifest import Manifest
from shardgen.jobs.preflight import SHARD_MINUTES, estimate, sizing_warnings
from tests.conftest import base_config


def plan(rows: int, per_shard: int) -> Manifest:
    cuts = [*range(0, rows, per_shard), rows]
    pairs = enumerate(itertools.pairwise(cuts))
    shards = [{"id": f"{i:05d}", "start": a, "stop": b, "segments": []} for i, (a, b) in pairs]
    return Manifest({"version": 1, "source": {"kind": "parquet", "files": []}, "total_rows": rows,
                     "rows_per_shard": per_shard, "shards": shards})  # fmt: skip


def labelling(per_shard: int, **preflight):
    """A labelling run: 500-token prompts, 8 output tokens a row."""
    return base_config({"parquet": ["x.parquet"]}, sampling={"temperature": 0, "max_tokens": 8},
                       shards={"rows_per_shard": per_shard}, preflight=preflight)  # fmt: skip


def test_a_shards_minutes_count_its_prompt_tokens_on_the_jobs_gpu():
    config = labelling(840_000)  # what the rule that counted output tokens only gave for 45 minutes
    e = estimate(config, plan(2_000_000, 840_000), [500] * 10, gpu_model=None, time_limit=240)
    # 840,000 x (500 / 20,000 + 8 / 2,500) s = 23,688 s of generation: 394.8 minutes, past the limit
    assert e["generation_minutes_per_shard"] == 394.8 and e["minutes_per_shard"] == 396.8
    assert e["gpu"].startswith("an H100") and e["rows_per_shard_for_target"] == round(SHARD_MINUTES * 60 / 0.0282)
    (warning,) = sizing_warnings(config, e)
    assert "past the generate jobs' time limit of 240 minutes" in warning and "about 95745" in warning
    h200 = estimate(config, plan(2_000_000, 840_000), [500] * 10, gpu_model="nvidia_h200_141gb", time_limit=240)
    assert h200["gpu"] == "H200" and h200["generation_minutes_per_shard"] < e["generation_minutes_per_shard"]
    assert relative_speed("b200")[:2] > relative_speed("h100")[:2] > relative_speed("a100")[:2]
    fine = estimate(config, plan(2_000_000, 95_745), [500] * 10, time_limit=240)
    assert fine["generation_minutes_per_shard"] == 45.0 and sizing_warnings(config, fine) == []


def test_many_short_shards_are_a_warning_and_a_few_small_ones_are_not():
    config = labelling(1_000)
    many = estimate(config, plan(20_000, 1_000), [500] * 10, time_limit=240)
    (warning,) = sizing_warnings(config, many)
    assert "generate for at most 0.5 minutes each" in warning and "shards.per_job" in warning
    assert sizing_warnings(config, estimate(config, plan(3_000, 1_000), [500] * 10)) == [], "3 shards: a small run"
    slower = labelling(1_000, prompt_tokens_per_second=1_000, tokens_per_second=100)
    assert sizing_warnings(slower, estimate(slower, plan(20_000, 1_000), [500] * 10)) == [], (
        "the rates are the config's"
    )
