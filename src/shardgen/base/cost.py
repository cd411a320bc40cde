"""What a run cost: the GPU-hours it used at the user's price, and its tokens at a hosted batch price.

The GPU-hours billed are every attempt's time on its GPUs: the attempt that
finished a shard (``gpu_hours``: its wall time, engine start included, × its
GPUs) and the attempts before it that were interrupted or failed (from their
start and end records). Time in Slurm's queue holds no GPU and is not billed.
An attempt killed without an end record (kill -9, a lost node) has no
measured time: it is counted in ``attempts_unmeasured`` and left out.
No price is built in (``cost.gpu_hour``, ``cost.compare``).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

INCLUDES = (
    "every attempt's time on its GPUs (engine start, generation, saving), the attempts that were "
    "interrupted or failed included; not the time jobs waited in the queue"
)


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)).total_seconds()


def earlier_attempts(shard: Mapping[str, Any]) -> tuple[float, int]:
    """GPU-hours of a shard's attempts before the one that finished it, and how many of them have no
    end record (killed outright) and so no measured time."""
    hours, unmeasured = 0.0, 0
    for attempt in (shard.get("attempts") or [])[:-1]:
        seconds = _seconds(attempt.get("started"), attempt.get("ended"))
        if seconds is None:
            unmeasured += 1
        else:
            hours += max(seconds, 0.0) * (shard.get("gpus") or 1) / 3600
    return hours, unmeasured


def _per(amount: float, count: float, unit: float) -> float | None:
    return amount / count * unit if count else None


def run_cost(stats: Mapping[str, Any], cost: Any) -> dict[str, Any] | None:
    """The run's cost (``stats``: the run totals, ``cost``: ``config.CostConfig``), None without a price.

    Per million input (prompt) and output (generated) tokens, each the whole
    cost over those tokens (one cost, two views); per thousand input rows.
    With ``cost.compare``, what the same tokens cost at the hosted batch
    price and this run's cost as a fraction of it (``ratio`` < 1: cheaper here).
    """
    if cost.gpu_hour is None:
        return None
    total = stats["billed_gpu_hours"] * cost.gpu_hour
    prompt, generated = stats.get("prompt_tokens") or 0, stats.get("generated_tokens") or 0
    out = {
        "currency": cost.currency,
        "gpu_hour": cost.gpu_hour,
        "billed_gpu_hours": stats["billed_gpu_hours"],
        "total": total,
        "per_million_input_tokens": _per(total, prompt, 1e6),
        "per_million_output_tokens": _per(total, generated, 1e6),
        "per_thousand_rows": _per(total, stats.get("rows") or 0, 1e3),
        "includes": INCLUDES,
        "attempts_unmeasured": stats.get("attempts_unmeasured", 0),
        "compare": None,
    }
    if cost.compare:
        hosted = (prompt * cost.compare["input_per_mtok"] + generated * cost.compare["output_per_mtok"]) / 1e6
        out["compare"] = {**cost.compare, "hosted_total": hosted, "ratio": total / hosted if hosted else None}
    return out


def shard_cost(shard: Mapping[str, Any], cost: Any) -> float | None:
    """One shard's cost: its billed GPU-hours at ``cost.gpu_hour``."""
    return None if cost.gpu_hour is None else shard["billed_gpu_hours"] * cost.gpu_hour


def summary_line(c: Mapping[str, Any] | None) -> str | None:
    """The cost line of the run's summary."""
    if not c:
        return None
    cur = c["currency"]
    per = c["per_million_output_tokens"] or c["per_million_input_tokens"]
    unit = "output" if c["per_million_output_tokens"] else "input"
    line = f"cost            {c['total']:,.2f} {cur} ({c['billed_gpu_hours']:.4f} GPU-hours at {c['gpu_hour']:g} {cur}"
    line += f"; {per:,.4f} {cur} per million {unit} tokens)" if per is not None else ")"
    compare = c["compare"]
    if compare and compare["ratio"] is not None:
        line += f"; hosted batch price {compare['hosted_total']:,.2f} {cur} (this run: ×{compare['ratio']:.2f})"
    return line
