"""Planning: split the dataset into shards from metadata alone.

The manifest lists every shard with its global row range and the file
segments it covers, plus what the source looked like when planned (file sizes
and modification times, or the dataset's fingerprint), so a job can refuse
input that changed since. The same input and config always give the same
manifest.

A plan made again keeps the shards of the plan before it (``kept_shards``) as far as their files are
the same ones, in the same order: files added after them get new shards, so a grown dataset's
committed shards are kept (their fingerprints do not change) and only the new rows are generated.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.base.io import atomic_write_text
from shardgen.base.registry import Hooks, Registry
from shardgen.data.manifest import MANIFEST_VERSION, Manifest, Shard
from shardgen.data.outputs import check_input_columns
from shardgen.data.sources import Source, open_source
from shardgen.errors import InputError
from shardgen.requests.prompts import PromptRenderer
from shardgen.requests.results import result_spec

if TYPE_CHECKING:
    from shardgen.config import RunConfig


def shard_id_width(num_shards: int) -> int:
    """Zero-padded width: at least 5 digits, so ids sort as numbers do."""
    return max(5, len(str(max(num_shards - 1, 0))))


def shards_between(source: Source, cuts: list[int], first: int = 0, width: int = 0) -> list[Shard]:
    """The shards from each cut (a row index) to the next, numbered in order from ``first``."""
    width = max(width, shard_id_width(first + len(cuts) - 1))
    return [
        Shard(f"{first + i:0{width}d}", a, b, source.segments(a, b))
        for i, (a, b) in enumerate(itertools.pairwise(cuts))
    ]


# shards.balance: tokens. Prompt bytes per token of a BPE tokenizer on English text (an estimate:
# only the balance between prompt and output work depends on it), and the bound on a shard's rows.
BYTES_PER_TOKEN = 4
MAX_ROWS_FACTOR = 4


class WorkCurve:
    """Estimated work (tokens) of the input's first rows: per block of rows, its prompt bytes per row
    as tokens plus ``output_tokens``.

    ``blocks``: ``(rows, prompt bytes)`` in row order (``Source.byte_blocks``).
    """

    def __init__(self, blocks: Iterable[tuple[int, int]], output_tokens: int, total_rows: int) -> None:
        firsts, per_row, before = [], [], [0.0]  # per block: first row, work per row, work before it
        row = 0
        for rows, size in blocks:
            if rows:
                firsts.append(row)
                per_row.append(size / rows / BYTES_PER_TOKEN + output_tokens)
                before.append(before[-1] + rows * per_row[-1])
                row += rows
        if row != total_rows:
            raise InputError(f"input: the metadata describes {row} rows, the source has {total_rows}; plan again")
        firsts.append(total_rows)
        self.firsts, self.per_row, self.before, self.total_rows = firsts, per_row, before, total_rows

    @property
    def total(self) -> float:
        return self.before[-1]

    def work_to(self, r: int) -> float:
        """The work of rows ``[0, r)``."""
        i = max(bisect.bisect_right(self.firsts, r) - 1, 0)
        return self.before[i] + (r - self.firsts[i]) * self.per_row[i] if i < len(self.per_row) else self.before[-1]

    def row_reaching(self, x: float) -> int:
        """The fewest rows whose work reaches ``x``."""
        i = min(max(bisect.bisect_left(self.before, x) - 1, 0), len(self.per_row) - 1)
        return min(self.firsts[i] + math.ceil((x - self.before[i]) / self.per_row[i] - 1e-9), self.total_rows)


class RowCurve:
    """Work as rows: the estimate of a plan without one."""

    def __init__(self, total_rows: int) -> None:
        self.total = self.total_rows = total_rows

    def work_to(self, r: int) -> float:
        return float(r)

    def row_reaching(self, x: float) -> int:
        return min(math.ceil(x - 1e-9), self.total_rows)


def balanced_cuts(
    total: int, rows_per_shard: int, blocks: Iterable[tuple[int, int]], output_tokens: int, start: int = 0
) -> tuple[list[int], WorkCurve]:
    """The cuts of shards of about equal estimated work (``shards.balance: tokens``) from row ``start``,
    and the work curve they follow.

    ``blocks``: ``(rows, prompt bytes)`` in row order (``Source.byte_blocks``);
    a row's work is its block's prompt bytes per row as tokens, plus
    ``output_tokens``. As many shards as ``rows_per_shard`` would give, cut
    where the cumulative work first reaches each multiple of total ÷ count,
    and none larger than ``MAX_ROWS_FACTOR × rows_per_shard`` rows (such cuts
    add shards).
    """
    curve = WorkCurve(blocks, output_tokens, total)
    count = max(-(-(total - start) // rows_per_shard), 1)
    base = curve.work_to(start)
    target = (curve.total - base) / count
    cuts, k = [start], 1
    while cuts[-1] < total:
        a = cuts[-1]
        stop = curve.row_reaching(base + k * target) if k < count else total
        cuts.append(min(max(stop, a + 1), a + MAX_ROWS_FACTOR * rows_per_shard, total))
        while k < count and curve.work_to(cuts[-1]) - base >= k * target * (1 - 1e-12):
            k += 1
    return cuts, curve


def shard_works(curve: WorkCurve | RowCurve, cuts: list[int]) -> list[float]:
    """The estimated work of each shard between ``cuts``."""
    return [curve.work_to(b) - curve.work_to(a) for a, b in itertools.pairwise(cuts)]


# shards.tail: guided. A tail shard is this fraction of the work left per worker, and no smaller than
# this fraction of an average shard of the plan (bench/scale.py, simulate step: how these were chosen).
TAIL_FRACTION = 1 / 8
TAIL_FLOOR = 1 / 4


def guided_tail(cuts: list[int], curve: WorkCurve | RowCurve, workers: int) -> list[int]:
    """The cuts with the end of the plan cut smaller (guided self-scheduling).

    The plan's shards are kept while each is at most ``TAIL_FRACTION`` of
    the work after its start per worker. From the first that is larger, to
    the end, each shard is that fraction of the work left per worker, but no
    less than ``TAIL_FLOOR`` of an average shard of ``cuts`` and of no more
    rows than the largest: shards shrink as the run nears its end, so the
    last shards to start end soon after the others. Work is ``curve``'s
    estimate. Deterministic; every row stays in exactly one shard, in order.
    """
    total = cuts[-1]
    if total == cuts[0] or workers < 1:
        return list(cuts)
    work = curve.work_to
    end = work(total)
    floor = TAIL_FLOOR * (end - work(cuts[0])) / (len(cuts) - 1)
    rows = max(b - a for a, b in itertools.pairwise(cuts))  # and no more rows than the plan's largest shard
    out = [cuts[0]]
    for a, b in itertools.pairwise(cuts):
        if work(b) - work(a) <= TAIL_FRACTION * (end - work(a)) / workers:
            out.append(b)
            continue
        while out[-1] < total:  # the tail, from a
            x = work(out[-1])
            step = max(TAIL_FRACTION * (end - x) / workers, floor)
            stop = total if end - x - step < floor / 2 else curve.row_reaching(x + step)
            out.append(min(max(stop, out[-1] + 1), out[-1] + rows, total))
        break
    return out


# What features add to planning: the plan of an input a feature plans itself, by the input key that
# selects it (a run before this one: its plan), and checks of the input and of the plan before it is written.
PLANNERS: dict[str, Callable[[RunConfig], dict[str, Any]]] = Registry()
INPUT_CHECKS: list[Callable[[RunConfig, Source], None]] = Hooks()
PLAN_CHECKS: list[Callable[[RunConfig, Manifest], None]] = Hooks()


def check_columns(config: RunConfig, schema: Any, where: str, head: Any = None) -> None:
    """The input's columns (``schema``, of ``where``) for this config: unique, with every column the
    config reads, and none that a result column of this config would overwrite. Checked when the
    plan is made, and again by the preflight, by every job and by the merge, for the config each
    runs with: a change of sampling that adds a column (``structured_outputs.choice`` adds
    ``label``; ``n`` > 1 adds ``sample_index``) does not plan again.

    Raises:
        InputError: naming the column and where it is.
    """
    renderer = _renderer(config)
    prompt_key = "prompt.messages_column" if renderer and renderer.messages_column else "prompt.template"
    keyed = {"input.id_column": config.input.id_column, "input.sampling_column": config.input.sampling_column,
             "lora.column": config.lora.column}  # fmt: skip
    keyed |= {f"prompt.images[{i}]": c for i, c in enumerate(config.prompt.images)}
    check_input_columns(
        schema, renderer.columns if renderer else set(), keyed, result_spec(config, head).names, prompt_key, where
    )


def _renderer(config: RunConfig) -> PromptRenderer | None:
    """The run's prompt renderer; None for a task without a model, which has no prompt."""
    return PromptRenderer.from_config(config.prompt) if config.kind.uses_engine else None


# What a plan must share with the plan before it for that one's shards to be kept.
PLAN_SETTINGS = ("version", "rows_per_shard", "balance", "tail")


def kept_shards(previous: dict[str, Any] | None, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The shards of the plan before (``previous``, a manifest) that ``plan`` (a manifest without shards
    yet) keeps: the longest run of its first shards whose files are still the first files of the
    input, the same ones (path, size, modification time, rows, ETag) in the same order. With the same
    settings (``PLAN_SETTINGS``) and input files only; none otherwise.

    A file added after them gets new shards, and a committed shard that is kept keeps its fingerprint,
    so its job keeps it: a grown dataset generates its new rows alone. A file edited, removed, or added
    before others ends the kept run at that file: its shards and all after it are planned again (their
    rows generated again)."""
    if not previous or any(previous.get(k) != plan.get(k) for k in PLAN_SETTINGS):
        return []
    before, now = previous["source"], plan["source"]
    if "files" not in before or "files" not in now:
        return []
    if {k: v for k, v in before.items() if k != "files"} != {k: v for k, v in now.items() if k != "files"}:
        return []
    pairs = zip(before["files"], now["files"], strict=False)
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before["files"]), len(now["files"])))
    return list(itertools.takewhile(lambda s: all(seg[0] < same for seg in s["segments"]), previous["shards"]))


def build_manifest(config: RunConfig, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest for a run; with the manifest of the plan before it (``previous``), the shards of
    that one it keeps (``kept_shards``) and new ones after them.

    Raises:
        InputError: the input cannot be read, or a column the run needs is
            missing, or a column would clash with the output's own columns.
    """
    for key, planner in PLANNERS.items():  # an input a feature plans itself
        if getattr(config.input, key, None):
            return planner(config)
    source = open_source(config.input, config.kind.pairs)
    renderer = _renderer(config)
    check_columns(config, source.schema, source.describe())
    for check in INPUT_CHECKS:
        check(config, source)
    if source.num_rows == 0 and not config.input.allow_empty:
        raise InputError(
            f"input: {source.describe()} has no rows; nothing to generate. "
            "Set input.allow_empty: true to end such runs cleanly with an empty output"
        )
    per_shard, total = config.shards.rows_per_shard, source.num_rows
    guided = config.shards.tail == "guided"
    manifest = {
        "version": MANIFEST_VERSION,
        "source": source.to_manifest(),
        "total_rows": total,
        "rows_per_shard": per_shard,
        "balance": config.shards.balance,
    }
    if guided:  # only then: the manifests of other plans stay as they were
        manifest["tail"] = {"kind": "guided", "workers": config.shards.workers}
    kept = kept_shards(previous, manifest)
    start = kept[-1]["stop"] if kept else 0
    works: list[float] | None = None
    curve: WorkCurve | RowCurve = RowCurve(total)
    if config.shards.balance == "tokens" and total > start and renderer is not None:
        blocks = source.byte_blocks(sorted(renderer.columns))
        cuts, curve = balanced_cuts(total, per_shard, blocks, config.sampling.max_tokens * config.sampling.n, start)
    else:
        cuts = [*range(start, total, per_shard), total] if total > start else [start]
    if guided:
        cuts = guided_tail(cuts, curve, config.shards.workers or 1)
    shards = shards_between(source, cuts, len(kept), len(kept[0]["id"]) if kept else 0)
    if isinstance(curve, WorkCurve):
        works = shard_works(curve, cuts)
    entries = list(kept)
    for i, s in enumerate(shards):
        entry = {
            "id": s.id,
            "start": s.start,
            "stop": s.stop,
            "segments": [[g.file, g.start, g.stop] for g in s.segments],
        }
        if works is not None:
            entry["estimated_tokens"] = round(works[i])
        entries.append(entry)
    return manifest | {"shards": entries}


def write_manifest(config: RunConfig, path: str | Path) -> dict[str, Any]:
    """Plan the run into ``path``, keeping the shards of the plan before it: the one at ``path``, or,
    where the workflow removed it before planning again (as Snakemake does a job's outputs), its copy
    beside it (``last_plan``)."""
    path = Path(path)
    previous = next((json.loads(p.read_text()) for p in (path, last_plan(path)) if p.exists()), None)
    manifest = build_manifest(config, previous)
    for check in PLAN_CHECKS:
        check(config, Manifest(manifest))
    text = json.dumps(manifest, indent=1) + "\n"
    atomic_write_text(path, text)
    atomic_write_text(last_plan(path), text)
    return manifest


def last_plan(manifest: Path) -> Path:
    """The copy of the last plan beside its manifest, which the next plan keeps shards of."""
    return manifest.with_name(manifest.stem + ".last.json")
