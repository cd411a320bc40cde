"""Per-row sampling (input.sampling_column): what a row may set, under OpenAI's names or vLLM's, and
the row errors that name the field; the params are vLLM's own SamplingParams."""

from __future__ import annotations

import pytest

from shardgen import config as cfg
from shardgen.engines.vllm import make_sampling_params
from shardgen.errors import ConfigError, RowError
from shardgen.requests import rowsampling
from shardgen.requests.results import sampling_params as plain_sampling_params
from shardgen.requests.rowsampling import overrides, row_logprobs, row_sampling
from tests.conftest import TEST_MODEL_CFG


def sampling_params(*args, **kwargs):
    """A row's params as the vLLM engine makes them (vLLM's own checks)."""
    return rowsampling.sampling_params(*args, **kwargs, make=make_sampling_params)


RUN = {"max_tokens": 32, "temperature": 0.0, "n": 1}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, {}),
        ('{"max_tokens": 5, "stop": null}', {"max_tokens": 5}),
        ({"temperature": 0.7, "seed": None}, {"temperature": 0.7}),
        ([("top_p", 0.9)], {"top_p": 0.9}),  # an Arrow map column
    ],
)
def test_a_rows_value_is_a_mapping_or_a_json_object_and_null_fields_keep_the_runs(value, expected):
    assert overrides(value, "params") == expected


@pytest.mark.parametrize(("value", "said"), [("{not json", "params: not a JSON object"), (7, "not int")])
def test_a_value_that_is_no_mapping_is_the_rows_error(value, said):
    with pytest.raises(RowError, match=said) as e:
        overrides(value, "params")
    assert e.value.reason == "invalid_sampling"


def test_openais_names_map_to_vllms_and_a_json_schema_response_format_constrains_the_row():
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    row = {"max_completion_tokens": 7, "temperature": 0.5, "user": "u1", "model": "gpt-x", "n": 1,
           "response_format": schema}  # fmt: skip
    assert row_sampling(RUN, row, "params") == {
        "max_tokens": 7, "temperature": 0.5, "n": 1, "structured_outputs": {"json": {"type": "object"}}
    }  # fmt: skip
    assert row_sampling(RUN, {"response_format": {"type": "json_object"}}, "p")["structured_outputs"] == {
        "json_object": True
    }
    assert "structured_outputs" not in row_sampling(RUN, {"response_format": {"type": "text"}}, "p")


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"n": 3}, "params.n: 3, but the run's is 1: .* needs output.samples: list"),
        ({"n": 0}, "params.n: an integer of at least 1, not 0"),
        ({"logprobs": True, "top_logprobs": 21}, "params.top_logprobs: true, false or an integer from 0 to 20"),
        ({"logprobs": False, "top_logprobs": 2}, "params.top_logprobs: needs logprobs true"),
        ({"logprobs": 3, "top_logprobs": 2}, "params.top_logprobs: with logprobs true, not with logprobs 3"),
        ({"top_logprobs": 2}, "params.top_logprobs: needs logprobs true"),
        ({"tools": [{"type": "function"}]}, "params.tools: not a sampling field"),
        ({"response_format": {"type": "xml"}}, "params.response_format: type text, json_object or json_schema"),
    ],
)
def test_a_field_the_row_may_not_set_is_its_error_naming_the_field(row, said):
    with pytest.raises(RowError, match=said):
        row_sampling(RUN, row, "params")


def test_a_rows_response_format_in_a_run_with_structured_outputs_is_refused():
    run = {**RUN, "structured_outputs": {"choice": ["yes", "no"]}}
    with pytest.raises(RowError, match="the run's sampling.structured_outputs decide it"):
        row_sampling(run, {"response_format": {"type": "json_object"}}, "p")


def test_the_params_are_vllms_with_the_rows_values_and_vllm_refuses_a_bad_one():
    params, seed = sampling_params(RUN, {"max_tokens": 3, "stop": ["\n"], "seed": 11}, "p")
    assert (params.max_tokens, params.stop, seed) == (3, ["\n"], 11)
    with pytest.raises(RowError, match=r"^invalid_sampling: p: max_tokens must be at least 1") as e:
        sampling_params(RUN, {"max_tokens": -1}, "p")
    assert e.value.reason == "invalid_sampling"
    with pytest.raises(RowError, match="p.seed: an integer, not 'abc'"):
        sampling_params(RUN, {"seed": "abc"}, "p")
    with pytest.raises(RowError, match="p.temperature: a number, not 'hot'"):
        sampling_params(RUN, {"temperature": "hot"}, "p")
    with pytest.raises(RowError, match="p.stop: a string or a list of strings"):
        sampling_params(RUN, {"stop": [1]}, "p")


def test_the_column_is_for_generation_and_must_be_in_the_input():
    base = {"input": {"parquet": ["x.parquet"], "sampling_column": "params"}, "prompt": {"template": "{{ text }}"},
            "model": {**TEST_MODEL_CFG, "runner": "pooling"}, "task": "embed"}  # fmt: skip
    with pytest.raises(ConfigError, match="input.sampling_column sets sampling per row: for task generate"):
        cfg.RunConfig.from_dict(base)


@pytest.mark.parametrize(
    ("run", "row", "logprobs"),
    [
        (RUN, {"logprobs": True, "top_logprobs": 3}, 3),  # OpenAI's chat pair
        (RUN, {"logprobs": True}, 0),  # the sampled token alone
        (RUN, {"logprobs": 2}, 2),  # vLLM's, and OpenAI's completions
        ({**RUN, "logprobs": 4}, {"logprobs": True}, 4),  # an absent top_logprobs keeps the run's
        ({**RUN, "logprobs": 4}, {"top_logprobs": 1}, 1),
        ({**RUN, "logprobs": 4}, {"logprobs": False}, None),
    ],
)
def test_a_rows_own_logprobs_are_vllms_count_of_top_tokens(run, row, logprobs):
    assert row_sampling(run, row, "p").get("logprobs") == logprobs
    assert row_logprobs(run, row, "p") == logprobs


def test_a_rows_own_n_is_its_samples_where_samples_are_lists_and_the_params_carry_it():
    assert row_sampling(RUN, {"n": 3}, "p", own_n=True)["n"] == 3
    row = {"n": 3, "temperature": 0.8, "logprobs": True, "top_logprobs": 2}
    params, _ = sampling_params(RUN, row, "p", own_n=True)
    assert (params.n, params.logprobs) == (3, 2)
    with pytest.raises(RowError, match="n must be 1 when using greedy sampling"):  # vLLM's check, the row's error
        sampling_params(RUN, {"n": 3}, "p", own_n=True)
    # the run's own n is no change, whatever the layout
    assert row_sampling({**RUN, "n": 2}, {"n": 2}, "p")["n"] == 2


def test_the_logprobs_a_writer_expects_of_a_row_are_the_runs_without_a_value_and_none_for_an_invalid_one():
    assert row_logprobs({**RUN, "logprobs": 5}, None, "p") == 5
    assert row_logprobs(RUN, None, None) is None
    assert row_logprobs(RUN, '{"logprobs": true, "top_logprobs": 2}', "body") == 2
    assert row_logprobs(RUN, {"temperature": "hot"}, "p") is None  # the row is an error row


def test_a_rows_logprobs_in_a_run_whose_choice_probs_take_them_are_refused():
    with pytest.raises(RowError, match="p.logprobs: output.choice_probs takes the log-probabilities"):
        sampling_params(RUN, {"logprobs": True}, "p", [11, 12])


def test_the_fake_engine_and_a_server_get_the_rows_fields_as_attributes_and_the_counts_no_engine_takes_refused():
    """Their jobs never import vLLM: the same fields by name, over SamplingParams' defaults."""
    params, seed = rowsampling.sampling_params(RUN, {"max_tokens": 3, "stop": ["\n"], "seed": 11, "top_p": 0.5}, "p",
                                               [7, 8], make=plain_sampling_params)  # fmt: skip
    assert (params.max_tokens, params.stop, params.top_p, params.n, seed) == (3, ["\n"], 0.5, 1, 11)
    assert params.logprob_token_ids == [7, 8] and params.seed is None, "the seed is the task's to set"
    structured = plain_sampling_params({"structured_outputs": {"choice": ["a", "b"]}}).structured_outputs
    assert structured.choice == ["a", "b"]
    for field, value in (("max_tokens", 0), ("n", 0), ("temperature", -1), ("logprobs", -2)):
        with pytest.raises(RowError, match=rf"^invalid_sampling: p\W+{field}\W.*{value}"):
            rowsampling.sampling_params(RUN, {field: value}, "p", own_n=True, make=plain_sampling_params)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):  # the run's, past the schema
        plain_sampling_params({"max_tokens": 0})
