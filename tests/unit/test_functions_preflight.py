"""The preflight of a Python step (``functions.check_rows``): the user's function runs in a worker process
with the step's timeout, import included, on a few sampled rows; a row that hangs or ends its process is a
note, never a hung or killed preflight; a later step's function and one with ``function.preflight: false``
are imported and checked, never called; the calls are counted in the report and the step's stats.

The preflights that could hang or end their process before the fix run in a process of their own, bounded
by ``subprocess.run``'s timeout; the others are bounded by ``SIGALRM`` (``bounded``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig
from shardgen.data.plan import write_manifest
from shardgen.features import functions
from shardgen.jobs import preflight
from tests.unit.test_functions import calls, function_config

# The longest any test here may take; what it checks ends in a few seconds.
pytestmark = pytest.mark.usefixtures("bounded")  # a hang fails its test within a minute

COUNTED = """\
import os, time

def check(row):
    with open(os.environ["CALLS_FILE"], "a") as f:  # one line per call: the test counts them
        f.write(f"{row['n']}\\n")
    n = row["n"]
BODY
    return {"even": n % 2 == 0, "half": n / 2}
"""


def counted(body: str) -> str:
    """A function that writes each call's row to CALLS_FILE, then runs ``body`` (indented)."""
    return COUNTED.replace("BODY\n", textwrap.indent(textwrap.dedent(body), "    "))


def planned(tmp_path: Path, source: str, rows: int = 12, **function: Any) -> RunConfig:
    (tmp_path / "check.py").write_text(source)
    config = function_config(tmp_path, rows=rows, **function)
    write_manifest(config, RunDir(config.output.dir).manifest)
    return config


def preflight_process(tmp_path: Path, config: RunConfig, setup: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    """``shardgen preflight`` in a process of its own (``setup``: Python run before it), bounded; returns the
    process and its report (empty when it wrote none)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.raw))
    run_dir = RunDir(config.output.dir)
    argv = ["preflight", "--config", str(path), "--manifest", str(run_dir.manifest), "--report", str(run_dir.preflight)]
    code = f"{setup}\nfrom shardgen.cli import main\nraise SystemExit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45,
                          env=os.environ | {"CALLS_FILE": str(tmp_path / "calls")})  # fmt: skip
    report = json.loads(run_dir.preflight.read_text()) if run_dir.preflight.exists() else {}
    return proc, report


def test_a_row_that_never_returns_is_a_note_and_the_preflight_stops_calling(tmp_path):
    config = planned(tmp_path, counted("if n == 2:\n    time.sleep(3600)\n"), timeout_seconds=2)
    proc, report = preflight_process(tmp_path, config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls(tmp_path / "calls") == [0, 1, 2]  # not one call after the first timeout
    assert report["function_calls"] == 3
    (note,) = [w for w in report["warnings"] if "row 2" in w]
    assert "took more than function.timeout_seconds (2 s)" in note and "that row's timeout error" in note
    assert "preflight: ok" in proc.stdout and "3 call(s) of the function" in proc.stdout


def test_a_row_that_ends_its_process_is_a_note_not_the_preflights_end(tmp_path):
    config = planned(tmp_path, counted("if n == 1:\n    os._exit(3)\n"))
    proc, report = preflight_process(tmp_path, config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls(tmp_path / "calls") == [0, 1]
    (note,) = [w for w in report["warnings"] if "row 1" in w]
    assert "its process ended (exit code 3)" in note and "that row's worker_died error" in note
    assert report["function_calls"] == 2


def test_a_module_that_hangs_at_import_is_a_problem_not_a_hung_preflight(tmp_path):
    source = "import time\ntime.sleep(3600)\n\ndef check(row):\n    return {'even': True, 'half': 0.5}\n"
    config = planned(tmp_path, source, timeout_seconds=1)
    proc, report = preflight_process(tmp_path, config, "import shardgen.features.functions as f\nf.IMPORT_SECONDS = 1")
    assert proc.returncode != 0 and not report
    assert "importing it took more than 1 s" in proc.stderr and "check.py:check" in proc.stderr


def test_a_module_that_ends_its_process_at_import_is_a_problem_not_the_preflights_end(tmp_path):
    source = "import os\nos._exit(4)\n\ndef check(row):\n    return {'even': True, 'half': 0.5}\n"
    proc, report = preflight_process(tmp_path, planned(tmp_path, source))
    assert proc.returncode == 2 and not report, proc.stdout + proc.stderr  # shardgen's error, not the exit 4
    assert "its worker process ended while importing it" in proc.stderr and "check.py:check" in proc.stderr


def test_the_preflight_calls_a_few_sampled_rows_and_counts_its_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    config = planned(tmp_path, counted(""), rows=300, timeout_seconds=5)
    config = RunConfig.from_dict(dict(config.raw) | {"shards": {"rows_per_shard": 30}})
    write_manifest(config, RunDir(config.output.dir).manifest)
    report = preflight.run(config, RunDir(config.output.dir).manifest)
    made = calls(tmp_path / "calls")
    assert len(made) == 8, made
    assert len(made) == functions.PREFLIGHT_ROWS == report["function_calls"] == report["sampled_rows"]
    assert len({n // 30 for n in made}) == len(made)  # each from a shard of its own, spread over the input
    assert "8 call(s) of the function on 8 sampled row(s)" in preflight.report_text(report)


def test_the_preflight_stops_calling_once_its_calls_took_the_timeout_in_all(tmp_path, monkeypatch):
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    config = planned(tmp_path, counted("time.sleep(0.7)\n"), timeout_seconds=2)
    report = preflight.run(config, RunDir(config.output.dir).manifest)
    assert len(calls(tmp_path / "calls")) == 3 == report["function_calls"]  # 0.7, 1.4, 2.1 s in all: stop


SCHEMA = pa.schema([("n", pa.int64()), ("generation", pa.string())])


def test_a_later_steps_function_is_imported_and_checked_but_never_called(tmp_path, monkeypatch):
    """No row of a later step exists at the preflight: an invented one proves little, and would be a call
    more than once per row."""
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    (tmp_path / "check.py").write_text(counted("raise ValueError('a placeholder row is not a row')\n"))
    spec = {"path": str(tmp_path / "check.py"), "name": "check", "columns": {"even": "bool", "half": "float64"},
            "timeout_seconds": 5}  # fmt: skip
    assert functions.check_rows(spec, [], SCHEMA) == ([], [], 0)
    later = SimpleNamespace(raw={"function": spec}, input=SimpleNamespace(step={"name": "draft"}))
    _, _, fields = functions.FunctionTask.check_rows(later, [], SCHEMA)
    assert fields == {"function_calls": 0, "function_not_called": "a later step: its rows do not exist yet"}
    assert calls(tmp_path / "calls") == []
    (tmp_path / "two.py").write_text("def check(row, extra):\n    return {}\n")
    problems, _, made = functions.check_rows(spec | {"path": str(tmp_path / "two.py")}, [], SCHEMA)
    assert made == 0 and "check(row, extra)" in problems[0] and "must take one argument" in problems[0]


def test_function_preflight_false_imports_and_checks_it_in_a_worker_but_never_calls_it(tmp_path, monkeypatch):
    """A verifier with side effects (a sandbox, a paid judge) says: do not call me at preflight."""
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    config = planned(tmp_path, counted(""), preflight=False)
    report = preflight.run(config, RunDir(config.output.dir).manifest)
    assert report["ok"] and report["function_calls"] == 0 and calls(tmp_path / "calls") == []
    assert "not called (function.preflight: false)" in preflight.report_text(report)
    called = {**config.raw, "function": {k: v for k, v in config.raw["function"].items() if k != "preflight"}}
    assert RunConfig.from_dict(called).fingerprint == config.fingerprint  # not what the function computes
    (tmp_path / "check.py").write_text("import no_such_module_here\n")
    with pytest.raises(preflight.PreflightError, match="ModuleNotFoundError"):
        preflight.run(config, RunDir(config.output.dir).manifest)


def test_the_merged_stats_count_the_functions_calls_the_preflights_included(tmp_path, monkeypatch):
    from shardgen.jobs.merge import merge
    from tests.unit.test_functions import run

    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    config = planned(tmp_path, counted(""))
    run_dir = RunDir(config.output.dir)
    preflight.main_preflight(config, str(run_dir.manifest), str(run_dir.preflight))
    run(config)
    stats = merge(config, run_dir.manifest, tmp_path / "out.parquet", tmp_path / "stats.json")
    assert stats["function_calls"] == {"preflight": 8, "shards": 12, "total": 20} == {
        **json.loads((tmp_path / "stats.json").read_text())["function_calls"]}  # fmt: skip
    assert len(calls(tmp_path / "calls")) == 20


def test_a_batch_functions_preflight_calls_it_on_batches_of_one_row(tmp_path):
    """Its own exception (one pickle cannot rebuild) is a note; a column of the wrong length, a problem."""
    source = textwrap.dedent("""\
        class Odd(Exception):
            def __init__(self, what, where):
                super().__init__(f"{what} at {where}")

        def check(batch):
            n = batch.column("n").to_pylist()
            if n == [1]:
                raise Odd("not one", 1)
            return {"even": [x % 2 == 0 for x in n] * (2 if n == [3] else 1), "half": [x / 2 for x in n]}
        """)
    config = planned(tmp_path, source, batch=True)
    with pytest.raises(preflight.PreflightError, match=r"on row 3 \(a batch of one row\): column 'even' has 2 values"):
        preflight.run(config, RunDir(config.output.dir).manifest)
    sample = [(i, {"id": f"r{i}", "topic": "t", "n": i}) for i in range(3)]
    schema = pa.schema([("id", pa.string()), ("topic", pa.string()), ("n", pa.int64())])
    problems, notes, made = functions.check_rows(config.raw["function"], sample, schema)
    assert problems == [] and made == 3 and notes == [f"function {tmp_path / 'check.py'}:check raised on row 1: "
                                                      "Odd: not one at 1 (in the run, that row's error)"]  # fmt: skip
