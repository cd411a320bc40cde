"""The feed against vLLM's own ``LLM.chat``, where the feed is what bounds a job.

On the toy model (the demo model's tokenizer and chat template on one tiny
layer with random weights, made by ``make setup``), an engine step costs
almost nothing, so rows/s measures the Python side: rendering, the chat
template, tokenizing, adding requests, reading outputs, writing rows. That
is the regime of a GPU running a small model or short outputs (a label is 1
to 8 tokens), where the feed, not the GPU, bounds a job.

For each ``max_num_seqs`` (vLLM's offline default is 1024 on H100/H200, 256
on smaller GPUs), four kinds of rows go through both sides:

- ``text``: free text, 4 tokens;
- ``choice``: a label of three with ``output.choice_probs`` (the labels'
  first-token log-probabilities);
- ``json``: a small JSON schema;
- ``n4``: four samples per row.

vLLM's side is an engine started as a user's script starts it (``vllm.LLM`` with
the same model arguments and vLLM's defaults: stats logging off), running
``LLM.chat`` on the conversations and ``LLM.generate`` on them rendered by the
chat template, alternating, after one warm-up of each. shardgen's side is the
engine a job starts (stats logging on: each request's time to first token),
running ``run_shard`` (reading the Parquet shard, rendering, tokenizing,
feeding, checkpointing, writing the shard and its stats). One engine runs at a
time; both get the same ``SamplingParams``.

The result is the ratio of rows/s (median of the repeats); ``steps_short``
counts engine steps that ran short of requests after the first, which a
feed that keeps up never has. A profile of the feed (the top functions of
one shardgen run) shows where its time goes.

Usage: python bench/feed.py [--size smoke|full] [--rows N] [--kinds KIND ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
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
from shardgen.jobs.generate import JobContext, run_shard  # noqa: E402
from shardgen.requests.prompts import PromptRenderer  # noqa: E402
from shardgen.requests.tasks import GenerateTask  # noqa: E402

TOY = ROOT / "models" / "toy"
TOPICS = ["the sea", "owls", "tea", "clocks", "maps", "bread", "snow", "bridges", "rivers", "kites"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}

KINDS = {
    "text": ({"temperature": 0.0, "max_tokens": 4}, {}),
    "choice": (
        {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
        {"choice_probs": True},
    ),
    "json": ({"temperature": 0.0, "max_tokens": 12, "structured_outputs": {"json": SCHEMA}}, {}),
    "n4": ({"temperature": 0.8, "max_tokens": 4, "n": 4}, {}),
}


@dataclass
class Size:
    rows: int
    repeats: int
    max_num_seqs: tuple[int, ...]


# smoke: one engine (a start is most of its time), to prove the benchmark runs
SIZES = {"smoke": Size(64, 1, (256,)), "full": Size(4000, 3, (256, 1024))}


def model_config(max_num_seqs: int) -> dict:
    return {
        "model": str(TOY),
        "dtype": "float32",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 512 << 20,
        "enforce_eager": True,
        "max_num_seqs": max_num_seqs,
        # random weights would fill a JSON record with whitespace
        "extra": {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
    }


def rows(n: int) -> list[dict]:
    return [{"id": i, "text": f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]}."} for i in range(n)]


def run_config(data: Path, out: Path, n: int, sampling: dict, output: dict, model: dict) -> RunConfig:
    return RunConfig.from_dict(
        {
            "input": {"parquet": [str(data)]},
            "shards": {"rows_per_shard": n},
            "prompt": {"system": "Label the note.", "template": "{{ text }}"},
            "model": model,
            "sampling": sampling,
            "cache": {"enabled": False},  # the engine's speed: every row a request
            "output": {"dir": str(out), **output},
            # the default interval: a real job saves every 1000 rows
            "checkpoint": {"rows": 1000, "seconds": 300},
            # random weights: an output may be cut at max_tokens; throughput is what is measured
            "errors": {"max_rate": 1.0},
        }
    )


@dataclass
class Case:
    """One kind of rows, ready for both sides: its shard, its config and the conversations."""

    kind: str
    config: RunConfig
    manifest: Path
    conversations: list
    work: Path


def prepare(kind: str, model: dict, work: Path, size: Size) -> Case:
    sampling, output = KINDS[kind]
    data = work / f"{kind}.parquet"
    pq.write_table(pa.Table.from_pylist(rows(size.rows)), data)
    config = run_config(data, work / f"{kind}-out", size.rows, sampling, output, model)
    manifest = work / f"{kind}-manifest.json"
    write_manifest(config, manifest)
    renderer = PromptRenderer.from_config(config.prompt)
    return Case(kind, config, manifest, [renderer.render(r) for r in rows(size.rows)], work)


def timed(paths: dict, size: Size) -> tuple[dict, dict]:
    """Each path once to warm up (structured-output grammars, the allocator), then the repeats,
    alternating: rows/s and the cores each process kept busy, per run."""
    for run in paths.values():
        run("warm")
    rates: dict[str, list[float]] = {p: [] for p in paths}
    busy: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    for i in range(size.repeats):
        for path, run in paths.items():
            with CpuShare() as share:
                t = time.perf_counter()
                run(str(i))
                rates[path].append(size.rows / (time.perf_counter() - t))
            busy[path].append(share.result)
    return rates, busy


def measure_vllm(llm, case: Case, size: Size) -> dict:
    """``LLM.chat`` on the conversations, and ``LLM.generate`` on them rendered by the chat template
    (as a user who renders prompts themselves), with the ``SamplingParams`` shardgen's task makes."""
    params = GenerateTask(case.config, Engine(llm).tokenizer()).sampling
    tokenizer = llm.get_tokenizer()
    texts: dict[str, list] = {}

    def chat(_: str) -> None:
        outs = llm.chat(case.conversations, params, use_tqdm=False)
        texts["vllm_chat"] = [[o.text for o in out.outputs] for out in outs]

    def generate(_: str) -> None:
        prompts = tokenizer.apply_chat_template(case.conversations, add_generation_prompt=True, tokenize=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts["vllm_generate"] = [[o.text for o in out.outputs] for out in outs]

    rates, busy = timed({"vllm_chat": chat, "vllm_generate": generate}, size)
    return {"rates": rates, "busy": busy, "texts": texts}


def measure_shardgen(engine: Engine, case: Case, size: Size) -> dict:
    """shardgen's ``run_shard``: the Parquet shard read, rendered, tokenized, fed, checkpointed, written."""
    texts: dict[str, list] = {}
    feeds = []

    def shardgen(tag: str) -> None:
        out, stats_path = case.work / f"{case.kind}-{tag}.parquet", case.work / f"{case.kind}-{tag}.json"
        stats = run_shard(case.config, case.manifest, "00000", out, stats_path, JobContext(engine))
        feeds.append(stats["feed"])
        by_row: dict[int, list] = {}
        for r in pq.read_table(out, columns=["row_index", "generation"]).to_pylist():
            by_row.setdefault(r["row_index"], []).append(r["generation"])
        texts["shardgen"] = [by_row[i] for i in range(size.rows)]

    rates, busy = timed({"shardgen": shardgen}, size)
    return {
        "rates": rates,
        "busy": busy,
        "texts": texts,
        # engine steps short of requests after the first one (the first starts from an empty queue)
        "steps_short": max(max(f["steps_short"] - 1, 0) for f in feeds[1:]),
        "window": feeds[-1]["window"],
    }


def compare(case: Case, vllm_side: dict, ours: dict) -> dict:
    rates = {**vllm_side["rates"], **ours["rates"]}
    busy = {**vllm_side["busy"], **ours["busy"]}
    texts = {**vllm_side["texts"], **ours["texts"]}
    median = {k: statistics.median(v) for k, v in rates.items()}
    cores = {k: {p: statistics.median(b[p] for b in v) for p in v[0]} for k, v in busy.items()}
    greedy = KINDS[case.kind][0].get("temperature") == 0
    return {
        **{f"{k}_rows_per_s": round(v, 1) for k, v in median.items()},
        "ratio": round(median["shardgen"] / median["vllm_chat"], 3),
        "ratio_generate": round(median["shardgen"] / median["vllm_generate"], 3),
        "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        # greedy kinds: every path must give every row the same text (n4 samples, unseeded)
        "same_text": (texts["shardgen"] == texts["vllm_chat"] == texts["vllm_generate"]) if greedy else None,
        # cores each process kept busy (CPU seconds per second): where the time went
        "busy": {k: {p: round(x, 2) for p, x in v.items()} for k, v in cores.items()},
        # the frontend's CPU time per row: what the feed itself costs, whatever bounds the engine
        "frontend_ms_per_row": {k: round(1000 * cores[k]["frontend"] / median[k], 3) for k in median},
        "steps_short": ours["steps_short"],
        "window": ours["window"],
    }


class CpuShare:
    """CPU seconds per wall second of this process (the frontend: shardgen's feed, or LLM.chat), of
    vLLM's engine core process and of its worker, over a block."""

    def __enter__(self) -> CpuShare:
        me = psutil.Process()
        self._procs = {"frontend": me}
        for child in me.children(recursive=True):
            name = child.name()
            if "EngineCore" in name:
                self._procs["engine_core"] = child
            elif "Worker" in name:
                self._procs["worker"] = child
        self._cpu = {k: sum(p.cpu_times()[:2]) for k, p in self._procs.items()}
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        self.result = {k: (sum(p.cpu_times()[:2]) - self._cpu[k]) / wall for k, p in self._procs.items()}


def profile_feed(engine: Engine, model: dict, work: Path, size: Size, top: int = 20) -> list[dict]:
    """The functions where one shardgen run of the text rows spends its time (cumulative)."""
    sampling, output = KINDS["text"]
    data = work / "profile.parquet"
    pq.write_table(pa.Table.from_pylist(rows(size.rows)), data)
    config = run_config(data, work / "profile-out", size.rows, sampling, output, model)
    write_manifest(config, work / "profile-manifest.json")
    prof = cProfile.Profile()
    prof.enable()
    run_shard(config, work / "profile-manifest.json", "00000", work / "p.parquet", work / "p.json", JobContext(engine))
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = stats.total_tt
    out = []
    for (file, line, name), (_, calls, own, cum, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        out.append({"function": f"{name} ({where})", "calls": calls, "own_s": round(own, 3), "cum_s": round(cum, 3)})
        if len(out) >= top:
            break
    return [{"total_s": round(total, 3)}, *out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rows", type=int, help="rows per run instead of the size's")
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="kinds of rows to run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    size = SIZES[args.size]
    if args.rows:
        size = Size(args.rows, size.repeats, size.max_num_seqs)
    if not (TOY / "config.json").exists():
        sys.exit(f"the toy model is missing at {TOY}: run `make setup`")
    clear_thread_env()
    from vllm import LLM

    results: dict = {}
    profile: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seqs in size.max_num_seqs:
            model = model_config(seqs)
            work = Path(tmp) / f"seqs-{seqs}"
            work.mkdir()
            cases = {kind: prepare(kind, model, work, size) for kind in args.kinds}
            # vLLM as a user's script starts it: its own defaults (stats logging off)
            vllm_args = {k: v for k, v in EngineSettings(model=model).kwargs.items() if k != "disable_log_stats"}
            llm = LLM(**vllm_args)
            try:
                vllm_side = {kind: measure_vllm(llm, case, size) for kind, case in cases.items()}
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
            # shardgen's engine, as a job starts it (the same model arguments)
            engine = Engine()
            engine.start(EngineSettings(model=model))
            try:
                ours = {kind: measure_shardgen(engine, case, size) for kind, case in cases.items()}
                if seqs == max(size.max_num_seqs) and "text" in cases:
                    profile = profile_feed(engine, model, work, size)
            finally:
                engine.close()
            results[str(seqs)] = {kind: compare(case, vllm_side[kind], ours[kind]) for kind, case in cases.items()}
    result = {
        "what": "rows/s on the toy model (feed-bound): shardgen's run_shard on its engine against vLLM's LLM.chat "
        "and LLM.generate on an engine with vLLM's defaults, same model arguments, rows and SamplingParams; "
        "median of the repeats",
        "size": args.size,
        "rows": size.rows,
        "repeats": size.repeats,
        "max_num_seqs": results,
        "profile_top": profile,
        "vllm": vllm_version(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "feed", result, markdown(result))


def markdown(r: dict) -> str:
    lines = [
        f"vLLM {r['vllm']}, {r['machine']}, {r['date']}; {r['rows']} rows per run, median of {r['repeats']}; "
        "toy model (one layer of width 64): the feed bounds the job. `python bench/feed.py`\n",
        "| max_num_seqs | rows | `LLM.chat` rows/s | `LLM.generate` rows/s | shardgen rows/s | ÷ chat | ÷ generate | "
        "same text | frontend CPU ms/row (chat; generate; shardgen) | cores busy: frontend / engine core / worker "
        "(chat; shardgen) | steps short of requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seqs, kinds in r["max_num_seqs"].items():
        for kind, m in kinds.items():
            b = {k: " / ".join(f"{v:.2f}" for v in m["busy"][k].values()) for k in ("vllm_chat", "shardgen")}
            same = {True: "yes", False: "**no**", None: "(sampled)"}[m["same_text"]]
            ms = "; ".join(f"{m['frontend_ms_per_row'][k]:.3f}" for k in ("vllm_chat", "vllm_generate", "shardgen"))
            lines.append(
                f"| {seqs} | {kind} | {m['vllm_chat_rows_per_s']:.0f} | {m['vllm_generate_rows_per_s']:.0f} | "
                f"{m['shardgen_rows_per_s']:.0f} | **{m['ratio']:.3f}** | {m['ratio_generate']:.3f} | {same} | {ms} | "
                f"{b['vllm_chat']}; {b['shardgen']} | {m['steps_short']} |"
            )
    if r["profile_top"]:
        lines += ["", f"Profile of one shardgen run (text rows, {r['rows']} rows; cumulative seconds):", ""]
        lines += ["| function | calls | own s | cumulative s |", "|---|---|---|---|"]
        for p in r["profile_top"][1:]:
            lines.append(f"| `{p['function']}` | {p['calls']} | {p['own_s']} | {p['cum_s']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
