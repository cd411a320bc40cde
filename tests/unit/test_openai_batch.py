"""output.format openai_batch: the merged rows as OpenAI's Batch API result and error files, checked
with the `openai` package's own types, not a schema written here."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from shardgen import config as cfg
from shardgen import formats
from shardgen.errors import ConfigError, ShardgenError
from tests.conftest import TEST_MODEL_CFG

PROV = {
    "task": "generate",
    "model": "<local>/SmolLM2",
    "created": "2026-12-04T10:00:00+00:00",
    "config_fingerprint": "f",
}


def write(tmp_path, rows: list[dict], provenance: dict = PROV, id_column: str | None = "id"):
    table = pa.Table.from_pylist(rows)
    out = tmp_path / "openai"
    batches = ((table.schema, b) for b in table.to_batches(max_chunksize=2))
    formats.write("openai_batch", out, batches, lambda: table.schema, provenance, id_column)
    lines = {
        name: [json.loads(x) for x in (out / name).read_text().splitlines()]
        for name in ("output.jsonl", "errors.jsonl")
    }
    return out, lines["output.jsonl"], lines["errors.jsonl"]


def sample(row: int, s: int, text: str | None, reason: str | None = "stop", error: str | None = None) -> dict:
    return {"id": f"q{row}", "row_index": row, "sample_index": s, "generation": text, "finish_reason": reason,
            "prompt_tokens": 10 + row, "generated_tokens": None if text is None else 3, "error": error}  # fmt: skip


TOO_LONG = "prompt_too_long: 5000 tokens"


def test_a_generation_run_gives_a_result_line_per_request_and_an_error_line_per_failed_one_in_input_order(tmp_path):
    rows = [
        sample(0, 0, "Hello", "stop"), sample(0, 1, "Hi there", "length"),
        sample(1, 0, None, None, TOO_LONG), sample(1, 1, None, None, TOO_LONG),
        sample(2, 0, "Yes", "stop"), sample(2, 1, "No", "abort"),
        sample(3, 0, "Sure", "stop"), sample(3, 1, "Fine", "stop"),
    ]  # fmt: skip
    out, ok, failed = write(tmp_path, rows)
    assert [line["custom_id"] for line in ok] == ["q0", "q3"] and [line["custom_id"] for line in failed] == ["q1", "q2"]
    first = ChatCompletion.model_validate(ok[0]["response"]["body"])
    assert ok[0]["response"]["status_code"] == 200 and ok[0]["error"] is None and ok[0]["id"] == "batch_req_0"
    assert [c.message.content for c in first.choices] == ["Hello", "Hi there"] and first.model == "<local>/SmolLM2"
    assert [c.finish_reason for c in first.choices] == ["stop", "length"] and [c.index for c in first.choices] == [0, 1]
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (10, 6, 16)
    assert first.created == 1796378400  # the provenance's 2026-12-04T10:00:00Z
    too_long = failed[0]["response"]
    assert too_long["status_code"] == 400 and too_long["body"]["error"]["code"] == "prompt_too_long"
    assert too_long["body"]["error"]["message"] == TOO_LONG
    assert "finish_reason 'abort'" in failed[1]["response"]["body"]["error"]["message"]
    # the provenance names both files' digests; a changed file is found out
    prov = formats.provenance(out)
    assert formats.format_of(out) == "openai_batch" and prov["task"] == "generate" and "output.jsonl_sha256" in prov
    names, read = formats.read_columns(out, 1)
    got = pa.Table.from_batches(list(read(names)))
    assert got.column("prompt_tokens").to_pylist() == [10, 13] and got.column("generated_tokens").to_pylist() == [6, 6]
    (out / "errors.jsonl").write_text("")
    with pytest.raises(ShardgenError, match="describes another 'errors.jsonl'"):
        formats.provenance(out)
    with pytest.raises(ShardgenError, match="not a dataset"):
        formats.load(out)


def test_samples_as_lists_and_no_id_column_give_the_same_choices_with_the_row_index_as_custom_id(tmp_path):
    rows = [{"row_index": 0, "generation": ["a", "b"], "finish_reason": ["stop", "stop"], "generated_tokens": [1, 2],
             "prompt_tokens": 4, "error": None}]  # fmt: skip
    _, ok, failed = write(tmp_path, rows, id_column=None)
    completion = ChatCompletion.model_validate(ok[0]["response"]["body"])
    assert ok[0]["custom_id"] == "0" and failed == []
    assert [c.message.content for c in completion.choices] == ["a", "b"] and completion.usage.completion_tokens == 3


def test_an_embedding_run_gives_openais_embedding_list(tmp_path):
    empty = "empty_prompt: nothing to embed"
    rows = [{"id": "p0", "row_index": 0, "prompt_tokens": 5, "embedding": [0.6, 0.8], "error": None},
            {"id": "p1", "row_index": 1, "prompt_tokens": 0, "embedding": None, "error": empty}]  # fmt: skip
    _, ok, failed = write(tmp_path, rows, {**PROV, "task": "embed"})
    response = CreateEmbeddingResponse.model_validate(ok[0]["response"]["body"])
    assert response.data[0].embedding == [0.6, 0.8] and response.usage.total_tokens == 5
    assert failed[0]["custom_id"] == "p1" and failed[0]["response"]["body"]["error"]["code"] == "empty_prompt"


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"task": "classify", "model": {**TEST_MODEL_CFG, "runner": "pooling"}}, "for task generate and embed"),
        ({"output": {"format": "openai_batch", "push_to_hub": "me/data"}}, "push_to_hub needs a dataset"),
    ],
)
def test_an_openai_batch_output_the_format_cannot_hold_is_refused(extra, said):
    config = {"input": {"parquet": ["x.parquet"]}, "prompt": {"template": "{{ text }}"}, "model": dict(TEST_MODEL_CFG),
              "output": {"format": "openai_batch"}, **extra}  # fmt: skip
    with pytest.raises(ConfigError, match=said):
        cfg.RunConfig.from_dict(config)
