"""Overhead of shardgen's generate path against raw vLLM, in one run on one engine.

Both sides get the same prompts, already rendered, and the same engine and
sampling settings. Raw vLLM is ``LLM.generate`` over all prompts at once (the
engine's best case: one call, everything queued); shardgen is ``run_shard``
over a Parquet shard of the same rows, which also reads the input, renders and
tokenizes, checkpoints and writes its output. Runs alternate (raw, shardgen,
raw, shardgen, ...) after one warm-up, so that drift on a shared machine hits
both alike; the result is the ratio of output tokens/s.

Usage: python bench/throughput.py [--rows N] [--max-tokens N] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardgen import config as cfg  # noqa: E402
from shardgen.engine import (  # noqa: E402
    Tokenizer,
    clear_thread_env,
    make_llm,
    make_sampling_params,
    shutdown,
    vllm_version,
)
from shardgen.generate import run_shard  # noqa: E402
from shardgen.plan import write_manifest  # noqa: E402
from shardgen.prompts import PromptRenderer  # noqa: E402

SYSTEM = (
    "You are a careful assistant that labels short texts. Read the text, decide which single topic it is "
    "mostly about, and answer with one short sentence that names the topic and gives one reason. "
) * 4
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]


def config_for(data: Path, out: Path, rows: int, max_tokens: int) -> dict:
    return cfg.validate(
        {
            "input": {"parquet": [str(data)]},
            "shards": {"rows_per_shard": rows},
            "prompt": {"system": SYSTEM, "template": "Text {{ n }}: a note about {{ topic }}. Label it."},
            "model": {
                "model": str(ROOT / "models" / "SmolLM2-135M-Instruct"),
                "max_model_len": 1024,
                "kv_cache_memory_bytes": 1 << 30,
                "enforce_eager": True,
            },
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
            "output": {"dir": str(out)},
        }
    )


def raw_vllm(llm, token_ids: list[list[int]], params) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def shardgen_path(llm, config, manifest: Path, work: Path, i: int) -> tuple[float, int]:
    t = time.perf_counter()
    stats = run_shard(config, manifest, "00000", work / f"s{i}.parquet", work / f"s{i}.json", llm=llm)
    return time.perf_counter() - t, stats["generated_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    clear_thread_env()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [{"n": i, "topic": TOPICS[i % len(TOPICS)]} for i in range(args.rows)]
        pq.write_table(pa.Table.from_pylist(rows), work / "in.parquet")
        config = config_for(work / "in.parquet", work / "out", args.rows, args.max_tokens)
        manifest = work / "manifest.json"
        write_manifest(config, manifest)

        llm = make_llm(config["model"])
        params = make_sampling_params(config["sampling"])
        renderer = PromptRenderer(config["prompt"]["template"], config["prompt"]["system"])
        tok = Tokenizer(llm.get_tokenizer(), llm.llm_engine.model_config.max_model_len)
        token_ids = [tok.encode(renderer.render(r)) for r in rows]

        raw_vllm(llm, token_ids, params)  # warm-up: caches, allocator, prefix cache
        runs: dict[str, list[float]] = {"raw": [], "shardgen": []}
        for i in range(args.repeats):
            secs, toks = raw_vllm(llm, token_ids, params)
            runs["raw"].append(toks / secs)
            secs, toks = shardgen_path(llm, config, manifest, work, i)
            runs["shardgen"].append(toks / secs)
        shutdown(llm)

    raw, ours = statistics.median(runs["raw"]), statistics.median(runs["shardgen"])
    result = {
        "what": "output tokens/s, median of the repeats; shardgen includes reading, rendering, "
        "tokenizing, checkpointing and writing the shard",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "prompt_tokens_mean": round(statistics.mean(len(t) for t in token_ids), 1),
        "repeats": args.repeats,
        "raw_vllm_tokens_per_s": round(raw, 2),
        "shardgen_tokens_per_s": round(ours, 2),
        "ratio": round(ours / raw, 3),
        "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()},
        "vllm": vllm_version(),
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    md = (
        "| path | output tokens/s (median) | runs |\n|---|---|---|\n"
        f"| raw vLLM `LLM.generate` | {raw:.1f} | {', '.join(f'{x:.1f}' for x in runs['raw'])} |\n"
        f"| shardgen `run_shard` | {ours:.1f} | {', '.join(f'{x:.1f}' for x in runs['shardgen'])} |\n"
        f"| **ratio** | **{ours / raw:.3f}** | |\n\n"
        f"{args.rows} rows, {result['prompt_tokens_mean']} prompt tokens on average (a shared system prompt), "
        f"{args.max_tokens} output tokens each, vLLM {result['vllm']}, {result['machine']}, {result['date']}.\n"
    )
    (args.out / "throughput.md").write_text(md)
    print(md)


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    return f"CPU: {platform.machine()}, {os.cpu_count()} cores, vLLM's CPU build"


if __name__ == "__main__":
    main()
