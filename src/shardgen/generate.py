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
import signal
import socket
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
from shardgen import jobinfo, memory
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
    """The job was asked to stop (SIGTERM, SIGINT); finished rows are saved."""

    def __init__(self, signum: int, shard_id: str) -> None:
        self.signal_name = signal.Signals(signum).name
        super().__init__(
            f"shard {shard_id}: stopped by {self.signal_name}; finished rows are saved and the next attempt "
            "resumes from them"
        )


class OutOfMemory(ShardgenError):
    """The engine ran out of memory; the next attempt uses lower settings.

    ``record``: the stage, the error and the settings, kept in the attempt's entry of ``attempts.jsonl``.
    """

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


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


# How often a running shard rewrites its progress.json (what `shardgen status` and the tests read).
PROGRESS_SECONDS = 5.0


@dataclass
class _Counters:
    rows: int = 0  # input rows this attempt finished (generated or errors)
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

    def caused(self, error: Exception, grace_s: float = 2.0) -> bool:
        """Whether ``error`` is the signal's doing: Slurm signals every process of a job (scancel, the time
        limit), so vLLM's engine core gets the SIGTERM too and may die before this process's handler
        has run; the engine's death is then the stop, not a failure (seen on the local Slurm)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        deadline = time.time() + grace_s
        while self.signal is None and isinstance(error, EngineDeadError) and time.time() < deadline:
            time.sleep(0.05)  # the handler runs on this thread, between these sleeps
        return self.signal is not None


def engine_settings(
    config: dict[str, Any], model_record: dict[str, Any], failures: list[dict[str, Any]]
) -> tuple[dict, dict]:
    """The engine's ``model`` settings for this job, and what decided them.

    The model is the local directory the fetch step found (no hub lookup in
    a job); ``auto`` precisions are chosen for the GPUs the job got, which
    are checked against what the config needs; an attempt after earlier ones
    ran out of memory (``failures``) takes one step from the settings they
    used (``memory.overrides``); seeded sampling on vLLM's CPU build turns
    chunked prefill off.

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
    overrides = memory.overrides(failures)
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
        "memory_defaults": memory.vllm_defaults(devices, gpus_per_job(config)),
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
    out_dir = Path(config["output"]["dir"])
    ckpt = ShardCheckpoint(out_dir / "checkpoints" / shard.id, shard.start, shard.stop, schema, below=out_dir)
    done = ckpt.resume()
    log.info("shard %s: rows [%d, %d), %d already done in checkpoints", shard.id, shard.start, shard.stop, len(done))
    attempts = ckpt.attempts()
    slurm = jobinfo.slurm_info()
    attempt = {"attempt": len(attempts) + 1, "started": _now(), "host": jobinfo.host(), "pid": os.getpid()}
    attempt.update(slurm=slurm, rows_done_before=len(done))
    ckpt.log_attempt({"event": "start", **attempt})
    counters = _Counters()
    try:
        table, engine_s, gen_s, stats = _attempt(
            config, shard, source, renderer, spec, ckpt, done, attempts, model_record, counters, llm, stop, output
        )
    except BaseException as e:
        end = {"event": "end", **_outcome(e), "ended": _now()}
        end.update(rows_saved=ckpt.saved_inputs, rows_generated=counters.rows)
        ckpt.log_attempt(end)
        ckpt.close()
        raise
    wall_s = time.time() - t_start
    stats = {**_shard_stats(config, shard, table, len(done), counters, engine_s, gen_s, wall_s), **stats}
    stats.update(
        fingerprint=fingerprint,
        config_fingerprint=config_fp,
        checkpoints_discarded=ckpt.discarded,
        model_source={k: model_record.get(k) for k in ("source", "path", "repo_id", "revision", "commit")},
        peak_rss_mib=jobinfo.peak_rss_mib(),
        host=attempt["host"],
        slurm=slurm,
        queue_wait_seconds=slurm.get("queue_wait_seconds"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        thread_env_removed=removed_env,
    )
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n", below=out_dir)
    return stats


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _outcome(error: BaseException) -> dict[str, Any]:
    """How an attempt ended, for its entry in ``attempts.jsonl``."""
    if isinstance(error, Interrupted):
        return {"outcome": "interrupted", "signal": error.signal_name}
    if isinstance(error, OutOfMemory):
        return {"outcome": "out_of_memory", **error.record}
    kind = {TooManyErrors: "too_many_errors", WrongGpus: "wrong_gpus"}.get(type(error), "failed")
    return {"outcome": kind, "error": f"{type(error).__name__}: {error}"[:1000]}


def _attempt(config, shard, source, renderer, spec, ckpt, done, attempts, model_record, counters, llm, stop, output):
    """The part of an attempt after its start is recorded: checks, the engine, the feed, the commit."""
    # Before any engine starts: the input is as planned, and the rows kept
    # from earlier attempts do not already fail the shard.
    source.check_unchanged({seg.file for seg in shard.segments})
    budget = ErrorBudget(shard.id, shard.rows, config["errors"]["max_rate"], ckpt.resumed_errors, ckpt.first_error)
    for warning in warnings(config):
        log.warning(warning)

    engine_start_s = generation_s = 0.0
    feed_stats: dict[str, Any] = {}
    engine_delta: dict[str, float] = {}
    failures = [
        {k: a.get(k) for k in ("kind", "stage", "error", "settings")}
        for a in attempts
        if a["outcome"] == "out_of_memory"
    ]
    model_cfg, setup = engine_settings(config, model_record, failures)
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
    log_start = jobinfo.own_log_size()  # what this attempt writes to the job's log comes after
    progress = {"attempt": len(attempts) + 1, "host": jobinfo.host(), "pid": os.getpid()}
    progress["job_id"] = os.environ.get("SLURM_JOB_ID")
    if len(done) < shard.rows:
        t0 = time.time()
        own_engine = llm is None
        try:
            if own_engine:
                llm = eng.make_llm(model_cfg)
            elif isinstance(llm, SharedEngine):
                llm = llm.get(model_cfg)  # started by the job's first shard that needs it
        except Exception as e:
            _raise_if_memory(e, "engine start", memory.used_settings(model_cfg, setup["memory_defaults"]), log_start)
            raise
        engine_start_s = time.time() - t0
        try:
            tokenizer = eng.Tokenizer(llm.get_tokenizer(), llm.llm_engine.model_config.max_model_len)
            renderer.max_chars = tokenizer.max_prompt_chars
            if spec.choice_probs:
                spec = ResultSpec(
                    config["sampling"], config["output"], choice_first_tokens(tokenizer.hf, spec.choices or [])
                )
            feeder = eng.Feeder(llm, eng.make_sampling_params(config["sampling"], spec.choice_token_ids))
            requests = _Requests(config, renderer, tokenizer, feeder)
            before = eng.engine_counters(llm)
            t1 = time.time()
            try:
                _generate(source, shard, done, requests, spec, feeder, ckpt, config["checkpoint"], counters, budget,
                          stop, progress)  # fmt: skip
            except Exception as e:
                if stop.caused(e):
                    raise Interrupted(stop.signal, shard.id) from e
                used = memory.used_settings(model_cfg, setup["memory_defaults"], llm)
                _raise_if_memory(e, "generation", used, log_start)
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
            raise Interrupted(stop.signal, shard.id)

    history = ckpt.attempts()
    history[-1].update(outcome="committed", ended=_now(), rows_generated=counters.rows)
    table = ckpt.commit(output)
    stats = _engine_stats(engine_delta)
    stats.update(
        feed=feed_stats,
        engine={"vllm_version": eng.vllm_version(), "args": eng.engine_kwargs(model_cfg)},
        attempts=history,
        memory_failures=failures,
        memory_overrides=setup["memory_overrides"],
        gpu_devices=setup["gpus"],
        gpu_model=", ".join(sorted({g.get("name") or "?" for g in setup["gpus"]})) or None,
        precision=setup["precision"],
    )
    return table, engine_start_s, generation_s, stats


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


def _raise_if_memory(error: Exception, stage: str, used: dict[str, Any], log_start: int) -> None:
    """When ``error`` was memory running out, raise ``OutOfMemory``: the attempt's record keeps the
    kind of failure and the settings it used, from which the next attempt takes one step."""
    # the engine core runs in a child process, which writes the real cause to the job's log
    text = "".join(traceback.format_exception(error)) + jobinfo.own_log_tail(since=log_start)
    kind = memory.failure_kind(text)
    if kind is None:
        return
    record = {"kind": kind, "stage": stage, "error": f"{type(error).__name__}: {error}"[:500], "settings": used}
    raise OutOfMemory(
        f"{kind.replace('_', ' ')} during {stage} with {used}; the next attempt uses "
        f"{memory.next_settings(kind, used)}. If it keeps failing: {memory.advice(kind)}",
        record,
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


def _generate(source, shard, done, requests, spec, feeder, ckpt, ckpt_cfg, counters, budget, stop, progress) -> None:
    pending: dict[int, dict[str, Any]] = {}
    finished: list[dict[str, Any]] = []
    last_flush = last_progress = time.time()
    bar = progress_bar(total=shard.rows, initial=len(done), desc=f"shard {shard.id}")

    def feed() -> Iterator[eng.Request]:
        for index, row, item in requests(_rows(source, shard, done)):
            if isinstance(item, RowError):
                finished.extend(spec.error_rows(row, index, str(item)))
                counters.rows += 1
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

    def report_progress(now: float) -> None:
        nonlocal last_progress
        last_progress = now
        done_now = len(done) + counters.rows
        ckpt.write_progress({**progress, "time": now, "rows": shard.rows, "done": done_now, "saved": ckpt.saved_inputs})

    report_progress(time.time())
    try:
        for c in feeder.run(feed(), should_stop=stop):
            counters.rows += 1
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
            now = time.time()
            if len(finished) >= ckpt_cfg["rows"] or now - last_flush >= ckpt_cfg["seconds"]:
                flush()
            if now - last_progress >= PROGRESS_SECONDS:
                report_progress(now)
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
        # rows this attempt finished, counted as they finished (errors included)
        "rows_generated": c.rows,
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
