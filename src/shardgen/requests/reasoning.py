"""Reasoning models (``sampling.reasoning_parser``): vLLM's parser, checked and built once, and each
generated sample split into its trace and its answer.

Offline, vLLM gives a sample's whole text (``CompletionOutput`` has no reasoning field,
vllm/outputs.py); the engine argument ``reasoning_parser`` only gates structured outputs until the
trace ends and enables ``thinking_token_budget`` (docs/dev/vllm-reasoning.md). shardgen splits the
text itself, with the parser's own ``extract_reasoning``, as vLLM's server does
(vllm/parser/abstract_parser.py: ``parse``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardgen.errors import RowError

# The row error of a sample whose trace never gave way to an answer.
UNFINISHED = "reasoning_unfinished"
NO_ANSWER = "no_answer"


def parser_names() -> list[str]:
    """The installed vLLM's built-in reasoning parsers (importing vLLM: seconds)."""
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.list_registered()


def name_problem(name: str, known: Sequence[str]) -> str | None:
    """Why ``name`` is not one of the ``known`` parsers (None when it is), naming the close ones."""
    if name in known:
        return None
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
    return (
        f"sampling.reasoning_parser: '{name}' is not one of the installed vLLM's reasoning parsers{hint}; "
        f"it knows: {', '.join(known)}"
    )


def make_parser(name: str, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> Any:
    """vLLM's parser ``name`` for the engine's tokenizer.

    Every parser takes ``(tokenizer, *args, **kwargs)`` (vllm/reasoning/abs_reasoning_parsers.py:
    ``ReasoningParser.__init__``); those of engine-based models read ``chat_template_kwargs`` (Qwen3's
    ``enable_thinking``: vllm/parser/qwen3.py, ``Qwen3Parser.__init__``), as the server passes them.

    Raises:
        KeyError: no parser of that name.
        Exception: whatever the parser raises for this tokenizer (deepseek_r1 without ``<think>`` in the
            vocabulary: RuntimeError, vllm/reasoning/basic_parsers.py).
    """
    from vllm.reasoning import ReasoningParserManager

    cls = ReasoningParserManager.get_reasoning_parser(name)
    return cls(tokenizer, chat_template_kwargs=dict(chat_template_kwargs or {}))


def problems(sampling: Mapping[str, Any], tokenizer: Any, chat_template_kwargs: Mapping[str, Any]) -> list[str]:
    """What the engine or the split would fail on, for the preflight: the name against the installed
    vLLM, the parser on this model's tokenizer, a thinking budget without markers to count between,
    and structured outputs whose gate would never open."""
    name = sampling.get("reasoning_parser")
    if not name:
        return []
    if problem := name_problem(name, parser_names()):
        return [problem]
    try:
        parser = make_parser(name, tokenizer, chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - the engine would fail at its start the same way (ReasoningConfig)
        return [
            f"sampling.reasoning_parser: '{name}' does not work with this model's tokenizer: {type(e).__name__}: {e}"
        ]
    out = []
    start, end = parser.reasoning_start_str, parser.reasoning_end_str
    if sampling.get("thinking_token_budget") is not None and not (start and end):
        # vllm/config/reasoning.py: ReasoningConfig stays disabled, and vllm/v1/engine/input_processor.py
        # (_validate_params) refuses every request that has a budget
        out.append(
            f"sampling.thinking_token_budget: the reasoning parser '{name}' has no start and end markers to "
            "count the trace between, and vLLM refuses every request with a budget; drop the budget"
        )
    if (
        sampling.get("structured_outputs")
        and end
        and tokenizer.convert_tokens_to_ids(end) in (None, tokenizer.unk_token_id)
    ):
        # the structured-output gate looks for the end marker as one token (vllm/v1/structured_output/__init__.py,
        # _get_constraint_bounds): without it the grammar is never applied
        out.append(
            f"sampling.structured_outputs with sampling.reasoning_parser '{name}': the model's vocabulary has no "
            f"single token '{end}', so vLLM would never see the reasoning end and never apply the format; "
            "is this the parser of this model?"
        )
    return out


@dataclass(frozen=True)
class Split:
    """A sample split by the parser: the trace, the answer, the trace's tokens (end marker included),
    and the row error of a sample that has no answer."""

    reasoning: str | None
    answer: str | None
    reasoning_tokens: int
    error: str | None = None


def _find(seq: Sequence[int], sub: Sequence[int]) -> int | None:
    """The index of the first occurrence of ``sub`` (not empty) in ``seq``."""
    seq, sub = list(seq), list(sub)
    start = 0
    while True:
        try:
            i = seq.index(sub[0], start)
        except ValueError:
            return None
        if seq[i : i + len(sub)] == sub:
            return i
        start = i + 1


class Splitter:
    """Splits a run's samples with one parser (built once per job).

    The trace's tokens are counted by locating the parser's end marker in the sample's token ids, as
    vLLM's ``ReasoningConfig`` encodes it (vllm/config/reasoning.py: ``initialize_token_ids``): exact,
    and a scan instead of a tokenizer call per sample; the parser's own count
    (``count_reasoning_tokens``) is 0 for deepseek_r1 when the prompt opened the trace. A parser
    without an end marker (openai_gptoss, granite) gets its trace re-encoded: an approximation.

    Args:
        parser: vLLM's reasoning parser (``make_parser``).
        tokenizer: the engine's (Hugging Face) tokenizer.
    """

    def __init__(self, parser: Any, tokenizer: Any) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        end = parser.reasoning_end_str
        self.end_ids: list[int] = list(tokenizer.encode(end, add_special_tokens=False)) if end else []
        # vLLM's server keeps special tokens in the text for engine-based parsers, whose markers may
        # be special tokens (vllm/parser/engine/parser_engine.py: ParserEngine.adjust_request)
        self.keep_special_tokens = bool(getattr(parser, "engine_based_streaming", False))

    @classmethod
    def of(cls, name: str, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> Splitter:
        return cls(make_parser(name, tokenizer, chat_template_kwargs), tokenizer)

    def split(self, text: str, token_ids: Sequence[int], finish_reason: str | None,
              prompt_token_ids: Sequence[int] | None) -> Split:  # fmt: skip
        """The sample's trace and answer.

        With the end marker in the output, the parser splits the text. Without it, a prompt that closed
        the trace already (``enable_thinking: false`` renders ``<think></think>``) makes the whole text
        the answer, as vLLM's streaming parser and structured-output gate decide
        (vllm/parser/abstract_parser.py: ``parse_delta``); otherwise the parser decides, which for
        most parsers makes the whole text a trace with no answer.
        """
        at = _find(token_ids, self.end_ids) if self.end_ids else None
        if at is not None:
            reasoning, answer = self.parser.extract_reasoning(text, None)
            count = at + len(self.end_ids)
        elif self.end_ids and self.parser.is_reasoning_end(list(prompt_token_ids or ())):
            reasoning, answer, count = None, text, 0
        else:
            reasoning, answer = self.parser.extract_reasoning(text, None)
            if answer is None:
                count = len(token_ids)
            else:
                count = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        error = None
        if answer is None and finish_reason == "length":
            where = "ended on the last token of" if at is not None else "did not end within"
            error = str(RowError(
                UNFINISHED,
                f"the reasoning {where} max_tokens ({len(token_ids)} tokens): no answer; raise "
                "sampling.max_tokens, or set sampling.thinking_token_budget below it",
            ))  # fmt: skip
        elif answer is None:
            error = str(RowError(NO_ANSWER, f"the model stopped ({finish_reason}) after its reasoning, with no answer"))
        return Split(reasoning, answer, count, error)
