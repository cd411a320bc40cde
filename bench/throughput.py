"""Throughput of shardgen's generate path against raw vLLM, in one run on one engine.

Three comparisons, each side by side on one engine and the same prompts:

1. **Overhead**: raw vLLM (``LLM.generate`` over all prompts at once, the
   engine's best case) against shardgen's ``run_shard`` over a Parquet shard
   of the same rows, which also reads the input, renders and tokenizes,
   checkpoints and writes its output. A long shared system prompt. Runs
   alternate (raw, shardgen, raw, ...) after one warm-up, so drift on a shared
   machine hits both alike; the result is the ratio of output tokens/s.
2. **Prefix caching**: raw vLLM with the prefix cache read (on) and with
   every request told to skip it (``skip_reading_prefix_cache``, off), from a
   cold cache each time; and shardgen's measured hit rate against the most
   the shared prefix allows (full cache blocks of the prefix each prompt
   shares with the one before, for every prompt but the first).
3. **Order**: documents with several questions each, shuffled, through
   ``run_shard`` with ``prompt.order: input`` and ``prefix``, from a cold
   cache each time; with a KV cache smaller than all the documents, the
   prefix-aware order reuses each document while it is cached.

Usage: python bench/throughput.py [--rows N] [--max-tokens N] [--repeats N] [--docs N] [--questions N] [--out DIR]

Two engines: one with a KV cache that holds the whole batch (comparisons 1
and 2), one with a KV cache smaller than the documents (comparison 3).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import machine, write_results  # noqa: E402

from shardgen import config as cfg  # noqa: E402
from shardgen.base.installed import vllm_build, vllm_version  # noqa: E402
from shardgen.base.jobenv import clear_thread_env  # noqa: E402
from shardgen.data.plan import write_manifest  # noqa: E402
from shardgen.engines.kinds import EngineSettings  # noqa: E402
from shardgen.engines.vllm import Engine, make_sampling_params  # noqa: E402
from shardgen.jobs.generate import JobContext, run_shard  # noqa: E402
from shardgen.requests.prompts import PromptRenderer  # noqa: E402

SYSTEM = (
    "You are a careful assistant that labels short texts. Read the text, decide which single topic it is "
    "mostly about, and answer with one short sentence that names the topic and gives one reason. "
) * 12
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
WORDS = "river mountain lantern orchard harbor meadow violin compass glacier pepper canyon ember".split()


def model_config(kv_cache_mib: int) -> dict:
    return {
        "model": str(ROOT / "models" / "SmolLM2-135M-Instruct"),
        # CPUs without AVX-512 BF16 emulate bfloat16 about 5x slower; GPUs run the model's own dtype
        "dtype": "float32" if vllm_build() == "cpu" else "auto",
        "max_model_len": 1024,
        "kv_cache_memory_bytes": kv_cache_mib << 20,
        "enforce_eager": True,
        "enable_chunked_prefill": False,
    }


def shard_config(data: Path, out: Path, rows: int, max_tokens: int, prompt: dict, model: dict) -> cfg.RunConfig:
    return cfg.RunConfig.from_dict(
        {
            "input": {"parquet": [str(data)]},
            "shards": {"rows_per_shard": rows},
            "prompt": prompt,
            "model": dict(model),
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
            "cache": {"enabled": False},  # the engine's speed: every row a request
            "output": {"dir": str(out)},
            "checkpoint": {"rows": 100_000, "seconds": 3600},
        }
    )


def plan(
    work: Path, name: str, rows: list[dict], max_tokens: int, prompt: dict, model: dict
) -> tuple[cfg.RunConfig, Path]:
    data = work / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = shard_config(data, work / f"{name}-out", len(rows), max_tokens, prompt, model)
    manifest = work / f"{name}-manifest.json"
    write_manifest(config, manifest)
    return config, manifest


def raw_vllm(llm, token_ids: list[list[int]], params) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def shardgen_path(engine: Engine, config, manifest: Path, work: Path, tag: str) -> dict:
    t = time.perf_counter()
    stats = run_shard(config, manifest, "00000", work / f"{tag}.parquet", work / f"{tag}.json", JobContext(engine))
    stats["bench_seconds"] = time.perf_counter() - t
    return stats


def shared_prefix_max(token_ids: list[list[int]], block: int) -> float:
    """The highest prefix-cache hit rate a cold cache allows: for every prompt but the first, the full
    blocks of what it shares with the prompt before it (vLLM always computes a prompt's last token)."""
    hits = 0
    for prev, ids in itertools.pairwise(token_ids):
        common = next((i for i, (a, b) in enumerate(zip(prev, ids, strict=False)) if a != b), min(len(prev), len(ids)))
        hits += min(common, len(ids) - 1) // block * block
    return hits / sum(len(ids) for ids in token_ids)


def overhead_and_caching(engine: Engine, model: dict, work: Path, args) -> dict:
    llm = engine.llm
    rows = [{"n": i, "topic": TOPICS[i % len(TOPICS)]} for i in range(args.rows)]
    prompt = {"system": SYSTEM, "template": "Text {{ n }}: a note about {{ topic }}. Label it."}
    config, manifest = plan(work, "shared", rows, args.max_tokens, prompt, model)
    params = make_sampling_params(config.sampling)
    renderer = PromptRenderer.from_config(config.prompt)
    token_ids = engine.tokenizer().encode_batch([renderer.render(r) for r in rows])

    raw_vllm(llm, token_ids, params)  # warm-up: caches, allocator, prefix cache
    runs: dict[str, list[float]] = {"raw": [], "shardgen": []}
    hit_rates = []
    for i in range(args.repeats):
        secs, toks = raw_vllm(llm, token_ids, params)
        runs["raw"].append(toks / secs)
        stats = shardgen_path(engine, config, manifest, work, f"shared{i}")
        runs["shardgen"].append(stats["generated_tokens"] / stats["bench_seconds"])

    # prefix caching on and off, each from a cold cache
    off = params.clone()
    off.skip_reading_prefix_cache = True
    caching: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for name, p in (("on", params), ("off", off)):
            llm.reset_prefix_cache()
            secs, toks = raw_vllm(llm, token_ids, p)
            caching[name].append(toks / secs)
    llm.reset_prefix_cache()
    stats = shardgen_path(engine, config, manifest, work, "shared-cold")
    hit_rates.append(stats["prefix_cache_hit_rate"])
    block = llm.llm_engine.vllm_config.cache_config.block_size
    best = shared_prefix_max(token_ids, block)
    raw, ours = statistics.median(runs["raw"]), statistics.median(runs["shardgen"])
    on, cache_off = statistics.median(caching["on"]), statistics.median(caching["off"])
    return {
        "rows": args.rows,
        "prompt_tokens_mean": round(statistics.mean(len(t) for t in token_ids), 1),
        "raw_vllm_tokens_per_s": round(raw, 2),
        "shardgen_tokens_per_s": round(ours, 2),
        "ratio": round(ours / raw, 3),
        "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()},
        "cache_on_tokens_per_s": round(on, 2),
        "cache_off_tokens_per_s": round(cache_off, 2),
        "cache_speedup": round(on / cache_off, 3),
        "cache_runs": {k: [round(x, 2) for x in v] for k, v in caching.items()},
        "block_size": block,
        "hit_rate": round(hit_rates[-1] or 0.0, 4),
        "hit_rate_max": round(best, 4),
        "hit_rate_of_max": round((hit_rates[-1] or 0.0) / best, 3) if best else None,
    }


def documents_and_questions(engine: Engine, model: dict, work: Path, args) -> dict:
    rng = random.Random(5)
    docs = [f"Document {d}: " + " ".join(rng.choice(WORDS) for _ in range(300)) for d in range(args.docs)]
    rows = [{"doc": d, "q": q} for d in docs for q in range(args.questions)]
    random.Random(9).shuffle(rows)
    result: dict = {"docs": args.docs, "questions": args.questions, "rows": len(rows)}
    texts = {}
    for order in ("input", "prefix"):
        prompt = {"template": "{{ doc }}\n\nQuestion {{ q }}: what is the first word?", "chat": False, "order": order}
        config, manifest = plan(work, f"docs-{order}", rows, args.max_tokens, prompt, model)
        engine.llm.reset_prefix_cache()
        stats = shardgen_path(engine, config, manifest, work, f"docs-{order}")
        texts[order] = pq.read_table(work / f"docs-{order}.parquet").column("generation").to_pylist()
        result[order] = {
            "output_tokens_per_s": round(stats["generated_tokens"] / stats["bench_seconds"], 2),
            "seconds": round(stats["bench_seconds"], 2),
            "hit_rate": round(stats["prefix_cache_hit_rate"] or 0.0, 4),
        }
    result["same_text"] = texts["input"] == texts["prefix"]
    result["speedup"] = round(result["input"]["seconds"] / result["prefix"]["seconds"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--docs", type=int, default=32, help="documents of the order comparison")
    ap.add_argument("--questions", type=int, default=4, help="questions per document")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache of the overhead and caching engine")
    ap.add_argument(
        "--order-kv-cache-mib", type=int, default=128, help="KV cache of the order engine: smaller than all documents"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    clear_thread_env()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # two engines: a KV cache that fits the whole batch for the first two
        # comparisons, one that cannot hold every document for the third
        results = {}
        llm = llm_mib = None
        try:
            for name, measure, mib in (
                ("overhead", overhead_and_caching, args.kv_cache_mib),
                ("order", documents_and_questions, args.order_kv_cache_mib),
            ):
                model = model_config(mib)
                if llm is None or llm_mib != mib:  # one engine when both KV caches are the same (a smoke run)
                    if llm is not None:
                        llm.llm_engine.engine_core.shutdown()
                    # one engine for both sides: wrapped, so run_shard uses it as it is (an Engine() that
                    # started it would start another for settings that differ from the job's)
                    from vllm import LLM

                    llm, llm_mib = LLM(**EngineSettings(model=model).kwargs), mib
                results[name] = measure(Engine(llm), model, work, args)
        finally:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
    result = {
        "what": "output tokens/s (median of the repeats); shardgen includes reading, rendering, tokenizing, "
        "checkpointing and writing the shard",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "kv_cache_mib": args.kv_cache_mib,
        "order_kv_cache_mib": args.order_kv_cache_mib,
        **results,
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "throughput", result, markdown(result))


def markdown(r: dict) -> str:
    s, o = r["overhead"], r["order"]

    def runs(xs):
        return ", ".join(f"{x:.1f}" for x in xs)

    return (
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; {r['max_tokens']} output tokens per row, "
        f"median of {r['repeats']} runs; overhead and caching on one engine, order on a second with a small "
        "KV cache.\n\n"
        f"**Overhead** ({s['rows']} rows, {s['prompt_tokens_mean']} prompt tokens on average, "
        "a shared system prompt)\n\n"
        "| path | output tokens/s | runs |\n|---|---|---|\n"
        f"| raw vLLM `LLM.generate` | {s['raw_vllm_tokens_per_s']:.1f} | {runs(s['runs']['raw'])} |\n"
        f"| shardgen `run_shard` | {s['shardgen_tokens_per_s']:.1f} | {runs(s['runs']['shardgen'])} |\n"
        f"| **ratio** | **{s['ratio']:.3f}** | |\n\n"
        "**Prefix caching** (raw vLLM, same prompts, cold cache each run)\n\n"
        "| prefix cache | output tokens/s | runs |\n|---|---|---|\n"
        f"| read | {s['cache_on_tokens_per_s']:.1f} | {runs(s['cache_runs']['on'])} |\n"
        f"| skipped | {s['cache_off_tokens_per_s']:.1f} | {runs(s['cache_runs']['off'])} |\n"
        f"| **speed-up** | **{s['cache_speedup']:.3f}** | |\n\n"
        f"shardgen's prefix-cache hit rate: {100 * s['hit_rate']:.1f}% of prompt tokens; the shared prefix allows "
        f"at most {100 * s['hit_rate_max']:.1f}% ({s['block_size']}-token blocks, cold cache): "
        f"**{100 * (s['hit_rate_of_max'] or 0):.1f}% of the maximum**.\n\n"
        f"**Order** ({o['docs']} documents x {o['questions']} questions, shuffled; "
        f"KV cache {r['order_kv_cache_mib']} MiB, smaller than the documents)\n\n"
        "| `prompt.order` | seconds | output tokens/s | prefix-cache hit rate |\n|---|---|---|---|\n"
        f"| input | {o['input']['seconds']:.1f} | {o['input']['output_tokens_per_s']:.1f} | "
        f"{100 * o['input']['hit_rate']:.1f}% |\n"
        f"| prefix | {o['prefix']['seconds']:.1f} | {o['prefix']['output_tokens_per_s']:.1f} | "
        f"{100 * o['prefix']['hit_rate']:.1f}% |\n"
        f"| **speed-up** | **{o['speedup']:.3f}** | | |\n\n"
        f"Same text in both orders: {o['same_text']}.\n"
    )


if __name__ == "__main__":
    main()
