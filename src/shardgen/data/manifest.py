"""A planned run as its jobs read it back: the manifest (``plan.write_manifest`` writes it), its shards
and segments, and the shards a run writes now (``run_shards``).

Light on purpose: ``shardgen status`` and every job read it; the sources (pyarrow) are imported only
where a shard's rows are read (``Manifest.source``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.base.registry import Hooks
from shardgen.errors import InputError

if TYPE_CHECKING:
    from shardgen.base.rundir import RunDir
    from shardgen.data.sources import Source, SourceKind

MANIFEST_VERSION = 1
SHARD_ID = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of one file (index into the source's files), or of the dataset."""

    file: int
    start: int
    stop: int


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
        from shardgen.data.sources import source_from_manifest  # pyarrow: only where rows are read

        return source_from_manifest(self.data["source"])

    @property
    def source_kind(self) -> SourceKind:
        """What the core asks of the plan's source (``sources.source_kind``), without opening it."""
        from shardgen.data.sources import source_kind  # the registry of source kinds: not for shardgen status

        return source_kind(self.data["source"]["kind"])

    def shard(self, shard_id: str) -> Shard:
        try:
            return self._by_id[shard_id]
        except KeyError:
            raise InputError(f"manifest: no shard '{shard_id}' (the plan has {len(self.shards)})") from None


# -- The shards a run writes ----------------------------------------------------------------------------
# A feature may divide the plan's shards while a run goes (splits: an idle worker's cut makes pieces). It
# registers how to find a run's pieces now; every reader of a run's shards (a job, the merge, shardgen
# status) asks ``run_shards``, never the feature.
PIECES: list[Callable[[Manifest, RunDir, bool], list[Shard] | None]] = Hooks(features=("features.splits",))


def run_shards(manifest: Manifest, run_dir: RunDir, workers: bool = True) -> list[Shard]:
    """The shards a run writes now, in row order: the plan's, or the pieces a feature divided them into.
    ``workers``: whether the run has elastic workers (only they split: a run without them never sees a
    cut an earlier run of workers made); ``shardgen status``, which has no config, looks either way."""
    for pieces in PIECES:
        if (found := pieces(manifest, run_dir, workers)) is not None:
            return found
    return manifest.shards


def holds(stats: dict[str, Any], shard: Shard) -> bool:
    """Whether a committed file's stats hold the shard's rows as they are now (not a file committed
    before a later cut narrowed it); stats without a range are a plan shard's, its whole rows."""
    return (stats.get("row_start", shard.start), stats.get("row_stop", shard.stop)) == (shard.start, shard.stop)


def work_order(manifest: Manifest) -> list[str]:
    """Shard ids in the order elastic workers take them: largest estimated work first (the plan's
    ``estimated_tokens`` when every shard has one, else rows), ties in plan order."""
    entries = manifest.data["shards"]
    estimated = all("estimated_tokens" in e for e in entries)
    sizes = [e["estimated_tokens"] if estimated else e["stop"] - e["start"] for e in entries]
    return [entries[i]["id"] for i in sorted(range(len(entries)), key=lambda i: -sizes[i])]
