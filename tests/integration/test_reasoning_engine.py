"""A reasoning model on the real engine (CPU build): the trace apart from the answer, the thinking
budget, structured outputs after the trace, and a trace cut by max_tokens."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from shardgen.data.plan import write_manifest
from shardgen.engines.vllm import Engine
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import base_config, write_parquet

pytestmark = pytest.mark.engine

LABELS = ["positive", "negative"]
BUDGET = 4


def reasoner_model(reasoner_dir) -> dict:
    """The model section of every shard of the test (one engine); compact JSON for the rollout's tool
    calls (the test model's answers would fill a JSON object with whitespace)."""
    compact = {"backend": "xgrammar", "disable_any_whitespace": True}
    return {"model": str(reasoner_dir), "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20,
            "extra": {"structured_outputs_config": compact}}  # fmt: skip


def shard(tmp_path, engine, rows, reasoner_dir, prompt=None, inputs=None, **overrides):
    """Plan ``rows`` as one shard on the reasoning model, run it on ``engine``; the table and stats."""
    data = write_parquet(tmp_path / "in.parquet", rows)
    config = base_config(
        {"parquet": [str(data)], "id_column": "id", **(inputs or {})},
        model=reasoner_model(reasoner_dir),
        prompt={"template": "Review: {{ text }}\nIs it positive or negative?", **(prompt or {})},
        sampling={"temperature": 0.0, "max_tokens": 16, "reasoning_parser": "deepseek_r1",
                  "thinking_token_budget": BUDGET, "structured_outputs": {"choice": LABELS}},
        output={"dir": str(tmp_path / "out"), "choice_probs": True},
        shards={"rows_per_shard": len(rows)},
        **overrides,
    )  # fmt: skip
    write_manifest(config, tmp_path / "manifest.json")
    out, stats = tmp_path / "00000.parquet", tmp_path / "00000.stats.json"
    run_shard(config, tmp_path / "manifest.json", "00000", out, stats, JobContext(engine))
    return pq.read_table(out).to_pylist(), json.loads(stats.read_text())


def test_the_trace_is_the_budget_the_label_follows_it_and_a_trace_cut_by_max_tokens_is_the_rows_error(
    tmp_path, reasoner_dir
):
    """On the ``reasoner`` test model, whose greedy decoding never picks ``<think>``/``</think>`` (their
    embeddings are zero), so that every ``</think>`` was forced by the budget; with ``deepseek_r1``,
    ``thinking_token_budget: 4`` and ``choice`` labels, through shard jobs on one engine that the first
    job starts from the config (so the parser reached it as an engine argument). Proves:

    - the trace lands in ``reasoning``, exactly the budget long: ``reasoning_tokens`` is 4 + the end
      marker, found in the token ids;
    - ``generation`` and ``label`` are one of the labels: the grammar applied after the trace (the
      model cannot end the trace, and a grammar applied from the first token would have given a label
      and no trace), and ``choice_probs``, read at the answer's first position, sum to 1;
    - the shard's stats count the reasoning tokens apart from the generated ones;
    - a row whose own max_tokens (3, by ``input.sampling_column``) ends inside the trace gets the error
      ``reasoning_unfinished``, no answer, and vLLM's finish_reason ``length``; the other rows go on;
    - with ``chat_template_kwargs: {enable_thinking: false}`` (the prompt closes the trace), no trace
      and a label, on the same engine.
    """
    engine = Engine()
    try:
        rows = [{"id": f"r{i}", "text": t, "params": None} for i, t in enumerate(["Lovely tea.", "Broke at once.",
                "Stale bread.", "Clear maps."])]  # fmt: skip
        rows[2]["params"] = json.dumps({"max_tokens": 3})
        got, stats = shard(tmp_path / "think", engine, rows, reasoner_dir, inputs={"sampling_column": "params"},
                           errors={"max_rate": 0.5})  # fmt: skip
        answered = [got[i] for i in (0, 1, 3)]
        for r in answered:
            assert r["error"] is None, r["error"]
            assert r["reasoning"] and "think>" not in r["reasoning"] and r["reasoning_tokens"] == BUDGET + 1
            assert r["generation"] in LABELS and r["label"] == r["generation"] and r["finish_reason"] == "stop"
            assert r["generated_tokens"] > r["reasoning_tokens"]  # the label's tokens and the end of sequence
            assert math.isclose(sum(r["choice_probs"].values()), 1.0) and r["label_prob"] is not None
        cut = got[2]
        assert cut["error"] == (
            "reasoning_unfinished: the reasoning did not end within max_tokens (3 tokens): no answer; raise "
            "sampling.max_tokens, or set sampling.thinking_token_budget below it"
        )
        assert (cut["finish_reason"], cut["generation"], cut["label"]) == ("length", None, None)
        assert cut["reasoning_tokens"] == 3
        assert stats["reasoning_tokens"] == 3 * (BUDGET + 1) + 3 == sum(r["reasoning_tokens"] for r in got)
        assert stats["generated_tokens"] == sum(r["generated_tokens"] for r in got) > stats["reasoning_tokens"]
        assert stats["errors"] == 1 and stats["error_reasons"] == {"reasoning_unfinished": 1}

        # the same engine settings: a sampling column turns chunked prefill off on the CPU build
        off, _ = shard(tmp_path / "off", engine, rows[:1], reasoner_dir, inputs={"sampling_column": "params"},
                       prompt={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
        assert (off[0]["reasoning"], off[0]["reasoning_tokens"], off[0]["error"]) == (None, 0, None)
        assert off[0]["generation"] in LABELS

        # a rollout: each turn's trace kept apart (its assistant message's reasoning), its call after it
        (tmp_path / "tool.py").write_text("def echo(word):\n    return word.upper()\n")
        word = {
            "type": "object",
            "required": ["word"],
            "properties": {"word": {"type": "string", "enum": ["yes", "no"]}},
        }
        tools = [{"path": str(tmp_path / "tool.py"), "name": "echo", "schema": word}]
        data = write_parquet(tmp_path / "rollout" / "in.parquet", rows[:2])
        config = base_config(
            {"parquet": [str(data)], "id_column": "id", "sampling_column": "params"},
            model=reasoner_model(reasoner_dir),
            prompt={"template": "Review: {{ text }}\nIs it positive or negative?"},
            sampling={"temperature": 0.0, "max_tokens": 32, "reasoning_parser": "deepseek_r1",
                      "thinking_token_budget": BUDGET},
            rollout={"max_turns": 2, "tools": tools, "tool_choice": "echo", "tool_processes": 1},
            output={"dir": str(tmp_path / "rollout" / "out")}, shards={"rows_per_shard": 2},
        )  # fmt: skip
        write_manifest(config, tmp_path / "rollout" / "manifest.json")
        out = tmp_path / "rollout" / "00000.parquet"
        run_shard(config, tmp_path / "rollout" / "manifest.json", "00000", out, out.with_suffix(".json"),
                  JobContext(engine))  # fmt: skip
        for r in pq.read_table(out).to_pylist():
            assert r["error"] is None and r["turns"] == 2 and r["finish_reason"] == "max_turns", (r["messages"], r)
            messages = json.loads(r["messages"])
            turns = [m for m in messages if m["role"] == "assistant"]
            assert all(m["reasoning"] and "think>" not in m["reasoning"] for m in turns), messages
            results = [m["content"] for m in messages if m["role"] == "tool"]
            calls = [json.loads(m["tool_calls"][0]["function"]["arguments"])["word"] for m in turns]
            assert results == [c.upper() for c in calls], messages
        assert engine.starts == 1
    finally:
        engine.close()
