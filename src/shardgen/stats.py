"""Throughput statistics that add up: per shard, then summed by merge.

Latencies are kept as log-bucketed histograms rather than raw samples, so a
merge of 10,000 shards adds fixed-size arrays and its percentiles are exact to
the bucket width (about 2.5%).
"""

from __future__ import annotations

import math
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
    "gpu_hours",
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


def merge_shard_stats(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum per-shard stats into run totals (the stats of each shard stay under ``shards``)."""
    totals: dict[str, Any] = {k: 0 for k in SUMMED}
    hists = {k: LogHistogram() for k in HISTOGRAMS}
    error_reasons: dict[str, int] = {}
    for s in shards:
        for k in SUMMED:
            totals[k] += s.get(k) or 0
        for k in HISTOGRAMS:
            hists[k] += LogHistogram.from_json(s.get("histograms", {}).get(k, {}))
        for reason, n in s.get("error_reasons", {}).items():
            error_reasons[reason] = error_reasons.get(reason, 0) + n
    totals["gpu_hours"] = round(totals["gpu_hours"], 6)
    totals["error_reasons"] = error_reasons
    totals.update(summarize(totals, hists))
    totals["makespan_seconds"] = max((s.get("wall_seconds", 0) for s in shards), default=0)
    totals["num_shards"] = len(shards)
    totals["histograms"] = {k: h.to_json() for k, h in hists.items()}
    return totals


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
        f"prefix cache    {_fmt(hit if hit is None else 100 * hit)}% of prompt tokens",
        f"GPU-hours       {stats['gpu_hours']:.4f}",
    ]
    return "\n".join(lines)
