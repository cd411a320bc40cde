"""One shard job: read the shard's rows, render and tokenize prompts, generate, write.

Rows stream from the input; finished rows are flushed to checkpoint parts
every ``checkpoint.rows`` rows or ``checkpoint.seconds`` seconds. A restarted
job resumes from the parts. On SIGTERM/SIGINT (Slurm's time limit, scancel,
Ctrl+C) the job stops adding requests, flushes what is finished and exits
non-zero so that Snakemake retries it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardgen import engine as eng
from shardgen.config import content_config, content_fingerprint, digest, gpus_per_job, warnings
from shardgen.errors import RowError, ShardgenError, error_reason
from shardgen.io import atomic_write_text
from shardgen.outputs import ShardCheckpoint, output_schema
from shardgen.plan import Manifest, Shard
from shardgen.progress import progress_bar
from shardgen.prompts import PromptRenderer
from shardgen.results import ResultSpec, choice_first_tokens
from shardgen.stats import LogHistogram, summarize

log = logging.getLogger(__name__)


class Interrupted(ShardgenError):
    """The job was asked to stop; finished rows are saved."""


class OutOfMemory(ShardgenError):
    """The engine ran out of memory; the next attempt uses lower settings."""


class TooManyErrors(ShardgenError):
    """More than ``errors.max_rate`` of the shard's rows are per-row errors."""


class WrongGpus(ShardgenError):
    """The job got GPUs it cannot run on as configured (too few, or without the precision asked for)."""


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
        reason = error_reason(error)
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
    info: dict[str, Any] = {k: os.environ[v] for k, v in keys.items() if v in os.environ}
    if "job_id" in info:
        info.update(_slurm_times(info["job_id"]))
    return info


def _slurm_times(job_id: str) -> dict[str, Any]:
    """When Slurm queued and started this job, and the wait between (from ``scontrol``; empty if unavailable)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    try:
        submit = datetime.datetime.fromisoformat(fields["SubmitTime"])
        start = datetime.datetime.fromisoformat(fields["StartTime"])
    except (KeyError, ValueError):
        return {}
    return {
        "submit_time": fields["SubmitTime"],
        "start_time": fields["StartTime"],
        "queue_wait_seconds": (start - submit).total_seconds(),
        "time_limit": fields.get("TimeLimit"),
    }


def engine_settings(config: dict[str, Any], model_record: dict[str, Any], failures: int) -> tuple[dict, dict]:
    """The engine's ``model`` settings for this job, and what decided them.

    The model is the local directory the fetch step found (no hub lookup in
    a job); ``auto`` precisions are chosen for the GPUs the job got, which
    are checked against what the config needs; an attempt after running out
    of memory lowers the memory settings; seeded sampling on vLLM's CPU
    build turns chunked prefill off.

    Raises:
        WrongGpus: too few GPUs, or a precision the GPUs cannot run.
    """
    from shardgen import fetch, gpus

    model = config["model"]
    build = eng.vllm_build()
    devices = gpus.describe_gpus()
    hf_config = json.loads((Path(fetch.model_path(model_record)) / "config.json").read_text())
    checkpoint = gpus.checkpoint_quant_method(hf_config)
    precision = gpus.choose_precision(
        devices, model.get("quantization"), model.get("kv_cache_dtype"), checkpoint, build
    )
    settings = {**model, **fetch.engine_model_args(model_record)}
    settings.update(quantization=precision["quantization"], kv_cache_dtype=precision["kv_cache_dtype"])
    problems = gpus.check_gpus(
        devices,
        gpus_per_job(config),
        settings["quantization"] or checkpoint,
        settings["kv_cache_dtype"],
        build,
        from_checkpoint=settings["quantization"] is None,
    )
    if problems:
        raise WrongGpus("this job cannot run on the GPUs it got:\n  - " + "\n  - ".join(problems))
    notes = gpus.gpu_warnings(devices, settings["kv_cache_dtype"], build)
    fp8_kv = eng.fp8_kv_cache_supported(build)
    overrides = eng.lowered_memory_settings(settings, failures, fp8_kv)
    next_overrides = eng.lowered_memory_settings(settings, failures + 1, fp8_kv)
    settings.update(overrides)
    if (
        build == "cpu"
        and config["sampling"].get("seed") is not None
        and settings.get("enable_chunked_prefill") is not False
    ):
        settings["enable_chunked_prefill"] = False
        # without chunking, a step must hold a whole prompt
        if settings.get("max_num_batched_tokens") and settings.get("max_model_len"):
            settings["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], settings["max_model_len"])
        notes.append(
            "sampling.seed on vLLM's CPU build: chunked prefill is off (PyTorch's CPU generator cannot rewind "
            "the sample of a partly prefilled prompt, and the engine would fail)"
        )
    info = {
        "gpus": devices,
        "build": build,
        "precision": precision,
        "memory_overrides": overrides,
        "next_memory_overrides": next_overrides,
        "notes": notes,
    }
    return settings, info


class SharedEngine:
    """One engine for several shards of a job (``shards.per_job``): the first shard that needs it
    starts it (and counts its start time), the others reuse it; ``close`` stops it.

    Args:
        llm: an engine already running, which ``close`` leaves running (tests).
    """

    def __init__(self, llm: Any = None) -> None:
        self.llm = llm
        self._owned = llm is None

    def get(self, model_cfg: dict[str, Any]) -> Any:
        if self.llm is None:
            self.llm = eng.make_llm(model_cfg)
        return self.llm

    def close(self) -> None:
        if self.llm is not None and self._owned:
            eng.shutdown(self.llm)
        self.llm = None


def committed(config: dict[str, Any], manifest: Manifest, shard: Shard, shard_dir: Path) -> bool:
    """Whether the shard's file and stats are already there, made with this config and input."""
    import pyarrow.parquet as pq

    from shardgen.outputs import FINGERPRINT_KEY

    path = shard_dir / f"{shard.id}.parquet"
    if not path.exists() or not (shard_dir / f"{shard.id}.stats.json").exists():
        return False
    meta = pq.read_schema(path).metadata or {}
    return meta.get(FINGERPRINT_KEY, b"").decode() == shard_fingerprint(config, manifest, shard)


def run_shards(
    config: dict[str, Any],
    manifest_path: str | Path,
    shard_ids: list[str],
    shard_dir: str | Path,
    model_record: dict[str, Any] | None = None,
    engine: SharedEngine | None = None,
) -> list[dict[str, Any]]:
    """Several shards in one job with one engine start, each as ``run_shard`` does it.

    A shard already committed with this config and input is kept: a retry of
    a job that died after some of its shards goes on with the rest.
    Returns the stats of the shards generated now.
    """
    manifest = Manifest.load(manifest_path)
    shard_dir = Path(shard_dir)
    engine = engine or SharedEngine()
    done = []
    try:
        for shard_id in shard_ids:
            if committed(config, manifest, manifest.shard(shard_id), shard_dir):
                log.info("shard %s: already committed with this configuration; kept", shard_id)
                continue
            out, stats = shard_dir / f"{shard_id}.parquet", shard_dir / f"{shard_id}.stats.json"
            done.append(run_shard(config, manifest_path, shard_id, out, stats, engine, model_record))
    finally:
        engine.close()
    return done


def run_shard(
    config: dict[str, Any],
    manifest_path: str | Path,
    shard_id: str,
    output: str | Path,
    stats_path: str | Path,
    llm: Any = None,
    model_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Generate one shard and commit its output and stats. Returns the stats.

    Args:
        llm: an engine to use instead of starting one from ``config["model"]``
            (tests share one across shards).
        model_record: where the fetch step found the model (``fetch.resolve_model``);
            when None, it is looked up on the local disk only.

    Raises:
        Interrupted: SIGTERM or SIGINT arrived; finished rows are saved.
    """
    with _StopFlag() as stop:
        return _run_shard(config, manifest_path, shard_id, output, stats_path, llm, model_record, stop)


def _run_shard(config, manifest_path, shard_id, output, stats_path, llm, model_record, stop) -> dict[str, Any]:
    from shardgen import fetch

    t_start = time.time()
    removed_env = eng.clear_thread_env()
    if model_record is None:
        model_record = fetch.resolve_model(config["model"], allow_download=False)
    os.environ.update(fetch.job_environment(model_record))

    manifest = Manifest.load(manifest_path)
    shard = manifest.shard(shard_id)
    source = manifest.source()
    renderer = PromptRenderer.from_config(config["prompt"])
    spec = ResultSpec(config["sampling"], config["output"])
    fingerprint = shard_fingerprint(config, manifest, shard)
    config_fp = content_fingerprint(config)
    schema = output_schema(source.schema, fingerprint, config_fp, shard.id, spec.fields(), spec.rows_per_input)
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
    engine_delta: dict[str, float] = {}
    failures_file = ckpt.dir / MEMORY_FAILURES
    failures = json.loads(failures_file.read_text()) if failures_file.exists() else []
    model_cfg, setup = engine_settings(config, model_record, len(failures))
    log.info("shard %s: %d GPU(s) %s; precision: %s", shard.id, len(setup["gpus"]),
             [g.get("name") for g in setup["gpus"]], setup["precision"]["reason"])  # fmt: skip
    for note in setup["notes"]:
        log.warning("shard %s: %s", shard.id, note)
    if setup["memory_overrides"]:
        log.warning(
            "shard %s: %d earlier attempt(s) ran out of memory; now %s",
            shard.id,
            len(failures),
            setup["memory_overrides"],
        )
    if len(done) < shard.rows:
        t0 = time.time()
        own_engine = llm is None
        try:
            if own_engine:
                llm = eng.make_llm(model_cfg)
            elif isinstance(llm, SharedEngine):
                llm = llm.get(model_cfg)  # started by the job's first shard that needs it
        except Exception as e:
            _record_if_memory(e, "engine start", failures, failures_file, model_cfg, setup["next_memory_overrides"])
            raise
        engine_start_s = time.time() - t0
        try:
            tokenizer = eng.Tokenizer(llm.get_tokenizer(), llm.llm_engine.model_config.max_model_len)
            if spec.choice_probs:
                spec = ResultSpec(
                    config["sampling"], config["output"], choice_first_tokens(tokenizer.hf, spec.choices or [])
                )
            feeder = eng.Feeder(llm, eng.make_sampling_params(config["sampling"], spec.choice_token_ids))
            requests = _Requests(config, renderer, tokenizer, feeder)
            before = eng.engine_counters(llm)
            t1 = time.time()
            try:
                _generate(source, shard, done, requests, spec, feeder, ckpt, ckpt_cfg, counters, budget, stop)
            except Exception as e:
                _record_if_memory(e, "generation", failures, failures_file, model_cfg, setup["next_memory_overrides"])
                raise
            finally:
                generation_s = time.time() - t1
                after = eng.engine_counters(llm)
                engine_delta = {k: after[k] - before.get(k, 0) for k in after}
                feed_stats = {
                    "steps": feeder.stats.steps,
                    "max_in_flight": feeder.stats.max_in_flight,
                    "steps_short": feeder.stats.steps_short,
                    "window": feeder.window,
                    "order": config["prompt"]["order"],
                }
        finally:
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
    stats.update(_engine_stats(engine_delta))
    slurm = _slurm_info()
    stats.update(
        fingerprint=fingerprint,
        config_fingerprint=config_fp,
        feed=feed_stats,
        checkpoints_discarded=ckpt.discarded,
        engine={"vllm_version": eng.vllm_version(), "args": eng.engine_kwargs(model_cfg)},
        memory_failures=failures,
        memory_overrides=setup["memory_overrides"],
        gpu_devices=setup["gpus"],
        gpu_model=", ".join(sorted({g.get("name") or "?" for g in setup["gpus"]})) or None,
        precision=setup["precision"],
        model_source={k: model_record.get(k) for k in ("source", "path", "repo_id", "revision", "commit")},
        peak_rss_mib=_peak_rss_mib(),
        host=socket.gethostname(),
        slurm=slurm,
        queue_wait_seconds=slurm.get("queue_wait_seconds"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        thread_env_removed=removed_env,
    )
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    return stats


def _engine_stats(delta: dict[str, float]) -> dict[str, Any]:
    """Preemptions and speculative decoding from the engine's counters over this attempt."""
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


def _peak_rss_mib() -> float:
    """The largest resident memory of this process and of its finished children (the engine's), in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024, 1)


def _record_if_memory(error: Exception, stage: str, failures: list, path: Path, model_cfg: dict, nxt: dict) -> None:
    """When ``error`` was memory running out, record it for the next attempt and say so."""
    text = "".join(traceback.format_exception(error)) + _own_log_tail()
    if not eng.is_memory_error(text):
        return
    settings = {k: model_cfg.get(k) for k in ("max_num_seqs", "gpu_memory_utilization", "kv_cache_dtype")}
    failures.append({"stage": stage, "error": f"{type(error).__name__}: {error}"[:500], "settings": settings})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(failures, indent=1) + "\n")
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


class _Requests:
    """A shard's rows as engine requests: rendered, tokenized, seeded, in submission order.

    With ``prompt.order: prefix``, each block of upcoming rows is sorted by
    prompt tokens, so that prompts sharing a prefix are submitted together
    and hit the prefix cache before it is evicted. A block is several times
    the feed's window, so the engine's queue stays full while the next block
    is prepared. Rows that cannot become a prompt come out at once, as errors.
    """

    def __init__(self, config: dict[str, Any], renderer: PromptRenderer, tokenizer: eng.Tokenizer, feeder) -> None:
        self.renderer, self.tokenizer = renderer, tokenizer
        self.sorted = config["prompt"]["order"] == "prefix"
        self.block = max(4 * feeder.window, 1024)
        self.seed = config["sampling"].get("seed")
        self.id_column = config["input"].get("id_column")
        self.params = feeder.params

    def _request(self, index: int, row: dict[str, Any]) -> eng.Request:
        ids = self.tokenizer.encode(self.renderer.render(row))
        params = None
        if self.seed is not None:
            key = row[self.id_column] if self.id_column else index
            params = eng.with_seed(self.params, eng.row_seed(self.seed, key))
        return eng.Request(index, ids, params)

    def __call__(self, rows: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any], Any]]:
        """``(index, row, request)`` per row, or ``(index, row, RowError)`` for a row that cannot be a prompt."""
        block: list[tuple[int, dict[str, Any], eng.Request]] = []
        for index, row in rows:
            try:
                block.append((index, row, self._request(index, row)))
            except RowError as e:
                yield index, row, e
                continue
            if len(block) >= self.block:
                yield from self._release(block)
                block = []
        yield from self._release(block)

    def _release(self, block: list[tuple[int, dict[str, Any], eng.Request]]) -> list:
        if self.sorted:
            block.sort(key=lambda item: item[2].prompt_token_ids)
        return block


def _generate(source, shard, done, requests, spec, feeder, ckpt, ckpt_cfg, counters, budget, stop) -> None:
    pending: dict[int, dict[str, Any]] = {}
    finished: list[dict[str, Any]] = []
    last_flush = time.time()
    bar = progress_bar(total=shard.rows, initial=len(done), desc=f"shard {shard.id}")

    def feed() -> Iterator[eng.Request]:
        for index, row, item in requests(_rows(source, shard, done)):
            if isinstance(item, RowError):
                finished.extend(spec.error_rows(row, index, str(item)))
                bar.update(1)
                budget.add(index, str(item))
                continue
            pending[index] = row
            yield item

    def flush() -> None:
        nonlocal last_flush
        ckpt.flush(finished)
        finished.clear()
        last_flush = time.time()

    try:
        for c in feeder.run(feed(), should_stop=stop):
            row = pending.pop(c.key)
            if c.error is not None:
                finished.extend(spec.error_rows(row, c.key, str(c.error), c.prompt_tokens))
                budget.add(c.key, str(c.error))
            else:
                rows = spec.rows(row, c.key, c.prompt_tokens, c.samples)
                finished.extend(rows)
                error = next((r["error"] for r in rows if r["error"]), None)
                if error is not None:
                    budget.add(c.key, error)
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


def _column_sum(table: pa.Table, name: str) -> int:
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


def _shard_stats(config, shard, table: pa.Table, resumed: int, c: _Counters, engine_s, gen_s, wall_s) -> dict:
    reasons = error_reasons(table)
    gpus = gpus_per_job(config)
    counters = {
        "rows": shard.rows,
        "output_rows": table.num_rows,
        "errors": sum(reasons.values()),
        "rows_resumed": resumed,
        "rows_generated": shard.rows - resumed,
        "prompt_tokens": _column_sum(table, "prompt_tokens"),
        "generated_tokens": _column_sum(table, "generated_tokens"),
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


def main_generate(config, manifest, shards, output, stats, model_record=None, shard_dir=None, record=None) -> int:
    """One shard (``output``, ``stats``) or several in one job (``shard_dir``, and a job ``record``)."""
    from shardgen.fetch import load_record

    model = load_record(model_record) if model_record else None
    job = os.environ.get("SLURM_JOB_ID")
    log.info("start on %s%s (pid %d)", socket.gethostname(), f", Slurm job {job}" if job else "", os.getpid())
    try:
        if shard_dir is None:
            (shard,) = shards
            done = [run_shard(config, manifest, shard, output, stats, model_record=model)]
        else:
            done = run_shards(config, manifest, shards, shard_dir, model)
    except Interrupted as e:
        print(f"shardgen: {e}", file=sys.stderr)
        return 3
    for s in done:
        print(
            f"shard {s['shard']}: {s['rows']} rows ({s['errors']} errors, {s['rows_resumed']} resumed), "
            f"{s['output_tokens_per_s'] or 0:.1f} output tok/s",
            file=sys.stderr,
        )
    if record is not None:
        atomic_write_text(record, json.dumps({"shards": shards, "generated_now": [s["shard"] for s in done]}) + "\n")
    return 0
