"""output.format openai_batch: the merged rows as OpenAI's Batch API result and error files, checked
with the `openai` package's own types, not a schema written here."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from shardgen import config as cfg
from shardgen.data import formats
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


def position(sampled: tuple[int, str | None, float], *top: tuple[int, str | None, float]) -> list[dict]:
    """A ``logprobs`` cell's position as the writer reads it: the sampled token, then the top-k."""
    return [{"token_id": t, "token": s, "logprob": lp} for t, s, lp in (sampled, *top)]


def test_log_probabilities_are_openais_chat_and_completions_logprobs_with_each_requests_own_top_k(tmp_path):
    from openai.types import Completion

    from shardgen.requests.rowsampling import logprobs_of

    # per position the sampled token, then the top-k (k + 1 entries where the sampled one is not in it)
    two = [position((5, "Hé", -0.1), (6, "Hey", -2.5)), position((9, None, -7.0), (7, "!", -0.3), (8, ".", -1.5))]
    chat = '{"n": 2, "temperature": 0.8, "logprobs": true, "top_logprobs": 1}'
    rows = [
        # a chat request with its own n and logprobs: samples as lists, one row
        {"custom_id": "c", "url": "/v1/chat/completions", "body": chat, "row_index": 0, "prompt_tokens": 4,
         "generation": ["Hé!", "Hé"], "finish_reason": ["stop", "length"], "generated_tokens": [2, 1],
         "logprobs": [two, two[:1]], "error": None},
        # a completion request asking vLLM's way (an integer)
        {"custom_id": "p", "url": "/v1/completions", "body": '{"logprobs": 2}', "row_index": 1, "prompt_tokens": 3,
         "generation": ["Hé!"], "finish_reason": ["stop"], "generated_tokens": [2], "logprobs": [two],
         "error": None},
        # a request that asked for none
        {"custom_id": "x", "url": "/v1/chat/completions", "body": None, "row_index": 2, "prompt_tokens": 3,
         "generation": ["No"], "finish_reason": ["stop"], "generated_tokens": [1], "logprobs": [None],
         "error": None},
    ]  # fmt: skip
    table = pa.Table.from_pylist(rows)
    out = tmp_path / "openai"
    batches = ((table.schema, b) for b in table.to_batches(max_chunksize=2))
    formats.write("openai_batch", out, batches, lambda: table.schema, PROV, "custom_id", logprobs_of({}, "body"))
    c, p, x = (json.loads(line) for line in (out / "output.jsonl").read_text().splitlines())

    completion = ChatCompletion.model_validate(c["response"]["body"])
    assert len(completion.choices) == 2 and completion.usage.completion_tokens == 3
    content = completion.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hé", "token_id:9"] and content[0].bytes == list("Hé".encode())
    assert content[1].logprob == pytest.approx(-7.0)  # the sampled token, outside the top 1
    top = [[(a.token, round(a.logprob, 2)) for a in t.top_logprobs] for t in content]
    assert top == [[("Hé", -0.1)], [("!", -0.3)]]
    assert len(completion.choices[1].logprobs.content) == 1

    text = Completion.model_validate(p["response"]["body"])
    assert text.object == "text_completion" and text.choices[0].text == "Hé!"
    lp = text.choices[0].logprobs
    assert lp.tokens == ["Hé", "token_id:9"] and lp.token_logprobs == pytest.approx([-0.1, -7.0])
    assert lp.top_logprobs == [{"Hé": pytest.approx(-0.1), "Hey": pytest.approx(-2.5)},
                               {"!": pytest.approx(-0.3), ".": pytest.approx(-1.5)}]  # fmt: skip
    assert lp.text_offset == [0, 2]

    plain = ChatCompletion.model_validate(x["response"]["body"])
    assert plain.choices[0].logprobs is None


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
        ({"task": "classify", "model": {**TEST_MODEL_CFG, "runner": "pooling"}}, "for task generate, embed, score"),
        ({"output": {"format": "openai_batch", "push_to_hub": "me/data"}}, "push_to_hub needs a dataset"),
    ],
)
def test_an_openai_batch_output_the_format_cannot_hold_is_refused(extra, said):
    config = {"input": {"parquet": ["x.parquet"]}, "prompt": {"template": "{{ text }}"}, "model": dict(TEST_MODEL_CFG),
              "output": {"format": "openai_batch"}, **extra}  # fmt: skip
    with pytest.raises(ConfigError, match=said):
        cfg.RunConfig.from_dict(config)


# -- input.openai_batch -------------------------------------------------------------------------------


def request(i: int, url: str = "/v1/chat/completions", **body) -> dict:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Question {i}?"}], **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def batch_file(path, requests: list[dict], blank_every: int = 0) -> str:
    lines = []
    for i, r in enumerate(requests):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("")  # an empty line is no request
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def batch_config(paths: list[str], **extra) -> cfg.RunConfig:
    return cfg.RunConfig.from_dict({"input": {"openai_batch": paths}, "model": dict(TEST_MODEL_CFG),
                                    "shards": {"rows_per_shard": 1000}, **extra})  # fmt: skip


def test_a_batch_file_is_sharded_by_line_and_every_request_is_read_once_in_order(tmp_path):
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import build_manifest

    paths = [batch_file(tmp_path / "a.jsonl", [request(i) for i in range(2500)], blank_every=700),
             batch_file(tmp_path / "b.jsonl", [request(i) for i in range(2500, 2600)])]  # fmt: skip
    config = batch_config(paths)
    assert (config.input.id_column, config.input.sampling_column, config.prompt.messages_column) == (
        "custom_id",
        "body",
        "messages",
    )
    manifest = Manifest(build_manifest(config))
    assert manifest.data["total_rows"] == 2600 and len(manifest.shards) == 3
    assert manifest.data["source"]["models"] == ["gpt-4o-mini"]
    source = manifest.source()
    batches = (b for s in manifest.shards for b in source.read(s.segments, batch_rows=128))
    ids = [i for b in batches for i in b.column("custom_id").to_pylist()]
    assert ids == [f"req-{i}" for i in range(2600)], "every request once, in input order, across blocks and files"
    row = next(source.read(manifest.shards[2].segments)).to_pylist()[0]
    assert row["messages"] == [{"role": "user", "content": "Question 2000?"}] and row["request_error"] is None


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        (['{"custom_id": "a", "body": {}}', "{not json"], "'{path}', line 2: not JSON"),
        (['{"custom_id": "a"}', '{"custom_id": "a"}'], "'{path}', line 2: the custom_id 'a' again"),
        (['{"body": {}}'], "'{path}', line 1: a request needs a custom_id"),
        # a truncated emoji: a custom_id that is no text (it could not be an output's id)
        (['{"custom_id": "a"}', '{"custom_id": "q\\ud83d"}'], "'{path}', line 2: the custom_id 'q\\ud83d' is not"),
        (['{"custom_id": "a", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"], "'{path}', line 1: not JSON"),
        # one that Python's json reads, but a job's deeper stack might not
        (
            ['{"custom_id": "a", "body": ' + "[" * 300 + "]" * 300 + "}"],
            "line 1: not JSON shardgen reads (nested deeper",
        ),
        ([json.dumps(request(0)), json.dumps(request(1, model="other"))], "the requests name 2 models"),
    ],
)
def test_a_batch_file_that_cannot_be_served_is_refused_when_planning_naming_file_and_line(tmp_path, lines, said):
    from shardgen.data.plan import build_manifest
    from shardgen.errors import InputError

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=re.escape(said.format(path=path))):
        build_manifest(batch_config([str(path)]))


def test_a_request_that_is_not_valid_becomes_that_rows_error_naming_the_field():
    from shardgen.errors import RowError
    from shardgen.features.openai_batch.requests_in import OpenAIBatchSource, request_row
    from shardgen.jobs.feed.requests import RowInputs

    def row(r: dict) -> dict:
        return request_row(json.dumps(r).encode())

    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    # joined as vLLM's server joins them (chat_utils._parse_chat_message_content_parts)
    assert row(request(0, messages=[parts]))["messages"] == [{"role": "user", "content": "a\nb"}]
    assert json.loads(row(request(0, max_tokens=5, seed=1))["body"]) == {"max_tokens": 5, "seed": 1}
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert row(request(0, messages=[image]))["request_error"] == "body.messages[0].content: only text parts are served"
    assert row(request(0, messages=[]))["request_error"] == "body.messages: a non-empty list of messages"
    assert row(request(0, url="/v1/responses"))["request_error"].startswith("url: '/v1/responses' is none of")
    embedding = {"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "text", "dimensions": 8}}
    assert row(embedding)["request_error"] == "body.dimensions: not served for embeddings (it would change the result)"
    chat = RowInputs.for_run(batch_config(["x.jsonl"]), OpenAIBatchSource([]))  # serves /v1/chat/completions
    chat.check(row(request(0)))
    with pytest.raises(RowError, match="invalid_request: url: '/v1/embeddings', but this run serves /v1/chat"):
        chat.check(row({**embedding, "body": {"input": "text"}}))


def test_a_request_value_a_row_cannot_hold_is_its_rows_error_and_the_other_requests_are_read(tmp_path):
    """A non-string url, a truncated emoji (a lone surrogate: no UTF-8 for Arrow) in any field: the
    row's invalid_request error naming the field, not a shard whose read fails on every attempt."""
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import build_manifest

    emoji = request(1, messages=[{"role": "user", "content": "Hi \ud83d"}])
    key = request(3, stop=["x"], **{"tag\udc00": 1})
    lines = [request(0) | {"url": 123}, emoji, request(2), key, request(4, "/v1/chat/completions\ud83d")]
    path = batch_file(tmp_path / "in.jsonl", lines)
    assert "\\ud83d" in (tmp_path / "in.jsonl").read_text(), "written as JSON escapes"
    manifest = Manifest(build_manifest(batch_config([path])))
    rows = [r for s in manifest.shards for b in manifest.source().read(s.segments) for r in b.to_pylist()]
    assert [r["custom_id"] for r in rows] == [f"req-{i}" for i in range(5)]
    errors = [r["request_error"] for r in rows]
    assert errors[0] == "url: a string (one of /v1/chat/completions, /v1/completions, /v1/embeddings, /score, " \
        "/v1/score, /rerank, /v1/rerank, /v2/rerank), not a number"  # fmt: skip
    assert errors[1] == "body.messages[0].content: not valid Unicode text (a lone surrogate, '\\ud83d', at character 3)"
    assert errors[2] is None and rows[2]["messages"] == [{"role": "user", "content": "Question 2?"}]
    assert errors[3] == "body['tag\\udc00']: not valid Unicode text (a lone surrogate, '\\udc00', at character 3 " \
        "of the name)"  # fmt: skip
    assert errors[4] == "url: not valid Unicode text (a lone surrogate, '\\ud83d', at character 20)"
    assert all(e is None or e.encode() for e in errors), "an error the output can hold"


def test_a_chat_requests_prompt_and_sampling_are_what_vllms_server_makes_of_it_or_the_rows_error():
    """As vLLM 0.32's OpenAI server reads the same request: text parts joined with a newline, and
    max_completion_tokens before max_tokens; a null text part and the message fields the chat template
    would see beside role and content (name, tool_calls, tool_call_id, ...) are the row's error."""
    from shardgen.features.openai_batch.requests_in import request_row
    from shardgen.requests.rowsampling import overrides, row_sampling

    def row(r: dict) -> dict:
        return request_row(json.dumps(r).encode())

    def error(**body) -> str | None:
        return row(request(0, **body))["request_error"]

    def user(*parts, **fields) -> dict:
        return {"role": "user", "content": [{"type": "text", "text": t} for t in parts], **fields}

    assert row(request(0, messages=[user("a", "b", "c")]))["messages"] == [{"role": "user", "content": "a\nb\nc"}]
    assert error(messages=[user("a", None)]) == "body.messages[0].content[1].text: a string, not null"
    assert error(messages=[{"role": "user", "content": [{"type": "text"}]}]) == (
        "body.messages[0].content[0].text: a string, not null"
    )
    assert error(messages=[user(["a"])]) == "body.messages[0].content[0].text: a string, not a list"
    call = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for i, field, value in [(0, "name", "bob"), (1, "tool_calls", call), (1, "tool_call_id", "call_1"),
                            (1, "reasoning", "hmm")]:  # fmt: skip
        messages = [user("Hi"), {"role": "assistant", "content": "Hello"}, user("Bye")]
        messages[i] = messages[i] | {field: value}
        assert error(messages=messages) == (
            f"body.messages[{i}].{field}: not served (vLLM's chat template would see it; a message here is "
            "its role and content)"
        )
    assert error(messages=[user("Hi", name=None, tool_calls=None)]) is None, "null: absent, as vLLM has it"
    # both token limits, in either order: max_completion_tokens, as vLLM's server and OpenAI take it
    for body in ({"max_tokens": 3, "max_completion_tokens": 7}, {"max_completion_tokens": 7, "max_tokens": 3}):
        given = overrides(row(request(0, **body))["body"], "body")
        assert row_sampling({"max_tokens": 100}, given, "body")["max_tokens"] == 7
    given = overrides(row(request(0, max_tokens=3, max_completion_tokens=None))["body"], "body")
    assert row_sampling({"max_tokens": 100}, given, "body")["max_tokens"] == 3
    assert error(max_tokens="3", max_completion_tokens=7) == "body.max_tokens: an integer or null, not a string"
    # vLLM's completion requests have no max_completion_tokens (its server would ignore it)
    completion = {"custom_id": "p", "url": "/v1/completions", "body": {"prompt": "p", "max_completion_tokens": 7}}
    assert row(completion)["request_error"] == (
        "body.max_completion_tokens: not a field of a completion request (max_tokens is)"
    )


def test_a_batch_input_sets_the_prompt_the_id_and_the_sampling_and_refuses_other_settings():
    embed = cfg.RunConfig.from_dict({"task": "embed", "input": {"openai_batch": ["x.jsonl"]},
                                     "model": {**TEST_MODEL_CFG, "runner": "pooling"}})  # fmt: skip
    assert (embed.prompt.template, embed.prompt.chat, embed.input.sampling_column) == ("{{ input }}", False, None)
    completions = batch_config(["x.jsonl"], prompt={"chat": False})
    assert completions.prompt.template == "{{ input }}" and completions.input.sampling_column == "body"
    for extra, said in [
        ({"prompt": {"template": "{{ text }}"}}, "prompt.template: the requests of input.openai_batch are the prompts"),
        ({"input": {"openai_batch": ["x.jsonl"], "id_column": "n"}}, "input.id_column: input.openai_batch sets it"),
        ({"task": "classify", "model": {**TEST_MODEL_CFG, "runner": "pooling"}}, "input.openai_batch is for task"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            batch_config(["x.jsonl"], **extra)


def test_the_planning_benchmark_runs_and_writes_its_table(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, str(ROOT / "bench" / "batch_plan.py"), "--requests", "20", "60", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True)
    result = json.loads((tmp_path / "batch_plan.json").read_text())
    assert [r["requests"] for r in result["runs"]] == [20, 60] and result["runs"][1]["shards"] == 1
    assert "| 60 |" in (tmp_path / "batch_plan.md").read_text()


def test_a_reasoning_runs_trace_is_the_messages_reasoning_and_its_tokens_the_usage_details(tmp_path):
    """As vLLM's server gives them: ChatMessage.reasoning, completion_tokens_details.reasoning_tokens."""
    rows = [{**sample(0, 0, "yes"), "reasoning": "hmm", "reasoning_tokens": 2},
            {**sample(0, 1, "no"), "reasoning": None, "reasoning_tokens": 0}]  # fmt: skip
    _, ok, _ = write(tmp_path, rows)
    body = ok[0]["response"]["body"]
    completion = ChatCompletion.model_validate(body)
    assert [c.message.content for c in completion.choices] == ["yes", "no"]
    assert [c["message"]["reasoning"] for c in body["choices"]] == ["hmm", None]
    assert completion.usage.completion_tokens_details.reasoning_tokens == 2
    assert "reasoning" not in ChatCompletion.model_validate(write(tmp_path / "plain", [sample(0, 0, "a")])[1][0][
        "response"]["body"]).choices[0].message.model_extra  # fmt: skip


# -- Any JSON in any field: refused when planning, naming file and line, or rows (each its error at most) --

# text with lone surrogates (a truncated emoji) besides any other character: JSON escapes hold them, UTF-8 not
FUZZ_TEXT = st.lists(st.characters() | st.characters(categories=["Cs"]), max_size=5).map("".join)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | FUZZ_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(FUZZ_TEXT, inner, max_size=3),
    max_leaves=6,
)
# a valid request of each url a run of each kind serves, whose values (at any depth) the fuzz replaces and
# whose objects it adds to
FUZZ_REQUESTS = {
    "chat": [{"url": "/v1/chat/completions", "body": {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 5, "temperature": 0.5, "stop": ["x"], "logprobs": True, "top_logprobs": 1}}],
    "completions": [{"url": "/v1/completions", "body": {"model": "m", "prompt": "Once", "max_tokens": 5,
                                                          "logprobs": 1}}],
    "embed": [{"url": "/v1/embeddings", "body": {"model": "m", "input": "text", "user": "u"}}],
    "score": [{"url": "/score", "body": {"model": "m", "text_1": "q", "text_2": ["a", "b"]}},
              {"url": "/v1/rerank", "body": {"model": "m", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}}],
}  # fmt: skip
# names the fuzz adds fields under, beside arbitrary ones: those shardgen and vLLM read
FUZZ_NAMES = ["custom_id", "url", "body", "messages", "role", "content", "type", "text", "name", "tool_calls",
              "tool_call_id", "prompt", "input", "max_tokens", "max_completion_tokens", "n", "seed", "stop",
              "response_format", "text_1", "text_2", "queries", "documents", "query", "top_n", "model"]  # fmt: skip


def _paths(value: Any, at: tuple = ()) -> Iterator[tuple]:
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _paths(inner, (*at, key))


def _set(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    out = copy.copy(value)
    out[path[0]] = _set(value[path[0]], path[1:], new)
    return out


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


@st.composite
def fuzzed_request(draw, i: int, kind: str) -> Any:
    """A valid request, mostly of a url the run serves, with up to two of its values replaced by, or
    objects given, any JSON value."""
    others = draw(st.integers(0, 4)) == 2
    bases = [r for k in sorted(FUZZ_REQUESTS) for r in FUZZ_REQUESTS[k]] if others else FUZZ_REQUESTS[kind]
    out = {"custom_id": f"r{i}", "method": "POST", **draw(st.sampled_from(bases))}
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            # deepest first: hypothesis draws the first more often, and a custom_id not text is refused
            out = _set(out, draw(st.sampled_from(list(_paths(out))[:0:-1])), draw(JSON_VALUES))
        elif objects := [p for p in _paths(out) if isinstance(_get(out, p), dict)]:
            at = draw(st.sampled_from(objects))
            key = draw(st.sampled_from(FUZZ_NAMES) | FUZZ_TEXT)
            out = _set(out, at, {**_get(out, at), key: draw(JSON_VALUES)})
    return out


@pytest.fixture(scope="module")
def fuzz_runs(tmp_path_factory) -> dict[str, cfg.RunConfig]:
    """A run of each kind that reads OpenAI batch requests, all of one file, two rows a shard."""
    path = str(tmp_path_factory.mktemp("fuzz") / "requests.jsonl")
    shards = {"shards": {"rows_per_shard": 2}}
    pooling = {**TEST_MODEL_CFG, "runner": "pooling"}
    return {
        "chat": batch_config([path], **shards),
        "completions": batch_config([path], prompt={"chat": False}, **shards),
        "embed": batch_config([path], task="embed", model=pooling, **shards),
        "score": score_config([path], **shards),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_any_json_in_any_field_is_refused_naming_file_and_line_or_a_row_whose_read_never_fails(fuzz_runs, data):
    """Planning refuses a line naming file and line (not JSON, no custom_id, one repeated), or every
    line is its rows, which a job reads and makes requests of, or each row's error, whatever JSON the
    request's fields hold: never a read that fails the shard on every attempt."""
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import build_manifest
    from shardgen.errors import InputError, RowError
    from shardgen.features.openai_batch.requests_in import request_rows
    from shardgen.features.openai_batch.results_out import result_line
    from shardgen.jobs.feed.requests import RowInputs
    from shardgen.requests.prompts import PromptRenderer

    kind = data.draw(st.sampled_from(sorted(fuzz_runs)))
    config = fuzz_runs[kind]
    # a line of any JSON now and then (planning refuses all but an object with a custom_id)
    requests = [data.draw(JSON_VALUES if data.draw(st.integers(0, 19)) == 9 else fuzzed_request(i, kind))
                for i in range(3)]  # fmt: skip
    # JSON escapes for what is not ASCII, or UTF-8 (a lone surrogate as its three bytes, which Python's
    # json reads back)
    escaped = data.draw(st.booleans())
    lines = [json.dumps(r, ensure_ascii=escaped).encode("utf-8", "surrogatepass") for r in requests]
    path = config.input.openai_batch[0]
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    try:
        manifest = Manifest(build_manifest(config))
    except InputError as e:
        assert re.match(rf"input: '{re.escape(path)}', line [1-3]: ", str(e)) or "the requests name" in str(e), e
        str(e).encode()
        event(f"{kind}: refused when planning")
        return
    pairs = config.kind.pairs
    planned = [(json.loads(line)["custom_id"], len(request_rows(line, pairs))) for line in lines]
    source = manifest.source()
    rows = [r for s in manifest.shards for b in source.read(s.segments, batch_rows=2) for r in b.to_pylist()]
    assert [r["custom_id"] for r in rows] == [c for c, n in planned for _ in range(n)], "each line's rows once"
    event(f"{kind}: read")
    inputs = RowInputs.for_run(config, source)  # what a job checks of each row: its source's checks
    task = config.kind(config, None) if config.kind.generates else None
    for index, (row, prompt) in enumerate(zip(rows, PromptRenderer.from_config(config.prompt).render_batch(rows),
                                              strict=True)):  # fmt: skip
        try:
            inputs.check(row)
            if isinstance(prompt, RowError):
                raise prompt
            if task is not None:
                task.params(index, row)
            event(f"{kind}: a request")
        except RowError as e:  # the row's error, in the output: UTF-8, and an error line of the merge
            out = {"row_index": index, "custom_id": row["custom_id"], "url": row["url"], "error": str(e)}
            line = result_line([out], config.task, "m", 0, "custom_id")
            event(f"{kind}: a row's error ({e.reason})")
            assert line["response"]["status_code"] == 400
            json.dumps(line, ensure_ascii=False).encode()


# -- task score: vLLM's /score and /rerank requests ------------------------------------------------------


def score_request(i: int, url: str = "/score", **body) -> dict:
    return {"custom_id": f"s-{i}", "method": "POST", "url": url, "body": {"model": "bge-reranker", **body}}


def score_config(paths: list[str], **extra) -> cfg.RunConfig:
    return batch_config(paths, **{"task": "score", "model": {**TEST_MODEL_CFG, "runner": "pooling"}, **extra})


def test_a_score_or_rerank_request_is_a_row_per_pair_across_blocks_shards_and_files(tmp_path):
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import build_manifest
    from shardgen.features import openai_batch

    many = [f"doc {j}" for j in range(3 * openai_batch.requests_in.BATCH_BLOCK // 2)]  # a line of rows over two blocks
    paths = [batch_file(tmp_path / "a.jsonl", [score_request(0, text_1="q0", text_2=["a", "b"]),
                                              score_request(1, "/v1/rerank", query="q1", documents=many, top_n=2),
                                              score_request(2, "/v1/score", queries=["x", "y"], documents=["z", "w"])]),
             batch_file(tmp_path / "b.jsonl", [score_request(3, "/rerank", query="q3", documents="one"),
                                              score_request(4, text_1="q4", text_2=[])])]  # fmt: skip
    config = score_config(paths, shards={"rows_per_shard": 700})
    prompt = config.prompt
    assert (prompt.template, prompt.pair_template, prompt.chat) == ("{{ input }}", "{{ pair }}", False)
    manifest = Manifest(build_manifest(config))
    assert manifest.data["total_rows"] == 2 + len(many) + 2 + 1 + 1 and manifest.data["source"]["pairs"]
    source = manifest.source()
    rows = [r for s in manifest.shards for b in source.read(s.segments, batch_rows=100) for r in b.to_pylist()]
    pairs = [(r["custom_id"], r["input"], r["pair"], r["pair_index"]) for r in rows]
    assert pairs == [("s-0", "q0", "a", 0), ("s-0", "q0", "b", 1),
                     *[("s-1", "q1", d, j) for j, d in enumerate(many)],
                     ("s-2", "x", "z", 0), ("s-2", "y", "w", 1), ("s-3", "q3", "one", 0),
                     ("s-4", None, None, None)], "every pair once, in order, from any shard's start"  # fmt: skip
    assert json.loads(rows[2]["body"]) == {"top_n": 2} and rows[-1]["request_error"] == "body.text_2: at least one text"
    generate = Manifest(build_manifest(batch_config([paths[0]])))  # a generate run: a row per line, as before
    assert generate.data["total_rows"] == 3 and "pairs" not in generate.data["source"]
    assert "firsts" not in generate.data["source"]["files"][0]


@pytest.mark.parametrize(
    ("url", "body", "said"),
    [
        ("/score", {"text_1": "q"}, "body.text_2: a score request needs text_1 and text_2"),
        ("/score", {"documents": ["a"]}, "body.queries: a score request needs queries and documents"),
        ("/score", {"text_1": ["a", "b", "c"], "text_2": ["x", "y"]}, "body.text_1: 3 texts for 2 in body.text_2"),
        ("/score", {"text_1": "q", "text_2": ["a", {"content": []}]}, "body.text_2[1]: a string (multimodal"),
        ("/score", {"text_1": {"content": []}, "text_2": "a"}, "body.text_1: a string or a list of strings"),
        ("/score", {"text_1": "q", "text_2": "a", "top_n": 1}, "body.top_n: not a field of a score request"),
        ("/score", {"text_1": "q", "text_2": "a", "max_tokens_per_doc": 8}, "body.max_tokens_per_doc: not served"),
        ("/v1/rerank", {"query": ["q"], "documents": ["a"]}, "body.query: one string per rerank request"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "body.top_n: a non-negative integer"),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "instruction": "x"}, "body.instruction: not served for"),
        ("/score", "text", "body: a JSON object"),
    ],
)
def test_a_score_or_rerank_request_that_is_not_valid_is_one_row_whose_error_names_the_field(url, body, said):
    from shardgen.features.openai_batch.requests_in import request_rows

    (row,) = request_rows(json.dumps({"custom_id": "c", "url": url, "body": body}).encode(), pairs=True)
    assert row["request_error"].startswith(said) and row["pair"] is None


def test_score_fields_that_change_nothing_or_keep_vllms_default_are_served():
    from shardgen.features.openai_batch.requests_in import request_rows

    body = {"text_1": "q", "text_2": "a", "user": "u", "priority": 0, "max_tokens_per_query": 0,
            "use_activation": None, "chat_template_kwargs": {}}  # fmt: skip
    (row,) = request_rows(json.dumps({"custom_id": "c", "url": "/score", "body": body}).encode(), pairs=True)
    assert row["request_error"] is None and (row["input"], row["pair"]) == ("q", "a")


def test_the_score_fields_are_those_of_vllms_score_and_rerank_requests():
    """Every field vLLM's requests take is a text, ignored, or served at its default: none unnoticed."""
    from vllm.entrypoints.pooling.scoring import protocol

    from shardgen.features.openai_batch.requests_in import RERANK_TEXTS, SCORE_DEFAULTS, SCORE_IGNORED, SCORE_TEXTS

    common = SCORE_IGNORED | set(SCORE_DEFAULTS)
    forms = [protocol.ScoreQueriesDocumentsRequest, protocol.ScoreQueriesItemsRequest, protocol.ScoreDataRequest,
             protocol.ScoreTextRequest]  # fmt: skip
    assert [set(form.model_fields) - common for form in forms] == [set(texts) for texts in SCORE_TEXTS]
    assert set(protocol.RerankRequest.model_fields) - common == {*RERANK_TEXTS, "top_n"}
    fields = protocol.RerankRequest.model_fields
    assert all(fields[k].default in (None, *SCORE_DEFAULTS[k]) for k in SCORE_DEFAULTS), "served at vLLM's default"


def test_a_score_run_serves_score_and_rerank_urls_and_refuses_the_others_as_its_rows_errors():
    from shardgen.errors import RowError
    from shardgen.features.openai_batch.requests_in import OpenAIBatchSource, request_rows, served_urls
    from shardgen.jobs.feed.requests import RowInputs

    config = score_config(["x.jsonl"])
    source = OpenAIBatchSource([], pairs=True)
    inputs = RowInputs.for_run(config, source)
    assert served_urls(config) == ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
    (chat,) = request_rows(json.dumps(request(0)).encode(), pairs=True)
    with pytest.raises(RowError, match="invalid_request: url: '/v1/chat/completions', but this run serves /score, "):
        inputs.check(chat)
    (score,) = request_rows(json.dumps(score_request(0, text_1="a", text_2="b")).encode())  # in a generate run
    with pytest.raises(RowError, match="url: '/score', but this run serves /v1/chat/completions$"):
        RowInputs.for_run(batch_config(["x.jsonl"]), OpenAIBatchSource([])).check(score)
    for said, extra in [("prompt.pair_template: the requests", {"prompt": {"pair_template": "{{ b }}"}}),
                        ("input.openai_batch is for task generate, embed, score, not classify",
                         {"task": "classify"})]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(said)):
            score_config(["x.jsonl"], **extra)


def pair(custom_id: str, index: int, url: str, pair_index: int, score: float | None, error: str | None = None,
         body: str | None = None) -> dict:  # fmt: skip
    return {"custom_id": custom_id, "url": url, "input": "q", "pair": f"doc {pair_index}", "pair_index": pair_index,
            "body": body, "row_index": index, "prompt_tokens": 7, "score": score, "error": error}  # fmt: skip


def test_a_score_run_gives_vllms_score_and_rerank_responses_a_line_per_request(tmp_path):
    """Checked with vLLM's own response classes: there are no `openai` types for these."""
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    too_long = "prompt_too_long: the prompt has 600 tokens; max_model_len is 512"
    top = '{"top_n": 2}'
    rows = [pair("a", 0, "/score", 0, 0.25), pair("a", 1, "/score", 1, 0.75),
            pair("b", 2, "/v1/rerank", 0, 0.1, body=top), pair("b", 3, "/v1/rerank", 1, 0.9, body=top),
            pair("b", 4, "/v1/rerank", 2, 0.5, body=top),
            pair("c", 5, "/score", 0, 0.5), pair("c", 6, "/score", 1, None, too_long),
            {**pair("d", 7, "/rerank", 0, None, "invalid_request: body.query: one string per rerank request"),
             "pair_index": None},
            pair("e", 8, "/rerank", 0, 0.3), pair("e", 9, "/rerank", 1, 0.3)]  # fmt: skip
    _, ok, failed = write(tmp_path, rows, {**PROV, "task": "score"}, id_column="custom_id")
    assert [line["custom_id"] for line in ok] == ["a", "b", "e"]
    assert [line["custom_id"] for line in failed] == ["c", "d"]
    score = ScoreResponse.model_validate(ok[0]["response"]["body"])
    assert [(d.index, d.object, d.score) for d in score.data] == [(0, "score", 0.25), (1, "score", 0.75)]
    assert (score.usage.prompt_tokens, score.usage.total_tokens, score.model) == (14, 14, "<local>/SmolLM2")
    rerank = RerankResponse.model_validate(ok[1]["response"]["body"])
    ranked = [(r.index, r.document.text, r.relevance_score) for r in rerank.results]
    assert ranked == [(1, "doc 1", 0.9), (2, "doc 2", 0.5)], "the top_n most relevant, most relevant first"
    assert rerank.usage.prompt_tokens == 21, "every pair's tokens, the ones top_n leaves out too"
    ties = RerankResponse.model_validate(ok[2]["response"]["body"])
    assert [r.index for r in ties.results] == [0, 1], "all documents without top_n, ties in their order"
    assert failed[0]["response"]["body"]["error"]["code"] == "prompt_too_long"
    assert "body.query" in failed[1]["response"]["body"]["error"]["message"]
