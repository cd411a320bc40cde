"""The server engine's launch lines, requests and refusals, without a server (the real one:
tests/integration/test_server_engine.py)."""

from __future__ import annotations

import sys

import pytest

from shardgen.engines import server as se
from shardgen.engines.kinds import EngineSettings
from shardgen.errors import ConfigError
from tests.conftest import TEST_MODEL_CFG, base_config, make_rows, write_parquet

MODEL = {**TEST_MODEL_CFG, "tensor_parallel_size": 2, "max_num_seqs": 32, "gpu_memory_utilization": 0.85}


def command(preset: str, **server) -> list[str]:
    kwargs = EngineSettings(model={**MODEL, "enable_chunked_prefill": False}).kwargs
    return se.launch_command({"preset": preset, **server}, kwargs, 8123, "KEY")


def after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_vllm_preset_runs_vllms_server_module_on_loopback_with_every_engine_argument_and_no_key_in_argv():
    cmd = command("vllm")
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert after(cmd, "--host") == "127.0.0.1" and after(cmd, "--port") == "8123"
    assert after(cmd, "--model") == MODEL["model"] and after(cmd, "--max-model-len") == "1024"
    assert after(cmd, "--tensor-parallel-size") == "2" and after(cmd, "--max-num-seqs") == "32"
    assert after(cmd, "--kv-cache-memory-bytes") == str(128 * 2**20) and after(cmd, "--dtype") == "float32"
    assert "--enforce-eager" in cmd and "--no-enable-chunked-prefill" in cmd, "booleans as vLLM's CLI spells them"
    assert "--disable-uvicorn-access-log" in cmd, "no log line per request"
    assert "KEY" not in " ".join(cmd), "the key goes in the server's environment (VLLM_API_KEY), not its argv"


def test_the_vllm_preset_serves_the_runs_lora_adapters_by_name_as_vllms_own_parser_reads_them():
    import argparse

    from vllm.entrypoints.launchers.cli_args import LoRAParserAction

    adapters = {"tuned": "/models/a,b", "other": "/models/o"}  # a comma: vLLM reads name=path only without one
    cmd = se.launch_command({"preset": "vllm"}, {"model": "m", "enable_lora": True}, 1, "k", adapters)
    assert "--enable-lora" in cmd
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-modules", nargs="+", action=LoRAParserAction)
    given = cmd[cmd.index("--lora-modules") + 1 :]
    served = parser.parse_args(["--lora-modules", *given]).lora_modules
    assert {(m.name, m.path) for m in served} == set(adapters.items())
    assert "--lora-modules" not in command("vllm"), "none without adapters"


def test_each_other_preset_builds_its_documented_launch_line():
    sglang = command("sglang")
    assert sglang[1:3] == ["-m", "sglang.launch_server"] and after(sglang, "--model-path") == MODEL["model"]
    assert after(sglang, "--host") == "127.0.0.1" and after(sglang, "--tp-size") == "2"
    assert after(sglang, "--context-length") == "1024" and after(sglang, "--mem-fraction-static") == "0.85"
    assert after(sglang, "--max-running-requests") == "32" and after(sglang, "--api-key") == "KEY"
    trtllm = command("trtllm")
    assert trtllm[:3] == ["trtllm-serve", "serve", MODEL["model"]] and after(trtllm, "--host") == "127.0.0.1"
    assert after(trtllm, "--tp_size") == "2" and after(trtllm, "--max_seq_len") == "1024"
    assert after(trtllm, "--kv_cache_free_gpu_memory_fraction") == "0.85" and after(trtllm, "--max_batch_size") == "32"
    lmdeploy = command("lmdeploy")
    assert lmdeploy[:4] == ["lmdeploy", "serve", "api_server", MODEL["model"]]
    assert after(lmdeploy, "--server-name") == "127.0.0.1" and after(lmdeploy, "--server-port") == "8123"
    assert after(lmdeploy, "--tp") == "2" and after(lmdeploy, "--session-len") == "1024"
    assert after(lmdeploy, "--cache-max-entry-count") == "0.85" and after(lmdeploy, "--api-keys") == "KEY"


def test_a_command_of_ones_own_gets_the_model_host_port_and_key_filled_in_and_is_split_not_shelled():
    cmd = command("vllm", command="my-server --weights {model} --bind {host}:{port} --token {api_key} ';ls'")
    assert cmd == ["my-server", "--weights", MODEL["model"], "--bind", "127.0.0.1:8123", "--token", "KEY", ";ls"]
    listed = se.launch_command({"command": ["srv", "{port}", '{"a": {"b": 1}}']}, {"model": "m"}, 9, "k")
    assert listed == ["srv", "9", '{"a": {"b": 1}}'], "other braces kept (a JSON argument)"


def test_a_request_carries_the_prompts_token_ids_and_its_sampling_under_vllms_names():
    params = se.ServerEngine.sampling_params(
        {
            "max_tokens": 12,
            "temperature": 0.5,
            "top_k": 20,
            "n": 2,
            "stop": ["\n\n"],
            "ignore_eos": True,
            "structured_outputs": {"choice": ["yes", "no"]},
        }
    )
    params.seed = 7
    body = se.completion_body("m", [1, 2, 3], params)
    assert body["model"] == "m" and body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["n"], body["seed"]) == (12, 0.5, 20, 2, 7)
    assert body["stop"] == ["\n\n"] and body["ignore_eos"] is True
    assert body["structured_outputs"] == {"choice": ["yes", "no"]}


def plan_config(tmp_path, **overrides):
    data = write_parquet(tmp_path / "in.parquet", make_rows(4))
    return base_config({"parquet": [str(data)]}, **overrides)


@pytest.mark.parametrize(
    ("preset", "overrides", "named"),
    [
        ("vllm", {"task": "embed", "sampling": {}}, "task: embed"),
        ("vllm", {"sampling": {"max_tokens": 4, "reasoning_parser": "deepseek_r1"}}, "sampling.reasoning_parser"),
        ("sglang", {"sampling": {"max_tokens": 4, "logprobs": 2}}, "sampling.logprobs on preset sglang"),
        ("trtllm", {"lora": {"adapters": {"tuned": "/a"}, "column": "adapter"}}, "lora.adapters on preset trtllm"),
        ("lmdeploy", {"output": {"choice_probs": True}, "sampling": {"structured_outputs": {"choice": ["a", "b"]}}},
         "sampling.structured_outputs on preset lmdeploy .*, output.choice_probs on preset lmdeploy"),
    ],
)  # fmt: skip
def test_what_a_server_does_not_serve_yet_is_refused_when_the_run_plans_naming_the_key(
    tmp_path, preset, overrides, named
):
    with pytest.raises(ConfigError, match=f"engine.kind: server does not serve {named}"):
        plan_config(tmp_path, engine={"kind": "server", "server": {"preset": preset}}, **overrides)


def test_vllms_server_is_asked_for_log_probabilities_by_token_id_and_its_answer_read_as_vllms_own():
    params = se.ServerEngine.sampling_params({"max_tokens": 2, "logprobs": 1})
    body = se.completion_body("m", [1], params)
    assert (body["logprobs"], body["return_tokens_as_token_ids"]) == (1, True) and "logprob_token_ids" not in body
    labels = se.completion_body("m", [1], se.ServerEngine.sampling_params({"max_tokens": 1}, [5, 6]))
    assert (labels["logprob_token_ids"], labels["logprobs"], labels["return_tokens_as_token_ids"]) == ([5, 6], 0, True)
    answer = {"top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.5}, {"token_id:9": -9999.0}]}
    positions = se.position_logprobs(answer, lambda t: f"<{t}>")
    assert [list(p) for p in positions] == [[7, 3], [9]]
    assert (positions[0][3].logprob, positions[0][3].decoded_token, positions[0][3].rank) == (-2.5, "<3>", None)
    assert se.position_logprobs(None, str) is None
    with pytest.raises(se.TokensByText, match="by text"):
        se.position_logprobs({"top_logprobs": [{" the": -0.1}]}, str)


def test_a_server_is_one_of_preset_command_or_url_and_its_key_comes_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="needs one of engine.server.preset"):
        plan_config(tmp_path, engine={"kind": "server", "server": {}})
    with pytest.raises(ConfigError, match="needs one of engine.server.preset"):
        plan_config(tmp_path, engine={"kind": "server", "server": {"preset": "vllm", "url": "http://h:1"}})
    with pytest.raises(ConfigError, match="api_key_env is for engine.server.url"):
        plan_config(tmp_path, engine={"kind": "server", "server": {"preset": "vllm", "api_key_env": "K"}})
    with pytest.raises(ConfigError, match="engine.server is set, but engine.kind is vllm"):
        plan_config(tmp_path, engine={"server": {"url": "http://h:1"}})
    with pytest.raises(Exception, match="api_key"):  # the schema: a key itself is no variable's name
        plan_config(tmp_path, engine={"kind": "server", "server": {"url": "http://h:1", "api_key_env": "sk-1 2"}})
    url = plan_config(tmp_path, engine={"kind": "server", "server": {"url": "http://h:1", "api_key_env": "MY_KEY"}})
    preset = plan_config(tmp_path, engine={"kind": "server", "server": {"preset": "vllm"}})
    assert (
        url.fingerprint
        == plan_config(tmp_path, engine={"kind": "server", "server": {"url": "http://other:2"}}).fingerprint
    )
    assert len({url.fingerprint, preset.fingerprint, plan_config(tmp_path).fingerprint}) == 3, (
        "a server's rows are not the in-process engine's, nor another server's"
    )
