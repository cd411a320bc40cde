"""Rollouts with tools on the real engine, in process (the session engine): each row a conversation
whose turns are constrained to tool calls (``tool_choice: required``), the tools run in worker
processes, one call raises and one hangs past its timeout; every conversation is valid OpenAI chat
format and each tool result is the tool's value for the call's arguments."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from pydantic import TypeAdapter

from shardgen.data.plan import write_manifest
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import base_config, make_rows, write_parquet

pytestmark = pytest.mark.engine

# A tool that records each call (a JSON line: its arguments and its number), and returns what the test
# recomputes; its second call raises and its fourth hangs past the rollout's timeout.
TOOLS = '''\
import fcntl
import json
import time

CALLS = {calls!r}
CAPITALS = {{"france": "Paris", "italy": "Rome", "norway": "Oslo"}}


def _record(**call):
    with open(CALLS, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = len(f.read().splitlines()) + 1
        f.write(json.dumps({{**call, "n": n}}) + "\\n")
    return n


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    n = _record(tool="add", a=a, b=b)
    if n == 2:
        raise ValueError("the second call fails")
    if n == 4:
        time.sleep(30)
    return a + b


def capital(country):
    n = _record(tool="capital", country=country)
    if n == 2:
        raise ValueError("the second call fails")
    if n == 4:
        time.sleep(30)
    return {{"capital": CAPITALS[country]}}
'''
CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string", "enum": ["france", "italy", "norway"]}},
    "required": ["country"],
}


def expected(call: dict) -> str:
    if call["tool"] == "add":
        return json.dumps(call["a"] + call["b"])
    capitals = {"france": "Paris", "italy": "Rome", "norway": "Oslo"}
    return json.dumps({"capital": capitals[call["country"]]})


def test_each_row_is_a_valid_conversation_of_tool_calls_and_their_results_up_to_max_turns(
    tmp_path, engine, monkeypatch
):
    from openai.types.chat import ChatCompletionMessageParam

    calls_file = tmp_path / "calls.jsonl"
    (tmp_path / "tools.py").write_text(TOOLS.format(calls=str(calls_file)))
    rows = 6
    data = write_parquet(tmp_path / "in.parquet", make_rows(rows))
    tools = [{"path": str(tmp_path / "tools.py"), "name": "add"},
             {"path": str(tmp_path / "tools.py"), "name": "capital", "schema": CAPITAL_SCHEMA}]  # fmt: skip
    # one call per turn (parallel_tool_calls false: the schema's maxItems 1), for a turn that fits max_tokens
    rollout = {"max_turns": 3, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
               "tool_timeout_seconds": 2, "tool_processes": 2}  # fmt: skip
    config = base_config(
        {"parquet": [str(data)], "id_column": "id"},
        output={"dir": str(tmp_path / "out")},
        shards={"rows_per_shard": rows},
        prompt={"template": "Use a tool: what is the capital of the country next to {{ topic }}, or {{ n }} + 2?"},
        sampling={"temperature": 0.0, "max_tokens": 96},
        rollout=rollout,
    )
    assert config.kind.__name__ == "RolloutTask"
    manifest = tmp_path / "manifest.json"
    write_manifest(config, manifest)
    out, stats_path = tmp_path / "00000.parquet", tmp_path / "00000.stats.json"
    run_shard(config, manifest, "00000", out, stats_path, JobContext(engine))

    table = pq.read_table(out)
    stats = json.loads(stats_path.read_text())
    calls = {c["n"]: c for c in map(json.loads, calls_file.read_text().splitlines())}
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)]
    validate = TypeAdapter(list[ChatCompletionMessageParam]).validate_python
    errors: list[str] = []
    seen = 0
    for row in table.to_pylist():
        assert row["error"] is None, row
        messages = json.loads(row["messages"])
        validate(messages)  # OpenAI's chat format, as the openai package types it
        assert [m["role"] for m in messages[:1]] == ["user"]
        turns, i = 0, 1
        while i < len(messages):  # each turn: an assistant's calls, then one result per call, in order
            assistant = messages[i]
            assert assistant["role"] == "assistant" and assistant.get("tool_calls"), messages
            turns += 1
            ids = [c["id"] for c in assistant["tool_calls"]]
            answers = messages[i + 1 : i + 1 + len(ids)]
            assert [(m["role"], m["tool_call_id"]) for m in answers] == [("tool", x) for x in ids], messages
            for call, answer in zip(assistant["tool_calls"], answers, strict=True):
                args = json.loads(call["function"]["arguments"])
                if answer["content"].startswith("Error: "):  # the tool's error, told to the model
                    errors.append(answer["content"])
                else:  # the tool's value for the call's arguments
                    assert answer["content"] == expected({"tool": call["function"]["name"], **args}), (call, answer)
                seen += 1
            i += 1 + len(ids)
        # every turn calls a tool (required), so each row runs to max_turns, and no further
        assert turns == row["turns"] == 3 and row["finish_reason"] == "max_turns", row
        assert row["tool_calls"] == sum(len(m.get("tool_calls") or []) for m in messages)
        assert row["generation"] is None  # the last assistant message is a call, with no text
    assert seen == len(calls) == stats["feed"]["rollout"]["tool_calls"], "every call ran once, and only those"
    assert sorted(errors)[0] == "Error: ValueError: the second call fails", errors
    assert len(errors) == 2 and " took more than 2 s (rollout.tool_timeout_seconds)" in sorted(errors)[1], errors
    rollout_stats = stats["feed"]["rollout"]
    assert rollout_stats["rows"] == rows and rollout_stats["turns"] == 3 * rows
    assert rollout_stats["tool_errors"] == 2 and rollout_stats["rows_at_max_turns"] == rows
    assert rollout_stats["engine_idle_on_tools_s"] >= 0 and rollout_stats["tool_seconds"] >= 2
    assert stats["generated_tokens"] == sum(table.column("generated_tokens").to_pylist())
    # the same rollout from Python (shardgen.generate, handed the session's engine as its kept one)
    import copy

    import shardgen
    from shardgen import api
    from shardgen import config as cfg

    raw = {k: copy.deepcopy(v) for k, v in config.raw.items() if k not in ("input", "output")}
    kept = (cfg.digest(raw["engine"]), engine)
    monkeypatch.setattr(api, "_engine", kept)  # (the session's: never closed by the test)
    again = shardgen.generate(make_rows(rows), raw, workdir=tmp_path / "work")
    assert api._engine == kept and again.column("id").to_pylist() == table.column("id").to_pylist()
    assert again.column("turns").to_pylist() == [3] * rows and set(again.column("finish_reason").to_pylist()) == {
        "max_turns"
    }
    monkeypatch.setattr(api, "_engine", None)


def test_the_rollout_benchmark_runs_both_sides_on_the_same_rows(tmp_path, engine):
    """bench/rollouts.py in its smoke size, on the session engine (the demo model): shardgen's rollout and
    a loop over LLM.generate that waits for each turn's calls, the same calls on both sides."""
    import importlib.util
    import sys

    from tests.conftest import ROOT, TEST_MODEL_CFG

    sys.path.insert(0, str(ROOT / "bench"))  # its `common`
    spec = importlib.util.spec_from_file_location("bench_rollouts", ROOT / "bench" / "rollouts.py")
    bench = sys.modules["bench_rollouts"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    size = bench.SIZES["smoke"]
    m = bench.measure(engine, dict(TEST_MODEL_CFG), tmp_path, size)
    assert m["turns"]["loop"] == m["turns"]["shardgen"] > 0
    assert m["tool_calls"]["loop"] == m["tool_calls"]["shardgen"] > 0
    assert m["loop_engine_idle_s"] >= size.rows / size.processes * 0.1, "the loop waits for every call of a turn"
    assert m["shardgen_seconds"] > 0 and m["speedup"] > 0
