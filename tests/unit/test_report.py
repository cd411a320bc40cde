"""Report: every plot is written as valid SVG with its title, for 3 and for 2,000
shards; null and list token columns are handled; and ``snakemake --report`` on
the real Snakefile embeds the plots and their captions."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from shardgen import config as cfg
from shardgen.commands.report import FILES, length_counts, make_plots, plot_token_lengths, totals
from shardgen.data.manifest import Manifest
from shardgen.data.plan import write_manifest
from shardgen.data.stats import LogHistogram, merge_shard_stats
from shardgen.errors import ShardgenError
from shardgen.jobs.merge import merge
from shardgen.requests.results import ResultSpec
from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import snakemake_command

SVG = "{http://www.w3.org/2000/svg}"


def shard_stats(i: int, rows: int, rng: random.Random, queue: bool = True, slow: bool = False) -> dict[str, Any]:
    """One shard's stats as generate writes them (with the Slurm fields of a cluster run)."""
    ttft, latency = LogHistogram(), LogHistogram()
    for _ in range(rows):
        t = rng.lognormvariate(-2.0, 0.6)
        ttft.add(t)
        latency.add(t + rng.uniform(0.5, 2.0))
    generated = rows * 30
    gen_s = rng.uniform(40, 60) * (8 if slow else 1)
    engine_s = rng.uniform(30, 50)
    wall_s = engine_s + gen_s + rng.uniform(2, 8)
    s = {
        "shard": f"{i:05d}",
        "rows": rows,
        "errors": 1,
        "rows_resumed": 0,
        "rows_generated": rows,
        "prompt_tokens": rows * 120,
        "cached_prompt_tokens": rows * 60,
        "generated_tokens": generated,
        "attempt_requests": rows,
        "attempt_prompt_tokens": rows * 120,
        "attempt_generated_tokens": generated,
        "engine_start_seconds": round(engine_s, 3),
        "generation_seconds": round(gen_s, 3),
        "wall_seconds": round(wall_s, 3),
        "gpus": 1,
        "gpu_hours": wall_s / 3600,
        "error_reasons": {"prompt_too_long": 1},
        "output_tokens_per_s": generated / gen_s,
        "slurm": {"job_id": str(50000 + i), "partition": "gpu"},
        "histograms": {"ttft_s": ttft.to_json(), "latency_s": latency.to_json()},
    }
    if queue:
        s["queue_wait_seconds"] = round(rng.uniform(0, 900), 1)
    return s


def output_table(rows: int, samples: str = "one") -> pa.Table:
    """Token columns of a merged output: a null on every 16th row (an error row).

    ``samples``: "one" (one sample per row), "list" (two samples in list
    columns) or "rows" (two output rows per input row, with ``sample_index``).
    """
    prompt = [None if i % 16 == 5 else 20 + (i * 37) % 400 for i in range(rows)]
    generated = [None if p is None else 1 + (i * 7) % 48 for i, p in enumerate(prompt)]
    second = [None if p is None else 1 + (i * 11) % 48 for i, p in enumerate(prompt)]
    columns: dict[str, Any] = {"row_index": list(range(rows))}
    if samples == "list":
        columns["generated_tokens"] = pa.array(
            [None if g is None else [g, h] for g, h in zip(generated, second, strict=True)], pa.list_(pa.int32())
        )
    elif samples == "rows":
        columns = {
            "row_index": [i for i in range(rows) for _ in (0, 1)],
            "sample_index": pa.array([0, 1] * rows, pa.int32()),
            "generated_tokens": pa.array([v for pair in zip(generated, second, strict=True) for v in pair], pa.int32()),
        }
        prompt = [p for p in prompt for _ in (0, 1)]
    else:
        columns["generated_tokens"] = pa.array(generated, pa.int32())
    columns["generation"] = ["text"] * len(prompt)
    columns["prompt_tokens"] = pa.array(prompt, pa.int32())
    return pa.table(columns)


def write_output(table: pa.Table, directory: Path, fmt: str = "parquet") -> Path:
    """The merged output as ``output.format`` writes it."""
    if fmt == "jsonl":
        path = directory / "output.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    elif fmt == "hf":
        import datasets

        path = directory / "output"
        datasets.Dataset(table).save_to_disk(str(path))
    else:
        path = directory / "output.parquet"
        pq.write_table(table, path, row_group_size=1000)
    return path


def write_run(
    directory: Path,
    n_shards: int,
    rows_per_shard: int = 16,
    queue: str = "all",
    samples: str = "one",
    fmt: str = "parquet",
    slow_shard: int | None = None,
) -> tuple[Path, Path]:
    """A finished run's ``stats.json`` (as merge writes it) and its merged output.

    ``queue``: which shards recorded a queue wait ("all", "some", "none").
    """
    rng = random.Random(n_shards)
    shards = [
        shard_stats(
            i, rows_per_shard, rng, queue=queue == "all" or (queue == "some" and i % 3 != 0), slow=i == slow_shard
        )
        for i in range(n_shards)
    ]
    stats = merge_shard_stats(shards)
    stats["shards"] = [{k: v for k, v in s.items() if k != "histograms"} for s in shards]
    directory.mkdir(parents=True, exist_ok=True)
    stats_path = directory / "stats.json"
    stats_path.write_text(json.dumps(stats, indent=1))
    return stats_path, write_output(output_table(n_shards * rows_per_shard, samples), directory, fmt)


def svg_texts(path: Path) -> tuple[str, list[str]]:
    """Parse an SVG (failing on invalid XML): its <title> and every text it draws."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    return (title.text if title is not None else ""), ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


class _Table(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, str] = {}
        self._cell: list[str] = []
        self._cells: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("th", "td"):
            self._cell = []

    def handle_data(self, data):
        self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("th", "td"):
            self._cells.append("".join(self._cell))
        if tag == "tr":
            self.rows[self._cells[0]] = self._cells[1]
            self._cells = []


def totals_table(path: Path) -> dict[str, str]:
    parser = _Table()
    parser.feed(path.read_text())
    return parser.rows


# (file, its title, texts its axes must show: labels with units)
EXPECTED = {
    "throughput.svg": ("Output tokens/s per shard", ["output tokens/s (tokens per second)"]),
    "ttft.svg": ("Time to first token", ["time to first token (s, log scale)", "requests per bucket"]),
    "token_lengths.svg": (
        "Prompt and output lengths",
        ["prompt length (tokens)", "output length (tokens)", "rows (count)"],
    ),
    "time_per_shard.svg": ("Where the time went, per shard", ["queue wait", "engine start", "generation"]),
}


def test_three_shards_give_every_plot_as_valid_svg_with_title_and_labelled_axes(tmp_path):
    stats, output = write_run(tmp_path / "results", 3)
    paths = make_plots(stats, output, tmp_path / "plots")
    assert [p.name for p in paths] == list(FILES)
    for name, (title, labels) in EXPECTED.items():
        svg_title, texts = svg_texts(tmp_path / "plots" / name)
        assert svg_title.startswith(title), name
        assert any(t.startswith(title) for t in texts), f"{name}: the title is drawn"
        for label in labels:
            assert any(label in t for t in texts), f"{name}: {label!r} missing from {texts}"
    # one bar per shard, named by its id; time is in seconds or minutes per shard
    _, texts = svg_texts(tmp_path / "plots" / "throughput.svg")
    assert {"shard (id)", "00000", "00001", "00002"} <= set(texts)
    _, texts = svg_texts(tmp_path / "plots" / "time_per_shard.svg")
    assert {"00000", "00002"} <= set(texts) and ({"time (s)", "time (min)"} & set(texts))
    _, texts = svg_texts(tmp_path / "plots" / "ttft.svg")
    assert "Time to first token (48 requests)" in texts
    assert any(t.startswith("p50 ") and t.endswith(" s") for t in texts)


def test_two_thousand_shards_give_a_ranked_line_and_grouped_bars_not_2000_bars(tmp_path):
    stats, output = write_run(tmp_path / "results", 2000, rows_per_shard=4, slow_shard=1234)
    make_plots(stats, output, tmp_path / "plots")
    _, texts = svg_texts(tmp_path / "plots" / "throughput.svg")
    assert "Output tokens/s per shard (2,000 shards, ranked)" in texts
    assert "shard rank, slowest first (1 to 2,000)" in texts
    assert any(t.startswith("slowest: 01234 (job 51234)") for t in texts), "the slow shard is named"
    _, texts = svg_texts(tmp_path / "plots" / "time_per_shard.svg")
    assert "Where the time went, per shard (2,000 shards, mean of each group of 34)" in texts
    assert "mean time per shard (min)" in texts
    for name in EXPECTED:
        _, texts = svg_texts(tmp_path / "plots" / name)
        assert len(texts) < 80, f"{name}: readable, not a label per shard"
        assert (tmp_path / "plots" / name).stat().st_size < 200_000
    _, texts = svg_texts(tmp_path / "plots" / "ttft.svg")
    assert "Time to first token (8,000 requests)" in texts


def test_totals_table_adds_up_the_run_and_says_na_for_a_queue_wait_not_recorded(tmp_path):
    stats_path, output = write_run(tmp_path / "a", 3, queue="none")
    make_plots(stats_path, output, tmp_path / "a" / "plots")
    stats = json.loads(stats_path.read_text())
    rows = totals_table(tmp_path / "a" / "plots" / "totals.html")
    assert rows["rows"] == "48 (3 errors)"
    assert rows["shards"] == "3 (rows resumed from checkpoints: 0)"
    assert rows["generated tokens"] == "1,440"
    assert rows["output tokens/s"] == f"{stats['output_tokens_per_s']:,.1f}"
    assert rows["GPU-hours"] == f"{stats['gpu_hours']:,.4f}"
    assert rows["prefix cache hits"] == "50.0% of prompt tokens"
    assert rows["errors by reason"] == "prompt_too_long: 3"
    assert rows["queue wait, all shards"] == "n/a"
    _, texts = svg_texts(tmp_path / "a" / "plots" / "time_per_shard.svg")
    assert "queue wait (n/a: not recorded)" in texts

    stats_path, output = write_run(tmp_path / "b", 3, queue="some")
    make_plots(stats_path, output, tmp_path / "b" / "plots")
    assert totals_table(tmp_path / "b" / "plots" / "totals.html")["queue wait, all shards"].endswith(
        "(n/a for 1 shard)"
    )
    _, texts = svg_texts(tmp_path / "b" / "plots" / "time_per_shard.svg")
    assert "queue wait (n/a for 1 shard)" in texts


def test_null_figures_in_the_stats_are_na_not_errors():
    stats = merge_shard_stats([])
    stats["shards"] = [{"shard": "00000", "output_tokens_per_s": None, "generation_seconds": None, "slurm": {}}]
    rows = dict(totals(stats, []))
    assert rows["output tokens/s"] == "n/a"
    assert rows["time to first token p50 / p90 / p99"] == "n/a / n/a / n/a"


def test_a_shard_without_throughput_is_marked_na(tmp_path):
    stats_path, output = write_run(tmp_path, 3)
    stats = json.loads(stats_path.read_text())
    stats["shards"][1]["output_tokens_per_s"] = None  # every row came from checkpoints
    del stats["shards"][1]["slurm"]
    stats_path.write_text(json.dumps(stats))
    make_plots(stats_path, output, tmp_path / "plots")
    _, texts = svg_texts(tmp_path / "plots" / "throughput.svg")
    assert "n/a" in texts
    assert any("1 shard n/a (no generation time)" in t for t in texts)


def test_null_token_counts_are_counted_apart_from_the_lengths(tmp_path):
    _, output = write_run(tmp_path, 3)
    counts = length_counts(output, batch_size=7)
    prompt = pq.read_table(output).column("prompt_tokens").to_pylist()
    expected = np.bincount([p for p in prompt if p is not None])
    assert counts["prompt_tokens"].nulls == prompt.count(None) == 3
    assert np.array_equal(counts["prompt_tokens"].counts, expected)
    assert counts["generated_tokens"].total == 45 and not counts["generated_tokens"].per_sample
    _, texts = svg_texts(plot_token_lengths(counts, tmp_path / "lengths.svg"))
    assert any("3 without a value (error rows)" in t for t in texts)


def test_a_list_column_of_samples_is_flattened_one_count_per_sample(tmp_path):
    _, output = write_run(tmp_path, 3, samples="list")
    assert pa.types.is_list(pq.read_schema(output).field("generated_tokens").type)
    counts = length_counts(output, batch_size=5)
    generated = counts["generated_tokens"]
    assert generated.per_sample and generated.total == 2 * 45 and generated.nulls == 3
    values = [v for row in pq.read_table(output).column("generated_tokens").to_pylist() if row for v in row]
    assert np.array_equal(generated.counts, np.bincount(values))
    _, texts = svg_texts(plot_token_lengths(counts, tmp_path / "lengths.svg"))
    assert any(t.startswith("Output length (90 samples)") for t in texts)
    assert "samples (count)" in texts


def test_one_output_row_per_sample_counts_each_prompt_once_and_each_sample(tmp_path):
    _, output = write_run(tmp_path, 3, samples="rows")
    counts = length_counts(output, batch_size=7)
    assert counts["prompt_tokens"].total == 45 and counts["prompt_tokens"].nulls == 3, "once per input row"
    assert counts["generated_tokens"].per_sample and counts["generated_tokens"].total == 90
    assert counts["generated_tokens"].nulls == 6


@pytest.mark.parametrize("fmt", ["jsonl", "hf"])
def test_every_output_format_gives_the_same_counts_as_parquet(tmp_path, fmt):
    for samples in ("one", "list"):
        _, parquet = write_run(tmp_path / samples / "parquet", 3, samples=samples)
        _, other = write_run(tmp_path / samples / fmt, 3, samples=samples, fmt=fmt)
        expected, got = length_counts(parquet), length_counts(other, batch_size=10)
        for name in ("prompt_tokens", "generated_tokens"):
            assert np.array_equal(got[name].counts, expected[name].counts), (samples, name)
            assert (got[name].nulls, got[name].per_sample) == (expected[name].nulls, expected[name].per_sample)
    _, texts = svg_texts(plot_token_lengths(got, tmp_path / "lengths.svg"))
    assert any(t.startswith("Output length (90 samples)") for t in texts)


def test_length_counts_read_only_the_token_columns_batch_by_batch(tmp_path, monkeypatch):
    _, output = write_run(tmp_path, 3)
    seen: list[tuple[int, list[str]]] = []
    original = pq.ParquetFile.iter_batches

    def spy(self, batch_size=65536, row_groups=None, columns=None, **kw):
        for batch in original(self, batch_size=batch_size, row_groups=row_groups, columns=columns, **kw):
            seen.append((batch.num_rows, batch.schema.names))
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    length_counts(output, batch_size=10)
    assert all(names == ["prompt_tokens", "generated_tokens"] for _, names in seen)
    assert max(n for n, _ in seen) == 10 and sum(n for n, _ in seen) == 48


def test_an_empty_run_gives_every_file_saying_there_is_nothing(tmp_path):
    stats = merge_shard_stats([])
    stats["shards"] = []
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    schema = pa.schema([("prompt_tokens", pa.int32()), ("generated_tokens", pa.int32())])
    pq.write_table(schema.empty_table(), tmp_path / "output.parquet")
    paths = make_plots(tmp_path / "stats.json", tmp_path / "output.parquet", tmp_path / "plots")
    assert all(p.exists() for p in paths)
    assert "no shards" in svg_texts(tmp_path / "plots" / "throughput.svg")[1]
    assert "no time-to-first-token samples" in svg_texts(tmp_path / "plots" / "ttft.svg")[1]
    assert "no values" in svg_texts(tmp_path / "plots" / "token_lengths.svg")[1]


def test_unreadable_inputs_are_one_clear_error(tmp_path):
    stats, output = write_run(tmp_path, 3)
    with pytest.raises(ShardgenError, match="cannot read the stats"):
        make_plots(tmp_path / "nope.json", output, tmp_path / "plots")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ShardgenError, match="cannot read the output"):
        make_plots(stats, tmp_path / "bad.parquet", tmp_path / "plots")


def test_plots_are_byte_for_byte_repeatable(tmp_path):
    stats, output = write_run(tmp_path, 3)
    first = {p.name: p.read_bytes() for p in make_plots(stats, output, tmp_path / "one")}
    second = {p.name: p.read_bytes() for p in make_plots(stats, output, tmp_path / "two")}
    assert first == second


def test_shardgen_plots_command_writes_the_files(tmp_path, capsys):
    from shardgen.cli import main

    stats, output = write_run(tmp_path, 3)
    args = ["plots", "--stats", str(stats), "--output", str(output), "--out-dir", str(tmp_path / "p")]
    assert main(args) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == sorted(FILES)
    assert main([*args[:2], str(tmp_path / "missing.json"), *args[3:]]) == 2
    assert capsys.readouterr().err.startswith("shardgen: error: cannot read the stats")


# --- snakemake --report on the real Snakefile --------------------------------


def finished_run(workdir: Path) -> Path:
    """A finished run of the real workflow in ``workdir``, made without an engine.

    The plan is real (``write_manifest`` over real Parquet input), the shard
    files and stats are what generate writes, and the merge is the real
    merge. File times follow the DAG, so Snakemake sees every step up to
    the merge as done. Returns the config file.
    """
    write_parquet(workdir / "data" / "part-0.parquet", make_rows(30))
    config = {
        "input": {"parquet": ["data/*.parquet"], "id_column": "id"},
        "shards": {"rows_per_shard": 10},
        "prompt": {"template": "Write one short sentence about {{ topic }}."},
        "model": {"model": "models/demo-model", "max_model_len": 1024},
        "sampling": {"temperature": 0.0, "max_tokens": 12},
    }
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    resolved = cfg.validate(json.loads(json.dumps(config)))
    results = workdir / "results"
    old = os.getcwd()
    os.chdir(workdir)  # input paths are relative to the working directory, as in a run
    try:
        write_manifest(cfg.RunConfig.from_dict(resolved), results / "plan" / "manifest.json")
    finally:
        os.chdir(old)
    manifest = Manifest.load(results / "plan" / "manifest.json")
    (results / "plan" / "preflight.json").write_text(json.dumps({"ok": True, "problems": []}))
    (results / "shards").mkdir()
    spec = ResultSpec.of(cfg.RunConfig.from_dict(resolved))
    input_rows, rng = make_rows(30), random.Random(7)
    for shard in manifest.shards:
        schema = spec.schema(
            pq.read_schema(workdir / "data" / "part-0.parquet"),
            fingerprint="fp",
            config_fingerprint=cfg.content_fingerprint(resolved),
            shard_id=shard.id,
        )
        rows = [
            {
                **input_rows[i],
                "row_index": i,
                "generation": None if i == 3 else f"text {i}",
                "finish_reason": None if i == 3 else "stop",
                "prompt_tokens": None if i == 3 else 14 + i % 5,
                "generated_tokens": None if i == 3 else 1 + i % 12,
                "error": "prompt_too_long: 2000 tokens" if i == 3 else None,
            }
            for i in range(shard.start, shard.stop)
        ]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), results / "shards" / f"{shard.id}.parquet")
        stats = shard_stats(int(shard.id), shard.rows, rng)
        (results / "shards" / f"{shard.id}.stats.json").write_text(json.dumps(stats))
    os.chdir(workdir)  # output.dir is relative to it too
    try:
        merge(cfg.RunConfig.from_dict(resolved), results / "plan" / "manifest.json", results / "output.parquet",
              results / "stats.json")  # fmt: skip
    finally:
        os.chdir(old)
    # the times of a run that went in DAG order, all in the past
    now = time.time()
    steps = [
        [results / "plan" / "manifest.json"],
        [results / "plan" / "preflight.json"],
        sorted((results / "shards").iterdir()),
        [results / "output.parquet", results / "stats.json"],
    ]
    for age, paths in zip((400, 300, 200, 100), steps, strict=True):
        for p in paths:
            os.utime(p, (now - age, now - age))
    return configfile


def snakemake(workdir: Path, configfile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd, env = snakemake_command(workdir, configfile, "--cores", "1", *args)
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (
        f"snakemake {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    )
    return r


def report_script(html: str, script: str, name: str) -> Any:
    """The JSON a Snakemake 9 report embeds as ``var <name> = ...;`` in ``<script id="<script>">``."""
    m = re.search(rf'<script id="{script}">\s*var {name} = (.*?);\s*</script>', html, re.DOTALL)
    assert m, f"no {name} in the report"
    return json.loads(m.group(1))


def test_snakemake_report_of_a_finished_run_embeds_every_plot_and_its_caption(tmp_path):
    configfile = finished_run(tmp_path)
    plots = tmp_path / "results" / "plots"

    # After the merge only plot_stats is left to run: no shard job, no engine.
    dry = snakemake(tmp_path, configfile, "--dry-run")
    planned = set(re.findall(r"^rule (\w+):", dry.stdout, re.MULTILINE))
    assert planned == {"plot_stats", "all"}, dry.stdout[-3000:]

    snakemake(tmp_path, configfile)
    assert sorted(p.name for p in plots.iterdir()) == sorted(FILES)
    assert "wrote" in (tmp_path / "results" / "logs" / "plot_stats.log").read_text()

    # As a user would, after the run: the report of the default target.
    snakemake(tmp_path, configfile, "--report", "report.html")
    html = (tmp_path / "report.html").read_text()
    results = report_script(html, "results", "results")
    captions = {
        "totals.html": "Totals of the whole run",
        "throughput.svg": "Output tokens per second of each shard",
        "time_per_shard.svg": "Where each shard",
        "ttft.svg": "Time to first token of every request",
        "token_lengths.svg": "Prompt lengths",
    }
    for name, caption in captions.items():
        entry = results[f"results/plots/{name}"]
        assert entry["mime_type"] == ("text/html" if name.endswith(".html") else "image/svg+xml")
        # embedded whole, as base64 in a data URI: the report is one self-contained file
        data = base64.b64decode(entry["data_uri"].split("base64,", 1)[1])
        assert data == (plots / name).read_bytes(), name
        assert caption in entry["caption"], name
        assert entry["job_properties"]["rule"] == "plot_stats"
    # a caption's Jinja sees the run's config
    assert "in this run" in results["results/plots/time_per_shard.svg"]["caption"]
    assert "10" in results["results/plots/time_per_shard.svg"]["caption"]
    categories = report_script(html, "categories", "categories")
    assert {"Summary", "Throughput", "Latency", "Tokens"} <= set(categories)
    front = report_script(html, "workflow-desc", "workflow_desc")
    assert "shards of 10 rows" in front and "models/demo-model" in front
    assert "javascript:app.showResultInfo" in front, "the front page links to the plots"
