"""Plots and a table of totals of a finished run, for ``snakemake --report``.

Everything comes from the run's two results: the merged stats (each shard's
figures and the merged latency histograms) and the merged output, of which
only the two token-count columns are read, one batch at a time, so memory
stays flat however large the output is. Every plot has to stay readable with
thousands of shards: above ``MAX_BARS`` shards, per-shard bars give way to a
ranked line or to groups of shards.
"""

from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from shardgen.base.io import atomic_write, atomic_write_text
from shardgen.data import formats
from shardgen.data.stats import BUCKET_MIN, BUCKET_RATIO, LogHistogram
from shardgen.errors import ShardgenError
from shardgen.requests.tasks import KINDS

# The files make_plots writes into its directory (workflow/rules/report.smk names the same).
TOTALS = "totals.html"
THROUGHPUT = "throughput.svg"
TTFT = "ttft.svg"
TOKEN_LENGTHS = "token_lengths.svg"
TIME_PER_SHARD = "time_per_shard.svg"
FILES = (TOTALS, THROUGHPUT, TTFT, TOKEN_LENGTHS, TIME_PER_SHARD)

MAX_BARS = 60  # more shards than this: a ranked line, or bars of groups of shards
LENGTH_CAP = 1 << 20  # token counts at or above share the last bin (bounds the counting array)
TOKEN_COLUMNS = {"prompt_tokens": "Prompt length", "generated_tokens": "Output length"}
# Rows of the totals table that only text generation has.
GENERATION_ONLY_ROWS = {
    "generated tokens",
    "output tokens/s",
    "total tokens/s (prompt + output)",
    "time to first token p50 / p90 / p99",
    "  of which queued before scheduling",
    "  from scheduling to first token",
    "output tokens per GPU-hour",
}

# Text stays text in the SVG (searchable, small) and the files are byte-for-byte
# repeatable (no date, fixed ids), so a rerun changes nothing.
_RC = {"svg.fonttype": "none", "svg.hashsalt": "shardgen", "font.size": 9}
_COLORS = {"queue": "#9e9e9e", "engine": "#f0a030", "generation": "#3070b0", "other": "#70b070"}


@dataclass(frozen=True)
class ShardFigures:
    """One shard's figures, as the plots need them (None where the stats have no value)."""

    shard: str
    job_id: str | None
    output_tokens_per_s: float | None
    queue_wait_s: float | None
    engine_start_s: float
    generation_s: float
    other_s: float  # the rest of the job's wall time: reading, writing, checkpoints


@dataclass
class LengthCounts:
    """How often each token count occurs in a column (index = count), streamed."""

    counts: np.ndarray
    nulls: int = 0  # rows (or samples) without a value: error rows
    per_sample: bool = False  # one value per kept sample (a list column, or a row per sample)
    present: bool = True

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def add(self, values: np.ndarray) -> None:
        values = np.minimum(values.astype(np.int64, copy=False), LENGTH_CAP).clip(min=0)
        if not len(values):
            return
        counts = np.bincount(values)
        if len(counts) > len(self.counts):
            counts[: len(self.counts)] += self.counts
            self.counts = counts
        else:
            self.counts[: len(counts)] += counts

    def quantile(self, q: float) -> int | None:
        total = self.total
        if not total:
            return None
        return int(np.searchsorted(np.cumsum(self.counts), q * total, side="left"))


def _num(value: Any) -> float | None:
    """A finite number, or None (missing, null, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def load_stats(path: str | Path) -> dict[str, Any]:
    """Read the merged stats (``results/stats.json``).

    Raises:
        ShardgenError: the file cannot be read or is not a stats object.
    """
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ShardgenError(f"cannot read the stats '{path}': {e}") from e
    if not isinstance(stats, dict):
        raise ShardgenError(f"the stats '{path}' are not a JSON object")
    return stats


def shard_figures(stats: dict[str, Any]) -> list[ShardFigures]:
    """Each shard's figures, in plan order."""
    out = []
    for i, s in enumerate(stats.get("shards") or []):
        engine = _num(s.get("engine_start_seconds")) or 0.0
        generation = _num(s.get("generation_seconds")) or 0.0
        wall = _num(s.get("wall_seconds")) or 0.0
        job_id = (s.get("slurm") or {}).get("job_id")
        out.append(
            ShardFigures(
                shard=str(s.get("shard", f"#{i}")),
                job_id=str(job_id) if job_id is not None else None,
                output_tokens_per_s=_num(s.get("output_tokens_per_s")),
                queue_wait_s=_num(s.get("queue_wait_seconds")),
                engine_start_s=engine,
                generation_s=generation,
                other_s=max(0.0, wall - engine - generation),
            )
        )
    return out


def length_counts(output: str | Path, batch_size: int = 65536) -> dict[str, LengthCounts]:
    """Count the token lengths of ``prompt_tokens`` and ``generated_tokens`` in the merged output.

    Reads only those columns (and ``sample_index``), batch by batch, so memory
    does not grow with the output. Null values (error rows) are counted apart.
    Several samples per row are counted once per sample: a list column is
    flattened, and with one output row per sample a prompt is counted once,
    on its sample 0.

    Args:
        output: the merged output: a Parquet file, a JSON Lines file
            (``.jsonl``) or a ``datasets`` directory.

    Raises:
        ShardgenError: the output cannot be read.
    """
    path = Path(output)
    try:
        names, read = formats.read_columns(path, batch_size)
        out = {name: LengthCounts(np.zeros(0, np.int64), present=name in names) for name in TOKEN_COLUMNS}
        columns = [n for n in TOKEN_COLUMNS if n in names]
        per_sample_rows = "sample_index" in names  # output.samples rows: one output row per sample
        out["generated_tokens"].per_sample = per_sample_rows
        for batch in read(columns + ["sample_index"] * per_sample_rows) if columns else ():
            for name in columns:
                col, lc = batch.column(name), out[name]
                if name == "prompt_tokens" and per_sample_rows:
                    col = col.filter(pc.fill_null(pc.equal(batch.column("sample_index"), 0), True))
                if _is_list(col.type):
                    lc.per_sample = True
                    lc.nulls += col.null_count
                    col = pc.list_flatten(col)
                lc.nulls += col.null_count
                if not pa.types.is_null(col.type):
                    lc.add(col.drop_null().to_numpy(zero_copy_only=False))
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise ShardgenError(f"cannot read the output '{output}': {e}") from e
    return out


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _fmt(value: float | None, spec: str = ",.1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{format(value, spec)}{unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _time_unit(seconds: float) -> tuple[str, float]:
    """A unit for an axis whose largest value is ``seconds``: its name and its size in seconds."""
    if seconds >= 3 * 3600:
        return "h", 3600.0
    if seconds >= 300:
        return "min", 60.0
    return "s", 1.0


def totals(stats: dict[str, Any], shards: list[ShardFigures]) -> list[tuple[str, str]]:
    """The run's totals as (what, value) pairs, for people."""
    queue = [s.queue_wait_s for s in shards if s.queue_wait_s is not None]
    hit = _num(stats.get("prefix_cache_hit_rate"))
    reasons = stats.get("error_reasons") or {}
    queue_text = "n/a"  # not recorded by this run's shards
    if queue:
        queue_text = _duration(sum(queue))
        if len(queue) < len(shards):
            queue_text += f" (n/a for {_plural(len(shards) - len(queue), 'shard')})"

    longest = _duration(_num(stats.get("makespan_seconds")))
    if stats.get("slowest_shard") is not None:
        longest += f", shard {stats['slowest_shard']}"
        if (ratio := _num(stats.get("slowest_over_median"))) is not None:
            longest += f" ({ratio:.1f}× the median shard)"

    def n(key: str) -> str:
        return _fmt(_num(stats.get(key)), ",.0f")

    def percentiles(stem: str) -> str:
        return " / ".join(_fmt(_num(stats.get(f"{stem}_p{q}_s")), ".3f", " s") for q in (50, 90, 99))

    rows = [
        ("rows", f"{n('rows')} ({n('errors')} errors)"),
        ("shards", f"{len(shards):,} (rows resumed from checkpoints: {n('rows_resumed')})"),
        (
            "rows generated",
            f"{n('rows_generated')} ({n('requests_reused')} more reused from the request store, "
            f"{n('requests_deduplicated')} answered by a duplicate in their job)",
        ),
        ("prompt tokens", n("prompt_tokens")),
        ("generated tokens", n("generated_tokens")),
        ("output tokens/s", _fmt(_num(stats.get("output_tokens_per_s")))),
        ("total tokens/s (prompt + output)", _fmt(_num(stats.get("total_tokens_per_s")))),
        ("requests/s", _fmt(_num(stats.get("requests_per_s")), ",.2f")),
        ("time to first token p50 / p90 / p99", percentiles("ttft")),
        ("  of which queued before scheduling", percentiles("queue")),
        ("  from scheduling to first token", percentiles("ttft_scheduled")),
        ("end-to-end latency p50 / p90 / p99", percentiles("latency")),
        ("prefix cache hits", _fmt(None if hit is None else 100 * hit, ".1f", "% of prompt tokens")),
        ("generation time, all shards", _duration(_num(stats.get("generation_seconds")))),
        ("engine start time, all shards", _duration(_num(stats.get("engine_start_seconds")))),
        ("queue wait, all shards", queue_text),
        ("longest shard (wall time)", longest),
        ("GPU-hours", _fmt(_num(stats.get("gpu_hours")), ",.4f")),
        ("output tokens per GPU-hour", _fmt(_num(stats.get("output_tokens_per_gpu_hour")), ",.0f")),
    ]
    if not KINDS[stats.get("task", "generate")].generates:  # a pooling task: no output tokens, no first token
        rows = [("task", stats["task"])] + [r for r in rows if r[0] not in GENERATION_ONLY_ROWS]
        at = [r[0] for r in rows].index("requests/s") + 1
        rows.insert(at, ("prompt tokens/s", _fmt(_num(stats.get("prompt_tokens_per_s")))))
        rows.append(("rows per GPU-hour", _fmt(_num(stats.get("rows_per_gpu_hour")), ",.0f")))
    if "preemptions" in stats:
        rows.append(("preemptions (KV cache full)", n("preemptions")))
    spec = stats.get("spec_decode") or {}
    if _num(spec.get("acceptance_rate")) is not None:
        rows.append(("speculative decoding", f"{100 * spec['acceptance_rate']:.1f}% of draft tokens accepted"))
    if reasons:
        rows.append(("errors by reason", ", ".join(f"{k}: {v:,}" for k, v in sorted(reasons.items()))))
    return rows + _cost_rows(stats.get("cost"))


def _cost_rows(c: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The cost (``shardgen.base.cost.run_cost``): the total and what it includes, per token and row, and
    the hosted batch price of the same tokens."""
    if not isinstance(c, dict) or _num(c.get("total")) is None:
        return []
    cur = str(c.get("currency"))

    def money(v: Any, spec: str = ",.2f") -> str:
        return _fmt(_num(v), spec, f" {cur}")

    rows = [
        ("cost", f"{money(c['total'])} ({_fmt(_num(c.get('billed_gpu_hours')), ',.4f')} GPU-hours billed at "
                 f"{money(c.get('gpu_hour'), ',g')} each: {c.get('includes')})"),
        ("cost per million input / output tokens",
         f"{money(c.get('per_million_input_tokens'), ',.4f')} / {money(c.get('per_million_output_tokens'), ',.4f')}"),
        ("cost per thousand rows", money(c.get("per_thousand_rows"), ",.4f")),
    ]  # fmt: skip
    if _num(c.get("attempts_unmeasured")):
        rows.append(
            ("attempts without a measured time", f"{c['attempts_unmeasured']:,} (killed outright; not in the cost)")
        )
    compare = c.get("compare")
    if isinstance(compare, dict):
        rows.append((
            "the same tokens at the hosted batch price",
            f"{money(compare.get('hosted_total'))} ({money(compare.get('input_per_mtok'), ',g')} per million input, "
            f"{money(compare.get('output_per_mtok'), ',g')} per million output tokens); this run costs "
            f"{_fmt(_num(compare.get('ratio')), ',.2f', '×')} that",
        ))  # fmt: skip
    return rows


def write_totals(stats: dict[str, Any], shards: list[ShardFigures], path: Path) -> Path:
    """A small self-contained HTML table of the totals (shown in the report as it is)."""
    body = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in totals(stats, shards))
    text = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Run totals</title>\n'
        "<style>body{font-family:sans-serif;font-size:14px}table{border-collapse:collapse}"
        "th,td{padding:4px 12px;border-bottom:1px solid #ddd}th{text-align:left;font-weight:normal;color:#555}"
        "td{text-align:right;font-variant-numeric:tabular-nums}</style></head>\n"
        f'<body><table id="totals">\n<caption>Run totals</caption>\n{body}\n</table></body></html>\n'
    )
    atomic_write_text(path, text)
    return path


def _styled(plot: Callable[..., Path]) -> Callable[..., Path]:
    """Run a plot function under the report's matplotlib settings (without changing the caller's)."""

    @functools.wraps(plot)
    def wrapper(*args: Any, **kwargs: Any) -> Path:
        with matplotlib.rc_context(_RC):
            return plot(*args, **kwargs)

    return wrapper


def _save(fig: Figure, path: Path, title: str) -> Path:
    atomic_write(path, lambda f: fig.savefig(f, format="svg", metadata={"Title": title, "Date": None}))
    return path


def _nothing(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#555")


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


@_styled
def plot_throughput(shards: list[ShardFigures], path: Path) -> Path:
    """(a) Output tokens/s per shard: bars up to MAX_BARS shards, a ranked line above."""
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    known = [s for s in shards if s.output_tokens_per_s is not None]
    title = "Output tokens/s per shard"
    ax.set_ylabel("output tokens/s (tokens per second)")
    if not shards:
        ax.set_xlabel("shard (id)")
        _nothing(ax, "no shards")
    elif len(shards) <= MAX_BARS:
        x = np.arange(len(shards))
        ax.bar(x, [s.output_tokens_per_s or 0.0 for s in shards], color=_COLORS["generation"])
        for i, s in enumerate(shards):
            if s.output_tokens_per_s is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", rotation=90, fontsize=7)
        ax.set_xticks(x, [s.shard for s in shards], rotation=90 if len(shards) > 12 else 0, fontsize=7)
        ax.set_xlabel("shard (id)")
    else:
        ranked = sorted(known, key=lambda s: s.output_tokens_per_s)
        rank = np.arange(1, len(ranked) + 1)
        ax.plot(rank, [s.output_tokens_per_s for s in ranked], color=_COLORS["generation"], lw=1.2)
        ax.set_xlabel(f"shard rank, slowest first (1 to {len(ranked):,})")
        title += f" ({len(shards):,} shards, ranked)"
        slowest = ", ".join(s.shard + (f" (job {s.job_id})" if s.job_id else "") for s in ranked[:3])
        if slowest:
            ax.text(0.01, 0.03, f"slowest: {slowest}", transform=ax.transAxes, fontsize=8, color="#555")
    if known:
        median = float(np.median([s.output_tokens_per_s for s in known]))
        ax.axhline(median, color="#333", ls="--", lw=1, label=f"median {median:,.1f} tokens/s")
        ax.legend(loc="upper left")
        ax.set_ylim(bottom=0)
    if len(known) < len(shards):
        title += f"\n{_plural(len(shards) - len(known), 'shard')} n/a (no generation time)"
    ax.set_title(title)
    return _save(fig, path, title)


class _PlainLogFormatter(LogFormatter):
    """Log-axis labels as plain numbers (0.03, 0.2, 1), on the ticks matplotlib would label."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


@_styled
def plot_ttft(stats: dict[str, Any], path: Path) -> Path:
    """(b) Time to first token of every request, from the merged log-bucketed histogram."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    hists = stats.get("histograms") or {}
    hist = LogHistogram.from_json(hists.get("ttft_s") or {})
    scheduled = LogHistogram.from_json(hists.get("ttft_scheduled_s") or {})
    title = f"Time to first token ({hist.count:,} requests)"
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("requests per bucket (count; buckets 5% wide)")
    if not hist.count:
        _nothing(ax, "no time-to-first-token samples")
    else:
        for h, color, label in ((hist, _COLORS["generation"], "from arrival (queue included)"),
                                (scheduled, _COLORS["engine"], "from scheduling")):  # fmt: skip
            if h.count:
                lo, hi = min(h.counts), max(h.counts)
                counts = [h.counts.get(i, 0) for i in range(lo, hi + 1)]
                edges = BUCKET_MIN * BUCKET_RATIO ** np.arange(lo, hi + 2, dtype=float)  # bucket i: [MIN r^i, ..)
                ax.stairs(counts, edges, fill=True, color=color, alpha=0.6, label=label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_PlainLogFormatter())
        ax.xaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        for q, style in ((50, "--"), (90, "-."), (99, ":")):
            v = hist.quantile(q / 100)
            ax.axvline(v, color="#333", ls=style, lw=1, label=f"p{q} {v:.3g} s")
        ax.legend(loc="upper right")
    ax.set_title(title)
    return _save(fig, path, title)


def _rebin(counts: np.ndarray, max_bins: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Counts per integer value -> at most ``max_bins`` equal-width bins over the used range: (edges, counts)."""
    used = np.flatnonzero(counts)
    lo, hi = int(used[0]), int(used[-1])
    width = max(1, math.ceil((hi - lo + 1) / max_bins))
    starts = np.arange(lo, hi + 1, width)
    binned = np.add.reduceat(counts[lo : hi + 1], starts - lo)
    return np.append(starts, starts[-1] + width) - 0.5, binned  # a bin covers whole token counts


@_styled
def plot_token_lengths(lengths: dict[str, LengthCounts], path: Path) -> Path:
    """(c) Histograms of prompt and output lengths, side by side."""
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    title = "Prompt and output lengths"
    for ax, (name, label) in zip(axes, TOKEN_COLUMNS.items(), strict=True):
        lc = lengths.get(name) or LengthCounts(np.zeros(0, np.int64), present=False)
        unit = "samples" if lc.per_sample else "rows"
        ax.set_xlabel(f"{label.lower()} (tokens)")
        ax.set_ylabel(f"{unit} (count)")
        ax.set_title(
            f"{label} ({lc.total:,} {unit})" + (f"\n{lc.nulls:,} without a value (error rows)" if lc.nulls else "")
        )
        if not lc.present:
            _nothing(ax, f"the output has no column {name}")
            continue
        if not lc.total:
            _nothing(ax, "no values")
        else:
            edges, binned = _rebin(lc.counts)
            ax.stairs(binned, edges, fill=True, color=_COLORS["generation"], alpha=0.8)
            median = lc.quantile(0.5)
            ax.axvline(median, color="#333", ls="--", lw=1, label=f"median {median:,} tokens")
            ax.legend(loc="upper left")
    fig.suptitle(title)
    return _save(fig, path, title)


@_styled
def plot_time_per_shard(shards: list[ShardFigures], path: Path) -> Path:
    """(d) Where each shard's time went: queue wait, engine start, generation, the rest.

    Up to MAX_BARS shards get a stacked bar each; more are grouped, in plan
    order, into at most MAX_BARS groups, each bar the mean of its group.
    """
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    title = "Where the time went, per shard"
    if not shards:
        ax.set_xlabel("shard (id)")
        ax.set_ylabel("time (s)")
        _nothing(ax, "no shards")
        ax.set_title(title)
        return _save(fig, path, title)
    queue_known = sum(s.queue_wait_s is not None for s in shards)
    queue_label = "queue wait" + (
        " (n/a: not recorded)"
        if not queue_known
        else f" (n/a for {_plural(len(shards) - queue_known, 'shard')})"
        if queue_known < len(shards)
        else ""
    )
    parts = [
        ("queue", queue_label, [s.queue_wait_s or 0.0 for s in shards]),
        ("engine", "engine start", [s.engine_start_s for s in shards]),
        ("generation", "generation", [s.generation_s for s in shards]),
        ("other", "rest of the job (read, write, checkpoints)", [s.other_s for s in shards]),
    ]
    values = np.array([p[2] for p in parts], dtype=float)  # (part, shard)
    group = math.ceil(len(shards) / MAX_BARS)
    starts = np.arange(0, len(shards), group)
    sizes = np.diff(np.append(starts, len(shards)))
    means = np.add.reduceat(values, starts, axis=1) / sizes
    unit, scale = _time_unit(float(means.sum(axis=0).max()))
    x = np.arange(len(starts))
    bottom = np.zeros(len(starts))
    for (key, label, _), row in zip(parts, means / scale, strict=True):
        ax.bar(x, row, bottom=bottom, color=_COLORS[key], label=label, width=0.8 if group == 1 else 0.95)
        bottom += row
    if group == 1:
        ax.set_xticks(x, [s.shard for s in shards], rotation=90 if len(shards) > 12 else 0, fontsize=7)
        ax.set_xlabel("shard (id)")
        ax.set_ylabel(f"time ({unit})")
    else:
        ticks = x[:: max(1, len(x) // 10)]
        ax.set_xticks(ticks, [shards[starts[i]].shard for i in ticks], rotation=90, fontsize=7)
        ax.set_xlabel(f"first shard of each group of {group} (plan order)")
        ax.set_ylabel(f"mean time per shard ({unit})")
        title += f" ({len(shards):,} shards, mean of each group of {group})"
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title)
    return _save(fig, path, title)


def make_plots(stats_path: str | Path, output: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the totals table and the four plots of a run into ``out_dir``.

    Args:
        stats_path: the merged stats (``results/stats.json``).
        output: the merged output (``results/output.parquet``, ``.jsonl`` or
            the ``datasets`` directory); only the token counts are read.
        out_dir: where to write the files named in ``FILES``.

    Returns:
        The paths written, in the order of ``FILES``.

    Raises:
        ShardgenError: an input cannot be read.
    """
    stats = load_stats(stats_path)
    shards = shard_figures(stats)
    lengths = length_counts(output)
    out = Path(out_dir)
    return [
        write_totals(stats, shards, out / TOTALS),
        plot_throughput(shards, out / THROUGHPUT),
        plot_ttft(stats, out / TTFT),
        plot_token_lengths(lengths, out / TOKEN_LENGTHS),
        plot_time_per_shard(shards, out / TIME_PER_SHARD),
    ]


def main_plots(stats_path: str | Path, output: str | Path, out_dir: str | Path) -> int:
    for path in make_plots(stats_path, output, out_dir):
        print(f"wrote {path}")
    return 0
