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

from shardgen.generate import JobContext, run_shard
from shardgen.plan import write_manifest
from shardgen.server_engine import ServerEngine, ServerFailed
from tests.conftest import base_config, make_rows, write_parquet
from tests.integration.workflow import Background, workflow_config

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
