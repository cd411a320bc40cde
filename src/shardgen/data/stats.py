"""Throughput statistics that add up: per shard, then summed by merge.

Latencies are kept as log-bucketed histograms rather than raw samples, so a
merge of 10,000 shards adds fixed-size arrays and its percentiles are exact to
the bucket width (about 2.5%). A committed shard's stats file (``shard_record``) holds its figures
with what decided its content and how and where the attempt that finished it ran.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardgen.base import cost, jobinfo, memory, records
from shardgen.base.installed import vllm_version
from shardgen.config import TASKS
from shardgen.errors import error_reason

BUCKET_RATIO = 1.05  # bucket width: values within a bucket differ by at most 5%
BUCKET_MIN = 1e-4  # seconds; smaller values share the first bucket
_LOG = math.log(BUCKET_RATIO)


@dataclass
class LogHistogram:
    """A histogram of positive values with geometric buckets.

    ``counts`` maps a bucket index to a count; index ``i`` holds values in
    ``[BUCKET_MIN * r**i, BUCKET_MIN * r**(i+1))``.
    """

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, value: float) -> None:
        i = 0 if value <= BUCKET_MIN else int(math.log(value / BUCKET_MIN) / _LOG)
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
                return BUCKET_MIN * BUCKET_RATIO ** (i + 0.5)
        return BUCKET_MIN * BUCKET_RATIO ** (max(self.counts) + 0.5)

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
    "requests_reused",
    "requests_deduplicated",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
    "reasoning_tokens",
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
# Time to first token from arrival, end-to-end latency, time queued before scheduling, and time to
# first token from scheduling.
HISTOGRAMS = ("ttft_s", "latency_s", "queue_s", "ttft_scheduled_s")


def _rate(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(counters: dict[str, Any], hists: dict[str, LogHistogram], generates: bool = True) -> dict[str, Any]:
    """Derived figures: throughput, cache hit rate, latency percentiles.

    Throughput is the engine work of the attempts that finished the shards
    (``attempt_*``) over their generation time; rows taken from checkpoints
    cost no generation time now and are not counted in it. A pooling task
    (``generates`` false) has no output tokens: its output rates are None.
    """
    out: dict[str, Any] = {}
    gen_s = counters.get("generation_seconds", 0.0)
    prompt, generated = counters.get("attempt_prompt_tokens", 0), counters.get("attempt_generated_tokens", 0)
    out["output_tokens_per_s"] = _rate(generated, gen_s) if generates else None
    out["prompt_tokens_per_s"] = _rate(prompt, gen_s)
    out["total_tokens_per_s"] = _rate(generated + prompt, gen_s)
    out["requests_per_s"] = _rate(counters.get("attempt_requests", 0), gen_s)
    out["prefix_cache_hit_rate"] = _rate(counters.get("cached_prompt_tokens", 0), prompt)
    for name, h in hists.items():
        stem = name.removesuffix("_s")
        for q in (50, 90, 99):
            out[f"{stem}_p{q}_s"] = h.quantile(q / 100)
    return out


@dataclass
class AttemptCounters:
    """What one attempt of a shard did, counted as it happened (never derived from other counts)."""

    rows: int = 0  # input rows this attempt finished: generated, answered without the engine, or row errors
    requests: int = 0  # engine requests that completed
    # rows answered from the request store, and by a request with the same key in the job (engines.store)
    reused: int = 0
    deduplicated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    latency: LogHistogram = field(default_factory=LogHistogram)
    queue: LogHistogram = field(default_factory=LogHistogram)
    ttft_scheduled: LogHistogram = field(default_factory=LogHistogram)

    def histograms(self) -> dict[str, LogHistogram]:
        """By their names in the stats (``HISTOGRAMS``)."""
        return {"ttft_s": self.ttft, "latency_s": self.latency, "queue_s": self.queue,
                "ttft_scheduled_s": self.ttft_scheduled}  # fmt: skip


def _column_sum(table: pa.Table, name: str) -> int:
    if name not in table.column_names:  # a pooling task generates no tokens
        return 0
    col = table.column(name)
    if pa.types.is_list(col.type):
        col = pc.list_flatten(col)
    return int(pc.sum(col).as_py() or 0)


def error_reasons(table: pa.Table) -> dict[str, int]:
    """Input rows with an error, by reason: a row counts once, by its first failed sample's error."""
    bad = table.filter(table.column("error").is_valid()).select(["row_index", "error"])
    first: dict[int, str] = {}
    for i, e in zip(bad.column("row_index").to_pylist(), bad.column("error").to_pylist(), strict=True):
        first.setdefault(i, e)
    return dict(Counter(map(error_reason, first.values())))


def shard_stats(
    shard: Any,
    table: pa.Table,
    resumed: int,
    counters: AttemptCounters,
    engine_seconds: float,
    generation_seconds: float,
    wall_seconds: float,
    gpus: int,
    engine_delta: dict[str, float] | None = None,
    task: str = "generate",
) -> dict[str, Any]:
    """A committed shard's figures: the rows of its file, and the work of the attempt that finished it.

    Args:
        shard: the plan's shard (``id``, ``start``, ``stop``, ``rows``).
        table: the shard's committed output.
        resumed: input rows taken from checkpoints of earlier attempts.
        counters: what the finishing attempt counted as it ran.
        engine_delta: the engine's counters over the attempt (``Engine.counters``
            after minus before): preemptions and speculative decoding.
        task: the run's (``generate``, or a pooling task, which has no output tokens).
    """
    reasons = error_reasons(table)
    figures = {
        "rows": shard.rows,
        "output_rows": table.num_rows,
        "errors": sum(reasons.values()),
        "rows_resumed": resumed,
        # the rows the engine generated (or that failed): not those answered without it
        "rows_generated": counters.rows - counters.reused - counters.deduplicated,
        "requests_reused": counters.reused,
        "requests_deduplicated": counters.deduplicated,
        "prompt_tokens": _column_sum(table, "prompt_tokens"),
        "generated_tokens": _column_sum(table, "generated_tokens"),
        # of which a reasoning model's traces (sampling.reasoning_parser; 0 without one)
        "reasoning_tokens": _column_sum(table, "reasoning_tokens"),
        # This attempt's engine work, which throughput is measured over.
        "attempt_requests": counters.requests,
        "attempt_prompt_tokens": counters.prompt_tokens,
        "attempt_generated_tokens": counters.generated_tokens,
        "cached_prompt_tokens": counters.cached_tokens,
        "engine_start_seconds": round(engine_seconds, 3),
        "generation_seconds": round(generation_seconds, 3),
        "wall_seconds": round(wall_seconds, 3),
        "gpus": gpus,
        "gpu_hours": wall_seconds * gpus / 3600,
    }
    hists = counters.histograms()
    return {
        "shard": shard.id,
        "task": task,
        "row_start": shard.start,
        "row_stop": shard.stop,
        **figures,
        "error_reasons": reasons,
        **summarize(figures, hists, TASKS[task].generates),
        "histograms": {k: h.to_json() for k, h in hists.items()},
        **engine_stats(engine_delta or {}),
    }


def engine_stats(delta: dict[str, float]) -> dict[str, Any]:
    """Preemptions and speculative decoding from the engine's counters over an attempt."""
    out: dict[str, Any] = {"preemptions": int(delta.get("preemptions", 0))}
    drafts = delta.get("spec_decode_draft_tokens", 0)
    if drafts:
        accepted = delta.get("spec_decode_accepted_tokens", 0)
        out["spec_decode"] = {
            "draft_tokens": int(drafts),
            "accepted_tokens": int(accepted),
            "acceptance_rate": accepted / drafts,
            "drafts": int(delta.get("spec_decode_drafts", 0)),
        }
    return out


# What the stats (and the output's provenance) keep of the model record.
MODEL_SOURCE_KEYS = ("source", "path", "repo_id", "revision", "commit", "digest")


def shard_record(
    job: Any, run: Any, table: pa.Table, history: list[records.Attempt], nodes: list[str], node: str
) -> dict[str, Any]:
    """A committed shard's stats file: its figures (``shard_stats``), what decided its content, and how
    and where the attempt that finished it ran.

    Args:
        job: the shard's job (``generate.ShardJob``): the shard, its config, fingerprint, checkpoint,
            model record, the earlier attempts and this one's start.
        run: what the attempt's engine and feed produced (``generate.AttemptRun``), with the engine's
            settings (``engine.EngineSettings``).
        table: the shard's committed output.
        history: the shard's attempts, this one last and committed.
        nodes: the job's nodes (``multinode.job_nodes``; empty outside Slurm).
        node: this node's name (``multinode.node_name``).
    """
    settings = run.settings
    if settings is None:  # a task without an engine (a Python function): no model, no GPU
        return _engineless_record(job, run, table, history)
    stats = shard_stats(
        job.shard,
        table,
        len(job.done),
        run.counters,
        run.engine_seconds,
        run.generation_seconds,
        time.time() - job.started,
        job.config.model.gpus,
        run.engine_delta,
        job.config.task,
    )
    slurm = job.attempt.slurm
    stats.update(
        fingerprint=job.fingerprint,
        config_fingerprint=job.config.fingerprint,
        feed=run.feed,
        checkpoints_discarded=job.ckpt.discarded,
        engine={
            "vllm_version": vllm_version(),
            "args": settings.kwargs,
            "environment": settings.environment,
            "batch_invariant": bool(settings.model.get("batch_invariant")),
        },
        attempts=[a.as_dict() for a in history],
        memory_failures=memory.failures_of(job.attempts),
        memory_overrides=settings.memory_overrides,
        gpu_devices=settings.gpus,
        gpu_model=", ".join(sorted({g.get("name") or "?" for g in settings.gpus})) or None,
        precision=settings.precision,
        model_source={k: job.model_record.get(k) for k in MODEL_SOURCE_KEYS},
        lora_adapters={
            name: {k: a.get(k) for k in ("source", "path", "repo_id", "commit")}
            for name, a in (job.model_record.get("adapters") or {}).items()
        },
        peak_rss_mib=jobinfo.peak_rss_mib(),
        host=job.attempt.host,
        nodes=job.config.resources.nodes,  # the engine's; gpus and gpu_hours count all of theirs
        node_names=nodes or [job.attempt.host],
        node_gpus={node: settings.gpus, **run.worker_gpus} if run.worker_gpus else None,
        slurm=slurm,
        queue_wait_seconds=slurm.get("queue_wait_seconds"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        thread_env_removed=job.removed_env,
    )
    return stats


def _engineless_record(job: Any, run: Any, table: pa.Table, history: list[records.Attempt]) -> dict[str, Any]:
    """``shard_record`` of a task that runs no engine: its figures (no tokens, no GPU), what decided its
    content, its attempts and where the last ran."""
    stats = shard_stats(job.shard, table, len(job.done), run.counters, 0.0, run.generation_seconds,
                        time.time() - job.started, 0, None, job.config.task)  # fmt: skip
    slurm = job.attempt.slurm
    stats.update(fingerprint=job.fingerprint, config_fingerprint=job.config.fingerprint, feed=run.feed,
                 checkpoints_discarded=job.ckpt.discarded, attempts=[a.as_dict() for a in history],
                 peak_rss_mib=jobinfo.peak_rss_mib(), host=job.attempt.host, nodes=1,
                 node_names=[job.attempt.host], slurm=slurm, queue_wait_seconds=slurm.get("queue_wait_seconds"),
                 thread_env_removed=job.removed_env)  # fmt: skip
    return stats


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
    "requests_reused",
    "requests_deduplicated",
    "prompt_tokens",
    "generated_tokens",
    "reasoning_tokens",
    "output_tokens_per_s",
    "prompt_tokens_per_s",
    "requests_per_s",
    "prefix_cache_hit_rate",
    "ttft_p50_s",
    "latency_p50_s",
    "queue_p50_s",
    "ttft_scheduled_p50_s",
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
    "nodes",
    "node_names",
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
        self.task = "generate"
        self.billed_gpu_hours = 0.0  # every attempt's (shardgen.base.cost)
        self.attempts_unmeasured = 0
        self.function_calls = 0  # a Python step's: the calls of the attempts that committed its shards

    def add(self, s: dict[str, Any]) -> None:
        self.task = s.get("task", "generate")
        if self.task == "function":
            self.function_calls += (s.get("feed") or {}).get("calls") or 0
        for k in SUMMED:
            self.totals[k] += s.get(k) or 0
        earlier, unmeasured = cost.earlier_attempts(s)
        billed = (s.get("gpu_hours") or 0) + earlier
        self.billed_gpu_hours += billed
        self.attempts_unmeasured += unmeasured
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
        self.shards.append({**{k: s.get(k) for k in SHARD_SUMMARY_KEYS}, "billed_gpu_hours": billed})

    def result(self) -> dict[str, Any]:
        totals = dict(self.totals)
        totals["task"] = self.task
        totals["error_reasons"] = self.error_reasons
        generates = TASKS[self.task].generates
        totals.update(summarize(totals, self.hists, generates))
        totals["output_tokens_per_gpu_hour"] = (
            _rate(totals["attempt_generated_tokens"], totals["gpu_hours"]) if generates else None
        )
        totals["rows_per_gpu_hour"] = _rate(totals["attempt_requests"], totals["gpu_hours"])
        totals["billed_gpu_hours"] = self.billed_gpu_hours
        totals["attempts_unmeasured"] = self.attempts_unmeasured
        if self.task == "function":
            totals["function_calls"] = {"shards": self.function_calls}  # merge adds the preflight's
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
    if not TASKS[stats.get("task", "generate")].generates:
        return _pooling_summary_text(stats, hit)
    lines = [
        f"rows            {stats['rows']}  ({stats['errors']} errors"
        + (", " + ", ".join(f"{k}: {v}" for k, v in stats["error_reasons"].items()) if stats["error_reasons"] else "")
        + ")",
        f"shards          {stats['num_shards']}  (rows resumed from checkpoints: {stats['rows_resumed']})",
        f"tokens          {stats['prompt_tokens']} prompt, {stats['generated_tokens']} generated"
        + _reasoning_part(stats),
        f"throughput      {_fmt(stats['output_tokens_per_s'])} output tok/s, "
        f"{_fmt(stats['requests_per_s'], '.2f')} req/s (over {_fmt(stats['generation_seconds'])} s of generation)",
        f"latency         TTFT p50 {_fmt(stats['ttft_p50_s'], '.3f')} s, p90 {_fmt(stats['ttft_p90_s'], '.3f')} s "
        f"(of which queued p50 {_fmt(stats.get('queue_p50_s'), '.3f')} s; from scheduling p50 "
        f"{_fmt(stats.get('ttft_scheduled_p50_s'), '.3f')} s); end-to-end p50 {_fmt(stats['latency_p50_s'], '.3f')} s",
        f"prefix cache    {_fmt(hit if hit is None else 100 * hit)}% of prompt tokens; "
        f"{stats.get('preemptions', 0)} preemptions",
        _reuse_line(stats),
        f"GPU-hours       {stats['gpu_hours']:.4f}  ({_fmt(stats.get('output_tokens_per_gpu_hour'), '.0f')} output "
        "tokens per GPU-hour)",
        f"shards' time    slowest {stats.get('slowest_shard')} {_fmt(stats.get('makespan_seconds'))} s, "
        f"median {_fmt(stats.get('median_shard_seconds'))} s",
    ]
    spec = stats.get("spec_decode")
    if spec:
        lines.append(f"speculation     {_fmt(100 * (spec['acceptance_rate'] or 0))}% of draft tokens accepted")
    return "\n".join(lines + _cost_lines(stats))


def _reuse_line(stats: dict[str, Any]) -> str:
    """Where the rows' results came from this run (engines.store): the engine, the request store, a duplicate."""
    return (f"requests        {stats.get('rows_generated', 0)} rows generated, {stats.get('requests_reused', 0)} "
            f"answered from the request store, {stats.get('requests_deduplicated', 0)} by a duplicate")  # fmt: skip


def _reasoning_part(stats: dict[str, Any]) -> str:
    """How the generated tokens split into reasoning and answers (a run with a reasoning parser)."""
    reasoning = stats.get("reasoning_tokens") or 0
    if not reasoning:
        return ""
    return f" ({reasoning} reasoning, {stats['generated_tokens'] - reasoning} answer)"


def _cost_lines(stats: dict[str, Any]) -> list[str]:
    line = cost.summary_line(stats.get("cost"))
    return [line] if line else []


def _pooling_summary_text(stats: dict[str, Any], hit: float | None) -> str:
    """The summary of a pooling run (classify, reward, embed, score): rows and prompt tokens, no output."""
    reasons = ", ".join(f"{k}: {v}" for k, v in stats["error_reasons"].items())
    return "\n".join([
        f"task            {stats['task']}",
        f"rows            {stats['rows']}  ({stats['errors']} errors" + (f", {reasons}" if reasons else "") + ")",
        f"shards          {stats['num_shards']}  (rows resumed from checkpoints: {stats['rows_resumed']})",
        f"throughput      {_fmt(stats['requests_per_s'], '.2f')} rows/s, {_fmt(stats['prompt_tokens_per_s'])} prompt "
        f"tok/s (over {_fmt(stats['generation_seconds'])} s of pooling; {stats['prompt_tokens']} prompt tokens)",
        f"latency         end-to-end p50 {_fmt(stats['latency_p50_s'], '.3f')} s, p90 "
        f"{_fmt(stats['latency_p90_s'], '.3f')} s",
        f"prefix cache    {_fmt(hit if hit is None else 100 * hit)}% of prompt tokens",
        _reuse_line(stats),
        f"GPU-hours       {stats['gpu_hours']:.4f}  ({_fmt(stats.get('rows_per_gpu_hour'), '.0f')} rows per GPU-hour)",
        *_cost_lines(stats),
    ])  # fmt: skip
