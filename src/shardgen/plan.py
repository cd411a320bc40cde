"""Planning: split the dataset into shards from metadata alone.

The manifest lists every shard with its global row range and the file
segments it covers, plus what the source looked like when planned (file sizes
and modification times, or the dataset's fingerprint), so a job can refuse
input that changed since. The same input and config always give the same
manifest.
"""

from __future__ import annotations

import json
import re
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
    total = source.num_rows
    count = -(-total // rows_per_shard)
    width = shard_id_width(count)
    shards = []
    for i in range(count):
        start, stop = i * rows_per_shard, min((i + 1) * rows_per_shard, total)
        shards.append(Shard(f"{i:0{width}d}", start, stop, source.segments(start, stop)))
    return shards


def build_manifest(config: RunConfig) -> dict[str, Any]:
    """The manifest for a run.

    Raises:
        InputError: the input cannot be read, or a column the run needs is
            missing, or a column would clash with the output's own columns.
    """
    from shardgen.outputs import check_input_columns
    from shardgen.prompts import PromptRenderer
    from shardgen.results import ResultSpec

    source = open_source(config.input)
    renderer = PromptRenderer.from_config(config.prompt)
    result_columns = ResultSpec.of(config).names
    prompt_key = "prompt.messages_column" if renderer.messages_column else "prompt.template"
    check_input_columns(source.schema, renderer.columns, config.input.id_column, result_columns, prompt_key)
    if source.num_rows == 0 and not config.input.allow_empty:
        raise InputError(
            f"input: {source.describe()} has no rows; nothing to generate. "
            "Set input.allow_empty: true to end such runs cleanly with an empty output"
        )
    shards = make_shards(source, config.shards.rows_per_shard)
    return {
        "version": MANIFEST_VERSION,
        "source": source.to_manifest(),
        "total_rows": source.num_rows,
        "rows_per_shard": config.shards.rows_per_shard,
        "shards": [
            {"id": s.id, "start": s.start, "stop": s.stop, "segments": [[g.file, g.start, g.stop] for g in s.segments]}
            for s in shards
        ],
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
