"""Rollouts with tools (``rollout``, shardgen.features.rollouts), the parts without an engine: which kind a
rollout makes of a task, the config's refusals, the tools' schemas from their signatures, a turn's
calls as vLLM's parsers find them, a call in a worker process, the fingerprint of the tools' code.
(On the real engine: tests/integration/test_rollouts_engine.py; through the Slurm profile:
tests/integration/test_workflow.py, the rollout test.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from shardgen import config as cfg
from shardgen.config import RunConfig, content_fingerprint, validate
from shardgen.errors import ConfigError
from shardgen.features import rollouts, steps
from tests.conftest import MODEL, TEST_MODEL_CFG

TOOLS = """\
import time


def add(a: int, b: int = 2) -> int:
    \"\"\"Add two integers.

    Args:
        a: the first integer
        b: the second integer
    \"\"\"
    return a + b


def undocumented(a: int):
    return a


def fails(x):
    raise KeyError("no such thing")


def slow(x):
    time.sleep(30)


def table(x):
    return {"x": x, "items": [1, 2]}
"""


def rollout_config(tmp_path: Path, **rollout: Any) -> dict[str, Any]:
    (tmp_path / "tools.py").write_text(TOOLS)
    spec = {"tools": [{"path": "tools.py", "name": "add"}], "tool_choice": "required"} | rollout
    raw = {"input": {"parquet": [str(tmp_path / "in.parquet")]}, "model": dict(TEST_MODEL_CFG),
           "prompt": {"template": "{{ q }}"}, "rollout": spec,
           "output": {"dir": str(tmp_path / "results")}}  # fmt: skip
    return cfg.resolve_paths(raw, tmp_path)


def test_a_rollout_section_makes_a_generate_task_a_rollout_and_refuses_other_tasks(tmp_path):
    config = RunConfig.from_dict(rollout_config(tmp_path))
    assert config.kind is rollouts.task.RolloutTask
    assert config.raw["rollout"]["max_turns"] == 4 and config.raw["rollout"]["tool_timeout_seconds"] == 10
    assert config.raw["rollout"]["tools"][0]["path"] == str(tmp_path / "tools.py"), "relative to the config file"
    names = [f.name for f in config.kind.columns(config).fields()]
    assert names[-5:] == ["messages", "turns", "tool_calls", "error", "result_source"]
    with pytest.raises(ConfigError, match="rollout is set, but task is classify: rollout is for task: generate"):
        validate({**rollout_config(tmp_path), "task": "classify"})


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"rollout": {"tool_choice": "auto"}}, "rollout.tool_parser: tool_choice auto finds the calls"),
        ({"rollout": {"tool_choice": "calculator"}}, "'calculator' is none of auto, required, none and no tool's"),
        ({"rollout": {"tools": [{"path": "tools.py", "name": "add"}] * 2}}, "two tools named 'add'"),
        ({"rollout": {"tools": [{"path": "nowhere.py", "name": "add"}]}}, "rollout.tools[0].path: cannot read"),
        ({"prompt": {"template": "{{ q }}", "chat": False}}, "a conversation needs prompt.chat true"),
        ({"sampling": {"n": 2}}, "sampling.n must be 1"),
        ({"sampling": {"structured_outputs": {"choice": ["a", "b"]}}}, "drop sampling.structured_outputs"),
    ],
)
def test_a_rollout_that_cannot_run_is_refused_naming_the_key(tmp_path, change, said):
    raw = rollout_config(tmp_path)
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as e:
        validate(raw)
    assert said in str(e.value)


def test_in_a_run_of_steps_the_rollout_is_a_step_s_own(tmp_path):
    raw = rollout_config(tmp_path)
    rollout = raw.pop("rollout")
    raw["steps"] = [{"name": "solve", "rollout": rollout}, {"name": "again"}]
    solve, again = steps.step_configs(validate(raw))
    assert solve["rollout"]["tools"][0]["name"] == "add" and "rollout" not in again
    with pytest.raises(ConfigError, match=r"in a run of steps, it goes in the step that runs conversations"):
        steps.step_configs(validate({**raw, "rollout": rollout}))


def test_the_tools_code_is_in_the_fingerprint_and_their_paths_are_not(tmp_path):
    raw = rollout_config(tmp_path)
    first = content_fingerprint(validate(raw))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    elsewhere = {**rollout_config(moved), "input": raw["input"]}
    assert content_fingerprint(validate(elsewhere)) == first, "the same code elsewhere"
    (moved / "tools.py").write_text(TOOLS + "\n# edited\n")
    assert content_fingerprint(validate(elsewhere)) != first, "an edited tool reruns the shards"
    assert content_fingerprint(validate(rollout_config(tmp_path, max_turns=2))) != first
    example = rollout_config(tmp_path, tools=[{"path": "tools.py", "name": "add", "example": {"a": 1}}])
    assert content_fingerprint(validate(example)) == first, "the preflight's example call reruns nothing"


def test_a_tool_s_schema_comes_from_its_signature_and_docstring_unless_given(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    path = str(tmp_path / "tools.py")
    (made,) = rollouts.tools.definitions({"tools": [{"path": path, "name": "add"}]})
    assert made["function"]["name"] == "add" and made["function"]["description"] == "Add two integers."
    assert made["function"]["parameters"]["required"] == ["a"]
    assert made["function"]["parameters"]["properties"]["b"] == {"type": "integer", "description": "the second integer"}
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\] \(undocumented, .*tools.py, line 14\): no JSON schema"):
        rollouts.tools.definitions({"tools": [{"path": path, "name": "undocumented"}]})
    given = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    (ok,) = rollouts.tools.definitions({"tools": [{"path": path, "name": "fails", "schema": given}]})
    assert ok["function"]["parameters"] == given
    wrong = {"type": "object", "properties": {"y": {"type": "string"}}}
    with pytest.raises(ConfigError, match=r"the schema has \['y'\], which fails\(\) does not take"):
        rollouts.tools.definitions({"tools": [{"path": path, "name": "fails", "schema": wrong}]})


def test_the_tools_are_imported_in_a_worker_process_not_in_the_job_s_own(tmp_path):
    # a tool module that loads a large index as it is imported must not hold it in the job's process too
    imported = tmp_path / "imported"
    (tmp_path / "tools.py").write_text(f"import os\nopen({str(imported)!r}, 'a').write(f'{{os.getpid()}}\\n')\n{TOOLS}")
    (made,) = rollouts.tools.definitions({"tools": [{"path": str(tmp_path / "tools.py"), "name": "add"}]})
    assert made["function"]["name"] == "add"
    (pid,) = imported.read_text().split()
    assert int(pid) != os.getpid()


def test_a_turn_s_calls_are_found_as_vllm_s_server_finds_them():
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "add", "description": "",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    required = rollouts.calls.CallParser({"tool_choice": "required"}, tools, None)
    assert required.calls('[{"name": "add", "parameters": {"a": 1}}]') == (None, [("add", '{"a": 1}')])
    assert required.calls('[{"name": "add", "parame') == ('[{"name": "add", "parame', []), "cut: no call"
    named = rollouts.calls.CallParser({"tool_choice": "add"}, tools, None)
    assert named.calls('{"a": 1}') == (None, [("add", '{"a": 1}')])
    hermes = rollouts.calls.CallParser(
        {"tool_choice": "auto", "tool_parser": "hermes"}, tools, AutoTokenizer.from_pretrained(MODEL)
    )
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert hermes.calls(text) == ("Let me add. ", [("add", '{"a": 1}')]) and hermes.keeps_special_tokens
    assert hermes.calls("Three.") == ("Three.", [])
    schema = rollouts.calls.structured_schema({"tool_choice": "required"}, tools)
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["add"]
    assert rollouts.calls.structured_schema({"tool_choice": "auto"}, tools) is None


def test_a_call_s_failure_is_the_text_the_model_gets(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    names = ("add", "fails", "slow", "table")
    spec = {"tools": [{"path": str(tmp_path / "tools.py"), "name": n} for n in names], "tool_timeout_seconds": 1}
    pool = rollouts.tools.tool_pool(spec, 2)
    try:

        def call(name: str, args: str) -> tuple[bool, str]:
            future = pool.schedule(rollouts.tools._call_tool, args=(name, args), timeout=1)
            try:
                return future.result()
            except BaseException as e:  # noqa: BLE001
                return False, rollouts.tools.failed_call(e, name, 1)

        assert call("add", '{"a": 40}') == (True, "42")
        assert call("table", '{"x": "y"}') == (True, json.dumps({"x": "y", "items": [1, 2]}))
        assert call("fails", '{"x": 1}') == (False, "Error: KeyError: 'no such thing'")
        assert call("slow", '{"x": 1}') == (
            False,
            "Error: the tool slow took more than 1 s (rollout.tool_timeout_seconds); stopped",
        )
        assert call("add", '{"a": 1}') == (True, "3"), "the hung call's process was replaced"
        assert call("nope", "{}")[1].startswith("Error: no tool named 'nope'; the tools are add, fails, slow, table")
        assert call("add", "{not json")[1].startswith("Error: the arguments are not JSON")
        assert call("add", '{"c": 1}')[1].startswith("Error: TypeError: add() got an unexpected keyword argument")
    finally:
        pool.stop()
        pool.join()


def test_the_conversation_goes_to_the_chat_template_with_arguments_as_dicts():
    messages = [{"role": "user", "content": "Add 1."},
                {"role": "assistant", "content": None, "reasoning": "I should add.", "tool_calls": [
                    {"id": "call_0_1_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_0_1_0", "content": "3"}]  # fmt: skip
    shown = rollouts.calls.template_messages(messages)
    assert shown[1]["content"] == "" and shown[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert "reasoning" not in shown[1] and messages[1]["content"] is None, "the conversation itself unchanged"


def test_the_example_s_calculator_has_a_schema_from_its_docstring_and_computes_only_arithmetic():
    from tests.conftest import ROOT

    spec = {"path": str(ROOT / "config" / "examples" / "calculator.py"), "name": "calculator"}
    (made,) = rollouts.tools.definitions({"tools": [spec]})
    assert made["function"]["parameters"]["required"] == ["expression"]
    rollouts.tools._init_tools([spec])
    assert rollouts.tools._call_tool("calculator", json.dumps({"expression": "(3 + 4) * 12 / 5"})) == (True, "16.8")
    ok, said = rollouts.tools._call_tool("calculator", json.dumps({"expression": "__import__('os').getcwd()"}))
    assert not ok and said.startswith("Error: ValueError: not arithmetic")


def test_a_rollout_s_openai_batch_response_is_its_last_assistant_message():
    from openai.types.chat import ChatCompletion

    from shardgen.features.openai_batch.results_out import result_line

    call = {"id": "call_0_2_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0_2_0", "content": "3"}]  # fmt: skip
    row = {"row_index": 0, "custom_id": "q0", "generation": None, "finish_reason": "max_turns", "prompt_tokens": 9,
           "generated_tokens": 12, "error": None, "messages": json.dumps(messages), "turns": 2, "tool_calls": 2,
           "url": "/v1/chat/completions"}  # fmt: skip
    body = result_line([row], "generate", "m", 0, "custom_id")["response"]["body"]
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].id == "call_0_2_0"
    answered = [*messages, {"role": "assistant", "content": "It is 3."}]
    row = {**row, "generation": "It is 3.", "finish_reason": "stop", "messages": json.dumps(answered)}
    body = result_line([row], "generate", "m", 0, "custom_id")["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "It is 3." and body["usage"]["completion_tokens"] == 12
