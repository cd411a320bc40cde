"""What a rerun generates again (issue 50), through the whole workflow (``profiles/local``), counted from
the shards' stats each run wrote (``rows_generated``: the rows the engine generated):

- growth: a run over two Parquet files, then one file added beside them and the same command again. With
  the defaults, the plan made again keeps the shards of the plan before it (``plan.kept_shards``) and the
  kept shards end at once; planned anew (``plan/manifest.last.json`` removed first) the added rows move
  every shard's boundaries, and the store answers the rows it has (sampled with ``sampling.seed``: the
  defaults sample without one, which is never reused); planned anew without the store
  (``cache.enabled: false``) is how every rerun was before: every row again.
- edit: then (planned anew, with ``sampling.seed``) one branch of the template's ``if`` edited (the rows
  of one topic): the rows whose rendered prompt changed are generated, the store answers the others.
- duplicates: a file where every prompt appears three times, greedy: each distinct request is generated
  once, and every row has the result of its request.

The engine is the fake one (``engine.kind: fake``): the figures are counts of rows, which no engine
changes, and the config sets nothing but its input, template and engine. Usage: python bench/reuse.py
[--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import write_results  # noqa: E402

TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "kites", "rivers"]
FIRST, ADDED = (20, 18), 52  # the run: two files of 38 rows, then a file of 52
DISTINCT = 40  # duplicates: each of these prompts three times
SEEDED = {"seed": 1}  # each row's own seed: its result is its request's, and the store may keep it
BRANCH = "{% if topic == 'owls' %}Describe {{ topic }} briefly{% else %}What is {{ topic }}?{% endif %}"
TEMPLATE = BRANCH + " (note {{ id }})"  # a prompt of its own for each row
EDITED = TEMPLATE.replace("Describe {{ topic }} briefly", "Describe {{ topic }} in a word")


def write_file(path: Path, ids: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"r{i:05d}", "topic": TOPICS[i % len(TOPICS)]} for i in ids]
    pq.write_table(pa.Table.from_pylist(rows), path)


def snakemake(work: Path, template: str = TEMPLATE, **sections: dict) -> list[dict]:
    """One run of the workflow; the stats of the shards it committed (those it did not rerun are left out)."""
    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    config = {"input": {"parquet": [str(work / "data" / "*.parquet")], "id_column": "id"},
              "prompt": {"template": template}, "model": {"model": str(model)}, "engine": {"kind": "fake"},
              **sections}  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    before = shard_stats(work)
    bin_dir = Path(sys.executable).absolute().parent
    cmd = [str(bin_dir / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work),
           "--profile", str(ROOT / "profiles" / "local"), "--configfile", str(work / "config.yaml")]  # fmt: skip
    r = subprocess.run(cmd, cwd=work, env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"),
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"the run in {work} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads(text) for name, text in shard_stats(work).items() if before.get(name) != text]


def shard_stats(work: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (work / "results" / "shards").glob("*.stats.json")}


def output(work: Path) -> list[dict]:
    return pq.read_table(work / "results" / "output.parquet").to_pylist()


def counted(stats: list[dict], changed: int) -> dict:
    generated = sum(s["rows_generated"] for s in stats)
    return {"shards_run_again": len(stats), "rows_generated": generated,
            "requests_reused": sum(s["requests_reused"] for s in stats),
            "requests_deduplicated": sum(s["requests_deduplicated"] for s in stats),
            "per_changed_row": round(generated / changed, 3)}  # fmt: skip


def growth(work: Path, anew: bool, **sections: dict) -> dict:
    """The first run, a file added, the rerun."""
    first = 0
    for i, rows in enumerate(FIRST):
        write_file(work / "data" / f"part-{i}.parquet", list(range(first, first + rows)))
        first += rows
    snakemake(work, **sections)
    write_file(work / "data" / f"part-{len(FIRST)}.parquet", list(range(first, first + ADDED)))
    if anew:
        (work / "results" / "plan" / "manifest.last.json").unlink()
    again = snakemake(work, **sections)
    assert [r["id"] for r in output(work)] == [f"r{i:05d}" for i in range(sum(FIRST) + ADDED)], "every row once"
    return counted(again, ADDED)


def edit(work: Path) -> dict:
    """After ``growth`` sampled with a seed: one branch of the template edited, the rerun."""
    before = output(work)
    changed = sum(r["topic"] == "owls" for r in before)
    again = snakemake(work, template=EDITED, sampling=SEEDED)
    after = output(work)
    assert [r["id"] for r in after] == [r["id"] for r in before], "every row once, in input order"
    for a, b in zip(before, after, strict=True):
        assert (a["generation"] == b["generation"]) == (a["topic"] != "owls"), a["id"]
    return {"rows": len(after), "rows_changed": changed, **counted(again, changed)}


def duplicates(work: Path) -> dict:
    """Every prompt three times, greedy (the fake engine's answers are its prompt's)."""
    rows = [{"id": f"r{i:05d}", "item": i % DISTINCT, "topic": TOPICS[i % DISTINCT % len(TOPICS)]}
            for i in range(3 * DISTINCT)]  # fmt: skip
    (work / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), work / "data" / "part-0.parquet")
    stats = snakemake(work, template="What is {{ topic }}? (note {{ item }})", sampling={"temperature": 0.0})
    rows = output(work)
    assert [r["id"] for r in rows] == [f"r{i:05d}" for i in range(3 * DISTINCT)], "every row once, in input order"
    answers: dict[int, str] = {}
    assert all(answers.setdefault(r["item"], r["generation"]) == r["generation"] for r in rows), "one result a request"
    return {"rows": len(rows), "distinct_requests": DISTINCT, **counted(stats, DISTINCT)}


def markdown(r: dict) -> str:
    def line(name: str, s: dict, bold: bool = False) -> str:
        per = f"**{s['per_changed_row']}**" if bold else s["per_changed_row"]
        return (f"| {name} | {s['shards_run_again']} | {s['rows_generated']} | {s['requests_reused']} | "
                f"{s['requests_deduplicated']} | {per} |")  # fmt: skip

    g, e = r["growth"], r["edit"]
    return f"""# What a rerun generates again

{r["date"]}. `python bench/reuse.py`: the whole workflow (`profiles/local`, the fake engine), the config's
defaults but its input, template (a prompt of its own for each row) and engine. Rows the engine generated
(`rows_generated` of the shards each run committed), against the rows that changed:

| run | shards run | rows generated | reused from the store | deduplicated | per changed row |
|---|---|---|---|---|---|
{line(f"growth, the defaults: {r['first_rows']} rows, then a file of {r['added_rows']} added", g["defaults"], True)}
{line("growth, planned anew (the shards' boundaries all move), the store (`sampling.seed: 1`)", g["planned_anew"])}
{line("growth, planned anew, `cache.enabled: false` (every rerun before issue 50)", g["planned_anew_no_store"])}
{line(f"edit: one branch of the template ({e['rows_changed']} of {e['rows']} rows; `sampling.seed: 1`)", e, True)}
{line(f"duplicates: {r['duplicates']['distinct_requests']} prompts, each 3 times, greedy", r["duplicates"], True)}

Growth with the defaults reuses by shard: the kept shards end at once. The defaults sample (temperature 1)
without a seed, and such a request is never reused: with `sampling.seed` (each row's own seed) or greedy
sampling, the request store answers every row whose request it has (`result_source: store`), however the
shards moved. Duplicates is a first run: one request per distinct prompt went to the engine, the others
were answered by it (`result_source: duplicate`), every row in input order. A file edited, removed or
added before the others plans again from that file on (docs/failures.md, "Changing the config"); the store
still answers its rows whose request did not change.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("defaults", "anew", "nostore", "dups"):
            (root / name).mkdir()
        result = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "first_rows": sum(FIRST),
            "added_rows": ADDED,
            "growth": {
                "defaults": growth(root / "defaults", anew=False),
                "planned_anew": growth(root / "anew", anew=True, sampling=SEEDED),
                "planned_anew_no_store": growth(root / "nostore", anew=True, cache={"enabled": False}),
            },
            "edit": edit(root / "anew"),
            "duplicates": duplicates(root / "dups"),
        }
    write_results(args.out, "reuse", result, markdown(result))


if __name__ == "__main__":
    main()
