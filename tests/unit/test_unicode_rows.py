"""Text that UTF-8 cannot hold (a lone surrogate: half an emoji, read from a JSON escape or returned by a
user's code) in any writer of row values: one rule where rows become Arrow (``outputs.arrow_table``),
never a failed attempt."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardgen.data.outputs import ShardCheckpoint, lone_surrogate, repaired_text
from shardgen.features import functions, openai_batch, rollouts
from shardgen.features.functions import FunctionSpec
from shardgen.requests.results import ResultSpec, Sample

INPUT = pa.schema([pa.field("text", pa.string())])
ROW = {"text": "hello"}
HALF = "\ud83d"  # the first half of 😀, as json.loads reads "\ud83d" alone
# Texts with surrogates among other characters: hypothesis's own text() leaves surrogates out.
TEXTS = st.one_of(
    st.text(max_size=20),
    st.lists(st.sampled_from(["a", " ", "é", "😀", "\ud83d", "\ude00", "\udfff", '"', "\\", "\x00"]), max_size=12).map(
        "".join
    ),
)
FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def saved(tmp_path, spec, rows: list[dict]) -> list[dict]:
    """The rows as a checkpoint part holds them after a flush (read back from the file)."""
    ck = ShardCheckpoint(tmp_path / "ck", 0, 10, spec.schema(INPUT, "fp", "cfg", "00000"))
    ck.flush(rows)
    (part,) = sorted((tmp_path / "ck").glob("part-*.parquet"))
    out = pq.read_table(part).to_pylist()
    part.unlink()
    return out


def check(out: dict, column: str, written, text: str) -> None:
    """Either the text was kept as it was, or (only if it cannot be encoded) the row's error names the column."""
    if lone_surrogate(text) is None:
        assert out[column] == written
        assert out["error"] is None or "invalid_text" not in out["error"]
    else:
        assert out[column] is None
        assert out["error"].startswith("invalid_text: ") and f"column {column!r}" in out["error"]


def test_a_function_output_that_is_half_an_emoji_is_its_rows_error_and_the_others_are_saved(tmp_path):
    spec = FunctionSpec({"verdict": "string", "detail": "json"})
    good = spec.row(ROW, 0, functions.typed_row({"verdict": "ok", "detail": {"a": 1}}, spec.columns))
    bad = spec.row(ROW, 1, functions.typed_row({"verdict": f"x{HALF}", "detail": [HALF]}, spec.columns))
    first, second = saved(tmp_path, spec, [good, bad])
    assert first["verdict"] == "ok" and first["error"] is None
    assert second["verdict"] is None and second["detail"] is None and second["text"] == "hello"
    assert second["error"].startswith("invalid_text: column 'verdict'") and "column 'detail'" in second["error"]
    assert "\\ud83d" in second["error"], "the error shows the character, escaped"


def test_a_tool_result_that_is_half_an_emoji_reaches_the_model_repaired_and_the_messages_are_saved(tmp_path):
    tool = tmp_path / "tools.py"
    tool.write_text("def half(n: int):\n    return 'x' + chr(0xD83D) * n\n\ndef big():\n    return 'y' * 1000\n")
    rollouts.tools._init_tools([{"name": "half", "path": str(tool)}, {"name": "big", "path": str(tool)}])
    ok, text = rollouts.tools._call_tool("half", json.dumps({"n": 1}))
    assert ok and text == "x\ufffd"
    ok, text = rollouts.tools._call_tool("big", "{}", 999)
    assert not ok and "1000 characters, more than the context can hold (999)" in text
    assert rollouts.tools._call_tool("big", "{}", 1000) == (True, "y" * 1000)
    # a conversation whose last turn holds such text all the same (a model's own tool-call arguments)
    spec = rollouts.task.RolloutSpec({})
    (row,) = spec.rows(ROW, 0, 3, [Sample("done", "stop", 1)])
    messages = json.dumps([{"role": "tool", "content": f"x{HALF}"}], ensure_ascii=False)
    (out,) = saved(tmp_path, spec, [row | {"messages": messages, "turns": 2, "tool_calls": 1}])
    assert out["generation"] == "done" and out["messages"] is None
    assert out["error"].startswith("invalid_text: column 'messages'")


def test_structured_json_with_half_an_emoji_is_its_rows_error_not_the_attempts(tmp_path):
    spec = ResultSpec({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    (row,) = spec.rows(ROW, 0, 3, [Sample('{"a": "\\ud83d"}', "stop", 5)])
    (out,) = saved(tmp_path, spec, [row])
    assert out["generation"] == '{"a": "\\ud83d"}', "the generation itself is kept"
    assert out["parsed"] is None and out["error"].startswith("invalid_text: column 'parsed'")
    (pair,) = spec.rows(ROW, 1, 3, [Sample('{"a": "\\ud83d\\ude00"}', "stop", 5)])
    assert saved(tmp_path, spec, [pair])[0]["parsed"] == {"a": "😀"}, "an escaped pair is one character"


@FEW
@given(text=TEXTS)
def test_no_text_fails_a_flush_whichever_writer_made_it(tmp_path, text):
    # generation and reasoning
    spec = ResultSpec({"reasoning_parser": "deepseek_r1"})
    (row,) = spec.rows(ROW, 0, 3, [Sample(text, "stop", 1, reasoning=text, reasoning_tokens=1)])
    (out,) = saved(tmp_path, spec, [row])
    check(out, "generation", text, text)
    check(out, "reasoning", text, text)
    # parsed JSON (the model's escapes read back)
    spec = ResultSpec({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    (row,) = spec.rows(ROW, 0, 3, [Sample(json.dumps({"a": text}), "stop", 1)])
    read = json.loads(json.dumps(text))  # JSON reads an escaped pair of halves as one character
    check(saved(tmp_path, spec, [row])[0], "parsed", {"a": read}, read)
    # a function's outputs, as text and as JSON
    fspec = FunctionSpec({"s": "string", "j": "json"})
    row = fspec.row(ROW, 0, functions.typed_row({"s": text, "j": [text]}, fspec.columns))
    out = saved(tmp_path, fspec, [row])[0]
    check(out, "s", text, text)
    check(out, "j", json.dumps([text], ensure_ascii=False) if lone_surrogate(text) is None else None, text)
    # a tool's result as the model gets it, then in the conversation
    assert lone_surrogate(repaired_text(text)) is None
    spec = rollouts.task.RolloutSpec({})
    (row,) = spec.rows(ROW, 0, 3, [Sample("ok", "stop", 1)])
    messages = json.dumps([{"role": "tool", "content": repaired_text(text)}], ensure_ascii=False)
    (out,) = saved(tmp_path, spec, [row | {"messages": messages, "turns": 1, "tool_calls": 1}])
    assert out["messages"] == messages and out["error"] is None
    # an OpenAI batch request line: a row Arrow holds, or that row's request error
    line = json.dumps({"custom_id": "r", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": text}]}}).encode()  # fmt: skip
    request = openai_batch.requests_in.request_row(line)
    (back,) = pa.Table.from_pylist([request], schema=openai_batch.requests_in.BATCH_SCHEMA).to_pylist()
    if lone_surrogate(read) is None:
        assert back["messages"] == [{"role": "user", "content": read}] and back["request_error"] is None
    else:
        assert back["messages"] is None and "not valid Unicode" in back["request_error"]
