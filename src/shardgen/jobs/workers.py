"""A job of several shards, and the ``generate`` command that runs a job.

A job runs one shard, several one after another on one engine (``shards.per_job``), or claims shards
one by one as an elastic worker (``shards.workers``) until none is left. Each shard runs as
``generate.run_shard`` runs it, with the job's context (``generate.JobContext``): one engine, which
starts once for the job, and one stop flag (``stopflag.StopFlag``), installed for the whole job, so a
signal between two shards stops the next. A shard already committed with this config and input is
kept (``generate.committed``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardgen.base import jobinfo
from shardgen.base.io import atomic_write_text
from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig
from shardgen.data.manifest import Manifest
from shardgen.engines.kinds import for_config as engine_for
from shardgen.jobs import generate
from shardgen.jobs.claims import ClaimBoard, ClaimLost, Holder
from shardgen.jobs.stopflag import Interrupted, StopFlag
from shardgen.models.fetch import load_record

log = logging.getLogger(__name__)


def run_shards(
    config: RunConfig, manifest_path: str | Path, shard_ids: list[str], context: generate.JobContext | None = None
) -> list[dict[str, Any]]:
    """Several shards in one job with one engine start, each as ``run_shard`` does it.

    A shard already committed with this config and input is kept: a retry of
    a job that died after some of its shards goes on with the rest.
    Returns the stats of the shards generated now.

    Args:
        context: the job's engine and model record (``generate.JobContext``); the job installs its own
            stop flag.
    """
    manifest = Manifest.load(manifest_path)
    run_dir = RunDir(config.output.dir)
    context = context or generate.JobContext()
    own = context.engine is None
    engine = context.engine or engine_for(config)
    done = []
    try:
        with StopFlag() as stop:  # one for the job: a signal between two shards stops the next
            context = dataclasses.replace(context, engine=engine, stop=stop)
            for shard_id in shard_ids:
                out, stats = run_dir.shard_file(shard_id), run_dir.shard_stats(shard_id)
                if generate.committed(config, manifest, manifest.shard(shard_id), out, stats):
                    log.info("shard %s: already committed with this configuration; kept", shard_id)
                    continue
                done.append(generate.run_shard(config, manifest_path, shard_id, out, stats, context))
    finally:
        if own:
            engine.close()
    return done


def run_worker(
    config: RunConfig, manifest_path: str | Path, worker: int, context: generate.JobContext | None = None
) -> dict[str, Any]:
    """One elastic worker (``shards.workers``): claim shards and run each as ``run_shard`` does, on one
    engine, until no shard is left for this worker (``claims.ClaimBoard.next``). Returns the worker's
    record: the shards it committed, took over or lost, its engine starts and where its time went.

    Args:
        context: the job's engine and model record (``generate.JobContext``); the worker installs its
            own stop flag, and guards each shard's writes with its claim's check.

    Raises:
        Interrupted: SIGTERM or SIGINT; the shard's rows are saved and its claim kept for this worker's
            retry (or, after the lease, another worker). A worker waiting for a silent claim's lease to
            run out stops at once.
        OutOfMemory, TooManyErrors, ...: a shard failed; its claim is marked failed, so only this
            worker's retry tries it again.
    """
    started = time.time()
    manifest = Manifest.load(manifest_path)
    run_dir = RunDir(config.output.dir)
    holder = Holder.here(worker)
    stop = StopFlag()  # one for the job: a signal between two shards, or during a wait, stops it
    board = ClaimBoard(run_dir.claims, holder, config.shards.lease_seconds, below=run_dir.root,
                       sleep=lambda seconds: stop.sleep(seconds, "(none claimed)"))  # fmt: skip
    context = context or generate.JobContext()
    own = context.engine is None
    engine = context.engine or engine_for(config)
    record: dict[str, Any] = {"worker": worker, "host": holder.host, "job_id": holder.job_id, "committed": [],
                              "kept": [], "taken_over": [], "lost": []}  # fmt: skip
    shards = generate.WorkerShards(config, manifest, asdict(holder),
                                   sleep=lambda seconds: stop.sleep(seconds, "(asking for a split)"))  # fmt: skip
    try:
        with stop:
            while (claim := board.next(shards.ids, shards.is_done, shards.steal)) is not None:
                with claim:
                    shard_id = claim.shard
                    if claim.took_over and claim.took_over.get("worker") != worker:
                        record["taken_over"].append(shard_id)
                    if shards.is_done(shard_id):
                        record["kept"].append(shard_id)
                        claim.release()
                        continue
                    try:
                        shard_context = dataclasses.replace(context, engine=engine, guard=claim.check, stop=stop)
                        generate.run_shard(config, manifest_path, shard_id, run_dir.shard_file(shard_id),
                                           run_dir.shard_stats(shard_id), shard_context)  # fmt: skip
                    except ClaimLost as e:
                        log.warning("%s", e)
                        record["lost"].append(shard_id)
                        continue
                    except Interrupted:
                        raise
                    except BaseException as e:
                        claim.mark_failed(e)
                        raise
                    shards.done.add(shard_id)
                    record["committed"].append(shard_id)
                    claim.release()
    finally:
        board.close()
        shards.close()
        if own:
            engine.close()
    record.update(engine_starts=engine.starts, seconds=time.time() - started, splits_asked=shards.asked)
    return record


# -- The generate command -----------------------------------------------------------------------------


def main_shard(config: RunConfig, manifest: str, shard: str, output: str, stats: str, model_record: str | None) -> int:
    """``shardgen generate --shard ID --output ... --stats ...``: one shard, to ``output`` and ``stats``.
    Returns the exit status: 3 when a signal stopped it."""
    context = _start(model_record)
    try:
        done = [generate.run_shard(config, manifest, shard, output, stats, context)]
    except Interrupted as e:
        return _stopped(e)
    _print_shards(done)
    return 0


def main_shards(config: RunConfig, manifest: str, shards: list[str], record: str, model_record: str | None) -> int:
    """``shardgen generate --shard A,B,... --record ...``: several shards in one job, each where the run
    directory keeps it, and the job's ``record`` (its shards, and those generated now)."""
    context = _start(model_record)
    try:
        done = run_shards(config, manifest, shards, context)
    except Interrupted as e:
        return _stopped(e)
    _print_shards(done)
    atomic_write_text(record, json.dumps({"shards": shards, "generated_now": [s["shard"] for s in done]}) + "\n")
    return 0


def main_worker(config: RunConfig, manifest: str, worker: int, record: str, model_record: str | None) -> int:
    """``shardgen generate --worker N --record ...``: an elastic worker, and its ``record``
    (``run_worker``'s)."""
    context = _start(model_record)
    try:
        result = run_worker(config, manifest, worker, context)
    except Interrupted as e:
        return _stopped(e)
    atomic_write_text(record, json.dumps(result, indent=1) + "\n")
    print(f"worker {worker}: {len(result['committed'])} shard(s) committed, "
          f"{len(result['taken_over'])} taken over, {len(result['lost'])} lost", file=sys.stderr)  # fmt: skip
    return 0


def _start(model_record: str | None) -> generate.JobContext:
    """The job's context, with the model record the fetch step wrote; and the job's first log line."""
    model = load_record(model_record) if model_record else None
    job = os.environ.get("SLURM_JOB_ID")
    log.info("start on %s%s (pid %d)", jobinfo.host(), f", Slurm job {job}" if job else "", os.getpid())
    return generate.JobContext(model_record=model)


def _stopped(error: Interrupted) -> int:
    """A signal stopped the job: exit 3, so Snakemake retries it."""
    print(f"shardgen: {error}", file=sys.stderr)
    return 3


def _print_shards(done: list[dict[str, Any]]) -> None:
    for s in done:
        print(
            f"shard {s['shard']}: {s['rows']} rows ({s['errors']} errors, {s['rows_resumed']} resumed), "
            f"{s['output_tokens_per_s'] or 0:.1f} output tok/s",
            file=sys.stderr,
        )
