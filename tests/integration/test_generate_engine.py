"""A shard job in process: on the real vLLM engine (CPU build, one shared by the tests), and on the fake
engine (``fake``) where what is tested is the job's own (signals, saves, resumes, retries)."""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from shardgen.base.rundir import RunDir
from shardgen.data.outputs import ShardCheckpoint
from shardgen.data.plan import write_manifest
from shardgen.engines import kinds as eng
from shardgen.engines.fake import FakeEngine
from shardgen.engines.vllm import Engine
from shardgen.errors import InputError
from shardgen.jobs.feed.shard_loop import TooManyErrors
from shardgen.jobs.generate import JobContext, run_shard
from shardgen.jobs.stopflag import Interrupted
from tests.conftest import base_config, changed, make_rows, write_parquet
from tests.integration.workflow import part_rows

FAKE = {"kind": "fake"}


@pytest.fixture
def fake():
    """A job's handle on the fake engine (``engine.kind: fake``, which the configs of the tests using it set)."""
    return FakeEngine()


def plan(tmp_path, rows, **overrides):
    data = write_parquet(tmp_path / "in.parquet", rows)
    config = base_config({"parquet": [str(data)]}, output={"dir": str(tmp_path / "out")}, **overrides)
    manifest = tmp_path / "manifest.json"
    write_manifest(config, manifest)
    return config, manifest


def run(tmp_path, config, manifest, shard, engine, window=None):
    out, stats = tmp_path / f"{shard}.parquet", tmp_path / f"{shard}.stats.json"
    run_shard(config, manifest, shard, out, stats, JobContext(engine, window=window))
    return pq.read_table(out), json.loads(stats.read_text())


@pytest.mark.engine
def test_every_row_of_a_shard_gets_a_generation_and_the_stats_match_the_rows(tmp_path, engine):
    config, manifest = plan(tmp_path, make_rows(20))
    table, stats = run(tmp_path, config, manifest, "00001", engine)
    assert table.column("row_index").to_pylist() == list(range(8, 16))
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(8, 16)]
    assert all(g and g.strip() for g in table.column("generation").to_pylist())
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert table.column("error").null_count == table.num_rows
    assert stats["rows"] == 8 and stats["errors"] == 0 and stats["rows_generated"] == 8
    assert stats["generated_tokens"] == pc.sum(table.column("generated_tokens")).as_py()
    assert stats["prompt_tokens"] == pc.sum(table.column("prompt_tokens")).as_py()
    assert stats["generated_tokens"] <= 8 * config.sampling.max_tokens
    assert stats["ttft_p50_s"] > 0 and stats["output_tokens_per_s"] > 0
    assert stats["histograms"]["ttft_s"], "time to first token comes from vLLM's per-request metrics"
    # queued and from scheduling: the two parts of the time to first token, from vLLM's timestamps
    assert stats["queue_p50_s"] is not None and stats["ttft_scheduled_p50_s"] > 0
    assert stats["ttft_scheduled_p50_s"] <= stats["ttft_p99_s"]
    # the engine's processes were spawned, and its caches are this node's
    assert stats["engine"]["environment"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@pytest.mark.engine
def test_shardgen_generate_runs_on_vllm_and_the_same_call_twice_starts_one_engine(tmp_path, engine, monkeypatch):
    """The notebook loop on vLLM: the engine ``generate`` keeps between calls is started once (here the
    session's, which it is handed as its kept one), and its run's stats hold vLLM's own metrics."""
    import shardgen
    from shardgen import api
    from shardgen import config as cfg
    from tests.conftest import TEST_MODEL_CFG

    config = {"prompt": {"template": "Write one short sentence about {{ topic }}."}, "model": TEST_MODEL_CFG,
              "sampling": {"temperature": 0.0, "max_tokens": 6}}  # fmt: skip
    # the kept engine's key: the engine section as generate's validation fills it in
    filled = cfg.validate(copy.deepcopy(config) | {"input": {"parquet": ["x.parquet"]}})
    kept = (cfg.digest(filled["engine"]), engine)
    monkeypatch.setattr(api, "_engine", kept)  # (the session's: never closed by the test)
    rows = make_rows(5)
    first = shardgen.generate(rows, config, workdir=tmp_path)
    llm = engine.llm
    second = shardgen.generate(rows, config, workdir=tmp_path)
    assert api._engine == kept and engine.llm is llm, "one engine for both calls"
    assert first.column("id").to_pylist() == [r["id"] for r in rows] and first.equals(second)
    assert all(g.strip() for g in first.column("generation").to_pylist())
    (stats,) = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/stats.json")]  # the call's run's
    assert stats["rows"] == 5 and stats["ttft_p50_s"] > 0, "vLLM's per-request time to first token"
    monkeypatch.setattr(api, "_engine", None)


@pytest.mark.engine
def test_the_request_store_keeps_vllms_answers_as_they_were_and_an_edited_branch_reruns_only_its_rows(tmp_path, engine):
    """On vLLM: duplicates in a shard get the answer of the request sent, a rerun after an edit to one
    branch of the template takes every other row from the store, each equal to the answer stored
    (text, tokens, log-probabilities), and generates the rows whose prompt changed; run again, no engine
    starts (the keys made with the tokenizer transformers loads are vLLM's)."""
    before = "{% if topic == 'owls' %}Name an owl.{% else %}Write one short sentence about {{ topic }}.{% endif %}"
    greedy = {"temperature": 0.0, "max_tokens": 6, "logprobs": 2}
    config, manifest = plan(tmp_path, make_rows(16), shards={"rows_per_shard": 16}, cache={},
                            prompt={"template": before}, sampling=greedy)  # fmt: skip
    first, stats = run(tmp_path, config, manifest, "00000", engine)
    assert stats["attempt_requests"] == 8 and stats["requests_deduplicated"] == 8
    entries = pq.read_table(tmp_path / "out" / "cache" / "entries")
    stored = {json.loads(a)["samples"][0]["text"] for a in entries.column("answer").to_pylist()}
    assert entries.num_rows == 8 and set(first.column("generation").to_pylist()) == stored
    edited = before.replace("Name an owl.", "Name a small owl.")
    config, manifest = plan(tmp_path, make_rows(16), shards={"rows_per_shard": 16}, cache={},
                            prompt={"template": edited}, sampling=greedy)  # fmt: skip
    again, stats = run(tmp_path, config, manifest, "00000", engine)
    owls = [r["row_index"] for r in first.to_pylist() if r["topic"] == "owls"]
    assert stats["attempt_requests"] == 1 and stats["requests_reused"] == 14 and stats["requests_deduplicated"] == 1
    assert [r["row_index"] for r in again.to_pylist() if r["result_source"] != "store"] == owls
    kept = ("generation", "finish_reason", "prompt_tokens", "generated_tokens", "logprobs")
    for a, b in zip(first.to_pylist(), again.to_pylist(), strict=True):
        if a["topic"] != "owls":
            assert {k: a[k] for k in kept} == {k: b[k] for k in kept}, a["row_index"]
    assert pq.read_table(tmp_path / "out" / "cache" / "entries").num_rows == 9, "the new answer kept too"
    handle = Engine()  # a job's own handle, not started: the store answers every row, looked up with the
    (tmp_path / "third").mkdir()  # model's tokenizer loaded without vLLM
    third, stats = run(tmp_path / "third", config, manifest, "00000", handle)
    assert not handle.running and stats["requests_reused"] == 16 and stats["attempt_requests"] == 0
    assert third.drop(["result_source"]).equals(again.drop(["result_source"]))


@pytest.mark.engine
def test_bad_rows_of_every_kind_are_row_errors_and_the_shard_goes_on(tmp_path, engine):
    rows = [{"text": f"Say hello to {i}.", "raw": b"", "n": 1} for i in range(9)]
    rows[1]["text"] = "very long " * 2000  # far beyond max_model_len (1024)
    rows[2]["text"] = None
    rows[3]["text"] = "   "
    rows[4]["raw"] = b"\xff\xfe not utf-8"
    rows[5]["n"] = 0  # the template divides by it
    config, manifest = plan(
        tmp_path,
        rows,
        prompt={"template": "{{ text }}{{ raw }}{{ '' if 100 // n else '' }}"},
        shards={"rows_per_shard": 9},
        errors={"max_rate": 0.6},
    )
    table, stats = run(tmp_path, config, manifest, "00000", engine)
    errors = table.column("error").to_pylist()
    assert errors[1].startswith("prompt_too_long: the prompt has ")
    assert errors[2] == "null_value: column 'text' is null"
    assert errors[3] == "empty_prompt: the rendered prompt is empty"
    assert errors[4].startswith("undecodable_text: column 'raw' is not valid UTF-8")
    assert errors[5] == "template_error: template: ZeroDivisionError: integer division or modulo by zero"
    assert [e for i, e in enumerate(errors) if i not in (1, 2, 3, 4, 5)] == [None] * 4
    assert all(table.column("generation").to_pylist()[i] for i in (0, 6, 7, 8))
    assert stats["errors"] == 5 and stats["error_reasons"] == {
        "prompt_too_long": 1,
        "null_value": 1,
        "empty_prompt": 1,
        "undecodable_text": 1,
        "template_error": 1,
    }


@pytest.mark.engine
def test_a_gigabyte_cell_is_a_prompt_too_long_row_error_without_being_tokenized(tmp_path, engine, monkeypatch):
    """A 1 GiB cell would be about 350 million token ids: it must never reach the tokenizer."""
    rows = make_rows(4)
    rows[2]["topic"] = "x" * 2**30
    config, manifest = plan(tmp_path, rows, shards={"rows_per_shard": 4}, errors={"max_rate": 0.5})
    del rows
    longest = []
    real_encode = eng.Tokenizer.encode_batch

    def encode_batch(self, prompts):
        longest.extend(len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p) for p in prompts)
        return real_encode(self, prompts)

    monkeypatch.setattr(eng.Tokenizer, "encode_batch", encode_batch)
    out, stats_path = tmp_path / "s.parquet", tmp_path / "s.json"
    stats = run_shard(config, manifest, "00000", out, stats_path, JobContext(engine))
    errors = pq.read_table(out, columns=["error"]).column("error").to_pylist()
    assert errors[2].startswith("prompt_too_long: the prompt has more than") and errors.count(None) == 3
    assert len(longest) == 3 and max(longest) < 1000, "only the three ordinary rows were tokenized"
    assert stats["error_reasons"] == {"prompt_too_long": 1}


def stop_after_first_flush(monkeypatch) -> list[int]:
    """Send the job SIGTERM (what Slurm sends at the time limit) right after its first saved part."""
    real_flush = ShardCheckpoint.flush
    flushed: list[int] = []

    def flush_then_sigterm(self, rows):
        real_flush(self, rows)
        if rows:
            flushed.append(len(rows))
            if len(flushed) == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ShardCheckpoint, "flush", flush_then_sigterm)
    return flushed


def partial_run(tmp_path, engine, monkeypatch, **overrides) -> tuple[dict, object, int]:
    """Plan 16 rows in one shard and stop its job after some rows are saved (on the fake engine)."""
    config, manifest = plan(tmp_path, make_rows(16), shards={"rows_per_shard": 16},
                            checkpoint={"rows": 3, "seconds": 300}, engine=FAKE, **overrides)  # fmt: skip
    with monkeypatch.context() as m:
        flushed = stop_after_first_flush(m)
        # Two requests in flight at a time, so rows finish over many engine
        # steps and the stop lands mid-shard (with all 16 in one batch they
        # may all finish in the same step).
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            run_shard(
                config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json", JobContext(engine, window=2)
            )
    assert not (tmp_path / "s.parquet").exists()
    return config, manifest, sum(flushed)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_exactly_the_rows_finished_before_it_and_the_next_attempt_sends_only_the_rest(
    tmp_path, fake, monkeypatch, signum
):
    """Periodic saves are far above the shard's size: the only save is the one the signal makes."""
    rows, engine = 16, fake
    config, manifest = plan(tmp_path, make_rows(rows), shards={"rows_per_shard": rows},
                            checkpoint={"rows": 10_000, "seconds": 3600}, engine=FAKE)  # fmt: skip
    core = engine
    finished = {"before_signal": 0, "all": 0}
    real_step = core.step

    def step():
        outputs = real_step()
        finished["all"] += sum(1 for o in outputs if o.finished)
        if finished["all"] >= 5 and not finished["before_signal"]:
            finished["before_signal"] = finished["all"]  # what the engine finished before the signal
            os.kill(os.getpid(), signum)
        return outputs

    parts_before_signal = []
    real_flush = ShardCheckpoint.flush

    def flush(self, rows_):
        if rows_ and not finished["before_signal"]:
            parts_before_signal.append(len(rows_))
        real_flush(self, rows_)

    with monkeypatch.context() as m:
        m.setattr(core, "step", step)
        m.setattr(ShardCheckpoint, "flush", flush)
        with pytest.raises(Interrupted, match=f"stopped by {signal.Signals(signum).name}"):
            run_shard(
                config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json", JobContext(engine, window=2)
            )
    saved = finished["before_signal"]
    assert 5 <= saved < rows and parts_before_signal == [], "no periodic save happened before the signal"
    assert part_rows(tmp_path / "out" / "checkpoints" / "00000") == saved
    # the next attempt: what was finished comes from the checkpoint; the engine gets only the rest
    table, stats = run(tmp_path, config, manifest, "00000", engine)
    assert table.column("row_index").to_pylist() == list(range(rows))
    assert stats["rows_resumed"] == saved
    assert stats["attempt_requests"] == rows - saved == stats["rows_generated"], "only the unsaved rows were sent"
    first, second = stats["attempts"]
    assert first["outcome"] == "interrupted" and first["signal"] == signal.Signals(signum).name
    assert first["rows_saved"] == saved and second["outcome"] == "committed"
    assert not (tmp_path / "out" / "checkpoints" / "00000").exists()


def test_the_time_trigger_saves_rows_without_the_row_trigger(tmp_path, fake, monkeypatch):
    """checkpoint.seconds alone makes saves while the shard runs (the row trigger is out of reach)."""
    engine = fake
    config, manifest = plan(tmp_path, make_rows(16), shards={"rows_per_shard": 16},
                            checkpoint={"rows": 10_000, "seconds": 0.001}, engine=FAKE)  # fmt: skip
    saves = []
    real_flush = ShardCheckpoint.flush

    def flush(self, rows_):
        if rows_:
            saves.append(len(rows_))
        real_flush(self, rows_)

    with monkeypatch.context() as m:
        m.setattr(ShardCheckpoint, "flush", flush)
        run(tmp_path, config, manifest, "00000", engine, window=2)
    assert len(saves) >= 4 and sum(saves) == 16, saves


def test_a_truncated_part_is_detected_and_its_rows_generated_again(tmp_path, fake, monkeypatch):
    engine = fake
    config, manifest, saved = partial_run(tmp_path, engine, monkeypatch)
    parts = sorted((tmp_path / "out" / "checkpoints" / "00000").glob("part-*.parquet"))
    lost = pq.read_metadata(parts[-1]).num_rows
    parts[-1].write_bytes(parts[-1].read_bytes()[:100])  # the job died while writing it
    table, stats = run(tmp_path, config, manifest, "00000", engine)
    assert table.column("row_index").to_pylist() == list(range(16))
    assert stats["rows_resumed"] == saved - lost
    assert len(stats["checkpoints_discarded"]) == 1 and "unreadable" in stats["checkpoints_discarded"][0]


def test_checkpoints_of_a_changed_sampling_key_are_not_reused(tmp_path, fake, monkeypatch):
    engine = fake
    config, manifest, saved = partial_run(tmp_path, engine, monkeypatch)
    assert saved > 0
    config = changed(config, "sampling", max_tokens=10)  # was 12
    table, stats = run(tmp_path, config, manifest, "00000", engine)
    assert stats["rows_resumed"] == 0 and stats["rows_generated"] == 16
    assert all("another configuration" in d for d in stats["checkpoints_discarded"])
    assert max(table.column("generated_tokens").to_pylist()) <= 10


@pytest.mark.engine
def test_thread_variables_from_snakemake_are_dropped_before_the_engine_starts(tmp_path, engine, monkeypatch):
    from shardgen.base import jobenv

    monkeypatch.setattr(jobenv, "removed", {})  # what this process dropped before (the session's start)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    config, manifest = plan(tmp_path, make_rows(2))
    _, stats = run(tmp_path, config, manifest, "00000", engine)
    assert stats["thread_env_removed"] == {"OMP_NUM_THREADS": "2"}
    assert "OMP_NUM_THREADS" not in os.environ


def test_a_shard_over_the_error_rate_fails_keeping_its_rows_and_its_retry_fails_before_the_engine(tmp_path, fake):
    rows, engine = make_rows(16), fake
    for r in rows[4:]:
        r["topic"] = None  # 12 of 16 rows are errors; errors.max_rate 0.25 allows 4
    config, manifest = plan(tmp_path, rows, shards={"rows_per_shard": 16}, errors={"max_rate": 0.25},
                            checkpoint={"rows": 2, "seconds": 300}, engine=FAKE)  # fmt: skip
    out, stats = tmp_path / "s.parquet", tmp_path / "s.json"
    with pytest.raises(TooManyErrors, match=r"shard 00000: 5 of its 16 rows are errors.*\(4\).*null_value 5"):
        run_shard(config, manifest, "00000", out, stats, JobContext(engine))
    assert not out.exists() and not stats.exists()
    assert part_rows(tmp_path / "out" / "checkpoints" / "00000") >= 5, "finished rows are kept"
    # The retry counts the saved errors and stops before it would use an engine.
    with pytest.raises(TooManyErrors, match="first: row 4: null_value"):
        run_shard(config, manifest, "00000", out, stats, JobContext(engine=Engine(object())))


def test_an_input_changed_after_planning_is_refused_before_the_engine_starts(tmp_path):
    config, manifest = plan(tmp_path, make_rows(8))
    write_parquet(tmp_path / "in.parquet", make_rows(9))
    with pytest.raises(InputError, match=r"'.*in.parquet' changed after planning"):
        run_shard(
            config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json", JobContext(engine=Engine(object()))
        )


@pytest.mark.engine
def test_the_engine_listens_on_no_port_other_machines_can_reach(engine):
    import ipaddress

    import psutil

    me = psutil.Process()
    listening = [
        (p.pid, c.laddr)
        for p in [me, *me.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback
    ]
    assert listening == [], "the engine's own sockets must stay on the loopback interface"


def test_several_shards_in_one_job_share_the_engine_and_a_retry_keeps_the_committed_ones(tmp_path, fake):
    from shardgen.jobs.workers import run_shards

    engine = fake
    config, manifest = plan(tmp_path, make_rows(20), engine=FAKE)  # shards of 8: 00000, 00001, 00002
    shard_dir = RunDir(config.output.dir).shards
    shard_dir.mkdir(parents=True)
    run_shard(
        config, manifest, "00000", shard_dir / "00000.parquet", shard_dir / "00000.stats.json", JobContext(engine)
    )
    before = (shard_dir / "00000.parquet").stat().st_mtime_ns
    # the retry of a job that died after its first shard
    done = run_shards(config, manifest, ["00000", "00001", "00002"], JobContext(engine=engine))
    assert [s["shard"] for s in done] == ["00001", "00002"], "the committed shard is kept, the others run"
    assert (shard_dir / "00000.parquet").stat().st_mtime_ns == before
    assert pq.read_table(shard_dir / "00002.parquet").column("row_index").to_pylist() == list(range(16, 20))
    # a shard made with another config is not kept
    config = changed(config, "sampling", max_tokens=6)
    done = run_shards(config, manifest, ["00000"], JobContext(engine=engine))
    assert [s["shard"] for s in done] == ["00000"]
    assert engine.running and not engine._queue and engine.starts == 1, "the shared engine is still there, idle"


def test_out_of_memory_while_generating_keeps_the_finished_rows_and_the_retry_halves_the_batch_the_engine_used(
    tmp_path, fake, monkeypatch
):
    """CUDA's out-of-memory message raised from a step (the fake engine's), as on a GPU."""
    from shardgen.base.memory import OutOfMemory

    engine = fake
    config, manifest = plan(tmp_path, make_rows(16), shards={"rows_per_shard": 16},
                            checkpoint={"rows": 10_000, "seconds": 3600}, engine=FAKE)  # fmt: skip
    core = engine
    real_step, steps = core.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:  # two requests a step: some have finished
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB")
        return real_step()

    with monkeypatch.context() as m:
        m.setattr(core, "step", step)
        with pytest.raises(OutOfMemory, match="out of memory during generation"):
            run_shard(
                config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json", JobContext(engine, window=2)
            )
    assert not engine._queue, "the failed feed's requests were aborted"
    saved = part_rows(tmp_path / "out" / "checkpoints" / "00000")
    assert saved > 0, "rows finished before the failure are saved"
    used = engine.max_num_seqs
    table, stats = run(tmp_path, config, manifest, "00000", engine)
    assert table.column("row_index").to_pylist() == list(range(16)) and stats["rows_resumed"] == saved
    (failure,) = stats["memory_failures"]
    assert failure["kind"] == "out_of_memory" and failure["stage"] == "generation"
    assert failure["settings"]["max_num_seqs"] == used, "the settings the running engine used, not the config's"
    assert stats["memory_overrides"]["max_num_seqs"] == used // 2
    assert stats["attempts"][0]["outcome"] == "out_of_memory"


@pytest.mark.engine
def test_a_job_on_gpus_it_cannot_use_stops_before_the_model_loads(tmp_path, model_dir, monkeypatch):
    """On the CUDA build, a job that got one GPU for a tensor-parallel 2 model: stopped with both named,
    before the engine (which would load the weights) is created."""
    from shardgen.base import gpus
    from shardgen.engines.kinds import WrongGpus

    config, manifest = plan(tmp_path, make_rows(4), model={"tensor_parallel_size": 2})
    h100 = gpus.make_gpu("NVIDIA H100 80GB HBM3", index=0, memory_mib=81559, compute_capability="9.0")
    monkeypatch.setattr(eng, "vllm_build", lambda: "cuda")
    monkeypatch.setattr(gpus, "describe_gpus", lambda *a, **k: [h100])
    monkeypatch.setattr(Engine, "start", lambda self, settings: pytest.fail("the engine was started"))
    with pytest.raises(WrongGpus, match=r"sees 1 GPU\(s\) \(NVIDIA H100 80GB HBM3.*tensor_parallel_size × .* = 2"):
        run_shard(config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json")
    log = (tmp_path / "out" / "checkpoints" / "00000" / "attempts.jsonl").read_text().splitlines()
    assert [json.loads(line).get("outcome") for line in log] == [None, "wrong_gpus"]


@pytest.mark.engine
def test_a_signal_during_the_engine_start_abandons_the_start_and_records_the_attempt(tmp_path, model_dir, monkeypatch):
    """Slurm kills a job KillWait seconds (30 by default) after its SIGTERM, and a model's start takes
    minutes on a GPU: the start is abandoned at the signal, vLLM's client stops the processes it
    spawned, and the attempt ends recorded as interrupted (found by CI: a scancel during the start
    let the start run on, and the SIGKILL left the attempt with no end)."""
    import threading

    import psutil

    config, manifest = plan(tmp_path, make_rows(4))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    real_start = Engine.start
    handles = []

    def signal_once_the_engine_core_runs():
        while not [p for p in psutil.Process().children(recursive=True) if p.pid not in before]:
            time.sleep(0.1)
        time.sleep(1.0)  # vLLM's client is waiting for the engine core to load the model
        os.kill(os.getpid(), signal.SIGTERM)

    def start_then_signal(self, settings):
        handles.append(self)
        threading.Thread(target=signal_once_the_engine_core_runs, daemon=True).start()
        return real_start(self, settings)

    monkeypatch.setattr(Engine, "start", start_then_signal)
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        run_shard(config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json")
    assert handles and handles[0].starts == 0 and handles[0].llm is None, "the start was abandoned"
    log = (tmp_path / "out" / "checkpoints" / "00000" / "attempts.jsonl").read_text().splitlines()
    assert [json.loads(line).get("outcome") for line in log] == [None, "interrupted"]
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(new, 30)
    alive = [" ".join(p.cmdline()) for p in alive]
    # multiprocessing's resource tracker stays until this process ends, as after any spawn
    assert not [c for c in alive if "resource_tracker" not in c], f"processes outlived the abandoned start: {alive}"


@pytest.mark.engine
def test_a_signal_before_the_engine_start_stops_the_job_without_starting_it(tmp_path, model_dir, monkeypatch):
    from shardgen.engines.kinds import EngineSettings

    config, manifest = plan(tmp_path, make_rows(4))
    real_for_job = EngineSettings.for_job.__func__

    def for_job_then_signal(cls, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives after the attempt's start record, before the engine
        return real_for_job(cls, *args, **kwargs)

    monkeypatch.setattr(EngineSettings, "for_job", classmethod(for_job_then_signal))
    monkeypatch.setattr(Engine, "start", lambda self, settings: pytest.fail("the engine was started"))
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        run_shard(config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json")
    log = (tmp_path / "out" / "checkpoints" / "00000" / "attempts.jsonl").read_text().splitlines()
    assert [json.loads(line).get("outcome") for line in log] == [None, "interrupted"]


@pytest.mark.engine
def test_an_engine_core_killed_mid_shard_fails_the_attempt_at_once_and_keeps_its_saved_rows(
    tmp_path, model_dir, monkeypatch
):
    """The kernel's OOM killer or a SIGKILL ends vLLM's engine core without a word, and vLLM 0.32's
    offline client would then wait for its outputs for ever (engine._fail_when_engine_core_dies)."""
    import psutil

    config, manifest = plan(
        tmp_path, make_rows(16), shards={"rows_per_shard": 16}, checkpoint={"rows": 2, "seconds": 300}
    )
    real_flush, killed = ShardCheckpoint.flush, []
    shared = {p.pid for p in psutil.Process().children()}  # the session engine's, which other tests use

    def flush_then_kill(self, rows):
        real_flush(self, rows)
        if rows and not killed:
            for p in psutil.Process().children():
                if p.pid not in shared and "VLLM::EngineCore" in " ".join(p.cmdline()):
                    p.kill()
                    killed.append(p.pid)

    def hung(signum, frame):
        raise AssertionError("the job still waits on a dead engine core after 240 s")

    monkeypatch.setattr(ShardCheckpoint, "flush", flush_then_kill)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    try:
        with pytest.raises(Exception, match="EngineCore encountered an issue") as raised:
            run_shard(config, manifest, "00000", tmp_path / "s.parquet", tmp_path / "s.json", JobContext(window=2))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert killed and type(raised.value).__name__ == "EngineDeadError"
    log = (tmp_path / "out" / "checkpoints" / "00000" / "attempts.jsonl").read_text().splitlines()
    end = json.loads(log[-1])
    assert end["outcome"] == "failed" and "EngineDeadError" in end["error"]
    assert 2 <= end["rows_saved"] < 16, "the rows finished before the engine died are saved"
    assert part_rows(tmp_path / "out" / "checkpoints" / "00000") == end["rows_saved"]


@pytest.mark.engine
def test_a_run_directory_written_by_the_real_writers_reads_back_alike_in_status_merge_and_the_report(
    tmp_path, engine, monkeypatch
):
    """The run directory is the contract between the jobs, ``shardgen status``, the merge and the
    report. Here it is written by the real writers only (the plan, a job of several shards, an attempt
    stopped by SIGTERM after a save, its retry) and each reader reads it back: they agree on rows,
    row errors, resumed rows and attempts. (Records built by hand in unit tests cannot see a writer
    and its readers drift apart.)"""
    from shardgen.commands.report import FILES, make_plots
    from shardgen.commands.status import format_status, read_status
    from shardgen.jobs.merge import merge
    from shardgen.jobs.workers import run_shards

    rows = make_rows(20)
    rows[3]["topic"] = "very long " * 2000  # beyond max_model_len: a row error
    data = write_parquet(tmp_path / "in.parquet", rows)
    run_dir = RunDir(tmp_path / "results")
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)}, checkpoint={"rows": 2},
                         errors={"max_rate": 0.2})  # fmt: skip
    write_manifest(config, run_dir.manifest)  # shards of 8: 00000, 00001, 00002 (4 rows)
    run_shards(config, run_dir.manifest, ["00000", "00001"], JobContext(engine=engine))
    with monkeypatch.context() as m:
        stop_after_first_flush(m)  # one request at a time: the stop lands after 2 of its 4 rows
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            run_shard(config, run_dir.manifest, "00002", run_dir.shard_file("00002"), run_dir.shard_stats("00002"),
                      JobContext(engine, window=1))  # fmt: skip
    st = read_status(run_dir.root, squeue=False)
    assert [s.state for s in st.shards] == ["done", "done", "pending"], format_status(st)
    assert st.shards[2].done == 2 and st.rows_done == 18 and st.errors() == {"prompt_too_long": 1}

    leftover = run_dir.shards / ".00002.parquet.0a1b2c3d.tmp"  # of a commit killed mid-write
    leftover.write_bytes(b"PAR1 half a file")
    (generated,) = run_shards(config, run_dir.manifest, ["00000", "00001", "00002"], JobContext(engine=engine))
    assert not leftover.exists(), "the shard's next commit removes what a killed one left"
    assert generated["shard"] == "00002" and generated["rows_resumed"] == 2
    stopped, finished = generated["attempts"]
    assert (stopped["outcome"], stopped["signal"], stopped["rows_saved"]) == ("interrupted", "SIGTERM", 2)
    assert (finished["outcome"], finished["rows_done_before"]) == ("committed", 2)
    st = read_status(run_dir.root, squeue=False)
    assert [s.state for s in st.shards] == ["done"] * 3 and (st.rows_done, st.rows_resumed) == (20, 2)
    assert "rows: 20 of 20 done (100.0%), 2 of them from checkpoints" in format_status(st)

    stats = merge(config, run_dir.manifest, run_dir.merged("parquet"), run_dir.stats)
    assert (stats["rows"], stats["rows_resumed"], stats["errors"]) == (st.rows_done, st.rows_resumed, 1)
    assert stats["error_reasons"] == st.errors()
    assert [s["shard"] for s in stats["shards"]] == [s.id for s in st.shards]
    table = pq.read_table(run_dir.merged("parquet"))
    assert table.column("row_index").to_pylist() == list(range(20))
    written = make_plots(run_dir.stats, run_dir.merged("parquet"), run_dir.plots)
    assert sorted(p.name for p in written) == sorted(FILES)
    assert "20" in (run_dir.plots / "totals.html").read_text()

    # The same shards as OpenAI's batch result files, priced: a request per row, the failed one in the
    # error file; the cost counts the attempt SIGTERM stopped, and the report shows it.
    from openai.types.chat import ChatCompletion

    priced = changed(changed(config, "output", format="openai_batch"), "cost", gpu_hour=3.0)
    stats = merge(priced, run_dir.manifest, run_dir.merged("openai_batch"), run_dir.stats)
    out = run_dir.merged("openai_batch")
    ok, failed = ([json.loads(x) for x in (out / n).read_text().splitlines()] for n in ("output.jsonl", "errors.jsonl"))
    assert [int(line["custom_id"]) for line in ok] == [i for i in range(20) if i != 3]
    assert [line["response"]["body"]["error"]["code"] for line in failed] == ["prompt_too_long"]
    completions = [ChatCompletion.model_validate(line["response"]["body"]) for line in ok]
    assert all(c.choices[0].message.content and c.usage.completion_tokens <= 12 for c in completions)
    # the attempt SIGTERM stopped is billed too: its time from its record (whole seconds, so it may be 0 here)
    seconds = datetime.datetime.fromisoformat(stopped["ended"]) - datetime.datetime.fromisoformat(stopped["started"])
    assert stats["attempts_unmeasured"] == 0 and stats["billed_gpu_hours"] == pytest.approx(
        stats["gpu_hours"] + seconds.total_seconds() / 3600
    )
    assert stats["cost"]["total"] == pytest.approx(3.0 * stats["billed_gpu_hours"])
    make_plots(run_dir.stats, out, run_dir.plots)
    assert "GPU-hours billed at 3 USD each" in (run_dir.plots / "totals.html").read_text()


@pytest.mark.engine
def test_a_chain_whose_first_step_drops_rows_and_second_samples_several_counts_each_figure_once(tmp_path, engine):
    """Two generate steps on the session engine, run by the real writers (plan, shard jobs, merge,
    the select): the draft samples 2 per row, one row is an error and its keep_if passes on sample 0
    only; the rewrite samples 3 per row it gets. Every figure of stats.json and of the summary is in
    one unit: a step's ``rows`` are the input rows it ran, ``output_rows`` what it wrote for them,
    ``rows_passed_on`` the next step's ``rows`` (they were "3 rows -> -1 passed on"). A last select
    of pairs that finds no pair writes the chosen/rejected columns still."""
    from shardgen import config as cfg
    from shardgen.data.manifest import Manifest
    from shardgen.features import steps
    from shardgen.jobs.merge import merge
    from shardgen.jobs.workers import run_shards

    rows = make_rows(4)
    rows[1]["topic"] = None  # a row error of the draft: both its samples
    data = write_parquet(tmp_path / "in.parquet", rows)
    raw = base_config(
        {"parquet": [str(data)]},
        output={"dir": str(tmp_path / "out")},
        shards={"rows_per_shard": 2},
        errors={"max_rate": 0.5},
    ).raw
    raw.pop("sampling")
    raw["steps"] = [
        {"name": "draft", "sampling": {"n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 4},
         "select": {"keep_if": "sample_index == 0"}},
        {"name": "rewrite", "prompt": {"template": "Shorter: {{ draft_generation }}"},
         "sampling": {"n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 4},
         "select": {"keep_if": "sample_index < 2"}},
    ]  # fmt: skip
    raw = cfg.validate(raw)

    def run_steps(raw):
        for c in steps.step_configs(raw):
            cfg.write_resolved(c, c["output"]["dir"])
            run, run_dir = cfg.RunConfig.from_dict(c), RunDir(c["output"]["dir"])
            if not run_dir.manifest.exists():
                write_manifest(run, run_dir.manifest)
                run_shards(
                    run,
                    run_dir.manifest,
                    [s.id for s in Manifest.load(run_dir.manifest).shards],
                    JobContext(engine=engine),
                )
                merge(run, run_dir.manifest, run_dir.merged("parquet"), run_dir.stats)
        return steps.finish(raw, tmp_path / "out" / "output.parquet", tmp_path / "out" / "stats.json")

    stats = run_steps(raw)
    draft, rewrite = stats["steps"]
    figures = ("rows", "output_rows", "errors", "rows_passed_on")
    assert [draft[k] for k in figures] == [4, 8, 1, 3], "4 rows, 2 samples each; row 1 an error; sample 0 of 3"
    assert [rewrite[k] for k in figures] == [3, 9, 0, 6], "3 rows, 3 samples each, samples 0 and 1 kept"
    assert (stats["input_rows"], stats["output_rows"]) == (4, 6)
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert [[s[k] for k in figures] for s in saved["steps"]] == [[4, 8, 1, 3], [3, 9, 0, 6]]
    summary = steps.summary_text(saved)
    assert "4 rows (1 errors) -> 8 output rows -> 3 passed on" in summary
    assert "3 rows (0 errors) -> 9 output rows -> 6 passed on" in summary
    assert "4 input rows -> 6 output rows" in summary
    output = pq.read_table(tmp_path / "out" / "output.parquet").to_pylist()
    assert sorted((r["id"], r["draft_sample_index"], r["sample_index"]) for r in output) == [
        (rows[i]["id"], 0, s) for i in (0, 2, 3) for s in (0, 1)
    ]

    # the same steps, the last select pairs by a column all samples of a row share: no pair at all
    raw["steps"][1]["select"] = {"pairs": {"by": "prompt_tokens"}}
    stats = run_steps(cfg.validate(raw))
    table = pq.read_table(tmp_path / "out" / "output.parquet")
    assert table.num_rows == 0 and table.column_names == ["chosen", "rejected"]
    assert "draft_generation" in [f.name for f in table.schema.field("chosen").type]
    assert stats["output_rows"] == 0 and stats["steps"][1]["rows_passed_on"] == 0
