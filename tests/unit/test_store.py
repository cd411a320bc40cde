"""The request store (``engines.store``, ``cache``): answers kept by request, found again in later runs
and jobs, requests with one key sent once; an entry that does not verify, or a file not written whole,
is never read as an answer. On the fake engine: what is tested is shardgen's bookkeeping."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shardgen.data.plan import write_manifest
from shardgen.data.stats import merge_shard_stats, summary_text
from shardgen.engines import fake as fake_engine
from shardgen.engines.store import SCHEMA, RequestStore
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import base_config, make_rows, write_parquet

GREEDY = {"temperature": 0.0, "max_tokens": 24}


def plan(
    tmp_path: Path,
    rows: int = 24,
    template: str = "Write one short sentence about {{ topic }}.",
    endpoint: str | None = None,
    **overrides,
):
    data = write_parquet(tmp_path / "in.parquet", make_rows(rows))
    inputs = {"parquet": [str(data)], **({"storage_options": {"endpoint_url": endpoint}} if endpoint else {})}
    sections = {"output": {"dir": str(tmp_path / "out")}, "engine": {"kind": "fake"}, "sampling": GREEDY, "cache": {},
                "shards": {"rows_per_shard": rows}, "prompt": {"template": template}, **overrides}  # fmt: skip
    config = base_config(inputs, **sections)
    write_manifest(config, tmp_path / "manifest.json")
    return config, tmp_path / "manifest.json"


def run(tmp_path: Path, config, manifest, name: str, engine=None):
    out, stats = tmp_path / f"{name}.parquet", tmp_path / f"{name}.json"
    engine = engine or fake_engine.FakeEngine()
    run_shard(config, manifest, "00000", out, stats, JobContext(engine))
    return pq.read_table(out).to_pylist(), json.loads(stats.read_text()), engine


def figures(stats):
    return [stats[k] for k in ("rows_generated", "requests_reused", "requests_deduplicated", "attempt_requests")]


def entry_files(config) -> list[Path]:
    return sorted((Path(config.output.dir) / "cache" / "entries").glob("*.parquet"))


def test_duplicates_go_to_the_engine_once_and_a_rerun_takes_every_answer_from_the_store(tmp_path):
    config, manifest = plan(tmp_path)
    rows, stats, engine = run(tmp_path, config, manifest, "first")
    topics = collections.Counter(r["topic"] for r in rows)
    assert len(topics) == 8 and engine.answered == 8, "8 distinct prompts: 8 requests"
    assert figures(stats) == [8, 0, 16, 8]
    said = summary_text(merge_shard_stats([stats]))
    assert "requests        8 rows generated, 0 answered from the request store, 16 by a duplicate" in said, said
    assert [r["row_index"] for r in rows] == list(range(24)), "every row once, in input order"
    by_topic = {}
    for r in rows:
        assert by_topic.setdefault(r["topic"], r["generation"]) == r["generation"], "a duplicate has the same result"
    assert collections.Counter(r["result_source"] for r in rows) == {"engine": 8, "duplicate": 16}
    assert all(r["prompt_tokens"] > 0 and r["generated_tokens"] > 0 for r in rows)

    again, stats, engine = run(tmp_path, config, manifest, "again")
    assert engine.starts == 0 and figures(stats) == [0, 24, 0, 0], "every request stored: no engine started"
    assert {r["result_source"] for r in again} == {"store"}
    keep = ("row_index", "generation", "finish_reason", "prompt_tokens", "generated_tokens")
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in rows]
    assert stats["attempt_generated_tokens"] == 0 and stats["histograms"]["ttft_s"] == {}, "no engine work counted"


def test_an_edited_branch_of_the_template_reruns_only_the_rows_whose_prompt_changed(tmp_path):
    before = "{% if topic == 'owls' %}Two words on {{ topic }}.{% else %}One line on {{ topic }}.{% endif %}"
    config, manifest = plan(tmp_path, template=before)
    rows, _, _ = run(tmp_path, config, manifest, "first")
    after = before.replace("Two words on", "Three words on")
    config, manifest = plan(tmp_path, template=after)
    again, stats, engine = run(tmp_path, config, manifest, "edited")
    owls = [r["row_index"] for r in rows if r["topic"] == "owls"]
    assert engine.starts == 1 and engine.answered == 1, "one prompt changed: the engine, for one request"
    assert figures(stats) == [1, 21, 2, 1]
    assert [r["row_index"] for r in again if r["result_source"] != "store"] == owls
    unchanged = [(r["row_index"], r["generation"]) for r in rows if r["topic"] != "owls"]
    assert [(r["row_index"], r["generation"]) for r in again if r["topic"] != "owls"] == unchanged


def test_sampling_without_a_seed_is_never_reused_and_a_seed_makes_each_row_its_own_request(tmp_path):
    config, manifest = plan(tmp_path, sampling={"temperature": 0.8, "max_tokens": 8})
    run(tmp_path, config, manifest, "first")
    _, stats, engine = run(tmp_path, config, manifest, "again")
    assert engine.answered == 24 and figures(stats) == [24, 0, 0, 24] and entry_files(config) == []
    seeded, manifest = plan(tmp_path / "s", sampling={"temperature": 0.8, "max_tokens": 8, "seed": 3})
    _, stats, engine = run(tmp_path / "s", seeded, manifest, "first")
    assert engine.answered == 24, "each row has its own seed: no two rows share a request"
    _, stats, engine = run(tmp_path / "s", seeded, manifest, "again")
    assert engine.answered == 0 and stats["requests_reused"] == 24


def test_cache_enabled_false_sends_every_row_and_keeps_nothing(tmp_path):
    config, manifest = plan(tmp_path, cache={"enabled": False})
    rows, stats, engine = run(tmp_path, config, manifest, "first")
    assert engine.answered == 24 and figures(stats) == [24, 0, 0, 24] and entry_files(config) == []
    assert {r["result_source"] for r in rows} == {"engine"}


def test_another_model_setting_sampling_parameter_or_engine_is_another_request_its_speed_is_not(tmp_path):
    config, manifest = plan(tmp_path)
    run(tmp_path, config, manifest, "first")
    for name, overrides in (("tokens", {"sampling": {**GREEDY, "max_tokens": 25}}),
                            ("model", {"model": {"max_model_len": 2048}}),
                            ("engine", {"engine": {"kind": "fake", "fake": {"reject_rows": [99]}}})):  # fmt: skip
        other, manifest = plan(tmp_path, **overrides)
        _, stats, engine = run(tmp_path, other, manifest, name)
        assert engine.answered == 8 and stats["requests_reused"] == 0, name
    faster, manifest = plan(tmp_path, engine={"kind": "fake", "fake": {"tokens_per_second": 9999}})
    _, stats, engine = run(tmp_path, faster, manifest, "faster")
    assert engine.answered == 0 and stats["requests_reused"] == 24, "the engine's speed changes no answer"


def test_a_corrupt_entry_a_file_that_does_not_read_and_a_partial_file_are_ignored_and_generated_again(tmp_path):
    config, manifest = plan(tmp_path)
    rows, _, _ = run(tmp_path, config, manifest, "first")
    (path,) = entry_files(config)
    table = pq.read_table(path)
    answers = table.column("answer").to_pylist()
    answers[0] = answers[0].replace('"text": "', '"text": "tampered ')
    pq.write_table(table.set_column(1, "answer", pa.array(answers, pa.string())), path)
    entries = path.parent
    (entries / "broken.parquet").write_bytes(b"PAR1 not a parquet file")
    (entries / ".killed.parquet.partial").write_bytes(path.read_bytes()[:100])  # a writer killed mid-write
    store = RequestStore(str(Path(config.output.dir) / "cache"))
    store.refresh()
    assert len(store.files) == 1, "the broken file is not indexed, the partial one not listed"
    again, stats, engine = run(tmp_path, config, manifest, "again")
    assert engine.answered == 1 and stats["requests_reused"] == 21 and stats["requests_deduplicated"] == 2
    assert not any("tampered" in r["generation"] for r in again)
    assert [r["generation"] for r in again] == [r["generation"] for r in rows]


def test_two_writers_of_one_directory_each_find_the_others_entries(tmp_path):
    a, b = RequestStore(str(tmp_path / "c")), RequestStore(str(tmp_path / "c"))
    a.put([(bytes(16), '{"pooled": [1.0]}')])
    b.put([(bytes([1]) * 16, '{"pooled": [2.0]}')])
    a.refresh()
    b.refresh()
    assert a.get(bytes([1]) * 16) == b.get(bytes([1]) * 16) == '{"pooled": [2.0]}'
    assert a.get(bytes(16)) == b.get(bytes(16)) == '{"pooled": [1.0]}'
    assert pq.read_schema(next((tmp_path / "c" / "entries").glob("*.parquet"))).remove_metadata() == SCHEMA


def test_a_store_in_object_storage_answers_a_rerun_through_throttling_and_a_denied_one_loses_no_row(
    tmp_path, s3_server
):
    """``cache.dir: s3://...`` on the S3 test server, through a proxy that throttles the first two requests
    for each object (the AWS SDK retries), then one that denies writes and reads: the rows are all
    generated and saved, the preflight names the key, and nothing is read as an answer."""
    from shardgen.base import storage
    from tests.conftest import s3_bucket
    from tests.s3faults import FaultProxy

    s3_bucket(s3_server, "store")
    with FaultProxy(s3_server, throttle=2) as proxy:
        config, manifest = plan(tmp_path, cache={"dir": "s3://store/cache"}, endpoint=proxy.url)
        rows, stats, engine = run(tmp_path, config, manifest, "first")
        assert engine.answered == 8 and stats["requests_deduplicated"] == 16
        again, stats, engine = run(tmp_path, config, manifest, "again")
        assert engine.answered == 0 and stats["requests_reused"] == 24 and proxy.throttled >= 2
        assert [r["generation"] for r in again] == [r["generation"] for r in rows]
    with FaultProxy(s3_server, deny="/store/") as proxy:
        proxy.deny_reads = True
        denied, manifest = plan(tmp_path, cache={"dir": "s3://store/other"}, endpoint=proxy.url)
        said = storage.check_writable("s3://store/other", {"endpoint_url": proxy.url}, "cache.dir")
        assert said and said.startswith("cache.dir: cannot write under 's3://store/other': "), said
        rows, stats, engine = run(tmp_path, denied, manifest, "denied")
        assert engine.answered == 8 and [r["row_index"] for r in rows] == list(range(24)) and proxy.denied


def test_shardgen_cache_says_what_the_store_holds_and_prunes_it_by_model_age_and_size(tmp_path, capsys):
    from shardgen.cli import main

    config, manifest = plan(tmp_path)
    run(tmp_path, config, manifest, "first")
    run(tmp_path, config, manifest, "again")
    other, manifest = plan(tmp_path, model={"max_model_len": 2048})
    run(tmp_path, other, manifest, "other")
    root = str(Path(config.output.dir) / "cache")
    assert main(["cache", "--dir", root]) == 0
    said = capsys.readouterr().out
    model = config.model["model"]
    assert "16 entries in 3 files" in said and f"{model}: 16 entries" in said, said
    assert "16 by the engine, 24 from the store, 32 by a duplicate" in said, said
    assert main(["cache", "--dir", root, "--max-size", "1"]) == 0
    assert "removed 3 file(s), 16 entries" in capsys.readouterr().out
    _, stats, engine = run(tmp_path, config, manifest, "after")
    assert engine.answered == 8 and stats["requests_reused"] == 0, "pruned: generated again"
    assert main(["cache", "--dir", root, "--model", "another", "--older-than", "1"]) == 0
    assert "removed 0 file(s)" in capsys.readouterr().out
    assert main(["cache", "--dir", root, "--model", model]) == 0
    assert "removed 1 file(s), 8 entries" in capsys.readouterr().out


def test_two_runs_that_share_a_cache_dir_answer_each_others_requests(tmp_path):
    shared = {"dir": str(tmp_path / "shared")}
    first, manifest = plan(tmp_path / "a", cache=shared)
    rows, _, _ = run(tmp_path / "a", first, manifest, "first")
    second, manifest = plan(tmp_path / "b", cache=shared)
    again, stats, engine = run(tmp_path / "b", second, manifest, "second")
    assert engine.starts == 0 and stats["requests_reused"] == 24 and not (tmp_path / "b" / "out" / "cache").exists()
    assert [r["generation"] for r in again] == [r["generation"] for r in rows]


def test_the_preflight_says_how_many_rows_sample_without_a_seed_and_so_are_never_reused(tmp_path):
    from shardgen.jobs import preflight

    config, manifest = plan(tmp_path, sampling={"temperature": 0.7, "max_tokens": 8})
    notes = preflight.run(config, manifest)["warnings"]
    assert any(n.startswith("24 of 24 sampled rows sample at a temperature above 0 without a seed (about 24 of all")
               for n in notes), notes  # fmt: skip
    seeded, manifest = plan(tmp_path / "s", sampling={"temperature": 0.7, "max_tokens": 8, "seed": 1})
    assert not any("without a seed" in n for n in preflight.run(seeded, manifest)["warnings"])
