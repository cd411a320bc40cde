"""`shardgen status`: rows, rate, ETA and shards by state from the run's small files only."""

import datetime
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from shardgen.base.records import AttemptEnd, AttemptStart, Progress
from shardgen.cli import main
from shardgen.commands.status import format_status, read_status


def iso(t):
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def make_run(root, now):
    """Five shards of 100 rows: done, running fast, running slow, failed, pending."""
    (root / "plan").mkdir(parents=True)
    shards = [{"id": f"{i:05d}", "start": 100 * i, "stop": 100 * (i + 1), "segments": []} for i in range(5)]
    (root / "plan" / "manifest.json").write_text(json.dumps({"version": 1, "total_rows": 500, "shards": shards}))
    (root / "shards").mkdir()
    (root / "shards" / "00000.parquet").write_bytes(b"")
    stats = {"rows": 100, "rows_resumed": 40, "rows_generated": 60, "generation_seconds": 60.0,
             "error_reasons": {"prompt_too_long": 2}, "attempts": [{"ended": iso(now - 30)}]}  # fmt: skip
    (root / "shards" / "00000.stats.json").write_text(json.dumps(stats))

    def ckpt(shard, attempts, progress=None):
        d = root / "checkpoints" / shard
        d.mkdir(parents=True)
        (d / "attempts.jsonl").write_text("".join(a.line() + "\n" for a in attempts))
        if progress:
            (d / "progress.json").write_text(progress.text())

    start = AttemptStart(1, iso(now - 400), "gpu01", 11, {"job_id": "501"}, 0)
    ckpt("00001", [start], Progress(attempt=1, host="gpu01", pid=11, job_id="501", started=now - 101, time=now - 1,
                                    rows=100, done=60, resumed=10, saved=50,
                                    error_reasons={"rejected_by_engine": 1}))  # fmt: skip
    ckpt("00002", [replace(start, slurm={"job_id": "502"})],
         Progress(attempt=1, host="gpu01", pid=11, job_id="502", started=now - 400, time=now - 300, rows=100, done=5,
                  resumed=0, saved=0))  # fmt: skip
    ckpt("00003", [start, AttemptEnd("too_many_errors", error="TooManyErrors: 60 of 100")])


def test_status_counts_rows_and_shards_by_state_and_finds_the_slowest(tmp_path):
    now = time.time()
    make_run(tmp_path, now)
    st = read_status(tmp_path, window_s=600, squeue=False)
    assert [s.state for s in st.shards] == ["done", "running", "running", "failed", "pending"]
    assert (st.rows_done, st.rows_resumed, st.total_rows) == (100 + 60 + 5, 40 + 10, 500)
    # rows generated in the last 10 min: 60 (done shard) + 50 (running) + 5 (slow one)
    assert abs(st.rate() - 115 / 600) < 1e-6
    text = format_status(st)
    assert "rows: 165 of 500 done (33.0%), 50 of them from checkpoints" in text
    assert "shards: 1 done, 2 running, 1 pending, 1 failed" in text
    running = text.split("running (slowest first")[1].splitlines()
    assert running[1].lstrip().startswith("00002") and "silent 5 min" in running[1]  # slowest first
    assert "job 501 not in squeue on gpu01, attempt 1" in running[2]
    assert "00003  attempt 1: too_many_errors: TooManyErrors: 60 of 100" in text
    assert "row errors: 3 (prompt_too_long 2, rejected_by_engine 1)" in text
    assert "ETA" in text


def test_status_gives_running_shards_their_slurm_state_and_lists_only_this_runs_pending_jobs(tmp_path):
    make_run(tmp_path, time.time())
    here, other = str(tmp_path / "work"), str(tmp_path / "elsewhere")
    queue = "\n".join(  # squeue --me -h -o cluster.SQUEUE_FORMAT
        [
            f"501|RUNNING|None|run|rule_generate_shard_wildcards_00001|2026-12-03T10:00:00|{here}",
            f"503|PENDING|Priority|run|rule_generate_shard_wildcards_00004|2026-12-03T10:01:00|{here}",
            f"504|PENDING|PartitionConfig|run|rule_generate_shard_wildcards_00000|2026-12-03T10:01:00|{other}",
        ]
    )
    st = read_status(tmp_path, squeue=lambda: queue, workdir=here)
    assert st.jobs["501"] == "RUNNING"
    assert [job.job_id for job in st.pending] == ["503"], "another run's pending job is not this run's"
    text = format_status(st)
    assert "job 501 RUNNING on gpu01" in text
    assert "pending in Slurm: 1 job(s) of this run" in text
    assert "job 503 (rule_generate_shard_wildcards_00004), submitted 2026-12-03T10:01:00: Priority" in text


def test_status_reads_no_row_file(tmp_path):
    """It never opens a Parquet file: the committed shard's file here is not even valid Parquet."""
    make_run(tmp_path, time.time())
    assert read_status(tmp_path, squeue=False).shards[0].state == "done"


def test_the_status_command_prints_the_report_or_says_there_is_no_plan(tmp_path, capsys):
    make_run(tmp_path / "run", time.time())
    assert main(["status", "--dir", str(tmp_path / "run")]) == 0
    assert "shards: 1 done" in capsys.readouterr().out
    assert main(["status", "--dir", str(tmp_path / "none")]) == 1
    assert "has not planned" in capsys.readouterr().out


def test_status_reads_the_attempts_the_job_writes_and_any_failure_an_error_declares(tmp_path):
    """Records written by the job's own writer (ShardCheckpoint.log_attempt with records.attempt_end's outcome
    of each error), not by hand; a new kind of failure shows as failed, not pending."""
    import pyarrow as pa

    from shardgen.base.records import AttemptStart, attempt_end
    from shardgen.data.outputs import ShardCheckpoint
    from shardgen.errors import ShardgenError
    from shardgen.jobs.stopflag import Interrupted
    from shardgen.requests.results import ResultSpec

    class Preempted(ShardgenError):
        outcome = "preempted_for_good"

    shards = [{"id": f"{i:05d}", "start": 10 * i, "stop": 10 * (i + 1), "segments": []} for i in range(4)]
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "manifest.json").write_text(json.dumps({"version": 1, "total_rows": 40, "shards": shards}))
    schema = ResultSpec({}).schema(pa.schema([pa.field("text", pa.string())]), "fp", "cfg", "00000")
    ends = [RuntimeError("boom"), Preempted("gone"), Interrupted(15, "00002"), None]
    for shard, error in zip(shards, ends, strict=True):
        ck = ShardCheckpoint(tmp_path / "checkpoints" / shard["id"], shard["start"], shard["stop"], schema)
        ck.log_attempt(AttemptStart(1, "2026-01-01T00:00:00+00:00", "n1", 1, {"job_id": "7"}, 0))
        if error is not None:
            ck.log_attempt(attempt_end(error, rows_saved=0))
        ck.close()
    st = read_status(tmp_path, squeue=False)
    assert [s.state for s in st.shards] == ["failed", "failed", "pending", "running"]
    assert st.shards[0].error == "failed: RuntimeError: boom"
    assert st.shards[1].error == "preempted_for_good: Preempted: gone"


def _running(id, rows, done, rate, now):
    from shardgen.commands.status import ShardState

    started = now - (done / rate if rate else 0)
    span = (started, now, done) if rate else None
    return ShardState(id, rows, "running", done, 0, rate, span)


def test_the_eta_is_the_rows_left_at_the_runs_rate_unless_a_running_shard_ends_later():
    from shardgen.commands.status import RunStatus, ShardState

    now = time.time()
    # four shards of 1,000 rows at 1 row/s each over the last 100 s, and 2,000 rows pending:
    # 5,600 rows left at 4 rows/s take 1,400 s
    shards = [_running(f"{i:05d}", 1000, 100, 1.0, now) for i in range(4)]
    st = RunStatus(Path("/run"), [*shards, ShardState("00004", 2000)], now, 100.0, {})
    assert st.eta() == (pytest.approx(1400), [])
    text = format_status(st)
    assert "ETA 23 min" in text and "held up by" not in text
    # one shard runs at a tenth of the rate: its 900 rows left take 9,000 s at its own rate
    shards[2] = _running("00002", 1000, 100, 0.1, now)
    shards[2].span = (now - 100, now, 10)
    st = RunStatus(Path("/run"), [*shards, ShardState("00004", 2000)], now, 100.0, {})
    seconds, late = st.eta()
    assert seconds == pytest.approx(9000) and [(s.id, round(t)) for s, t in late] == [("00002", 9000)]
    text = format_status(st)
    assert "ETA 2.5 h" in text
    # the rest: 5,600 rows at 3.1 rows/s
    assert "held up by 1 running shard(s) that end after the rest (30 min at the run's rate)" in text
    assert "00002 (2.5 h left at 0.10 rows/s)" in text


def test_no_eta_without_a_rate():
    from shardgen.commands.status import RunStatus, ShardState

    now = time.time()
    st = RunStatus(Path("/run"), [ShardState("00000", 10), _running("00001", 10, 0, None, now)], now, 600.0, {})
    assert st.eta() is None and "ETA" not in format_status(st)


def test_a_split_shard_counts_each_piece_once_and_a_file_of_other_rows_not_at_all(tmp_path):
    """Shard 00004 cut at row 450: its pieces 00004 [400, 450) and 00004-450 [450, 500). The piece
    00004-450 is committed; 00004's file holds [400, 500), committed before the cut: not its rows."""
    now = time.time()
    make_run(tmp_path, now)
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "00004.450.cut").write_text("{}")
    for piece, start in (("00004", 400), ("00004-450", 450)):
        (tmp_path / "shards" / f"{piece}.parquet").write_bytes(b"")
        stats = {"rows": 500 - start, "row_start": start, "row_stop": 500, "rows_generated": 500 - start}
        (tmp_path / "shards" / f"{piece}.stats.json").write_text(json.dumps(stats))
    st = read_status(tmp_path, window_s=600, squeue=False)
    assert [(s.id, s.state) for s in st.shards][-2:] == [("00004", "pending"), ("00004-450", "done")]
    assert st.rows_done == 100 + 60 + 5 + 50, "the 50 rows of 00004-450 once"
