"""Pins of the identities a refactoring could change without a word: a shard's fingerprint over
Parquet files, over OpenAI batch files and of a piece a split made, and the content fingerprints of a
run of steps. A change of any of them makes every committed shard and checkpoint of a running
project look stale (issue 37: "pin before you move")."""

from __future__ import annotations

import pytest

from shardgen import config as cfg
from shardgen.data.identity import shard_fingerprint
from shardgen.data.manifest import MANIFEST_VERSION, Manifest
from shardgen.features import steps
from shardgen.features.splits import clip

ENGINE = "0.32.0"


def _config(**sections):
    return cfg.RunConfig.from_dict({
        "input": {"parquet": ["/data/in-*.parquet"]}, "prompt": {"template": "{{ topic }}"},
        "model": {"model": "my-org/model"}, "sampling": {"max_tokens": 8}, **sections,
    })  # fmt: skip


def _manifest(source: dict) -> Manifest:
    shards = [{"id": "00000", "start": 0, "stop": 12, "segments": [[0, 0, 10], [1, 0, 2]]},
              {"id": "00001", "start": 12, "stop": 20, "segments": [[1, 2, 10]]}]  # fmt: skip
    return Manifest(
        {"version": MANIFEST_VERSION, "source": source, "total_rows": 20, "rows_per_shard": 12, "shards": shards}
    )


FILES = [{"path": "/data/in-0.parquet", "size": 1000, "mtime_ns": 1, "rows": 10},
         {"path": "/data/in-1.parquet", "size": 800, "mtime_ns": 2, "rows": 10}]  # fmt: skip


@pytest.fixture(autouse=True)
def _engine(monkeypatch):
    monkeypatch.setattr(cfg, "engine_version", lambda: ENGINE)


def test_a_shards_fingerprint_over_parquet_files_and_of_a_piece_is_pinned():
    config, manifest = _config(), _manifest({"kind": "parquet", "files": FILES})
    shard = manifest.shards[0]
    assert shard_fingerprint(config, manifest, shard) == "0aa007c5be3865b9"
    assert shard_fingerprint(config, manifest, clip(shard, 5, 12)) == "3bfac90806dfa4e2"


def test_a_shards_fingerprint_over_openai_batch_files_is_pinned():
    config = _config(input={"openai_batch": ["/data/requests.jsonl"]}, prompt={}, output={"samples": "list"})
    files = [{"path": f"/data/requests-{i}.jsonl", "size": 5000, "mtime_ns": 3, "rows": 10, "offsets": [0]}
             for i in (0, 1)]  # fmt: skip
    manifest = _manifest({"kind": "openai_batch", "files": files, "models": ["m"]})
    assert shard_fingerprint(config, manifest, manifest.shards[1]) == "b0f12993da2d5263"


def test_the_content_fingerprints_of_a_run_of_steps_are_pinned():
    raw = cfg.validate({
        "input": {"parquet": ["/data/in-*.parquet"]}, "model": {"model": "my-org/model"},
        "output": {"dir": "results/chain"},
        "steps": [
            {"name": "draft", "prompt": {"template": "{{ topic }}"}, "sampling": {"n": 4, "seed": 1, "max_tokens": 8}},
            {"name": "judge", "task": "reward", "model": {"model": "my-org/reward"},
             "prompt": {"template": "{{ topic }} {{ generation }}", "chat": False},
             "select": {"best_of": {"by": "reward"}}},
        ],
    })  # fmt: skip
    draft, judge = steps.step_configs(raw)
    assert [cfg.content_fingerprint(c, ENGINE) for c in (draft, judge)] == ["ecac43a65beb75df", "60362abf2cf4f328"]
    assert steps.content_digest([draft, judge]) == "38aebd33fde0d0a4"


def test_a_shards_fingerprint_over_objects_holds_their_etag_and_over_local_files_stays_as_pinned():
    """An object rewritten in place with the same size has the same path, size and mtime_ns (0), and
    another ETag: its shards are generated again. A local file's entry (etag None) keeps its pin."""
    config = _config(input={"parquet": ["s3://b/in-*.parquet"]})
    objects = [f | {"path": "s3://b/" + f["path"].rsplit("/", 1)[1], "mtime_ns": 0, "etag": '"e1"'} for f in FILES]
    rewritten = [objects[0] | {"etag": '"e2"'}, objects[1]]
    one, two = (_manifest({"kind": "parquet", "files": files}) for files in (objects, rewritten))
    assert shard_fingerprint(config, one, one.shards[0]) != shard_fingerprint(config, two, two.shards[0])
    assert shard_fingerprint(config, one, one.shards[1]) == shard_fingerprint(config, two, two.shards[1])
    local = _manifest({"kind": "parquet", "files": [f | {"etag": None} for f in FILES]})  # as ParquetFileInfo
    assert shard_fingerprint(_config(), local, local.shards[0]) == "0aa007c5be3865b9"


def test_a_shards_fingerprint_over_a_hugging_face_dataset_is_pinned():
    config = _config(input={"hf": {"path": "my-org/data", "split": "train"}})
    manifest = _manifest({"kind": "hf", "args": {"path": "my-org/data", "split": "train"}, "fingerprint": "f00d",
                          "rows": 20})  # fmt: skip
    assert shard_fingerprint(config, manifest, manifest.shards[1]) == "325332412b85dd6b"


def test_a_later_steps_shard_fingerprint_over_the_step_befores_shards_is_pinned(monkeypatch):
    """A later step's shard is identified by the fingerprints of the step before's shards it reads
    (here stood in for: those need committed files) and its first row."""
    import base64

    import pyarrow as pa

    monkeypatch.setattr(steps.StepSource, "file_fingerprint", lambda self, index: f"before-{index}")
    schema = base64.b64encode(pa.schema([("topic", pa.string()), ("dropped", pa.string())]).serialize()).decode()
    step = {"name": "draft", "dir": "/runs/draft", "fingerprint": "d1", "group": 1}
    source = {"kind": "step", "step": step, "shards": [["00000", 10], ["00001", 10]], "names": {"topic": "topic"},
              "fingerprint": "d1", "schema": schema}  # fmt: skip
    manifest = _manifest(source)
    config = _config(input={"step": step}, prompt={"template": "{{ topic }}"})
    assert shard_fingerprint(config, manifest, manifest.shards[0]) == "bae4549e00d0e414"
