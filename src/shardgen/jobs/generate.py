"""One shard job, in four phases.

1. **Prepare** (``ShardJob.prepare``): the plan's shard and its input, the
   checkpoint with the rows already done, the record of earlier attempts;
   this attempt's start is recorded before anything can fail.
2. **Engine** (``EngineSettings.for_job``, ``Engine.start``): settings for the
   GPUs the job got, the precision and the memory failures before it; the
   engine starts once per job (several shards of a job share it).
3. **Feed** (``feed.ShardFeed``): the remaining rows, rendered and tokenized
   ahead of the engine, saved every checkpoint interval; SIGTERM and SIGINT
   (Slurm's time limit, scancel, Ctrl+C) stop it after a last save.
4. **Commit** (``ShardJob.commit``): the shard file and its stats (``stats.shard_record``).

A job that stops for a signal raises ``Interrupted`` (the command exits with
3, so Snakemake retries it); the next attempt resumes from the saved rows.

A job hands each of its shards its context (``JobContext``: the engine, the
model record, the stop flag). A job of several shards, an elastic worker and
the ``generate`` command live in ``workers``, the stop flag in ``stopflag``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardgen.base import jobenv, jobinfo, memory, records
from shardgen.base.io import Dir, atomic_write_text
from shardgen.base.memory import OutOfMemory
from shardgen.base.rundir import RunDir, committed_fingerprint
from shardgen.config import RunConfig, warnings
from shardgen.data.identity import shard_fingerprint
from shardgen.data.manifest import Manifest, Shard, holds, work_order
from shardgen.data.outputs import ShardCheckpoint
from shardgen.data.plan import check_columns
from shardgen.data.sources import Source
from shardgen.data.stats import AttemptCounters, shard_record
from shardgen.engines import multinode
from shardgen.engines.kinds import EngineSettings, Tokenizer
from shardgen.engines.kinds import for_config as engine_for
from shardgen.engines.multinode import WorkersLost
from shardgen.engines.store import NoEngine, StoreEngine
from shardgen.errors import RowError, ShardgenError
from shardgen.features import splits
from shardgen.jobs import claims
from shardgen.jobs.claims import ClaimLost
from shardgen.jobs.feed.requests import RowInputs, prepared_requests
from shardgen.jobs.feed.shard_loop import ErrorBudget, RowStream, ShardFeed, ShardWork
from shardgen.jobs.stopflag import Interrupted, StopFlag
from shardgen.models import fetch, heads
from shardgen.requests.lora import Adapters
from shardgen.requests.prompts import PromptRenderer
from shardgen.requests.results import DROPPED, result_spec
from shardgen.requests.tasks import make_task

log = logging.getLogger(__name__)


# -- Phase 1: prepare ---------------------------------------------------------------------------------


@dataclass
class ShardJob:
    """One attempt at one shard: what it reads, what is done already, and the record it keeps."""

    config: RunConfig
    shard: Shard
    source: Source
    renderer: PromptRenderer | None  # None for a task without a model
    ckpt: ShardCheckpoint
    done: set[int]
    attempts: list[records.Attempt]  # the earlier attempts, from attempts.jsonl
    attempt: records.AttemptStart  # this one's start record
    fingerprint: str
    model_record: dict[str, Any]
    budget: ErrorBudget
    head: heads.Head | None = None  # a pooling model's (heads.Head): its labels, its embedding size
    removed_env: dict[str, str] = field(default_factory=dict)
    splitter: splits.Splitter | None = None  # an elastic worker's: an idle worker may split the shard
    started: float = field(default_factory=time.time)

    @classmethod
    def prepare(
        cls,
        config: RunConfig,
        manifest_path: str | Path,
        shard_id: str,
        model_record: dict[str, Any] | None = None,
        guard: Callable[[], None] | None = None,
    ) -> ShardJob:
        """Open the shard's input and checkpoint, resume what is saved, and record this attempt's start.

        ``guard`` is called before every write of the shard's files (an elastic worker's claim check).

        Raises:
            InputError: the input changed since planning.
            TooManyErrors: the saved rows already hold too many errors.
        """
        removed_env = jobenv.enter()  # done by the command already; in process (tests, benchmarks) here
        if model_record is None and config.kind.uses_engine:
            model_record = fetch.resolve_model(config.model, allow_download=False, adapters=config.lora.adapters)
        manifest = Manifest.load(manifest_path)
        run_splits = splits.of_run(config)
        shard = run_splits.piece(manifest, shard_id) if run_splits else manifest.shard(shard_id)
        plan_shard = manifest.shard(splits.parent_id(shard_id))  # a piece's fingerprint is its shard's
        source = manifest.source()
        fingerprint = shard_fingerprint(config, manifest, plan_shard)
        head = heads.read_for(model_record) if config.kind.needs_head else None
        check_columns(config, source.schema, source.describe(), head)  # for the config this job runs
        schema = result_spec(config, head).schema(source.schema, fingerprint, config.fingerprint, shard.id)
        run_dir = RunDir(config.output.dir)
        ckpt = ShardCheckpoint(run_dir.checkpoint(shard.id), shard.start, shard.stop, schema, below=run_dir.root)
        if guard is not None:
            ckpt.guard = guard
        done = ckpt.resume()
        log.info("shard %s: rows [%d, %d), %d done in checkpoints", shard.id, shard.start, shard.stop, len(done))
        attempts = ckpt.attempts()
        attempt = records.AttemptStart(attempt=len(attempts) + 1, started=records.now(), host=jobinfo.host(),
                                       pid=os.getpid(), slurm=jobinfo.slurm_info(),
                                       rows_done_before=len(done))  # fmt: skip
        ckpt.log_attempt(attempt)
        try:
            # Before any engine starts: the input is as planned, and the rows kept
            # from earlier attempts do not already fail the shard.
            source.check_unchanged({seg.file for seg in shard.segments})
            budget = ErrorBudget(shard.id, shard.rows, config.errors.max_rate, ckpt.resumed_errors, ckpt.first_error)
        except BaseException as e:
            ckpt.log_attempt(records.attempt_end(e, ckpt.saved_inputs))
            ckpt.close()
            raise
        for warning in warnings(config.raw):
            log.warning(warning)
        renderer = PromptRenderer.from_config(config.prompt) if config.kind.uses_engine else None
        splitter = None
        if run_splits is not None and guard is not None:
            splitter = splits.Splitter(run_splits, plan_shard, shard, guard, answer=config.shards.split_seconds > 0)
        return cls(config, shard, source, renderer, ckpt, done, attempts, attempt, fingerprint, model_record or {},
                   budget, head, removed_env, splitter)  # fmt: skip

    @property
    def remaining(self) -> int:
        return self.shard.rows - len(self.done)

    def progress(self, done: int, saved: int, error_reasons: dict[str, int]) -> records.Progress:
        """This attempt's progress.json: who writes it, and how far it got."""
        a = self.attempt
        return records.Progress(attempt=a.attempt, host=a.host, pid=a.pid, job_id=a.slurm.get("job_id"),
                                started=self.started, time=time.time(), rows=self.shard.rows, done=done,
                                resumed=len(self.done), saved=saved, error_reasons=error_reasons)  # fmt: skip

    def work(self) -> ShardWork:
        """What the feed reads from and writes to."""
        floor = max(self.done, default=self.shard.start - 1) + 1  # a cut leaves every saved row to this shard
        rows = RowStream(self.remaining_rows(), self.shard.stop, floor)
        split = self.splitter if self.splitter is not None and self.splitter.answer else None  # split_seconds 0: none
        return ShardWork(self.shard.id, self.shard.rows, len(self.done), rows, self.renderer, self.ckpt,
                         self.config.checkpoint, self.config.prompt.order, self.budget, self.progress,
                         split, self.narrow, self.source.schema)  # fmt: skip

    def narrow(self, stop: int) -> None:
        """The shard now ends at ``stop``: the holder split it there (``splits.Splitter.decide``)."""
        self.shard = splits.clip(self.shard, self.shard.start, stop)
        self.ckpt.narrow(stop)
        self.budget.narrow(self.shard.rows)

    def remaining_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, row)`` of each row not done yet, in input order, streamed from the input."""
        index = self.shard.start
        for batch in self.source.read(self.shard.segments):
            for row in batch.to_pylist():
                if index not in self.done:
                    yield index, row
                index += 1

    def record_end(self, error: BaseException, counters: AttemptCounters) -> None:
        """How this attempt ended, for the next one and for the stats."""
        try:  # refused (ClaimLost) once the shard is another worker's
            self.ckpt.log_attempt(records.attempt_end(error, self.ckpt.saved_inputs, counters.rows))
        except OSError as e:  # a full disk: the error that ended the attempt is the one to raise
            log.warning("shard %s: could not record how the attempt ended: %s", self.shard.id, e)
        finally:
            self.ckpt.close()

    # -- Phase 4: commit ------------------------------------------------------------------------------

    def commit(self, output: str | Path, stats_path: str | Path, run: AttemptRun) -> dict[str, Any]:
        """Write the shard file from its parts, then its stats, then remove the parts (``ShardCheckpoint.
        commit``: a failure in between leaves the parts for the retry); return the stats."""
        if self.splitter is not None and (stop := self.splitter.stop_now()) != self.shard.stop:
            # a cut this attempt did not make: the holder before it, which lost its claim to this worker
            # after deciding it. Left unreleased: a takeover after the lease resumes the piece as it is
            # now (a part with rows past the cut is set aside, its rows run again), as after any lost claim.
            raise ClaimLost(f"shard {self.shard.id}: its rows end at {stop} by {self.splitter.splits.path}, "
                            f"not at {self.shard.stop} as this attempt ran them; not committed")  # fmt: skip
        history = self.ckpt.attempts()
        history[-1] = dataclasses.replace(history[-1], outcome=records.COMMITTED, ended=records.now(),
                                          rows_generated=run.counters.rows)  # fmt: skip
        out: dict[str, Any] = {}

        def write_stats(table: Any) -> None:
            out.update(shard_record(self, run, table, history, multinode.job_nodes(), multinode.node_name()))
            atomic_write_text(stats_path, json.dumps(out, indent=1, default=str) + "\n", below=self.config.output.dir)

        with Dir.open(Path(output).parent, below=self.config.output.dir) as shards:  # a killed commit's
            for name in (Path(output).name, Path(stats_path).name):
                shards.remove_leftovers(name)
        self.ckpt.commit(output, write_stats)
        return out


@dataclass
class AttemptRun:
    """What phases 2 and 3 of an attempt produced, for the commit."""

    settings: EngineSettings | None  # None for a task without an engine (``Task.uses_engine``)
    counters: AttemptCounters = field(default_factory=AttemptCounters)
    engine_seconds: float = 0.0
    generation_seconds: float = 0.0
    engine_delta: dict[str, float] = field(default_factory=dict)
    feed: dict[str, Any] = field(default_factory=dict)
    worker_gpus: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the engine's other nodes'


@dataclass
class JobContext:
    """What a job hands each of its shards besides the shard itself.

    Attributes:
        engine: the job's engine handle; by default one that starts for the shard and stops at its
            end (a job's shards share one, tests share a running one).
        model_record: where the fetch step found the model (``fetch.resolve_model``); when None, it
            is looked up on the local disk only.
        window: requests kept in flight (default: twice the engine's ``max_num_seqs``).
        guard: called before every write of the shard's files: an elastic worker's claim check. Without
            one, the job owns the shard through a claim of its own (``claims.own``) before it reads anything.
        stop: the job's stop flag, when the job runs several shards: a signal that came during an
            earlier shard (its commit, say) stops this one before it starts. By default one of its own.
    """

    engine: Any = None  # an engine.KINDS handle: engine.Engine (vLLM), fake_engine.FakeEngine
    model_record: dict[str, Any] | None = None
    window: int | None = None
    guard: Callable[[], None] | None = None
    stop: StopFlag | None = None


# -- The job: the four phases -------------------------------------------------------------------------


def run_shard(
    config: RunConfig,
    manifest_path: str | Path,
    shard_id: str,
    output: str | Path,
    stats_path: str | Path,
    context: JobContext | None = None,
) -> dict[str, Any]:
    """Generate one shard and commit its output and stats. Returns the stats.

    Args:
        context: the job's engine, model record, window, guard and stop flag (``JobContext``); by
            default the shard starts an engine and installs a stop flag of its own.

    Raises:
        Interrupted: SIGTERM or SIGINT arrived; finished rows are saved.
        OutOfMemory: the engine ran out of memory; the next attempt takes a step.
        TooManyErrors, WrongGpus, InputError: as their messages say.
    """
    context = context or JobContext()
    own = context.engine is None
    engine = context.engine or engine_for(config)
    try:
        with contextlib.nullcontext(context.stop) if context.stop is not None else StopFlag() as stop:
            if stop():
                raise Interrupted(stop.signal, shard_id)
            context = dataclasses.replace(context, engine=engine, stop=stop)
            sleep = functools.partial(stop.sleep, shard_id=shard_id)  # a signal stops the wait for a claim
            run_dir, lease = RunDir(config.output.dir), config.shards.lease_seconds
            with contextlib.nullcontext() if context.guard else claims.own(run_dir, shard_id, lease, sleep) as claim:
                if claim is not None:
                    manifest = Manifest.load(manifest_path)
                    # written since Snakemake started this job: the job that held the shard (an orphan of a
                    # killed controller) committed it
                    if Path(output).exists() and committed(config, manifest, manifest.shard(shard_id), output,
                                                           stats_path):  # fmt: skip
                        log.info("shard %s: committed meanwhile by the job that held it; kept", shard_id)
                        claim.release()
                        return json.loads(Path(stats_path).read_text())
                    if (kept := restore(config, manifest, shard_id, output, stats_path)) is not None:
                        claim.release()
                        return kept
                guard = context.guard or claim.check
                job = ShardJob.prepare(config, manifest_path, shard_id, context.model_record, guard)
                counters = AttemptCounters()
                try:
                    run = _run(job, context, counters)
                    stats = job.commit(output, stats_path, run)
                    if splits.parent_id(shard_id) == shard_id:  # (a piece's worker holds its files)
                        keep(run_dir, job.shard, job.fingerprint, output, stats_path)
                except BaseException as e:
                    job.record_end(e, counters)
                    raise
                finally:
                    if job.splitter is not None:  # its splits/ directory, opened once a request is looked for
                        job.splitter.close()
                if claim is not None:
                    claim.release()
                return stats
    finally:
        if own:
            engine.close()


def _run(job: ShardJob, context: JobContext, counters: AttemptCounters) -> AttemptRun:
    """Phases 2 and 3: the engine for this job's GPUs, then the feed of the remaining rows.

    ``context`` holds the job's engine and stop flag (``run_shard`` fills in its defaults). A task without
    an engine (a Python function) runs the rows itself (``Task.run_rows``)."""
    if not job.config.kind.uses_engine:
        run = AttemptRun(None, counters)
        t1 = time.time()
        try:
            run.feed = make_task(job.config, None, None).run_rows(job.work(), context.stop, counters)
        finally:
            run.generation_seconds = time.time() - t1
        if context.stop():
            raise Interrupted(context.stop.signal, job.shard.id)
        return run
    log_start = jobinfo.own_log_size()  # what this attempt writes to the job's log comes after
    failures = memory.failures_of(job.attempts)
    settings = EngineSettings.for_job(job.config, job.model_record, failures)
    run = AttemptRun(settings, counters)
    log.info("shard %s: %d GPU(s) %s; precision: %s", job.shard.id, len(settings.gpus),
             [g.get("name") for g in settings.gpus], settings.precision.get("reason"))  # fmt: skip
    for note in settings.notes:
        log.warning("shard %s: %s", job.shard.id, note)
    if settings.memory_overrides:
        log.warning("shard %s: %d earlier attempt(s) ran out of memory; now %s", job.shard.id, len(failures),
                    settings.memory_overrides)  # fmt: skip
    if not job.remaining:
        return run
    layout = memory.layout(settings.model, settings.gpus)
    if failed := memory.same_layout(failures, layout):
        raise OutOfMemory(f"shard {job.shard.id}: the model's weights did not fit in the last attempt, on the same "
                          f"GPUs with the same model and parallelism ({layout}); not loaded again. "
                          f"{memory.advice('weights_too_large')}", failed)  # fmt: skip
    stored = StoreEngine.for_job(job.config, job.model_record) if job.config.cache.enabled else None
    if stored is not None and (tokenizer := _stored_only(job, context, run, stored)) is not None:
        log.info("shard %s: every remaining request is in the request store; no engine is started", job.shard.id)
        context = dataclasses.replace(context, engine=NoEngine(tokenizer))
    else:
        _start_engine(job, context, run, log_start, layout)
    _feed(job, context, run, log_start, layout, stored)
    return run


def _stored_only(job: ShardJob, context: JobContext, run: AttemptRun, stored: StoreEngine) -> Tokenizer | None:
    """The model's tokenizer (loaded without an engine) when the request store answers every remaining row
    of the shard, looked up with it; None when a row is not stored or is an error, or the job's engine runs
    already (or the rows have images or turns, or the model several nodes). The rows are read and prepared
    once more for it, where the store holds anything."""
    config = job.config
    if not stored.store.holds_any() or context.engine.running or config.prompt.images or config.resources.nodes > 1:
        return None
    try:
        hf = fetch.load_tokenizer(config.model, job.model_record)
    except ShardgenError as e:
        log.info("shard %s: the request store is not searched before the engine starts (%s)", job.shard.id, e)
        return None
    tokenizer = Tokenizer(hf, 2**62, config.kind.generates, config.template_kwargs)  # a row too long is not stored
    task, inputs = _task(job, run, tokenizer)
    if task.turns() is not None:  # a rollout's later turns are not known before its first ones end
        return None
    errors: list[int] = []  # the rows that would be errors (a row a step before dropped is none: no request)

    def error(index: int, row: dict[str, Any], e: RowError) -> None:
        if e.reason != DROPPED:
            errors.append(index)

    requests = prepared_requests(job.remaining_rows(), job.renderer, tokenizer, task, error, inputs=inputs)
    return tokenizer if stored.answers_all(requests, errors) else None


def _task(job: ShardJob, run: AttemptRun, tokenizer: Tokenizer) -> tuple[Any, RowInputs]:
    """What the shard's rows become (``tasks.Task``), and what their requests carry beside their tokens."""
    config = job.config
    loras = job.model_record.get("adapters") or {}
    adapters = Adapters(config.lora, loras, run.settings.build) if config.lora.adapters else None
    return make_task(config, tokenizer, job.head), RowInputs.for_run(config, job.source, adapters)


def _start_engine(job: ShardJob, context: JobContext, run: AttemptRun, log_start: int, layout: dict[str, Any]) -> None:
    """Phase 2: the engine with the attempt's settings (``run.settings``).

    ``log_start`` and ``layout``: where this attempt's part of the job's log begins, and what the
    model is loaded on, for the record of a memory failure (``memory.raise_if_memory``)."""
    engine, stop, settings = context.engine, context.stop, run.settings
    jobenv.apply(settings.environment)  # before vLLM starts its processes, which inherit it
    t0 = time.time()
    try:
        with stop.raising(job.shard.id):
            engine.start(settings)
    except Interrupted:
        raise
    except Exception as e:
        if stop.caused(e):  # Slurm's SIGTERM reaches the engine's processes too, and fails the start
            raise Interrupted(stop.signal, job.shard.id) from e
        if engine.workers_lost:
            raise WorkersLost(f"shard {job.shard.id}: {engine.workers_lost}") from e
        used = memory.used_settings(settings.model, settings.memory_defaults)
        memory.raise_if_memory(e, "engine start", used, log_start, layout)
        raise
    run.engine_seconds = time.time() - t0  # about 0 when the job's engine was running already


def _feed(
    job: ShardJob, context: JobContext, run: AttemptRun, log_start: int, layout: dict[str, Any],
    stored: StoreEngine | None = None,
) -> None:  # fmt: skip
    """Phase 3: the remaining rows through the engine (behind the request store, ``stored``), and what the
    feed and the engine counted."""
    engine, stop, config = context.engine, context.stop, job.config
    tokenizer = engine.tokenizer(config.kind.generates, config.template_kwargs)
    job.renderer.max_chars = tokenizer.max_prompt_chars
    task, inputs = _task(job, run, tokenizer)
    work = job.work()
    if stored is not None:
        stored.engine = engine
        engine, work.on_save = stored, stored.save
    feed = ShardFeed(work, task, tokenizer, engine, stop, run.counters, context.window, inputs)
    before = engine.counters()
    t1 = time.time()
    try:
        feed.run()
    except Exception as e:
        if stop.caused(e):
            raise Interrupted(stop.signal, job.shard.id) from e
        if engine.workers_lost:
            raise WorkersLost(f"shard {job.shard.id}: {engine.workers_lost}") from e
        memory.raise_if_memory(e, "generation", engine.memory_settings(), log_start, layout)
        raise
    finally:
        run.generation_seconds = time.time() - t1
        after = engine.counters()
        run.engine_delta = {k: after[k] - before.get(k, 0) for k in after}
        run.feed = feed.stats
        run.worker_gpus = engine.worker_gpus
    if stop():
        raise Interrupted(stop.signal, job.shard.id)


# -- The run's shards: which are committed, and what an elastic worker may claim ----------------------


# -- Kept shards: a plan made again keeps a committed shard that Snakemake removed ------------------------
# A grown input is planned again (plan.kept_shards keeps the shards of its files as they were), and Snakemake
# then reruns every shard job, removing its file and stats first. A committed shard is also linked under
# its content (RunDir.kept: its id, first row and fingerprint), and a job whose shard has those links back
# them instead of generating it. One link per shard id: a shard committed again replaces its old one.


def keep(run_dir: RunDir, shard: Shard, fingerprint: str, output: str | Path, stats: str | Path) -> None:
    """Link the committed shard's file and stats under its content (a copy where links are not possible):
    the run directory's own shard files only (a shard written elsewhere, in process, is no run's)."""
    if Path(output).absolute() != run_dir.shard_file(shard.id).absolute():
        return
    parquet, record = run_dir.kept(shard.id, shard.start, fingerprint)
    try:
        parquet.parent.mkdir(parents=True, exist_ok=True)
        for old in parquet.parent.glob(f"{shard.id}-*"):
            old.unlink(missing_ok=True)
        for source, link in ((output, parquet), (stats, record)):
            _link(Path(source), link)
    except OSError as e:  # a full disk: the shard is committed; a later plan generates it again
        log.warning("shard %s: could not keep a link to it (%s)", shard.id, e)


def restore(config: RunConfig, manifest: Manifest, shard_id: str, output: str | Path, stats: str | Path) -> Any:
    """The stats of the shard linked back from its kept links (``keep``), or None where it has none: its
    file first, its stats last (the two make it committed), both as new to Snakemake as the job."""
    run_dir = RunDir(config.output.dir)
    if splits.parent_id(shard_id) != shard_id or Path(output).absolute() != run_dir.shard_file(shard_id).absolute():
        return None
    shard = manifest.shard(shard_id)
    parquet, record = run_dir.kept(shard_id, shard.start, shard_fingerprint(config, manifest, shard))
    if not (parquet.exists() and record.exists()):
        return None
    for link, target in ((parquet, Path(output)), (record, Path(stats))):
        _link(link, target)
        os.utime(target)
    if not committed(config, manifest, shard, output, stats):
        Path(stats).unlink(missing_ok=True)
        return None
    log.info("shard %s: its rows were committed before with this content; linked back from %s", shard_id, parquet)
    return json.loads(Path(stats).read_text())


def _link(source: Path, link: Path) -> None:
    link.unlink(missing_ok=True)
    try:
        os.link(source, link)
    except OSError:  # a file system without hard links
        import shutil  # (only there)

        shutil.copy2(source, link)


def committed(config: RunConfig, manifest: Manifest, shard: Shard, path: str | Path, stats: str | Path) -> bool:
    """Whether the shard's file and stats are committed (``rundir.committed_fingerprint``) with this
    config and input, and hold the shard's rows as they are now: ``shard`` may be a piece of a split
    shard (``splits``), whose rows a later cut ended sooner than a file committed before it holds."""
    plan_shard = manifest.shard(splits.parent_id(shard.id))
    if committed_fingerprint(path, stats) != shard_fingerprint(config, manifest, plan_shard):
        return False
    try:
        recorded = json.loads(Path(stats).read_text())
    except (OSError, ValueError):
        return False
    return holds(recorded, shard)


class WorkerShards:
    """What an elastic worker (``shards.workers``) may claim, for ``claims.ClaimBoard.next``: the plan's
    shards, largest estimated work first, then the pieces splits made of them (``splits``); which of
    them are committed; and, with ``shards.split_seconds``, its requests for a split (``splits.Thief``).

    ``who`` is the worker's claim holder, ``sleep`` how its requests wait for an answer."""

    def __init__(self, config: RunConfig, manifest: Manifest, who: dict[str, Any], sleep: Callable[[float], None]):
        self.config, self.manifest = config, manifest
        self.run_dir = RunDir(config.output.dir)
        self.done: set[str] = set()
        self.order = work_order(manifest)  # largest estimated work first
        self.splits = splits.of_run(config)
        self.thief = None
        if self.splits is not None and config.shards.split_seconds > 0:
            self.thief = splits.Thief(self.splits, self.run_dir, who, config.shards.split_seconds, sleep=sleep)
        self.steal = self.thief.steal if self.thief else None

    def ids(self) -> list[str]:
        """The plan's shards, then the pieces splits made."""
        return self.order + self.splits.new_pieces(self.manifest) if self.splits else self.order

    def is_done(self, shard_id: str) -> bool:
        """Whether the shard (or piece) is committed, as ``committed`` tells it."""
        if shard_id not in self.done:  # a committed shard is not looked at again (nor its cuts listed)
            files = self.run_dir.shard_file(shard_id), self.run_dir.shard_stats(shard_id)
            shard = self.splits.piece(self.manifest, shard_id) if self.splits else self.manifest.shard(shard_id)
            if committed(self.config, self.manifest, shard, *files):
                self.done.add(shard_id)
        return shard_id in self.done

    @property
    def asked(self) -> int:
        """How many splits the worker asked for."""
        return self.thief.asked if self.thief else 0

    def close(self) -> None:
        if self.splits is not None:
            self.splits.close()
