"""Multi-turn rollouts with tools (``rollout``): each row is a conversation the model carries on,
calling Python tools.

A row starts as its prompt (``prompt``, a chat). When a turn ends with tool calls (parsed by the
named vLLM tool parser, ``rollout.tool_parser``; with ``tool_choice: required`` or a tool's name, the
turn is constrained to a valid call by vLLM's structured outputs, the JSON schema vLLM's own server
uses: ``vllm/tool_parsers/utils.py: get_json_schema_from_tools``), the tools run in worker processes
(pebble's ``ProcessPool``, as Python steps' functions do: a call past ``tool_timeout_seconds`` has its
process replaced), their results are appended, and the row's next turn goes to the engine at once,
while the engine goes on with the other rows (``feed.Turns``: the feeder asks between engine steps).
A tool that raises, hangs or dies gives the model an error message, not the row an error. A row ends
with a turn that calls no tool, or after ``max_turns`` turns (``finish_reason: max_turns``; the last
turn's calls are run, so that every call in ``messages`` has its result).

Columns: ``messages`` (the whole conversation in OpenAI's chat format, JSON text), ``turns`` and
``tool_calls``; ``generation`` is the last assistant message's text, and the token counts are summed
over the turns. With a reasoning parser each assistant message keeps its turn's trace in
``reasoning``.

Exactly once: a finished conversation is checkpointed as its row is; a conversation that was not
finished when its job died starts again from its first turn in the next attempt. Its turns are not
saved one by one: a tool may have side effects or depend on the time, so the only conversation
that is known whole is a finished one (a seeded row asks the same first turn again).

The tools' files (or modules' versions) are in the run's fingerprint; the preflight imports each on
the login node, builds its JSON schema from its signature and docstring (``transformers``'
``get_json_schema``, unless the config gives ``schema``), and runs it once on ``example``
arguments where the config gives them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pebble
import pyarrow as pa

from shardgen import config as cfg
from shardgen import pycode, tasks
from shardgen.errors import ConfigError, RowError
from shardgen.feed import Request
from shardgen.outputs import repaired_text
from shardgen.results import Completion, ResultSpec

log = logging.getLogger(__name__)

# rollout.tool_choice besides a tool's name
TOOL_CHOICES = ("auto", "required", "none")
FINISH_MAX_TURNS = "max_turns"
ERROR_PREFIX = "Error: "  # what a tool's failure reads like to the model
# The longest the tools' import and definitions may take in their worker process (``definitions``).
IMPORT_SECONDS = 300


# -- The tools -----------------------------------------------------------------------------------------


def _key(i: int) -> str:
    return f"rollout.tools[{i}]"


def tool_names(rollout: Mapping[str, Any]) -> list[str]:
    return [t["name"] for t in rollout["tools"]]


def tool_digests(rollout: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What identifies each tool's code (``pycode.digest``), in order.

    Raises:
        ConfigError: a tool's file or module is not there.
    """
    return [{"name": t["name"], **pycode.digest(t, _key(i))} for i, t in enumerate(rollout["tools"])]


def definition(spec: Mapping[str, Any], fn: Callable[..., Any], key: str) -> dict[str, Any]:
    """The tool's OpenAI definition (``{"type": "function", "function": {...}}``): its JSON schema from
    ``spec["schema"]`` or else from its signature and docstring (``transformers``' ``get_json_schema``:
    every argument typed and described in an ``Args:`` section).

    Raises:
        ConfigError: naming the tool: no schema can be made, or the schema and the signature disagree.
    """
    name = spec["name"]
    where = f"{spec.get('path') or spec.get('module')}, line {pycode.line_of(fn)}"
    doc = inspect.getdoc(fn) or ""
    if spec.get("schema") is not None:
        parameters = dict(spec["schema"])
        description = doc.split("\n\n")[0].strip()
    else:
        from transformers.utils import get_json_schema

        try:
            made = get_json_schema(fn)["function"]
        except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(
                f"{key} ({name}, {where}): no JSON schema from its signature and docstring: {pycode.first_line(e)} "
                f"(type every argument and describe it under 'Args:', or give {key}.schema)"
            ) from None
        parameters, description = made["parameters"], made.get("description", "")
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # a builtin: taken as it is
        params = {}
    if params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if unknown := sorted(set(parameters.get("properties") or {}) - set(params)):
            raise ConfigError(f"{key} ({name}, {where}): the schema has {unknown}, which {name}() does not take")
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [n for n, p in params.items() if p.default is p.empty and p.kind in named]
    if missing := sorted(set(needed) - set(parameters.get("properties") or {})):
        raise ConfigError(f"{key} ({name}, {where}): {name}() needs {missing}, which its schema does not give")
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def load_tools(rollout: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
    """Each tool, imported here (its module's code runs), by name.

    Raises:
        ConfigError: naming the tool that does not import.
    """
    return {t["name"]: pycode.load(t, _key(i)) for i, t in enumerate(rollout["tools"])}


def _definitions_here(tools: list[dict[str, Any]]) -> tuple[str, ...]:
    loaded = load_tools({"tools": tools})
    return tuple(json.dumps(definition(t, loaded[t["name"]], _key(i))) for i, t in enumerate(tools))


@functools.lru_cache(maxsize=8)
def _definitions(tools_json: str, digests: str) -> tuple[str, ...]:
    # the tools are imported in a worker process, as where they run: a tool module that loads a large
    # index as it is imported must not hold it in the job's own process too
    tools = json.loads(tools_json)
    pool = pebble.ProcessPool(max_workers=1, context=multiprocessing.get_context("forkserver"))
    try:
        return pool.schedule(_definitions_here, args=(tools,), timeout=IMPORT_SECONDS).result()
    except FutureTimeout:
        names = ", ".join(t["name"] for t in tools)
        raise ConfigError(f"rollout.tools ({names}): not imported within {IMPORT_SECONDS} s") from None
    except pebble.ProcessExpired as e:
        raise ConfigError(f"rollout.tools: a tool's import ended its process (exit code {e.exitcode})") from None
    finally:
        pool.stop()
        pool.join(timeout=10)


def definitions(rollout: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tools' OpenAI definitions (``definition``), made once per process for the same code, in a
    worker process (the tools' modules are not imported here).

    Raises:
        ConfigError: a tool does not import or has no schema, naming it.
    """
    tools = list(rollout["tools"])
    digests = json.dumps(tool_digests(rollout), sort_keys=True)
    return [json.loads(d) for d in _definitions(json.dumps(tools, sort_keys=True), digests)]


# -- In the tools' worker processes -----------------------------------------------------------------------

_TOOLS: dict[str, Callable[..., Any]] = {}


def _init_tools(tools: list[dict[str, Any]]) -> None:
    global _TOOLS
    _TOOLS = load_tools({"tools": tools})


def _call_tool(name: str, arguments: str, max_chars: int | None = None) -> tuple[bool, str]:
    """In a worker: ``(ok, the text the model gets)`` of one call; a failure is the text of its error.

    The text goes to the model before it is a column: a result longer than ``max_chars`` (more than the
    context can hold: ``Tokenizer.max_prompt_chars``) is left out for an error the model reads, without
    sending it back or tokenizing it; text that is not valid Unicode (a lone surrogate, half an emoji)
    is repaired as vLLM's detokenizer repairs bytes it cannot decode (U+FFFD), since neither the
    tokenizer nor the output can take it.
    """
    ok, text = _run_tool(name, arguments)
    if max_chars is not None and len(text) > max_chars:
        return False, (f"{ERROR_PREFIX}the tool {name} returned {len(text)} characters, more than the context "
                       f"can hold ({max_chars}); its result is left out")  # fmt: skip
    return ok, repaired_text(text)


def _run_tool(name: str, arguments: str) -> tuple[bool, str]:
    fn = _TOOLS.get(name)
    if fn is None:
        return False, f"{ERROR_PREFIX}no tool named {name!r}; the tools are {', '.join(sorted(_TOOLS))}"
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError as e:
        return False, f"{ERROR_PREFIX}the arguments are not JSON: {e}"
    if not isinstance(args, dict):
        return False, f"{ERROR_PREFIX}the arguments must be a JSON object, not {type(args).__name__}"
    try:
        out = fn(**args)
    except Exception as e:  # noqa: BLE001 - the model gets the tool's error
        return False, f"{ERROR_PREFIX}{type(e).__name__}: {pycode.first_line(e)}"
    if isinstance(out, str):
        return True, out
    try:
        return True, json.dumps(out, ensure_ascii=False, default=str)
    except (TypeError, ValueError) as e:
        return False, f"{ERROR_PREFIX}the tool returned a {type(out).__name__} that is not JSON: {e}"


def tool_pool(rollout: Mapping[str, Any], processes: int) -> pebble.ProcessPool:
    """Worker processes with the tools loaded. ``forkserver``: the job's process runs the engine's
    threads, which a fork would copy mid-lock; a process replaced after a timeout is forked from a
    clean server."""
    return pebble.ProcessPool(max_workers=processes, initializer=_init_tools, initargs=(list(rollout["tools"]),),
                              context=multiprocessing.get_context("forkserver"))  # fmt: skip


def failed_call(e: BaseException, name: str, timeout: float) -> str:
    """The text the model gets for a call that did not return."""
    if isinstance(e, FutureTimeout):
        return f"{ERROR_PREFIX}the tool {name} took more than {timeout:g} s (rollout.tool_timeout_seconds); stopped"
    if isinstance(e, pebble.ProcessExpired):
        return f"{ERROR_PREFIX}the tool {name} ended its process (exit code {e.exitcode})"
    return f"{ERROR_PREFIX}{type(e).__name__}: {pycode.first_line(e)}"


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


# -- The conversations of a shard ------------------------------------------------------------------------


@dataclass
class Conversation:
    """One row's conversation while it runs."""

    messages: list[dict[str, Any]]
    started: float
    turns: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    finish_reason: str | None = None
    last: Completion | None = None  # the last turn's
    request: Request | None = None  # the last turn's
    results: list[str | None] = field(default_factory=list)  # this turn's calls' results
    pending: int = 0  # this turn's calls still running


class Rollouts:
    """A shard's conversations (``feed.Turns``): tool calls run in ``tool_pool``, each result comes back
    through a queue (pebble's done callbacks run in its own thread), and the feeder asks for the next
    turns between engine steps."""

    def __init__(self, task: RolloutTask) -> None:
        self.task = task
        self.rollout = task.rollout
        self.timeout = float(self.rollout["tool_timeout_seconds"])
        self.pool = tool_pool(self.rollout, task.processes)
        self.max_chars = task.tokenizer.max_prompt_chars
        self._done: queue.Queue = queue.Queue()
        self._early: list[tuple[int, int, str, Future, float]] = []
        self._waiting = 0
        self.counts = {"rows": 0, "turns": 0, "tool_calls": 0, "tool_errors": 0, "rows_at_max_turns": 0}
        self.tool_seconds = 0.0

    # -- feed.Turns --

    def ended(self, req: Request, c: Completion) -> Completion | None:
        convs = self.task.conversations
        conv = convs.get(c.key)
        if conv is None:
            messages = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": str(req.prompt)}]
            conv = convs[c.key] = Conversation([dict(m) for m in messages], started=req.submitted or time.time())
        conv.turns += 1
        conv.prompt_tokens += c.prompt_tokens
        conv.cached_tokens += c.cached_tokens
        conv.last, conv.request = c, req
        self.counts["turns"] += 1
        if conv.ttft_s is None:
            conv.ttft_s = c.ttft_s
        if c.error is not None:
            convs.pop(c.key)
            return self._summed(conv, c)
        out = c.output.outputs[0]
        conv.generated_tokens += len(out.token_ids)
        sample = self.task.sample(out, c.output.prompt_token_ids)
        content, calls = self.task.parser.calls(sample.text or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if sample.reasoning is not None:
            message["reasoning"] = sample.reasoning
        if calls:
            message["tool_calls"] = [{"id": f"call_{c.key}_{conv.turns}_{i}", "type": "function",
                                      "function": {"name": name, "arguments": args}}
                                     for i, (name, args) in enumerate(calls)]  # fmt: skip
        conv.messages.append(message)
        if not calls:
            return self._summed(conv, c)
        if conv.turns >= self.rollout["max_turns"]:
            conv.finish_reason = FINISH_MAX_TURNS  # its calls run, then it ends
        conv.tool_calls += len(calls)
        conv.results, conv.pending = [None] * len(calls), len(calls)
        self._waiting += 1
        for i, (name, args) in enumerate(calls):
            future = self.pool.schedule(_call_tool, args=(name, args, self.max_chars), timeout=self.timeout)
            future.add_done_callback(functools.partial(self._returned, c.key, i, name, time.monotonic()))
        return None

    def ready(self) -> tuple[list[Request], list[Completion]]:
        returned = self._early
        self._early = []
        while True:
            try:
                returned.append(self._done.get_nowait())
            except queue.Empty:
                break
        nexts: list[Request] = []
        ended: list[Completion] = []
        going: list[tuple[int, Conversation]] = []  # whose tools all returned, for their next turn
        for key, i, name, future, started in returned:
            conv = self.task.conversations[key]
            self.tool_seconds += time.monotonic() - started
            try:
                ok, text = future.result()
            except BaseException as e:  # noqa: BLE001 - its timeout, its process dying
                ok, text = False, failed_call(e, name, self.timeout)
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += not ok
            conv.results[i] = text
            conv.pending -= 1
            if conv.pending:
                continue
            self._waiting -= 1
            calls = conv.messages[-1]["tool_calls"]
            conv.messages += [{"role": "tool", "tool_call_id": call["id"], "content": result}
                              for call, result in zip(calls, conv.results, strict=True)]  # fmt: skip
            if conv.finish_reason == FINISH_MAX_TURNS:
                ended.append(self._summed(conv, conv.last))  # type: ignore[arg-type]
            else:
                going.append((key, conv))
        # the next turns' prompts: one call of the chat template and the tokenizer for all of them
        prompts = self.task.tokenizer.encode_batch([template_messages(conv.messages) for _, conv in going])
        for (key, conv), ids in zip(going, prompts, strict=True):
            prev = conv.request
            assert prev is not None
            if isinstance(ids, RowError):  # the conversation outgrew the context
                self.task.conversations.pop(key)
                ended.append(self._summed(conv, dataclasses.replace(conv.last, error=ids)))  # type: ignore[arg-type]
                continue
            nexts.append(Request(key, ids, prev.params, prev.row, lora=prev.lora, turn=conv.turns))
        return nexts, ended

    def waiting(self) -> int:
        return self._waiting

    def wait(self, seconds: float) -> None:
        try:
            self._early.append(self._done.get(timeout=seconds))
        except queue.Empty:
            pass

    def stats(self) -> dict[str, Any]:
        n = self.counts
        return {**n, "turns_per_row": round(n["turns"] / n["rows"], 3) if n["rows"] else None,
                "tool_seconds": round(self.tool_seconds, 3), "tool_processes": self.task.processes}  # fmt: skip

    def close(self) -> None:
        self.pool.stop()  # the calls still running: their rows are the next attempt's
        self.pool.join(timeout=10)

    # --

    def _returned(self, key: int, i: int, name: str, started: float, future: Future) -> None:
        self._done.put((key, i, name, future, started))

    def _summed(self, conv: Conversation, c: Completion) -> Completion:
        """The row's completion: its last turn's, with the tokens of every turn and the latency of all."""
        self.counts["rows"] += 1
        self.counts["rows_at_max_turns"] += conv.finish_reason == FINISH_MAX_TURNS
        return dataclasses.replace(c, prompt_tokens=conv.prompt_tokens, cached_tokens=conv.cached_tokens,
                                   ttft_s=conv.ttft_s, latency_s=time.time() - conv.started)  # fmt: skip


# -- The task --------------------------------------------------------------------------------------------


class RolloutSpec(ResultSpec):
    """A rollout's columns: a generation's, and ``messages``, ``turns``, ``tool_calls`` before ``error``."""

    def fields(self) -> list[pa.Field]:
        out = super().fields()
        extra = [pa.field("messages", pa.string()), pa.field("turns", pa.int32()), pa.field("tool_calls", pa.int32())]
        return [*out[:-1], *extra, out[-1]]


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
