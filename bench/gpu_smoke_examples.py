"""The examples of config/examples/ that fit one GPU, for bench/gpu_smoke.sh: each as it is, on a
small made-up input with the columns its prompt reads, its model downloaded like a user's would be.

Usage: python bench/gpu_smoke_examples.py list
       python bench/gpu_smoke_examples.py prepare NAME DIR ROWS   (DIR/config.yaml, DIR/data/)
       python bench/gpu_smoke_examples.py check NAME RESULTS_DIR ROWS
``check`` prints what it found and exits 1 unless every row has a result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardgen import cluster  # noqa: E402
from shardgen.config import RunConfig  # noqa: E402
from shardgen.requests.prompts import PromptRenderer  # noqa: E402

EXAMPLES = ROOT / "config" / "examples"


def one_gpu() -> list[str]:
    """The examples whose jobs ask for one GPU on one node (not a run of steps: its input is not made
    up text, and its Python step needs its own packages)."""
    names = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        config = RunConfig.load(path)
        if config.raw.get("steps"):
            continue
        request = cluster.generate_request(config, None, "generate_shard", config.resources.runtime)
        if (request.gpus, request.nodes) == (1, 1):
            names.append(path.stem)
    return names


def prepare(name: str, out: Path, rows: int) -> None:
    """The example's config with a made-up input of ``rows`` rows, shards of a quarter of them, the
    model in the default Hugging Face cache and the output under ``out``."""
    raw = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    config = RunConfig.from_dict(raw)
    columns = sorted(PromptRenderer.from_config(config.prompt).columns)
    data = {
        c: [f"A short sample {c} number {i}, about the weather in a small town." for i in range(rows)] for c in columns
    }
    if config.input.id_column:
        data[config.input.id_column] = [f"{name}-{i:05d}" for i in range(rows)]
    (out / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(data), out / "data" / "part-0.parquet")
    raw["input"] = {**raw["input"], "parquet": [str(out / "data" / "*.parquet")]}
    raw["shards"] = {**raw.get("shards", {}), "rows_per_shard": max(rows // 4, 1)}
    raw["model"].pop("download_dir", None)
    raw["output"] = {**raw.get("output", {}), "dir": "results"}
    (out / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def check(name: str, results: Path, rows: int) -> int:
    table = pq.read_table(results / "output.parquet")
    stats = json.loads((results / "stats.json").read_text())
    errors = [e for e in table.column("error").to_pylist() if e]
    shard = json.loads(next((results / "shards").glob("*.stats.json")).read_text())
    gpus = [g.get("name") for g in shard.get("gpu_devices") or []]
    print(f"{name}: {table.num_rows} rows of {rows} inputs, {len(errors)} errors, GPUs {gpus}, precision "
          f"{shard.get('precision')}, {stats.get('output_tokens_per_s')} output tok/s, "
          f"{stats.get('requests_per_s')} req/s")  # fmt: skip
    problems = [] if len(gpus) == 1 and all(gpus) else [f"GPUs {gpus}, expected one"]
    if len(set(table.column("row_index").to_pylist())) != rows:
        problems.append(f"not every one of the {rows} rows is in the output")
    if errors:
        problems.append(f"{len(errors)} row(s) with an error, the first: {errors[:1]}")
    for p in problems:
        print(f"{name}: PROBLEM: {p}")
    return 1 if problems else 0


def main() -> int:
    what = sys.argv[1]
    if what == "list":
        print("\n".join(one_gpu()))
        return 0
    name, path, rows = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    if what == "prepare":
        prepare(name, path, rows)
        return 0
    return check(name, path, rows)


if __name__ == "__main__":
    sys.exit(main())
