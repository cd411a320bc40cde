"""Reasoning models: the parser's name against the installed vLLM, what the preflight refuses, and
each sample split into its trace and its answer, with the trace's tokens counted exactly."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shardgen.requests import reasoning
from shardgen.requests.reasoning import Splitter

LABELS = {"structured_outputs": {"choice": ["positive", "negative"]}}


@pytest.fixture(scope="module")
def tok(reasoner_dir):
    return AutoTokenizer.from_pretrained(reasoner_dir)


@pytest.fixture(scope="module")
def demo_tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_a_misspelt_parser_is_refused_naming_the_close_ones():
    known = reasoning.parser_names()
    assert "deepseek_r1" in known and "qwen3" in known
    problem = reasoning.name_problem("deepseek-r1", known)
    assert problem.startswith("sampling.reasoning_parser: 'deepseek-r1' is not one of the installed vLLM's")
    assert "did you mean 'deepseek_r1'" in problem and "it knows: " in problem
    assert reasoning.name_problem("qwen3", known) is None


@pytest.mark.parametrize(
    ("sampling", "problem"),
    [
        ({"reasoning_parser": "qwen_3"}, "did you mean 'qwen3'"),
        ({"reasoning_parser": "deepseek_r1"}, "'deepseek_r1' does not work with this model's tokenizer: RuntimeError"),
        ({"reasoning_parser": "openai_gptoss", "thinking_token_budget": 8}, "has no start and end markers"),
        ({"reasoning_parser": "qwen3", **LABELS}, "has no single token '</think>'"),
    ],
)
def test_the_preflight_refuses_a_parser_the_demo_model_cannot_use(demo_tok, sampling, problem):
    (got,) = reasoning.problems(sampling, demo_tok, {})
    assert problem in got, got


def test_the_reasoning_model_passes_with_either_parser(tok):
    for name in ("deepseek_r1", "qwen3"):
        assert reasoning.problems({"reasoning_parser": name, "thinking_token_budget": 4, **LABELS}, tok, {}) == []


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_trace_and_its_answer_are_split_and_the_trace_counted_to_its_end_marker(tok, name):
    splitter = Splitter.of(name, tok)
    prompt = ids(tok, "<|im_start|>assistant\n<think>")
    out = ids(tok, "a b c</think>positive")
    split = splitter.split("a b c</think>positive", out, "stop", prompt)
    assert (split.reasoning, split.answer, split.error) == ("a b c", "positive", None)
    assert split.reasoning_tokens == out.index(tok.convert_tokens_to_ids("</think>")) + 1 == len(ids(tok, "a b c")) + 1


def test_a_prompt_that_closed_the_trace_makes_the_whole_text_the_answer(tok):
    """enable_thinking: false renders <think></think>: deepseek_r1 alone would file it all as reasoning."""
    splitter = Splitter.of("deepseek_r1", tok)
    split = splitter.split("positive", ids(tok, "positive"), "stop", ids(tok, "assistant\n<think></think>"))
    assert (split.reasoning, split.answer, split.reasoning_tokens, split.error) == (None, "positive", 0, None)


def test_a_trace_cut_by_max_tokens_is_the_rows_error_with_no_answer(tok):
    splitter = Splitter.of("deepseek_r1", tok)
    prompt = ids(tok, "assistant\n<think>")
    split = splitter.split("a b c", ids(tok, "a b c"), "length", prompt)
    assert (split.reasoning, split.answer, split.reasoning_tokens) == ("a b c", None, 3)
    assert split.error == (
        "reasoning_unfinished: the reasoning did not end within max_tokens (3 tokens): no answer; raise "
        "sampling.max_tokens, or set sampling.thinking_token_budget below it"
    )
    ended = splitter.split("a b c</think>", ids(tok, "a b c</think>"), "length", prompt)
    assert ended.answer is None and ended.reasoning_tokens == 4
    assert ended.error.startswith("reasoning_unfinished: the reasoning ended on the last token of max_tokens (4")
    stopped = splitter.split("a b c</think>", ids(tok, "a b c</think>"), "stop", prompt)
    assert stopped.error == "no_answer: the model stopped (stop) after its reasoning, with no answer"


def test_a_multi_token_end_marker_is_found_in_the_token_ids():
    assert reasoning._find([5, 1, 2, 1, 2, 3, 9], [1, 2, 3]) == 3
    assert reasoning._find([5, 1, 2], [1, 2, 3]) is None
    assert reasoning._find([7, 8], [8]) == 1


def test_label_probabilities_are_read_at_the_answers_first_position_not_the_traces(tok):
    """vLLM gives logprob_token_ids at every position; the labels' first tokens matter after the trace."""
    from types import SimpleNamespace

    from shardgen.requests.tasks import _sample

    def position(lp: dict[int, float]) -> dict:
        return {t: SimpleNamespace(logprob=v, rank=None, decoded_token=None) for t, v in lp.items()}

    text = "a b</think>yes"
    out = SimpleNamespace(text=text, token_ids=ids(tok, text), finish_reason="stop", index=0)
    answer_at = out.token_ids.index(tok.convert_tokens_to_ids("</think>")) + 1
    out.logprobs = [position({1: -9.0, 2: -9.0}) for _ in out.token_ids]
    out.logprobs[answer_at] = position({1: -0.1, 2: -3.0})
    sample = _sample(out, Splitter.of("deepseek_r1", tok), ids(tok, "assistant\n<think>"))
    assert (sample.text, sample.reasoning, sample.reasoning_tokens) == ("yes", "a b", answer_at)
    assert sample.first_logprobs == {1: -0.1, 2: -3.0}
