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
    src = manifest.data["source"]
    rows_identity = manifest.source_kind.rows_identity
    if "files" in src:  # input files (Parquet, a feature's): each by its path, size and modification time
        files = src["files"]
        inputs: Any = [_file_identity(files[s.file]) | {"start": s.start, "stop": s.stop} for s in shard.segments]
    elif rows_identity is not None:  # what the source's kind says identifies them
        inputs = rows_identity(manifest.source(), shard)
    else:  # a dataset, by its own fingerprint
        inputs = {"fingerprint": src["fingerprint"], "start": shard.start, "stop": shard.stop}
    return digest({"config": content_config(config.raw), "rows": inputs})


def _file_identity(f: dict[str, Any]) -> dict[str, Any]:
    """A file by its path, size and modification time; an object (whose mtime_ns is 0) by its ETag too,
    which a rewrite of the same size changes. A local file's has no ``etag`` key (None): its shards'
    fingerprints stay those committed before objects had one."""
    out = {k: f[k] for k in ("path", "size", "mtime_ns")}
    return out | ({"etag": f["etag"]} if f.get("etag") is not None else {})
