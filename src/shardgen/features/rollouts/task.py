"""The rollout task (``rollout``): a generate task whose rows are conversations (registered with config)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from shardgen import config as cfg
from shardgen.base import pycode
from shardgen.errors import ConfigError
from shardgen.features.rollouts.calls import CallParser, structured_schema
from shardgen.features.rollouts.conversations import Conversation, Rollouts
from shardgen.features.rollouts.tools import (
    _call_tool,
    _key,
    definitions,
    failed_call,
    tool_digests,
    tool_names,
    tool_pool,
)
from shardgen.requests import tasks
from shardgen.requests.results import Completion, ResultSpec

# rollout.tool_choice besides a tool's name
TOOL_CHOICES = ("auto", "required", "none")


# -- The task --------------------------------------------------------------------------------------------


class RolloutSpec(ResultSpec):
    """A rollout's columns: a generation's, and ``messages``, ``turns``, ``tool_calls`` before ``error``."""

    def fields(self) -> list[pa.Field]:
        out = super().fields()
        extra = [pa.field("messages", pa.string()), pa.field("turns", pa.int32()), pa.field("tool_calls", pa.int32())]
        return [*out[:-2], *extra, *out[-2:]]  # before error and result_source


class RolloutTask(tasks.GenerateTask):
    """``task: generate`` with a ``rollout`` section: each row a conversation (``Rollouts``)."""

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        super().check_config(config)
        rollout, sampling = config["rollout"], config.get("sampling") or {}
        names = tool_names(rollout)
        if len(set(names)) < len(names):
            raise ConfigError(f"rollout.tools: two tools named {next(n for n in names if names.count(n) > 1)!r}")
        choice = rollout["tool_choice"]
        if choice not in TOOL_CHOICES and choice not in names:
            raise ConfigError(f"rollout.tool_choice: {choice!r} is none of {', '.join(TOOL_CHOICES)} and no tool's "
                              f"name (the tools: {', '.join(names)})")  # fmt: skip
        if choice == "auto" and not rollout.get("tool_parser"):
            raise ConfigError("rollout.tool_parser: tool_choice auto finds the calls with one of vLLM's tool parsers "
                              "(hermes, llama3_json, ...): name the one your model was trained for")  # fmt: skip
        if not config["prompt"].get("chat", True):
            raise ConfigError("rollout: a conversation needs prompt.chat true (the model's chat template)")
        if config["prompt"].get("images"):
            raise ConfigError("rollout: prompt.images are not carried into a conversation's later turns; drop them")
        if sampling.get("n", 1) != 1:
            raise ConfigError("rollout: sampling.n must be 1 (a conversation per row: for several, repeat the rows)")
        if sampling.get("structured_outputs") and choice != "auto" and choice != "none":
            raise ConfigError(f"rollout.tool_choice: {choice} constrains each turn to a tool call; drop "
                              "sampling.structured_outputs")  # fmt: skip
        if config["output"].get("choice_probs"):
            raise ConfigError("rollout: output.choice_probs is for one-turn labels; drop it")
        tool_digests(rollout)  # each tool's file or module is there

    @classmethod
    def content(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """A generation's, and the rollout: its settings and its tools' code, not where their files are,
        the preflight's example calls, nor how many processes run them."""
        rollout = config["rollout"]
        kept = {k: v for k, v in rollout.items() if k not in ("tools", "tool_processes")}
        tools = [{k: v for k, v in t.items() if k not in ("path", "example")} for t in rollout["tools"]]
        return {**super().content(config), "rollout": {**kept, "tools": tools, "code": tool_digests(rollout)}}

    @classmethod
    def columns(cls, config: Any, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> RolloutSpec:
        return RolloutSpec.of(config, choice_token_ids)

    @classmethod
    def provenance(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The rollout's settings, and each tool: its name, file or module, and its code's digest."""
        rollout = config["rollout"]
        tools = [{"name": t["name"], "path": t.get("path"), "module": t.get("module"), "code": d}
                 for t, d in zip(rollout["tools"], tool_digests(rollout), strict=True)]  # fmt: skip
        kept = {k: v for k, v in rollout.items() if k != "tools"}
        return {"rollout": {**kept, "tools": tools}}

    @classmethod
    def chat_template_kwargs(cls, config: Any) -> dict[str, Any]:
        """The tools, for the chat template (as vLLM's server passes a request's ``tools``)."""
        return {"tools": definitions(config.raw["rollout"])}

    @classmethod
    def check_model(cls, config: Any, tokenizer: Any) -> tuple[list[str], list[str]]:
        """The tools import and have schemas that agree with their signatures; the tool parser is one of
        the installed vLLM's and takes the model's tokenizer; each tool with ``example`` arguments runs
        on them (in a worker process, within ``tool_timeout_seconds``)."""
        rollout = config.raw["rollout"]
        try:
            tools = definitions(rollout)
        except ConfigError as e:
            return [str(e)], []
        problems: list[str] = []
        if rollout["tool_choice"] == "auto":
            from vllm.tool_parsers import ToolParserManager

            known = ToolParserManager.list_registered()
            if rollout["tool_parser"] not in known:
                problems.append(f"rollout.tool_parser: {rollout['tool_parser']!r} is none of the installed vLLM's "
                                f"tool parsers ({', '.join(known)})")  # fmt: skip
                return problems, []
        try:
            CallParser(rollout, tools, tokenizer)
            structured_schema(rollout, tools)
        except Exception as e:  # noqa: BLE001 - the parser refuses the tokenizer, vLLM refuses a schema
            problems.append(f"rollout: {type(e).__name__}: {pycode.first_line(e)}")
        examples = [(i, t) for i, t in enumerate(rollout["tools"]) if t.get("example") is not None]
        if examples and not problems:
            timeout = float(rollout["tool_timeout_seconds"])
            pool = tool_pool(rollout, 1)
            try:
                for i, t in examples:
                    future = pool.schedule(_call_tool, args=(t["name"], json.dumps(t["example"])), timeout=timeout)
                    try:
                        ok, text = future.result()
                    except BaseException as e:  # noqa: BLE001
                        ok, text = False, failed_call(e, t["name"], timeout)
                    if not ok:
                        problems.append(f"{_key(i)} ({t['name']}): on its example {json.dumps(t['example'])}: {text}")
            finally:
                pool.stop()
                pool.join(timeout=10)
        return problems, []

    def __init__(self, config: Any, tokenizer: Any, head: Any = None) -> None:
        self.rollout = dict(config.raw["rollout"])
        tools = definitions(self.rollout)
        self.parser = CallParser(self.rollout, tools, tokenizer.hf)
        super().__init__(config, tokenizer, head)
        self.tokenizer = tokenizer
        self.spec = RolloutSpec.of(config)
        extra: dict[str, Any] = {}
        if schema := structured_schema(self.rollout, tools):
            extra["structured_outputs"] = {"json": schema}
        if self.parser.keeps_special_tokens and "skip_special_tokens" not in config.sampling:
            extra["skip_special_tokens"] = False
        if extra:
            self.run_sampling = {**self.run_sampling, **extra}
            self.sampling = self.make_params(self.run_sampling)
        self.processes = self.rollout.get("tool_processes") or max(2, len(os.sched_getaffinity(0)))
        self.conversations: dict[int, Conversation] = {}

    def turns(self) -> Rollouts:
        return Rollouts(self)

    def finish(self, row: dict[str, Any], completion: Completion) -> tasks.Finished:
        conv = self.conversations.pop(completion.key)
        out = completion.output
        sample = self.sample(out.outputs[0], out.prompt_token_ids)
        (result,) = self.spec.rows(row, completion.key, completion.prompt_tokens, [sample])
        last = conv.messages[-1] if conv.messages[-1]["role"] == "assistant" else None
        result.update(generation=last["content"] if last else None,
                      finish_reason=conv.finish_reason or sample.finish_reason,
                      generated_tokens=conv.generated_tokens, messages=json.dumps(conv.messages, ensure_ascii=False),
                      turns=conv.turns, tool_calls=conv.tool_calls)  # fmt: skip
        return tasks.Finished([result], result["error"], conv.generated_tokens)


def resolve_paths(config: dict[str, Any], base: Path) -> None:
    """Each tool's ``path`` (top level and in each step's rollout) relative to the config file's directory."""
    for section in pycode.sections(config):
        rollout = section.get("rollout")
        for tool in (rollout.get("tools") or []) if isinstance(rollout, dict) else []:
            pycode.resolve_path(tool, base)


# A rollout section makes task: generate a rollout (config asks TASK_SECTIONS); its tools' paths are
# relative to the config file.
cfg.register_task_section("rollout", {tasks.GenerateTask.name: RolloutTask})
cfg.register_path_resolver(resolve_paths)
