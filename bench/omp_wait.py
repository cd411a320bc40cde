"""Two CPU engines on the same cores: OpenMP's default wait policy against ``OMP_WAIT_POLICY=PASSIVE``.

vLLM's CPU build binds its OpenMP threads to every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), and
PyTorch's libgomp spins while a thread waits for the others. Where two engines share the cores (the
suite's two processes: the session engine beside a Slurm job's engine), each one's threads spin on
cores the other needs; with ``OMP_WAIT_POLICY=PASSIVE`` waiting threads sleep. A job on a cluster has
its cores to itself, where the policy changes nothing. ``make test`` does not set it: the suite as a
whole was no faster with it (bench/README.md).

Each case runs the same generation (the demo model, greedy, ``max_tokens`` each) in fresh processes:
one engine alone, then two at once; output tokens/s of each engine, and of both together.

Usage: python bench/omp_wait.py [--rows N] [--max-tokens N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import machine, write_results  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
ONE = """
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    rows, max_tokens = int(sys.argv[1]), int(sys.argv[2])
    llm = LLM(model=sys.argv[3], dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, max_num_seqs=32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [f"Tell me about topic number {i} in two sentences." for i in range(rows)]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps(rows * max_tokens / (time.perf_counter() - started)))

if __name__ == "__main__":
    main()
"""


def engines(count: int, policy: str | None, rows: int, max_tokens: int) -> list[float]:
    """Output tokens/s of each of ``count`` engines generating at once."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-c", ONE, str(rows), str(max_tokens), str(MODEL)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(count)]  # fmt: skip
    rates = []
    for p in procs:
        out, _ = p.communicate()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            sys.exit(f"an engine failed ({p.returncode}):\n{out[-2000:]}")
        rates.append(round(json.loads(line.removeprefix("RESULT ")), 1))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    cases = {}
    for policy in (None, "PASSIVE"):
        name = policy or "default"
        alone = engines(1, policy, args.rows, args.max_tokens)
        pair = engines(2, policy, args.rows, args.max_tokens)
        cases[name] = {"alone": alone[0], "two_at_once": pair, "two_together": round(sum(pair), 1)}
    result = {
        "what": "output tokens/s of one vLLM CPU engine alone and of two at once on the same cores, with OpenMP's "
        "default wait policy and with OMP_WAIT_POLICY=PASSIVE",
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "cases": cases,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_results(args.out, "omp_wait", result, markdown(result))


def markdown(r: dict) -> str:
    lines = [
        f"| {name} | {c['alone']} | {' + '.join(map(str, c['two_at_once']))} = {c['two_together']} | "
        f"{c['two_together'] / c['alone']:.2f} |"
        for name, c in r["cases"].items()
    ]
    return (
        f"{r['machine']}, {r['date']}; the demo model, {r['rows']} rows of {r['max_tokens']} output tokens, greedy, "
        "after a warm-up.\n\n"
        "| OMP_WAIT_POLICY | one engine alone (tok/s) | two engines at once (tok/s) | both ÷ alone |\n"
        "|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
