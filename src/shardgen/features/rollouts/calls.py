"""A turn's tool calls: vLLM's tool parser on the turn's text, the JSON schema that constrains a required
call, and the messages as the chat template takes them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# -- A turn's tool calls ---------------------------------------------------------------------------------


class CallParser:
    """The tool calls of a turn's text, as vLLM's server finds them (``vllm/parser/abstract_parser.py:
    _extract_tool_calls``): ``required``, a JSON list of ``{name, parameters}`` (what the structured
    output constrains the turn to); a tool's name, that tool's arguments as a JSON object; ``auto``,
    the tool parser's (``ToolParserManager``); ``none``, none."""

    def __init__(self, rollout: Mapping[str, Any], tools: list[dict[str, Any]], hf_tokenizer: Any) -> None:
        self.choice = rollout["tool_choice"]
        self.parser = self.request = None
        if self.choice == "auto":
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.tool_parsers import ToolParserManager

            self.parser = ToolParserManager.get_tool_parser(rollout["tool_parser"])(hf_tokenizer)
            self.request = ChatCompletionRequest(model="shardgen", messages=[{"role": "user", "content": ""}],
                                                 tools=tools, tool_choice="auto")  # fmt: skip
            self.request = self.parser.adjust_request(self.request)

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser reads special tokens (hermes' ``<tool_call>`` may be one): the turns keep them."""
        return self.request is not None and self.request.skip_special_tokens is False

    def calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """``(content, [(name, arguments as JSON text)])`` of a turn's text."""
        if self.choice == "none":
            return text, []
        if self.choice == "required":
            try:
                found = json.loads(text)
            except ValueError:
                return text, []  # cut by max_tokens: no call
            ok = isinstance(found, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in found)
            if not ok:
                return text, []
            return None, [(c["name"], json.dumps(c.get("parameters") or {}, ensure_ascii=False)) for c in found]
        if self.choice != "auto":  # a tool's name: the text is its arguments
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [(self.choice, text)]
        assert self.parser is not None
        info = self.parser.extract_tool_calls(text, self.request)
        if not info.tools_called:
            return text, []
        content = info.content if info.content and info.content.strip() else None
        return content, [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]


def structured_schema(rollout: Mapping[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON schema a turn is constrained to (``required``, a tool's name), as vLLM's server makes it;
    None for ``auto`` and ``none``."""
    choice = rollout["tool_choice"]
    if choice in ("auto", "none"):
        return None
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    params = [ChatCompletionToolsParam.model_validate(t) for t in tools]
    if choice != "required":
        choice = ChatCompletionNamedToolChoiceParam.model_validate({"type": "function", "function": {"name": choice}})
    return get_json_schema_from_tools(choice, params, rollout.get("parallel_tool_calls", True))  # type: ignore[return-value]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (as vLLM gives it to them): a call's arguments as a
    dict, and a message with no text as an empty one."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                try:
                    args = json.loads(c["function"]["arguments"])
                except ValueError:
                    args = c["function"]["arguments"]
                calls.append({**c, "function": {**c["function"], "arguments": args}})
            m["tool_calls"] = calls
        m.pop("reasoning", None)
        out.append(m)
    return out
