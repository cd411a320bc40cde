"""The conversations of a shard: each row's turns, its tools' calls between the engine's steps
(``feed.Turns``), and its end."""

from __future__ import annotations

import dataclasses
import functools
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardgen.errors import RowError
from shardgen.features.rollouts.calls import template_messages
from shardgen.features.rollouts.tools import _call_tool, failed_call, tool_pool
from shardgen.jobs.feed.requests import Request
from shardgen.requests.results import Completion

if TYPE_CHECKING:
    from shardgen.features.rollouts.task import RolloutTask


FINISH_MAX_TURNS = "max_turns"


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
