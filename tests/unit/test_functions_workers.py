"""A Python step's worker processes (``functions.FunctionFeed``): a function that cannot load in the job's
workers, or a pool that breaks, fails the attempt by name and saves nothing of it; an exception pickle cannot
rebuild is its row's error; the workers start from a forkserver, with the job's environment.

Bounded by ``SIGALRM`` (``bounded``): before the fixes, some of these hung."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig
from shardgen.errors import ShardgenError
from shardgen.features import functions
from tests.unit.test_functions import function_config, run

pytestmark = pytest.mark.usefixtures("bounded")  # a hang fails its test within a minute


BREAKS = {
    # a package missing on the compute node, only there (the variable stands for the node)
    "import": "import os\nif os.environ.get('BREAK_IMPORT'):\n    import no_such_package_on_this_node\n",
    # a module whose import ends its process (a crash in a C extension)
    "exit": "import os\nif os.environ.get('BREAK_IMPORT'):\n    os._exit(1)\n",
}
GOOD = "\ndef check(row):\n    return {'even': row['n'] % 2 == 0, 'half': row['n'] / 2}\n"


@pytest.mark.parametrize("how", sorted(BREAKS))
def test_a_function_that_cannot_load_in_the_workers_fails_the_attempt_and_saves_no_row(tmp_path, monkeypatch, how):
    """Even with ``errors.max_rate: 1`` (function_config's), no row gets an error the function never raised;
    once the environment is fixed, the next attempt runs every row."""
    (tmp_path / "check.py").write_text(BREAKS[how] + GOOD)
    config = function_config(tmp_path)
    monkeypatch.setenv("BREAK_IMPORT", "1")
    with pytest.raises(ShardgenError) as failed:
        run(config)
    message = str(failed.value)
    assert isinstance(failed.value, functions.FunctionFailed), message
    assert f"{tmp_path / 'check.py'}:check" in message and socket.gethostname() in message
    if how == "import":
        assert "ModuleNotFoundError: No module named 'no_such_package_on_this_node'" in message
    else:
        assert "BrokenProcessPool" in message
    assert not RunDir(config.output.dir).shard_file("00000").exists()
    monkeypatch.delenv("BREAK_IMPORT")
    rows, stats = run(config)
    assert stats["rows_resumed"] == 0 and stats["errors"] == 0 and len(rows) == 12  # nothing of it was saved
    first = stats["attempts"][0]
    assert first["outcome"] == "failed" and first["error"].startswith("FunctionFailed: "), first


ODD = """\
class Odd(Exception):
    def __init__(self, what, where):  # two required arguments: pickle cannot rebuild it
        super().__init__(f"{what} at {where}")
        self.what, self.where = what, where


def double(batch):
    if 6 in batch.column("n").to_pylist():
        raise Odd("a bad value\\nmore", 6)
    return {"twice": [2 * n for n in batch.column("n").to_pylist()]}
"""


@pytest.mark.parametrize("by", ["path", "module"])
def test_an_exception_pickle_cannot_rebuild_is_its_rows_error_and_the_other_rows_go_on(tmp_path, monkeypatch, by):
    """``function.batch``: the batch with row 6 fails, then row 6 alone; by ``module`` the parent can import
    the class (pickle fails on its arguments), by ``path`` it cannot import the module at all."""
    (tmp_path / "odd_step.py").write_text(ODD)
    (tmp_path / "check.py").write_text("")
    where: dict[str, Any] = {"path": str(tmp_path / "odd_step.py")}
    if by == "module":
        monkeypatch.syspath_prepend(str(tmp_path))
        where = {"module": "odd_step", "path": None}
    config = function_config(tmp_path, rows=10, name="double", batch=True, batch_rows=4, columns={"twice": "int64"})
    raw = dict(config.raw)
    raw["function"] = {k: v for k, v in ({**raw["function"], **where}).items() if v is not None}
    rows, stats = run(RunConfig.from_dict(raw))
    assert rows[6]["error"] == "exception: Odd: a bad value"
    assert [r["twice"] for r in rows] == [0, 2, 4, 6, 8, 10, None, 14, 16, 18]
    assert stats["feed"]["batches_run_again_by_row"] == 1 and stats["errors"] == 1


def test_a_function_that_exits_is_its_rows_error_not_the_jobs_end(tmp_path):
    """``sys.exit`` in the function (a SystemExit, not an Exception) is the row's error."""
    (tmp_path / "check.py").write_text("import sys\n\ndef check(row):\n    if row['n'] == 3:\n        sys.exit('no')\n"
                                       "    return {'even': True, 'half': 0.5}\n")  # fmt: skip
    rows, stats = run(function_config(tmp_path))
    assert rows[3]["error"] == "exception: SystemExit: no" and stats["errors"] == 1


WHERE = """\
import os

def where(row):
    return {"ppid": os.getppid(), "mark": os.environ.get("SHARDGEN_TEST_MARK"), "cwd": os.getcwd()}
"""


def test_the_workers_start_from_a_forkserver_with_the_jobs_environment(tmp_path, monkeypatch):
    """Not forked from the job (its threads' locks); still with its environment, working directory and
    ``sys.path``, as they are when the pool starts, not when the forkserver did."""
    (tmp_path / "check.py").write_text(WHERE)
    columns = {"ppid": "int64", "mark": "string", "cwd": "string"}
    for i in range(2):  # the second after the forkserver started, with another environment
        here = tmp_path / f"run{i}"
        here.mkdir()
        monkeypatch.chdir(here)
        monkeypatch.setenv("SHARDGEN_TEST_MARK", f"mark {i}")
        config = function_config(tmp_path, name="where", columns=columns, rows=4)
        raw = dict(config.raw) | {"output": {**config.raw["output"], "dir": str(here / "results")}}
        rows, _ = run(RunConfig.from_dict(raw))
        assert {r["mark"] for r in rows} == {f"mark {i}"} and {r["cwd"] for r in rows} == {str(here)}
        assert os.getpid() not in {r["ppid"] for r in rows}  # a forkserver's children, not this process's


def test_a_module_function_loads_in_the_workers_from_the_jobs_sys_path(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_checks.py").write_text(GOOD)
    (tmp_path / "check.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    raw = dict(function_config(tmp_path).raw)
    raw["function"] = {k: v for k, v in raw["function"].items() if k != "path"} | {"module": "my_checks"}
    rows, stats = run(RunConfig.from_dict(raw))
    assert stats["errors"] == 0 and rows[5]["half"] == 2.5
