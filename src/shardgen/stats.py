"""Throughput statistics that add up: per shard, then summed by merge.

Latencies are kept as log-bucketed histograms rather than raw samples, so a
merge of 10,000 shards adds fixed-size arrays and its percentiles are exact to
the bucket width (about 2.5%).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

_RATIO = 1.05  # bucket width: values within a bucket differ by at most 5%
_MIN = 1e-4  # seconds; smaller values share the first bucket
_LOG = math.log(_RATIO)


@dataclass
class LogHistogram:
    """A histogram of positive values with geometric buckets.

    ``counts`` maps a bucket index to a count; index ``i`` holds values in
    ``[_MIN * r**i, _MIN * r**(i+1))``.
    """

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, value: float) -> None:
        i = 0 if value <= _MIN else int(math.log(value / _MIN) / _LOG)
        self.counts[i] = self.counts.get(i, 0) + 1

    def __iadd__(self, other: LogHistogram) -> LogHistogram:
        for i, n in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + n
        return self

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def quantile(self, q: float) -> float | None:
        """The value at quantile ``q`` (bucket midpoint), or None when empty."""
        total = self.count
        if not total:
            return None
        rank = q * (total - 1)
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen > rank:
                return _MIN * _RATIO ** (i + 0.5)
        return _MIN * _RATIO ** (max(self.counts) + 0.5)

    def to_json(self) -> dict[str, int]:
        return {str(i): n for i, n in sorted(self.counts.items())}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> LogHistogram:
        return cls({int(i): n for i, n in data.items()})


# Counters that merge sums over shards.
SUMMED = (
    "rows",
    "output_rows",
    "errors",
    "rows_resumed",
    "rows_generated",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
    "attempt_requests",
    "attempt_prompt_tokens",
    "attempt_generated_tokens",
    "engine_start_seconds",
    "generation_seconds",
    "wall_seconds",
    "queue_wait_seconds",
    "gpu_hours",
    "preemptions",
)
HISTOGRAMS = ("ttft_s", "latency_s")


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(counters: dict[str, Any], hists: dict[str, LogHistogram]) -> dict[str, Any]:
    """Derived figures: throughput, cache hit rate, latency percentiles.

    Throughput is the engine work of the attempts that finished the shards
    (``attempt_*``) over their generation time; rows taken from checkpoints
    cost no generation time now and are not counted in it.
    """
    out: dict[str, Any] = {}
    gen_s = counters.get("generation_seconds", 0.0)
    prompt, generated = counters.get("attempt_prompt_tokens", 0), counters.get("attempt_generated_tokens", 0)
    out["output_tokens_per_s"] = _rate(generated, gen_s)
    out["total_tokens_per_s"] = _rate(generated + prompt, gen_s)
    out["requests_per_s"] = _rate(counters.get("attempt_requests", 0), gen_s)
    out["prefix_cache_hit_rate"] = _rate(counters.get("cached_prompt_tokens", 0), prompt)
    for name, h in hists.items():
        stem = name.removesuffix("_s")
        for q in (50, 90, 99):
            out[f"{stem}_p{q}_s"] = h.quantile(q / 100)
    return out


# What stats.json keeps of each shard: the figures a person compares across
# shards. The full stats stay in each shard's own stats file.
SHARD_SUMMARY_KEYS = (
    "shard",
    "rows",
    "output_rows",
    "errors",
    "error_reasons",
    "rows_resumed",
    "rows_generated",
    "prompt_tokens",
    "generated_tokens",
    "output_tokens_per_s",
    "requests_per_s",
    "prefix_cache_hit_rate",
    "ttft_p50_s",
    "latency_p50_s",
    "engine_start_seconds",
    "generation_seconds",
    "wall_seconds",
    "queue_wait_seconds",
    "gpu_hours",
    "gpus",
    "gpu_model",
    "preemptions",
    "spec_decode",
    "peak_rss_mib",
    "memory_failures",
    "host",
    "slurm",
    "cuda_visible_devices",
    "thread_env_removed",
    "precision",
)


class RunTotals:
    """Run totals, summed shard by shard, so a merge of 10,000 shards holds one shard's stats at a time."""

    def __init__(self) -> None:
        self.totals: dict[str, Any] = {k: 0 for k in SUMMED}
        self.hists = {k: LogHistogram() for k in HISTOGRAMS}
        self.error_reasons: dict[str, int] = {}
        self.spec = {"draft_tokens": 0, "accepted_tokens": 0}
        self.spec_seen = False
        self.walls: list[tuple[float, str]] = []
        self.peak_rss = 0.0
        self.gpu_models: dict[str, int] = {}
        self.shards: list[dict[str, Any]] = []

    def add(self, s: dict[str, Any]) -> None:
        for k in SUMMED:
            self.totals[k] += s.get(k) or 0
        for k in HISTOGRAMS:
            self.hists[k] += LogHistogram.from_json(s.get("histograms", {}).get(k, {}))
        for reason, n in s.get("error_reasons", {}).items():
            self.error_reasons[reason] = self.error_reasons.get(reason, 0) + n
        if s.get("spec_decode"):
            self.spec_seen = True
            for k in self.spec:
                self.spec[k] += s["spec_decode"][k]
        self.walls.append((s.get("wall_seconds") or 0, s.get("shard")))
        self.peak_rss = max(self.peak_rss, s.get("peak_rss_mib") or 0)
        gpu = s.get("gpu_model") or "none (vLLM's CPU build)"
        self.gpu_models[gpu] = self.gpu_models.get(gpu, 0) + 1
        self.shards.append({k: s.get(k) for k in SHARD_SUMMARY_KEYS})

    def result(self) -> dict[str, Any]:
        totals = dict(self.totals)
        totals["error_reasons"] = self.error_reasons
        totals.update(summarize(totals, self.hists))
        totals["output_tokens_per_gpu_hour"] = _rate(totals["attempt_generated_tokens"], totals["gpu_hours"])
        totals["spec_decode"] = (
            {**self.spec, "acceptance_rate": _rate(self.spec["accepted_tokens"], self.spec["draft_tokens"])}
            if self.spec_seen
            else None
        )
        totals["peak_rss_mib"] = self.peak_rss
        totals["gpu_models"] = self.gpu_models  # shards that ran on each
        totals.update(_stragglers(self.walls))
        totals["num_shards"] = len(self.shards)
        totals["histograms"] = {k: h.to_json() for k, h in self.hists.items()}
        totals["shards"] = self.shards
        return totals


def merge_shard_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stats into run totals (a summary of each shard stays under ``shards``)."""
    run = RunTotals()
    for s in shards:
        run.add(s)
    return run.result()


def _stragglers(walls: list[tuple[float, str]]) -> dict[str, Any]:
    """Makespan and how far the slowest shard is from the median one (wall time of the finishing attempt)."""
    if not walls:
        return {"makespan_seconds": 0, "slowest_shard": None, "median_shard_seconds": None, "slowest_over_median": None}
    walls = sorted(walls)
    median = statistics.median(w for w, _ in walls)
    return {
        "makespan_seconds": walls[-1][0],
        "slowest_shard": walls[-1][1],
        "median_shard_seconds": median,
        "slowest_over_median": _rate(walls[-1][0], median),
    }


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def summary_text(stats: dict[str, Any]) -> str:
    """A short summary for people, printed at the end of a run."""
    hit = stats["prefix_cache_hit_rate"]
    lines = [
        f"rows            {stats['rows']}  ({stats['errors']} errors"
        + (", " + ", ".join(f"{k}: {v}" for k, v in stats["error_reasons"].items()) if stats["error_reasons"] else "")
        + ")",
        f"shards          {stats['num_shards']}  (rows resumed from checkpoints: {stats['rows_resumed']})",
        f"tokens          {stats['prompt_tokens']} prompt, {stats['generated_tokens']} generated",
        f"throughput      {_fmt(stats['output_tokens_per_s'])} output tok/s, "
        f"{_fmt(stats['requests_per_s'], '.2f')} req/s (over {_fmt(stats['generation_seconds'])} s of generation)",
        f"latency         TTFT p50 {_fmt(stats['ttft_p50_s'], '.3f')} s, p90 {_fmt(stats['ttft_p90_s'], '.3f')} s; "
        f"end-to-end p50 {_fmt(stats['latency_p50_s'], '.3f')} s",
        f"prefix cache    {_fmt(hit if hit is None else 100 * hit)}% of prompt tokens; "
        f"{stats.get('preemptions', 0)} preemptions",
        f"GPU-hours       {stats['gpu_hours']:.4f}  ({_fmt(stats.get('output_tokens_per_gpu_hour'), '.0f')} output "
        "tokens per GPU-hour)",
        f"shards' time    slowest {stats.get('slowest_shard')} {_fmt(stats.get('makespan_seconds'))} s, "
        f"median {_fmt(stats.get('median_shard_seconds'))} s",
    ]
    spec = stats.get("spec_decode")
    if spec:
        lines.append(f"speculation     {_fmt(100 * (spec['acceptance_rate'] or 0))}% of draft tokens accepted")
    return "\n".join(lines)
