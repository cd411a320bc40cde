"""The model, fetched once on the login node; jobs read it from disk and never contact the hub.

Compute nodes are often offline, and hundreds of jobs asking the hub for the
same model at once would be slow or rate-limited. A local rule runs
``shardgen fetch-model`` before the preflight and every generate job:

- ``model.model`` that is a local directory is used as it is, with no network call;
- a hub id already in the Hugging Face cache resolves to its snapshot
  directory, with no network call;
- only a hub id that is not cached is downloaded (weights, config and
  tokenizer files only), with the token huggingface_hub reads from
  ``HF_TOKEN`` itself; the token never reaches the config, the record or a
  message.

The record (``results/plan/model.json``) names the directory each job gives
the engine (``engine_model_args``); the jobs run offline (``jobenv``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.errors import ShardgenError
from shardgen.base.installed import vllm_build
from shardgen.base.io import atomic_write_text
from shardgen.base.kernels import ensure_kernels

if TYPE_CHECKING:
    from shardgen.config import RunConfig

# What a job needs from a hub repository: weights (safetensors), configs and
# tokenizer files (JSON, SentencePiece, tiktoken, BPE vocabularies, the chat
# template). Code (*.py) only with model.trust_remote_code.
MODEL_PATTERNS = ("*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
# Checkpoints without safetensors: the formats vLLM falls back to.
FALLBACK_WEIGHT_PATTERNS = ("*.bin", "*.pt")
# Meta's original-format copies (as vLLM's own default ignore list).
IGNORE_PATTERNS = ("original/*",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class FetchError(ShardgenError):
    """The model cannot be found or fetched. The message names the config key and what to do."""


def _looks_like_path(name: str) -> bool:
    p = Path(name).expanduser()
    return p.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1 or p.exists()


def _scrub(text: str) -> str:
    """The text without the token's value, should a library ever put it in a message."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return text.replace(token, "***") if token and len(token) >= 4 else text


def _first_line(e: BaseException) -> str:
    lines = _scrub(str(e)).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _download_hint(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    cmd = f"hf download {repo_id}"
    if revision:
        cmd += f" --revision {revision}"
    if cache_dir:
        cmd += f" --cache-dir {cache_dir}"
    return cmd


def _has_weights(path: Path) -> bool:
    """The directory holds weights, and every shard its safetensors index names (an interrupted download lacks some)."""
    for index in path.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            return False
        if not all((path / shard).is_file() for shard in shards):
            return False
    return any(
        f.name.endswith(WEIGHT_SUFFIXES) and f.relative_to(path).parts[0] != "original"
        for f in path.rglob("*")
        if f.is_file()
    )


def _snapshot(repo_id: str, key: str, revision: str | None, cache_dir: str | None, **kwargs: Any) -> str:
    """``snapshot_download`` with its errors turned into ``FetchError`` messages for the user."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hint = _download_hint(repo_id, revision, cache_dir)
    rev = f" at model.revision '{revision}'" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, **kwargs)
    except HFValidationError as e:
        raise FetchError(
            f"{key}: '{repo_id}' is neither a local directory nor a valid Hugging Face repo id: {_scrub(str(e))}"
        ) from None
    except GatedRepoError:
        raise FetchError(
            f"{key}: '{repo_id}' is a gated model: accept its terms on its hub page, then set HF_TOKEN in "
            f"the environment to a token of that account (never in the config) and run again, or: {hint}"
        ) from None
    except RevisionNotFoundError:
        raise FetchError(
            f"model.revision: '{revision}' is not a branch, tag or commit of '{repo_id}' on the hub"
        ) from None
    except RepositoryNotFoundError:
        raise FetchError(
            f"{key}: '{repo_id}' is not on the hub, or it is private: check the name, or set HF_TOKEN in the "
            "environment to a token that can read it"
        ) from None
    except LocalEntryNotFoundError as e:
        if kwargs.get("local_files_only"):
            raise
        offline = "HF_HUB_OFFLINE is set, so nothing is downloaded; " if _hub_offline() else ""
        raise FetchError(
            f"{key}: '{repo_id}'{rev} is not in the Hugging Face cache and could not be downloaded "
            f"({offline}{_first_line(e)}). On a machine with network access, "
            f"run: {hint}"
        ) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise FetchError(
            f"{key}: the hub refused '{repo_id}'{rev} (HTTP {status}, {_first_line(e)}); "
            "for a private or gated model set HF_TOKEN in the environment (never in the config)"
        ) from None
    except Exception as e:  # noqa: BLE001 - a full disk, a proxy refusing...: the library raises many kinds
        raise FetchError(f"{key}: fetching '{repo_id}'{rev} failed: {_first_line(e)}") from None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _resolve_one(
    name: str,
    key: str,
    revision: str | None,
    cache_dir: str | None,
    patterns: tuple[str, ...],
    allow_download: bool,
    need_weights: bool,
) -> dict[str, Any]:
    """The record for one of ``model.model`` / ``model.tokenizer``."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    path = Path(name).expanduser()
    if path.is_dir():
        return {"source": "local", "path": str(path.absolute()), "digest": content_digest(path)}
    if _looks_like_path(name):
        raise FetchError(f"{key}: no such directory: '{name}'")

    common = {
        "allow_patterns": list(patterns),
        "ignore_patterns": list(IGNORE_PATTERNS),
    }
    record = {"source": "cache", "repo_id": name, "revision": revision, "cache_dir": cache_dir}
    try:
        snapshot: str | None = _snapshot(name, key, revision, cache_dir, local_files_only=True, **common)
    except LocalEntryNotFoundError:  # includes a snapshot the cache knows is incomplete
        snapshot = None
    if snapshot is not None and need_weights and not _has_weights(Path(snapshot)):
        snapshot = None  # only configs are cached (a tokenizer or config was loaded by itself)
    if snapshot is None:
        where = cache_dir or _default_cache()
        rev = f" at model.revision '{revision}'" if revision else ""
        if not allow_download:
            raise FetchError(
                f"{key}: '{name}'{rev} is not (completely) in the Hugging Face cache ({where}), and "
                f"downloading is off here. Download it on the login node: {_download_hint(name, revision, cache_dir)}"
                f" (HF_TOKEN set for gated models), or point {key} at a directory"
            )
        snapshot = _snapshot(name, key, revision, cache_dir, local_files_only=False, **common)
        if need_weights and not _has_weights(Path(snapshot)):
            common["allow_patterns"] = [*FALLBACK_WEIGHT_PATTERNS, *patterns]
            snapshot = _snapshot(name, key, revision, cache_dir, local_files_only=False, **common)
        if need_weights and not _has_weights(Path(snapshot)):
            raise FetchError(f"{key}: '{name}'{rev} has no weight files vLLM can load (*.safetensors, *.bin, *.pt)")
        record["source"] = "downloaded"
    snap = Path(snapshot)
    return {**record, "path": str(snap.absolute()), "commit": snap.name, "digest": content_digest(snap)}


# Files up to this size go into a model's digest whole; of larger ones, the first and last this many bytes.
DIGEST_WHOLE_BYTES = 1 << 20


def content_digest(directory: Path) -> str:
    """A digest of a model directory's content, for the provenance, without reading its weights:
    each file's name and size, small files (configs, tokenizer) whole, and of each large one the
    blob it links to in a Hugging Face cache (named by the hash of its content) or else its first
    and last MiB (a safetensors file begins with the names, types and shapes of its tensors)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(directory)}\0{size}\0".encode())
        if file.is_symlink() and size > DIGEST_WHOLE_BYTES:
            digest.update(Path(os.readlink(file)).name.encode())  # blobs/<sha256 of the content>
            continue
        with open(file, "rb") as f:
            digest.update(f.read(DIGEST_WHOLE_BYTES))
            if size > DIGEST_WHOLE_BYTES:
                f.seek(max(size - DIGEST_WHOLE_BYTES, DIGEST_WHOLE_BYTES))
                digest.update(f.read())
    return "sha256:" + digest.hexdigest()[:32]


def _default_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(
    model_cfg: Mapping[str, Any], allow_download: bool = True, adapters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Where the model (and a separate tokenizer, and LoRA adapters) is on disk, fetching it only when
    it is not there yet.

    Args:
        model_cfg: the config's ``model`` section: ``model``, ``revision``,
            ``tokenizer``, ``download_dir`` (the cache directory, as vLLM
            names it; default: huggingface_hub's, ``HF_HUB_CACHE``),
            ``trust_remote_code``.
        allow_download: fetch from the hub what is not cached; off, nothing
            but the local disk is read.
        adapters: ``lora.adapters``: LoRA adapters by name, each a directory or hub id.

    Returns:
        ``{"source": "local"|"cache"|"downloaded", "path": ..., and for hub
        models "repo_id", "revision" (as requested), "commit" (the
        snapshot's), "cache_dir"; "tokenizer": the same for
        ``model.tokenizer`` or None; "download_dir"; "adapters": the same for
        each LoRA adapter, by name}``.

    Raises:
        FetchError: naming ``model.model`` / ``model.revision`` / ``model.tokenizer`` /
            ``lora.adapters.<name>`` and what to do.
    """
    cache_dir = model_cfg.get("download_dir")
    cache_dir = str(Path(cache_dir).expanduser().absolute()) if cache_dir else None
    revision = model_cfg.get("revision")
    code = ("*.py",) if model_cfg.get("trust_remote_code") else ()
    record = _resolve_one(
        model_cfg["model"], "model.model", revision, cache_dir, MODEL_PATTERNS + code, allow_download, need_weights=True
    )
    tokenizer = model_cfg.get("tokenizer")
    tok_record = None
    if tokenizer and tokenizer != model_cfg["model"]:
        # vLLM uses model.revision for the tokenizer too (its tokenizer_revision defaults to it).
        tok_record = _resolve_one(
            tokenizer,
            "model.tokenizer",
            revision,
            cache_dir,
            TOKENIZER_PATTERNS + code,
            allow_download,
            need_weights=False,
        )
    # LoRA adapters: fetched like the model (no revision of their own), each by its name in lora.adapters
    loras = {
        name: _resolve_one(where, f"lora.adapters.{name}", None, cache_dir, MODEL_PATTERNS, allow_download, True)
        for name, where in sorted((adapters or {}).items())
    }
    return {**record, "tokenizer": tok_record, "download_dir": cache_dir, "adapters": loras}


def engine_model_args(resolved: dict[str, Any]) -> dict[str, Any]:
    """What replaces ``model`` / ``tokenizer`` / ``revision`` in the engine's arguments: the local directories.

    The snapshot directory is one fixed commit, so no revision is passed
    (None: left out by ``engine_kwargs``), and the engine has nothing to look
    up on the hub.
    """
    args: dict[str, Any] = {"model": resolved["path"], "revision": None}
    if resolved.get("tokenizer"):
        args["tokenizer"] = resolved["tokenizer"]["path"]
    return args


def model_path(resolved: dict[str, Any]) -> str:
    """The local directory the engine is given as its model."""
    return resolved["path"]


def load_record(path: str | Path) -> dict[str, Any]:
    """Read the record ``main_fetch`` wrote."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise FetchError(f"cannot read the model record '{path}': {e}; run shardgen fetch-model again") from e


def describe(resolved: dict[str, Any]) -> str:
    """One line: what was resolved, from where."""
    if resolved["source"] == "local":
        line = f"model: {resolved['path']} (local directory)"
    else:
        line = (
            f"model: {resolved['repo_id']} commit {resolved['commit'][:12]} ({resolved['source']}) "
            f"at {resolved['path']}"
        )
    tok = resolved.get("tokenizer")
    if tok:
        line += f"; tokenizer: {tok.get('repo_id') or tok['path']} ({tok['source']})"
    return line


def write_record(config: RunConfig, output_path: str | Path) -> dict[str, Any] | None:
    """Resolve (and if need be download) the model and write its record as JSON; return it. A task without
    a model (a Python function) has nothing to fetch: its record says so, and None is returned."""
    if not config.kind.uses_engine:
        atomic_write_text(output_path, json.dumps({"source": None, "path": None, "task": config.task}) + "\n")
        return None
    resolved = resolve_model(config.model, allow_download=True, adapters=config.lora.adapters)
    atomic_write_text(output_path, json.dumps(resolved, indent=1, sort_keys=True) + "\n")
    return resolved


def main_fetch(config: RunConfig, output_path: str | Path) -> int:
    """The record (``write_record``); print one line. On the CUDA build, also install FlashInfer's
    precompiled kernels if they are missing (``kernels.py``)."""
    resolved = write_record(config, output_path)
    if resolved is None:
        print(f"task {config.task}: no model to fetch")
        return 0
    print(describe(resolved))
    # here, with internet access, rather than in every offline job (kernels.py)
    if vllm_build() == "cuda" and (done := ensure_kernels()):
        print(done)
    return 0


def load_tokenizer(model_cfg: Mapping[str, Any], record: dict[str, Any]) -> Any:
    """The model's tokenizer (transformers'), from where the fetch step found it (``record``), without an
    engine: the preflight's, and a job's that looks its requests up in the request store first.

    Raises:
        ShardgenError: it does not load, naming the key and the directory.
    """
    from transformers import AutoTokenizer  # a second of import, for the commands that tokenize

    key = "tokenizer" if record.get("tokenizer") else "model"
    where = record["tokenizer"]["path"] if record.get("tokenizer") else record["path"]
    try:
        return AutoTokenizer.from_pretrained(
            str(where), trust_remote_code=model_cfg.get("trust_remote_code", False), local_files_only=True
        )
    except Exception as e:  # transformers raises many kinds
        raise ShardgenError(f"model.{key}: cannot load the tokenizer from '{where}': {type(e).__name__}: {e}") from e
