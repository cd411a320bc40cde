"""LoRA adapters: which one each row's request runs with (``lora.adapter`` for all, or
``lora.column`` per row), as ``Adapter``s the engine makes its requests of, and what preflight checks of them.

vLLM serves an adapter per request: ``LLMEngine.add_request(..., lora_request=)``
(vllm/v1/engine/llm_engine.py), with the engine started with
``enable_lora`` and a ``max_lora_rank`` at least the adapter's rank
(vllm/lora/worker_manager.py: ``WorkerLoRAManager._load_adapter`` refuses a
larger one at the first request, in the GPU job). Each adapter name gets one
fixed integer id, the same in every job (its place in the sorted names).

On vLLM 0.32's CPU build a base-model row batched with adapter rows gets an
adapter too: its LoRA ops pick each token's adapter weights with
``lora_b_weights[lora_indices_tensor]`` (vllm/lora/ops/torch_ops/lora_ops.py:
``bgmv_shrink``, ``bgmv_expand``), and a base row's index is -1, which
Python reads as the last adapter slot; the GPU kernels skip index -1
(vllm/lora/ops/triton_ops/lora_expand_op.py, ``lora_shrink_op.py``). Seen
here: the same prompt, alone, gives the base model's text; batched with its
adapter twin, the adapter's. So on the CPU build a row without an adapter is
a per-row error in a run with adapters, rather than a silently wrong row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardgen.errors import RowError

VLLM_DEFAULT_MAX_LORA_RANK = 16  # vllm/config/lora.py: LoRAConfig.max_lora_rank
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # ... and its allowed values (MaxLoRARanks)


@dataclass(frozen=True)
class Adapter:
    """One adapter a request runs with: its name, its number (unique in the run, from 1) and its local
    directory; the engine makes its own request of it (vLLM's ``LoRARequest``: ``engine.lora_request``)."""

    name: str
    id: int
    path: str


class Adapters:
    """The run's adapters (``Adapter``) by name.

    Args:
        lora: the config's ``lora`` section.
        records: where the fetch step found each adapter (the model record's ``adapters``).
        build: vLLM's (``cpu`` or ``cuda``); on the CPU build a row without an adapter is an error.
    """

    def __init__(self, lora: Any, records: Mapping[str, Mapping[str, Any]], build: str = "cuda") -> None:
        self.lora = lora
        self.build = build
        self.requests: dict[str, Adapter] = {}
        for i, name in enumerate(sorted(records or ()), start=1):
            self.requests[name] = Adapter(name, i, str(records[name]["path"]))

    def for_row(self, row: Mapping[str, Any]) -> Adapter | None:
        """The row's adapter, or None for the base model.

        Raises:
            RowError: the row names an adapter that is not declared.
        """
        name = adapter_name(self.lora, row, self.build)
        return self.requests[name] if name is not None else None


def adapter_name(lora: Any, row: Mapping[str, Any], build: str = "cuda") -> str | None:
    """The adapter a row runs with (``lora.adapter``, or the row's ``lora.column``), None for the base model.

    Raises:
        RowError: the row names an adapter that is not declared, or none on vLLM's CPU build
            (where it would get an adapter anyway: see the module's docstring).
    """
    if lora.column is None:
        return lora.adapter
    name = row.get(lora.column)
    if name is None or name == "":
        if build == "cpu" and lora.adapters:
            raise RowError(
                "base_row_with_lora_on_cpu",
                f"column '{lora.column}' names no adapter, and vLLM's CPU build would run this row with an adapter "
                "batched with it (vllm/lora/ops/torch_ops/lora_ops.py); run base-model rows without lora, or on a GPU",
            )
        return None
    if not isinstance(name, str) or name not in lora.adapters:
        raise RowError(
            "unknown_adapter",
            f"column '{lora.column}': {str(name)[:80]!r} is not one of lora.adapters {sorted(lora.adapters)}",
        )
    return name


def problems(model_cfg: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What would fail at a job's first request: an adapter that is not a PEFT LoRA adapter, or whose
    rank is above ``model.max_lora_rank``."""
    out = []
    limit = model_cfg.get("max_lora_rank") or VLLM_DEFAULT_MAX_LORA_RANK
    for name, record in sorted(records.items()):
        path = Path(record["path"]) / "adapter_config.json"
        try:
            adapter = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            out.append(f"lora.adapters.{name}: {path} cannot be read ({e}); is it a PEFT LoRA adapter directory?")
            continue
        rank = int(adapter.get("r") or 0)
        if rank > limit:
            fits = next((r for r in MAX_LORA_RANKS if r >= rank), None)
            out.append(
                f"lora.adapters.{name}: its rank is {rank}, above model.max_lora_rank ({limit}); "
                + (f"set model.max_lora_rank: {fits}" if fits else "vLLM serves ranks up to 512")
            )
    return out
