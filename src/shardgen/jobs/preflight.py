"""Preflight: everything that can be checked before a single GPU job is submitted.

It runs once, on the machine the workflow starts on, after planning and
before any generate job: the input is still as planned, the id column is
unique, the model and its tokenizer load from local files, the precision can
run on the installed vLLM build, and the template renders and fits the
context on a sample of rows. Problems are collected and reported together;
the report (``preflight.json``) also carries an estimate of the run's size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from shardgen.base import jobenv, jobinfo, storage
from shardgen.base.gpus import (
    FP4_WEIGHT_FORMATS,
    FP8_WEIGHT_FORMATS,
    MXFP4_WEIGHT_FORMATS,
    checkpoint_quant_method,
    installed_quantization_methods,
    relative_speed,
)
from shardgen.base.installed import version_problem, vllm_build
from shardgen.base.io import atomic_write_text
from shardgen.base.kernels import kernel_problem
from shardgen.config import RunConfig, engine_version, warnings
from shardgen.data.manifest import Manifest
from shardgen.data.plan import check_columns
from shardgen.engines import kinds, store
from shardgen.engines import vllm as eng
from shardgen.errors import InputError, RowError, ShardgenError
from shardgen.jobs.feed.requests import Request, RowInputs, prepared_requests
from shardgen.models import heads
from shardgen.models.fetch import load_record, load_tokenizer, resolve_model
from shardgen.requests import lora, reasoning
from shardgen.requests.prompts import PromptRenderer
from shardgen.requests.results import DROPPED, choice_first_tokens
from shardgen.requests.tasks import Task, make_task

# Weight formats that need a CUDA GPU: vLLM's CPU build has no kernels for them.
GPU_ONLY_QUANTIZATION = FP8_WEIGHT_FORMATS | FP4_WEIGHT_FORMATS | MXFP4_WEIGHT_FORMATS
# Where Hugging Face configs keep the context length (vLLM takes the smallest present).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# Shards the sample is drawn from: a few rows at the start of each of up to this many, spread evenly.
SAMPLE_SHARDS = 32


class PreflightError(ShardgenError):
    """The run would fail or waste GPU time; nothing has been submitted."""


def _hf_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"model.model: cannot read {model_dir / 'config.json'}: {e}") from e


def model_context_length(hf_config: dict[str, Any]) -> tuple[int, str] | None:
    """The model's own context length and the key it came from, as vLLM derives it."""
    text = hf_config.get("text_config") or {}
    found = [(int(c[k]), k) for c in (hf_config, text) for k in CONTEXT_KEYS if isinstance(c.get(k), int)]
    return min(found) if found else None


def check_precision(model_cfg: Mapping[str, Any], hf_config: dict[str, Any], build: str) -> list[str]:
    """Weight formats the installed vLLM build cannot run."""
    problems = []
    wanted = model_cfg.get("quantization")
    ckpt = checkpoint_quant_method(hf_config)
    if build == "cpu":
        if wanted in GPU_ONLY_QUANTIZATION:
            problems.append(
                f"model.quantization: '{wanted}' needs a CUDA GPU (native FP8 on Hopper/Ada, FP4 on Blackwell), "
                "and this workflow runs vLLM's CPU build; remove model.quantization or install the CUDA build "
                "(SHARDGEN_VLLM=gpu make setup)"
            )
        elif wanted is None and ckpt in GPU_ONLY_QUANTIZATION:
            problems.append(
                f"model.model: the checkpoint is quantized as '{ckpt}', which needs a CUDA GPU; "
                "this workflow runs vLLM's CPU build"
            )
    return problems


def check_engine_values(model_cfg: Mapping[str, Any], hf_config: Mapping[str, Any]) -> list[str]:
    """``model.quantization`` and ``model.kv_cache_dtype`` against the installed vLLM's own lists (a typo
    is refused here, not inside a job), and ``fp8`` on a checkpoint it cannot quantize at load."""
    import difflib

    problems = []
    for key in ("quantization", "kv_cache_dtype"):
        value = model_cfg.get(key)
        if value is None:  # vLLM is imported only for a value to check: 9.4 s to 6.8 s on the demo
            continue
        if key == "quantization":
            allowed = sorted(installed_quantization_methods() | {"auto"})
        else:
            allowed = sorted(eng.kv_cache_dtypes() | {"auto"})
        if value not in allowed:
            near = difflib.get_close_matches(str(value), allowed, n=1)
            problems.append(
                f"model.{key}: '{value}' is not one of vLLM {engine_version()}'s"
                + (f" (did you mean '{near[0]}'?)" if near else "")
                + f"; it knows: {', '.join(allowed)}"
            )
    if model_cfg.get("quantization") == "fp8" and checkpoint_quant_method(hf_config) is None:
        # vllm/model_executor/layers/quantization/fp8.py: online FP8 moved to the fp8_per_* methods
        problems.append(
            "model.quantization: 'fp8' no longer quantizes a BF16/FP16 checkpoint at load in vLLM "
            f"{engine_version()}; use auto (FP8 where the GPU has it), fp8_per_channel or fp8_per_tensor"
        )
    return problems


def check_parallel_layout(model_cfg: Mapping[str, Any], hf_config: Mapping[str, Any]) -> list[str]:
    """The parallel sizes against the model's shape, as vLLM checks them only once a job has its GPUs:
    tensor parallelism splits the attention heads evenly (vllm/config/model.py:
    ``ModelConfig.verify_with_parallel_config``), and each pipeline stage needs a layer
    (vllm/distributed/utils.py: ``get_pp_indices`` gives a stage ``layers // stages`` of them)."""
    text = hf_config.get("text_config") or {}
    heads = text.get("num_attention_heads") or hf_config.get("num_attention_heads")
    layers = text.get("num_hidden_layers") or hf_config.get("num_hidden_layers")
    tp, pp = model_cfg.get("tensor_parallel_size") or 1, model_cfg.get("pipeline_parallel_size") or 1
    problems = []
    if isinstance(heads, int) and heads % tp:
        fits = [n for n in range(1, min(heads, 16) + 1) if heads % n == 0]
        problems.append(
            f"model.tensor_parallel_size: {tp} does not divide the model's {heads} attention heads; vLLM refuses "
            f"to start; use one of {fits}"
        )
    if isinstance(layers, int) and pp > layers:
        problems.append(f"model.pipeline_parallel_size: {pp} stages for the model's {layers} layers; at most {layers}")
    return problems


def check_engine_keys(model_cfg: Mapping[str, Any]) -> list[str]:
    """``model.extra`` keys that are not ``vllm.LLM`` engine arguments."""
    extra = model_cfg.get("extra") or {}
    if not extra:
        return []
    import difflib

    known = eng.engine_argument_names()
    problems = []
    for key in sorted(set(extra) - known):
        near = difflib.get_close_matches(key, sorted(known), n=1)
        problems.append(
            f"model.extra.{key}: not an argument of vLLM {engine_version()}'s engine"
            + (f" (did you mean '{near[0]}'?)" if near else "")
        )
    return problems


def check_ids(source: Any, manifest: Manifest, column: str) -> list[str]:
    """``input.id_column`` holds no nulls and no value twice (reads that column only)."""
    segments = [seg for shard in manifest.shards for seg in shard.segments]
    chunks = [b.column(0) for b in source.read(segments, columns=[column])]
    if not chunks:
        return []
    ids = pa.chunked_array(chunks)
    problems = []
    if ids.null_count:
        first = pc.index(pc.is_null(ids), True).as_py()
        problems.append(f"input.id_column: '{column}' has {ids.null_count} null value(s), the first at row {first}")
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        examples = ", ".join(f"{v['values']!r} ×{v['counts']}" for v in repeated[:3].to_pylist())
        problems.append(
            f"input.id_column: '{column}' is not unique: {len(repeated)} value(s) appear more than once ({examples})"
        )
    return problems


def sample_rows(source: Any, manifest: Manifest, n: int) -> list[tuple[int, dict[str, Any]]]:
    """About ``n`` rows: the first rows of up to ``SAMPLE_SHARDS`` shards spread over the plan."""
    shards = manifest.shards
    if not shards:
        return []
    k = min(len(shards), SAMPLE_SHARDS, n)
    picked = sorted({round(i * (len(shards) - 1) / max(k - 1, 1)) for i in range(k)})
    per = math.ceil(n / len(picked))
    rows: list[tuple[int, dict[str, Any]]] = []
    for i in picked:
        shard = shards[i]
        index = shard.start
        for batch in source.read(shard.segments, batch_rows=min(per, 1024)):
            for row in batch.to_pylist():
                rows.append((index, row))
                index += 1
                if index - shard.start >= per:
                    break
            if index - shard.start >= per:
                break
    return rows[:n]


def check_sampling(config: RunConfig, tokenizer: Any, build: str) -> tuple[list[str], list[str]]:
    """Problems and notes of the sampling settings that need the tokenizer or the build; the reasoning
    parser here, before any job, rather than in the config check (``config.check_reasoning``): its
    name needs the installed vLLM's registry, and the parser the model's tokenizer."""
    problems, notes = [], []
    problems += reasoning.problems(config.sampling, tokenizer, config.prompt.chat_template_kwargs)
    choices = config.sampling.choices
    if config.output.choice_probs and choices:
        try:
            choice_first_tokens(tokenizer, choices)
        except ShardgenError as e:
            problems.append(str(e))
    kv = config.model.get("kv_cache_dtype")
    if kv and kv.startswith("fp8") and not kinds.fp8_kv_cache_supported(build):
        problems.append(
            f"model.kv_cache_dtype: '{kv}' on vLLM's CPU build needs a CPU with AVX-512 or AMX, and this one has "
            "neither; remove the key (or use auto, which picks FP8 only where it runs)"
        )
    if (config.sampling.seed is not None or config.input.sampling_column) and build == "cpu":
        notes.append(
            "seeded sampling on vLLM's CPU build: jobs run with chunked prefill off (PyTorch's CPU generator cannot "
            "rewind the sample of a partly prefilled prompt); long prompts are prefilled in one step"
        )
    return problems, notes


# A KV cache smaller than this on a GPU starves the batch (the CPU demo sets 1 GiB).
SMALL_KV_CACHE_BYTES = 4 << 30


def cpu_demo_settings(model_cfg: Any, build: str) -> list[str]:
    """Warnings for settings of the CPU demo (config/config.yaml) that reach the CUDA build, where
    they cost throughput: start from config/examples/ instead."""
    if build != "cuda":
        return []
    out = []
    if model_cfg.get("dtype") == "float32":
        out.append("model.dtype: float32 on a GPU halves throughput and doubles the weights' memory; leave it out "
                   "(the model's own, bfloat16)")  # fmt: skip
    if model_cfg.get("enforce_eager"):
        out.append("model.enforce_eager: true turns off CUDA graphs, much slower decoding on a GPU; leave it out")
    kv = model_cfg.get("kv_cache_memory_bytes")
    if kv and kv < SMALL_KV_CACHE_BYTES:
        out.append(f"model.kv_cache_memory_bytes: {kv} ({kv / 2**30:.1f} GiB) starves the batch on a GPU; leave it "
                   "out and let model.gpu_memory_utilization size the KV cache")  # fmt: skip
    if out:
        out.append("these are the CPU demo's settings (config/config.yaml); config/examples/ has configs for GPUs")
    return out


def unused_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> list[str]:
    """The keys of ``kwargs`` that the tokenizer's chat template never reads (vLLM drops them
    silently too: vllm/renderers/hf.py, ``resolve_chat_template_kwargs``)."""
    import jinja2
    from jinja2 import meta

    template = getattr(tokenizer, "chat_template", None)
    if not kwargs or not isinstance(template, str):
        return []
    names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    return sorted(k for k in kwargs if k not in names)


def run(
    config: RunConfig, manifest_path: str | Path, record: dict[str, Any] | None = None,
    gpu_model: str | None = None, time_limit: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Check the run; return the report.

    Args:
        record: where the fetch step found the model; when None, it is looked
            up on the local disk only.
        gpu_model, time_limit: the GPU type and the time limit (minutes) the generate jobs ask for (the
            profile's), for the estimate of a shard's minutes (``estimate``).

    Raises:
        PreflightError: listing every problem found.
        FetchError: the model is not on the local disk.
    """
    manifest = Manifest.load(manifest_path)
    source = manifest.source()
    problems: list[str] = []
    notes = list(warnings(config.raw))
    model_cfg, sampling = config.model, config.sampling
    max_rate = config.errors.max_rate

    # The input: as planned, and ids that identify rows. Rows that a run before this one makes after this
    # check (its source is not read at preflight) are not read: their columns are checked below, the rows
    # by the jobs. Ids that planning checked already are not read again.
    kind = manifest.source_kind
    if kind.read_at_preflight:
        source.check_unchanged()
    if config.output.upload and (why := storage.check_writable(config.output.upload, config.input.storage_options)):
        problems.append(why)
    shared = config.cache.dir if config.cache.enabled and config.kind.uses_engine else None
    if shared and storage.is_url(shared) and (why := storage.check_writable(shared, config.input.storage_options,
                                                                            "cache.dir")):  # fmt: skip
        problems.append(why)
    if config.input.id_column and kind.read_at_preflight and not kind.ids_planned:
        problems += check_ids(source, manifest, config.input.id_column)

    if not config.kind.uses_engine:
        return _run_without_engine(config, manifest, source, problems, notes)

    # The model: local files, a tokenizer, a precision this build runs, a context that fits.
    record = record or resolve_model(model_cfg, allow_download=False, adapters=config.lora.adapters)
    model_dir = Path(record["path"])
    hf_config = _hf_config(model_dir)
    build = vllm_build()
    if version := version_problem():
        problems.append(version)
    notes += cpu_demo_settings(model_cfg, build)
    problems += check_precision(model_cfg, hf_config, build)
    problems += check_engine_keys(model_cfg)
    problems += check_engine_values(model_cfg, hf_config)
    problems += check_parallel_layout(model_cfg, hf_config)
    if build == "cuda" and (missing := kernel_problem()):
        problems.append(missing)
    own = model_context_length(hf_config)
    max_len = model_cfg.max_model_len or (own[0] if own else None)
    if own and model_cfg.max_model_len and model_cfg.max_model_len > own[0]:
        problems.append(
            f"model.max_model_len: {model_cfg['max_model_len']} is more than the model's own context "
            f"({own[1]} = {own[0]} in {model_dir / 'config.json'}); vLLM refuses to start with it"
        )
    problems += lora.problems(model_cfg, record.get("adapters") or {})
    head = heads.Head.read(model_dir) if config.kind.needs_head else None
    try:  # for this config: a change of sampling can add a result column without planning again
        check_columns(config, source.schema, source.describe(), head)
    except InputError as e:
        problems.append(str(e))
    if head is not None:
        problems += config.kind.problems(head, model_cfg, config.raw["pooling"])
    elif max_len is not None and sampling.max_tokens >= max_len:
        problems.append(
            f"sampling.max_tokens ({sampling.max_tokens}) leaves no room for a prompt in the model's "
            f"context of {max_len} tokens"
        )
    hf_tokenizer = load_tokenizer(model_cfg, record)
    tokenizer = kinds.Tokenizer(hf_tokenizer, max_len or 2**62, config.kind.generates, config.template_kwargs)
    more_problems, more_notes = config.kind.check_model(config, hf_tokenizer)  # what the task adds: a rollout's tools
    problems += more_problems
    notes += more_notes
    if unused := unused_template_kwargs(hf_tokenizer, config.prompt.chat_template_kwargs):
        notes.append(
            f"prompt.chat_template_kwargs: the model's chat template does not use {', '.join(unused)}; "
            "it changes nothing (a misspelt name?)"
        )
    more_problems, more_notes = check_sampling(config, hf_tokenizer, build)
    problems += more_problems
    notes += more_notes

    # A sample of rows, made requests as a shard job makes them: the template renders, prompts tokenize and
    # fit, each row's adapter, images and own sampling are valid.
    renderer = PromptRenderer.from_config(config.prompt)
    if max_len is not None:
        renderer.max_chars = tokenizer.max_prompt_chars
    sample = sample_rows(source, manifest, config.preflight.sample_rows) if kind.read_at_preflight else []
    reasons: dict[str, int] = {}
    first_error: dict[str, str] = {}

    def row_error(index: int, row: dict[str, Any], e: RowError) -> None:
        if e.reason == DROPPED:  # a row its source dropped: not this run's, no error (as a job counts it)
            return
        reasons[e.reason] = reasons.get(e.reason, 0) + 1
        first_error.setdefault(e.reason, f"row {index}: {e}")

    lengths: list[int] = []
    outputs: list[int] = []  # the output tokens each sampled row that runs may generate
    undetermined = 0  # sampled rows whose answers the request store can neither keep nor reuse
    if sample:
        try:
            task = make_task(config, tokenizer, head)
        except Exception:  # a problem listed above fails it too (a reasoning parser, a rollout's tools, no vLLM)
            if not problems:
                raise
            sample = []  # the run is refused for it anyway
        else:
            records = record.get("adapters") or {}
            adapters = lora.Adapters(config.lora, records, build) if config.lora.adapters else None
            inputs = RowInputs.for_run(config, source, adapters)
            for req in sample_requests(sample, renderer, tokenizer, task, inputs, row_error):
                lengths.append(len(req.prompt_token_ids))
                undetermined += not store.determined(req.params)
                if config.kind.generates:  # the row's own max_tokens and n (input.sampling_column), as vLLM has them
                    outputs.append(req.params.max_tokens * req.params.n)
    errors = sum(reasons.values())
    detail = "; ".join(f"{k} {v} (first: {first_error[k]})" for k, v in sorted(reasons.items()))
    if "template_unsafe" in reasons:
        problems.append(f"prompt.template: the sandbox refused an unsafe operation: {first_error['template_unsafe']}")
    elif sample and errors / len(sample) > max_rate:
        problems.append(
            f"prompt: {errors} of {len(sample)} sampled rows would be errors, more than errors.max_rate "
            f"({max_rate}) allows, so every shard would fail: {detail}"
        )
    elif errors:
        notes.append(
            f"{errors} of {len(sample)} sampled rows will be per-row errors (about "
            f"{round(errors / len(sample) * manifest.total_rows)} of all rows): {detail}"
        )
    if undetermined and config.cache.enabled:
        notes.append(
            f"{undetermined} of {len(lengths)} sampled rows sample at a temperature above 0 without a seed (about "
            f"{round(undetermined / len(lengths) * manifest.total_rows)} of all rows): their answers are neither "
            "reused nor kept by the request store (cache); set sampling.seed or temperature: 0 to reuse them"
        )
    if max_len is not None and config.kind.generates:
        short = sum(1 for n in lengths if n + sampling.max_tokens > max_len)
        if short:
            notes.append(
                f"{short} of {len(sample)} sampled rows leave fewer than sampling.max_tokens "
                f"({sampling.max_tokens}) tokens of the {max_len}-token context; their output stops early"
            )

    report = {
        "ok": not problems,
        "problems": problems,
        "warnings": notes,
        "vllm_build": build,
        "vllm_version": engine_version(),
        "model_dir": str(model_dir),
        "max_model_len": max_len,
        "sampled_rows": len(sample),
        "sampled_errors": reasons,
        "estimate": estimate(config, manifest, lengths, outputs, gpu_model, time_limit),
    }
    report["warnings"] += sizing_warnings(config, report["estimate"])
    if problems:
        raise PreflightError(
            f"preflight found {len(problems)} problem(s); no generate job was submitted:\n  - "
            + "\n  - ".join(problems)
        )
    return report


def sample_requests(
    sample: list[tuple[int, dict[str, Any]]],
    renderer: PromptRenderer,
    tokenizer: kinds.Tokenizer,
    task: Task,
    inputs: RowInputs,
    on_error: Callable[[int, dict[str, Any], RowError], None],
) -> list[Request]:
    """The sampled rows as the requests a shard job makes of them (``feed.prepared_requests``), each
    row's images decoded (a job decodes them when it submits the request); a row that would be an
    error goes to ``on_error`` instead."""
    out = []
    for req in prepared_requests(iter(sample), renderer, tokenizer, task, on_error, inputs=inputs):
        try:
            req.images()  # a column of broken images is found now
        except RowError as e:
            on_error(req.key, req.row, e)
            continue
        out.append(req)
    return out


def _run_without_engine(
    config: RunConfig, manifest: Manifest, source: Any, problems: list[str], notes: list[str]
) -> dict[str, Any]:
    """The preflight of a task without a model (a Python function): its columns, and the task itself on
    a few sampled rows (``Task.check_rows``; up to the task's ``preflight_rows``). Rows that a run before
    this one makes (its source is not read at preflight) do not exist yet: the task gets none, and checks
    what it can without them."""
    try:
        check_columns(config, source.schema, source.describe())
    except InputError as e:
        problems.append(str(e))
    n = min(config.preflight.sample_rows, config.kind.preflight_rows or config.preflight.sample_rows)
    sample = sample_rows(source, manifest, n) if manifest.source_kind.read_at_preflight else []
    more_problems, more_notes, *fields = config.kind.check_rows(config, sample, source.schema)
    problems += more_problems
    notes += more_notes
    if problems:
        listed = "\n  - ".join(problems)
        raise PreflightError(f"preflight found {len(problems)} problem(s); no job was submitted:\n  - {listed}")
    rows, shards = manifest.total_rows, len(manifest.shards)
    return {"ok": True, "problems": [], "warnings": notes, "task": config.task, "sampled_rows": len(sample),
            **(fields[0] if fields else {}),  # what the task adds: a function's calls (function_calls)
            "estimate": {"rows": rows, "shards": shards, "gpus_per_job": 0, "gpu_hours_at_most": 0.0}}  # fmt: skip


def estimate(
    config: RunConfig, manifest: Manifest, lengths: list[int], outputs: list[int] | None = None,
    gpu_model: str | None = None, time_limit: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The run's size: rows, shards, prompt tokens (from the sample), GPU-hours at the stated throughput,
    and the minutes of the largest shard on the jobs' GPU type: the engine's start, its prompt tokens at
    ``preflight.prompt_tokens_per_second`` and its output tokens at ``preflight.tokens_per_second`` (each
    an H100's, scaled to ``gpu_model`` by ``gpus.relative_speed``).

    Args:
        outputs: the output tokens each sampled row may generate (its ``max_tokens`` times its ``n``):
            with ``input.sampling_column`` a row's own, so the sample's mean stands for every row.
        gpu_model, time_limit: the jobs' GPU type and time limit in minutes (the profile's), when known.
    """
    rows, shards = manifest.total_rows, len(manifest.shards)
    pre = config.preflight
    generates = config.kind.generates
    # every sample of a row is generated: n of them
    out_tokens = rows * config.sampling.max_tokens * config.sampling.n if generates else 0
    per_row = generates and bool(config.input.sampling_column and outputs)
    if per_row:
        out_tokens = round(sum(outputs) / len(outputs) * rows)
    mean_prompt = sum(lengths) / len(lengths) if lengths else 0.0
    work = out_tokens if generates else mean_prompt * rows  # a pooling task's work is its prompts
    seconds = work / pre.tokens_per_second + shards * pre.engine_start_seconds
    gpus = config.model.gpus
    prefill, decode, gpu = relative_speed(gpu_model)
    largest = max((s.rows for s in manifest.shards), default=0)
    if generates:
        generating = (mean_prompt * largest / (pre.prompt_tokens_per_second * prefill)
                      + (out_tokens / rows if rows else 0) * largest / (pre.tokens_per_second * decode))  # fmt: skip
    else:  # a pooling task's work is its prompts, at its stated rate
        generating = mean_prompt * largest / (pre.tokens_per_second * prefill)
    return {
        "rows": rows,
        "shards": shards,
        "gpus_per_job": gpus,
        "mean_prompt_tokens_sampled": round(mean_prompt, 1),
        "prompt_tokens": round(mean_prompt * rows),
        "output_tokens_at_most": out_tokens,
        "assumed_tokens_per_second": pre.tokens_per_second,
        "assumed_engine_start_seconds": pre.engine_start_seconds,
        "gpu_hours_at_most": round(seconds * gpus / 3600, 3),
        "gpu": gpu,
        "largest_shard_rows": largest,
        "generation_minutes_per_shard": round(generating / 60, 1),
        "minutes_per_shard": round((generating + pre.engine_start_seconds) / 60, 1),
        "job_time_limit_minutes": time_limit,
        # the rows of a shard that generates for SHARD_MINUTES, at the same rates
        "rows_per_shard_for_target": (round(SHARD_MINUTES * 60 * largest / generating) if generating > 0 else None),
    } | ({"output_tokens_from": "the sampled rows' own max_tokens and n"} if per_row else {})


# What the estimate takes a good shard to be: long against the engine's start and the queue, well within a
# job's time limit (docs/deployment.md, "Shard size"); shorter than SHORT_SHARD_MINUTES is a warning.
SHARD_MINUTES = 45
SHORT_SHARD_MINUTES = 3


def sizing_warnings(config: RunConfig, e: dict[str, Any]) -> list[str]:
    """A shard expected to run past the jobs' time limit, or to generate for only a few minutes (in a run of
    several shards, each paying the engine's start), with the rows per shard that would take SHARD_MINUTES."""
    rates = (f"on {e['gpu']} at preflight.prompt_tokens_per_second and preflight.tokens_per_second, "
             f"counting max_tokens; rows_per_shard about {e['rows_per_shard_for_target']} would take {SHARD_MINUTES} "
             "minutes")  # fmt: skip
    limit = e.get("job_time_limit_minutes")
    if limit and e["minutes_per_shard"] > limit:
        return [f"a shard of {e['largest_shard_rows']} rows is expected to take up to {e['minutes_per_shard']} minutes "
                f"({rates}), past the generate jobs' time limit of {limit:g} minutes (resources.runtime): each "
                "would need retries to finish"]  # fmt: skip
    if e["shards"] > 3 and e["generation_minutes_per_shard"] < SHORT_SHARD_MINUTES:
        return [f"shards are expected to generate for at most {e['generation_minutes_per_shard']} minutes each "
                f"({rates}) against an engine start of about {e['assumed_engine_start_seconds']:g} s per job: "
                "raise shards.rows_per_shard, or start the engine once for several shards (shards.per_job, "
                "shards.workers)"]  # fmt: skip
    return []


def report_text(report: dict[str, Any]) -> str:
    e = report["estimate"]
    if "vllm_build" not in report:  # a task without a model
        ran = f"run on {report['sampled_rows']} sampled row(s)"
        if "function_not_called" in report:
            ran = f"imported and checked in a worker process, not called ({report['function_not_called']})"
        elif "function_calls" in report:
            ran = f"{report['function_calls']} call(s) of the function on {report['sampled_rows']} sampled row(s)"
        lines = [f"preflight: ok (task {report['task']}, {ran})", f"  rows {e['rows']} in {e['shards']} shards, no GPU"]
        return "\n".join(lines + [f"  warning: {w}" for w in report["warnings"]])
    lines = [
        f"preflight: ok ({report['sampled_rows']} sampled rows; "
        f"vLLM {report['vllm_version']}, {report['vllm_build']} build)",
        f"  rows {e['rows']} in {e['shards']} shards, {e['gpus_per_job']} GPU(s) per job",
        f"  prompt tokens about {e['prompt_tokens']} (mean {e['mean_prompt_tokens_sampled']} sampled), "
        f"output tokens at most {e['output_tokens_at_most']}"
        + (f" ({e['output_tokens_from']})" if "output_tokens_from" in e else ""),
        f"  GPU-hours at most {e['gpu_hours_at_most']} at {e['assumed_tokens_per_second']} output tokens/s "
        f"and {e['assumed_engine_start_seconds']} s engine start per job (preflight.tokens_per_second, "
        "preflight.engine_start_seconds)",
        f"  a shard ({e['largest_shard_rows']} rows) about {e['minutes_per_shard']} minutes at most on {e['gpu']}, "
        f"{e['generation_minutes_per_shard']} of them generating"
        + (f" (the jobs' time limit: {e['job_time_limit_minutes']:g})" if e.get("job_time_limit_minutes") else ""),
    ]
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def main_preflight(
    config: RunConfig, manifest: str, report_path: str, model_record: str | None = None,
    gpu_model: str | None = None, time_limit: float | None = None,
) -> int:  # fmt: skip
    jobenv.enter("preflight")  # done by the command already; in process (tests) here
    report = run(config, manifest, load_record(model_record) if model_record else None, gpu_model, time_limit)
    atomic_write_text(report_path, json.dumps(report, indent=1) + "\n")
    print(report_text(report))
    return 0


def storage_objects(config: RunConfig) -> bool:
    """Whether the run reads its input from object storage (an ``s3://`` pattern)."""
    return any(storage.is_url(p) for p in config.input.parquet or ())


def reach_storage(config: RunConfig, manifest_path: str | Path, record_path: str | Path) -> dict[str, Any]:
    """From a compute job, before any GPU job (the rule ``reach_storage``, submitted like a generate job
    but asking for no GPU): the input's objects can be read where the jobs run, one object of each
    bucket (a compute node may reach a site's store when it reaches nothing else, or not at all, with
    other credentials). Writes what it read, and from where.

    Raises:
        InputError: an object cannot be read from here, naming it, the node and the job.
    """
    where = f"{jobinfo.host()}" + (f", Slurm job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else "")
    firsts: dict[str, str] = {}
    try:
        for f in Manifest.load(manifest_path).data["source"].get("files") or []:
            if storage.is_url(f["path"]):
                firsts.setdefault(f["path"].split("/")[2], f["path"])
        for url in firsts.values():
            storage.head(url, config.input.storage_options)
    except InputError as e:
        raise InputError(f"{e} (from a compute job on {where}: the nodes that run the generate jobs must reach "
                         "the endpoint, with the credentials in the environment they inherit); no generate job "
                         "was submitted") from e  # fmt: skip
    record = {"host": jobinfo.host(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "objects": list(firsts.values())}
    atomic_write_text(record_path, json.dumps(record, indent=1) + "\n", below=config.output.dir)
    return record
