"""The request store: a layer in front of any engine that answers a request seen before from its stored
answer, sends a request already in flight in the job once, and keeps what the engine answers.

A request's key (``request_key``) is a digest of what decides its answer: the job's part
(``job_context``: the model's identity and content digest, the engine and its settings that change
outputs, the vLLM version, the task) and the request's own (the prompt's token ids, its images by
content, the LoRA adapter, every sampling or pooling parameter, the row's seed among them). A request
whose answer that does not decide, sampling with ``temperature > 0`` and no seed, has no key: it is
never reused, within a run or across runs.

Entries are Parquet files, readable with pyarrow (docs/request-store.md): ``<cache.dir>/entries/
<name>.parquet`` with the columns ``key`` (16 bytes), ``answer`` (the engine's answer in a neutral
JSON form: ``answer``), ``check`` (8 bytes of a digest of key and answer) and ``created``. A file is
written whole under a temporary name and renamed (one PUT on object storage), so no reader sees half
of one; files are only added, so jobs and runs that share a directory need no lock. A file that does
not read, or an entry whose check fails, is ignored: its request goes to the engine again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shardgen.base import storage
from shardgen.config import content_config
from shardgen.engines import kinds
from shardgen.engines.server import ServerOutput, ServerSample
from shardgen.errors import ShardgenError
from shardgen.requests.results import DUPLICATE, ENGINE, STORE, EngineRequest, Pooled

if TYPE_CHECKING:
    from shardgen.config import RunConfig

log = logging.getLogger(__name__)

# shardgen's version of how an answer is stored and read back: a change that alters what a stored
# answer means bumps it, and every entry of the old one is no longer found.
STORE_VERSION = 1
ENTRIES = "entries"
SCHEMA = pa.schema([("key", pa.binary(16)), ("answer", pa.string()), ("check", pa.binary(8)),
                    ("created", pa.timestamp("ms", tz="UTC"))])  # fmt: skip
# An entry file's metadata key: what wrote it (``StoreEngine.save``: the model, the task, and the requests the
# job answered since its save before, by where they came from), which ``shardgen cache`` reads.
ABOUT = b"shardgen.about"
# Entry files whose answers a job holds in memory at once (read whole when one of their keys is found).
OPEN_FILES = 4


# -- Keys ---------------------------------------------------------------------------------------------


def job_context(config: RunConfig, model_record: dict[str, Any]) -> bytes:
    """What decides every answer of a job's requests beside the request itself: the config's model,
    engine and adapters as the content fingerprint has them (``config.content_config``), the model's
    identity where the fetch step found it (its commit and the digest of its files, not its path), the
    task and ``STORE_VERSION``."""
    content = content_config(dict(config.raw))
    identity = {k: model_record.get(k) for k in ("repo_id", "revision", "commit", "digest")}
    parts = {k: content.get(k) for k in ("model", "engine_version", "engine", "lora")}
    return _digest([STORE_VERSION, config.task, parts, identity])


def determined(params: Any) -> bool:
    """Whether a request's answer is determined by the request: not when it samples at a temperature
    above 0 without a seed (a pooling request always is)."""
    temperature = getattr(params, "temperature", None)
    return temperature is None or temperature == 0 or getattr(params, "seed", None) is not None


def request_key(context: bytes, request: EngineRequest) -> bytes | None:
    """The request's key in the store, or None when its answer is not determined by it (``determined``)."""
    params = request.params
    if not determined(params):
        return None
    prompt = request.prompt
    images = [_image_digest(i) for i in (prompt.get("multi_modal_data") or {}).get("image") or ()]
    lora = request.lora
    adapter = None if lora is None else [lora.name, getattr(lora, "digest", None) or str(lora.path)]
    rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
    return _digest([context.hex(), rest, images, adapter, _plain(params)])


def _digest(obj: Any) -> bytes:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=_plain).encode(), digest_size=16).digest()


def _plain(value: Any) -> Any:
    """A parameter object as JSON values: its public fields (vLLM's ``SamplingParams`` and
    ``PoolingParams``, their nested dataclasses, or the namespaces the other engines get), without the
    fields an engine derives or sets itself (``_``-prefixed) and shardgen's own ``skip_clone``."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, SimpleNamespace):
        items = vars(value).items()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif hasattr(value, "__struct_fields__"):  # msgspec.Struct (vLLM's params)
        items = ((name, getattr(value, name)) for name in value.__struct_fields__)
    else:
        return repr(value)
    return {k: v for k, v in items if not k.startswith("_") and k != "skip_clone"}


def _image_digest(image: Any) -> str:
    """A decoded image (PIL) by its size, mode and pixels."""
    h = hashlib.blake2b(f"{image.mode}:{image.size}".encode(), digest_size=16)
    h.update(image.tobytes())
    return h.hexdigest()


def _halves(keys: pa.ChunkedArray) -> np.ndarray:
    """16-byte keys as rows of two big-endian 64-bit halves (from the Arrow buffers, without a copy per key)."""
    parts = []
    for chunk in keys.chunks:
        data = np.frombuffer(chunk.buffers()[1], dtype=">u8")
        parts.append(data[2 * chunk.offset : 2 * (chunk.offset + len(chunk))])
    flat = np.concatenate(parts) if parts else np.empty(0, ">u8")
    return flat.astype(np.uint64).reshape(-1, 2)


def _check(key: bytes, answer: str) -> bytes:
    return hashlib.blake2b(key + answer.encode(), digest_size=8).digest()


# -- Answers: the engine's outputs in a neutral form, and back ------------------------------------------


def answer(out: Any) -> str:
    """A finished output of any engine (vLLM's ``RequestOutput`` or ``PoolingRequestOutput``, the
    fake's, a server's) as the JSON the store keeps: per sample its index, text, token ids, finish and
    stop reason and log-probabilities; a pooling output's values."""
    outputs = out.outputs
    if hasattr(outputs, "data"):  # pooled
        return json.dumps({"pooled": outputs.data.tolist()})
    samples = []
    for s in outputs:
        logprobs = None
        if s.logprobs:
            logprobs = [[[int(t), float(v.logprob), v.rank, v.decoded_token] for t, v in position.items()]
                        for position in s.logprobs]  # fmt: skip
        stop = s.stop_reason if isinstance(s.stop_reason, int | str) or s.stop_reason is None else str(s.stop_reason)
        samples.append({"index": s.index, "text": s.text, "token_ids": list(s.token_ids),
                        "finish_reason": s.finish_reason, "stop_reason": stop,
                        "cumulative_logprob": s.cumulative_logprob, "logprobs": logprobs})  # fmt: skip
    return json.dumps({"samples": samples})


def rebuilt(request: EngineRequest, text: str, source: str) -> ServerOutput:
    """The output of ``request`` from a stored answer, in the neutral form a server's answers are read into
    (no metrics: no latency or time to first token is counted for it)."""
    data = json.loads(text)
    ids = list(request.prompt.get("prompt_token_ids") or ())
    if "pooled" in data:
        return ServerOutput(request.request_id, ids, Pooled(data["pooled"]), source=source)
    samples = []
    for s in data["samples"]:
        logprobs = None
        if s["logprobs"] is not None:
            logprobs = [{t: SimpleNamespace(logprob=lp, rank=rank, decoded_token=tok) for t, lp, rank, tok in position}
                        for position in s["logprobs"]]  # fmt: skip
        samples.append(ServerSample(s["index"], s["text"], s["token_ids"], s["finish_reason"], s["stop_reason"],
                                    logprobs, s["cumulative_logprob"]))  # fmt: skip
    return ServerOutput(request.request_id, ids, samples, source=source)


# -- The store ----------------------------------------------------------------------------------------


class RequestStore:
    """The entry files of one directory (a local path or an ``s3://`` prefix), and an index of their
    keys: every key to its file and row, read once per file (``refresh`` reads the files added since).

    Args:
        root: ``cache.dir``.
        options: ``input.storage_options`` (object storage only).
    """

    def __init__(self, root: str, options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        if storage.is_url(root):
            self.fs: pafs.FileSystem = storage.filesystem(options)
            self.base = storage.path_of(self.root)
        else:
            self.fs, self.base = pafs.LocalFileSystem(), os.path.abspath(root)
        self.entries = f"{self.base}/{ENTRIES}"
        self.files: list[str] = []
        # the index: every key as two 64-bit halves, sorted by the first, and where it is (file << 32 | row;
        # -1: an entry that did not verify): 24 bytes an entry
        self._hi = np.empty(0, np.uint64)
        self._lo = np.empty(0, np.uint64)
        self._at = np.empty(0, np.int64)
        self._seen: set[str] = set()
        self._open: OrderedDict[int, tuple[list[str], list[bytes]]] = OrderedDict()

    @classmethod
    def for_config(cls, config: RunConfig) -> RequestStore:
        """The run's store (``cache.dir``, by default ``<output.dir>/cache``), one per process and directory."""
        return _store(store_root(config), json.dumps(dict(config.input.storage_options), sort_keys=True))

    def listed(self) -> list[pafs.FileInfo]:
        """The entry files there now, by path (not a hidden one a writer has not renamed yet).

        Raises:
            OSError: the directory (or prefix) cannot be listed.
        """
        infos = self.fs.get_file_info(pafs.FileSelector(self.entries, allow_not_found=True))
        names = ((i, i.path.rsplit("/", 1)[-1]) for i in infos)
        files = [i for i, name in names if i.type == pafs.FileType.File and name.endswith(".parquet")
                 and not name.startswith(".")]  # fmt: skip
        return sorted(files, key=lambda i: i.path)

    def refresh(self) -> None:
        """Index the entry files added since the last look, and forget those removed since (pruned:
        ``shardgen cache``)."""
        try:
            infos = self.listed()
        except OSError as e:
            log.warning("request store %s: not listed (%s); every request goes to the engine", self.root, e)
            return
        if gone := self._seen - {i.path for i in infos}:
            numbers = [n for n, path in enumerate(self.files) if path in gone]
            self._at[np.isin(self._at >> 32, numbers) & (self._at >= 0)] = -1
            for n in numbers:
                self._open.pop(n, None)
            self._seen -= gone
        added = []
        for info in infos:
            if info.path in self._seen:
                continue
            self._seen.add(info.path)
            try:
                keys = pq.read_table(info.path, columns=["key"], filesystem=self.fs).column("key")
                if keys.type != SCHEMA.field("key").type or keys.null_count:
                    raise pa.ArrowInvalid(f"its key column is {keys.type}, with {keys.null_count} nulls")
            except (OSError, pa.ArrowException) as e:
                log.warning("request store: %s does not read (%s); its entries are ignored", info.path, e)
                continue
            added.append((info.path, keys))
        self._add(added)

    def _add(self, files: list[tuple[str, pa.ChunkedArray]]) -> None:
        """Index the keys of new files (a later file's key does not replace an earlier one's)."""
        his, los, ats = [self._hi], [self._lo], [self._at]
        for path, keys in files:
            number = len(self.files)
            self.files.append(path)
            halves = _halves(keys)
            his.append(halves[:, 0])
            los.append(halves[:, 1])
            ats.append((number << 32) | np.arange(len(halves), dtype=np.int64))
        if len(his) > 1:
            hi = np.concatenate(his)
            order = np.argsort(hi, kind="stable")
            self._hi, self._lo, self._at = hi[order], np.concatenate(los)[order], np.concatenate(ats)[order]

    def holds_any(self) -> bool:
        """Whether any entry is indexed."""
        return bool(len(self._hi))

    def _find(self, keys: list[bytes]) -> list[int | None]:
        """Where each key is (its position in the index), or None: one search for them all."""
        if not keys or not len(self._hi):
            return [None] * len(keys)
        q = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64).reshape(-1, 2)
        first = np.searchsorted(self._hi, q[:, 0])
        at = np.minimum(first, len(self._hi) - 1)
        hit = (self._hi[at] == q[:, 0]) & (self._lo[at] == q[:, 1]) & (self._at[at] >= 0)
        out: list[int | None] = [int(i) if h else None for i, h in zip(at, hit, strict=True)]
        for n in np.flatnonzero(~hit & (self._hi[at] == q[:, 0])):  # keys sharing a first half: the next ones
            i = int(at[n]) + 1
            while i < len(self._hi) and self._hi[i] == q[n, 0]:
                if self._lo[i] == q[n, 1] and self._at[i] >= 0:
                    out[n] = i
                    break
                i += 1
        return out

    def get_many(self, keys: list[bytes]) -> list[tuple[str, int] | None]:
        """The stored answer of each key and the number of its file (``files``); None where there is none
        or it does not verify."""
        return [None if i is None else self._answer(key, i) for key, i in zip(keys, self._find(keys), strict=True)]

    def get(self, key: bytes) -> str | None:
        found = self.get_many([key])[0]
        return None if found is None else found[0]

    def _answer(self, key: bytes, i: int) -> tuple[str, int] | None:
        number, row = int(self._at[i]) >> 32, int(self._at[i]) & 0xFFFFFFFF
        answers = self._answers(number)
        if answers is None or row >= len(answers[0]):
            return None
        text, check = answers[0][row], answers[1][row]
        if text is None or check != _check(key, text):
            log.warning("request store: the entry at row %d of %s does not verify; its request goes to the "
                        "engine again", row, self.files[number])  # fmt: skip
            self._at[i] = -1
            return None
        return text, number

    def _answers(self, number: int) -> tuple[list[str], list[bytes]] | None:
        if number in self._open:
            self._open.move_to_end(number)
            return self._open[number]
        try:
            table = pq.read_table(self.files[number], columns=["answer", "check"], filesystem=self.fs)
        except (OSError, pa.ArrowException) as e:
            log.warning("request store: %s does not read (%s); its entries are ignored", self.files[number], e)
            return None
        self._open[number] = (table.column("answer").to_pylist(), table.column("check").to_pylist())
        if len(self._open) > OPEN_FILES:
            self._open.popitem(last=False)
        return self._open[number]

    def put(self, entries: list[tuple[bytes, str]], about: dict[str, Any] | None = None) -> int | None:
        """Add ``entries`` (key, answer) as one new file, written whole before it appears, with ``about``
        in its metadata (``ABOUT``: the model, and the requests the job answered since its last save); its
        number (``files``), None when it could not be written."""
        now = pa.scalar(int(time.time() * 1000), pa.timestamp("ms", tz="UTC"))
        table = pa.table({"key": [k for k, _ in entries], "answer": [a for _, a in entries],
                          "check": [_check(k, a) for k, a in entries], "created": [now.as_py()] * len(entries)},
                         schema=SCHEMA.with_metadata({ABOUT: json.dumps(about or {})}))  # fmt: skip
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.parquet"
        path = f"{self.entries}/{name}"
        try:
            if storage.is_url(self.root):  # one PUT: the object appears whole or not at all
                pq.write_table(table, path, filesystem=self.fs)
            else:
                self.fs.create_dir(self.entries, recursive=True)
                partial = f"{self.entries}/.{name}.partial"
                try:
                    pq.write_table(table, partial, filesystem=self.fs)
                    os.replace(partial, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(partial)
        except OSError as e:  # the rows are saved all the same; only their reuse is lost
            log.warning("request store %s: %d answers not kept (%s)", self.root, len(entries), e)
            return None
        self._seen.add(path)
        self._add([(path, table.column("key"))])
        return len(self.files) - 1


def store_root(config: RunConfig) -> str:
    """The run's store: ``cache.dir``, by default ``<output.dir>/cache`` (a local one as an absolute path)."""
    root = config.cache.dir or os.path.join(config.output.dir, "cache")
    return root if storage.is_url(root) else os.path.abspath(root)


@functools.lru_cache(maxsize=8)
def _store(root: str, options: str) -> RequestStore:
    return RequestStore(root, json.loads(options))


# -- A job whose every request is stored: no engine ---------------------------------------------------


class StoreChanged(ShardgenError):
    """A job that found every request stored and started no engine (``NoEngine``) was asked for one it
    could not answer: entries were removed meanwhile (``shardgen cache``). The retry starts the engine."""


@dataclass
class NoEngine(kinds.OutsideEngine):
    """The engine of a job whose every remaining request the store answers: nothing starts, and the
    tokenizer is the model's own, loaded without an engine (the one the requests were looked up with).

    Args:
        tok: the job's tokenizer (``kinds.Tokenizer``).
    """

    tok: kinds.Tokenizer
    running: bool = False

    def start(self, settings: kinds.EngineSettings) -> NoEngine:
        return self

    def tokenizer(self, generates: bool = True, chat_template_kwargs: Any = None) -> kinds.Tokenizer:
        return self.tok

    @property
    def max_num_seqs(self) -> int:
        return self.MAX_NUM_SEQS

    def submit(self, requests: list[EngineRequest]) -> list[Exception | None]:
        raise StoreChanged(
            f"{len(requests)} request(s) found in the request store when the job began were not there when "
            "they were sent (was it pruned?); the next attempt starts the engine"
        )

    def step(self) -> list[Any]:
        return []

    def abort(self, request_ids: list[str]) -> None:
        pass

    def close(self, wait: float | None = None) -> None:
        pass


# -- The layer in front of an engine --------------------------------------------------------------------


@dataclass
class StoreEngine:
    """An engine handle (``kinds.for_config``) behind the store, with the same methods: ``submit`` sends
    the engine only the requests whose keys are neither stored nor in flight; ``step`` hands back the
    engine's outputs and the answers found (``rebuilt``); ``save`` adds the engine's new answers
    to the store (the feed calls it before it saves rows, ``ShardWork.on_save``).

    Args:
        engine: the job's engine handle.
        store: the run's store (``RequestStore.for_config``), indexed.
        context: the job's part of every key (``job_context``).
    """

    engine: Any
    store: RequestStore
    context: bytes
    about: dict[str, Any] = field(default_factory=dict)  # the model and task, in each file's metadata
    # the keyed requests answered since the last save, by where the answer came from
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys((ENGINE, STORE, DUPLICATE), 0))
    _ready: list[ServerOutput] = field(default_factory=list)
    _followers: dict[bytes, list[EngineRequest]] = field(default_factory=dict)  # by the key in flight
    _key_of: dict[str, bytes] = field(default_factory=dict)  # the engine's keyed requests
    _in_engine: set[str] = field(default_factory=set)
    _new: dict[bytes, str] = field(default_factory=dict)  # answers not saved yet
    _saved: set[int] = field(default_factory=set)  # the files of this job's saved answers

    @classmethod
    def for_job(cls, config: RunConfig, model_record: dict[str, Any]) -> StoreEngine:
        """The run's store (indexed now) in front of the engine a job sets later (``engine``)."""
        store = RequestStore.for_config(config)
        store.refresh()
        about = {"model": config.model.get("model"), "task": config.task}
        return cls(None, store, job_context(config, model_record), about)

    def __getattr__(self, name: str) -> Any:  # start, close, tokenizer, counters, max_num_seqs...
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def answers_all(self, requests: Iterable[Any], errors: Sized) -> bool:
        """Whether the store answers every one of ``requests`` (a job's, with their ``prompt_token_ids``,
        ``params`` and ``lora``), and ``errors`` stays empty as they are made; stops at the first miss."""
        it = iter(requests)
        while batch := list(itertools.islice(it, 256)):
            asked = [EngineRequest("", {"prompt_token_ids": r.prompt_token_ids}, r.params, r.lora) for r in batch]
            keys = [request_key(self.context, r) for r in asked]
            if errors or None in keys or None in self.store.get_many(keys):  # type: ignore[arg-type]
                return False
        return not errors

    def submit(self, requests: list[EngineRequest]) -> list[Exception | None]:
        errors: list[Exception | None] = [None] * len(requests)
        keys = [request_key(self.context, r) for r in requests]
        asked = [k for k in keys if k is not None and k not in self._followers and k not in self._new]
        stored = dict(zip(asked, self.store.get_many(asked), strict=True))
        sent: list[tuple[int, EngineRequest, bytes | None]] = []
        for i, (r, key) in enumerate(zip(requests, keys, strict=True)):
            if key is None:
                sent.append((i, r, None))
            elif key in self._followers:
                self._followers[key].append(r)
            elif key in self._new:
                self._ready.append(rebuilt(r, self._new[key], DUPLICATE))
            elif (found := stored.get(key)) is not None:
                text, number = found
                self._ready.append(rebuilt(r, text, DUPLICATE if number in self._saved else STORE))
            else:
                self._followers[key] = []
                sent.append((i, r, key))
        refused = self.engine.submit([r for _, r, _ in sent]) if sent else []
        for (i, r, key), error in zip(sent, refused, strict=True):
            errors[i] = error
            if error is not None:
                if key is not None:
                    self._answer_followers(key, None, str(error))
                continue
            self._in_engine.add(r.request_id)
            if key is not None:
                self._key_of[r.request_id] = key
        return errors

    def step(self) -> list[Any]:
        outputs = list(self.engine.step()) if self._in_engine else []
        for out in outputs:
            if not out.finished or out.request_id not in self._in_engine:
                continue
            self._in_engine.discard(out.request_id)
            key = self._key_of.pop(out.request_id, None)
            if key is None:
                continue
            error = getattr(out, "error", None)
            text = None if error is not None else answer(out)
            if text is not None:
                self._new[key] = text
                self.counts[ENGINE] += 1
            self._answer_followers(key, text, error)
        ready, self._ready = self._ready, []
        for out in ready:
            if out.error is None:
                self.counts[out.source] += 1
        return outputs + ready

    def _answer_followers(self, key: bytes, text: str | None, error: str | None) -> None:
        for r in self._followers.pop(key, []):
            if text is None:
                ids = list(r.prompt.get("prompt_token_ids") or ())
                self._ready.append(ServerOutput(r.request_id, ids, [], error=error, source=DUPLICATE))
            else:
                self._ready.append(rebuilt(r, text, DUPLICATE))

    def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for key in list(self._followers):
            self._followers[key] = [r for r in self._followers[key] if r.request_id not in ids]
        self._ready = [o for o in self._ready if o.request_id not in ids]
        mine = [i for i in request_ids if i in self._in_engine]
        for i in mine:
            self._in_engine.discard(i)
            if (key := self._key_of.pop(i, None)) is not None:
                self._followers.pop(key, None)
        if mine:
            self.engine.abort(mine)

    def save(self) -> None:
        """Add the engine's answers since the last save to the store (one file), and index the files other
        jobs added since (their answers serve this job's next requests)."""
        if self._new or any(self.counts.values()):
            about = {**self.about, "requests": self.counts}
            if (number := self.store.put(list(self._new.items()), about)) is not None:
                self._saved.add(number)
            self._new.clear()
            self.counts = dict.fromkeys(self.counts, 0)
        self.store.refresh()
