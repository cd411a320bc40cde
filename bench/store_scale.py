"""The request store at scale (issue 50): 1,000,000 entries in 100 files (a run's saves), indexed by a new
job (``RequestStore.refresh``: the key column of each file), then every key looked up in the feed's
batches of 64 (``RequestStore.get_many``'s search), and 100,000 keys that are not there. Memory is the
index's, measured with tracemalloc (its peak: while the files' keys are merged). Usage:
python bench/store_scale.py [--out DIR] [--entries N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import machine, write_results  # noqa: E402

from shardgen.engines.store import RequestStore  # noqa: E402

FILES, BATCH = 100, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--entries", type=int, default=1_000_000)
    args = ap.parse_args()
    n = args.entries
    keys = [os.urandom(16) for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        writer = RequestStore(tmp)
        per = n // FILES
        for f in range(FILES):
            writer.put([(k, '{"pooled": [0.5]}') for k in keys[f * per : (f + 1) * per]])
        store = RequestStore(tmp)
        tracemalloc.start()
        t0 = time.perf_counter()
        store.refresh()
        index_s = time.perf_counter() - t0
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        t0 = time.perf_counter()
        found = sum(i is not None for j in range(0, n, BATCH) for i in store._find(keys[j : j + BATCH]))
        find_s = time.perf_counter() - t0
        missing = [os.urandom(16) for _ in range(n // 10)]
        t0 = time.perf_counter()
        false = sum(i is not None for j in range(0, len(missing), BATCH) for i in store._find(missing[j : j + BATCH]))
        miss_s = time.perf_counter() - t0
    assert found == n and false == 0
    result = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": machine(), "entries": n, "files": FILES,
              "index_seconds": round(index_s, 2), "index_mib": round(held / 2**20, 1),
              "index_peak_mib": round(peak / 2**20, 1), "bytes_per_entry": round(held / n, 1),
              "lookup_us_per_key": round(1e6 * find_s / n, 2),
              "miss_us_per_key": round(1e6 * miss_s / len(missing), 2)}  # fmt: skip
    md = f"""# The request store at scale

{result["date"]}, {result["machine"]}. `python bench/store_scale.py`: {n:,} entries in {FILES} files, indexed by a
new job, then every key looked up in batches of {BATCH} (as the feed submits), and {len(missing):,} keys that
are not there.

| figure | value |
|---|---|
| index the files' keys | {result["index_seconds"]} s |
| index memory held | {result["index_mib"]} MiB ({result["bytes_per_entry"]} bytes an entry) |
| peak while merging the files' keys | {result["index_peak_mib"]} MiB |
| look a stored key up | {result["lookup_us_per_key"]} µs a key |
| look a missing key up | {result["miss_us_per_key"]} µs a key |

The index is two sorted arrays of the keys' 64-bit halves and one of their places (24 bytes an entry):
memory grows with the store's entries, not with the rows a job runs, and a lookup is a binary search
(O(log entries)), so a 1,000,000-row shard set costs O(rows) lookups. The answers are read a file at a
time when one of its keys is found (four files held at once).
"""
    write_results(args.out, "store_scale", result, md)


if __name__ == "__main__":
    main()
