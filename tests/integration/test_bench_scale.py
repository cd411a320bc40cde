"""The scale benchmark runs in its smoke size and measures every step it promises (not the Slurm ones)."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT
from tests.integration.workflow import run_bounded


def _positive(run: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(run[key], int | float) and run[key] > 0, (key, run)


def test_the_scale_benchmark_measures_plan_dry_run_merge_and_simulates_the_three_modes(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--size", "smoke", "--out", str(out), "--work", str(work)]
    r = run_bounded(cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "scale.json").read_text())
    assert result["size"] == "smoke"
    assert "slurm" not in result  # only with --slurm

    # planning: 100,000 and 1,000,000 rows, 10,000 rows per shard
    plan = result["plan"]
    assert [(p["rows"], p["shards"]) for p in plan["runs"]] == [(100_000, 10), (1_000_000, 100)]
    for p in plan["runs"]:
        _positive(p, "seconds", "peak_rss_mb", "manifest_bytes")
        manifest = json.loads((work / "plan" / f"files-{p['files']}" / "manifest.json").read_text())
        assert manifest["total_rows"] == p["rows"] and len(manifest["shards"]) == p["shards"]
    assert plan["ratio_rows"] == 10

    # the dry run lists one generate job per planned shard, plus preflight, merge and all
    dry = result["dryrun"]
    assert [d["shards"] for d in dry["runs"]] == [100, 1000]
    for d in dry["runs"]:
        _positive(d, "seconds", "peak_rss_mb")
        jobs = d["jobs"]
        assert (jobs["generate_shard"], jobs["preflight"], jobs["merge_shards"], jobs["all"]) == (d["shards"], 1, 1, 1)
        assert "plan_shards" not in jobs  # the plan was taken as done
        assert jobs["total"] == sum(n for job, n in jobs.items() if job != "total")
        assert d["generate_jobs_listed"] == d["shards"]
    assert dry["ratio_shards"] == 10
    assert dry["ratio_seconds"] == round(dry["runs"][1]["seconds"] / dry["runs"][0]["seconds"], 2)

    # merge: both runs wrote every planned row once, and summed the stats of every shard
    merge = result["merge"]
    assert [(m["rows"], m["shards"]) for m in merge["runs"]] == [(100_000, 10), (1_000_000, 100)]
    for m in merge["runs"]:
        _positive(m, "seconds", "peak_rss_mb", "output_bytes", "shard_bytes")
        assert m["output_rows"] == m["stats_rows"] == m["rows"]
        assert m["stats_shards"] == m["shards"]
    assert merge["ratio_peak_rss"] == round(merge["runs"][1]["peak_rss_mb"] / merge["runs"][0]["peak_rss_mb"], 2)
    # each step's peak RSS is its own, not this benchmark's: a bare import is smaller than a merge
    assert 0 < merge["import_baseline"]["peak_rss_mb"] <= min(m["peak_rss_mb"] for m in merge["runs"])

    md = (out / "scale.md").read_text()
    for row in ("| plan |", "| `snakemake -n` | 1,000 shards |", "| merge ratio |"):
        assert row in md

    # the simulation: every mode ran all the work; workers start the fewest engines and finish first,
    # and sooner with the plan's guided tail
    sim = {r["mode"]: r for r in result["simulate"]["runs"]}
    assert list(sim) == ["per_shard", "per_job", "workers", "workers + tail", "workers + tail + split",
                         "workers, defaults"]  # fmt: skip
    cluster = result["simulate"]["cluster"]
    assert sim["per_shard"]["engine_starts"] == cluster["shards"]
    assert sim["per_job"]["engine_starts"] == cluster["shards"] // cluster["per_job"]
    assert sim["workers"]["engine_starts"] == cluster["gpus"] + sim["workers"]["failures"]  # a retry starts one
    for r in sim.values():
        assert 0 < r["efficiency"] <= 1 and r["billed_gpu_h"] >= result["simulate"]["work"]["total_gpu_h"]
    assert sim["workers"]["makespan_h"] < sim["per_job"]["makespan_h"] < sim["per_shard"]["makespan_h"]
    assert sim["workers + tail"]["makespan_h"] < sim["workers"]["makespan_h"]
    # idle workers split the running shards (splits.victim, splits.cut_point): the end comes sooner still
    assert sim["workers + tail + split"]["splits_made"] > 0
    assert sim["workers + tail + split"]["makespan_h"] < sim["workers + tail"]["makespan_h"]
    end = {(e["sigma"], e["estimate"], e["shards"]): e["runs"] for e in result["simulate"]["end"]}
    (split,) = [r for r in end[(1.5, "rows", 1000)] if r["order"] == "longest first + tail + split, order input"]
    assert split["vs_bound"] <= 1.10 and split["efficiency"] >= 0.97, split
    # what a user gets with only shards.workers set (issue 38): the tail and splits by default, in prefix order
    for (sigma, estimate, shards), runs in end.items():
        (defaults,) = [r for r in runs if r["order"] == "defaults"]
        assert defaults["efficiency"] >= 0.97, (sigma, estimate, shards, defaults)
        assert defaults["vs_bound"] <= (1.05 if sigma <= 1.0 else 1.10), (sigma, estimate, shards, defaults)
    assert "**Simulated**" in md
