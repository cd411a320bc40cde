"""A LoRA adapter per row on the real engine, through the workflow: the rows that name the adapter
run with it (their greedy text differs from the base model's on the same prompt), a row naming an
undeclared adapter is a per-row error, and the output's provenance names the adapter. On vLLM's
CPU build a row without an adapter is a per-row error too: batched with adapter rows it would run
with an adapter (shardgen.requests.lora's docstring has the vLLM source). The same run on vLLM's own
server (engine.kind: server), which its job starts serving the adapter by name, gives each row the
same text and error."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT
from tests.integration.workflow import run_workflow, workflow_config

pytestmark = pytest.mark.engine

ADAPTER = ROOT / "models" / "lora"
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread"]


def test_rows_run_with_the_adapter_their_column_names_and_an_unknown_one_is_a_row_error(tmp_path, llm):
    rows = [{"id": f"r{i:05d}", "topic": t, "adapter": a} for i, (t, a) in
            enumerate((t, a) for t in TOPICS for a in ("tuned", None))]  # fmt: skip
    rows.append({"id": "r99999", "topic": "kites", "adapter": "missing"})
    path = tmp_path / "data" / "in.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    config = workflow_config(
        {"parquet": [str(path)], "id_column": "id"},
        shards={"rows_per_shard": 20},
        lora={"adapters": {"tuned": str(ADAPTER)}, "column": "adapter"},
        errors={"max_rate": 0.75},
    )
    config["model"]["max_lora_rank"] = 8
    run_workflow(tmp_path, config, "local")

    table = pq.read_table(tmp_path / "results" / "output.parquet").to_pylist()
    assert [r["id"] for r in table] == [r["id"] for r in rows], "every row exactly once, in order"
    by = {(r["topic"], r["adapter"]): r for r in table}
    assert by[("kites", "missing")]["error"].startswith("unknown_adapter")
    assert all(by[(t, "tuned")]["error"] is None for t in TOPICS)
    assert all(by[(t, None)]["error"].startswith("base_row_with_lora_on_cpu") for t in TOPICS)
    # the base model's greedy text for the same prompts (the session engine runs the same model)
    from vllm import SamplingParams

    system, template = config["prompt"]["system"], config["prompt"]["template"]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": template.replace("{{ topic }}", t)}]
             for t in TOPICS]  # fmt: skip
    base = [o.outputs[0].text for o in llm.chat(chats, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    changed = [t for t, text in zip(TOPICS, base, strict=True) if by[(t, "tuned")]["generation"] != text]
    assert len(changed) >= len(TOPICS) - 1, "the adapter's rows were generated with it"
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["error_reasons"] == {"unknown_adapter": 1, "base_row_with_lora_on_cpu": len(TOPICS)}
    # named by its last component: local paths stay out of the provenance unless output.provenance_paths
    assert stats["provenance"]["lora_adapters"]["tuned"]["path"] == f"<local>/{ADAPTER.name}"

    # the same run on vLLM's server, the adapter served by its name (--lora-modules), a row's model
    on_server = tmp_path / "server"
    on_server.mkdir()
    run_workflow(on_server, {**config, "engine": {"kind": "server", "server": {"preset": "vllm"}}}, "local")
    served = pq.read_table(on_server / "results" / "output.parquet").to_pylist()

    def outcome(r):
        return r["id"], r["generation"], (r["error"] or "").split(":")[0]

    assert [outcome(r) for r in served] == [outcome(r) for r in table]
