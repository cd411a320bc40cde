"""Shared fixtures: real Parquet and datasets inputs, configs, and one real engine per session."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen import config as cfg

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

# Engine settings for tests on the CPU build: no torch.compile; float32,
# because CPUs without AVX-512 BF16 emulate bfloat16 about 5x slower (measured
# on an AVX2-only EPYC); a KV cache of about 2,900 tokens (22 blocks of 128),
# small enough that a prefix-order test can fill it.
TEST_MODEL_CFG: dict[str, Any] = {
    "model": str(MODEL),
    "dtype": "float32",
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 128 * 1024 * 1024,
    "enforce_eager": True,
}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL / "config.json").exists():
        pytest.fail(f"the demo model is missing at {MODEL}: run `make setup`")
    return MODEL


REASONER = ROOT / "models" / "reasoner"


@pytest.fixture(scope="session")
def reasoner_dir() -> Path:
    """The reasoning test model (scripts/make_test_models.py: ``make_reasoner``)."""
    if not (REASONER / "config.json").exists():
        pytest.fail(f"the reasoning test model is missing at {REASONER}: run `make test-models`")
    return REASONER


def make_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    topics = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges"]
    return [{"id": f"r{i:05d}", "topic": topics[i % len(topics)], "n": i} for i in range(start, start + n)]


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 7) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def parquet_files(tmp_path: Path) -> list[Path]:
    """Three files of 10, 7 and 13 rows (30 in all), with small row groups."""
    sizes = [10, 7, 13]
    files, start = [], 0
    for i, n in enumerate(sizes):
        files.append(write_parquet(tmp_path / "data" / f"part-{i}.parquet", make_rows(n, start)))
        start += n
    return files


def base_config(inputs: dict[str, Any], **overrides: Any) -> cfg.RunConfig:
    """A run's config; ``overrides`` replace whole sections (``model`` is merged)."""
    config: dict[str, Any] = {
        "input": inputs,
        "shards": {"rows_per_shard": 8},
        "prompt": {"template": "Write one short sentence about {{ topic }}."},
        "model": copy.deepcopy(TEST_MODEL_CFG),
        "sampling": {"temperature": 0.0, "max_tokens": 12},
        # the rows repeat 8 topics: what these tests count is the engine's work on every row (the
        # request store has tests of its own: test_store.py, and the workflows that pass `cache`)
        "cache": {"enabled": False},
    }
    for key, value in overrides.items():
        if key == "model":
            config["model"].update(value)
        else:
            config[key] = value
    return cfg.RunConfig.from_dict(config)


def changed(config: cfg.RunConfig, section: str, **values: Any) -> cfg.RunConfig:
    """``config`` with some keys of one section changed."""
    raw = copy.deepcopy(dict(config.raw))
    raw[section] = {**raw[section], **values}
    return cfg.RunConfig.from_dict(raw)


@pytest.fixture(scope="session")
def engine(model_dir: Path):
    """One real vLLM engine for every in-process engine test (a start costs about a minute), as the
    handle a job's shards share: ``run_shard(..., JobContext(engine))`` uses it and leaves it running.

    Chunked prefill is off, as shardgen runs it for seeded sampling on the
    CPU build (``EngineSettings.for_job``), so the seeded tests can share it.
    """
    from shardgen.base.jobenv import clear_thread_env
    from shardgen.engines.kinds import EngineSettings
    from shardgen.engines.vllm import Engine

    clear_thread_env()  # before vLLM is imported
    from vllm import LLM

    # Wrapped, not started by the handle: a handle that started its engine starts another when a
    # shard's settings differ (engine.Engine.start), and the tests share this one as it is.
    llm = LLM(**EngineSettings(model={**TEST_MODEL_CFG, "enable_chunked_prefill": False}).kwargs)
    yield Engine(llm)
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def llm(engine):
    """The session engine's ``vllm.LLM``, for tests that look inside it."""
    return engine.llm


# `make test` runs the suite in two processes (pytest-xdist, ``-n 2``): most of a Slurm test's time is
# one core's (a job's engine starting, Snakemake polling), so two at once fill the machine's two. Each
# process submits to a Slurm partition of its own (scripts/slurm-up.sh: debug and its twin debug2), so
# that one's jobs never wait behind the other's.
SLURM_PARTITION = "debug2" if os.environ.get("PYTEST_XDIST_WORKER") == "gw1" else "debug"


@pytest.fixture
def slurm_cluster() -> None:
    """The local Slurm cluster (``make slurm``): a test that needs it fails, never skips, without it."""
    import shutil
    import subprocess

    up = False
    if shutil.which("sinfo"):
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
        up = r.returncode == 0 and any(s in r.stdout for s in ("idle", "mix", "alloc"))
    if not up:
        pytest.fail("no Slurm cluster: run `make slurm` (scripts/slurm-up.sh) first")


@pytest.fixture
def in_tmp(tmp_path: Path):
    """Run the test with the temporary directory as working directory."""
    old = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)


# -- The suite in two processes (make test) -------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """The tests that use the session engine run in one process, so it is started once; pytest-xdist
    starts that group first (the scope of most tests). Then the longest kinds first, Slurm runs, then
    the other engine tests, so that neither process is left with a long test at the end while the
    other has nothing to do."""
    for item in items:
        if "engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("session-engine"))

    def rank(item) -> int:
        return 0 if item.get_closest_marker("slurm") else 1 if item.get_closest_marker("engine") else 2

    items.sort(key=rank)  # stable: each kind in the order collected


# -- A suite that cannot pass with a whole category missing ------------------------------------------


def pytest_addoption(parser):
    parser.addoption(
        "--require-markers",
        default="",
        help="comma-separated markers (engine,slurm) of which at least one test must pass and none be skipped",
    )


_PASSED: dict[str, int] = {}
_SKIPPED: dict[str, list[str]] = {}


def pytest_runtest_logreport(report):
    for marker in ("engine", "slurm"):
        if marker not in report.keywords:
            continue
        if report.when == "call" and report.passed:
            _PASSED[marker] = _PASSED.get(marker, 0) + 1
        elif report.skipped:
            _SKIPPED.setdefault(marker, []).append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller, which sees every report, checks
    required = [m for m in session.config.getoption("--require-markers").split(",") if m]
    problems = [f"no '{m}' test passed" for m in required if not _PASSED.get(m)]
    problems += [f"'{m}' tests were skipped: {', '.join(_SKIPPED[m][:3])}" for m in required if _SKIPPED.get(m)]
    if problems:
        session.config.get_terminal_writer().line(
            "required test categories did not run: " + "; ".join(problems), red=True
        )
        session.exitstatus = 1


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode, a separate process on a free port) for the
    session, with the test credentials in this process's environment, which the workflow runs and
    their Slurm jobs inherit. Yields its endpoint URL."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"moto's S3 server did not start on port {port} in 60 s")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    yield f"http://127.0.0.1:{port}"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.terminate()
    server.wait(10)


# The test server's credentials (moto accepts any), where AWS tools read them.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def s3_bucket(endpoint: str, name: str) -> Any:
    """A new bucket on the test server; returns a boto3 client of it (the test's own view of the store)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return client


@pytest.fixture
def bounded():
    """A test still running after a minute fails instead of hanging (pytest-timeout is not installed): for
    tests of user code that may hang or end its process."""
    seconds = 60

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the test ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
