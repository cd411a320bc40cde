"""The fake engine (``engine.kind: fake``): a shard job through the same feed, checkpoints and commit as on
vLLM, in a fraction of a second: its answers follow its documented rule, its failures are survived."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from shardgen.data.plan import write_manifest
from shardgen.engines import fake as fake_engine
from shardgen.errors import ConfigError
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import ROOT, base_config, make_rows, write_parquet
from tests.integration.workflow import part_rows

FAKE = {"kind": "fake"}


def plan(tmp_path, rows=20, engine=None, **overrides):
    data = write_parquet(tmp_path / "in.parquet", make_rows(rows))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(tmp_path / "out")},
                         engine=FAKE if engine is None else engine, **overrides)  # fmt: skip
    manifest = tmp_path / "manifest.json"
    write_manifest(config, manifest)
    return config, manifest


def run(tmp_path, config, manifest, shard="00000", name="s", engine=None):
    out, stats = tmp_path / f"{name}.parquet", tmp_path / f"{name}.json"
    run_shard(config, manifest, shard, out, stats, JobContext(engine))
    return pq.read_table(out).to_pylist(), json.loads(stats.read_text())


def test_a_shard_on_the_fake_engine_gets_every_row_once_with_the_answer_its_rule_gives(tmp_path):
    config, manifest = plan(tmp_path, shards={"rows_per_shard": 20}, sampling={"max_tokens": 64})
    rows, stats = run(tmp_path, config, manifest)
    assert [r["row_index"] for r in rows] == list(range(20)) and stats["rows_generated"] == 20
    assert all(r["generation"].startswith("fake ") and r["finish_reason"] == "stop" for r in rows)
    answers = {(r["topic"], r["generation"]) for r in rows}  # 8 topics: 8 prompts
    assert len(answers) == len({r["generation"] for r in rows}) == 8, "each prompt its own answer, and only one"
    again, _ = run(tmp_path, config, manifest, name="again")
    assert [r["generation"] for r in again] == [r["generation"] for r in rows], "the same answers in every run"
    cut, _ = run(tmp_path, *plan(tmp_path / "cut", sampling={"max_tokens": 2}), name="cut")
    assert {r["finish_reason"] for r in cut} == {"length"} and {r["generated_tokens"] for r in cut} == {2}
    long, _ = run(tmp_path, *plan(tmp_path / "long", sampling={"max_tokens": 40, "ignore_eos": True}), name="long")
    assert {r["finish_reason"] for r in long} == {"length"} and {r["generated_tokens"] for r in long} == {40}


def test_the_fake_engine_answers_samples_labels_and_json_as_the_sampling_asks(tmp_path):
    config, manifest = plan(tmp_path, rows=8, sampling={"n": 3, "seed": 7, "max_tokens": 32})
    rows, _ = run(tmp_path, config, manifest)
    assert len(rows) == 24 and {r["sample_index"] for r in rows} == {0, 1, 2}
    assert len({r["generation"] for r in rows if r["row_index"] == 0}) == 3, "each sample its own answer"
    labels = {"choice": ["yes", "no"]}
    config, manifest = plan(tmp_path / "c", sampling={"max_tokens": 4, "structured_outputs": labels})
    rows, _ = run(tmp_path / "c", config, manifest)
    assert {r["label"] for r in rows} <= {"yes", "no"} and all(r["error"] is None for r in rows)
    schema = {"type": "object", "required": ["topic", "score"],
              "properties": {"topic": {"type": "string"}, "score": {"type": "integer"}}}  # fmt: skip
    config, manifest = plan(tmp_path / "j", sampling={"max_tokens": 64, "structured_outputs": {"json": schema}})
    rows, _ = run(tmp_path / "j", config, manifest)
    assert all(r["error"] is None and r["parsed"]["score"] == 0 for r in rows)
    nested = {"$defs": {"Score": {"type": "integer", "minimum": 3}}, "type": "object", "required": ["s", "t"],
              "properties": {"s": {"$ref": "#/$defs/Score"}, "t": {"type": "string", "maxLength": 4}}}  # fmt: skip
    assert fake_engine.instance(nested, "0123456789abcdef") == {"s": 3, "t": "0123"}


def test_rows_the_fake_engine_refuses_are_their_rows_errors_and_the_others_go_on(tmp_path):
    engine = {"kind": "fake", "fake": {"reject_rows": [2, 5]}}
    config, manifest = plan(tmp_path, rows=8, engine=engine, errors={"max_rate": 0.5})
    rows, stats = run(tmp_path, config, manifest)
    errors = {r["row_index"]: r["error"] for r in rows if r["error"]}
    assert sorted(errors) == [2, 5] and all(e.startswith("rejected_by_engine: ") for e in errors.values())
    assert stats["errors"] == 2


def test_a_dead_engine_fails_the_attempt_and_the_next_one_answers_only_the_rows_not_saved(tmp_path):
    engine = {"kind": "fake", "fake": {"crash_after": 5, "tokens_per_second": 10000}}
    config, manifest = plan(tmp_path, engine=engine, shards={"rows_per_shard": 20}, checkpoint={"rows": 1})
    with pytest.raises(fake_engine.FakeEngineDied, match="after 5 requests"):
        run(tmp_path, config, manifest)
    assert part_rows(tmp_path / "out" / "checkpoints" / "00000") == 5
    handle = fake_engine.FakeEngine()  # the next attempt's engine, which does not die
    rows, stats = run(tmp_path, config, manifest, engine=handle)
    assert [r["row_index"] for r in rows] == list(range(20)), "every row once"
    assert handle.answered == 15 and stats["rows_generated"] == 15, "the saved rows are not asked again"
    assert len(stats["attempts"]) == 2


def test_the_fake_engine_pools_as_the_task_asks_from_its_models_head(tmp_path):
    """classify: a probability per id2label class; reward: the raw score of one output; embed: a unit
    vector of the model's size; the same row the same values in every run."""
    prompt = {"template": "A note about {{ topic }}.", "chat": False}

    def pooled(task, model, name, **overrides):
        config, manifest = plan(tmp_path / name, rows=8, task=task, prompt=prompt, sampling={},
                                model={"model": str(ROOT / "models" / model)}, **overrides)  # fmt: skip
        rows, stats = run(tmp_path / name, config, manifest)
        assert all(r["error"] is None for r in rows) and stats["rows_generated"] == 8
        return rows

    labels = json.loads((ROOT / "models" / "classifier" / "config.json").read_text())["id2label"]
    classified = pooled("classify", "classifier", "c")
    assert all(sum(r["probs"].values()) == pytest.approx(1, abs=1e-5) for r in classified)
    assert {r["label"] for r in classified} <= set(labels.values()) and len({r["label"] for r in classified}) > 1
    rewards = [r["reward"] for r in pooled("reward", "reward", "r")]
    assert any(not 0 <= x <= 1 for x in rewards) and len(set(rewards)) > 1, "raw scores"
    assert [r["reward"] for r in pooled("reward", "reward", "r2")] == rewards, "the same values in every run"
    embedded = pooled("embed", "SmolLM2-135M-Instruct", "e")
    assert {len(r["embedding"]) for r in embedded} == {576}
    assert all(sum(x * x for x in r["embedding"]) == pytest.approx(1, abs=1e-4) for r in embedded)


def test_the_fake_engines_failures_go_with_it_and_its_rows_are_not_vllms(tmp_path):
    with pytest.raises(ConfigError, match="engine.fake is set, but engine.kind is vllm"):
        plan(tmp_path, engine={"fake": {"crash_after": 3}})
    data = str(write_parquet(tmp_path / "in.parquet", make_rows(4)))

    def fingerprint(**engine):
        return base_config({"parquet": [data]}, **engine).fingerprint

    assert fingerprint(engine=FAKE) != fingerprint(), "a fake run's shards are never a vLLM run's"
    assert fingerprint(engine={"kind": "vllm"}) == fingerprint(), "vLLM runs keep their fingerprints"


def test_a_feed_stopped_at_a_refused_row_leaves_no_request_it_added_in_the_engine():
    """The engine took the batch's other requests before the refused row's error is handed out: when the
    consumer stops there (its error budget, a lost claim), those are aborted, not left running."""
    from types import SimpleNamespace

    from shardgen.jobs.feed.engine_loop import Feeder
    from shardgen.jobs.feed.requests import Request

    handle = fake_engine.FakeEngine({"reject_rows": [0]}, _settings=SimpleNamespace(model={}))
    params = SimpleNamespace(n=1, max_tokens=4)
    feed = Feeder(handle, window=8).run(Request(i, [1, 2, i], params) for i in range(4))
    first = next(feed)
    assert first.key == 0 and first.error is not None and first.error.reason == "rejected_by_engine"
    feed.close()  # the consumer raised
    assert not handle._queue, "the three requests the engine took were aborted"
