"""``shardgen cache``: what a request store holds (files, entries, bytes, by model, the requests it
answered), and pruning it by age, by model or to a size, a whole entry file at a time (``engines.store``:
files are only ever added, so removing one while jobs run only sends its requests to the engine again)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from shardgen.engines.store import ABOUT, DUPLICATE, ENGINE, STORE, RequestStore
from shardgen.errors import ShardgenError

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass
class EntryFile:
    path: str
    size: int
    mtime: float
    entries: int
    model: str | None
    requests: dict[str, int]


def size_bytes(text: str) -> int:
    """``500M``, ``2G``, ``10k``, a plain number of bytes.

    Raises:
        ShardgenError: naming the option.
    """
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in UNITS else (t, "")
    try:
        return int(float(number) * UNITS[unit])
    except ValueError:
        raise ShardgenError(f"cache --max-size: {text!r} is not a size (500M, 2G, 10k)") from None


def entry_files(store: RequestStore) -> list[EntryFile]:
    """The store's entry files, oldest first (files that do not read are listed with no entries)."""
    out = []
    for info in store.listed():
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        try:
            meta = pq.read_metadata(info.path, filesystem=store.fs)
            about = json.loads((meta.metadata or {}).get(ABOUT, b"{}"))
            out.append(EntryFile(info.path, info.size or 0, mtime, meta.num_rows, about.get("model"),
                                 about.get("requests") or {}))  # fmt: skip
        except (OSError, ValueError) as e:
            out.append(EntryFile(info.path, info.size or 0, mtime, 0, None, {"unreadable": 1}))
            print(f"cache: {info.path} does not read ({e})")
    return sorted(out, key=lambda f: (f.mtime, f.path))


def summary(files: list[EntryFile]) -> dict[str, Any]:
    models: dict[str, int] = {}
    requests = dict.fromkeys((ENGINE, STORE, DUPLICATE), 0)
    for f in files:
        models[f.model or "unknown"] = models.get(f.model or "unknown", 0) + f.entries
        for k in requests:
            requests[k] += f.requests.get(k, 0)
    return {"files": len(files), "entries": sum(f.entries for f in files), "bytes": sum(f.size for f in files),
            "oldest": min((f.mtime for f in files), default=None), "models": models, "requests": requests}  # fmt: skip


def to_prune(files: list[EntryFile], older_than_days: float | None, model: str | None,
             max_bytes: int | None, now: float) -> list[EntryFile]:  # fmt: skip
    """The files to remove: older than the age, or of the model; then the oldest of the rest until the
    store fits ``max_bytes``."""
    gone = [f for f in files if (older_than_days is not None and now - f.mtime > older_than_days * 86400)
            or (model is not None and f.model == model)]  # fmt: skip
    if max_bytes is not None:
        left = [f for f in files if f not in gone]
        size = sum(f.size for f in left)
        for f in left:  # oldest first
            if size <= max_bytes:
                break
            gone.append(f)
            size -= f.size
    return gone


def main_cache(root: str, options: Mapping[str, Any] | None, older_than_days: float | None = None,
               model: str | None = None, max_size: str | None = None) -> int:  # fmt: skip
    store = RequestStore(root, dict(options or {}))
    files = entry_files(store)
    pruning = older_than_days is not None or model is not None or max_size is not None
    if pruning:
        gone = to_prune(files, older_than_days, model, size_bytes(max_size) if max_size else None, time.time())
        for f in gone:
            store.fs.delete_file(f.path)
        print(f"removed {len(gone)} file(s), {sum(f.entries for f in gone):,} entries, "
              f"{sum(f.size for f in gone):,} bytes")  # fmt: skip
        files = [f for f in files if f not in gone]
    s = summary(files)
    oldest = time.strftime("%Y-%m-%d %H:%M", time.gmtime(s["oldest"])) + " UTC" if s["oldest"] else "none"
    r = s["requests"]
    print(f"request store {root}: {s['entries']:,} entries in {s['files']:,} files, {s['bytes']:,} bytes; "
          f"oldest {oldest}")  # fmt: skip
    for name, n in sorted(s["models"].items()):
        print(f"  {name}: {n:,} entries")
    print(f"requests answered by the jobs that wrote it: {r[ENGINE]:,} by the engine, {r[STORE]:,} from the "
          f"store, {r[DUPLICATE]:,} by a duplicate")  # fmt: skip
    return 0
