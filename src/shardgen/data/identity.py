"""A shard's identity: the fingerprint of everything that decides its content.

A committed shard's file and stats carry it (``rundir.committed_fingerprint``), and a job keeps a
shard committed with the same one instead of generating it again (``generate.committed``). The
config part of it is ``config.content_config``, which leaves out what decides speed, not text.
"""

from __future__ import annotations

from typing import Any

from shardgen.config import RunConfig, content_config, digest
from shardgen.data.manifest import Manifest, Shard


def shard_fingerprint(config: RunConfig, manifest: Manifest, shard: Shard) -> str:
    """Everything that decides the shard's content: its input rows and the content config."""
    inputs = planned_rows(manifest, shard)
    if inputs is None:  # what the source's kind says identifies them
        inputs = manifest.source_kind.rows_identity(manifest.source(), shard)  # type: ignore[misc]
    return digest({"config": content_config(config.raw), "rows": inputs})


def planned_rows(manifest: Manifest, shard: Shard) -> Any:
    """What identifies a shard's rows from the plan alone: each segment's file by its path, size and
    modification time and the segment's rows (input files: Parquet, a feature's), or the dataset's
    fingerprint and the shard's rows; None where the source's kind says what identifies them
    (``rows_identity``: the step before's committed shards)."""
    src = manifest.data["source"]
    if "files" in src:
        files = src["files"]
        return [_file_identity(files[s.file]) | {"start": s.start, "stop": s.stop} for s in shard.segments]
    if manifest.source_kind.rows_identity is not None:
        return None
    return {"fingerprint": src["fingerprint"], "start": shard.start, "stop": shard.stop}


def _file_identity(f: dict[str, Any]) -> dict[str, Any]:
    """A file by its path, size and modification time; an object (whose mtime_ns is 0) by its ETag too,
    which a rewrite of the same size changes. A local file's has no ``etag`` key (None): its shards'
    fingerprints stay those committed before objects had one."""
    out = {k: f[k] for k in ("path", "size", "mtime_ns")}
    return out | ({"etag": f["etag"]} if f.get("etag") is not None else {})
