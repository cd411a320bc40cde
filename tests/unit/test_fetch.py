"""Fetching the model once: local directories and cached hub ids resolve with no network; downloads only when
not cached; the token never reaches the record."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

from shardgen.models.fetch import (
    FetchError,
    engine_model_args,
    main_fetch,
    model_path,
    resolve_model,
)
from tests.conftest import MODEL

REPO = "org/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
TOKEN = "hf_NotARealTokenButSecret0123456789"
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes], ref: str | None = "main") -> Path:
    """One snapshot in the Hugging Face cache layout: blobs by hash, snapshot files linking to them, refs/<ref>."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for rel, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        target = snapshot / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(Path("../" * (len(Path(rel).parts) + 1)) / "blobs" / blob.name)
    if ref:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def model_files(weights: bool = True) -> dict[str, bytes]:
    """The demo model's small files; the 500 MB weights replaced by a small stand-in."""
    files = {name: (MODEL / name).read_bytes() for name in SMALL_FILES if (MODEL / name).exists()}
    if weights:
        files["model.safetensors"] = b"stand-in for the weights"
    return files


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    """A cache with REPO at COMMIT (refs/main) and at OLD_COMMIT (no ref)."""
    if not (MODEL / "config.json").exists():
        pytest.fail(f"the demo model is missing at {MODEL}: run `make setup`")
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, COMMIT, model_files())
    add_snapshot(cache, REPO, OLD_COMMIT, model_files(), ref=None)
    return cache


@pytest.fixture
def network_attempts(monkeypatch) -> list[str]:
    """Every network call fails and is recorded; the library is not told to stay offline, so it would try."""
    attempts: list[str] = []

    def refuse(*args, **kwargs):
        attempts.append(repr(args[:2]))
        raise OSError("a network call was attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return attempts


def cfg(cache: Path, **model) -> dict:
    return {"model": REPO, "revision": None, "tokenizer": None, "download_dir": str(cache), **model}


def run_config(model: dict):
    """A run whose model section is ``model``."""
    from shardgen.config import RunConfig

    return RunConfig.from_dict({"input": {"parquet": ["x.parquet"]}, "prompt": {"template": "{{ t }}"}, "model": model})


# -- No network ------------------------------------------------------------------------------------


def test_a_local_directory_is_used_as_it_is_with_no_network_call(network_attempts):
    record = resolve_model({"model": str(MODEL)})
    assert record["source"] == "local"
    assert record["path"] == str(MODEL.absolute())
    assert record["tokenizer"] is None
    assert network_attempts == []


def test_a_cached_hub_id_resolves_to_its_snapshot_and_commit_with_no_network_call(hf_cache, network_attempts):
    record = resolve_model(cfg(hf_cache), allow_download=True)
    snapshot = hf_cache / "models--org--tiny-chat" / "snapshots" / COMMIT
    assert record["source"] == "cache"
    assert record["path"] == str(snapshot)
    assert record["repo_id"] == REPO and record["revision"] is None and record["commit"] == COMMIT
    assert (Path(record["path"]) / "config.json").read_bytes() == (MODEL / "config.json").read_bytes()
    assert network_attempts == []


def test_a_pinned_revision_resolves_to_that_commits_snapshot(hf_cache, network_attempts):
    record = resolve_model(cfg(hf_cache, revision=OLD_COMMIT), allow_download=False)
    assert record["commit"] == OLD_COMMIT and record["revision"] == OLD_COMMIT
    assert record["path"].endswith(f"snapshots/{OLD_COMMIT}")
    assert network_attempts == []


def test_the_network_guard_sees_the_attempt_when_the_library_does_go_online(tmp_path, network_attempts):
    # The proof that the tests above would have failed had the lookup gone online.
    with pytest.raises(FetchError, match="not in the Hugging Face cache and could not be downloaded"):
        resolve_model(cfg(tmp_path / "empty"), allow_download=True)
    assert network_attempts


# -- Not cached ------------------------------------------------------------------------------------


def test_a_pinned_revision_that_is_not_cached_is_a_clear_error_when_downloads_are_off(hf_cache, network_attempts):
    missing = "a" * 40
    with pytest.raises(FetchError) as e:
        resolve_model(cfg(hf_cache, revision=missing), allow_download=False)
    message = str(e.value)
    assert message.startswith(f"model.model: '{REPO}' at model.revision '{missing}' is not (completely) in")
    assert f"hf download {REPO} --revision {missing} --cache-dir {hf_cache}" in message
    assert "HF_TOKEN" in message
    assert network_attempts == []


def test_a_snapshot_with_only_configs_is_not_taken_for_the_model(tmp_path, network_attempts):
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, COMMIT, model_files(weights=False))  # e.g. only AutoConfig was loaded once
    with pytest.raises(FetchError, match="is not \\(completely\\) in the Hugging Face cache"):
        resolve_model(cfg(cache), allow_download=False)


def test_a_snapshot_missing_a_shard_its_index_names_is_not_taken_for_the_model(tmp_path, network_attempts):
    cache = tmp_path / "hub"
    files = model_files(weights=False)
    files["model-00001-of-00002.safetensors"] = b"part one"
    files["model.safetensors.index.json"] = json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    ).encode()
    add_snapshot(cache, REPO, COMMIT, files)  # an interrupted download
    with pytest.raises(FetchError, match="not \\(completely\\)"):
        resolve_model(cfg(cache), allow_download=False)


def test_a_path_that_does_not_exist_names_model_model(tmp_path, network_attempts):
    with pytest.raises(FetchError, match="^model.model: no such directory: "):
        resolve_model({"model": str(tmp_path / "nowhere")})


class FakeHub:
    """``snapshot_download`` with an empty cache: offline lookups miss, downloads write a snapshot."""

    def __init__(self, cache: Path, weights: bool = True) -> None:
        self.cache, self.weights, self.calls = cache, weights, []

    def __call__(self, repo_id, *, revision=None, cache_dir=None, local_files_only=False, **kwargs):
        call = {"repo_id": repo_id, "revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
        self.calls.append({**call, **kwargs})
        if local_files_only:
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
        snapshot = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / (revision or COMMIT)
        if not snapshot.exists():
            add_snapshot(self.cache, repo_id, revision or COMMIT, model_files(self.weights))
        return str(snapshot)


def test_a_model_not_cached_is_downloaded_online_with_its_revision_cache_dir_and_patterns(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    record = resolve_model(cfg(tmp_path / "hub", revision=OLD_COMMIT))
    assert [c["local_files_only"] for c in hub.calls] == [True, False]
    online = hub.calls[1]
    assert online["repo_id"] == REPO and online["revision"] == OLD_COMMIT
    assert online["cache_dir"] == str(tmp_path / "hub")
    assert {"*.safetensors", "*.json", "*.model", "*.tiktoken", "*.jinja"} <= set(online["allow_patterns"])
    assert "*.py" not in online["allow_patterns"] and "*.bin" not in online["allow_patterns"]
    assert "token" not in online  # huggingface_hub reads HF_TOKEN itself
    assert record["source"] == "downloaded" and record["commit"] == OLD_COMMIT


def test_trust_remote_code_adds_the_models_python_files_to_the_download(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    resolve_model(cfg(tmp_path / "hub", trust_remote_code=True))
    assert "*.py" in hub.calls[-1]["allow_patterns"]


def test_a_repo_without_safetensors_is_fetched_again_for_bin_weights_and_refused_if_it_has_none(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub", weights=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    with pytest.raises(FetchError, match="has no weight files vLLM can load"):
        resolve_model(cfg(tmp_path / "hub"))
    assert "*.bin" in hub.calls[-1]["allow_patterns"]


def test_a_separate_tokenizer_is_resolved_too_and_one_equal_to_the_model_is_not(hf_cache, network_attempts):
    add_snapshot(hf_cache, "org/tokenizer", COMMIT, {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"})
    record = resolve_model(cfg(hf_cache, tokenizer="org/tokenizer"), allow_download=False)
    assert record["tokenizer"]["source"] == "cache"
    assert record["tokenizer"]["path"].endswith(f"models--org--tokenizer/snapshots/{COMMIT}")
    assert resolve_model(cfg(hf_cache, tokenizer=REPO), allow_download=False)["tokenizer"] is None
    assert network_attempts == []


# -- What jobs get ---------------------------------------------------------------------------------


def test_jobs_get_the_local_snapshot_and_an_offline_environment_without_usage_reports(hf_cache, network_attempts):
    record = resolve_model(cfg(hf_cache, revision="main", tokenizer=None), allow_download=False)
    args = engine_model_args(record)
    assert args["model"] == model_path(record) == record["path"]
    assert args["revision"] is None  # the snapshot is one commit; nothing to resolve on the hub
    assert "tokenizer" not in args
    from shardgen.base.jobenv import OFFLINE_ENV

    assert OFFLINE_ENV == {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",  # vLLM's rank-0 worker would post usage data to stats.vllm.ai
        "DO_NOT_TRACK": "1",
    }


# -- The token -------------------------------------------------------------------------------------


def test_the_token_never_appears_in_the_record_the_written_json_or_the_printed_line(
    hf_cache, tmp_path, monkeypatch, capsys, network_attempts
):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out = tmp_path / "results" / "plan" / "model.json"
    assert main_fetch(run_config(cfg(hf_cache)), out) == 0
    text = out.read_text()
    assert TOKEN not in text and TOKEN not in json.dumps(resolve_model(cfg(hf_cache)))
    assert json.loads(text)["commit"] == COMMIT
    printed = capsys.readouterr().out
    assert TOKEN not in printed and printed.count("\n") == 1 and REPO in printed
    assert network_attempts == []


def test_the_token_is_scrubbed_from_a_download_error_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def leaky(repo_id, **kwargs):
        raise LocalEntryNotFoundError(f"request with Authorization: Bearer {TOKEN} failed")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", leaky)
    with pytest.raises(FetchError) as e:
        resolve_model(cfg(tmp_path / "hub"))
    assert TOKEN not in str(e.value) and "***" in str(e.value)


def test_main_fetch_replaces_the_record_atomically(hf_cache, tmp_path, network_attempts):
    out = tmp_path / "model.json"
    out.write_text("stale")
    main_fetch(run_config(cfg(hf_cache)), out)
    assert json.loads(out.read_text())["source"] == "cache"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.json")] == []


def test_a_models_digest_follows_its_content_without_reading_its_weights_whole(tmp_path):
    """The provenance names a model by its id, revision and this digest: a changed config or changed
    weights change it, a copy of the directory elsewhere does not."""
    import shutil

    from shardgen.models.fetch import DIGEST_WHOLE_BYTES, content_digest

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = bytearray(3 * DIGEST_WHOLE_BYTES)
    (model / "model.safetensors").write_bytes(weights)
    digest = content_digest(model)
    shutil.copytree(model, tmp_path / "copy")
    assert content_digest(tmp_path / "copy") == digest and digest.startswith("sha256:")
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert content_digest(model) != digest
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights[-1] = 1  # the end of the last tensor
    (model / "model.safetensors").write_bytes(weights)
    assert content_digest(model) != digest
