"""A rollout's tools: their definitions (built in a worker process) and their calls, each in a worker
process of a pool (pebble), with a timeout; a failure is the text the model gets."""

from __future__ import annotations

import functools
import inspect
import json
import multiprocessing
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import pebble

from shardgen.base import pycode
from shardgen.data.outputs import repaired_text
from shardgen.errors import ConfigError

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
