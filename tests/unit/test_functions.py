"""Python steps (``task: function``, shardgen.features.functions): the function over a shard's rows in worker
processes, per-row errors, resume, the fingerprint of its code, and the preflight's refusals. (Through
the Slurm profile after the real engine: tests/integration/test_workflow.py, the function step test.)"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shardgen import config as cfg
from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig
from shardgen.data.plan import write_manifest
from shardgen.errors import ConfigError
from shardgen.features import functions
from shardgen.jobs import preflight
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import make_rows, write_parquet

CHECK = """\
import os, time

def check(row):
    with open(os.environ["CALLS_FILE"], "a") as f:  # one line per call: the test counts them
        f.write(f"{row['n']}\\n")
    n = row["n"]
    if n == 3:
        raise ValueError("no threes\\nsecond line")
    if n == 5:
        time.sleep(60)
    if n == 7:
        return {"even": "yes", "half": 3.5}
    if n == 9:
        return {"even": False}
    return {"even": n % 2 == 0, "half": n / 2}
"""


def function_config(tmp_path: Path, rows: int = 12, **function: Any) -> RunConfig:
    data = write_parquet(tmp_path / "in.parquet", make_rows(rows))
    spec = {"path": "check.py", "name": "check", "columns": {"even": "bool", "half": "float64"},
            "timeout_seconds": 2, "processes": 2} | function  # fmt: skip
    raw = {"input": {"parquet": [str(data)]}, "task": "function", "function": spec,
           "shards": {"rows_per_shard": 100}, "errors": {"max_rate": 1.0},
           "output": {"dir": str(tmp_path / "results")}}  # fmt: skip
    return RunConfig.from_dict(cfg.resolve_paths(raw, tmp_path))


def run(config: RunConfig, context: JobContext | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_dir = RunDir(config.output.dir)
    if not run_dir.manifest.exists():
        write_manifest(config, run_dir.manifest)
    stats = run_shard(config, run_dir.manifest, "00000", run_dir.shard_file("00000"), run_dir.shard_stats("00000"),
                      context)  # fmt: skip
    return pq.read_table(run_dir.shard_file("00000")).to_pylist(), stats


def calls(path: Path) -> list[int]:
    return sorted(int(x) for x in path.read_text().split()) if path.exists() else []


def test_a_function_step_gives_each_row_its_columns_and_a_bad_row_only_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    (tmp_path / "check.py").write_text(CHECK)
    rows, stats = run(function_config(tmp_path))
    by_n = {r["n"]: r for r in rows}
    assert [r["row_index"] for r in rows] == list(range(12))
    assert by_n[4]["even"] is True and by_n[4]["half"] == 2.0 and by_n[4]["error"] is None
    assert by_n[3]["error"] == "exception: ValueError: no threes"
    assert by_n[5]["error"].startswith("timeout: ") and "timeout_seconds (2 s)" in by_n[5]["error"]
    assert by_n[7]["error"] == "wrong_type: column 'even': str 'yes', not bool"
    assert by_n[9]["error"] == "missing_column: returned no 'half' (function.columns)"
    assert by_n[3]["even"] is None and by_n[3]["topic"] == "clocks"  # the input's columns kept
    assert calls(tmp_path / "calls") == list(range(12))  # once per row, the stuck one's process replaced
    assert stats["errors"] == 4 and stats["error_reasons"] == {
        "exception": 1, "timeout": 1, "wrong_type": 1, "missing_column": 1}  # fmt: skip
    assert stats["gpus"] == 0 and stats["gpu_hours"] == 0 and stats["rows"] == 12
    assert stats["feed"]["processes"] == 2 and stats["feed"]["calls"] == 12


BATCH = """\
import pyarrow.compute as pc

def double(batch):
    if batch.num_rows == 1 and batch.column("n")[0].as_py() == 6:
        raise RuntimeError("row 6 itself")
    if 6 in batch.column("n").to_pylist():
        raise RuntimeError("a batch with row 6")
    return {"twice": pc.multiply(batch.column("n"), 2), "meta": [{"n": n} for n in batch.column("n").to_pylist()]}
"""


def test_a_batch_function_that_fails_is_run_again_row_by_row_so_only_the_failing_row_is_an_error(tmp_path):
    (tmp_path / "check.py").write_text(BATCH)
    config = function_config(tmp_path, rows=10, name="double", batch=True, batch_rows=4,
                             columns={"twice": "int64", "meta": "json"})  # fmt: skip
    rows, stats = run(config)
    assert [r["twice"] for r in rows] == [0, 2, 4, 6, 8, 10, None, 14, 16, 18]
    assert rows[6]["error"] == "exception: RuntimeError: row 6 itself"
    assert json.loads(rows[2]["meta"]) == {"n": 2}
    assert stats["feed"]["batches_run_again_by_row"] == 1 and stats["feed"]["calls"] == 3 + 4


def test_a_stopped_function_job_resumes_without_calling_the_function_on_saved_rows_again(tmp_path, monkeypatch):
    """Row 10's call sends the job SIGTERM (as Slurm's time limit would): the rows finished are saved, the
    next attempt calls the function on the others only."""
    from shardgen.jobs.stopflag import Interrupted

    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    monkeypatch.setenv("JOB_PID", str(os.getpid()))  # the workers are a forkserver's children, not the job's
    stopper = "    if n == 10 and not os.path.exists(os.environ['CALLS_FILE'] + '.stopped'):\n" \
              "        open(os.environ['CALLS_FILE'] + '.stopped', 'w').close()\n" \
              "        os.kill(int(os.environ['JOB_PID']), 15)\n"  # fmt: skip
    (tmp_path / "check.py").write_text(CHECK.replace('    n = row["n"]\n', '    n = row["n"]\n' + stopper))
    config = function_config(tmp_path, rows=40, processes=1)
    config = RunConfig.from_dict(dict(config.raw) | {"checkpoint": {"rows": 1, "seconds": 60}})
    with pytest.raises(Interrupted, match="SIGTERM"):
        run(config)
    first = calls(tmp_path / "calls")
    assert 10 in first and len(first) < 40
    rows, stats = run(config)
    assert [r["row_index"] for r in rows] == list(range(40))
    saved = stats["rows_resumed"]
    assert saved >= 10
    again = calls(tmp_path / "calls")
    assert len(again) - len(first) == 40 - saved  # the saved rows were not called again
    assert sorted(set(again)) == list(range(40))


def test_the_fingerprint_holds_the_functions_code_not_where_its_file_is(tmp_path):
    (tmp_path / "check.py").write_text(CHECK)
    config = function_config(tmp_path)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "check.py").write_text(CHECK)
    raw = json.loads(json.dumps(config.raw))
    raw["function"]["path"] = str(moved / "check.py")
    assert RunConfig.from_dict(raw).fingerprint == config.fingerprint
    raw["function"]["processes"] = 7  # how fast, not what
    assert RunConfig.from_dict(raw).fingerprint == config.fingerprint
    (moved / "check.py").write_text(CHECK + "\n# edited\n")
    assert RunConfig.from_dict(raw).fingerprint != config.fingerprint
    assert config.gpus == 0 and config.gpus_per_node == 0


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        (None, {}, r"function.path: cannot read .*check.py: No such file"),
        ("def check(row):\n    return {'even': True\n", {}, r"check.py, line 2: syntax error"),
        ("import no_such_module_here\n", {}, r"importing .*check.py failed at .*check.py, line 1: ModuleNotFound"),
        ("def other(row):\n    return {}\n", {}, r"defines no 'check' \(its functions: other\)"),
        ("def check(row, extra):\n    return {}\n", {}, r"check\(row, extra\) \(.*check.py, line 1\) must take one"),
        ("def check(row):\n    return {'even': True, 'half': 1.0, 'x': 1}\n", {}, r"undeclared_column"),
        ("def check(row):\n    return {'even': 1, 'half': 1.0}\n", {}, r"column 'even': int 1, not bool"),
    ],
)
def test_the_preflight_refuses_a_function_that_cannot_run_naming_file_and_line(tmp_path, source, spec, message):
    if source is not None:
        (tmp_path / "check.py").write_text(source)
    else:
        (tmp_path / "check.py").write_text("")
    config = function_config(tmp_path, **spec)
    if source is None:
        (tmp_path / "check.py").unlink()
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_dict(config.raw)  # its fingerprint reads the file: refused with the config
        return
    run_dir = RunDir(config.output.dir)
    write_manifest(config, run_dir.manifest)
    with pytest.raises(preflight.PreflightError, match=message):
        preflight.run(config, run_dir.manifest)


def test_a_function_that_raises_on_a_sample_row_is_a_note_of_the_preflight_not_a_refusal(tmp_path):
    (tmp_path / "check.py").write_text(
        textwrap.dedent("""\
        def check(row):
            if row["n"] == 0:
                raise KeyError("answer")
            return {"even": True, "half": 0.5}
        """)
    )
    config = function_config(tmp_path)
    run_dir = RunDir(config.output.dir)
    write_manifest(config, run_dir.manifest)
    report = preflight.run(config, run_dir.manifest)
    assert report["ok"] and "raised on row 0: KeyError" in report["warnings"][0]
    assert "no GPU" in preflight.report_text(report)


def test_function_columns_may_not_take_a_name_shardgen_keeps(tmp_path):
    (tmp_path / "check.py").write_text(CHECK)
    with pytest.raises(ConfigError, match=r"function.columns: \['error'\]"):
        function_config(tmp_path, columns={"error": "string"})


def test_typed_values_follow_the_declared_types():
    assert functions.typed_value("c", "float64", 3) == 3.0
    assert functions.typed_value("c", "json", {"a": [1, None]}) == '{"a": [1, null]}'
    assert functions.typed_value("c", "int64", None) is None
    with pytest.raises(Exception, match="not int64"):
        functions.typed_value("c", "int64", True)
    with pytest.raises(Exception, match="not a JSON value"):
        functions.typed_value("c", "json", float("nan"))


def test_a_function_section_needs_task_function_and_a_run_without_a_function_needs_a_model(tmp_path):
    (tmp_path / "check.py").write_text(CHECK)
    raw = dict(function_config(tmp_path).raw)
    with pytest.raises(ConfigError, match="function is set, but task is generate"):
        RunConfig.from_dict({**raw, "task": "generate", "model": {"model": "m"}})
    with pytest.raises(ConfigError, match="model: task generate runs a model"):
        RunConfig.from_dict({**raw, "task": "generate"})
