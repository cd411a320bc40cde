"""shardgen from Python: ``shardgen.generate`` on the fake engine (what it decides: the data it takes, the
run directory it keeps, the engine it keeps, resuming, steps); its real-engine test is in
tests/integration/test_generate_engine.py, ``shardgen.run`` and the comparison with the workflow in
tests/integration/test_workflow.py."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

import shardgen
from shardgen import api
from shardgen.engines import fake as fake_engine
from shardgen.errors import ConfigError, InputError
from tests.conftest import TEST_MODEL_CFG, make_rows, write_parquet

CONFIG = {
    "prompt": {"template": "Write one short sentence about {{ topic }}."},
    "model": TEST_MODEL_CFG,
    "engine": {"kind": "fake"},
    "sampling": {"temperature": 0.0, "max_tokens": 12},
    "shards": {"rows_per_shard": 5},
}


@pytest.fixture(autouse=True)
def closed():
    """Every test starts without a kept engine and leaves none."""
    shardgen.close()
    yield
    shardgen.close()


def test_the_api_is_listed_and_import_shardgen_stays_light():
    import subprocess
    import sys

    assert {"generate", "run", "close", "RunResult"} <= set(shardgen.__all__)
    assert shardgen.generate is api.generate and shardgen.run.__doc__
    code = "import sys, shardgen; print(sorted(m for m in ('pyarrow', 'shardgen.api', 'vllm') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_generate_takes_each_kind_of_data_and_two_calls_start_one_engine(tmp_path):
    import datasets
    import pandas as pd

    rows = make_rows(12)
    table = shardgen.generate(rows, CONFIG, workdir=tmp_path)
    assert table.num_rows == 12 and table.column("id").to_pylist() == [r["id"] for r in rows]
    assert table.column("row_index").to_pylist() == list(range(12)), "input order, every row once"
    assert all(g.startswith("fake ") for g in table.column("generation").to_pylist())
    assert b"shardgen.provenance" in table.schema.metadata, "the merge's provenance, as the workflow writes it"
    handle = api._engine[1]
    assert isinstance(handle, fake_engine.FakeEngine) and handle.starts == 1
    assert handle.answered == 8, "8 topics: each request sent once (the request store)"
    path = write_parquet(tmp_path / "data" / "part-0.parquet", rows)
    for data in (rows, pd.DataFrame(rows), pa.Table.from_pylist(rows), datasets.Dataset.from_list(rows),
                 path, str(tmp_path / "data" / "*.parquet")):  # fmt: skip
        again = shardgen.generate(data, CONFIG, workdir=tmp_path)
        assert again.column("generation") == table.column("generation"), type(data)
    assert api._engine[1] is handle and handle.starts == 1, "the engine kept between calls"
    assert handle.answered == 8, "the same rows again: the committed run or the request store answers them"


def test_the_callers_environment_is_kept_its_token_included(tmp_path, monkeypatch):
    """A shard job drops the Hugging Face token and runs offline (jobenv): in a notebook, that is the job's,
    and the next call may download a model."""
    import os

    monkeypatch.setenv("HF_TOKEN", "hf_kept")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    shardgen.generate(make_rows(2), CONFIG, workdir=tmp_path)
    assert os.environ["HF_TOKEN"] == "hf_kept" and "HF_HUB_OFFLINE" not in os.environ


def test_an_edited_template_generates_only_what_changed_and_a_config_file_reads_like_the_workflows(tmp_path):
    import yaml

    rows = make_rows(16)  # 8 topics, each twice
    first = shardgen.generate(rows, CONFIG, workdir=tmp_path)
    edited = copy.deepcopy(CONFIG)
    edited["prompt"]["template"] = (
        "{% if topic == 'topic-0' %}Tell me about {{ topic }}.{% else %}Write one short sentence about "
        "{{ topic }}.{% endif %}"
    )
    path = tmp_path / "conf" / "run.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(edited))
    second = shardgen.generate(rows, path, workdir=tmp_path)
    changed = [i for i, r in enumerate(rows) if r["topic"] == "topic-0"]
    before, after = first.column("generation").to_pylist(), second.column("generation").to_pylist()
    assert [i for i in range(16) if before[i] != after[i]] == changed
    sources = second.column("result_source").to_pylist()
    assert [i for i, s in enumerate(sources) if s == "engine"] == changed[:1], "one new request, sent once"
    assert {sources[i] for i in range(16) if i not in changed} == {"store"}


def test_an_interrupted_call_resumes_from_its_checkpoints(tmp_path):
    rows = make_rows(10)
    dying = copy.deepcopy(CONFIG) | {"engine": {"kind": "fake", "fake": {"crash_after": 4}},
                                     "checkpoint": {"rows": 1}, "shards": {"rows_per_shard": 10}}  # fmt: skip
    with pytest.raises(fake_engine.FakeEngineDied):
        shardgen.generate(rows, dying, workdir=tmp_path)
    assert api._engine is None, "an engine that failed is not kept"
    table = shardgen.generate(rows, CONFIG | {"shards": {"rows_per_shard": 10}}, workdir=tmp_path)
    assert table.column("row_index").to_pylist() == list(range(10))
    # rows 0-3 were saved; 8 and 9 repeat their topics (8 topics): the store answers those
    assert api._engine[1].answered == 4, "the saved rows are not asked again"


def test_steps_and_function_steps_run_as_in_the_workflow(tmp_path):
    (tmp_path / "steps.py").write_text(
        "def shout(row):\n    return {'loud': row['generation'].upper()}\n"
    )  # fmt: skip
    config = {
        **{k: v for k, v in CONFIG.items() if k != "prompt"},
        "steps": [
            {"name": "draft", "prompt": CONFIG["prompt"]},
            {
                "name": "loud",
                "function": {
                    "path": str(tmp_path / "steps.py"),
                    "name": "shout",
                    "columns": {"loud": "string"},
                    "processes": 1,
                },
            },
        ],
    }
    table = shardgen.generate(make_rows(6), config, workdir=tmp_path)
    assert table.num_rows == 6
    assert table.column("loud").to_pylist() == [g.upper() for g in table.column("generation").to_pylist()]


def test_bad_data_and_bad_config_get_the_packages_errors_naming_what_is_wrong(tmp_path):
    with pytest.raises(InputError, match="list of dicts"):
        shardgen.generate(["a", "b"], CONFIG, workdir=tmp_path)
    with pytest.raises(InputError, match="data is a int"):
        shardgen.generate(3, CONFIG, workdir=tmp_path)
    with pytest.raises(ConfigError, match="sampling.max_tokens"):
        shardgen.generate(make_rows(2), {**CONFIG, "sampling": {"max_tokens": -1}}, workdir=tmp_path)
    with pytest.raises(InputError, match="topic"):
        shardgen.generate([{"id": 1, "other": "x"}], CONFIG, workdir=tmp_path)
