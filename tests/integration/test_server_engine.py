"""The server engine (engine.kind: server) against vLLM's own OpenAI-compatible server from the same CPU
build: a run through the Slurm profile whose job starts the server gives the in-process engine's greedy
generations, every row once, the server listening on loopback only; a request it refuses is its row's
error; and a shard reaches a running server by its URL with the key from the environment."""

from __future__ import annotations

import ipaddress
import json
import threading
import time

import psutil
import pyarrow.parquet as pq
import pytest

from shardgen.data.plan import write_manifest
from shardgen.engines.server import ServerEngine, ServerFailed
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import base_config, make_rows, write_parquet
from tests.integration.workflow import Background, workflow_config

pytestmark = pytest.mark.engine

ROWS = 12
TOO_LONG = 3  # its own max_tokens is more than the context: the server refuses it (vLLM's own check)
LOGPROBS = 5  # asks for the log-probabilities of its tokens and of the 2 likeliest at each position
CAPITAL = """\
def capital(country: str) -> dict:
    \"\"\"The capital of a country.

    Args:
        country: the country, in lower case
    \"\"\"
    return {"capital": {"france": "Paris", "italy": "Rome", "norway": "Oslo"}.get(country, "unknown")}
"""


def shard(tmp_path, name: str, engine_handle, **engine_section):
    rows = make_rows(ROWS)
    for i, row in enumerate(rows):
        row["sampling"] = json.dumps({"max_tokens": 5000 if i == TOO_LONG else 12}
                                     | ({"logprobs": True, "top_logprobs": 2} if i == LOGPROBS else {}))  # fmt: skip
    data = write_parquet(tmp_path / "in.parquet", rows)
    work = tmp_path / name
    config = base_config({"parquet": [str(data)], "sampling_column": "sampling"}, shards={"rows_per_shard": ROWS},
                         output={"dir": str(work)}, errors={"max_rate": 0.2}, **engine_section)  # fmt: skip
    return run(config, work, engine_handle)


def run(config, work, engine_handle):
    write_manifest(config, work / "m.json")
    run_shard(config, work / "m.json", "00000", work / "s.parquet", work / "s.json", JobContext(engine_handle))
    return pq.read_table(work / "s.parquet").to_pylist(), json.loads((work / "s.json").read_text())


def listening(process: psutil.Process) -> list[tuple[int, str]]:
    return [(p.pid, c.laddr.ip) for p in [process, *process.children(recursive=True)]
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]  # fmt: skip


def served_sockets(workdir, done: threading.Event, seen: dict) -> None:
    """Until ``done``: the listening sockets of every vLLM server process working in ``workdir`` (a
    Slurm job's, which is not the test's child), by pid."""
    while not done.is_set():
        for p in psutil.process_iter(["cmdline", "cwd"]):
            if p.info["cwd"] == str(workdir) and "vllm.entrypoints.openai.api_server" in (p.info["cmdline"] or []):
                try:
                    found = listening(p)
                except psutil.Error:
                    continue
                seen.setdefault(p.pid, set()).update(ip for _, ip in found)
        time.sleep(0.5)


@pytest.mark.slurm
def test_a_slurm_run_on_a_vllm_server_its_job_starts_gives_the_in_process_generations_on_loopback_only(
    tmp_path, engine, slurm_cluster
):
    """engine.kind: server, preset vllm, through the Slurm profile: the generate job starts vLLM's
    server, on loopback only; the merged output has every row once, the in-process engine's greedy
    generation for each, and the row the server refuses as its error; the run's stats have its
    throughput (bench/server.py --slurm compares it with the in-process engine's)."""
    in_process, _ = shard(tmp_path / "session", "in-process", engine)
    config = workflow_config(
        {"parquet": [str(tmp_path / "session" / "in.parquet")], "id_column": "id", "sampling_column": "sampling"},
        shards={"rows_per_shard": ROWS},
        prompt={"template": "Write one short sentence about {{ topic }}."},
        sampling={"temperature": 0.0, "max_tokens": 12},
        errors={"max_rate": 0.2},
        engine={"kind": "server", "server": {"preset": "vllm"}},
    )
    config["model"]["enable_chunked_prefill"] = False  # the session engine's settings
    done, seen = threading.Event(), {}
    watcher = threading.Thread(target=served_sockets, args=(tmp_path, done, seen), daemon=True)
    watcher.start()
    try:
        Background(tmp_path, config, "slurm").wait()
    finally:
        done.set()
        watcher.join()
    assert len(seen) == 1 and all(ips for ips in seen.values()), f"one server, seen listening: {seen}"
    assert all(ipaddress.ip_address(ip).is_loopback for ips in seen.values() for ip in ips), seen

    served = pq.read_table(tmp_path / "results" / "output.parquet").to_pylist()
    assert [r["id"] for r in served] == [r["id"] for r in in_process], "every row once, in order"
    # vLLM's server checks a request's max_tokens against the context (its offline engine does not)
    assert served[TOO_LONG]["error"].startswith("rejected_by_engine: ") and "5000" in served[TOO_LONG]["error"]
    others = [i for i in range(ROWS) if i != TOO_LONG]
    assert [served[i]["generation"] for i in others] == [in_process[i]["generation"] for i in others]
    assert [served[i]["generated_tokens"] for i in others] == [in_process[i]["generated_tokens"] for i in others]
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["rows"] == ROWS and stats["errors"] == 1 and stats["output_tokens_per_s"] > 0, stats


def same_logprobs(served: list, in_process: list) -> bool:
    """The same tokens at each position, most likely first, with the same log-probabilities (to 1e-3)."""
    pairs = list(zip(served, in_process, strict=True))
    return all(
        [x["token_id"] for x in a] == [y["token_id"] for y in b]
        and all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a, b, strict=True))
        for a, b in pairs
    )


def labelled(tmp_path, name: str, engine_handle, **engine_section):
    """A run of labels with their probabilities (structured outputs' choice, output.choice_probs)."""
    data = write_parquet(tmp_path / "labels.parquet", make_rows(4))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(tmp_path / name), "choice_probs": True},
                         sampling={"temperature": 0.0, "max_tokens": 8,
                                   "structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                         **engine_section)  # fmt: skip
    return run(config, tmp_path / name, engine_handle)[0]


def rollout(tmp_path, name: str, engine_handle, **engine_section):
    """A rollout whose every turn is a call of one tool (tool_choice: required), two turns a row."""
    (tmp_path / "capital.py").write_text(CAPITAL)
    rows = [{"id": f"r{i}", "country": c} for i, c in enumerate(["france", "italy", "norway"])]
    data = write_parquet(tmp_path / "countries.parquet", rows)
    tools = [{"path": str(tmp_path / "capital.py"), "name": "capital"}]
    config = base_config({"parquet": [str(data)], "id_column": "id"}, output={"dir": str(tmp_path / name)},
                         prompt={"template": "Use the tool: what is the capital of {{ country }}?"},
                         sampling={"temperature": 0.0, "max_tokens": 96},
                         rollout={"max_turns": 2, "tools": tools, "tool_choice": "required",
                                  "parallel_tool_calls": False},
                         **engine_section)  # fmt: skip
    return run(config, tmp_path / name, engine_handle)[0]


def test_a_vllm_server_the_job_starts_gives_the_in_process_generations_and_listens_on_loopback_only(
    tmp_path, engine, monkeypatch
):
    in_process, _ = shard(tmp_path, "in-process", engine)
    server = ServerEngine({"preset": "vllm"})
    try:
        # the session engine's settings (chunked prefill off): the same engine, behind HTTP
        served, stats = shard(tmp_path, "served", server, engine={"kind": "server", "server": {"preset": "vllm"}},
                              model={"enable_chunked_prefill": False})  # fmt: skip
        sockets = listening(psutil.Process(server._process.pid))
        assert sockets and all(ipaddress.ip_address(ip).is_loopback for _, ip in sockets), sockets

        assert [r["row_index"] for r in served] == list(range(ROWS)), "every row once"
        # vLLM's server checks a request's max_tokens against the context (its offline engine does not)
        assert served[TOO_LONG]["error"].startswith("rejected_by_engine: ") and "5000" in served[TOO_LONG]["error"]
        others = [i for i in range(ROWS) if i != TOO_LONG]
        assert [served[i]["generation"] for i in others] == [in_process[i]["generation"] for i in others]
        assert [served[i]["generated_tokens"] for i in others] == [in_process[i]["generated_tokens"] for i in others]
        assert all(served[i]["error"] is None and served[i]["finish_reason"] for i in others)
        assert stats["rows_generated"] == ROWS and stats["errors"] == 1

        # a running server, by its URL: the key from the environment; a wrong one is named at once
        monkeypatch.setenv("SERVER_KEY", server._key)
        reached = ServerEngine({"url": server.url, "api_key_env": "SERVER_KEY"})
        again, _ = shard(tmp_path, "reached", reached, engine={"kind": "server",
                         "server": {"url": server.url, "api_key_env": "SERVER_KEY"}})  # fmt: skip
        assert [r["generation"] for r in again] == [r["generation"] for r in served]
        # log-probabilities by token id (return_tokens_as_token_ids), as vLLM gives them in process
        assert again[LOGPROBS]["logprobs"] and same_logprobs(
            again[LOGPROBS]["logprobs"], in_process[LOGPROBS]["logprobs"]
        )
        reach = {"kind": "server", "server": {"url": server.url, "api_key_env": "SERVER_KEY"}}
        # the labels' probabilities (logprob_token_ids), and a rollout's conversations, as in process
        labels = labelled(tmp_path, "labels-served", ServerEngine(reach["server"]), engine=reach)

        def probs(rows):
            return [(r["label"], {k: round(p, 3) for k, p in r["choice_probs"].items()}) for r in rows]

        assert probs(labels) == probs(labelled(tmp_path, "labels", engine))
        talks = rollout(tmp_path, "rollout-served", ServerEngine(reach["server"]), engine=reach)
        assert all(r["error"] is None and r["turns"] == 2 for r in talks), [
            (r["error"], r["turns"], r["finish_reason"]) for r in talks
        ]
        assert [r["messages"] for r in talks] == [r["messages"] for r in rollout(tmp_path, "rollout", engine)]
        monkeypatch.setenv("SERVER_KEY", "wrong")
        with pytest.raises(ServerFailed, match=r"refused the API key \(HTTP 401\) in \$SERVER_KEY"):
            shard(tmp_path, "wrong-key", ServerEngine({"url": server.url, "api_key_env": "SERVER_KEY"}),
                  engine={"kind": "server", "server": {"url": server.url, "api_key_env": "SERVER_KEY"}})  # fmt: skip
    finally:
        process = server._process
        server.close()
    assert process is not None and process.poll() is not None, "the server stopped with its handle"
