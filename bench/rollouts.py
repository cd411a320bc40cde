"""Rollouts with tools: the engine kept busy while the tools run.

Each row is a conversation of ``turns`` turns; every turn is one call (``tool_choice: required``,
``parallel_tool_calls: false``) of a tool that sleeps 100 ms, in the same number of worker
processes on both sides. Two ways over the same rows on one engine, alternating:

- shardgen: ``run_shard`` with the ``rollout`` section: a row's next turn goes to the engine as soon
  as its tool returns, while the engine serves the other rows (``feed.Turns``);
- a batch loop: every live row's turn through ``LLM.generate``, then every call of the batch, waited
  for, then the next turn: what a loop written around ``LLM.generate`` or ``LLM.chat`` does.

Reported: wall seconds, the seconds the engine had nothing to run because it waited on tools (the
loop: its tool phases; shardgen: the feed's ``idle_on_tools_s``), rows/s, and the ratio. On the toy
model (``make setup``; random weights, but each turn is a call the structured output forces) the
engine's steps cost little, so the tools' waits are most of the loop's time, as with a small model on
a GPU.

Usage: python bench/rollouts.py [--size smoke|full] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import machine, write_results  # noqa: E402

from shardgen.base.installed import vllm_version  # noqa: E402
from shardgen.base.jobenv import clear_thread_env  # noqa: E402
from shardgen.config import RunConfig  # noqa: E402
from shardgen.data.plan import write_manifest  # noqa: E402
from shardgen.engines.kinds import EngineSettings  # noqa: E402
from shardgen.engines.vllm import Engine  # noqa: E402
from shardgen.features import rollouts  # noqa: E402
from shardgen.jobs.generate import JobContext, run_shard  # noqa: E402
from shardgen.requests.prompts import PromptRenderer  # noqa: E402

TOY = ROOT / "models" / "toy"
TOOL = """\
import time

CAPITALS = {"france": "Paris", "italy": "Rome", "norway": "Oslo", "spain": "Madrid"}


def capital(country):
    time.sleep(SLEEP)
    return {"capital": CAPITALS[country]}
"""
SCHEMA = {"type": "object", "required": ["country"],
          "properties": {"country": {"type": "string", "enum": ["france", "italy", "norway", "spain"]}}}  # fmt: skip
COUNTRIES = ["france", "italy", "norway", "spain"]


@dataclass
class Size:
    rows: int
    turns: int
    repeats: int
    processes: int
    max_num_seqs: int
    warm: bool = True  # a warm-up run of each side first


# smoke: to prove it runs (tests/integration/test_rollouts_engine.py, on the session engine)
SIZES = {"smoke": Size(8, 2, 1, 2, 4, warm=False), "full": Size(256, 3, 3, 8, 64)}


def toy_model(max_num_seqs: int) -> dict:
    return {
        "model": str(TOY),
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 512 << 20,
        "enforce_eager": True,
        "max_num_seqs": max_num_seqs,
        "extra": {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
    }


def rollout_config(work: Path, size: Size, model: dict, sleep: float) -> RunConfig:
    tool = work / "tool.py"
    tool.write_text(TOOL.replace("SLEEP", repr(sleep)))
    data = work / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": i, "country": COUNTRIES[i % 4]} for i in range(size.rows)]), data)
    return RunConfig.from_dict({
        "input": {"parquet": [str(data)]},
        "shards": {"rows_per_shard": size.rows},
        "prompt": {"template": "Use the tool: what is the capital of {{ country }}?"},
        "model": model,
        "sampling": {"temperature": 0.0, "max_tokens": 48},
        "cache": {"enabled": False},  # the engine's speed: every row a request
        "rollout": {"max_turns": size.turns, "tools": [{"path": str(tool), "name": "capital", "schema": SCHEMA}],
                    "tool_choice": "required", "parallel_tool_calls": False, "tool_processes": size.processes},
        "output": {"dir": str(work / "out")},
        "errors": {"max_rate": 1.0},
    })  # fmt: skip


def shardgen_side(engine: Engine, config: RunConfig, work: Path, tag: str) -> dict[str, Any]:
    manifest = work / "manifest.json"
    if not manifest.exists():
        write_manifest(config, manifest)
    t = time.perf_counter()
    stats = run_shard(config, manifest, "00000", work / f"{tag}.parquet", work / f"{tag}.json", JobContext(engine))
    wall = time.perf_counter() - t
    rollout = stats["feed"]["rollout"]
    conversations = pq.read_table(work / f"{tag}.parquet", columns=["messages"]).column("messages").to_pylist()
    return {"seconds": wall, "engine_idle_s": rollout["engine_idle_on_tools_s"], "turns": rollout["turns"],
            "tool_calls": rollout["tool_calls"], "messages": [json.loads(m) for m in conversations]}  # fmt: skip


def loop_side(engine: Engine, config: RunConfig, size: Size) -> dict[str, Any]:
    """Turn by turn over the whole batch: ``LLM.generate`` on every live row, then every call, waited for."""
    rollout = config.raw["rollout"]
    tokenizer = engine.tokenizer(True, config.template_kwargs)
    task = rollouts.task.RolloutTask(config, tokenizer)  # the same SamplingParams and call parser as shardgen's
    renderer = PromptRenderer.from_config(config.prompt)
    rows = pq.read_table(config.raw["input"]["parquet"][0]).to_pylist()
    conversations = [list(renderer.render(r)) for r in rows]
    live = list(range(len(rows)))
    pool = rollouts.tools.tool_pool(rollout, size.processes)
    idle = turns = calls = 0
    t = time.perf_counter()
    try:
        for turn in range(1, size.turns + 1):
            if not live:
                break
            ids = tokenizer.encode_batch([rollouts.calls.template_messages(conversations[i]) for i in live])
            prompts = [{"prompt_token_ids": x} for x in ids]
            outs = engine.llm.generate(prompts, task.sampling, use_tqdm=False)
            turns += len(live)
            pending = []
            for i, out in zip(live, outs, strict=True):
                content, found = task.parser.calls(out.outputs[0].text)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if found:
                    message["tool_calls"] = [
                        {"id": f"call_{i}_{turn}_{k}", "type": "function", "function": {"name": n, "arguments": a}}
                        for k, (n, a) in enumerate(found)
                    ]
                conversations[i].append(message)
                for call in message.get("tool_calls", []):
                    future = pool.schedule(
                        rollouts.tools._call_tool, args=(call["function"]["name"], call["function"]["arguments"])
                    )
                    pending.append((i, call["id"], future))
            t_tools = time.perf_counter()  # the engine waits for every call of the batch
            wait([f for _, _, f in pending])
            idle += time.perf_counter() - t_tools
            calls += len(pending)
            for i, call_id, future in pending:
                _, text = future.result()
                conversations[i].append({"role": "tool", "tool_call_id": call_id, "content": text})
            live = [i for i in live if conversations[i][-1]["role"] == "tool"]
    finally:
        pool.stop()
        pool.join()
    return {"seconds": time.perf_counter() - t, "engine_idle_s": idle, "turns": turns, "tool_calls": calls,
            "messages": conversations}  # fmt: skip


def measure(engine: Engine, model: dict, work: Path, size: Size, sleep: float = 0.1) -> dict[str, Any]:
    """Both sides on the same rows and engine, alternating (after a warm-up of each); medians."""
    config = rollout_config(work, size, model, sleep)
    if size.warm:
        shardgen_side(engine, config, work, "warm")
        loop_side(engine, config, size)
    runs: dict[str, list[dict[str, Any]]] = {"loop": [], "shardgen": []}
    for i in range(size.repeats):
        runs["loop"].append(loop_side(engine, config, size))
        runs["shardgen"].append(shardgen_side(engine, config, work, f"run{i}"))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "engine_idle_s")}
           for side, rs in runs.items()}  # fmt: skip
    last = {side: rs[-1] for side, rs in runs.items()}
    return {
        "rows": size.rows,
        "turns_per_row": size.turns,
        "tool_sleep_s": sleep,
        "tool_processes": size.processes,
        "max_num_seqs": model.get("max_num_seqs"),
        **{f"{side}_{k}": round(v, 3) for side, m in med.items() for k, v in m.items()},
        **{f"{side}_rows_per_s": round(size.rows / m["seconds"], 2) for side, m in med.items()},
        "speedup": round(med["loop"]["seconds"] / med["shardgen"]["seconds"], 3),
        "turns": {side: r["turns"] for side, r in last.items()},
        "tool_calls": {side: r["tool_calls"] for side, r in last.items()},
        "same_conversations": last["loop"]["messages"] == last["shardgen"]["messages"],
        "runs": {side: [round(r["seconds"], 3) for r in rs] for side, rs in runs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    size = SIZES[args.size]
    if not (TOY / "config.json").exists():
        sys.exit(f"the toy model is missing at {TOY}: run `make setup`")
    clear_thread_env()
    model = toy_model(size.max_num_seqs)
    engine = Engine()
    engine.start(EngineSettings(model=model))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            m = measure(engine, model, Path(tmp), size)
    finally:
        engine.close()
    result = {
        "what": "a rollout of tool calls (each tool sleeps 100 ms): shardgen's run_shard, which submits a row's next "
        "turn when its tool returns, against a loop of LLM.generate over the batch that waits for every call of a "
        "turn; same rows, engine, SamplingParams and worker processes; medians of the repeats",
        "size": args.size,
        **m,
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "rollouts", result, markdown(result))


def markdown(r: dict) -> str:
    return (
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; toy model, {r['rows']} rows of {r['turns_per_row']} turns, "
        f"a tool call per turn sleeping {r['tool_sleep_s']} s in {r['tool_processes']} processes, max_num_seqs "
        f"{r['max_num_seqs']}; median of {len(r['runs']['loop'])}.\n\n"
        "| | wall s | engine idle on tools s | rows/s |\n|---|---|---|---|\n"
        f"| loop over LLM.generate, waiting for each turn's calls | {r['loop_seconds']} | {r['loop_engine_idle_s']} | "
        f"{r['loop_rows_per_s']} |\n"
        f"| shardgen rollout | {r['shardgen_seconds']} | {r['shardgen_engine_idle_s']} | {r['shardgen_rows_per_s']} |\n"
        f"\n**{r['speedup']}×** the loop's speed; same conversations: {r['same_conversations']}.\n"
    )


if __name__ == "__main__":
    main()
