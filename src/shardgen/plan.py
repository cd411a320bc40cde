"""Planning: split the dataset into shards from metadata alone.

The manifest lists every shard with its global row range and the file
segments it covers, plus what the source looked like when planned (file sizes
and modification times, or the dataset's fingerprint), so a job can refuse
input that changed since. The same input and config always give the same
manifest.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.errors import InputError
from shardgen.io import atomic_write_text
from shardgen.sources import Segment, Source, open_source, source_from_manifest

if TYPE_CHECKING:
    from shardgen.config import RunConfig

MANIFEST_VERSION = 1
SHARD_ID = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of the input, in input order."""

    id: str
    start: int
    stop: int
    segments: list[Segment]

    @property
    def rows(self) -> int:
        return self.stop - self.start


def shard_id_width(num_shards: int) -> int:
    """Zero-padded width: at least 5 digits, so ids sort as numbers do."""
    return max(5, len(str(max(num_shards - 1, 0))))


def make_shards(source: Source, rows_per_shard: int) -> list[Shard]:
    """Consecutive shards of ``rows_per_shard`` rows; the last takes the remainder."""
    return shards_between(source, [*range(0, source.num_rows, rows_per_shard), source.num_rows])


def shards_between(source: Source, cuts: list[int]) -> list[Shard]:
    """The shards from each cut (a row index) to the next, numbered in order."""
    width = shard_id_width(len(cuts) - 1)
    return [Shard(f"{i:0{width}d}", a, b, source.segments(a, b)) for i, (a, b) in enumerate(itertools.pairwise(cuts))]


# shards.balance: tokens. Prompt bytes per token of a BPE tokenizer on English text (an estimate:
# only the balance between prompt and output work depends on it), and the bound on a shard's rows.
BYTES_PER_TOKEN = 4
MAX_ROWS_FACTOR = 4


def make_balanced_shards(
    source: Source, rows_per_shard: int, blocks: Iterable[tuple[int, int]], output_tokens: int
) -> tuple[list[Shard], list[float]]:
    """Shards of about equal estimated work, and the work of each (tokens).

    ``blocks``: ``(rows, prompt bytes)`` in row order (``Source.byte_blocks``);
    a row's work is its block's prompt bytes per row as tokens, plus
    ``output_tokens``. As many shards as ``rows_per_shard`` would give, cut
    where the cumulative work first reaches each multiple of total ÷ count,
    and none larger than ``MAX_ROWS_FACTOR × rows_per_shard`` rows (such cuts
    add shards).
    """
    firsts, per_row, before = [], [], [0.0]  # per block: first row, work per row, work before it
    row = 0
    for rows, size in blocks:
        if rows:
            firsts.append(row)
            per_row.append(size / rows / BYTES_PER_TOKEN + output_tokens)
            before.append(before[-1] + rows * per_row[-1])
            row += rows
    total = source.num_rows
    if row != total:
        raise InputError(f"input: the metadata describes {row} rows, the source has {total}; plan again")
    firsts.append(total)

    def work_to(r: int) -> float:  # the work of rows [0, r)
        i = max(bisect.bisect_right(firsts, r) - 1, 0)
        return before[i] + (r - firsts[i]) * per_row[i] if i < len(per_row) else before[-1]

    def row_reaching(x: float) -> int:  # the fewest rows whose work reaches x
        i = min(max(bisect.bisect_left(before, x) - 1, 0), len(per_row) - 1)
        return min(firsts[i] + math.ceil((x - before[i]) / per_row[i] - 1e-9), total)

    count = -(-total // rows_per_shard)
    target = before[-1] / count
    cuts, k = [0], 1
    while cuts[-1] < total:
        start = cuts[-1]
        stop = row_reaching(k * target) if k < count else total
        cuts.append(min(max(stop, start + 1), start + MAX_ROWS_FACTOR * rows_per_shard, total))
        while k < count and work_to(cuts[-1]) >= k * target * (1 - 1e-12):
            k += 1
    return shards_between(source, cuts), [work_to(b) - work_to(a) for a, b in itertools.pairwise(cuts)]


def check_columns(config: RunConfig, schema: Any, where: str, head: Any = None) -> None:
    """The input's columns (``schema``, of ``where``) for this config: unique, with every column the
    config reads, and none that a result column of this config would overwrite. Checked when the
    plan is made, and again by the preflight, by every job and by the merge, for the config each
    runs with: a change of sampling that adds a column (``structured_outputs.choice`` adds
    ``label``; ``n`` > 1 adds ``sample_index``) does not plan again.

    Raises:
        InputError: naming the column and where it is.
    """
    from shardgen.outputs import check_input_columns
    from shardgen.prompts import PromptRenderer
    from shardgen.results import result_spec

    renderer = PromptRenderer.from_config(config.prompt)
    prompt_key = "prompt.messages_column" if renderer.messages_column else "prompt.template"
    keyed = {"input.id_column": config.input.id_column, "lora.column": config.lora.column}
    keyed |= {f"prompt.images[{i}]": c for i, c in enumerate(config.prompt.images)}
    check_input_columns(schema, renderer.columns, keyed, result_spec(config, head).names, prompt_key, where)


def build_manifest(config: RunConfig) -> dict[str, Any]:
    """The manifest for a run.

    Raises:
        InputError: the input cannot be read, or a column the run needs is
            missing, or a column would clash with the output's own columns.
    """
    from shardgen.prompts import PromptRenderer

    source = open_source(config.input)
    renderer = PromptRenderer.from_config(config.prompt)
    check_columns(config, source.schema, source.describe())
    if source.num_rows == 0 and not config.input.allow_empty:
        raise InputError(
            f"input: {source.describe()} has no rows; nothing to generate. "
            "Set input.allow_empty: true to end such runs cleanly with an empty output"
        )
    per_shard = config.shards.rows_per_shard
    works: list[float] | None = None
    if config.shards.balance == "tokens" and source.num_rows:
        blocks = source.byte_blocks(sorted(renderer.columns))
        output_tokens = config.sampling.max_tokens * config.sampling.n
        shards, works = make_balanced_shards(source, per_shard, blocks, output_tokens)
    else:
        shards = make_shards(source, per_shard)
    entries = []
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
    return {
        "version": MANIFEST_VERSION,
        "source": source.to_manifest(),
        "total_rows": source.num_rows,
        "rows_per_shard": per_shard,
        "balance": config.shards.balance,
        "shards": entries,
    }


class Manifest:
    """A planned run, as read back by generate and merge jobs."""

    def __init__(self, data: dict[str, Any]) -> None:
        if data.get("version") != MANIFEST_VERSION:
            raise InputError(f"manifest: version {data.get('version')} is not {MANIFEST_VERSION}; plan again")
        self.data = data
        for s in data["shards"]:
            # ids name files and directories: digits only, never a path
            if not SHARD_ID.fullmatch(str(s["id"])):
                raise InputError(f"manifest: the shard id {s['id']!r} is not a number; plan again")
        self.total_rows: int = data["total_rows"]
        self.shards = [
            Shard(s["id"], s["start"], s["stop"], [Segment(*g) for g in s["segments"]]) for s in data["shards"]
        ]
        self._by_id = {s.id: s for s in self.shards}

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        return cls(json.loads(Path(path).read_text()))

    def source(self) -> Source:
        return source_from_manifest(self.data["source"])

    def shard(self, shard_id: str) -> Shard:
        try:
            return self._by_id[shard_id]
        except KeyError:
            raise InputError(f"manifest: no shard '{shard_id}' (the plan has {len(self.shards)})") from None


def write_manifest(config: RunConfig, path: str | Path) -> dict[str, Any]:
    manifest = build_manifest(config)
    atomic_write_text(path, json.dumps(manifest, indent=1) + "\n")
    return manifest
