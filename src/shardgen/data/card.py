"""The dataset card of a run's output: a ``README.md`` in the Hugging Face dataset-card format (YAML
metadata, then Markdown), written beside the output by the merge (inside a directory output: ``hf``,
``openai_batch``) and pushed as the dataset's card with it.

It says what was run (the model and its revision, the prompt, the sampling, the steps), the
provenance's config fingerprint, the rows, errors and tokens, the GPU-hours and cost (the summary the
run printed), and the command that runs it again from the run's own resolved config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from shardgen.base.io import atomic_write_text
from shardgen.base.rundir import RunDir
from shardgen.config import digest
from shardgen.version import __version__

CARD_NAME = "README.md"
# The hub's size classes (huggingface_hub's dataset-card metadata), by the rows' count.
_SIZES = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
          (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B")]  # fmt: skip


def card_path(output: str | Path) -> Path:
    """Where an output's card goes: inside a directory output, beside a file."""
    output = Path(output)
    return output / CARD_NAME if output.is_dir() else output.with_name(CARD_NAME)


def card_text(config: Mapping[str, Any], stats: Mapping[str, Any], summary: str, output: str | Path) -> str:
    """The card of the output at ``output`` of the run of ``config`` (its resolved config), whose merge's
    stats are ``stats`` and printed ``summary``."""
    from huggingface_hub import DatasetCard, DatasetCardData  # (the merge's only; not a light command's)

    prov = stats.get("provenance") or {}
    rows = stats.get("output_rows", stats.get("rows", 0))
    model = _models(config, prov)
    data = DatasetCardData(
        pretty_name=f"{config.get('task', 'generate')} with {model}" if model else "shardgen output",
        tags=["shardgen", "synthetic"],
        size_categories=[next((name for limit, name in _SIZES if rows < limit), "n>1T")],
    )
    if not Path(output).is_dir():  # the file beside the card, for the hub's viewer and load_dataset
        data.configs = [{"config_name": "default", "data_files": Path(output).name}]
    out_dir = str(config["output"]["dir"])
    if Path(out_dir).is_absolute() and not config["output"].get("provenance_paths"):
        out_dir = "<output.dir>"  # no local path leaves the machine unless output.provenance_paths
    resolved = RunDir(out_dir).configs / f"{digest(dict(config))}.json"
    sections = [
        f"# {data.pretty_name}",
        f"Made with shardgen {__version__} on {prov.get('created') or 'an unknown date'}: {rows} rows.",
        "## What was run",
        *_what_was_run(config, prov),
        "## Results",
        f"```text\n{summary}\n```",
        "## Provenance",
        f"- config fingerprint: `{stats.get('config_fingerprint') or prov.get('config_fingerprint')}`\n"
        "- all of it: the output's metadata `shardgen.provenance` (Parquet), and the run's stats in `stats.json`",
        "## Reproduce",
        "From the shardgen checkout the run was made with, with its model and input where the config names them:",
        f"```bash\nsnakemake --profile profiles/slurm --configfile {resolved}\n```",
    ]
    return str(DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"))


def write_card(config: Mapping[str, Any], stats: Mapping[str, Any], summary: str, output: str | Path) -> Path:
    """Write the output's card (``card_text``) where ``card_path`` says; return its path."""
    path = card_path(output)
    atomic_write_text(path, card_text(config, stats, summary, output))
    return path


def _models(config: Mapping[str, Any], prov: Mapping[str, Any]) -> str:
    if config.get("steps"):
        return ", ".join(dict.fromkeys(str(s.get("model") or "") for s in prov.get("steps", []) if s.get("model")))
    return str(prov.get("model") or "")


def _what_was_run(config: Mapping[str, Any], prov: Mapping[str, Any]) -> list[str]:
    """The model, prompt and sampling of a run (of each step of a run of steps), as Markdown."""
    if not config.get("steps"):
        return [_one(config, prov)]
    out = []
    for step, step_prov in zip(config["steps"], prov.get("steps", [{}] * len(config["steps"])), strict=False):
        merged = {k: v for k, v in config.items() if k != "steps"} | dict(step)
        out.append(f"### Step {step['name']}\n\n{_one(merged, step_prov)}")
    if select := (prov.get("select") or None):
        out.append(f"Then the last step's `select`:\n\n```yaml\n{yaml.safe_dump(select, sort_keys=False)}```")
    return out


def _one(config: Mapping[str, Any], prov: Mapping[str, Any]) -> str:
    lines = [f"- task: `{config.get('task', 'generate')}`"]
    if "function" in config and config.get("task", "function") == "function":
        function = config["function"]
        code = json.dumps((prov.get("function") or {}).get("code"), sort_keys=True)
        lines.append(f"- Python function: `{function.get('module') or Path(function.get('path', '')).name}:"
                     f"{function['name']}` (its code: `{code}`)")  # fmt: skip
        return "\n".join(lines)
    lines += [
        f"- model: `{prov.get('model') or (config.get('model') or {}).get('model')}`, revision "
        f"`{prov.get('model_revision') or 'local'}`, weights digest `{prov.get('model_digest') or 'unknown'}`",
        f"- engine: {_engine(config, prov)}",
    ]
    prompt = {k: v for k, v in (config.get("prompt") or {}).items() if v not in (None, [], {}, "")}
    if prompt:
        lines.append(f"- prompt:\n\n```yaml\n{yaml.safe_dump(prompt, sort_keys=False, allow_unicode=True)}```")
    sampling = prov.get("sampling") if "sampling" in prov else config.get("sampling")
    if sampling:
        lines.append(f"- sampling: `{json.dumps(sampling, sort_keys=True)}`")
    return "\n".join(lines)


def _engine(config: Mapping[str, Any], prov: Mapping[str, Any]) -> str:
    engine = config.get("engine") or {}
    kind = engine.get("kind", "vllm")
    if kind == "vllm":
        return f"vLLM {prov.get('vllm_version') or 'unknown'}"
    server = engine.get("server") or {}
    return f"{kind} ({server['preset']})" if server.get("preset") else kind
