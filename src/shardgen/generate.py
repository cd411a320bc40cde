"""One shard job: read the shard's rows, render and tokenize prompts, generate, write.

Rows stream from the input; finished rows are flushed to checkpoint parts
every ``checkpoint.rows`` rows or ``checkpoint.seconds`` seconds. A restarted
job resumes from the parts. On SIGTERM/SIGINT (Slurm's time limit, scancel,
Ctrl+C) the job stops adding requests, flushes what is finished and exits
non-zero so that Snakemake retries it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from shardgen import engine as eng
from shardgen.config import content_config, content_fingerprint, digest, gpus_per_job, warnings
from shardgen.errors import RowError, ShardgenError
from shardgen.io import atomic_write_text
from shardgen.outputs import ShardCheckpoint, output_schema
from shardgen.plan import Manifest, Shard
from shardgen.progress import progress_bar
from shardgen.prompts import PromptRenderer
from shardgen.stats import LogHistogram, summarize

log = logging.getLogger(__name__)


class Interrupted(ShardgenError):
    """The job was asked to stop; finished rows are saved."""


class OutOfMemory(ShardgenError):
    """The engine ran out of memory; the next attempt uses lower settings."""


class TooManyErrors(ShardgenError):
    """More than ``errors.max_rate`` of the shard's rows are per-row errors."""


class ErrorBudget:
    """Counts per-row errors and fails the shard as soon as the final rate must exceed ``max_rate``.

    With ``rows`` rows in the shard, more than ``floor(max_rate * rows)`` errors
    means the rate is above the limit whatever the remaining rows give, so the
    shard stops there instead of spending GPU time on a lost cause.
    """

    def __init__(self, shard_id: str, rows: int, max_rate: float, errors: int = 0, first: str | None = None) -> None:
        self.shard_id, self.rows, self.max_rate = shard_id, rows, max_rate
        self.limit = int(max_rate * rows)
        self.errors = errors
        self.reasons: dict[str, int] = {}
        self.first = first
        self.check()

    def add(self, index: int, error: str) -> None:
        self.errors += 1
        reason = error.split(":", 1)[0]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.first is None:
            self.first = f"row {index}: {error}"
        self.check()

    def check(self) -> None:
        if self.errors > self.limit:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items()))
            raise TooManyErrors(
                f"shard {self.shard_id}: {self.errors} of its {self.rows} rows are errors, more than "
                f"errors.max_rate {self.max_rate} allows ({self.limit})"
                + (f" [{reasons}]" if reasons else "")
                + f"; first: {self.first}. Fix the input or prompt.template (or raise errors.max_rate); "
                "finished rows are kept for the next attempt"
            )


MEMORY_FAILURES = "memory_failures.json"


def _own_log_tail(limit: int = 200_000) -> str:
    """The end of this process's stderr when it is a file (the job's log).

    vLLM's engine core runs in a child process that writes the real cause of
    a failed start there; the parent only sees "initialization failed".
    """
    try:
        path = os.readlink("/proc/self/fd/2")
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def shard_fingerprint(config: dict[str, Any], manifest: Manifest, shard: Shard) -> str:
    """Everything that decides the shard's content: its input rows and the content config."""
    src = manifest.data["source"]
    if src["kind"] == "parquet":
        files = [
            {k: src["files"][s.file][k] for k in ("path", "size", "mtime_ns")} | {"start": s.start, "stop": s.stop}
            for s in shard.segments
        ]
        inputs: Any = files
    else:
        inputs = {"fingerprint": src["fingerprint"], "start": shard.start, "stop": shard.stop}
    return digest({"config": content_config(config), "rows": inputs})


@dataclass
class _Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    latency: LogHistogram = field(default_factory=LogHistogram)


class _StopFlag:
    """Set by SIGTERM/SIGINT while installed; the feed loop polls it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self) -> bool:
        return self.signal is not None

    def _handler(self, signum, _frame) -> None:
        if self.signal is None:
            log.warning("received %s: stopping after saving finished rows", signal.Signals(signum).name)
        self.signal = signum

    def __enter__(self) -> _StopFlag:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def _slurm_info() -> dict[str, Any]:
    keys = {
        "job_id": "SLURM_JOB_ID",
        "array_task_id": "SLURM_ARRAY_TASK_ID",
        "restart_count": "SLURM_RESTART_COUNT",
        "partition": "SLURM_JOB_PARTITION",
        "nodelist": "SLURM_JOB_NODELIST",
        "gpus_on_node": "SLURM_GPUS_ON_NODE",
    }
    return {k: os.environ[v] for k, v in keys.items() if v in os.environ}


def _result(row: dict[str, Any], index: int, **fields: Any) -> dict[str, Any]:
    out = dict(row)
    out.update(
        row_index=index,
        generation=None,
        finish_reason=None,
        prompt_tokens=None,
        generated_tokens=None,
        error=None,
    )
    out.update(fields)
    return out


def run_shard(
    config: dict[str, Any],
    manifest_path: str | Path,
    shard_id: str,
    output: str | Path,
    stats_path: str | Path,
    llm: Any = None,
) -> dict[str, Any]:
    """Generate one shard and commit its output and stats. Returns the stats.

    Args:
        llm: an engine to use instead of starting one from ``config["model"]``
            (tests share one across shards).

    Raises:
        Interrupted: SIGTERM or SIGINT arrived; finished rows are saved.
    """
    with _StopFlag() as stop:
        return _run_shard(config, manifest_path, shard_id, output, stats_path, llm, stop)


def _run_shard(config, manifest_path, shard_id, output, stats_path, llm, stop: _StopFlag) -> dict[str, Any]:
    t_start = time.time()
    removed_env = eng.clear_thread_env()

    manifest = Manifest.load(manifest_path)
    shard = manifest.shard(shard_id)
    source = manifest.source()
    prompt_cfg = config["prompt"]
    renderer = PromptRenderer(prompt_cfg["template"], prompt_cfg.get("system"), prompt_cfg["chat"])
    fingerprint = shard_fingerprint(config, manifest, shard)
    config_fp = content_fingerprint(config)
    schema = output_schema(source.schema, fingerprint, config_fp, shard.id)
    ckpt_cfg = config["checkpoint"]
    ckpt = ShardCheckpoint(Path(config["output"]["dir"]) / "checkpoints" / shard.id, shard.start, shard.stop, schema)
    done = ckpt.resume()
    log.info("shard %s: rows [%d, %d), %d already done in checkpoints", shard.id, shard.start, shard.stop, len(done))
    # Before any engine starts: the input is as planned, and the rows kept
    # from earlier attempts do not already fail the shard.
    source.check_unchanged({seg.file for seg in shard.segments})
    budget = ErrorBudget(shard.id, shard.rows, config["errors"]["max_rate"], ckpt.resumed_errors, ckpt.first_error)
    for warning in warnings(config):
        log.warning(warning)

    counters = _Counters()
    engine_start_s = generation_s = 0.0
    feed_stats: dict[str, Any] = {}
    failures_file = ckpt.dir / MEMORY_FAILURES
    failures = json.loads(failures_file.read_text()) if failures_file.exists() else []
    overrides = eng.lowered_memory_settings(config["model"], len(failures))
    model_cfg = {**config["model"], **overrides}
    if overrides:
        log.warning("shard %s: %d earlier attempt(s) ran out of memory; now %s", shard.id, len(failures), overrides)
    if len(done) < shard.rows:
        t0 = time.time()
        own_engine = llm is None
        try:
            if own_engine:
                llm = eng.make_llm(model_cfg)
        except Exception as e:
            _record_if_memory(e, "engine start", failures, failures_file, config["model"], model_cfg)
            raise
        engine_start_s = time.time() - t0
        tokenizer = eng.Tokenizer(llm.get_tokenizer(), llm.llm_engine.model_config.max_model_len)
        feeder = eng.Feeder(llm, eng.make_sampling_params(config["sampling"]))
        t1 = time.time()
        try:
            _generate(source, shard, done, renderer, tokenizer, feeder, ckpt, ckpt_cfg, counters, budget, stop)
        except Exception as e:
            _record_if_memory(e, "generation", failures, failures_file, config["model"], model_cfg)
            raise
        finally:
            generation_s = time.time() - t1
            feed_stats = {
                "steps": feeder.stats.steps,
                "max_in_flight": feeder.stats.max_in_flight,
                "window": feeder.window,
            }
            if own_engine:
                eng.shutdown(llm)
        if stop():
            raise Interrupted(
                f"shard {shard.id}: stopped by {signal.Signals(stop.signal).name}; "
                "finished rows are saved and the next attempt resumes from them"
            )

    table = ckpt.commit(output)
    wall_s = time.time() - t_start
    stats = _shard_stats(config, shard, table, len(done), counters, engine_start_s, generation_s, wall_s)
    stats.update(
        fingerprint=fingerprint,
        config_fingerprint=config_fp,
        feed=feed_stats,
        checkpoints_discarded=ckpt.discarded,
        engine={"vllm_version": eng.vllm_version(), "args": eng.engine_kwargs(model_cfg)},
        memory_failures=failures,
        memory_overrides=overrides,
        host=socket.gethostname(),
        slurm=_slurm_info(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        thread_env_removed=removed_env,
    )
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    return stats


def _record_if_memory(
    error: Exception, stage: str, failures: list, path: Path, base_cfg: dict, model_cfg: dict
) -> None:
    """When ``error`` was memory running out, record it for the next attempt and say so."""
    text = "".join(traceback.format_exception(error)) + _own_log_tail()
    if not eng.is_memory_error(text):
        return
    settings = {k: model_cfg.get(k) for k in ("max_num_seqs", "gpu_memory_utilization", "kv_cache_dtype")}
    failures.append({"stage": stage, "error": f"{type(error).__name__}: {error}"[:500], "settings": settings})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(failures, indent=1) + "\n")
    nxt = eng.lowered_memory_settings(base_cfg, len(failures))
    raise OutOfMemory(
        f"out of memory during {stage} with {settings}; the next attempt uses {nxt}. "
        "If it keeps failing: lower model.max_model_len, then max_num_seqs, or use more GPUs."
    ) from error


def _rows(source: Any, shard: Shard, done: set[int]) -> Iterator[tuple[int, dict[str, Any]]]:
    index = shard.start
    for batch in source.read(shard.segments):
        for row in batch.to_pylist():
            if index not in done:
                yield index, row
            index += 1


def _generate(source, shard, done, renderer, tokenizer, feeder, ckpt, ckpt_cfg, counters, budget, stop) -> None:
    pending: dict[int, dict[str, Any]] = {}
    finished: list[dict[str, Any]] = []
    last_flush = time.time()
    bar = progress_bar(total=shard.rows, initial=len(done), desc=f"shard {shard.id}")

    def requests() -> Iterator[eng.Request]:
        for index, row in _rows(source, shard, done):
            try:
                ids = tokenizer.encode(renderer.render(row))
            except RowError as e:
                finished.append(_result(row, index, error=str(e)))
                bar.update(1)
                budget.add(index, str(e))
                continue
            pending[index] = row
            yield eng.Request(index, ids)

    def flush() -> None:
        nonlocal last_flush
        ckpt.flush(finished)
        finished.clear()
        last_flush = time.time()

    try:
        for c in feeder.run(requests(), should_stop=stop):
            row = pending.pop(c.key)
            if c.error is not None:
                finished.append(_result(row, c.key, prompt_tokens=c.prompt_tokens, error=str(c.error)))
                budget.add(c.key, str(c.error))
            else:
                finished.append(
                    _result(
                        row,
                        c.key,
                        generation=c.text,
                        finish_reason=c.finish_reason,
                        prompt_tokens=c.prompt_tokens,
                        generated_tokens=c.generated_tokens,
                    )
                )
                counters.requests += 1
                counters.prompt_tokens += c.prompt_tokens
                counters.cached_tokens += c.cached_tokens
                counters.generated_tokens += c.generated_tokens
                if c.ttft_s is not None:
                    counters.ttft.add(c.ttft_s)
                if c.latency_s is not None:
                    counters.latency.add(c.latency_s)
                bar.update(1, tokens=c.generated_tokens)
            if len(finished) >= ckpt_cfg["rows"] or time.time() - last_flush >= ckpt_cfg["seconds"]:
                flush()
    finally:
        flush()
        bar.close()


def _shard_stats(config, shard, table: pa.Table, resumed: int, c: _Counters, engine_s, gen_s, wall_s) -> dict:
    errors = table.column("error").to_pylist()
    reasons: dict[str, int] = {}
    for e in errors:
        if e is not None:
            reason = e.split(":", 1)[0]
            reasons[reason] = reasons.get(reason, 0) + 1
    gpus = gpus_per_job(config)
    counters = {
        "rows": table.num_rows,
        "errors": sum(reasons.values()),
        "rows_resumed": resumed,
        "rows_generated": table.num_rows - resumed,
        "prompt_tokens": int(pa.compute.sum(table.column("prompt_tokens")).as_py() or 0),
        "generated_tokens": int(pa.compute.sum(table.column("generated_tokens")).as_py() or 0),
        # This attempt's engine work, which throughput is measured over.
        "attempt_requests": c.requests,
        "attempt_prompt_tokens": c.prompt_tokens,
        "attempt_generated_tokens": c.generated_tokens,
        "cached_prompt_tokens": c.cached_tokens,
        "engine_start_seconds": round(engine_s, 3),
        "generation_seconds": round(gen_s, 3),
        "wall_seconds": round(wall_s, 3),
        "gpus": gpus,
        "gpu_hours": wall_s * gpus / 3600,
    }
    hists = {"ttft_s": c.ttft, "latency_s": c.latency}
    return {
        "shard": shard.id,
        "row_start": shard.start,
        "row_stop": shard.stop,
        **counters,
        "error_reasons": reasons,
        **summarize(counters, hists),
        "histograms": {k: h.to_json() for k, h in hists.items()},
    }


def main_generate(config, manifest, shard, output, stats) -> int:
    try:
        s = run_shard(config, manifest, shard, output, stats)
    except Interrupted as e:
        print(f"shardgen: {e}", file=sys.stderr)
        return 3
    print(
        f"shard {s['shard']}: {s['rows']} rows ({s['errors']} errors, {s['rows_resumed']} resumed), "
        f"{s['output_tokens_per_s'] or 0:.1f} output tok/s",
        file=sys.stderr,
    )
    return 0
