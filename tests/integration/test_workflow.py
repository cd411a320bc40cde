"""The whole workflow: real Parquet and datasets inputs, the real Slurm; the real engine in the tests marked
engine, the fake one (engine.kind: fake) where what is tested is shardgen's own (reruns, steps, selection)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import subprocess
import time
from collections import Counter

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from shardgen.base.installed import slurm_plugin_problem
from shardgen.base.rundir import RunDir
from shardgen.features.rollouts.tools import ERROR_PREFIX
from shardgen.features.steps import DROPPED
from tests.conftest import ROOT, TEST_MODEL_CFG, make_rows, s3_bucket, write_parquet
from tests.integration.workflow import (
    BIN,
    Background,
    dry_run_jobs,
    finished_shards,
    generate_process,
    part_rows,
    run_workflow,
    slurm_jobs,
    workflow_config,
)

STATS_KEYS = {
    "rows",
    "errors",
    "prompt_tokens",
    "generated_tokens",
    "generation_seconds",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "prefix_cache_hit_rate",
    "gpu_hours",
    "shards",
}


def check_output(workdir, ids: list[str]) -> tuple:
    table = pq.read_table(workdir / "results" / "output.parquet")
    stats = json.loads((workdir / "results" / "stats.json").read_text())
    assert table.column("id").to_pylist() == ids, "every row exactly once, in input order"
    assert table.column("row_index").to_pylist() == list(range(len(ids)))
    assert all(g and g.strip() for g in table.column("generation").to_pylist())
    assert None not in table.column("finish_reason").to_pylist()
    assert STATS_KEYS <= set(stats)
    assert stats["rows"] == len(ids) and stats["errors"] == 0
    assert stats["generated_tokens"] == pc.sum(table.column("generated_tokens")).as_py()
    # the totals are the sums over the shards, and the token counts those of the output rows
    for key in ("rows", "errors", "prompt_tokens", "generated_tokens", "gpu_hours"):
        assert stats[key] == pytest.approx(sum(s[key] for s in stats["shards"])), key
    assert stats["prompt_tokens"] == pc.sum(table.column("prompt_tokens")).as_py()
    assert stats["output_tokens_per_s"] > 0 and stats["ttft_p50_s"] > 0 and stats["gpu_hours"] > 0
    return table, stats


@pytest.mark.engine
@pytest.mark.slurm
def test_slurm_profile_submits_a_job_per_shard_without_pausing_retries_a_killed_one_alone_and_merges_every_row(
    tmp_path, slurm_cluster, s3_server
):
    """The input is two objects in S3-compatible storage (the test server), read in place by the jobs,
    and the output is uploaded there (output.upload), byte for byte. The first shard's job is killed
    (kill -9) once it saved rows: its retry resumes them, reading the rest from the objects again. The
    request store is there too (cache.dir), written as the rows are saved: each shard's rows repeat its
    prompts (8 topics, the shard's part), so each job answers some rows from it or from a request in flight,
    the killed one's retry included; no shard's prompts are another's, so the first shard is generated
    whichever job Slurm runs first."""
    sizes, files, start = [12, 8], [], 0
    store = s3_bucket(s3_server, "slurm-in")
    s3_bucket(s3_server, "slurm-out")
    for i, n in enumerate(sizes):
        files.append(str(write_parquet(tmp_path / "data" / f"part-{i}.parquet", make_rows(n, start))))
        store.upload_file(files[-1], "slurm-in", f"data/part-{i}.parquet")
        start += n
    # a JSON extraction: every row's answer parses into the typed `parsed` column;
    # compact JSON through an engine setting passed as model.extra
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}}, "required": ["answer"]}
    compact = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    config = workflow_config(
        {"parquet": ["s3://slurm-in/data/*.parquet"], "id_column": "id",
         "storage_options": {"endpoint_url": s3_server}},
        shards={"rows_per_shard": 10},
        # a row at a time, saved every 2: the job is killed between two saves
        model={**TEST_MODEL_CFG, "extra": compact, "max_num_seqs": 1},
        checkpoint={"rows": 2, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 48, "structured_outputs": {"json": schema}},
        output={"upload": "s3://slurm-out/run/"},
        cache={"dir": "s3://slurm-out/cache"},
        prompt={"system": "Answer in one short sentence.", "template": "What is {{ topic }}? (part {{ n // 10 }})"},
    )  # fmt: skip
    # the two jobs go out in one round: no pause between submissions (plugin >= 2.7.1; 2.6.1 pauses
    # 5 s per pair); the node's 2 CPUs run one job at a time, and the first shard's job, killed
    # once it saved rows, is the one submitted again
    assert slurm_plugin_problem() is None
    run = Background(tmp_path, config, "slurm")
    ckpt = tmp_path / "results" / "checkpoints" / "00000"
    run.wait_until(lambda: ckpt.exists() and part_rows(ckpt) > 0, 600, "the first shard's saved rows")
    killed = json.loads((ckpt / "attempts.jsonl").read_text().splitlines()[0])["slurm"]["job_id"]
    job = generate_process(tmp_path, "--shard", "00000")
    for p in [*job.children(recursive=True), job]:  # no warning, no save: as a node failure
        p.kill()
    saved = part_rows(ckpt)
    assert 0 < saved < 10
    text = run.wait()
    table, stats = check_output(tmp_path, [f"r{i:05d}" for i in range(20)])
    assert all(isinstance(p["answer"], str) for p in table.column("parsed").to_pylist())
    assert all(g.startswith('{"answer":') for g in table.column("generation").to_pylist()), "compact JSON"
    assert len(stats["shards"]) == 2  # 20 rows in shards of 10: the second has rows of both files
    for s in stats["shards"]:
        assert s["slurm"].get("job_id"), "each shard ran as a Slurm job"
        assert s["cuda_visible_devices"] == "0", "the job was given one (fake) GPU by the scheduler"
        assert s["gpus"] == 1
        assert "OMP_NUM_THREADS" in s["thread_env_removed"]
        assert s["queue_wait_seconds"] >= 0 and s["slurm"]["submit_time"], "Slurm's queue wait, from scontrol"
    shard_dir = tmp_path / "results" / "shards"
    attempts = [json.loads((shard_dir / f"{s['shard']}.stats.json").read_text())["attempts"] for s in stats["shards"]]
    assert [len(a) for a in attempts] == [2, 1], "only the killed shard ran again"
    assert attempts[0][0]["outcome"] is None and attempts[0][0]["slurm"]["job_id"] == killed
    first = json.loads((shard_dir / "00000.stats.json").read_text())
    answered = first["attempt_requests"] + first["requests_reused"] + first["requests_deduplicated"]
    assert first["rows_resumed"] == saved and answered == 10 - saved, "its saved rows resumed, the others answered"
    sources = table.column("result_source").to_pylist()
    assert set(sources) <= {"engine", "store", "duplicate"} and len(sources) - sources.count("engine") >= 4, sources
    by_prompt = {}  # rows 8 and 9 of each shard repeat its rows 0 and 1
    for row in table.select(["topic", "n", "generation"]).to_pylist():
        key = (row["topic"], row["n"] // 10)
        assert by_prompt.setdefault(key, row["generation"]) == row["generation"], "one request, one result"
    assert store.list_objects_v2(Bucket="slurm-out", Prefix="cache/entries/")["KeyCount"] > 0
    first_round = sorted(datetime.datetime.fromisoformat(a[0]["slurm"]["submit_time"]) for a in attempts)
    assert (first_round[-1] - first_round[0]).total_seconds() < 4, first_round
    assert "output: results/output.parquet" in text
    # the compute side read the objects before any generate job: a Slurm job of its own
    reach = json.loads((tmp_path / "results" / "plan" / "storage-reach.json").read_text())
    assert reach["objects"] == ["s3://slurm-in/data/part-0.parquet"] and reach["slurm_job_id"], reach
    # the objects' rows, as the same files on local disk hold them; the output, stats and card uploaded
    local = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert table.select(["id", "topic", "n"]).to_pylist() == local
    uploaded = json.loads((tmp_path / "results" / "uploaded.json").read_text())
    names = ["output.parquet", "stats.json", "README.md"]
    assert uploaded["uploaded"] == [f"s3://slurm-out/run/{name}" for name in names]
    for name in names:
        body = store.get_object(Bucket="slurm-out", Key=f"run/{name}")["Body"].read()
        assert body == (tmp_path / "results" / name).read_bytes(), name
    assert dry_run_jobs(tmp_path, config, "slurm") == {}, "nothing to do again, nothing uploaded again"


def test_local_profile_runs_a_dataset_saved_with_save_to_disk_into_a_datasets_directory(tmp_path, monkeypatch):
    """Run from Python (``shardgen.run``, as the command line), and the same rows through
    ``shardgen.generate`` give the same rows and columns."""
    import datasets

    import shardgen

    rows = make_rows(14)
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    # one shard (the Slurm test runs several), on the fake engine: what is tested is what reruns
    config = workflow_config({"disk": str(tmp_path / "ds")}, shards={"rows_per_shard": 14}, output={"format": "hf"},
                             engine={"kind": "fake"})  # fmt: skip
    monkeypatch.setenv("PATH", f"{BIN}:{os.environ['PATH']}")  # the jobs' `shardgen` command
    result = shardgen.run(config, profile="local", directory=tmp_path)
    assert result.output == tmp_path / "results" / "output" and result.stats["rows"] == 14
    ds = datasets.load_from_disk(str(tmp_path / "results" / "output"))
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats == result.stats
    table = shardgen.generate(datasets.Dataset.from_list(rows), config, workdir=tmp_path / "work")
    shardgen.close()
    assert table.column_names == ds.column_names
    differ = [c for c in table.column_names if table.column(c).to_pylist() != ds[c]]
    assert differ == [], differ
    assert ds["id"] == [r["id"] for r in rows] and ds["row_index"] == list(range(14))
    assert all(g.strip() for g in ds["generation"]) and stats["rows"] == 14 and stats["errors"] == 0
    assert json.loads(ds.info.description)["shardgen_provenance"]["config_fingerprint"] == stats["config_fingerprint"]
    assert [s["rows"] for s in stats["shards"]] == [14]
    # a second run finds everything up to date and runs nothing
    r = run_workflow(tmp_path, config, "local")
    assert "Nothing to be done" in r.stdout + r.stderr
    # nor does a change of resources, memory settings or checkpoint interval
    # (real runs: a dry run stops at the plan checkpoint once the config changed)
    shard_files = sorted((tmp_path / "results" / "shards").glob("*.parquet"))
    mtimes = [p.stat().st_mtime_ns for p in shard_files]
    config["resources"]["runtime"] = 90
    config["model"]["max_num_seqs"] = 8
    config["checkpoint"] = {"rows": 5, "seconds": 60}
    config["prompt"]["order"] = "input"
    r = run_workflow(tmp_path, config, "local")
    assert "rule generate_shard:" not in r.stdout + r.stderr
    assert [p.stat().st_mtime_ns for p in shard_files] == mtimes
    # A dry run lists what a change would rerun: a change of what decides the text reruns the shard...
    for key, value in [("prompt", {**config["prompt"], "template": "Who is {{ topic }}?"}),
                       ("model", {**config["model"], "seed": 1}),
                       ("sampling", {**config["sampling"], "max_tokens": 6})]:  # fmt: skip
        assert dry_run_jobs(tmp_path, {**config, key: value}).get("generate_shard") == 1, key
    # ...a change of the input plans again first (a dry run cannot see past the plan), and so does
    # an input file changed in place...
    assert "plan_shards" in dry_run_jobs(tmp_path, {**config, "input": {**config["input"], "id_column": "id"}})
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    os.utime(arrow, ns=(arrow.stat().st_atime_ns, arrow.stat().st_mtime_ns + 10**9))
    assert "plan_shards" in dry_run_jobs(tmp_path, config)
    os.utime(arrow, ns=(arrow.stat().st_atime_ns, arrow.stat().st_mtime_ns - 10**9))
    # ...and a change of output format, or of the price of a GPU-hour, merges again and generates nothing
    for key, value in [("output", {"format": "jsonl"}), ("cost", {"gpu_hour": 2.5})]:
        jobs = dry_run_jobs(tmp_path, {**config, key: value})
        assert "merge_shards" in jobs and "generate_shard" not in jobs and "plan_shards" not in jobs, (key, jobs)


def test_an_hf_input_whose_local_data_file_grew_is_planned_again_not_kept_or_refused_forever(tmp_path):
    """input.hf with a local data file: the file grew after planning. The run used to say "Nothing to
    be done" and keep the old plan (or fail every job "changed after planning" with no way out): the
    file is now in what decides replanning. Planning only: no engine runs."""
    data = tmp_path / "data" / "topics.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(8)))
    config = workflow_config({"hf": {"path": "json", "data_files": str(data)}})
    run_workflow(tmp_path, config, "local", "--until", "plan_shards")
    manifest = tmp_path / "results" / "plan" / "manifest.json"
    assert json.loads(manifest.read_text())["total_rows"] == 8
    assert "plan_shards" not in dry_run_jobs(tmp_path, config)
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(10)))  # two rows more
    assert "plan_shards" in dry_run_jobs(tmp_path, config)
    run_workflow(tmp_path, config, "local", "--until", "plan_shards")
    assert json.loads(manifest.read_text())["total_rows"] == 10


@pytest.mark.engine
def test_a_labelling_run_with_hostile_values_runs_no_shell_code_and_leaks_no_token(tmp_path, monkeypatch, capfd):
    """Shell metacharacters in values, a column named like a path, an output
    directory with a space, and a token in the environment: the run labels
    every row (two shards in one job), runs nothing it was not asked to, and
    the token appears nowhere. It runs shardgen as a Snakemake module of the
    user's own Snakefile, whose handlers then still run (the lock, the summary);
    from Python (``shardgen.run``, which finds the user's Snakefile in its directory)."""
    import shardgen

    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    token = "hf_ShardgenTestSecret0123456789abcdef"
    monkeypatch.setenv("HF_TOKEN", token)
    rows = [
        {"id": f"$(touch {marker})", "text": "I loved it; the best tea ever.", "../../evil": "a"},
        {"id": f"`touch {marker}`", "text": "Terrible; it broke at once.", "../../evil": "b"},
        {"id": "; rm -rf ~ #", "text": f"$(touch {marker}) is fine", "../../evil": "c"},
        {"id": "r4", "text": "It is a clock.", "../../evil": "d"},
    ]
    write_parquet(tmp_path / "data" / "in.parquet", rows)
    config = workflow_config(
        {"parquet": ["data/in.parquet"], "id_column": "id"},
        # two shards in one job, on one engine
        shards={"rows_per_shard": 2, "per_job": 2},
        prompt={
            "system": f"Label reviews. $(touch {marker}) `touch {marker}` ; rm -rf ~",
            "template": "Review: {{ text }}\nLabel:",
        },
        sampling={"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["positive", "negative"]}},
        output={"dir": "out dir; echo pwned", "format": "jsonl", "choice_probs": True},
    )
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(
        f'module shardgen:\n    snakefile:\n        "{ROOT / "Snakefile"}"\n    config:\n        config\n\n\n'
        "use rule * from shardgen\n"
    )
    monkeypatch.setenv("PATH", f"{BIN}:{os.environ['PATH']}")  # the jobs' `shardgen` command
    result = shardgen.run(config, profile="local", directory=tmp_path)
    assert not marker.exists(), "no config or row value ran as a shell command"
    out = tmp_path / "out dir; echo pwned"
    assert result.output == out / "output.jsonl" and result.stats["rows"] == 4
    assert RunDir(out).lock.exists(), "the module's onstart took the run's lock"
    said = capfd.readouterr()
    assert f"output: {out.name}/output.jsonl" in said.out + said.err, "the module's onsuccess printed the summary"
    lines = [json.loads(line) for line in (out / "output.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [r["id"] for r in rows]
    assert [r["../../evil"] for r in lines] == ["a", "b", "c", "d"], "a column named like a path is just a column"
    for r in lines:
        assert r["error"] is None and r["label"] in ("positive", "negative")
        assert abs(sum(r["choice_probs"].values()) - 1) < 1e-6 and r["label_prob"] > 0
    assert not list(tmp_path.parent.glob("evil*")) and not (tmp_path / "evil").exists()
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] == 4 and stats["provenance"]["model_digest"].startswith("sha256:")
    # the model's local directory by its last component only (output.provenance_paths is off)
    assert stats["provenance"]["model"] == "<local>/" + config["model"]["model"].rsplit("/", 1)[-1]
    first, second = (json.loads((out / "shards" / f"0000{i}.stats.json").read_text()) for i in (0, 1))
    assert first["engine_start_seconds"] > 5 and second["engine_start_seconds"] < 1, "one engine start per job"
    assert (out / "logs" / "generate_shards" / "00000.log").exists()
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert leaked == [], f"the HF token was written to {leaked}"
    shared = [str(p) for p in out.rglob("*") if p.is_file() and p.stat().st_mode & 0o007]
    assert shared == [], f"other users may read {shared} (output.world_readable is false)"


# The steps test's function: a line per call (the row's id and sample), and one sample of each row turned down.
CHECK = """\
import json

CALLS = {calls!r}


def check(row):
    with open(CALLS, "a") as f:
        f.write(json.dumps([row["id"], row["sample_index"]]) + "\\n")
    return {{"keep": row["sample_index"] != 2}}
"""


@pytest.mark.slurm
def test_steps_keep_the_best_of_four_samples_by_a_reward_model_and_a_rerun_redoes_only_what_changed(
    tmp_path, slurm_cluster
):
    """A run of three steps through the Slurm profile, on the fake engine (what is tested is how steps
    chain, select and rerun; the reward model on vLLM: test_pooling): four seeded samples per row
    (draft), a Python function on each sample in CPU jobs (check, ``keep_if``: it turns down one
    sample of each row), then the test reward model on the samples it kept (judge) with
    ``select.best_of``. The run is stopped (Ctrl-C) once the judge committed a shard; the rerun redoes
    no shard of the draft or the check and not that one. The function ran once per sample; the output
    has every input row once, with the kept sample the judge scored highest; each step's own output
    every row it made. A change of the judge's prompt reruns the judge's jobs alone, which generate every
    judgement anew; a change of the last select, the selection alone (pairs: the best and worst sample of
    each row); back at the first prompt, the judge's jobs take every judgement from the request store."""
    rows = 6
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(rows))
    config = workflow_config({"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
                             shards={"rows_per_shard": 3})  # fmt: skip
    config.pop("sampling")
    # slow enough that the run is stopped before the judge's second shard is done (a shard 5-10 s)
    config["engine"] = {"kind": "fake", "fake": {"tokens_per_second": 20}}
    config["cache"] = {}  # the request store, each step's own
    reward = {**TEST_MODEL_CFG, "model": str(ROOT / "models" / "reward")}
    judge_prompt = {"template": "Question: What is {{ topic }}?\nAnswer: {{ generation }}", "chat": False}
    calls = tmp_path / "check-calls"
    (tmp_path / "check.py").write_text(CHECK.format(calls=str(calls)))
    check = {"path": "check.py", "name": "check", "columns": {"keep": "bool"}, "processes": 1}
    config["steps"] = [
        {"name": "draft", "sampling": {"n": 4, "seed": 7, "temperature": 1.0, "max_tokens": 8}},
        {"name": "check", "function": check, "select": {"keep_if": "keep"},
         "resources": {"cpus_per_task": 1, "mem_mb": 1000, "runtime": 5}},
        {"name": "judge", "task": "reward", "model": reward, "prompt": judge_prompt,
         "select": {"best_of": {"by": "reward"}}},
    ]  # fmt: skip
    out = tmp_path / "results"
    draft, checked, judge = (RunDir(out / "steps" / name) for name in ("draft", "check", "judge"))
    run = Background(tmp_path, config, "slurm")

    def finished(step: str) -> set[str]:
        return finished_shards(run.output(), f"{step}_generate_shard")

    run.wait_until(lambda: len(finished("draft")) == len(finished("check")) == 2 and finished("judge"), 600,
                   "the draft, the check, and a judge shard")  # fmt: skip
    judged = [p for s in finished("judge") for p in (judge.shard_file(s), judge.shard_stats(s))]
    done = [*draft.shards.glob("*"), *checked.shards.glob("*"), *judged]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in done}
    run.proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the run's jobs are cancelled
    run.proc.wait(120)
    run.out.close()
    assert "shardgen: error: interrupted (SIGINT" in run.output(), "Ctrl-C stops the run (shardgen.commands.runstop)"
    deadline = time.time() + 120  # a vLLM job's SIGTERM, KillWait (30 s), then the node's cleanup
    while set(slurm_jobs(tmp_path).values()) & {"RUNNING", "PENDING", "COMPLETING"} and time.time() < deadline:
        time.sleep(0.5)
    assert set(slurm_jobs(tmp_path).values()) <= {"CANCELLED", "COMPLETED"}, slurm_jobs(tmp_path)

    text = run_workflow(tmp_path, config, "slurm").stdout
    kept = {p for p, key in before.items() if p.exists() and (p.stat().st_ino, p.stat().st_mtime_ns) == key}
    assert kept == set(before), f"redone after the stop: {sorted(set(before) - kept)}"
    assert not any(f"{step}_generate_shard" in line for line in text.splitlines() if "rule " in line
                   for step in ("draft", "check"))  # fmt: skip
    for shard in ("00000", "00001"):  # each draft and check shard made once
        assert len(json.loads(draft.shard_stats(shard).read_text())["attempts"]) == 1
        assert len(json.loads(checked.shard_stats(shard).read_text())["attempts"]) == 1
    samples = {(f"r{i:05d}", s) for i in range(rows) for s in range(4)}
    # once per sample (the preflight does not call a later step's function: its rows do not exist yet)
    called = Counter(tuple(c) for c in map(json.loads, calls.read_text().splitlines()))
    assert called == dict.fromkeys(samples, 1), called

    # raw scores, not probabilities
    judged = pq.read_table(judge.merged("parquet")).to_pylist()  # every sample kept, with the draft's columns
    assert len(judged) == rows * 3 and DROPPED not in judged[0]
    assert {(r["id"], r["sample_index"]) for r in judged} == {(i, s) for i, s in samples if s != 2}
    assert all(r["generation"] and r["error"] is None for r in judged)
    assert any(r["reward"] < 0 or r["reward"] > 1 for r in judged) and len({r["reward"] for r in judged}) > 1
    best = {}
    for r in judged:
        if r["id"] not in best or r["reward"] > best[r["id"]]["reward"]:
            best[r["id"]] = r
    output = pq.read_table(out / "output.parquet").to_pylist()
    assert [r["id"] for r in output] == [f"r{i:05d}" for i in range(rows)], "every input row once, in order"
    assert [(r["sample_index"], r["generation"], r["reward"]) for r in output] == [
        (best[r["id"]]["sample_index"], best[r["id"]]["generation"], best[r["id"]]["reward"]) for r in output
    ], "the sample the judge scored highest"
    stats = json.loads((out / "stats.json").read_text())
    assert [(s["name"], s["rows"], s["rows_passed_on"]) for s in stats["steps"]] == [
        ("draft", rows, rows * 4), ("check", rows * 4, rows * 3), ("judge", rows * 3, rows)
    ]  # fmt: skip
    assert stats["gpu_hours"] == pytest.approx(sum(s["gpu_hours"] for s in stats["steps"])) and stats["gpu_hours"] > 0
    assert stats["steps"][1]["gpu_hours"] == 0
    assert [s["name"] for s in stats["provenance"]["steps"]] == ["draft", "check", "judge"]
    assert stats["steps"][2]["span_s"] > 0 and stats["steps"][2]["start_after_input_p50_s"] is not None
    assert "step judge" in text and f"{rows} output rows" in text
    status = subprocess.run([str(BIN / "shardgen"), "status", "--dir", str(out)], capture_output=True, text=True)
    assert "step draft:" in status.stdout and "step judge:" in status.stdout, status.stdout + status.stderr

    changed = {**config, "steps": [*config["steps"][:2], {**config["steps"][2], "prompt": {
        **judge_prompt, "template": "Answer: {{ generation }}"}}]}  # fmt: skip
    jobs = dry_run_jobs(tmp_path, changed)
    assert jobs.get("judge_generate_shard") == 2 and not any(j.startswith(("draft_", "check_")) for j in jobs), jobs
    pairs = {**config, "steps": [*config["steps"][:2], {**config["steps"][2], "select": {"pairs": {"by": "reward"}}}]}
    assert dry_run_jobs(tmp_path, pairs) == {"select_output": 1, "all": 1}
    fast = {"kind": "fake", "fake": {"tokens_per_second": 5000}}  # the engine's speed is not in the fingerprint

    def judge_figures() -> list[int]:
        shards = [json.loads(judge.shard_stats(s).read_text()) for s in ("00000", "00001")]
        return [sum(s[k] for s in shards) for k in ("rows_generated", "requests_reused", "requests_deduplicated")]

    text = run_workflow(tmp_path, {**changed, "engine": fast}, "local").stdout
    assert not any("draft_generate_shard" in line for line in text.splitlines() if "rule " in line)
    # the judge's rows: the three samples of each row the check kept, and the one it dropped (no request)
    assert judge_figures() == [rows * 4, 0, 0], "every judgement anew"
    run_workflow(tmp_path, {**pairs, "engine": fast}, "local")  # the first judge prompt again
    assert judge_figures() == [rows, rows * 3, 0], "every judgement from the store"
    assert {r["result_source"] for r in pq.read_table(judge.merged("parquet")).to_pylist()} == {"store"}
    chosen = pq.read_table(out / "output.parquet").to_pylist()
    assert [p["chosen"]["id"] for p in chosen] == [f"r{i:05d}" for i in range(rows)]
    assert all(p["chosen"]["id"] == p["rejected"]["id"] and p["chosen"]["reward"] > p["rejected"]["reward"]
               and p["chosen"]["sample_index"] == best[p["chosen"]["id"]]["sample_index"] for p in chosen)  # fmt: skip


# The rollout's tool: a line per call; it raises for Norway, and hangs on a job's first call for Italy.
CAPITAL = """\
import json
import os
import time

CALLS = {calls!r}
CAPITALS = {{"france": "Paris", "italy": "Rome"}}


def capital(country):
    with open(CALLS, "a") as f:
        f.write(json.dumps(country) + "\\n")
    if country == "norway":
        raise LookupError("no capital on file for norway")
    hung = CALLS + ".hung-" + os.environ.get("SLURM_JOB_ID", "")
    if country == "italy" and not os.path.exists(hung):
        open(hung, "w").close()
        time.sleep(30)
    return {{"capital": CAPITALS[country]}}
"""
CAPITAL_SCHEMA = {"type": "object", "required": ["country"],
                  "properties": {"country": {"type": "string", "enum": ["france", "italy", "norway"]}}}  # fmt: skip
# The verifier: a line per call; per-row errors of three kinds, and the job killed once (from inside).
VERIFY = """\
import json
import multiprocessing
import os
import signal
import time

CALLS = {calls!r}


def verify(row):
    key = row["id"]
    with open(CALLS, "a") as f:  # a line per call: the test counts them
        f.write(key + "\\n")
    if key == "r00001":
        raise ValueError("cannot verify this one\\nsecond line")
    if key == "r00002":
        time.sleep(60)
    if key == "r00003":
        return {{"keep": "yes", "answers": 1}}
    if key == "r00006" and not os.path.exists(CALLS + ".killed"):
        open(CALLS + ".killed", "w").close()
        time.sleep(2)  # the rows before are saved (checkpoint.rows 1)
        # the job's process dies: Slurm fails the job, Snakemake retries it (the worker's parent is a forkserver)
        os.kill(multiprocessing.parent_process().pid, signal.SIGKILL)
    answers = [m["content"] for m in json.loads(row["messages"]) if m["role"] == "tool"]
    return {{"keep": (len(answers) + row["n"]) % 2 == 0, "answers": len(answers)}}
"""


@pytest.mark.engine
@pytest.mark.slurm
def test_a_rollout_then_a_function_step_keep_each_conversation_once_through_kills_of_both_jobs(tmp_path, slurm_cluster):
    """A rollout with tools (``tool_choice: required``, the real engine) -> verify (a Python function in
    a CPU job) -> ``keep_if``, through the Slurm profile. The rollout's job is killed (kill -9) once it
    saved conversations, and the verifier's kills itself on one row: each retry resumes, and every row
    is in each step's output once. Every conversation is OpenAI chat format, each tool result the
    tool's value for its call, or the error of a tool that raised or hung past its timeout, after which
    the conversation went on; none longer than max_turns. The verifier's rows that raise, pass their
    timeout or return a wrong type are those rows' errors; it ran once per row (the one that killed its
    job twice, the killed job's saved rows not again). An edited function reruns only its step and the
    selection; a function file that does not import is refused before any job."""
    from openai.types.chat import ChatCompletionMessageParam
    from pydantic import TypeAdapter

    rows = 12
    countries = ["france", "italy", "norway"]
    write_parquet(tmp_path / "data" / "in.parquet", [{"id": f"r{i:05d}", "country": countries[i % 3], "n": i}
                                                     for i in range(rows)])  # fmt: skip
    tool_calls, verify_calls = tmp_path / "tool-calls", tmp_path / "verify-calls"
    (tmp_path / "capital.py").write_text(CAPITAL.format(calls=str(tool_calls)))
    (tmp_path / "verify.py").write_text(VERIFY.format(calls=str(verify_calls)))
    # compact JSON calls (an engine setting passed as model.extra); 2 sequences at a time, so the
    # conversations finish a few at a time and the job is killed with some saved and some not
    compact = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    config = workflow_config({"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
                             shards={"rows_per_shard": rows}, checkpoint={"rows": 1},
                             model={**TEST_MODEL_CFG, "max_num_seqs": 2, "extra": compact},
                             prompt={"template": "Use the tool: what is the capital of {{ country }}?"},
                             errors={"max_rate": 0.5})  # fmt: skip
    config.pop("sampling")
    tools = [{"path": "capital.py", "name": "capital", "schema": CAPITAL_SCHEMA, "example": {"country": "france"}}]
    function = {"path": "verify.py", "name": "verify", "columns": {"keep": "bool", "answers": "int64"},
                "timeout_seconds": 3, "processes": 1}  # fmt: skip
    config["steps"] = [
        {"name": "solve", "sampling": {"temperature": 0.0, "max_tokens": 32},
         "rollout": {"max_turns": 2, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
                     "tool_processes": 2, "tool_timeout_seconds": 2}},
        {"name": "verify", "function": function, "select": {"keep_if": "keep"},
         "resources": {"cpus_per_task": 1, "mem_mb": 1000, "runtime": 5}},
    ]  # fmt: skip
    out = tmp_path / "results"
    solve, verify = RunDir(out / "steps" / "solve"), RunDir(out / "steps" / "verify")
    run = Background(tmp_path, config, "slurm")
    ckpt = out / "steps" / "solve" / "checkpoints" / "00000"
    run.wait_until(lambda: ckpt.exists() and part_rows(ckpt) > 0, 600, "conversations saved by the rollout's job")
    job = generate_process(tmp_path)
    for p in [*job.children(recursive=True), job]:  # the node's OOM killer: no warning, no save
        p.kill()
    saved = part_rows(ckpt)
    assert 0 < saved < rows
    text = run.wait()

    conversations = pq.read_table(solve.merged("parquet")).to_pylist()
    assert [r["id"] for r in conversations] == [f"r{i:05d}" for i in range(rows)], "every row once, in order"
    validate = TypeAdapter(list[ChatCompletionMessageParam]).validate_python
    # what the model is told of each call: the tool's value, or why there is none (and the row goes on)
    hung = ERROR_PREFIX + "the tool capital took more than 2 s (rollout.tool_timeout_seconds); stopped"
    told = {
        "france": ['{"capital": "Paris"}'],
        "italy": ['{"capital": "Rome"}', hung],
        "norway": [ERROR_PREFIX + "LookupError: no capital on file for norway"],
    }
    asked = Counter()
    for r in conversations:
        messages = json.loads(r["messages"])
        validate(messages)  # OpenAI's chat format, as the openai package types it
        # a call every turn (required, one per turn), so every row runs to max_turns, and no further
        assert r["error"] is None and r["turns"] == 2 and r["finish_reason"] == "max_turns", r
        assert messages[0]["role"] == "user"
        calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        assert (
            len(calls) == r["tool_calls"] == len(results)
            and sum(m["role"] == "assistant" for m in messages) == r["turns"]
        )
        for call in calls:  # each result the tool's for the call's arguments
            country = json.loads(call["function"]["arguments"])["country"]
            assert results[call["id"]] in told[country], (call, results)
            asked[results[call["id"]]] += 1
    # a tool that raised, one that hung (each job's first call for Italy: the killed one's may be saved)
    assert asked[told["norway"][0]] > 0 and asked[hung] in (1, 2), asked
    solve_stats = json.loads(solve.shard_stats("00000").read_text())
    killed, finished = solve_stats["attempts"]
    assert killed["outcome"] is None and finished["outcome"] == "committed"
    assert solve_stats["rows_resumed"] == saved and solve_stats["attempt_requests"] >= rows - saved
    assert solve_stats["feed"]["rollout"]["rows"] == rows - saved, "the saved conversations were not run again"
    # the preflight's example call, then each conversation's calls: those of the killed job's unsaved ones twice
    recorded = [json.loads(line) for line in tool_calls.read_text().splitlines()]
    assert recorded[0] == "france" and len(recorded) - 1 >= sum(r["tool_calls"] for r in conversations)

    made = pq.read_table(verify.merged("parquet")).to_pylist()  # every row, with its function's columns
    assert [r["id"] for r in made] == [f"r{i:05d}" for i in range(rows)]
    by_id = {r["id"]: r for r in made}
    assert by_id["r00001"]["error"] == "exception: ValueError: cannot verify this one"
    assert by_id["r00002"]["error"].startswith("timeout: ")
    assert by_id["r00003"]["error"] == "wrong_type: column 'keep': str 'yes', not bool"
    for key, r in by_id.items():
        if key not in ("r00001", "r00002", "r00003"):
            assert r["error"] is None and r["answers"] == r["tool_calls"], r
            assert r["keep"] == ((r["answers"] + r["n"]) % 2 == 0)
    kept = [k for k, r in by_id.items() if r["keep"] is True and r["error"] is None]
    assert 0 < len(kept) < rows
    output = pq.read_table(out / "output.parquet").to_pylist()
    assert [r["id"] for r in output] == kept, "exactly the rows it returned true for, once"
    counted = Counter(verify_calls.read_text().split())
    # once per row: the one whose call killed the job twice, and the next, which the killed job's
    # worker process may have started as it died (rows in flight when a job dies run again)
    assert set(counted) == set(by_id) and max(counted.values()) == 2, counted
    assert counted["r00006"] == 2 and {k for k, n in counted.items() if n > 1} <= {"r00006", "r00007"}, counted
    killed = json.loads(verify.shard_stats("00000").read_text())
    assert len(killed["attempts"]) == 2 and killed["rows_resumed"] == 6, killed["attempts"]  # r00000-r00005 saved
    assert killed["gpus"] == 0 and killed["gpu_hours"] == 0 and killed["feed"]["processes"] == 1
    stats = json.loads((out / "stats.json").read_text())
    assert [(s["name"], s["rows"], s["output_rows"], s["errors"]) for s in stats["steps"]] == [
        ("solve", rows, rows, 0), ("verify", rows, rows, 3)]  # fmt: skip
    assert stats["output_rows"] == len(kept)
    solve_prov, verify_prov = (stats["provenance"]["steps"][i] for i in (0, 1))
    code = hashlib.sha256((tmp_path / "verify.py").read_bytes()).hexdigest()
    assert verify_prov["function"]["name"] == "verify" and verify_prov["function"]["code"]["file_sha256"] == code
    tool_code = hashlib.sha256((tmp_path / "capital.py").read_bytes()).hexdigest()
    assert solve_prov["rollout"]["tools"][0]["code"]["file_sha256"] == tool_code
    assert "step verify" in text

    (tmp_path / "verify.py").write_text(VERIFY.format(calls=str(verify_calls)) + "\n# edited\n")
    jobs = dry_run_jobs(tmp_path, config)
    assert jobs.get("verify_generate_shard") == 1 and "select_output" in jobs, jobs
    assert not any(j.startswith("solve_") for j in jobs), jobs

    (tmp_path / "verify.py").write_text("def verify(row):\n    return {'keep': True\n")
    failed = run_workflow(tmp_path, config, "slurm", check=False)
    said = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "verify.py, line 2: syntax error" in said, said[-3000:]
    assert "rule verify_generate_shard" not in said, "no job of the step ran"
