"""Jobs that die: kill -9, a Slurm time limit, scancel, an out-of-memory at engine start.

Each run has one shard whose rows finish a few at a time (``max_num_seqs``
small), so that it can be broken after some rows are done and before all
are. Periodic saves are set far above the shard's size wherever a test
proves what a signal saves: only the save the signal makes can put rows in
a checkpoint. What each attempt did is read from the shard's record of its
attempts (``stats["attempts"]``), never derived from the other counts.
"""

from __future__ import annotations

import json
import re
import subprocess

import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import (
    Background,
    dry_run_jobs,
    generate_process,
    part_rows,
    progress_of,
    run_workflow,
    workflow_config,
)

NO_PERIODIC_SAVES = {"rows": 10_000, "seconds": 3600}
# A Slurm job's rows/s over the session engine's on the same rows (``rows_per_s``), measured here
JOB_SPEED = 1.07  # a job 2.99 rows/s, the session engine 2.80 (AVX-512, 2 cores)


def one_shard_run(tmp_path, rows: int, checkpoint=None, **model):
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(rows))
    config = workflow_config(
        {"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
        shards={"rows_per_shard": rows},
        checkpoint=checkpoint or {"rows": 4, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
    )
    config["model"].update({"max_num_seqs": 4, **model})
    return config


@pytest.fixture(scope="module")
def rows_per_s(engine, tmp_path_factory) -> float:
    """This machine's speed on ``one_shard_run``'s rows (24 tokens each, 4 at a time), measured on the
    session engine: what a test that races a Slurm time limit sizes its shard from. (Seen: 2-3.5 rows/s
    in a job on a 2-core machine with AVX-512, 1.26 on an AVX2-only one.)"""
    from shardgen.config import RunConfig, validate
    from shardgen.data.plan import write_manifest
    from shardgen.jobs.generate import JobContext, run_shard

    def run(rows: int) -> dict:
        tmp = tmp_path_factory.mktemp("rate")
        config = one_shard_run(tmp, rows, checkpoint=NO_PERIODIC_SAVES)
        config["output"] = {"dir": str(tmp / "results")}
        run = RunConfig.from_dict(validate(config))
        write_manifest(run, tmp / "manifest.json")
        run_shard(run, tmp / "manifest.json", "00000", tmp / "s.parquet", tmp / "s.json", JobContext(engine, window=4))
        return json.loads((tmp / "s.json").read_text())

    run(4)  # warm: the engine's first requests are slower
    stats = run(24)
    return stats["rows_generated"] / stats["generation_seconds"]


def results(tmp_path, rows: int):
    table = pq.read_table(tmp_path / "results" / "output.parquet")
    # the shard's own stats (stats.json keeps a summary of each shard)
    shard = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)], "every row exactly once, in order"
    assert table.column("error").null_count == rows
    assert shard["checkpoints_discarded"] == [], "every saved part was whole and was reused"
    assert not (tmp_path / "results" / "checkpoints" / "00000").exists()
    return table, shard


def checkpoints(tmp_path):
    return tmp_path / "results" / "checkpoints" / "00000"


def progress(tmp_path) -> dict:
    """What the running shard last reported: rows done (saved or not) and rows saved."""
    return progress_of(tmp_path / "results", "00000")


TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges"]
# Requests of an OpenAI batch file that are not valid: each is its row's error, named in the error file.
INVALID_REQUESTS = {
    7: ({"max_tokens": -1}, "body: max_tokens must be at least 1"),
    19: ({"url": "/v1/responses"}, "url: '/v1/responses' is none of"),
    33: ({"logit_bias": {"50": 5}}, "body.logit_bias: not a sampling field"),
}
# Requests with their own n and log-probabilities (5: temperature 0.8, 10: greedy)
OWN_SAMPLES = {5: {"n": 2, "logprobs": True, "top_logprobs": 2}, 10: {"logprobs": True, "top_logprobs": 1}}


def batch_run(tmp_path, rows: int) -> tuple[dict, dict[str, int]]:
    """A one-shard run of an OpenAI batch file of ``rows`` chat requests, each with its own max_tokens,
    temperature and seed, some not valid (INVALID_REQUESTS), with results in OpenAI's format."""
    lines, limits = [], {}
    for i in range(rows):
        body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % 8]}."}],
                "max_tokens": 8 + i % 17, "temperature": [0, 0.8][i % 2], "seed": i}  # fmt: skip
        request = {"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        change, _ = INVALID_REQUESTS.get(i, ({}, None))
        request["url"] = change.pop("url", request["url"])
        body.update(change, **OWN_SAMPLES.get(i, {}))
        limits[request["custom_id"]] = body["max_tokens"]
        lines.append(json.dumps(request))
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / "requests.jsonl").write_text("\n".join(lines) + "\n")
    config = workflow_config(
        {"openai_batch": [str(tmp_path / "data" / "requests.jsonl")]},
        shards={"rows_per_shard": rows},
        checkpoint={"rows": 4, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        output={"format": "openai_batch", "samples": "list"},  # a request's own n: samples as lists
        errors={"max_rate": 0.2},
    )
    del config["prompt"]  # the requests' messages are the prompts
    config["model"].update({"max_num_seqs": 4})
    return config, limits


@pytest.mark.engine
def test_kill_9_loses_only_unsaved_rows_and_a_rerun_after_the_retries_are_used_up_resumes(tmp_path):
    """Also: an OpenAI batch file in and out, each request with its own sampling (one with its own n
    and logprobs, one with logprobs), the invalid ones in the error file; the rerun keeps every
    request exactly once, in input order."""
    from openai.types.chat import ChatCompletion

    rows = 60
    config, limits = batch_run(tmp_path, rows)
    run = Background(tmp_path, config, "local", "--retries", "0")
    run.wait_until(lambda: part_rows(checkpoints(tmp_path)) > 0, 300, "a checkpoint part")
    job = generate_process(tmp_path)
    victims = [*job.children(recursive=True), job]
    for p in victims:  # what the OOM killer or a node failure does: no warning, no save
        p.kill()
    saved = part_rows(checkpoints(tmp_path))
    assert 0 < saved < rows
    with pytest.raises(AssertionError, match="snakemake failed"):
        run.wait()  # no retries left: the run stops
    # the same command again, as the README says to
    run_workflow(tmp_path, config, "local", "--retries", "0")
    out = tmp_path / "results" / "openai"
    ok, failed = ([json.loads(x) for x in (out / n).read_text().splitlines()] for n in ("output.jsonl", "errors.jsonl"))
    valid = [f"req-{i:03d}" for i in range(rows) if i not in INVALID_REQUESTS]
    assert [line["custom_id"] for line in ok] == valid, "every valid request exactly once, in input order"
    for line in ok:
        completion = ChatCompletion.model_validate(line["response"]["body"])
        own = OWN_SAMPLES.get(int(line["custom_id"][4:]), {})
        n, tokens = own.get("n", 1), limits[line["custom_id"]]
        assert completion.usage.completion_tokens == tokens * n, "each within its own max_tokens"
        assert len(completion.choices) == n and all(bool(c.logprobs) == bool(own) for c in completion.choices)
        for choice in completion.choices if own else []:  # each token and the request's top_logprobs
            assert len(choice.logprobs.content) == tokens
            assert all(len(t.top_logprobs) == own["top_logprobs"] for t in choice.logprobs.content)
        if own and own["top_logprobs"] == 1:  # greedy: the sampled token is the most likely one
            assert all(t.top_logprobs[0].token == t.token for t in completion.choices[0].logprobs.content)
    assert [line["custom_id"] for line in failed] == [f"req-{i:03d}" for i in INVALID_REQUESTS]
    for line, (_, said) in zip(failed, INVALID_REQUESTS.values(), strict=True):
        assert said in line["response"]["body"]["error"]["message"], line
    shard = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    assert shard["checkpoints_discarded"] == [] and not checkpoints(tmp_path).exists()
    assert shard["rows_resumed"] == saved, "every saved row was reused"
    assert shard["attempt_requests"] == rows - saved, "the engine was sent only the unsaved rows"
    killed, finished = shard["attempts"]
    assert killed["outcome"] is None, "a killed attempt could not record its end"
    assert finished["outcome"] == "committed" and finished["rows_done_before"] == saved


def _job_states(job_ids) -> dict[str, str]:
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True, text=True
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.mark.engine
@pytest.mark.slurm
@pytest.mark.serial  # sized from the session engine's speed: with nothing beside it, as its job runs
def test_a_time_limit_and_a_scancel_each_save_the_finished_rows_and_the_retries_get_more_time(
    tmp_path, slurm_cluster, rows_per_s
):
    """SIGTERM reaches shardgen under Slurm, from the time limit and from scancel, and what it saves
    is what the next attempt resumes; each attempt gets runtime × its number; a retry never writes
    beside the attempt it replaces."""
    # 25-55 s from job start to the first row here (about 35-70 s on an AVX2-only machine): a
    # 1-minute limit could end attempt 1 before its first row. So attempt 1 asks 2 minutes (the
    # runtime), and once it has generated rows its limit is lowered to 1 minute (``scontrol update``,
    # as an operator may): Slurm ends it at the next of its checks (every 30 s) after the job's first
    # minute, the same TIMEOUT, SIGTERM and KillWait as a limit reached unaided; the limit its attempt
    # recorded at start stays 2 minutes. It generates for at most 90 - 25 s, so the shard is 95 s of rows
    # at this machine's speed (JOB_SPEED × the session engine's). Attempt 2 (4 minutes) is cancelled
    # once it has generated rows of its own; attempt 3 (6 minutes) finishes. Slurm signals every
    # process of the job, vLLM's engine core included.
    rows = round(95 * JOB_SPEED * rows_per_s)
    print(f"session engine: {rows_per_s:.2f} rows/s; the shard: {rows} rows")
    config = one_shard_run(tmp_path, rows, checkpoint=NO_PERIODIC_SAVES)
    config["resources"]["runtime"] = 2
    run = Background(tmp_path, config, "slurm")
    run.wait_until(lambda: progress(tmp_path).get("done", 0) >= 4, 600, "rows of the first attempt")
    subprocess.run(["scontrol", "update", f"JobId={progress(tmp_path)['job_id']}", "TimeLimit=1"], check=True)
    run.wait_until(lambda: progress(tmp_path).get("attempt") == 2, 600, "the second attempt")
    resumed = progress(tmp_path)["saved"]
    run.wait_until(lambda: progress(tmp_path).get("done", 0) >= resumed + 4, 300, "rows of the second attempt")
    assert progress(tmp_path)["saved"] == resumed, "no periodic save: only a signal saves"
    subprocess.run(["scancel", progress(tmp_path)["job_id"]], check=True)
    run.wait()
    _, shard = results(tmp_path, rows)
    timed_out, cancelled, finished = shard["attempts"]
    assert [a["slurm"]["time_limit"] for a in shard["attempts"]] == ["00:02:00", "00:04:00", "00:06:00"]
    assert timed_out["outcome"] == cancelled["outcome"] == "interrupted"
    assert timed_out["signal"] == cancelled["signal"] == "SIGTERM"
    assert 0 < timed_out["rows_saved"] == cancelled["rows_done_before"] == resumed
    assert cancelled["rows_saved"] == finished["rows_done_before"] == shard["rows_resumed"] > resumed
    assert shard["attempt_requests"] == rows - shard["rows_resumed"], "the engine was sent only the unsaved rows"
    states = _job_states([a["slurm"]["job_id"] for a in shard["attempts"]])
    assert [states[a["slurm"]["job_id"]] for a in shard["attempts"]] == ["TIMEOUT", "CANCELLED", "COMPLETED"]
    # one writer: each retry (submitted while its predecessor was still saving) began only after it ended
    for before, after in zip(shard["attempts"], shard["attempts"][1:], strict=False):
        assert after["started"] >= before["ended"], shard["attempts"]
    assert not list((tmp_path / "results" / "claims").glob("*.claim")), "the committed shard's claims are gone"
    # the log names the Slurm job of the attempt that finished
    log = (tmp_path / "results" / "logs" / "generate_shard" / "00000.log").read_text()
    assert re.search(rf"start on \S+, Slurm job {finished['slurm']['job_id']} ", log), log[:2000]
    print(f"the last attempt: {shard['rows_generated'] / shard['generation_seconds']:.2f} rows/s")


@pytest.mark.slurm
def test_a_rerun_after_a_killed_controller_waits_for_its_orphan_and_writes_every_row_once(tmp_path, slurm_cluster):
    """The controller dies (kill -9) while its job generates; the job runs on. The rerun (after
    --unlock) warns of it, and its own job for the shard, running beside it, waits for it rather than
    write beside it; the orphan commits, and the rerun keeps its shard. The orphan is suspended
    (scontrol suspend) until the rerun's job waits for it, so that it cannot finish first."""
    rows = 40
    config = one_shard_run(tmp_path, rows)
    # the fake engine, at about a real job's speed here (3 rows/s): which job writes the shard is shardgen's
    config["engine"] = {"kind": "fake", "fake": {"tokens_per_second": 72}}
    # longer than the suspension (the unlock, the rerun's start and its job's, up to about 75 s on a
    # slow machine); the waiting job looks every 36 s
    config["shards"]["lease_seconds"] = 180
    config["resources"]["cpus_per_task"] = 1  # the two jobs run at once on the test node's 2 CPUs
    run = Background(tmp_path, config, "slurm")
    run.wait_until(lambda: progress(tmp_path).get("saved", 0) >= 4, 600, "the first job's saved rows")
    orphan = progress(tmp_path)["job_id"]
    subprocess.run(["scontrol", "suspend", orphan], check=True)
    run.proc.kill()  # the controller; its Slurm job stays (suspended, then running)
    run.proc.wait()
    run.out.close()
    run_workflow(tmp_path, config, "slurm", "--unlock")
    log_file = tmp_path / "results" / "logs" / "generate_shard" / "00000.log"
    rerun = Background(tmp_path, config, "slurm")
    try:
        # Snakemake removes the orphan's log before it submits the rerun's job, which then writes it anew
        waits = lambda: log_file.exists() and "still holds it; waiting" in log_file.read_text()  # noqa: E731
        rerun.wait_until(waits, 300, "the rerun's job to wait")
    finally:
        subprocess.run(["scontrol", "resume", orphan], check=True)
    out = rerun.wait()
    assert f"still queued or running ({orphan})" in out
    _, shard = results(tmp_path, rows)
    assert [a["slurm"]["job_id"] for a in shard["attempts"]] == [orphan], "the orphan made the shard alone"
    assert shard["rows_resumed"] == 0 and shard["attempt_requests"] == rows
    jobs = _job_states(re.findall(r"submitted with SLURM jobid (\d+)", out))
    assert list(jobs.values()) == ["COMPLETED"], "the rerun's job waited, then kept the orphan's shard"
    log = log_file.read_text()
    assert "still holds it; waiting until it has ended" in log and "committed meanwhile by the job" in log, log[-3000:]
    assert _job_states([orphan]) == {orphan: "COMPLETED"}


@pytest.mark.engine
def test_a_kv_cache_too_small_at_engine_start_is_retried_with_a_larger_one_and_succeeds(tmp_path):
    """Also, while this run goes: a dry run of another config in its directory changes nothing it
    reads, and a second run on its output directory from elsewhere is refused, naming this one."""
    from shardgen.config import content_fingerprint, validate

    # A KV cache of 32 MiB cannot hold one 1024-token sequence in float32 (53 MB are needed:
    # vllm/v1/core/kv_cache_utils.py); the retry doubles it to 64 MiB, which can.
    rows = 8
    config = one_shard_run(tmp_path, rows, kv_cache_memory_bytes=32 * 2**20)
    run = Background(tmp_path, config, "local")  # the local profile retries once
    run.wait_until(lambda: (checkpoints(tmp_path) / "attempts.jsonl").exists(), 300, "the first attempt")
    other = {**config, "sampling": {**config["sampling"], "max_tokens": 5}}
    assert dry_run_jobs(tmp_path, other).get("generate_shard") == 1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = run_workflow(elsewhere, {**config, "output": {"dir": str(tmp_path / "results")}}, "local", check=False)
    said = second.stdout + second.stderr
    assert second.returncode != 0
    in_use = rf"output.dir '.*results' is in use by another run \(process \d+ of \S+ on \S+, started .* in {tmp_path}\)"
    assert re.search(in_use, said), said[-3000:]
    run.wait()
    _, shard = results(tmp_path, rows)
    (failure,) = shard["memory_failures"]
    assert failure["kind"] == "kv_cache_too_small" and failure["stage"] == "engine start"
    assert failure["settings"]["kv_cache_memory_bytes"] == 32 * 2**20
    assert shard["memory_overrides"] == {"kv_cache_memory_bytes": 64 * 2**20}
    assert shard["engine"]["args"]["kv_cache_memory_bytes"] == 64 * 2**20
    assert [a["outcome"] for a in shard["attempts"]] == ["out_of_memory", "committed"]
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["config_fingerprint"] == content_fingerprint(validate(config)), "made under the run's own config"
    assert stats["provenance"]["sampling"]["max_tokens"] == 24 and stats["generated_tokens"] == rows * 24
