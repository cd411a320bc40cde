"""Result columns: samples as rows or lists, parsed JSON, labels and their probabilities, log-probabilities."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from shardgen.errors import ConfigError
from shardgen.requests.results import ResultSpec, Sample, choice_first_tokens, json_arrow_type

ROW = {"text": "hello"}
SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative"]},
        "score": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "extra": {"anyOf": [{"type": "string"}, {"type": "number"}]},
    },
    "required": ["sentiment", "score"],
}


def table(spec: ResultSpec, rows: list[dict]) -> pa.Table:
    schema = pa.schema([pa.field("text", pa.string()), *spec.fields()])
    return pa.Table.from_pylist(rows, schema=schema)


def test_the_plain_result_columns_are_the_documented_ones():
    assert ResultSpec({}).names == [
        "row_index",
        "generation",
        "finish_reason",
        "prompt_tokens",
        "generated_tokens",
        "error",
        "result_source",
    ]


def test_several_samples_as_rows_give_one_row_per_sample_with_its_index():
    spec = ResultSpec({"n": 3}, samples="rows")
    assert spec.rows_per_input == 3 and "sample_index" in spec.names
    rows = spec.rows(ROW, 7, 5, [Sample(f"s{i}", "stop", i + 1) for i in range(3)])
    assert [(r["row_index"], r["sample_index"], r["generation"]) for r in rows] == [
        (7, 0, "s0"),
        (7, 1, "s1"),
        (7, 2, "s2"),
    ]
    t = table(spec, rows)
    assert t.column("generated_tokens").to_pylist() == [1, 2, 3]
    # a row that failed before generating still fills all its sample rows
    errors = spec.error_rows(ROW, 8, "null_value: column 'text' is null")
    assert [r["sample_index"] for r in errors] == [0, 1, 2] and all(r["error"] for r in errors)
    table(spec, errors)


def test_several_samples_as_a_list_give_one_row_with_list_columns():
    spec = ResultSpec({"n": 2}, samples="list")
    assert spec.rows_per_input == 1 and "sample_index" not in spec.names
    (row,) = spec.rows(ROW, 0, 5, [Sample("a", "stop", 1), Sample("bb", "length", 2)])
    t = table(spec, [row])
    assert t.column("generation").to_pylist() == [["a", "bb"]]
    assert t.column("generated_tokens").to_pylist() == [[1, 2]]
    assert t.column("error").to_pylist() == [None]


def test_json_schemas_become_typed_struct_columns():
    t = json_arrow_type(SCHEMA)
    assert t == pa.struct(
        [("sentiment", pa.string()), ("score", pa.int64()), ("tags", pa.list_(pa.string())), ("extra", pa.string())]
    )
    assert json_arrow_type({"type": ["integer", "null"]}) == pa.int64()
    assert json_arrow_type({"type": "object"}) is None  # free-form: stored as JSON text


def test_a_generation_that_parses_fills_the_parsed_column_and_one_that_does_not_is_a_row_error():
    spec = ResultSpec({"structured_outputs": {"json": SCHEMA}})
    good = '{"sentiment": "positive", "score": 4, "tags": ["a"], "extra": 2.5}'
    (row,) = spec.rows(ROW, 0, 5, [Sample(good, "stop", 20)])
    assert row["error"] is None
    assert row["parsed"] == {"sentiment": "positive", "score": 4, "tags": ["a"], "extra": "2.5"}
    (cut,) = spec.rows(ROW, 1, 5, [Sample('{"sentiment": "posi', "length", 8)])
    assert cut["error"].startswith("invalid_json: the output is not valid JSON (the output was cut at max_tokens)")
    (wrong,) = spec.rows(ROW, 2, 5, [Sample('{"sentiment": "meh", "score": 1}', "stop", 8)])
    assert wrong["error"].startswith("invalid_json: the output does not match the schema at sentiment")
    t = table(spec, [row, cut, wrong])
    assert t.column("parsed").to_pylist()[0]["score"] == 4 and t.column("parsed").to_pylist()[1] is None


def test_a_label_outside_the_choices_is_a_row_error():
    spec = ResultSpec({"structured_outputs": {"choice": ["yes", "no"]}})
    (ok,) = spec.rows(ROW, 0, 5, [Sample(" yes", "stop", 1)])
    (bad,) = spec.rows(ROW, 1, 5, [Sample("maybe", "stop", 1)])
    assert ok["label"] == "yes" and ok["error"] is None
    assert bad["label"] is None and bad["error"].startswith("invalid_choice: the output 'maybe'")


def test_choice_probabilities_are_a_softmax_of_the_labels_first_tokens_and_sum_to_one():
    spec = ResultSpec(
        {"structured_outputs": {"choice": ["yes", "no", "unsure"]}}, choice_probs=True, choice_token_ids=[11, 22, 33]
    )
    first = {11: math.log(0.6), 22: math.log(0.2), 33: math.log(0.1), 99: math.log(0.1)}
    (row,) = spec.rows(ROW, 0, 5, [Sample("yes", "stop", 1, first_logprobs=first)])
    probs = row["choice_probs"]
    assert sum(probs.values()) == pytest.approx(1.0)
    assert probs["yes"] == pytest.approx(0.6 / 0.9) and row["label_prob"] == probs["yes"]
    t = table(spec, [row])
    assert t.column("choice_probs").type == pa.struct(
        [("yes", pa.float64()), ("no", pa.float64()), ("unsure", pa.float64())]
    )


def test_labels_sharing_their_first_token_are_refused():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(text[0]), 1]

    assert choice_first_tokens(Tok(), ["yes", "no"]) == [ord("y"), ord("n")]
    with pytest.raises(ConfigError, match="the labels 'positive' and 'positron' start with the same token"):
        choice_first_tokens(Tok(), ["positive", "negative", "positron"])


def test_top_logprobs_are_kept_per_position():
    spec = ResultSpec({"logprobs": 2})
    lp = [[(5, "Hi", -0.1), (6, "Hey", -2.5)], [(7, "!", -0.3), (8, ".", -1.5)]]
    (row,) = spec.rows(ROW, 0, 5, [Sample("Hi!", "stop", 2, logprobs=lp)])
    t = table(spec, [row])
    assert t.column("logprobs").to_pylist()[0][1][0] == {"token_id": 7, "token": "!", "logprob": pytest.approx(-0.3)}


def test_rows_with_their_own_sampling_and_samples_as_lists_get_list_columns_and_a_logprobs_column_at_n_1():
    spec = ResultSpec({}, samples="list", per_row=True)  # a row may set n and logprobs
    assert spec.rows_per_input == 1 and spec.as_list
    lp = [[(5, "Hi", -0.1)]]
    (one,) = spec.rows(ROW, 0, 5, [Sample("Hi", "stop", 1, logprobs=lp), Sample("Yo", "stop", 1)])
    (plain,) = spec.rows(ROW, 1, 5, [Sample("Hey", "stop", 1)])  # a row that asked for none
    t = table(spec, [one, plain])
    assert t.column("generation").to_pylist() == [["Hi", "Yo"], ["Hey"]]
    assert t.column("logprobs").to_pylist()[1] == [None] and t.column("logprobs").to_pylist()[0][1] is None
    # runs without per-row sampling keep their columns; choice_probs take the log-probabilities
    assert "logprobs" not in ResultSpec({}).names and not ResultSpec({}, samples="list").as_list
    assert "logprobs" not in ResultSpec({"structured_outputs": {"choice": ["a"]}}, "rows", True, per_row=True).names
    assert "logprobs" in ResultSpec({}, per_row=True).names and not ResultSpec({}, per_row=True).as_list


def test_a_list_mode_error_names_the_sample():
    spec = ResultSpec({"n": 2, "structured_outputs": {"choice": ["a", "b"]}}, samples="list")
    (row,) = spec.rows(ROW, 0, 5, [Sample("a", "stop", 1), Sample("c", "stop", 1)])
    assert row["label"] == ["a", None] and row["error"].startswith("sample 1: invalid_choice")


def test_a_reasoning_run_adds_the_trace_and_its_tokens_and_labels_the_answer():
    spec = ResultSpec({"reasoning_parser": "qwen3", "structured_outputs": {"choice": ["yes", "no"]}})
    assert spec.names[4:8] == ["generated_tokens", "reasoning", "reasoning_tokens", "label"]
    (row,) = spec.rows(ROW, 0, 5, [Sample("yes", "stop", 9, reasoning="hmm", reasoning_tokens=6)])
    assert (row["generation"], row["reasoning"], row["reasoning_tokens"], row["label"], row["error"]) == (
        "yes", "hmm", 6, "yes", None,
    )  # fmt: skip
    error = "reasoning_unfinished: the reasoning did not end within max_tokens (8 tokens): no answer"
    (cut,) = spec.rows(ROW, 1, 5, [Sample(None, "length", 8, reasoning="hmm hmm", reasoning_tokens=8, error=error)])
    assert (cut["generation"], cut["label"], cut["error"], cut["finish_reason"]) == (None, None, error, "length")
    table(spec, [row, cut])  # the rows fit the columns


def test_a_reasoning_run_with_samples_as_lists_has_list_columns_of_the_trace():
    spec = ResultSpec({"reasoning_parser": "qwen3", "n": 2}, samples="list")
    assert spec.names[4:7] == ["generated_tokens", "reasoning", "reasoning_tokens"]
    samples = [Sample("a", "stop", 3, reasoning="r0", reasoning_tokens=2), Sample("b", "stop", 4, reasoning=None,
               reasoning_tokens=0)]  # fmt: skip
    (row,) = spec.rows(ROW, 0, 5, samples)
    assert (row["reasoning"], row["reasoning_tokens"]) == (["r0", None], [2, 0])
    assert table(spec, [row]).schema.field("reasoning").type == pa.list_(pa.string())
