"""Python steps (``task: function``): a function named in the config, over each row, in worker processes.

A step with a ``function`` section (or a run with ``task: function``) runs no model: its shard jobs ask
for CPUs only, and each row of its input (in a run of steps: the rows the step before passed on) goes
to ``function.name`` of ``function.path`` (a file, relative to the config file) or ``function.module``.
It returns the row's new columns (``function.columns``, typed), or, with ``function.batch``, a column of
values per ``pyarrow.RecordBatch`` of rows. Everything else is a step's like any other: the plan, the
shards, the checkpoints, the exactly-once merge, the stats, ``select``.

Per row: an exception is the row's ``exception`` error (its type and first line), a row past
``function.timeout_seconds`` its ``timeout`` error (the worker process is killed and replaced: pebble's
``ProcessPool``), a value of the wrong type or a missing or undeclared column its ``wrong_type`` /
``missing_column`` / ``undeclared_column`` error naming the column; a worker that dies on a row
(``os._exit``, a crash) gives ``worker_died``. A batch that fails is run again row by row, so that only
the rows that fail get an error.

The run's fingerprint holds the digest of the function's file (a module's: its file and its
distribution's version, ``function_digest``): an edited function reruns its step and those after it,
nothing before it. The preflight (``check_rows``), on the machine the workflow starts on, imports the
function in a worker process as a job's are, and calls it there on a few sampled rows, each with its
timeout; never on a later step's (none exists yet), nor with ``function.preflight: false``.

The workers start from a forkserver (``_pool``): the job's process has threads (the claim heartbeat,
pebble's own), which a fork would copy with their locks held. What crosses back from a worker is plain
(typed values, texts, exceptions of this module): an exception pickle cannot rebuild in the job's
process would break the pool. A function that cannot load in a job's workers, or a pool that breaks,
is the attempt's failure (``FunctionFailed``), never a row's error.
"""

from __future__ import annotations

import inspect
import json
import logging
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pebble
import pyarrow as pa

from shardgen import config as cfg
from shardgen.base import pycode
from shardgen.data.stats import AttemptCounters
from shardgen.errors import ConfigError, RowError, ShardgenError, error_reason
from shardgen.jobs.feed.shard_loop import ShardLoop, ShardWork
from shardgen.requests import tasks
from shardgen.requests.results import DROPPED, RESERVED_COLUMNS, Columns

log = logging.getLogger(__name__)

# function.columns: each type's Arrow type (json: the value's JSON text)
TYPES = {"bool": pa.bool_(), "int64": pa.int64(), "float64": pa.float64(), "string": pa.string(), "json": pa.string()}
# How often the job looks at its stop flag and its checkpoint while rows run.
POLL_SECONDS = 0.5
# The preflight calls the function on at most this many sampled rows: each call is one more than once
# per row (a verifier may have side effects), and a few real rows find what a wrong function does.
PREFLIGHT_ROWS = 8
# The least time the preflight gives the function's import (a longer timeout_seconds gives it more): a
# slow import is no hang, and a job's worker imports it outside any row's timeout.
IMPORT_SECONDS = 60.0
# What the preflight waits for a call past its timeout, for pebble to report it.
LATE_SECONDS = 10.0


class FunctionFailed(ShardgenError):
    """The function cannot run in this job's worker processes (its import failed there, the pool of
    workers broke): the attempt's failure, naming the function, the error and the node. No row is an
    error of it: the next attempt runs the rows."""


class LoadFailed(Exception):
    """Raised in a worker whose function did not load; its one argument says why (picklable)."""


class FunctionRaised(Exception):
    """A batch call's exception as ``"<Type>: <first line>"``: what crosses back whatever the function
    raised (its own exception class may not unpickle in the job's process)."""


# -- The function -------------------------------------------------------------------------------------


def describe(spec: Mapping[str, Any]) -> str:
    """``<file or module>:<name>``, as messages name the function."""
    return pycode.describe(spec)


def function_digest(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies the function's code (``pycode.digest``).

    Raises:
        ConfigError: the file or module is not there.
    """
    return pycode.digest(spec, "function")


def load_function(spec: Mapping[str, Any]) -> Callable[[Any], Any]:
    """The function ``spec`` (``function``) names, imported here (its module's code runs).

    Raises:
        ConfigError: the file is missing or does not import (naming file and line), the name is not
            defined there, not a function, or does not take one argument.
    """
    fn = pycode.load(spec, "function")
    try:
        signature = inspect.signature(fn)
        signature.bind(None)
    except TypeError:
        what = "a pyarrow.RecordBatch" if spec.get("batch") else "a row (a dict of its columns)"
        where = spec.get("path") or spec.get("module")
        raise ConfigError(
            f"function.name: {spec['name']}{signature} ({where}, line {pycode.line_of(fn)}) must take one "
            f"argument, {what}"
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


# -- Values: what a function returns, typed per function.columns ------------------------------------------


def typed_value(column: str, kind: str, value: Any) -> Any:
    """``value`` as column ``column`` of type ``kind`` holds it (None stays None).

    Raises:
        RowError: ``wrong_type``, naming the column.
    """
    if value is None:
        return None
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):  # a numpy scalar
        try:
            value = value.item()
        except (ValueError, TypeError):
            pass
    ok = False
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int64":
        ok = isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    elif kind == "float64":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "string":
        ok = isinstance(value, str)
    elif kind == "json":
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RowError("wrong_type", f"column {column!r}: not a JSON value ({e})") from None
    if not ok:
        raise RowError("wrong_type", f"column {column!r}: {type(value).__name__} {value!r:.80}, not {kind}")
    # the plain type (a subclass of str or int may be of a module the job's process cannot unpickle)
    return {"bool": bool, "int64": int, "float64": float, "string": str}[kind](value)


def typed_row(out: Any, columns: Mapping[str, str]) -> dict[str, Any]:
    """A function's return for one row, as the row's new columns.

    Raises:
        RowError: not a dict, a declared column missing, an undeclared one, a value of another type.
    """
    if not isinstance(out, Mapping):
        raise RowError("wrong_type", f"returned a {type(out).__name__}, not a dict of the columns {list(columns)}")
    if missing := [c for c in columns if c not in out]:
        raise RowError("missing_column", f"returned no {', '.join(map(repr, missing))} (function.columns)")
    if extra := [str(c) for c in out if c not in columns]:
        raise RowError("undeclared_column", f"returned {', '.join(map(repr, extra))}, not in function.columns")
    return {c: typed_value(c, kind, out[c]) for c, kind in columns.items()}


def _values(column: Any, n: int, name: str) -> list[Any]:
    """A batch function's column as a list of ``n`` Python values."""
    if hasattr(column, "to_pylist"):
        column = column.to_pylist()
    elif hasattr(column, "tolist"):
        column = column.tolist()
    column = list(column)
    if len(column) != n:
        raise ValueError(f"column {name!r} has {len(column)} values for a batch of {n} rows")
    return column


# -- In the worker processes ------------------------------------------------------------------------------

_FUNCTION: Callable[[Any], Any] | None = None
_LOAD_ERROR: str | None = None  # why the function did not load in this worker


def _pool(spec: Mapping[str, Any], processes: int) -> pebble.ProcessPool:
    """``processes`` worker processes, each of which imports the function once as it starts (outside any
    row's timeout). ``forkserver``, as the rollout tools' pool: the caller has Python threads (the claim
    heartbeat, pebble's), which a fork would copy with a lock held. The server preloads this module, so
    a worker starts in tens of milliseconds, not half a second (its default, ``__main__``, is never
    preloaded in CPython 3.11: the key the forkserver passes is not the one it reads); its one other
    thread is then pyarrow's jemalloc background thread, which jemalloc's own fork handlers make safe.
    A worker gets the caller's environment, ``sys.path`` and working directory as they are now, as a
    forked one would (the server's are those of when it started)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__])  # read when the server starts (once a process)
    state = (dict(os.environ), list(sys.path), os.getcwd())
    return pebble.ProcessPool(max_workers=processes, initializer=_init_worker, initargs=(dict(spec), *state),
                              context=context)  # fmt: skip


def _init_worker(spec: Mapping[str, Any], environ: dict[str, str], path: list[str], cwd: str) -> None:
    """Load the function; a failure is kept, not raised: pebble would end the worker and break the pool, and
    every row's call reports it instead (``LoadFailed``), which the job makes its attempt's failure."""
    global _FUNCTION, _LOAD_ERROR
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    try:
        _FUNCTION = load_function(spec)
    except BaseException as e:  # noqa: BLE001 - a SystemExit at import too: it fails the attempt, by name
        raised = f"importing it raised {type(e).__name__}: {pycode.first_line(e)}"
        why = str(e) if isinstance(e, ConfigError) else raised
        _LOAD_ERROR = f"{why} (on {socket.gethostname()})"


def _loaded() -> str | None:
    """In a worker: why the function did not load, or None (the preflight's first task)."""
    return _LOAD_ERROR


def _call(rows: list[dict[str, Any]] | pa.RecordBatch, columns: Mapping[str, str]) -> list[tuple[str | None, Any]]:
    """In a worker: ``(error, columns)`` for each row, the function called once per row (a list of
    rows: one) or once for the batch (a RecordBatch: its failure is raised, ``FunctionRaised`` for the
    function's own exception, for the caller to run its rows one by one).

    Raises:
        LoadFailed: the function did not load in this worker.
    """
    if _LOAD_ERROR is not None:
        raise LoadFailed(_LOAD_ERROR)
    assert _FUNCTION is not None
    if isinstance(rows, pa.RecordBatch):
        try:
            out = _FUNCTION(rows)
        except BaseException as e:  # one that unpickles in the job's process, not the function's own
            raise FunctionRaised(f"{type(e).__name__}: {pycode.first_line(e)}") from e
        if not isinstance(out, Mapping):
            raise TypeError(f"returned a {type(out).__name__}, not a dict of columns")
        values = {str(c): _values(v, rows.num_rows, str(c)) for c, v in out.items()}
        per_row = [{c: v[i] for c, v in values.items()} for i in range(rows.num_rows)]
    else:
        per_row = []
        for row in rows:
            try:
                per_row.append(_FUNCTION(row))
            except BaseException as e:  # noqa: BLE001 - the row's error (sys.exit too): its type and first line
                per_row.append(RowError("exception", f"{type(e).__name__}: {pycode.first_line(e)}"))
    results: list[tuple[str | None, Any]] = []
    for out in per_row:
        try:
            if isinstance(out, RowError):
                raise out
            results.append((None, typed_row(out, columns)))
        except RowError as e:
            results.append((str(e), None))
    return results


# -- The task -------------------------------------------------------------------------------------------


class FunctionSpec(Columns):
    """The columns a function step adds: ``row_index``, the function's columns, ``error``."""

    def __init__(self, columns: Mapping[str, str]) -> None:
        self.columns = dict(columns)

    def fields(self) -> list[pa.Field]:
        return [pa.field("row_index", pa.int64(), nullable=False),
                *(pa.field(c, TYPES[k]) for c, k in self.columns.items()), pa.field("error", pa.string())]  # fmt: skip

    def error_rows(self, row: dict[str, Any], index: int, error: str | None, prompt_tokens: int | None = None) -> list:
        return [{**row, **dict.fromkeys(self.columns), "row_index": index, "error": error}]

    def row(self, row: dict[str, Any], index: int, values: dict[str, Any]) -> dict[str, Any]:
        return {**row, **values, "row_index": index, "error": None}


class FunctionTask(tasks.Task):
    """``task: function``: ``function`` over every row, in a CPU job of worker processes."""

    name = "function"
    uses_engine = False
    preflight_rows = PREFLIGHT_ROWS  # the preflight samples no more rows than it calls the function on
    spec: FunctionSpec

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        function = config.get("function")
        if not function:
            raise ConfigError("task: function needs a function section (function.path or function.module, and name)")
        reserved = sorted(set(function["columns"]) & {*RESERVED_COLUMNS, DROPPED})
        if reserved:
            raise ConfigError(f"function.columns: {reserved} are columns shardgen keeps for itself; rename them")
        if config.get("shards", {}).get("workers"):
            raise ConfigError("task: function runs a job per shard: drop shards.workers")
        function_digest(function)  # its file or module is there

    @classmethod
    def content(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The function's code (``function_digest``), name, columns and how it is called: not where its
        file is, how many processes run it, nor whether the preflight calls it."""
        function = config["function"]
        kept = {k: v for k, v in function.items() if k not in ("path", "processes", "preflight")}
        return {"task": cls.name, "function": kept, "code": function_digest(function)}

    @classmethod
    def columns(cls, config: Any, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> Columns:
        return FunctionSpec(config.raw["function"]["columns"])

    @classmethod
    def provenance(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The function: its name, columns and call settings, its code's digest, its file or module."""
        content, function = cls.content(config), config["function"]
        return {"function": {**content["function"], "code": content["code"], "path": function.get("path"),
                             "module": function.get("module")}}  # fmt: skip

    def __init__(self, config: Any, tokenizer: Any = None, head: Any = None) -> None:
        self.function = dict(config.raw["function"])
        self.spec = FunctionSpec(self.function["columns"])
        self.processes = self.function.get("processes") or len(os.sched_getaffinity(0))
        self.timeout = float(self.function["timeout_seconds"])

    def run_rows(self, work: ShardWork, stop: Callable[[], bool], counters: AttemptCounters) -> dict[str, Any]:
        return FunctionFeed(self, work, stop, counters).run()

    @classmethod
    def check_rows(cls, config: Any, rows: list[tuple[int, dict[str, Any]]], schema: pa.Schema) -> tuple:
        """``check_rows``; returns the problems, the notes and the preflight report's fields: how many
        times it called the function (``function_calls``) and, if it did not, why not."""
        spec = config.raw["function"]
        problems, notes, calls = check_rows(spec, rows, schema)
        if not spec.get("preflight", True):
            why = "function.preflight: false"
        elif config.input.step is not None:
            why = "a later step: its rows do not exist yet"
        else:
            why = None if rows else "no row to sample"
        return problems, notes, {"function_calls": calls} | ({"function_not_called": why} if why else {})


def check_rows(
    spec: Mapping[str, Any], rows: list[tuple[int, dict[str, Any]]], schema: pa.Schema
) -> tuple[list[str], list[str], int]:
    """The preflight of a function, in a worker process as a job runs it (``_pool``), never in this one:
    it imports the function (at most ``IMPORT_SECONDS``, or ``timeout_seconds`` if longer) and checks it
    takes one argument; then, unless ``function.preflight`` is false, calls it on up to
    ``PREFLIGHT_ROWS`` of ``rows`` (a sample of the input; none for a later step, whose rows do not
    exist yet), one at a time, each at most ``timeout_seconds``, and checks it returns the declared
    columns with their types. It stops calling after a row past its timeout or that ended its process,
    and once its calls took ``timeout_seconds`` in all.

    Returns:
        The problems (a function that cannot run: refused before any job), the notes (a row it
        raised on, stopped on or ended its process on, which only that row would suffer in the run),
        and how many times it called the function.
    """
    name, columns = describe(spec), spec["columns"]
    at = f"function {name}"
    timeout = float(spec.get("timeout_seconds") or 60)
    problems: list[str] = []
    notes: list[str] = []
    calls = 0
    pool = _pool(spec, 1)
    try:
        bound = max(timeout, IMPORT_SECONDS)
        try:
            why = _result(pool, pool.schedule(_loaded), bound)
        except FutureTimeout:
            why = (f"{at}: importing it took more than {bound:g} s in a worker process (function."
                   f"timeout_seconds, at least {IMPORT_SECONDS:g} s); a job's workers would hang as long")  # fmt: skip
        except (BrokenProcessPool, pebble.ProcessExpired) as e:
            why = (f"{at}: its worker process ended while importing it ({type(e).__name__}: "
                   f"{pycode.first_line(e)}); so would a job's")  # fmt: skip
        if why is not None:
            return [why], [], 0
        if not spec.get("preflight", True):
            return [], [], 0
        started = time.monotonic()
        for index, row in rows[:PREFLIGHT_ROWS]:
            if calls and time.monotonic() - started >= timeout:
                break
            row = {k: v for k, v in row.items() if k != DROPPED}
            arg: Any = [row]
            if spec.get("batch"):
                arg = pa.RecordBatch.from_pylist([row], schema=_without_dropped(schema))
            future = pool.schedule(_call, args=(arg, columns), timeout=timeout)
            calls += 1
            try:
                ((error, _),) = _result(pool, future, timeout + LATE_SECONDS)
            except FunctionRaised as e:
                error = str(RowError("exception", e.args[0]))
            except FutureTimeout:
                notes.append(f"{at} took more than function.timeout_seconds ({timeout:g} s) on row {index} (in "
                             "the run, that row's timeout error); the preflight called it on no more rows")  # fmt: skip
                break
            except (pebble.ProcessExpired, BrokenProcessPool) as e:
                code = f"exit code {e.exitcode}" if isinstance(e, pebble.ProcessExpired) else type(e).__name__
                notes.append(f"{at}: its process ended ({code}) on row {index} (in the run, that row's worker_died "
                             "error); the preflight called it on no more rows")  # fmt: skip
                break
            except (TypeError, ValueError) as e:  # a batch's return that is not a column per declared name
                problems.append(f"{at}: on row {index} (a batch of one row): {pycode.first_line(e)}; fix the "
                                "function or function.columns")  # fmt: skip
                break
            if error is None:
                continue
            reason, _, what = error.partition(": ")
            if error_reason(error) == "exception":
                notes.append(f"{at} raised on row {index}: {what} (in the run, that row's error)")
                continue
            problems.append(f"{at}: on row {index} it {what} [{reason}]; fix the function or function.columns")
            break
    finally:
        pool.stop()  # a worker still importing or on a row past its timeout is ended
        pool.join(timeout=LATE_SECONDS)
    return problems, notes, calls


def _result(pool: pebble.ProcessPool, future: Future, timeout: float) -> Any:
    """``future``'s result, waited for at most ``timeout`` seconds.

    Raises:
        BrokenProcessPool: the pool broke before it took the task (pebble aborts only the tasks it has
            taken: a worker that ends its process at import can break it first).
        TimeoutError: ``timeout`` passed; or the task's own (pebble's timeout), with ``future`` done.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=min(POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        except FutureTimeout:
            if future.done() or time.monotonic() >= deadline:
                raise
            if not pool.active:
                raise BrokenProcessPool("the pool stopped before it ran the task") from None


def _without_dropped(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f for f in schema if f.name != DROPPED])


# -- A shard's rows through the function ----------------------------------------------------------------


class FunctionFeed(ShardLoop):
    """One shard's remaining rows through the function in ``task.processes`` worker processes, up to
    two calls per process in flight, saved as they finish (``checkpoint.rows``/``seconds``), stopped by
    the job's stop flag after a last save (rows in flight then are the next attempt's)."""

    def __init__(self, task: FunctionTask, work: ShardWork, stop: Callable[[], bool], counters: AttemptCounters):
        super().__init__(work, counters)
        self.task, self.stop = task, stop
        self.batch = bool(task.function.get("batch"))
        self.batch_rows = int(task.function.get("batch_rows") or 64) if self.batch else 1
        self.schema = _without_dropped(work.schema) if work.schema is not None else None
        self.calls = self.retried_batches = 0

    def run(self) -> dict[str, Any]:
        """Run every remaining row; returns what the feed saw (the shard stats' ``feed``).

        Raises:
            TooManyErrors: the shard's errors passed ``errors.max_rate``.
            FunctionFailed: the function does not load in the workers, or their pool broke.
        """
        task = self.task
        pool = _pool(task.function, task.processes)
        pending: dict[Future, tuple[list[tuple[int, dict[str, Any]]], float]] = {}
        rows = iter(self.work.remaining)
        exhausted = False
        self._report_progress(time.time())
        try:
            while True:
                while not exhausted and len(pending) < 2 * task.processes and not self.stop():
                    chunk = self._next_chunk(rows)
                    exhausted = len(chunk) < self.batch_rows
                    if chunk:
                        self._submit(pool, pending, chunk, self.batch)
                if self.stop() or not pending:
                    break
                done, _ = wait(list(pending), timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                now = time.time()
                for future in done:
                    chunk, submitted = pending.pop(future)
                    self._done(pool, pending, future, chunk, submitted, now)
                if pending and not pool.active:  # broken before it took them: pebble aborts only those it took
                    raise self._failed(BrokenProcessPool("the pool stopped with calls still to run"))
                self._tick(now)
        finally:
            pool.stop()  # the rows still in flight are not saved: the next attempt runs them
            pool.join(timeout=10)
            self._end()
        return {"processes": task.processes, "calls": self.calls, "batch_rows": self.batch_rows,
                "batches_run_again_by_row": self.retried_batches}  # fmt: skip

    def _next_chunk(self, rows: Iterator[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``batch_rows`` rows for the function; a row the step before did not pass on is written
        as it is (``dropped``) and not called."""
        chunk = []
        for index, row in rows:
            if row.get(DROPPED) is not None:
                self._finished.extend(self.task.spec.error_rows(row, index, None))
                self._count_row()
                continue
            chunk.append((index, row))
            if len(chunk) >= self.batch_rows:
                break
        return chunk

    def _submit(self, pool: pebble.ProcessPool, pending: dict, chunk: list[tuple[int, dict[str, Any]]], batch: bool):
        columns = self.task.spec.columns
        if batch:
            plain = [{k: v for k, v in row.items() if k != DROPPED} for _, row in chunk]
            arg: Any = pa.RecordBatch.from_pylist(plain, schema=self.schema)
        else:
            ((_, row),) = chunk
            arg = [{k: v for k, v in row.items() if k != DROPPED}]
        try:
            future = pool.schedule(_call, args=(arg, columns), timeout=self.task.timeout * len(chunk))
        except RuntimeError as e:  # pebble's pool broke ("Unexpected error within the Pool"): no row's doing
            raise self._failed(e) from e
        pending[future] = (chunk, time.time())
        self.calls += 1

    def _done(self, pool, pending, future: Future, chunk, submitted: float, now: float) -> None:
        try:
            results = future.result()
        except (LoadFailed, BrokenProcessPool) as e:  # the attempt's failure: no row of it is saved
            raise self._failed(e) from e
        except Exception as e:  # noqa: BLE001 - the function's, its timeout, or its process dying
            if len(chunk) > 1:  # a batch: each of its rows on its own, so only those that fail are errors
                self.retried_batches += 1
                for item in chunk:
                    self._submit(pool, pending, [item], True)
                return
            results = [(self._call_error(e), None)]
        seconds = (now - submitted) / len(chunk)
        for (index, row), (error, values) in zip(chunk, results, strict=True):
            if error is not None:
                self._finished.extend(self.task.spec.error_rows(row, index, error))
                self.work.budget.add(index, error)
            else:
                self._finished.append(self.task.spec.row(row, index, values))
            self.counters.requests += 1
            self.counters.latency.add(seconds)
            self._count_row()

    def _failed(self, e: BaseException) -> FunctionFailed:
        name = describe(self.task.function)
        if isinstance(e, LoadFailed):
            why = f"it does not load in this job's worker processes: {e.args[0]}"
        else:
            why = (
                f"the pool of its worker processes on {socket.gethostname()} broke ({type(e).__name__}: "
                f"{pycode.first_line(e)}; a worker that ended its process importing the function?)"
            )
        return FunctionFailed(f"function {name}: {why}. No row is an error of it: fix the environment the jobs "
                              "run in, and the next attempt runs the rows")  # fmt: skip

    def _call_error(self, e: BaseException) -> str:
        name = describe(self.task.function)
        if isinstance(e, FunctionRaised):
            return str(RowError("exception", e.args[0]))
        if isinstance(e, FutureTimeout):
            return str(RowError("timeout", f"{name} took more than function.timeout_seconds "
                                           f"({self.task.timeout:g} s); its process was replaced"))  # fmt: skip
        if isinstance(e, pebble.ProcessExpired):
            return str(RowError("worker_died", f"{name}: its process ended on this row (exit code {e.exitcode})"))
        return str(RowError("exception", f"{type(e).__name__}: {pycode.first_line(e)}"))


def check_task(config: dict[str, Any]) -> None:
    """A ``function`` section belongs to ``task: function``.

    Raises:
        ConfigError: it is set with another task.
    """
    if config.get("function") and config.get("task") != FunctionTask.name:
        raise ConfigError(f"function is set, but task is {config.get('task')}: a function runs as task: function")


def resolve_path(config: dict[str, Any], base: Path) -> None:
    """``function.path`` (top level and in each step) relative to the config file's directory."""
    for section in pycode.sections(config):
        pycode.resolve_path(section.get("function"), base)


# task: function is a task like the others (config asks tasks.KINDS); its path is relative to the config file.
tasks.KINDS[FunctionTask.name] = FunctionTask
cfg.register_tasks({FunctionTask.name: FunctionTask})
cfg.register_path_resolver(resolve_path)
cfg.register_check(check_task)
