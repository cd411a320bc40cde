"""Object storage: ``s3://`` URLs for the input's Parquet objects and the output's upload.

Through pyarrow's S3 file system (``pyarrow.fs.S3FileSystem``): ranged reads of Parquet footers and row
groups, multipart uploads, the AWS SDK's standard retries with backoff on throttling and transient
errors. Credentials come from where AWS tools read them (the environment, the shared credentials and
config files, an instance role), never from the config (``trust.find_credentials`` refuses a key there);
``input.storage_options`` says only where the service is (``endpoint_url``, ``region``) and whether to
sign requests (``anonymous``).

An object is identified by its size and ETag: planning records them, a shard's fingerprint holds them
(``identity.shard_fingerprint``: an object rewritten with the same size is another input), a job refuses
an object whose ETag changed since (``ParquetSource.check_unchanged``) or changes while it reads it
(``ParquetSource.read``), and an upload is skipped when the object there is the one the last upload of
the same bytes left (``upload``).

A glob selects the objects that ``glob.glob(pattern, recursive=True)`` selects of the same files on
local disk (``glob_match``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import glob
import hashlib
import io
import itertools
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from shardgen.base.credentials import redact
from shardgen.base.io import atomic_write_text
from shardgen.errors import InputError, ShardgenError

SCHEME = "s3://"
# Attempts of each request (the AWS SDK's standard retry strategy: exponential backoff with jitter on
# throttling, 5xx and connection errors). 6 give up on a closed port after 8 to 25 s here (12 tries; the
# backoff is random); 10 took 87 s.
MAX_ATTEMPTS = 6
# Objects whose footers planning reads at once.
PARALLEL_READS = 16
CHUNK = 8 << 20
# The largest object S3 copies in one request (CopyObject): a larger upload cannot go through a temporary
# object (``_write``).
COPY_LIMIT = 5 << 30


class StorageError(ShardgenError):
    """Object storage refused or could not be reached; the message names the object and what to check."""


def is_url(path: str) -> bool:
    return str(path).startswith(SCHEME)


def _where(options: Mapping[str, Any] | None) -> str:
    endpoint = (options or {}).get("endpoint_url")
    return f"the endpoint {redact(endpoint)}" if endpoint else "AWS S3"


def _hint(options: Mapping[str, Any] | None) -> str:
    return (
        f"check the URL, {_where(options)} (input.storage_options.endpoint_url) and the credentials, which are "
        "read from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) or ~/.aws/credentials"
    )


@functools.cache
def _filesystem(endpoint_url: str | None, region: str | None, anonymous: bool) -> pafs.S3FileSystem:
    kwargs: dict[str, Any] = {
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=MAX_ATTEMPTS),
        "connect_timeout": 10,
        "request_timeout": 60,
        "anonymous": anonymous,
    }
    if endpoint_url:
        parts = urlsplit(endpoint_url if "://" in endpoint_url else f"https://{endpoint_url}")
        # (without a userinfo: credentials come from the environment, never a URL)
        kwargs["endpoint_override"] = parts.netloc.rpartition("@")[2] + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def filesystem(options: Mapping[str, Any] | None) -> pafs.S3FileSystem:
    """The S3 file system of ``input.storage_options`` (one per process and options)."""
    options = options or {}
    return _filesystem(options.get("endpoint_url"), options.get("region"), bool(options.get("anonymous")))


def path_of(url: str) -> str:
    """``bucket/key`` of ``s3://bucket/key``."""
    return url[len(SCHEME) :]


def glob_match(pattern: str, path: str) -> bool:
    """Whether ``glob.glob(pattern, recursive=True)`` would select the file ``path`` of the same tree on
    local disk (``/``-separated, both): what ``input.parquet`` takes of objects is what it takes of files.

    Each ``/`` component of the pattern matches one of the path (``fnmatch``: ``*``, ``?``, ``[...]``,
    ``[!...]``), except ``**`` alone in a component, which matches zero or more directories (all of what
    is left, at the end). A wildcard skips names starting with ``.`` unless its component starts with
    ``.`` too, and ``**`` skips them always (glob's ``include_hidden=False``). A pattern ending with ``/``
    selects directories only: no file.
    """
    if pattern.endswith("/"):
        return False
    pats = tuple(c for c in pattern.split("/") if c)  # glob reads 'a//b' as 'a/b'
    return _glob_match(pats, tuple(path.split("/")))


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _glob_match(pats: tuple[str, ...], names: tuple[str, ...]) -> bool:
    @functools.cache
    def match(i: int, j: int) -> bool:  # pats[i:] against names[j:]
        if i == len(pats):
            return j == len(names)
        pat = pats[i]
        if pat == "**":
            if i == len(pats) - 1:  # everything below: the file and the directories above it
                return j < len(names) and not any(map(_hidden, names[j:]))
            # zero or more directories (never the file, the last name), none of them hidden
            for k in range(j, len(names)):
                if match(i + 1, k):
                    return True
                if k == len(names) - 1 or _hidden(names[k]):
                    return False
            return False
        if j == len(names):
            return False
        name = names[j]
        if not glob.has_magic(pat):
            ok = pat == name
        else:
            ok = (_hidden(pat) or not _hidden(name)) and fnmatch.fnmatchcase(name, pat)
        return ok and match(i + 1, j + 1)

    return match(0, 0)


def expand(patterns: list[str], options: Mapping[str, Any] | None, key: str) -> list[str]:
    """The objects ``s3://`` patterns name, in config order, each glob's matches sorted by key.

    Raises:
        InputError: an object does not exist, a glob matches none, or the storage cannot be listed,
            naming ``key`` and the URL.
    """
    fs, out = filesystem(options), []
    for url in patterns:
        path = path_of(url)
        try:
            if glob.has_magic(path):
                parts = path.split("/")
                literal = list(itertools.takewhile(lambda p: not glob.has_magic(p), parts[:-1]))
                if not literal:
                    raise InputError(f"{key}: '{redact(url)}' has a pattern in its bucket's name; name the bucket")
                base = "/".join(literal)  # the directories above the first wildcard: all that is listed
                rest = parts[len(literal) :]
                deep = len(rest) > 1 or "**" in rest  # (else one level: a listing of its names only)
                infos = fs.get_file_info(pafs.FileSelector(base, recursive=deep, allow_not_found=True))
                found = sorted(i.path for i in infos if i.type == pafs.FileType.File and glob_match(path, i.path))
                if not found:
                    raise InputError(f"{key}: the pattern '{redact(url)}' matches no object")
                out.extend(SCHEME + p for p in found)
            else:
                info = fs.get_file_info(path)
                if info.type != pafs.FileType.File:
                    raise InputError(f"{key}: no such object: '{redact(url)}'")
                out.append(url)
        except OSError as e:
            raise InputError(f"{key}: cannot list '{redact(url)}': {_first_line(e)}; {_hint(options)}") from e
    return out


def _first_line(e: BaseException) -> str:
    return redact((str(e).strip().splitlines() or [type(e).__name__])[0][:300])


def open_input(url: str, options: Mapping[str, Any] | None) -> pa.NativeFile:
    """A random-access file of the object (its reads are ranged GETs).

    Raises:
        InputError: it cannot be opened, naming it.
    """
    try:
        return filesystem(options).open_input_file(path_of(url))
    except OSError as e:
        raise InputError(f"input: cannot read '{redact(url)}': {_first_line(e)}; {_hint(options)}") from e


class CountingFile(io.RawIOBase):
    """An object opened for reading (``open_input``), counting the bytes read through it: what planning
    reads of each object (its footer) is reported against the objects' size, and a read of its rows
    knows whether anything was read since it last checked the object (``ParquetSource.read``)."""

    def __init__(self, f: pa.NativeFile) -> None:
        super().__init__()
        self.f, self.read_bytes = f, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def size(self) -> int:
        return self.f.size()

    def readinto(self, buffer: Any) -> int:
        data = self.f.read(len(buffer))
        buffer[: len(data)] = data
        self.read_bytes += len(data)
        return len(data)

    def read_buffer(self, nbytes: int | None = None) -> pa.Buffer:
        """What pyarrow's reads through a Python file call when it has it: no copy of a row group's bytes."""
        data = self.f.read_buffer(nbytes)
        self.read_bytes += data.size
        return data

    def close(self) -> None:
        self.f.close()
        super().close()


def etag(f: pa.NativeFile) -> str | None:
    """The ETag of an open object (its HEAD response, which opening it read)."""
    value = (f.metadata() or {}).get("ETag") or (f.metadata() or {}).get(b"ETag")
    return value.decode() if isinstance(value, bytes) else value


def head(url: str, options: Mapping[str, Any] | None) -> tuple[int, str | None]:
    """``(size, ETag)`` of an object.

    Raises:
        InputError: it is gone or cannot be read, naming it.
    """
    f = open_input(url, options)
    try:
        return f.size(), etag(f)
    finally:
        f.close()


def parallel(fn: Any, items: list[Any]) -> list[Any]:
    """``fn`` of each item, ``PARALLEL_READS`` at a time (an object store answers in parallel)."""
    if len(items) < 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(PARALLEL_READS) as pool:
        return list(pool.map(fn, items))


# -- The upload -----------------------------------------------------------------------------------------


def _sha256(read: Any) -> str:
    h = hashlib.sha256()
    while chunk := read(CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _remote_sha256(fs: pafs.S3FileSystem, path: str) -> str:
    with fs.open_input_stream(path) as f:
        return _sha256(f.read)


def upload(files: list[tuple[Path, str]], prefix: str, options: Mapping[str, Any] | None, state: Path) -> dict:
    """Upload each ``(local file, name)`` to ``<prefix>/<name>``; returns what was uploaded and skipped.

    An object appears under its name only when its (multipart) upload completes: one cut off leaves no
    object, or the one before it as it was (``_write``; a file above 5 GiB: no object). Each is verified
    after: its size, and the SHA-256 of its bytes read back. ``state`` records each upload (its SHA-256,
    size and ETag), after each one: a file whose bytes and object are those of the last upload is
    skipped, so a rerun that changed nothing uploads nothing, and one cut off uploads only what it had not.

    Raises:
        StorageError: an upload was refused or did not verify, naming the object.
    """
    fs = filesystem(options)
    done: dict[str, Any] = json.loads(state.read_text()) if state.exists() else {}
    uploaded, skipped = [], []
    for local, name in files:
        url = prefix.rstrip("/") + "/" + name
        path = path_of(url)
        with open(local, "rb") as f:
            sha = _sha256(f.read)
        size = local.stat().st_size
        last = done.get(url)
        try:
            if last and last["sha256"] == sha and last["size"] == size:
                with fs.open_input_file(path) as there:
                    if (there.size(), etag(there)) == (size, last["etag"]):
                        skipped.append(url)
                        continue
        except OSError:
            pass  # gone or unreadable: uploaded again
        try:
            _write(fs, local, path)
            with fs.open_input_file(path) as there:
                got_size, got_etag = there.size(), etag(there)
            if got_size != size or _remote_sha256(fs, path) != sha:
                raise StorageError(
                    f"output.upload: '{redact(url)}' does not hold what was uploaded ({got_size} of {size} bytes, or "
                    "another checksum); run the workflow again to upload it"
                )
        except OSError as e:
            raise StorageError(
                f"output.upload: cannot write '{redact(url)}': {_first_line(e)}; {_hint(options)}"
            ) from e
        done[url] = {"sha256": sha, "size": size, "etag": got_etag}
        atomic_write_text(state, json.dumps(done, indent=1, sort_keys=True) + "\n")
        uploaded.append(url)
    return {"uploaded": uploaded, "skipped": skipped}


def _write(fs: pafs.S3FileSystem, local: Path, path: str) -> None:
    """``local``'s bytes as the object ``path``, leaving the object there before as it was until they are
    all up. Closing pyarrow's stream completes its (multipart) upload with what was written, even after
    an error (a signal, a read error; pyarrow has no abort), so the bytes go to a temporary object beside
    it (``_partial``), which is copied to its name once complete (S3's CopyObject: on the server, atomic)
    and removed; after an error only the temporary object is, and a process killed outright never
    completes its upload. A file larger than ``COPY_LIMIT``, which CopyObject cannot take, is written
    under its name, and removed after an error (the one before it is then gone too)."""
    direct = local.stat().st_size > COPY_LIMIT
    target = path if direct else _partial(path)
    stream = fs.open_output_stream(target)
    try:
        with open(local, "rb") as src:
            while chunk := src.read(CHUNK):
                stream.write(chunk)
    except BaseException:
        completed = False
        with contextlib.suppress(Exception):
            stream.close()  # (completes the upload with what was written: pyarrow cannot abort one)
            completed = True
        if completed or not direct:  # (a direct upload never completed left the object before it as it was)
            with contextlib.suppress(Exception):
                fs.delete_file(target)
        raise
    stream.close()
    if not direct:
        try:
            fs.copy_file(target, path)
        finally:
            with contextlib.suppress(Exception):
                fs.delete_file(target)


def _partial(path: str) -> str:
    """Where an upload to ``path`` is written first: beside it, a name starting with '.', which globs and
    dataset readers (pyarrow's, Hugging Face's) skip; the next upload of the same file overwrites it."""
    head, _, name = path.rpartition("/")
    return f"{head}/.{name}.shardgen-upload"


def require_writable(prefix: str | None, options: Mapping[str, Any] | None) -> None:
    """``check_writable``, for a run about to start (a run of steps, before any job).

    Raises:
        StorageError: ``prefix`` cannot take the upload, naming it and why.
    """
    if prefix and (why := check_writable(prefix, options)):
        raise StorageError(f"{why}; no job was started")


def check_writable(prefix: str, options: Mapping[str, Any] | None, key: str = "output.upload") -> str | None:
    """Why ``prefix`` cannot take the upload (or what config ``key`` writes there; None: it can): a test
    object written there and removed."""
    fs = filesystem(options)
    probe = path_of(prefix.rstrip("/") + "/.shardgen-preflight-probe")
    try:
        with fs.open_output_stream(probe) as f:
            f.write(b"shardgen preflight: may this run upload here?\n")
        fs.delete_file(probe)
    except OSError as e:
        return f"{key}: cannot write under '{redact(prefix)}': {_first_line(e)}; {_hint(options)}"
    return None
