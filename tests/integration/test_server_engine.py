"""The server engine (engine.kind: server) against vLLM's own OpenAI-compatible server from the same CPU
build: a shard through a server the job starts gives the in-process engine's greedy generations, the
server listens on loopback only, a request it refuses is its row's error, and a run reaches a running
server by its URL with the key from the environment."""

from __future__ import annotations

import ipaddress
import json

import psutil
import pyarrow.parquet as pq
import pytest

from shardgen.generate import JobContext, run_shard
from shardgen.plan import write_manifest
from shardgen.server_engine import ServerEngine, ServerFailed
from tests.conftest import base_config, make_rows, write_parquet

pytestmark = pytest.mark.engine

ROWS = 12
TOO_LONG = 3  # its own max_tokens is more than the context: the server refuses it (vLLM's own check)


def shard(tmp_path, name: str, engine_handle, **engine_section):
    rows = make_rows(ROWS)
    for i, row in enumerate(rows):
        row["sampling"] = json.dumps({"max_tokens": 5000 if i == TOO_LONG else 12})
    data = write_parquet(tmp_path / "in.parquet", rows)
    work = tmp_path / name
    config = base_config({"parquet": [str(data)], "sampling_column": "sampling"}, shards={"rows_per_shard": ROWS},
                         output={"dir": str(work)}, errors={"max_rate": 0.2}, **engine_section)  # fmt: skip
    write_manifest(config, work / "m.json")
    run_shard(config, work / "m.json", "00000", work / "s.parquet", work / "s.json", JobContext(engine_handle))
    return pq.read_table(work / "s.parquet").to_pylist(), json.loads((work / "s.json").read_text())


def listening(process: psutil.Process) -> list[tuple[int, str]]:
    return [(p.pid, c.laddr.ip) for p in [process, *process.children(recursive=True)]
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]  # fmt: skip


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
        monkeypatch.setenv("SERVER_KEY", "wrong")
        with pytest.raises(ServerFailed, match=r"refused the API key \(HTTP 401\) in \$SERVER_KEY"):
            shard(tmp_path, "wrong-key", ServerEngine({"url": server.url, "api_key_env": "SERVER_KEY"}),
                  engine={"kind": "server", "server": {"url": server.url, "api_key_env": "SERVER_KEY"}})  # fmt: skip
    finally:
        process = server._process
        server.close()
    assert process is not None and process.poll() is not None, "the server stopped with its handle"
