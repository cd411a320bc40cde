"""Files shardgen writes: atomically, with the process's umask, and never through a symlink below the output directory.

Every write goes to a temporary file in the target's directory, is synced,
and is renamed onto the target, so a reader sees the old file or the whole
new one, never a part. Files are created with ``os.open`` and mode 0666, so
the kernel applies the umask (the CLI narrows it once at start, see
``restrict_umask``); nothing changes the umask or a file's mode afterwards.

``Dir`` holds an open directory descriptor and does everything relative to
it (create, read, rename, remove), so a symlink swapped in after the
directory was opened cannot redirect a write or a delete. ``Dir.open(path,
below=root)`` refuses a symlink at any component of ``path`` below ``root``:
the checkpoint and shard directories of a run stay inside its output
directory even when something else was linked there.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from shardgen.errors import ShardgenError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW


class UnsafePath(ShardgenError):
    """A directory below the output directory is a symlink (or not a directory)."""


def current_umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: the one way left to read it
    os.umask(mask)
    return mask


def restrict_umask(world_readable: bool) -> int:
    """Once, at the start of a command (and of a workflow run, in its Snakefile): files that shardgen,
    the libraries it calls and the commands it starts create get no permissions for other users unless
    ``world_readable``. Returns the umask now in force."""
    mask = current_umask()
    if not world_readable:
        mask |= 0o007
        os.umask(mask)
    return mask


class Dir:
    """An open directory; names are resolved relative to its descriptor, never following a symlink."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: str | Path, *, below: str | Path | None = None, create: bool = True) -> Dir:
        """Open ``path`` (creating missing directories when ``create``).

        Components of ``path`` that lie below ``below`` must be real
        directories, not symlinks; ``below`` itself, and paths outside it, are
        opened as the system resolves them.

        Raises:
            UnsafePath: a component below ``below`` is a symlink or a file.
        """
        path = Path(path)
        root = Path(below) if below is not None else None
        rel: tuple[str, ...] = ()
        if root is not None:
            try:
                rel = Path(os.path.normpath(path.absolute())).relative_to(os.path.normpath(root.absolute())).parts
            except ValueError:
                root = None
        if root is None:
            if create:
                path.mkdir(parents=True, exist_ok=True)
            return cls(os.open(path, _DIR_FLAGS), path)
        if create:
            root.mkdir(parents=True, exist_ok=True)
        d = cls(os.open(root, _DIR_FLAGS), root)
        for part in rel:
            try:
                nxt = d.sub(part, create=create)
            finally:
                d.close()
            d = nxt
        return d

    def sub(self, name: str, create: bool = True) -> Dir:
        """The subdirectory ``name``, created if missing; a symlink there is refused."""
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            if os.path.islink(self.path / name) or not os.path.isdir(self.path / name):
                raise UnsafePath(
                    f"'{self.path / name}' is a symlink or not a directory; shardgen keeps its files in real "
                    "directories below output.dir (to put them on another file system, point output.dir itself "
                    "there)"
                ) from e
            raise
        return Dir(fd, self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def is_file(self, name: str) -> bool:
        import stat

        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    @contextmanager
    def open_read(self, name: str) -> Iterator[IO[bytes]]:
        """A regular file of this directory for reading (a symlink is refused)."""
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            yield f

    def read_text(self, name: str) -> str:
        with self.open_read(name) as f:
            return f.read().decode()

    def write_atomic(self, name: str, write: Callable[[IO[bytes]], None]) -> None:
        """Call ``write(file)`` on a new temporary file here, sync it, and rename it onto ``name``."""
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, 0o666, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        os.fsync(self.fd)  # the rename itself survives a crash

    def remove_leftovers(self, name: str) -> list[str]:
        """Remove what a writer of ``name`` killed mid-write left here: its temporary files
        (``write_atomic``), the old copy a directory swap set aside (``replace_dir``) and the working
        directories of a ``datasets`` output; for the one writer of ``name`` to call before it writes.
        Returns the names removed."""
        pattern = re.compile(rf"\.{re.escape(name)}\.([0-9a-f]{{8}}\.(tmp|old)|[a-z0-9_]{{8}})")
        removed = []
        for entry in os.scandir(self.fd):
            if pattern.fullmatch(entry.name):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(os.path.join(self.path, entry.name), ignore_errors=True)
                else:
                    os.unlink(entry.name, dir_fd=self.fd)
                removed.append(entry.name)
        return removed

    def append_line(self, name: str, line: str) -> None:
        """Append one whole line, or fail loudly.

        One ``write`` keeps lines whole when the process dies. A short write (a full disk) leaves a cut
        line: it is raised as ``OSError``, and the next append first ends the cut line, so that only it
        is lost, never the line after it (readers skip lines that do not parse).
        """
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | _NOFOLLOW, 0o666, dir_fd=self.fd)
        try:
            data = (line.rstrip("\n") + "\n").encode()
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # the line before was cut
            write_all(fd, data)
        finally:
            os.close(fd)

    def create_exclusive(self, name: str, data: bytes, keep: bool = False) -> bool:
        """Create ``name`` holding ``data`` unless it exists: True for the one caller that created it,
        however many race (``O_EXCL``, atomic on local file systems and on NFSv3 and later).

        When writing ``data`` fails (a full disk) the error is raised and the file removed (a claim
        file would read as someone else's; nobody has it then), unless ``keep``: a file whose name is
        what counts (a cut), which others may have seen already."""
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, 0o666, dir_fd=self.fd)
        except FileExistsError:
            return False
        try:
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            if not keep:
                self.unlink(name)
            raise
        os.close(fd)
        return True

    def touch(self, name: str) -> float:
        """Set ``name``'s modification time to now, as the file system's clock has it (on NFS, the
        server's: a time of None is sent as "set to server time"); return that time.

        Raises:
            FileNotFoundError: ``name`` is gone.
        """
        os.utime(name, None, dir_fd=self.fd, follow_symlinks=False)
        return self.mtime(name)

    def mtime(self, name: str) -> float:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime

    def move(self, name: str, dest: Dir, new_name: str | None = None) -> None:
        os.rename(name, new_name or name, src_dir_fd=self.fd, dst_dir_fd=dest.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def rmdir(self, name: str) -> bool:
        """Remove the subdirectory ``name`` if it is empty; False when it is not (or is gone)."""
        try:
            os.rmdir(name, dir_fd=self.fd)
            return True
        except OSError:
            return False


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written: a write may write less than asked (a full disk, a
    signal), and only a write of nothing raises.

    Raises:
        OSError: the file system took only part of ``data`` (ENOSPC when it said why).
    """
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"wrote {len(data) - len(view)} of {len(data)} bytes")
        view = view[n:]


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, path: Path) -> None:
    """Put the finished directory ``new`` at ``path``, replacing what is there.

    With a directory already at ``path`` the two are swapped in one step, so
    a reader sees the old directory or the new one, whole (where the file
    system cannot swap, the old one is renamed aside first: ``path`` is then
    missing for a moment, never partly written). The old content ends up at
    ``new`` and is removed.
    """
    import shutil

    if not path.exists():
        new.rename(path)
        return
    if not _exchange(new, path):
        aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
        path.rename(aside)
        new.rename(path)
        new = aside
    shutil.rmtree(new)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], below: str | Path | None = None) -> None:
    """Write ``path`` atomically: ``write(file)`` fills a temporary file beside it, renamed into place.

    Args:
        below: the output directory, when ``path`` is inside it: no directory
            between the two may be a symlink (``Dir.open``).
    """
    path = Path(path)
    with Dir.open(path.parent, below=below) as d:
        d.write_atomic(path.name, write)


def atomic_write_text(path: str | Path, text: str, below: str | Path | None = None) -> None:
    atomic_write(path, lambda f: f.write(text.encode()), below)


class LazyDir:
    """A directory of the run opened (``Dir.open``, created) on first use, and closed by ``close``."""

    def __init__(self, path: str | Path, below: str | Path | None = None) -> None:
        self.path, self.below = Path(path), below
        self._dir: Dir | None = None

    @property
    def dir(self) -> Dir:
        if self._dir is None:
            self._dir = Dir.open(self.path, below=self.below)
        return self._dir

    def close(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
