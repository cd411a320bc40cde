"""Planning a dataset of 1,000 objects in S3-compatible storage reads their footers only.

A real S3-compatible server (moto's server mode, on this machine) holds ``--objects`` Parquet objects of
about ``--mib`` MiB each (incompressible text in 4 row groups). ``shardgen plan``'s source scan
(``sources.ParquetSource.scan``: a HEAD and the footer's ranged read per object, 16 objects at a time)
describes them; the bytes it read are counted as pyarrow reads them (``storage.CountingFile``) and
compared with the objects' size, which a loader that reads the data to count its rows would fetch.

Usage: python bench/s3_plan.py [--objects 1000] [--mib 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import write_results  # noqa: E402

from shardgen.data.sources import ParquetSource  # noqa: E402


def parquet_object(mib: float, seed: int) -> bytes:
    rng = random.Random(seed)
    rows = int(mib * 1024)  # ~1 KiB of text a row
    table = pa.Table.from_pylist([{"id": i, "text": "".join(rng.choices("abcdefghij", k=1000))} for i in range(rows)])
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=max(rows // 4, 1), compression="none")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=1000)
    ap.add_argument("--mib", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for _ in range(100):
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - the server is starting
                time.sleep(0.2)
        bodies = [parquet_object(args.mib, seed) for seed in range(8)]  # 8 distinct objects, repeated
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: client.put_object(Bucket="bench", Key=f"data/part-{i:05d}.parquet",
                                                      Body=bodies[i % 8]), range(args.objects)))  # fmt: skip
        upload_s = time.perf_counter() - t
        t = time.perf_counter()
        source = ParquetSource.scan(["s3://bench/data/*.parquet"], {"endpoint_url": endpoint})
        plan_s = time.perf_counter() - t
    finally:
        server.terminate()
        server.wait()
    objects, read, size = source.objects_read or (0, 0, 0)
    result = {
        "what": "shardgen's planning scan of Parquet objects on an S3-compatible server (moto, this machine): the "
        "bytes it read against the objects' size",
        "objects": objects,
        "rows": source.num_rows,
        "object_bytes": size,
        "bytes_read": read,
        "read_fraction": round(read / size, 5) if size else None,
        "bytes_read_per_object": round(read / objects) if objects else None,
        "plan_seconds": round(plan_s, 2),
        "upload_seconds": round(upload_s, 2),
        "date": time.strftime("%Y-%m-%d"),
    }
    md = (
        f"{result['date']}; moto's S3 server on this machine.\n\n"
        "| objects | their bytes | bytes planning read | fraction | per object | plan s |\n|---|---|---|---|---|---|\n"
        f"| {objects} | {size:,} | {read:,} | **{100 * result['read_fraction']:.2f}%** | "
        f"{result['bytes_read_per_object']:,} | {result['plan_seconds']} |\n"
    )
    write_results(args.out, "s3_plan", result, md)


if __name__ == "__main__":
    main()
