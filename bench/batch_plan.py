"""Planning an OpenAI Batch input (input.openai_batch): time and peak memory of `shardgen plan` on
request files of 10,000 and 50,000 chat requests of about 4 KB each (the larger 193 MB), side by
side; the ratios say whether time grows with the file and memory stays flat.

Usage: python bench/batch_plan.py [--requests 10000 50000] [--out DIR]
Writes DIR/batch_plan.{json,md} (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import write_results  # noqa: E402

WORDS = "the of and to in is that it for as with was on be by this are from or at an which have".split()


def write_batch(path: Path, n: int, seed: int = 0) -> int:
    """``n`` chat requests of about 4 KB each, with varied sampling fields; returns the file's bytes."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(1000))
            messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]
            sampling = {"max_tokens": rng.randint(16, 512), "temperature": rng.choice([0, 0.7, 1.0]), "seed": i}
            body = {"model": "my-model", "messages": messages, **sampling}
            f.write(
                json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
            f.write("\n")
    return path.stat().st_size


def plan(work: Path, requests: Path) -> dict:
    """`shardgen plan` in a child process: its wall time and peak RSS."""
    config = {"input": {"openai_batch": [str(requests)]}, "model": {"model": "my-model"},
              "shards": {"rows_per_shard": 1000}, "output": {"dir": str(work / "out")}}  # fmt: skip
    cfg = work / f"{requests.stem}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    manifest = work / f"{requests.stem}.manifest.json"
    cmd = [sys.executable, "-m", "shardgen.cli", "plan", "--config", str(cfg), "--manifest", str(manifest)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    shards = len(json.loads(manifest.read_text())["shards"])
    return {"seconds": round(seconds, 2), "peak_rss_mb_so_far": round(peak, 1), "shards": shards}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[10000, 50000])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in sorted(args.requests):  # smallest first: the children's peak RSS only grows
            path = work / f"batch-{n}.jsonl"
            size = write_batch(path, n)
            runs.append({"requests": n, "file_mb": round(size / 2**20, 1), **plan(work, path)})
    small, big = runs[0], runs[-1]
    result = {
        "what": "shardgen plan of an OpenAI Batch request file: wall time and peak RSS of the planning process",
        "runs": runs,
        "ratio_requests": round(big["requests"] / small["requests"], 2),
        "ratio_seconds": round(big["seconds"] / small["seconds"], 2),
        "ratio_peak_rss": round(big["peak_rss_mb_so_far"] / small["peak_rss_mb_so_far"], 2),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows = "\n".join(f"| {r['requests']:,} | {r['file_mb']} MB | {r['shards']} | {r['seconds']} s | "
                     f"{r['peak_rss_mb_so_far']} MB |" for r in runs)  # fmt: skip
    md = (
        "# Planning an OpenAI Batch input (`bench/batch_plan.py`)\n\n"
        "| requests | file | shards | plan time | peak RSS (largest child so far) |\n|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"{result['ratio_requests']}× the requests: {result['ratio_seconds']}× the time, "
        f"{result['ratio_peak_rss']}× the peak memory. Planning reads every line once (JSON, custom_id, "
        f"model) and keeps an 8-byte digest per custom_id and an offset per 1,024 lines. {result['date']}.\n"
    )
    write_results(args.out, "batch_plan", result, md)


if __name__ == "__main__":
    main()
