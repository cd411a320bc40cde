"""The pooling tasks end to end through the workflow: a classifier (killed with kill -9 mid-shard, then
resumed: the fake engine), and on the real engine an embedding model (local profile, from an OpenAI batch
file), a cross-encoder through the Slurm profile (from vLLM's score and rerank requests) and a reward
model (its raw score). Every row exactly once, each output column of its Arrow type and shape, the stats
and the report consistent with the rows; and a classifier task on a model without a classification head
stops in the preflight."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import MODEL, ROOT, make_rows, write_parquet
from tests.integration.workflow import (
    Background,
    controller_job,
    generate_process,
    part_rows,
    run_workflow,
    workflow_config,
)

CLASSIFIER = ROOT / "models" / "classifier"
REWARD = ROOT / "models" / "reward"


TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges"]


def pooling_run(tmp_path, task: str, model, rows: int, **sections):
    """One shard of ``rows`` unless ``shards`` says otherwise (each shard starts an engine)."""
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(rows))
    config = workflow_config(
        {"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
        task=task,
        prompt={"template": "A short note about {{ topic }}, number {{ n }}.", "chat": False},
        **{"shards": {"rows_per_shard": rows}, **sections},
    )
    config.pop("sampling")
    config["model"]["model"] = str(model)
    return config


def merged(tmp_path, rows: int) -> tuple[pa.Table, dict]:
    table = pq.read_table(tmp_path / "results" / "output.parquet")
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)], "every row exactly once, in order"
    assert table.column("error").null_count == rows
    assert "generation" not in table.column_names and "generated_tokens" not in table.column_names
    assert stats["rows"] == rows and stats["errors"] == 0 and stats["generated_tokens"] == 0
    assert stats["prompt_tokens"] == sum(table.column("prompt_tokens").to_pylist()) > 0
    assert stats["attempt_requests"] == stats["rows_generated"], "one engine request per row generated now"
    assert stats["prompt_tokens_per_s"] > 0 and stats["requests_per_s"] > 0 and stats["output_tokens_per_s"] is None
    assert stats["latency_p50_s"] > 0 and stats["ttft_p50_s"] is None, "a pooled row has a latency, no first token"
    assert stats["gpu_hours"] >= 0 and stats["provenance"]["task"] == stats["task"]
    return table, stats


def test_a_classifier_killed_mid_shard_resumes_and_gives_a_label_and_probabilities_per_row(tmp_path):
    """On the fake engine, at a set speed (the resume is shardgen's; vLLM's probabilities: the pooling
    benchmark's smoke run in test_bench.py, the same values as ``LLM.classify``): the columns follow the
    model's head."""
    rows = 240
    config = pooling_run(tmp_path, "classify", CLASSIFIER, rows, checkpoint={"rows": 8, "seconds": 300})
    config["model"]["max_num_seqs"] = 2
    config["engine"] = {"kind": "fake", "fake": {"tokens_per_second": 300}}  # prompt tokens: about 12 s
    run = Background(tmp_path, config, "local", "--retries", "0")
    ckpt = tmp_path / "results" / "checkpoints" / "00000"
    run.wait_until(lambda: part_rows(ckpt) > 0, 300, "a checkpoint part")
    job = generate_process(tmp_path)
    for p in [*job.children(recursive=True), job]:  # no warning, no save
        p.kill()
    saved = part_rows(ckpt)
    assert 0 < saved < rows
    with pytest.raises(AssertionError, match="snakemake failed"):
        run.wait()
    run_workflow(tmp_path, config, "local", "--retries", "0")  # the same command again

    table, stats = merged(tmp_path, rows)
    shard = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    assert shard["rows_resumed"] == saved and shard["attempt_requests"] == rows - saved, "finished rows not redone"
    labels = ["negative", "neutral", "positive"]
    assert table.schema.field("probs").type == pa.struct([(label, pa.float32()) for label in labels])
    probs = table.column("probs").to_pylist()
    assert all(math.isclose(sum(p.values()), 1.0, rel_tol=1e-5) for p in probs), "softmax probabilities"
    assert table.column("label").to_pylist() == [max(p, key=p.get) for p in probs], "the most likely label"
    assert stats["task"] == "classify"
    totals = (tmp_path / "results" / "plots" / "totals.html").read_text()
    assert "prompt tokens/s" in totals and "rows per GPU-hour" in totals and "output tokens/s" not in totals


@pytest.mark.engine
def test_an_embedding_model_gives_a_fixed_size_normalised_float32_vector_per_row(tmp_path):
    """From an OpenAI batch file of embedding requests to OpenAI's embedding lists (the Parquet
    output's vector column is checked from the shards, which every format is merged from)."""
    from openai.types import CreateEmbeddingResponse

    rows, bad = 30, 12  # request 12 asks for dimensions: not served, its row's error
    requests = [{"custom_id": f"p{i:02d}", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "m", "input": f"A short note about {TOPICS[i % 8]}, number {i}.",
                          **({"dimensions": 8} if i == bad else {})}} for i in range(rows)]  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    config = pooling_run(tmp_path, "embed", MODEL, rows, output={"format": "openai_batch"})
    config["input"], _ = {"openai_batch": [str(tmp_path / "data" / "in.jsonl")]}, config.pop("prompt")
    run_workflow(tmp_path, config, "local")
    out = tmp_path / "results" / "openai"
    ok, failed = ([json.loads(x) for x in (out / n).read_text().splitlines()] for n in ("output.jsonl", "errors.jsonl"))
    assert [line["custom_id"] for line in ok] == [f"p{i:02d}" for i in range(rows) if i != bad]
    assert [line["custom_id"] for line in failed] == [f"p{bad}"] and "body.dimensions" in json.dumps(failed[0])
    hidden = json.loads((MODEL / "config.json").read_text())["hidden_size"]
    vectors = [CreateEmbeddingResponse.model_validate(line["response"]["body"]).data[0].embedding for line in ok]
    assert all(len(v) == hidden and math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
    assert vectors[0] != vectors[1]
    shard = pq.read_table(tmp_path / "results" / "shards" / "00000.parquet")
    assert shard.schema.field("embedding").type == pa.list_(pa.float32(), hidden)
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["task"] == "embed" and stats["num_shards"] == 1 and stats["errors"] == 1


@pytest.mark.engine
def test_a_reward_model_gives_each_row_its_raw_score(tmp_path):
    """A one-output classifier's raw score (no sigmoid): what select.best_of ranks samples by (the
    steps test in test_workflow.py runs the same task on the fake engine)."""
    rows = 8
    config = pooling_run(tmp_path, "reward", REWARD, rows)
    run_workflow(tmp_path, config, "local")
    table, stats = merged(tmp_path, rows)
    assert table.schema.field("reward").type == pa.float32() and stats["task"] == "reward"
    rewards = table.column("reward").to_pylist()
    assert any(not 0 <= x <= 1 for x in rewards) and len(set(rewards)) > 1, "raw scores, one per row"


def flaky_scontrol(bin_dir) -> str:
    """A PATH whose ``scontrol show config`` fails every other call, as it did in CI under load: the
    Slurm plugin then queries sacct for that status check, which fails without accounting, and (but
    for shardgen.commands.statuscheck) loses the run's jobs, so the run waits for ever."""
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{bin_dir}/calls" 2>/dev/null || echo 0); echo $((n + 1)) > "{bin_dir}/calls"\n'
        'if [ "$1 $2" = "show config" ] && [ $((n % 2)) -eq 1 ]; then exit 1; fi\n'
        f'exec {shutil.which("scontrol")} "$@"\n'
    )
    script.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.engine
@pytest.mark.slurm
def test_a_cross_encoder_scores_each_pair_through_slurm(tmp_path, slurm_cluster, monkeypatch):
    """From an OpenAI batch file of vLLM's score and rerank requests (one text with several, N with N,
    a rerank's top_n) to vLLM's score and rerank responses, a line per request (the Parquet output's
    score column is checked from the shard, which every format is merged from). The controller runs
    as a Slurm job (profiles/slurm/controller.sbatch, for clusters that forbid long processes on
    login nodes) and submits the generate job from inside it; Slurm's status queries fail every other
    check meanwhile, and the run still sees its job end."""
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    items = [f"Item {i} is about {TOPICS[i % 8]}." for i in range(6)]
    bodies = [
        ("/score", {"text_1": "What is the sea?", "text_2": items}),
        ("/v1/rerank", {"query": "What is the sea?", "documents": items, "top_n": 2}),
        ("/v1/score", {"queries": [f"What is {t}?" for t in TOPICS[:4]], "documents": items[:4]}),
        ("/rerank", {"query": "What are owls?", "documents": items[:3]}),
        ("/score", {"text_1": "What is tea?"}),  # no text_2: the request's error
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),  # not a score run's url
    ]
    requests = [{"custom_id": f"s{i}", "method": "POST", "url": url, "body": {"model": "m", **body}}
                for i, (url, body) in enumerate(bodies)]  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    rows = 6 + 6 + 4 + 3 + 1 + 1  # a row per pair, one per request that is not valid
    # the controller job holds one of the node's 2 CPUs
    config = pooling_run(tmp_path, "score", REWARD, rows, output={"format": "openai_batch"}, errors={"max_rate": 0.2},
                         resources={"mem_mb": 4000, "cpus_per_task": 1, "runtime": 10})  # fmt: skip
    config["input"], _ = {"openai_batch": [str(tmp_path / "data" / "in.jsonl")]}, config.pop("prompt")
    monkeypatch.setenv("PATH", flaky_scontrol(tmp_path / "bin"))
    controller, log = controller_job(tmp_path, config)
    assert "Falling back to 'sacct'" in log and "status query failed" in log, "a status check failed"
    generate = re.findall(r"submitted with SLURM jobid (\d+)", log)
    assert len(generate) == 1 and generate[0] != controller, log[-3000:]

    out = tmp_path / "results" / "openai"
    ok, failed = ([json.loads(x) for x in (out / n).read_text().splitlines()] for n in ("output.jsonl", "errors.jsonl"))
    assert [line["custom_id"] for line in ok] == ["s0", "s1", "s2", "s3"], "a line per request, in input order"
    assert [line["custom_id"] for line in failed] == ["s4", "s5"]
    assert "body.text_2" in json.dumps(failed[0]) and "but this run serves /score" in json.dumps(failed[1])
    score, rerank, pairs, owls = (line["response"]["body"] for line in ok)
    scores = [d.score for d in ScoreResponse.model_validate(score).data]
    assert len(scores) == 6 and all(0 < x < 1 for x in scores) and len(set(scores)) > 1, "sigmoid scores"
    ranked = sorted(range(6), key=lambda i: -scores[i])[:2]
    top = RerankResponse.model_validate(rerank).results
    assert [r.index for r in top] == ranked and [r.document.text for r in top] == [items[i] for i in ranked]
    assert all(math.isclose(r.relevance_score, scores[r.index], rel_tol=1e-3) for r in top), "the same pairs"
    assert len(ScoreResponse.model_validate(pairs).data) == 4 and len(RerankResponse.model_validate(owls).results) == 3
    shard = pq.read_table(tmp_path / "results" / "shards" / "00000.parquet")
    assert shard.schema.field("score").type == pa.float32() and shard.num_rows == rows
    tokens = [t for t in shard.column("prompt_tokens").to_pylist() if t is not None]  # not an invalid request's
    assert sum(body["usage"]["prompt_tokens"] for body in (score, rerank, pairs, owls)) == sum(tokens), "its pairs'"
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["rows"] == rows and stats["errors"] == 2 and stats["shards"][0]["slurm"]["job_id"]


def test_classify_with_a_model_without_a_classification_head_stops_in_the_preflight(tmp_path):
    config = pooling_run(tmp_path, "classify", MODEL, 10)
    r = run_workflow(tmp_path, config, "local", check=False)
    assert r.returncode != 0
    log = (tmp_path / "results" / "logs" / "preflight.log").read_text()
    assert "task: classify needs a model with a classification head" in log and str(MODEL) in log
    assert not (tmp_path / "results" / "shards").exists() or not list((tmp_path / "results" / "shards").iterdir())
