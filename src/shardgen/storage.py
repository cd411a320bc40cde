"""Object storage: ``s3://`` URLs for the input's Parquet objects and the output's upload.

Through pyarrow's S3 file system (``pyarrow.fs.S3FileSystem``): ranged reads of Parquet footers and row
groups, multipart uploads, the AWS SDK's standard retries with backoff on throttling and transient
errors. Credentials come from where AWS tools read them (the environment, the shared credentials and
config files, an instance role), never from the config (``trust.find_credentials`` refuses a key there);
``input.storage_options`` says only where the service is (``endpoint_url``, ``region``) and whether to
sign requests (``anonymous``).

An object is identified by its size and ETag: planning records them, a job refuses an object whose
ETag changed since (``ParquetSource.check_unchanged``), and an upload is skipped when the object there
is the one the last upload of the same bytes left (``upload``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import io
import json
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from shardgen.errors import InputError, ShardgenError
from shardgen.io import atomic_write_text

SCHEME = "s3://"
# Attempts of each request (the AWS SDK's standard retry strategy: exponential backoff with jitter on
# throttling, 5xx and connection errors). 6 give up on a closed port after 8 to 25 s here (12 tries; the
# backoff is random); 10 took 87 s.
MAX_ATTEMPTS = 6
# Objects whose footers planning reads at once.
PARALLEL_READS = 16
CHUNK = 8 << 20


class StorageError(ShardgenError):
    """Object storage refused or could not be reached; the message names the object and what to check."""


def is_url(path: str) -> bool:
    return str(path).startswith(SCHEME)


def _where(options: Mapping[str, Any] | None) -> str:
    endpoint = (options or {}).get("endpoint_url")
    return f"the endpoint {endpoint}" if endpoint else "AWS S3"


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
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
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


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob over keys as a regex: ``*`` and ``?`` stay within one ``/`` level, ``**`` crosses them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 1)) > i:
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


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
                base = re.split(r"[*?\[]", path, maxsplit=1)[0].rsplit("/", 1)[0]
                matcher = _glob_regex(path)
                infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
                found = sorted(i.path for i in infos if i.type == pafs.FileType.File and matcher.match(i.path))
                if not found:
                    raise InputError(f"{key}: the pattern '{url}' matches no object")
                out.extend(SCHEME + p for p in found)
            else:
                info = fs.get_file_info(path)
                if info.type != pafs.FileType.File:
                    raise InputError(f"{key}: no such object: '{url}'")
                out.append(url)
        except OSError as e:
            raise InputError(f"{key}: cannot list '{url}': {_first_line(e)}; {_hint(options)}") from e
    return out


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def open_input(url: str, options: Mapping[str, Any] | None) -> pa.NativeFile:
    """A random-access file of the object (its reads are ranged GETs).

    Raises:
        InputError: it cannot be opened, naming it.
    """
    try:
        return filesystem(options).open_input_file(path_of(url))
    except OSError as e:
        raise InputError(f"input: cannot read '{url}': {_first_line(e)}; {_hint(options)}") from e


class CountingFile(io.RawIOBase):
    """An object opened for reading (``open_input``), counting the bytes read through it: what planning
    reads of each object (its footer) is reported against the objects' size."""

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
    object, or the one before it. Each is verified after: its size, and the SHA-256 of its bytes read
    back. ``state`` records each upload (its SHA-256, size and ETag), after each one: a file whose bytes
    and object are those of the last upload is skipped, so a rerun that changed nothing uploads nothing,
    and one cut off uploads only what it had not.

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
                    f"output.upload: '{url}' does not hold what was uploaded ({got_size} of {size} bytes, or "
                    "another checksum); run the workflow again to upload it"
                )
        except OSError as e:
            raise StorageError(f"output.upload: cannot write '{url}': {_first_line(e)}; {_hint(options)}") from e
        done[url] = {"sha256": sha, "size": size, "etag": got_etag}
        atomic_write_text(state, json.dumps(done, indent=1, sort_keys=True) + "\n")
        uploaded.append(url)
    return {"uploaded": uploaded, "skipped": skipped}


def _write(fs: pafs.S3FileSystem, local: Path, path: str) -> None:
    """``local``'s bytes as the object ``path`` (a multipart upload above a few MiB). Closing pyarrow's
    stream completes the upload with what was written, even after an error (a signal, a read error):
    the object it made is then removed, so that no part of the file is left under its name. (A process
    killed outright never completes its upload: nothing appears.)"""
    stream = fs.open_output_stream(path)
    try:
        with open(local, "rb") as src:
            while chunk := src.read(CHUNK):
                stream.write(chunk)
    except BaseException:
        with contextlib.suppress(Exception):
            stream.close()
            fs.delete_file(path)
        raise
    stream.close()


def require_writable(prefix: str | None, options: Mapping[str, Any] | None) -> None:
    """``check_writable``, for a run about to start (a run of steps, before any job).

    Raises:
        StorageError: ``prefix`` cannot take the upload, naming it and why.
    """
    if prefix and (why := check_writable(prefix, options)):
        raise StorageError(f"{why}; no job was started")


def check_writable(prefix: str, options: Mapping[str, Any] | None) -> str | None:
    """Why ``prefix`` cannot take the upload (None: it can): a test object written there and removed."""
    fs = filesystem(options)
    probe = path_of(prefix.rstrip("/") + "/.shardgen-preflight-probe")
    try:
        with fs.open_output_stream(probe) as f:
            f.write(b"shardgen preflight: may this run upload here?\n")
        fs.delete_file(probe)
    except OSError as e:
        return f"output.upload: cannot write under '{prefix}': {_first_line(e)}; {_hint(options)}"
    return None
