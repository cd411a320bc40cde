"""Checkpoint parts: atomic flushes, resume, and rejection of broken or foreign parts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen.base import records
from shardgen.base.records import AttemptEnd, AttemptStart
from shardgen.data.outputs import ShardCheckpoint
from shardgen.errors import InputError
from shardgen.requests.results import ResultSpec

INPUT = pa.schema([pa.field("text", pa.string())])


def rows(indexes) -> list[dict]:
    return [
        {
            "text": f"t{i}",
            "row_index": i,
            "generation": f"g{i}",
            "finish_reason": "stop",
            "prompt_tokens": 3,
            "generated_tokens": 2,
            "error": None,
        }
        for i in indexes
    ]


def checkpoint(tmp_path, fingerprint="fp1", start=10, stop=20) -> ShardCheckpoint:
    return ShardCheckpoint(tmp_path / "ck", start, stop, ResultSpec({}).schema(INPUT, fingerprint, "cfg", "00001"))


def test_a_restarted_shard_resumes_the_rows_of_its_parts(tmp_path):
    ck = checkpoint(tmp_path)
    ck.flush(rows([13, 11]))
    ck.flush(rows([10]))
    again = checkpoint(tmp_path)
    assert again.resume() == {10, 11, 13}
    again.flush(rows([12, 14, 15, 16, 17, 18, 19]))
    table = again.commit(tmp_path / "shard.parquet", lambda table: None)
    assert table.column("row_index").to_pylist() == list(range(10, 20))
    assert pq.read_table(tmp_path / "shard.parquet").column("generation").to_pylist()[0] == "g10"
    assert not (tmp_path / "ck").exists(), "parts are removed once the shard file is committed"


def test_a_truncated_part_is_discarded_and_its_rows_generated_again(tmp_path):
    ck = checkpoint(tmp_path)
    ck.flush(rows([10, 11]))
    ck.flush(rows([12, 13]))
    second = sorted((tmp_path / "ck").glob("part-*.parquet"))[1]
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])
    again = checkpoint(tmp_path)
    assert again.resume() == {10, 11}
    assert again.discarded and "unreadable" in again.discarded[0]
    assert not second.exists()


def test_parts_of_another_configuration_are_not_reused(tmp_path):
    checkpoint(tmp_path, fingerprint="old").flush(rows([10, 11]))
    again = checkpoint(tmp_path, fingerprint="new")
    assert again.resume() == set()
    assert "another configuration" in again.discarded[0]


def test_a_new_part_never_overwrites_an_old_one(tmp_path):
    checkpoint(tmp_path).flush(rows([10]))
    again = checkpoint(tmp_path)
    again.resume()
    again.flush(rows([11]))
    assert len(list((tmp_path / "ck").glob("part-*.parquet"))) == 2


def test_commit_refuses_an_incomplete_shard(tmp_path):
    ck = checkpoint(tmp_path)
    ck.flush(rows([10, 11]))
    with pytest.raises(InputError, match="8 missing"):
        ck.commit(tmp_path / "shard.parquet", lambda table: None)
    assert not (tmp_path / "shard.parquet").exists()


def test_the_error_budget_fails_as_soon_as_the_final_rate_must_exceed_the_limit():
    from shardgen.jobs.feed.shard_loop import ErrorBudget, TooManyErrors

    budget = ErrorBudget("00007", rows=20, max_rate=0.1)  # 2 errors allowed
    budget.add(3, "null_value: column 'x' is null")
    budget.add(5, "prompt_too_long: 2000 tokens")
    with pytest.raises(TooManyErrors, match=r"shard 00007: 3 of its 20 rows.*\(2\).*first: row 3: null_value"):
        budget.add(9, "null_value: column 'x' is null")
    with pytest.raises(TooManyErrors):
        ErrorBudget("00007", rows=20, max_rate=0.1, errors=3, first="row 1: x")
    ErrorBudget("00007", rows=20, max_rate=1.0, errors=20)  # 1 never fails


def test_a_symlinked_checkpoint_directory_is_refused_and_nothing_in_its_target_is_touched(tmp_path):
    """The reproduction: results/checkpoints linked to a directory holding a Spark part and notes."""
    from shardgen.base.io import UnsafePath

    results, other = tmp_path / "results", tmp_path / "spark-job"
    (other / "00001").mkdir(parents=True)
    spark = other / "00001" / "part-00000-1b2c-c000.snappy.parquet"
    spark.write_bytes(b"PAR1 not ours PAR1")
    (other / "00001" / "notes.txt").write_text("keep me")
    results.mkdir()
    (results / "checkpoints").symlink_to(other)
    schema = ResultSpec({}).schema(INPUT, "fp1", "cfg", "00001")
    ck = ShardCheckpoint(results / "checkpoints" / "00001", 10, 20, schema, below=results)
    with pytest.raises(UnsafePath, match="symlink"):
        ck.resume()
    assert spark.read_bytes() == b"PAR1 not ours PAR1" and (other / "00001" / "notes.txt").read_text() == "keep me"


def test_files_shardgen_did_not_write_are_left_alone_through_resume_and_commit(tmp_path):
    ck = checkpoint(tmp_path)
    ck.flush(rows(range(10, 15)))
    foreign = {
        "part-00000-1b2c-c000.snappy.parquet": b"spark",  # Spark's naming: not shardgen's
        "part-x.parquet": b"x",  # used to crash the job
        "notes.txt": b"mine",
    }
    for name, data in foreign.items():
        (tmp_path / "ck" / name).write_bytes(data)
    # a part of another shard, with shardgen's exact name: not this shard's to take or remove
    other = ShardCheckpoint(tmp_path / "elsewhere", 0, 10, ResultSpec({}).schema(INPUT, "fp1", "cfg", "00000"))
    other.flush(rows(range(0, 2)))
    (tmp_path / "elsewhere" / "part-000000.parquet").rename(tmp_path / "ck" / "part-000007.parquet")
    again = checkpoint(tmp_path)
    assert again.resume() == set(range(10, 15))
    assert sorted(again.foreign) == sorted([*foreign, "part-000007.parquet"])
    again.flush(rows(range(15, 20)))
    assert again.commit(tmp_path / "shard.parquet", lambda table: None).num_rows == 10
    left = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir() if p.name in foreign}
    assert left == foreign, "foreign files are kept as they were"
    assert {p.name for p in (tmp_path / "ck").iterdir()} == {*foreign, "part-000007.parquet"}


def test_a_part_that_cannot_be_reused_is_moved_aside_not_deleted(tmp_path):
    checkpoint(tmp_path, fingerprint="old").flush(rows([10, 11]))
    data = (tmp_path / "ck" / "part-000000.parquet").read_bytes()
    again = checkpoint(tmp_path, fingerprint="new")
    assert again.resume() == set()
    (moved,) = (tmp_path / "ck" / "discarded").iterdir()
    assert moved.name.endswith("-part-000000.parquet") and moved.read_bytes() == data
    assert "moved to discarded/" in again.discarded[0]


def start(attempt: int, host: str) -> AttemptStart:
    return AttemptStart(attempt, "2026-01-01T00:00:00+00:00", host, 1, {}, 0)


def test_each_attempt_is_recorded_with_how_it_ended(tmp_path):
    ck = checkpoint(tmp_path)
    ck.log_attempt(start(1, "n1"))
    ck.log_attempt(AttemptEnd("interrupted", signal="SIGTERM", rows_saved=4))
    ck.log_attempt(start(2, "n2"))  # killed without a word
    ck.log_attempt(start(3, "n3"))
    ck.dir.append_line("attempts.jsonl", '{"event": "end", "outcome": "fa')  # cut by a full disk: skipped
    attempts = checkpoint(tmp_path).attempts()
    assert [(a.attempt, a.host, a.outcome) for a in attempts] == [(1, "n1", "interrupted"), (2, "n2", None),
                                                                  (3, "n3", None)]  # fmt: skip
    assert (attempts[0].signal, attempts[0].rows_saved, attempts[1].rows_saved) == ("SIGTERM", 4, None)


def test_attempt_records_keep_the_fields_they_know_and_carry_their_version():
    line = start(1, "n1").line()
    assert json.loads(line)["v"] == records.VERSION
    later = json.dumps({**json.loads(line), "v": records.VERSION + 1, "gpu_clock_mhz": 1980})  # a later shardgen's
    (attempt,) = records.read_attempts(later + "\n" + AttemptEnd("committed").line())
    assert (attempt.attempt, attempt.outcome) == (1, "committed") and not attempt.failed
    assert records.read_progress("{not json") is None


def test_a_writer_that_lost_the_shard_records_nothing_in_the_new_owners_attempts(tmp_path):
    from shardgen.jobs.claims import ClaimLost

    old = checkpoint(tmp_path)
    old.log_attempt(start(1, "worker-0"))
    new = checkpoint(tmp_path)  # the worker that took the shard over after the lease
    new.log_attempt(start(1, "worker-1"))

    def lost():
        raise ClaimLost("shard 00001: worker 1 took it over")

    old.guard = lost  # the old worker wakes up
    with pytest.raises(ClaimLost):
        old.log_attempt(AttemptEnd("failed", error="boom"))
    last = checkpoint(tmp_path).attempts()[-1]
    assert (last.host, last.outcome) == ("worker-1", None), "still running"


def test_a_commit_that_fails_before_its_stats_are_written_keeps_the_parts_for_the_retry(tmp_path):
    ck = checkpoint(tmp_path)
    ck.resume()
    ck.flush(rows(range(10, 15)))
    ck.flush(rows(range(15, 20)))

    def full_disk(table):
        assert table.num_rows == 10 and (tmp_path / "shard.parquet").exists(), "the shard file comes first"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        ck.commit(tmp_path / "shard.parquet", full_disk)
    again = checkpoint(tmp_path)
    assert again.resume() == set(range(10, 20)), "the retry resumes every row"
    written = []
    again.commit(tmp_path / "shard.parquet", written.append)
    assert [t.num_rows for t in written] == [10] and not (tmp_path / "ck").exists()
