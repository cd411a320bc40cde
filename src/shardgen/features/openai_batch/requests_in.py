"""Requests in (``input.openai_batch``): a request file's lines as rows, checked and paired as vLLM
reads them, and the files as a source (a source kind, registered with sources)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from shardgen.data import sources
from shardgen.data.manifest import Segment
from shardgen.data.outputs import lone_surrogate
from shardgen.data.sources import BATCH_ROWS, ParquetSource, SourceKind, expand_patterns
from shardgen.errors import InputError, RowError

if TYPE_CHECKING:
    from shardgen.config import RunConfig

from shardgen.features.openai_batch.api import ALL_URLS, CHAT, COMPLETIONS, EMBEDDINGS, RERANK, SCORE, URLS

# -- Requests in (input.openai_batch) -----------------------------------------------------------------

# body fields a row's columns take; the rest is sampling (input.sampling_column: shardgen.requests.rowsampling)
CONTENT_FIELDS = ("messages", "prompt", "input", "model")
# /v1/embeddings fields that change no result here
EMBEDDING_IGNORED = frozenset({"user", "encoding_format"})


def served_urls(config: RunConfig) -> tuple[str, ...]:
    """The request urls a run of ``input.openai_batch`` serves (none for another input): its task's,
    and for generation whether prompts are chats."""
    if not config.input.openai_batch:
        return ()
    if config.task == "score":
        return SCORE + RERANK
    return (COMPLETIONS if URLS[config.task] == CHAT and not config.prompt.chat else URLS[config.task],)


def row_check(config: RunConfig) -> Callable[[dict[str, Any]], None] | None:
    """The check of each request row of a run (``sources.SourceKind.row_check``): a request that is not
    valid (``request_error``), or for a url the run does not serve (``served_urls``), is the row's error."""
    urls = served_urls(config)
    if not urls:
        return None

    def check(row: dict[str, Any]) -> None:  # raises RowError: invalid_request, naming the field
        if row.get("request_error"):
            raise RowError("invalid_request", row["request_error"])
        if row.get("url") not in urls:
            raise RowError("invalid_request", f"url: {row.get('url')!r}, but this run serves {', '.join(urls)}")

    return check


def scan_line(line: bytes, path: str, lineno: int, pairs: bool = False) -> tuple[str, str | None, int]:
    """A request line's ``custom_id``, ``body.model`` and rows (``request_rows``), read when planning.

    Raises:
        InputError: the line is not a JSON object with a string ``custom_id`` (valid Unicode), or nests
            deeper than ``MAX_DEPTH``, naming the file and line.
    """
    where = f"input: '{path}', line {lineno}"
    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's json reads
        raise InputError(f"{where}: not JSON ({e})") from None
    # a job reads the line again with a deeper stack: one that nests near Python's limit could fail there
    # (the counts, a few microseconds a 4 KB line, spare the walk of every request's values)
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH and _depth(request) > MAX_DEPTH:
        raise InputError(f"{where}: not JSON shardgen reads (nested deeper than {MAX_DEPTH} levels)")
    if not isinstance(request, dict) or not isinstance(request.get("custom_id"), str) or not request["custom_id"]:
        raise InputError(f"{where}: a request needs a custom_id (a non-empty string)")
    custom = request["custom_id"]
    if (at := lone_surrogate(custom)) is not None:  # an id no output can hold (escaped by repr)
        raise InputError(
            f"{where}: the custom_id {custom!r} is not valid Unicode text (a lone surrogate at character {at}: "
            "a truncated emoji?)"
        )
    body = request.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    # a model that is not text is the row's error (request_row), not a name to record
    model = model if isinstance(model, str) and lone_surrogate(model) is None else None
    return custom, model, _rows(request, line, pairs)


def _rows(request: dict[str, Any], line: bytes, pairs: bool) -> int:
    """The rows ``request_rows`` makes of the request: it decides the same way, from the parsed line."""
    if not pairs or request.get("url") not in SCORE + RERANK:
        return 1
    try:
        return len(_score_request(request, line)[0])
    except ValueError:
        return 1  # the row of the request's error


# How deeply a request may nest (its JSON arrays and objects): far deeper than a request has reason to,
# and far enough from Python's recursion limit (1,000) that a job's stack reads what planning read.
MAX_DEPTH = 200


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a JSON value (iteratively: any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


# An escape of a surrogate (\ud800 to \udfff; or an escaped backslash before such text, which the
# search of the values then clears)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _not_unicode(request: dict[str, Any], line: bytes) -> str | None:
    """The error naming the first field (in the line's order) of the request (parsed from ``line``)
    whose value or name is not valid Unicode text, None where every string is."""
    # a lone surrogate needs an escape of one, bytes that are not UTF-8 (Python's json reads a
    # surrogate's own three bytes) or another encoding (UTF-16 and 32 have NUL bytes): a search of the
    # line, a microsecond, rules them out for almost every line
    if b"\x00" not in line and not SURROGATE_ESCAPE.search(line):
        try:
            line.decode("utf-8")
            return None
        except UnicodeDecodeError:
            pass
    try:
        json.dumps(request, ensure_ascii=False).encode("utf-8")  # an emoji's escaped pair: at C speed
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[Any, str]] = [(request, "")]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            if (i := lone_surrogate(value)) is not None:
                return f"{at}: not valid Unicode text (a lone surrogate, {value[i]!r}, at character {i})"
        elif isinstance(value, dict):
            for key in value:
                if (i := lone_surrogate(key)) is not None:
                    where = f"{at}[{key!r}]"  # repr: escaped
                    return (
                        f"{where}: not valid Unicode text (a lone surrogate, {key[i]!r}, at character {i} of the name)"
                    )
            stack.extend((v, f"{at}.{k}" if at else k) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def _kind(value: Any) -> str:
    """A JSON value's kind, for an error message (the value itself may be large)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def request_row(line: bytes) -> dict[str, Any]:
    """The row of one request line (``BATCH_SCHEMA``): its custom id and url, the chat
    ``messages`` (text parts joined) or the text ``input`` (``input``, or a completion's ``prompt``),
    the sampling fields of its body as JSON (``body``), and what makes it invalid
    (``request_error``, naming the field), which makes it the row's error.

    Whatever JSON a planned line holds (``scan_line``), the row is one Arrow holds: a field that is not
    text where text is read, or a string that is not valid Unicode (a lone surrogate) anywhere, is the
    row's error, and its columns are null."""
    request = json.loads(line)
    body = request.get("body")
    row = {"custom_id": request["custom_id"], "url": None, "messages": None, "input": None, "body": None,
           "request_error": None}  # fmt: skip
    try:
        if (error := _not_unicode(request, line)) is not None:
            raise ValueError(error)
        url = request.get("url")
        if not isinstance(url, str):
            raise ValueError(f"url: a string (one of {', '.join(ALL_URLS)}), not {_kind(url)}")
        row["url"] = url
        if not isinstance(body, dict):
            raise ValueError("body: a JSON object")
        if url in SCORE + RERANK:
            return row  # another task's request (a score run reads it with request_rows): RowInputs refuses it
        if url == CHAT:
            row["messages"] = _messages(body.get("messages"))
        elif url in (COMPLETIONS, EMBEDDINGS):
            key = "prompt" if url == COMPLETIONS else "input"
            if not isinstance(body.get(key), str):
                raise ValueError(f"body.{key}: one string per request")
            row["input"] = body[key]
        else:
            raise ValueError(f"url: {url!r} is none of {', '.join(ALL_URLS)}")
        rest = {k: v for k, v in body.items() if k not in CONTENT_FIELDS}
        if url == EMBEDDINGS and (changes := sorted(set(rest) - EMBEDDING_IGNORED)):
            raise ValueError(f"body.{changes[0]}: not served for embeddings (it would change the result)")
        if url == CHAT and rest.get("max_completion_tokens") is not None and "max_tokens" in rest:
            # vLLM's server takes max_completion_tokens over max_tokens, in whatever order the body has
            # them, as OpenAI does (OpenAIServingChat._create_chat_completion, vllm/entrypoints/openai/
            # chat_completion/serving.py); its ChatCompletionRequest still checks max_tokens
            given = rest.pop("max_tokens")
            if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
                raise ValueError(f"body.max_tokens: an integer or null, not {_kind(given)}")
        if url == COMPLETIONS and rest.get("max_completion_tokens") is not None:
            # not a field of vLLM's CompletionRequest (vllm/entrypoints/openai/completion/protocol.py), whose
            # server ignores it: the row's error, not a limit vLLM would not set
            raise ValueError("body.max_completion_tokens: not a field of a completion request (max_tokens is)")
        row["body"] = json.dumps(rest) if rest and url != EMBEDDINGS else None
    except ValueError as e:
        row["request_error"] = str(e)
    return row


# The message fields beside role and content that vLLM's server gives the chat template
# (vllm/renderers/chat_utils.py, _parse_chat_message_content: name and task, an assistant's tool_calls
# and reasoning, a tool message's tool_call_id, a developer's tools), which a row's message (a role and
# a content: BATCH_SCHEMA) does not carry: one that is set is the row's error (null: absent, as
# vLLM has it). vLLM drops the others, as shardgen does.
TEMPLATE_FIELDS = ("name", "task", "tool_calls", "reasoning", "tool_call_id", "tools")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages: a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts are served")
            for j, part in enumerate(content):
                # vLLM skips a null text part, with a warning: the request says there is text
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"body.messages[{i}].content[{j}].text: a string, not {_kind(part.get('text'))}")
            # joined as vLLM's server joins them for a chat template that takes a string
            # (vllm/renderers/chat_utils.py, _parse_chat_message_content_parts)
            content = "\n".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ValueError(f"body.messages[{i}]: a role and a text content")
        if field := next((f for f in TEMPLATE_FIELDS if m.get(f) is not None), None):
            raise ValueError(
                f"body.messages[{i}].{field}: not served (vLLM's chat template would see it; a message here is "
                "its role and content)"
            )
        out.append({"role": m["role"], "content": content})
    return out


# -- Score and rerank requests (task score) -----------------------------------------------------------

# The two texts of vLLM's ScoreRequest forms, in the order its union tries them, and of its
# RerankRequest (vllm/entrypoints/pooling/scoring/protocol.py)
SCORE_TEXTS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
RERANK_TEXTS = ("query", "documents")
# fields of vLLM's score and rerank requests that change no score
SCORE_IGNORED = frozenset({"model", "user", "request_id", "priority", "cache_salt"})
# fields that would change the scores, served at vLLM's default only (a null field is the default)
SCORE_DEFAULTS = {"truncate_prompt_tokens": (), "padding": (), "truncation_side": (), "use_activation": (),
                  "mm_processor_kwargs": ({},), "chat_template_kwargs": ({},), "instruction": (),
                  "max_tokens_per_query": (0,), "max_tokens_per_doc": (0,)}  # fmt: skip


def request_rows(line: bytes, pairs: bool = False) -> list[dict[str, Any]]:
    """The rows of one request line: its row (``request_row``); in a score run (``pairs``), a row per
    pair of texts of a score or rerank request (``sources.PAIR_SCHEMA``): the first text as ``input``,
    the second as ``pair``, its place among the request's pairs (``pair_index``; a rerank's document
    index), and a rerank's ``top_n`` in ``body``. A request that is not valid is one row, its error."""
    row = request_row(line)
    if not pairs:
        return [row]
    row |= {"pair": None, "pair_index": None}
    if row["url"] not in SCORE + RERANK:
        return [row]  # another task's request: RowInputs refuses it
    try:
        texts, top_n = _score_request(json.loads(line), line)
    except ValueError as e:
        return [row | {"request_error": str(e)}]
    body = json.dumps({"top_n": top_n}) if top_n else None
    return [row | {"input": a, "pair": b, "pair_index": i, "body": body} for i, (a, b) in enumerate(texts)]


def _score_request(request: dict[str, Any], line: bytes) -> tuple[list[tuple[str, str]], int]:
    """``score_pairs`` of a score or rerank request line, whose strings must be text as ``request_row``
    has them: planning counts its rows with it (``_rows``), a job makes them (``request_rows``).

    Raises:
        ValueError: naming the field.
    """
    if (error := _not_unicode(request, line)) is not None:
        raise ValueError(error)
    return score_pairs(request["url"], request.get("body"))


def score_pairs(url: str, body: Any) -> tuple[list[tuple[str, str]], int]:
    """The pairs of texts of a score or rerank request, as vLLM pairs them (one first text with each
    second, or the i-th with the i-th: vllm/entrypoints/pooling/scoring/utils.py,
    ``_validate_score_input_lens``), and a rerank's ``top_n`` (0: every document).

    Raises:
        ValueError: naming the field.
    """
    rerank = url in RERANK
    kind = "rerank" if rerank else "score"
    if not isinstance(body, dict):
        raise ValueError("body: a JSON object")
    if rerank:
        first, second = RERANK_TEXTS
        if not isinstance(body.get(first), str):
            raise ValueError(f"body.{first}: one string per rerank request")
    else:
        given = [f for f in SCORE_TEXTS if f[0] in body and f[1] in body]
        if not given:
            half = next((f for f in SCORE_TEXTS if f[0] in body or f[1] in body), SCORE_TEXTS[-1])
            missing = half[1] if half[0] in body else half[0]
            raise ValueError(f"body.{missing}: a score request needs {half[0]} and {half[1]}")
        first, second = given[0]
    ones, twos = _texts(body, first), _texts(body, second)
    if len(ones) > 1 and len(ones) != len(twos):
        raise ValueError(f"body.{first}: {len(ones)} texts for {len(twos)} in body.{second}: pairs are 1:1, 1:N or N:N")
    top_n = body.get("top_n") if rerank else None
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise ValueError("body.top_n: a non-negative integer")
    served = {first, second, "top_n"} if rerank else {first, second}
    for key in sorted(set(body) - served):
        value = body[key]
        if value is None or key in SCORE_IGNORED or (key in SCORE_DEFAULTS and value in SCORE_DEFAULTS[key]):
            continue
        if key in SCORE_DEFAULTS:
            raise ValueError(f"body.{key}: not served for {kind} requests (it would change the scores)")
        raise ValueError(f"body.{key}: not a field of a {kind} request")
    return [(ones[0] if len(ones) == 1 else ones[i], t) for i, t in enumerate(twos)], top_n or 0


def _texts(body: dict[str, Any], key: str) -> list[str]:
    value = body[key]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"body.{key}: a string or a list of strings (multimodal content is not served)")
    if not value:
        raise ValueError(f"body.{key}: at least one text")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise ValueError(f"body.{key}[{i}]: a string (multimodal content is not served)")
    return value


# -- The input: request files as rows (a source kind, registered with sources) ----------------------------


@dataclass(frozen=True)
class BatchFileInfo:
    """What planning records of one OpenAI Batch file: its rows (a row per line; in a score run a row
    per pair of texts, ``openai_batch.request_rows``), and the byte offset of the line that holds every
    ``BATCH_BLOCK``-th row (where a job starts reading a shard's lines), with the first row of that
    line (``firsts``: recorded in a score run only, where a line may hold several rows)."""

    path: str
    size: int
    mtime_ns: int
    rows: int
    offsets: list[int] = field(default_factory=list)
    firsts: list[int] | None = None

    def first_row(self, block: int) -> int:
        """The first row of the line at ``offsets[block]``."""
        return self.firsts[block] if self.firsts is not None else block * BATCH_BLOCK


BATCH_BLOCK = 1024  # rows between two recorded offsets
# The columns of an OpenAI Batch input's rows (request_row makes them).
BATCH_SCHEMA = pa.schema([
    ("custom_id", pa.large_string()),
    ("url", pa.large_string()),
    ("messages", pa.large_list(pa.struct([("role", pa.large_string()), ("content", pa.large_string())]))),
    ("input", pa.large_string()),
    ("body", pa.large_string()),
    ("request_error", pa.large_string()),
])  # fmt: skip
# A score run's rows (a row per pair of texts): the second text, and its place among its request's pairs.
PAIR_SCHEMA = BATCH_SCHEMA.append(pa.field("pair", pa.large_string())).append(pa.field("pair_index", pa.int32()))


class OpenAIBatchSource:
    """OpenAI Batch API request files (JSON Lines), a request per line, in the order given, as rows
    (``BATCH_SCHEMA``): planning reads every line once (each must be JSON with a unique
    ``custom_id``) and records where each block of rows starts; a job seeks to its lines.

    In a score run (``pairs``) a score or rerank request is a row per pair of texts (``PAIR_SCHEMA``),
    each scored by its own engine request as a Parquet input's rows are; the merge gives the request's
    pairs back as one result line (``openai_batch.requests``).
    """

    kind = "openai_batch"

    def __init__(self, files: list[BatchFileInfo], models: list[str] | None = None, pairs: bool = False) -> None:
        self.files = files
        self.models = models or []  # the body.model values of the requests, when planned
        self.pairs = pairs
        self.schema = PAIR_SCHEMA if pairs else BATCH_SCHEMA
        self._offsets = list(itertools.accumulate((f.rows for f in files), initial=0))

    @classmethod
    def scan(cls, patterns: list[str], pairs: bool = False) -> OpenAIBatchSource:
        """Read the files once: row offsets, a JSON object per line, unique custom ids, one model.

        Raises:
            InputError: naming the file and line.
        """
        infos, seen, models = [], set(), set()
        for path in expand_patterns(patterns, "input.openai_batch"):
            offsets, firsts, rows, pos = [], [], 0, 0
            st = os.stat(path)
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        custom_id, model, count = scan_line(line, path, lineno, pairs)
                        while len(offsets) * BATCH_BLOCK < rows + count:  # the blocks that start in this line
                            offsets.append(pos)
                            firsts.append(rows)
                        key = hashlib.blake2b(custom_id.encode(), digest_size=8).digest()
                        if key in seen:
                            raise InputError(f"input: '{path}', line {lineno}: the custom_id {custom_id!r} again")
                        seen.add(key)
                        models.add(model)
                        rows += count
                    pos += len(line)  # an empty line is no request
            infos.append(BatchFileInfo(path, st.st_size, st.st_mtime_ns, rows, offsets, firsts if pairs else None))
        models.discard(None)
        if len(models) > 1:
            raise InputError(
                f"input.openai_batch: the requests name {len(models)} models ({', '.join(sorted(models)[:5])}); "
                "a run serves one (model.model): split the file by model"
            )
        return cls(infos, sorted(models), pairs)

    def to_manifest(self) -> dict[str, Any]:
        files = [{k: v for k, v in asdict(f).items() if k != "firsts" or v is not None} for f in self.files]
        # `pairs` only when set: the manifests of other runs stay as they were
        return {"kind": self.kind, "files": files, "models": self.models} | ({"pairs": True} if self.pairs else {})

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> OpenAIBatchSource:
        return cls([BatchFileInfo(**f) for f in entry["files"]], entry.get("models"), entry.get("pairs", False))

    # files by path, size and modification time, rows by a running offset: as Parquet's
    num_rows = ParquetSource.num_rows
    describe = ParquetSource.describe
    segments = ParquetSource.segments
    check_unchanged = ParquetSource.check_unchanged

    def read(
        self, segments: list[Segment], batch_rows: int = BATCH_ROWS, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Stream the requests of the segments as rows, from the recorded offset before each."""
        self.check_unchanged({s.file for s in segments})
        schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
        for seg in segments:
            info = self.files[seg.file]
            block = seg.start // BATCH_BLOCK
            row = info.first_row(block)
            out: list[dict[str, Any]] = []
            with open(info.path, "rb") as f:
                f.seek(info.offsets[block])
                for line in f:
                    if not line.strip():
                        continue
                    if row >= seg.stop:
                        break
                    for request in request_rows(line, self.pairs):
                        if seg.start <= row < seg.stop:
                            out.append(request)
                            if len(out) == batch_rows:
                                yield pa.RecordBatch.from_pylist(out, schema=schema)
                                out = []
                        row += 1
            if out:
                yield pa.RecordBatch.from_pylist(out, schema=schema)

    def byte_blocks(self, columns: list[str]) -> Iterator[tuple[int, int]]:
        """``(rows, bytes)`` of each block of rows, from the recorded offsets (the whole request's; a
        line of several blocks' rows counts in the first)."""
        for info in self.files:
            ends = [*info.offsets[1:], info.size]
            for i, (start, end) in enumerate(zip(info.offsets, ends, strict=True)):
                yield min(BATCH_BLOCK, info.rows - i * BATCH_BLOCK), end - start


# planned from input.openai_batch; its manifest entries are of kind "openai_batch". Each row is checked as
# a request before it is one (row_check); planning read every custom_id (ids_planned: a score request's
# rows share one).
sources.register_source(OpenAIBatchSource.kind, SourceKind(
    OpenAIBatchSource.from_manifest, key="openai_batch",
    open=lambda input_cfg, pairs: OpenAIBatchSource.scan(list(input_cfg.openai_batch), pairs),
    files=lambda input_cfg: expand_patterns(list(input_cfg.openai_batch), "input.openai_batch"),
    row_check=row_check, ids_planned=True,
))  # fmt: skip
