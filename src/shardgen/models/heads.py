"""What a model's checkpoint gives a pooling task (classify, reward, embed, score), read from its
files without torch or vLLM: its class labels, whether it really has a classification head, the
size of its embeddings.

vLLM does not check the head itself: ``convert="classify"`` on a checkpoint
without one loads an *uninitialised* ``score`` layer (``torch.empty``)
without an error (vllm/model_executor/models/adapters.py: ``as_seq_cls_model``;
the weight is missing from what ``load_weights`` returns, and
``DefaultModelLoader.track_weights_loading`` counts it as loaded), and every
row gets a confident, meaningless label. So preflight refuses a
classification task on a model whose weights hold no head
(``tasks.PoolingTask.problems``), before any job.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardgen.models.fetch import model_path

# Architectures whose reward is one value per token (vllm/model_executor/models/qwen2_rm.py,
# internlm2.py: token_classify poolers).
TOKEN_REWARD_SUFFIXES = ("ForProcessRewardModel", "ForRewardModel", "RewardModel")
CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ClassificationModel")
# Weight names of a classification head in Hugging Face checkpoints.
HEAD_WEIGHTS = ("score.weight", "classifier.weight", "classifier.out_proj.weight", "v_head.weight")
HEAD_PREFIXES = ("score.", "classifier.", "v_head.")
ST_DENSE = "sentence_transformers.models.Dense"


@dataclass(frozen=True)
class Head:
    """What a checkpoint says about its output head.

    Attributes:
        architectures: ``config.json``'s.
        labels: the class names, by class id (``id2label``; ``LABEL_0``, ... when absent).
        has_head: whether the weights hold a classification head.
        embedding_size: the size of its embeddings, as vLLM derives it
            (vllm/config/model.py: ``ModelConfig.embedding_size``: the config's
            ``embedding_size``, else the last Sentence-Transformers Dense layer's
            ``out_features``, else ``hidden_size``).
    """

    architectures: tuple[str, ...]
    labels: tuple[str, ...]
    has_head: bool
    embedding_size: int | None

    @classmethod
    def read(cls, model_dir: str | Path) -> Head:
        """Read the head of the model in ``model_dir`` (config.json, the safetensors headers).

        Raises:
            OSError, ValueError: config.json cannot be read.
        """
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        text = cfg.get("text_config") or {}
        id2label = cfg.get("id2label") or {}
        n = len(id2label) or int(cfg.get("num_labels") or 2)  # Hugging Face's default is two labels
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
        size = cfg.get("embedding_size") or _dense_out_features(d) or cfg.get("hidden_size") or text.get("hidden_size")
        return cls(tuple(cfg.get("architectures") or ()), labels, _has_head_weights(d), size)

    @property
    def per_token_reward(self) -> bool:
        return any(a.endswith(TOKEN_REWARD_SUFFIXES) for a in self.architectures)


def _weight_names(model_dir: Path) -> set[str]:
    """The tensor names of the checkpoint: the safetensors index, else each file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names


def _has_head_weights(model_dir: Path) -> bool:
    names = _weight_names(model_dir)
    return any(n in HEAD_WEIGHTS or n.startswith(HEAD_PREFIXES) for n in names)


def _dense_out_features(model_dir: Path) -> int | None:
    """The last Sentence-Transformers Dense layer's output size (vLLM appends these layers)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    out = None
    for m in modules:
        if m.get("type") == ST_DENSE:
            try:
                out = json.loads((model_dir / m.get("path", "") / "config.json").read_text())["out_features"]
            except (OSError, ValueError, KeyError):
                continue
    return out


def is_classifier(head: Head) -> bool:
    return any(a.endswith(CLASSIFIER_SUFFIXES) for a in head.architectures)


def embedding_dim(head: Head | None, pooling: Mapping[str, Any]) -> int | None:
    """The length of the ``embedding`` column: ``pooling.dimensions`` (Matryoshka truncation) or the model's."""
    if pooling.get("dimensions") is not None:
        return int(pooling["dimensions"])
    return head.embedding_size if head is not None else None


def read_for(model_record: Mapping[str, Any] | None) -> Head | None:
    """The head of the run's model (``fetch.resolve_model``'s record), or None without one."""
    if not model_record:
        return None

    return Head.read(model_path(dict(model_record)))
