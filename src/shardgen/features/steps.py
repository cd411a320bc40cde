"""Runs of several steps (``steps:``): generate, then judge, then select, in one resumable run.

Each step is a shardgen run of its own under ``<output.dir>/steps/<name>/`` (its plan, shards,
checkpoints, claims, logs, merge and stats: the whole contract of ``rundir``), made from the run's
config by ``step_configs``: the step's sections over the top-level ones. The workflow includes the
Snakefile once per step (a Snakemake module each). A later step's input is the step before it
(``input.step``): shard i of a step reads the committed shard i of the step before, so steps
pipeline shard by shard, and its fingerprint holds the earlier step's, so a change reruns that step
and the ones after it, never the ones before.

Rows keep their place across steps. An earlier step's row ``r`` gives ``m`` rows (its samples), and
the next step's rows ``r * m`` to ``r * m + m - 1`` are those: a step's plan is the earlier step's
with every range times ``m`` (``step_manifest``), known before any of them ran. A row the earlier
step does not pass on (it has an error, or its ``select`` dropped it) still has its place: the next
step writes it with the reason in ``dropped`` and sends nothing to the engine (``feed.RowInputs``),
and its merge leaves it out. So a step's shards, checkpoints and exactly-once checks are a single
run's, with nothing known about the earlier step's results beforehand.

``select`` compares the rows that came from one input row of the run (``group``: a step's rows per
input row, the product of the earlier steps' samples).
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import statistics
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from jinja2.exceptions import TemplateSyntaxError

from shardgen import config as cfg
from shardgen.base.io import atomic_write_text
from shardgen.base.rundir import RunDir, committed_fingerprint
from shardgen.base.sandbox import BoundedSandbox, RenderBudget, TemplateTimeout
from shardgen.config import RunConfig, content_fingerprint, digest, validate
from shardgen.data import formats, plan, sources
from shardgen.data.card import write_card
from shardgen.data.manifest import MANIFEST_VERSION, Manifest, Segment
from shardgen.data.plan import check_columns
from shardgen.data.sources import Source
from shardgen.errors import ConfigError, InputError
from shardgen.models.fetch import load_record
from shardgen.models.heads import Head
from shardgen.requests.results import DROPPED, result_spec

# What a step may set; each replaces the top-level section of its name.
STEP_SECTIONS = ("task", "model", "function", "rollout", "prompt", "sampling", "pooling", "lora", "resources")
# An earlier step's columns that are its own bookkeeping, not passed on (its own output keeps them).
BOOKKEEPING = ("row_index", "finish_reason", "prompt_tokens", "generated_tokens", "reasoning_tokens", "error",
               "result_source", DROPPED)  # fmt: skip
OUTPUT_KEY = "output.dir"


def check_bookkeeping(columns: list[str], where: str) -> None:
    """The input of a run of steps has none of the steps' bookkeeping columns: a step does not pass
    them on, and reads the one before's ``dropped`` as why a row was not passed on (a user's values
    there would drop rows, or fail the next step).

    Raises:
        InputError: naming the columns and where they are.
    """
    if clash := sorted(set(columns) & set(BOOKKEEPING)):
        raise InputError(
            f"input: {where} has the column(s) {clash}, which a run of steps keeps for its own bookkeeping (a step "
            f"passes none of {', '.join(BOOKKEEPING)} on to the next, and '{DROPPED}' says why a row was not); "
            "rename them in the input"
        )


def step_dir(root: str, name: str) -> str:
    return str(Path(root) / "steps" / name)


def step_configs(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The configuration of each step of a ``steps`` config, validated: the top-level sections with
    the step's over them, its own ``output.dir``, and (after the first) the step before as ``input``.

    Raises:
        ConfigError: naming the step and the key.
    """
    root = config["output"]["dir"]
    if config.get("rollout"):
        raise ConfigError("rollout: in a run of steps, it goes in the step that runs conversations (steps[i].rollout)")
    base = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("steps", "step")}
    shards = config.get("shards") or {}
    if shards.get("workers") or shards.get("per_job", 1) > 1:
        raise ConfigError(
            "steps: a run of steps runs one job per shard, each starting when the step before committed the "
            "same shard; drop shards.workers and shards.per_job"
        )
    if config["output"].get("format") == "openai_batch" or config["output"].get("push_to_hub"):
        raise ConfigError(
            "steps: a run of steps writes output.format parquet, jsonl or hf, and does not push to the hub "
            "(push <output.dir>/output.* yourself)"
        )
    steps = config["steps"]
    names = [s["name"] for s in steps]
    if len(set(names)) < len(names):
        raise ConfigError(f"steps: two steps named {next(n for n in names if names.count(n) > 1)!r}")
    out: list[dict[str, Any]] = []
    group = 1
    for index, step in enumerate(steps):
        name = step["name"]
        c = copy.deepcopy(base)
        for key in STEP_SECTIONS:
            if key in step:
                c[key] = copy.deepcopy(step[key])
        if "function" in step:  # a Python step (shardgen.features.functions): no model
            if step.get("task", "function") != "function":
                raise ConfigError(f"steps[{index}] ({name}): function is for task: function, not {step['task']}")
            c["task"] = "function"
            c.pop("model", None)
        elif c.get("task") == "function":
            raise ConfigError(f"steps[{index}] ({name}): task: function needs the step's own function section")
        elif "model" not in c:
            raise ConfigError(f"steps[{index}] ({name}): no model: set model in the step or at the top level")
        c["output"] = {k: v for k, v in c.get("output", {}).items() if k not in ("samples", "choice_probs")}
        c["output"] |= dict(step.get("output") or {}) | {"dir": step_dir(root, name), "format": "parquet"}
        c["output"].pop("push_to_hub", None)
        c["output"].pop("upload", None)  # the run's output is uploaded (steps.smk), not each step's
        select = step.get("select")
        if select and "pairs" in select and index < len(steps) - 1:
            raise ConfigError(f"steps[{index}] ({name}).select.pairs: pairs end a run; only the last step's select")
        if select and "keep_if" in select:
            keep_if(select["keep_if"], f"steps[{index}] ({name}).select.keep_if")
        if out:
            before = out[-1]
            c["input"] = {"allow_empty": config["input"].get("allow_empty", False), "step": {
                "dir": before["output"]["dir"], "name": before["step"]["name"],
                "fingerprint": content_fingerprint(before), "group": before["step"]["group"],
                "select": before["step"]["select"],
            }}  # fmt: skip
        try:
            validate(c)
        except ConfigError as e:
            raise ConfigError(f"steps[{index}] ({name}): {e}") from None
        c["step"] = {"name": name, "index": index, "count": len(steps), "group": group, "select": select,
                     "run_dir": root}  # fmt: skip
        out.append(c)
        group *= result_spec(RunConfig.from_dict(c)).rows_per_input
    preflights = [str(RunDir(c["output"]["dir"]).preflight) for c in out]
    for i, c in enumerate(out):
        c["step"]["preflights"] = preflights
        if i:  # the step before's resolved config (config.write_resolved: named by its digest), when complete
            c["step"]["previous_config"] = str(
                RunDir(out[i - 1]["output"]["dir"]).configs / f"{digest(out[i - 1])}.json"
            )
    return out


def keep_if(expression: str, key: str = "select.keep_if") -> Any:
    """``select.keep_if`` compiled in the sandbox: a callable of a row's columns.

    Raises:
        ConfigError: it does not compile, naming ``key``.
    """
    try:
        return BoundedSandbox(undefined=jinja2.StrictUndefined).compile_expression(expression)
    except TemplateSyntaxError as e:
        raise ConfigError(f"{key}: {expression!r} is not a Jinja expression: {e.message}") from e


# -- Which rows a step passes on ------------------------------------------------------------------------


def dropped_reasons(table: pa.Table, step: str, select: Mapping[str, Any] | None, group: int) -> list[str | None]:
    """For each row of a step's output (in row order): why it is not passed on, or None.

    A row with an error, or one the step itself did not get (``dropped``), is not; of the others,
    ``select`` chooses (``best_of``/``pairs`` among the rows of one input row: ``row_index // group``).

    Raises:
        InputError: the ``by`` column is missing or not a number; keep_if fails on a row.
    """
    n = table.num_rows
    reasons: list[str | None] = [None] * n
    errors = table.column("error").to_pylist() if "error" in table.column_names else [None] * n
    earlier = table.column(DROPPED).to_pylist() if DROPPED in table.column_names else [None] * n
    for i in range(n):
        if earlier[i] is not None:
            reasons[i] = earlier[i]
        elif errors[i] is not None:
            reasons[i] = f"step {step}: error"
    if not select:
        return reasons
    ((kind, spec),) = select.items()
    if kind == "keep_if":
        test = keep_if(spec)
        rows = table.to_pylist()
        with RenderBudget() as budget:
            for i, row in enumerate(rows):
                if reasons[i] is None:
                    with budget.render():
                        try:  # its columns are there (check_select); a value it cannot take is the row's
                            ok = test(**row)
                        except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError) as e:
                            ok, reasons[i] = False, f"step {step}: keep_if {spec} failed: {type(e).__name__}: {e}"
                        except TemplateTimeout:  # the alarm's (a BaseException): that row's too
                            ok = False
                            reasons[i] = f"step {step}: keep_if {spec} failed: it took more than {budget.seconds:g} s"
                    if not ok and reasons[i] is None:
                        reasons[i] = f"step {step}: keep_if {spec} is false"
        return reasons
    values = by_column(table, spec["by"], step)
    lowest = spec.get("lowest", False)
    index = table.column("row_index").to_numpy()
    best = best_in_groups(index // group, values, reasons, lowest)
    for i in range(n):
        if reasons[i] is None and i not in best:
            reasons[i] = f"step {step}: not the {'lowest' if lowest else 'highest'} {spec['by']} of its row"
    return reasons


def check_select(config: RunConfig, schema: pa.Schema) -> None:
    """The columns a step's ``select`` reads are among those of its rows (``schema``), and the one
    ``best_of``/``pairs`` compare by is a number (checked when it plans, before its GPU work).

    Raises:
        InputError: naming the step, the key and the columns.
    """
    select = (config.step or {}).get("select")
    if not select:
        return
    ((kind, spec),) = select.items()
    if kind == "keep_if":
        used = jinja2.meta.find_undeclared_variables(BoundedSandbox().parse("{{ " + spec + " }}"))
    else:
        used = {spec["by"]}
    if missing := sorted(used - set(schema.names)):
        raise InputError(
            f"steps: {config.step['name']}.select.{kind} reads {missing}, which the step's rows do not have "
            f"(they have: {', '.join(schema.names)})"
        )
    if kind != "keep_if" and not _numeric(schema.field(spec["by"]).type):
        raise InputError(
            f"steps: {config.step['name']}.select.{kind}.by: '{spec['by']}' is a column of "
            f"{schema.field(spec['by']).type}, not a number; {kind} compares numbers"
        )


def by_column(table: pa.Table, column: str, step: str) -> np.ndarray:
    """The values of ``select``'s ``by`` column, as floats (NaN where null).

    Raises:
        InputError: the column is missing or not a number.
    """
    if column not in table.column_names:
        raise InputError(f"step {step}: select by '{column}': no such column (there are {table.column_names})")
    col = table.column(column)
    if not _numeric(col.type):
        raise InputError(f"step {step}: select by '{column}': a column of {col.type}, not a number")
    return pc.cast(col, pa.float64()).fill_null(float("nan")).to_numpy(zero_copy_only=False)


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def best_in_groups(groups: np.ndarray, values: np.ndarray, reasons: list[str | None], lowest: bool) -> dict[int, int]:
    """Row -> the row at the other end, for the best row of each group (among rows not yet dropped,
    with a value); the other end is the worst (``pairs``). The first of equal rows wins."""
    best: dict[Any, int] = {}
    worst: dict[Any, int] = {}
    sign = -1.0 if lowest else 1.0
    for i, (g, v) in enumerate(zip(groups.tolist(), values.tolist(), strict=True)):
        if reasons[i] is not None or v != v:  # NaN: no value to compare
            continue
        if g not in best or sign * v > sign * values[best[g]]:
            best[g] = i
        if g not in worst or sign * v < sign * values[worst[g]]:
            worst[g] = i
    return {best[g]: worst[g] for g in best}


def selected(table: pa.Table, step: str, select: Mapping[str, Any] | None, group: int) -> tuple[pa.Table, int]:
    """A step's output as the run's output: the rows it passes on (``pairs``: a row per input row with
    the ``chosen`` and ``rejected`` rows), and how many rows it did not pass on."""
    if not select or "pairs" not in select:
        reasons = dropped_reasons(table, step, select, group)
        return table.filter(pa.array([r is None for r in reasons])), len(reasons) - reasons.count(None)
    reasons = dropped_reasons(table, step, None, group)  # rows with an error are in no pair
    spec = select["pairs"]
    values = by_column(table, spec["by"], step)
    ends = best_in_groups(table.column("row_index").to_numpy() // group, values, reasons, spec.get("lowest", False))
    chosen = pa.array(sorted(i for i, j in ends.items() if i != j), pa.int64())
    rejected = pa.array([ends[i] for i in chosen.to_pylist()], pa.int64())
    pairs = pa.table([table.take(chosen).to_struct_array(), table.take(rejected).to_struct_array()],
                     schema=pairs_schema(table.schema))  # fmt: skip
    return pairs, table.num_rows - 2 * len(chosen)


def pairs_schema(schema: pa.Schema) -> pa.Schema:
    """The output of ``select.pairs`` over rows of ``schema``: a row per pair, the ``chosen`` and the
    ``rejected`` row (an output with no pair has it too)."""
    row = pa.struct(list(schema.remove_metadata()))
    return pa.schema([("chosen", row), ("rejected", row)])


# -- A step's input: the step before it --------------------------------------------------------------


def passed_columns(schema: pa.Schema, own: list[str], before: str) -> tuple[pa.Schema, dict[str, str]]:
    """The columns a step reads from the step before it (whose shard files have ``schema``): without
    its bookkeeping, a column this step writes too (``own``) renamed ``<before>_<column>``, and
    ``dropped``; and the name of each in the earlier step's files."""
    fields, names = [], {}
    for f in schema:
        if f.name not in BOOKKEEPING:
            name = f"{before}_{f.name}" if f.name in own else f.name
            if name in names:
                raise InputError(
                    f"step {before}: its rows have the columns '{name}' and '{f.name}', which the next step would "
                    f"both read as '{name}' (it writes '{f.name}' too, so it reads the earlier one renamed); rename "
                    f"'{name}' in the input"
                )
            fields.append(f.with_name(name))
            names[name] = f.name
    return pa.schema([*fields, pa.field(DROPPED, pa.string())]), names


class StepSource:
    """The rows of the step before (``input.step``), shard by shard: shard i's file is that step's
    committed shard i, read when the shard's job runs (it is the job's input)."""

    kind = "step"

    def __init__(
        self, step: Mapping[str, Any], shards: list[tuple[str, int]], schema: pa.Schema, names: dict[str, str]
    ) -> None:
        self.step = dict(step)
        self.shards = shards  # (id, rows) of each shard of the step before, times its samples
        self.schema = schema
        self.names = names  # column -> its name in the earlier step's files
        self.fingerprint = step["fingerprint"]
        self._run_dir = RunDir(step["dir"])

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows in self.shards)

    def describe(self) -> str:
        return f"the rows of step '{self.step['name']}' ({self._run_dir.root})"

    def to_manifest(self) -> dict[str, Any]:
        schema = base64.b64encode(self.schema.serialize()).decode()
        return {"kind": self.kind, "step": self.step, "shards": [list(s) for s in self.shards], "names": self.names,
                "fingerprint": self.fingerprint, "schema": schema}  # fmt: skip

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> StepSource:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(entry["schema"])))
        return cls(entry["step"], [tuple(s) for s in entry["shards"]], schema, entry["names"])

    def segments(self, start: int, stop: int) -> list[Segment]:
        segs, offset = [], 0
        for i, (_, rows) in enumerate(self.shards):
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                segs.append(Segment(i, lo - offset, hi - offset))
            offset += rows
        return segs

    def shard_file(self, index: int) -> tuple[Path, Path]:
        shard = self.shards[index][0]
        return self._run_dir.shard_file(shard), self._run_dir.shard_stats(shard)

    def file_fingerprint(self, index: int) -> str:
        """The committed shard's own fingerprint (its rows and configuration).

        Raises:
            InputError: the shard is not committed, or was made with another configuration.
        """
        path, stats = self.shard_file(index)
        found = committed_fingerprint(path, stats)
        if not found:
            raise InputError(f"{self.describe()}: shard {self.shards[index][0]} is not committed ({path})")
        config = (pq.read_schema(path).metadata or {}).get(b"shardgen.config_fingerprint", b"").decode()
        if config != self.fingerprint:
            raise InputError(
                f"{self.describe()}: shard {self.shards[index][0]} was made with another configuration of that "
                f"step ({config}, not {self.fingerprint}); run the workflow again"
            )
        return found

    def rows_identity(self, shard: Any) -> dict[str, Any]:
        """What identifies a shard's rows (``sources.SourceKind.rows_identity``): the fingerprints of the
        committed shards of the step before that it reads, and its first row."""
        return {"step": [self.file_fingerprint(s.file) for s in shard.segments], "start": shard.start}

    def check_unchanged(self, indexes: set[int] | None = None) -> None:
        """The earlier step's shards these segments read are committed with its configuration (not
        for the preflight, which runs before any of them)."""
        for i in sorted(range(len(self.shards)) if indexes is None else indexes):
            self.file_fingerprint(i)

    def read(
        self, segments: list[Segment], batch_rows: int = 1024, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The rows of the segments as this step reads them (``passed_schema``), with ``dropped``."""
        for seg in segments:
            self.file_fingerprint(seg.file)
            path, _ = self.shard_file(seg.file)
            table = pq.read_table(path).slice(seg.start, seg.stop - seg.start)
            reasons = dropped_reasons(table, self.step["name"], self.step.get("select"), self.step["group"])
            cols = [table.column(self.names[f.name]).cast(f.type) for f in self.schema if f.name != DROPPED]
            out = pa.Table.from_arrays([*cols, pa.array(reasons, pa.string())], schema=self.schema)
            if columns is not None:
                out = out.select(columns)
            yield from out.to_batches(max_chunksize=batch_rows)

    def byte_blocks(self, columns: list[str]) -> Iterator[tuple[int, int]]:  # pragma: no cover - not planned by bytes
        raise InputError("a step after the first is planned as the step before it, not by tokens")


def step_manifest(config: RunConfig) -> dict[str, Any]:
    """The plan of a step after the first: the step before's, with every row range times its samples
    (each shard's rows are that step's shard's output rows, in order).

    Raises:
        InputError: the step before has not planned, or a column this step reads will be missing.
    """
    step = dict(config.input.step or {})
    before = RunConfig.load(config.raw["step"]["previous_config"])
    plan = Manifest.load(RunDir(step["dir"]).manifest)
    head = None
    if before.kind.needs_head:
        head = Head.read(Path(load_record(RunDir(step["dir"]).model_record)["path"]))
    spec = result_spec(before, head)
    m = spec.rows_per_input
    written = spec.schema(plan.source().schema).remove_metadata()
    schema, names = passed_columns(written, result_spec(config).names, step["name"])
    source = StepSource(step, [(s.id, s.rows * m) for s in plan.shards], schema, names)
    check_columns(config, schema, source.describe())
    shards = [{"id": s.id, "start": s.start * m, "stop": s.stop * m, "segments": [[i, 0, s.rows * m]]}
              for i, s in enumerate(plan.shards)]  # fmt: skip
    return {"version": MANIFEST_VERSION, "source": source.to_manifest(), "total_rows": plan.total_rows * m,
            "rows_per_shard": plan.data["rows_per_shard"] * m, "balance": "rows", "shards": shards}  # fmt: skip


# -- The run's output -------------------------------------------------------------------------------


def finish(config: Mapping[str, Any], output: str | Path, stats_path: str | Path) -> dict[str, Any]:
    """The output of a run of steps: the last step's rows after its ``select`` (read shard by shard
    from its committed files: a ``select`` compares rows of one input row, which one shard holds), in
    ``output.format``, with the provenance of every step; and the stats of every step and the chain.

    Raises:
        InputError: a step has not merged, or ``select`` names a column that is not there.
    """
    steps = step_configs(config)
    done = []
    for c in steps:
        path = RunDir(c["output"]["dir"]).stats
        if not path.exists():
            raise InputError(f"step {c['step']['name']}: not merged yet ({path})")
        done.append(json.loads(path.read_text()))
    last = steps[-1]["step"]
    run_dir = RunDir(steps[-1]["output"]["dir"])
    passed = [0]

    def batches() -> Iterator[tuple[pa.Schema, pa.RecordBatch]]:
        for shard in Manifest.load(run_dir.manifest).shards:
            table = pq.read_table(run_dir.shard_file(shard.id)).replace_schema_metadata(None)
            if DROPPED in table.column_names:  # rows this step did not get: not its rows
                table = table.filter(pc.is_null(table.column(DROPPED))).drop_columns([DROPPED])
            rows, _ = selected(table, last["name"], last["select"], last["group"])
            passed[0] += rows.num_rows
            yield from ((rows.schema, b) for b in rows.to_batches())

    def empty() -> pa.Schema:
        schema = pq.read_schema(run_dir.merged("parquet")).remove_metadata()
        return pairs_schema(schema) if last["select"] and "pairs" in last["select"] else schema

    fmt = config["output"].get("format", "parquet")
    prov = {
        "steps": [{"name": c["step"]["name"], **(s.get("provenance") or {})} for c, s in zip(steps, done, strict=True)],
        "select": last["select"],
        "config_fingerprint": content_digest(steps),
    }
    formats.write(fmt, output, batches(), empty, prov, config["input"].get("id_column"))
    stats = chain_stats(steps, done, passed[0], [s.id for s in Manifest.load(run_dir.manifest).shards])
    stats["provenance"] = prov
    stats["output"] = {"path": str(output), "format": fmt}
    atomic_write_text(stats_path, json.dumps(stats, indent=1, default=str) + "\n")
    write_card(config, stats, summary_text(stats), output)
    return stats


def content_digest(steps: list[dict[str, Any]]) -> str:
    """The fingerprint of a run of steps: its steps' (each holds the one before it's) and the last select."""
    return digest([content_fingerprint(steps[-1]), steps[-1]["step"]["select"]])


SUMMED = ("gpu_hours", "billed_gpu_hours", "prompt_tokens", "generated_tokens", "errors")


def shard_times(step: Mapping[str, Any], shards: list[str]) -> dict[str, tuple[float, float]]:
    """When each committed shard of a step started (its first attempt) and was done (its last)."""
    run_dir, out = RunDir(step["output"]["dir"]), {}
    for shard in shards:
        attempts = json.loads(run_dir.shard_stats(shard).read_text()).get("attempts") or []
        times = [datetime.datetime.fromisoformat(a[k]).timestamp() for a in attempts for k in ("started", "ended")
                 if a.get(k)]  # fmt: skip
        if times:
            out[shard] = (min(times), max(times))
    return out


def timing(steps: list[dict[str, Any]], shards: list[str]) -> list[dict[str, float | None]]:
    """Per step: its span (first shard started to last done), how long it ran while the step before
    still ran (shard by shard pipelining), and the median time its shards waited, once the same
    shard of the step before was done, to start (the scheduler's part)."""
    times = [shard_times(c, shards) for c in steps]
    out: list[dict[str, float | None]] = []
    for i, t in enumerate(times):
        if not t:
            out.append({"span_s": None, "overlap_with_step_before_s": None, "start_after_input_p50_s": None})
            continue
        first, last = min(a for a, _ in t.values()), max(b for _, b in t.values())
        before = times[i - 1] if i else {}
        overlap = max(0.0, max(b for _, b in before.values()) - first) if before else None
        waits = [t[s][0] - before[s][1] for s in t if s in before]
        out.append({"span_s": round(last - first, 1),
                    "overlap_with_step_before_s": None if overlap is None else round(overlap, 1),
                    "start_after_input_p50_s": round(statistics.median(waits), 1) if waits else None})  # fmt: skip
    return out


def chain_stats(
    steps: list[dict[str, Any]], done: list[dict[str, Any]], rows_out: int, shards: list[str] | None = None
) -> dict[str, Any]:
    """Each step's figures, when it ran against the step before (``timing``), and the chain's totals.

    A step's ``rows`` are the input rows it ran (those the step before passed on to it), of which
    ``errors`` had an error (a row once, as ``stats.error_reasons`` counts); ``output_rows`` the rows
    it wrote for them (``rows`` times its samples), of which ``rows_passed_on`` went on to the next
    step (its ``rows``), or, for the last step, are the run's output rows (after its ``select``;
    ``pairs``: a row per pair). Each step's merge counts ``rows_not_passed_on`` in its input rows
    (``merge.merge``).
    """
    per_step = []
    times = timing(steps, shards) if shards else [{}] * len(steps)
    got = [s["rows"] - s.get("rows_not_passed_on", 0) for s in done]  # the input rows each step ran
    for i, (c, s) in enumerate(zip(steps, done, strict=True)):
        per_step.append({
            "name": c["step"]["name"], "task": c["task"], "model": s.get("provenance", {}).get("model"),
            "rows": got[i], "output_rows": s["output_rows"], "errors": s.get("errors", 0),
            "rows_passed_on": got[i + 1] if i + 1 < len(done) else rows_out,
            "select": c["step"]["select"],
            **{k: s.get(k) for k in ("prompt_tokens", "generated_tokens", "gpu_hours", "billed_gpu_hours",
                                     "output_tokens_per_s", "ttft_p50_s", "wall_seconds")},
            "cost": (s.get("cost") or {}).get("total"),
            **times[i],
        })  # fmt: skip
    totals = {k: sum(s.get(k) or 0 for s in done) for k in SUMMED}
    costs = [p["cost"] for p in per_step]
    return {
        "steps": per_step,
        "input_rows": per_step[0]["rows"],
        "output_rows": rows_out,
        **totals,
        "cost": sum(costs) if all(c is not None for c in costs) else None,
        "currency": (done[0].get("cost") or {}).get("currency"),
    }


def summary_text(stats: Mapping[str, Any]) -> str:
    """The chain's summary for people: a line per step, then the totals."""
    lines = []
    for s in stats["steps"]:
        tokens = f"{s['prompt_tokens'] or 0:,} prompt + {s['generated_tokens'] or 0:,} generated tokens"
        lines.append(f"step {s['name']:<12} {s['task']:<9} {s['rows']:,} rows ({s['errors']} errors) -> "
                     f"{s['output_rows']:,} output rows -> {s['rows_passed_on']:,} passed on; {tokens}; "
                     f"{s['gpu_hours'] or 0:.4f} GPU-hours")  # fmt: skip
        if s.get("overlap_with_step_before_s") is not None:
            lines[-1] += f"; ran {s['overlap_with_step_before_s']:,.0f} s alongside the step before"
    lines.append(f"run              {stats['input_rows']:,} input rows -> {stats['output_rows']:,} output rows; "
                 f"{stats['gpu_hours']:.4f} GPU-hours")  # fmt: skip
    if stats.get("cost") is not None:
        lines.append(f"cost             {stats['cost']:,.2f} {stats['currency']}")
    return "\n".join(lines)


def _warnings(config: dict[str, Any]) -> list[str]:
    """The warnings of each step's config, naming the step."""
    return [f"step {c['step']['name']}: {w}" for c in step_configs(config) for w in cfg.warnings(c)]


def _check_input(config: RunConfig, source: Source) -> None:
    """The first step's input has none of the steps' bookkeeping columns (``check_bookkeeping``)."""
    if config.step:
        check_bookkeeping(source.schema.names, source.describe())


def _check_plan(config: RunConfig, manifest: Manifest) -> None:
    """What a step's ``select`` reads is in its rows (``check_select``)."""
    if config.step:
        check_select(config, pa.schema([*manifest.source().schema, *result_spec(config).fields()]))


# A config with `steps` is a run of steps: each step's config is checked as a run's (step_configs);
# a later step's input is the step before (input.step): planned from its plan, read from its shards.
cfg.register_run_mode("steps", step_configs, _warnings)
plan.PLANNERS["step"] = step_manifest
plan.INPUT_CHECKS.append(_check_input)
plan.PLAN_CHECKS.append(_check_plan)
# Its rows carry `dropped` (drops_rows), exist only once the step before ran, after this step's preflight
# (read_at_preflight), and are identified by that step's shards' fingerprints (rows_identity).
sources.register_source(StepSource.kind, sources.SourceKind(
    StepSource.from_manifest, drops_rows=True, read_at_preflight=False, rows_identity=StepSource.rows_identity,
))  # fmt: skip
