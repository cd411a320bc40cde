"""The user's Python that a config names: a function by ``path`` (a file) or ``module``, and ``name``.

A Python step's function (``function``) and a rollout's tools (``rollout.tools``) are named the same
way. ``load`` imports one here (its module's code runs) and names the key, file and line of whatever
fails; ``digest`` is what identifies its code in a run's fingerprint, read without running it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shardgen.errors import ConfigError


def describe(spec: Mapping[str, Any]) -> str:
    """``<file or module>:<name>``, as messages name the function."""
    return f"{spec.get('path') or spec.get('module')}:{spec['name']}"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 500 characters)."""
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else ""


def _module_file(module: str, key: str) -> Path:
    """The file of a module, found without running it (its parent packages do run).

    Raises:
        ConfigError: no such module.
    """
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{key}.module: {module!r} cannot be found: {type(e).__name__}: {e}") from e
    if found is None or not found.origin or not Path(found.origin).is_file():
        raise ConfigError(f"{key}.module: no module {module!r} is importable here (is its package installed?)")
    return Path(found.origin)


def digest(spec: Mapping[str, Any], key: str) -> dict[str, Any]:
    """What identifies the function's code: the SHA-256 of its file, and for a ``module`` the version of
    the distribution that installs it (None for a module of no distribution).

    Raises:
        ConfigError: the file or module is not there (naming ``key``).
    """
    if spec.get("path"):
        path = Path(spec["path"])
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{key}.path: cannot read {path}: {e.strerror or e}") from e
        return {"file_sha256": hashlib.sha256(data).hexdigest()}
    module = spec["module"]
    data = _module_file(module, key).read_bytes()
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top) or []
    version = importlib.metadata.version(dists[0]) if dists else None
    return {"file_sha256": hashlib.sha256(data).hexdigest(), "distribution": dists[0] if dists else None,
            "version": version}  # fmt: skip


def _import_error(e: BaseException, where: str, file: Path | None, key: str) -> ConfigError:
    """A ConfigError for an import that failed, naming the file and line where it failed."""
    if isinstance(e, SyntaxError):
        return ConfigError(f"{key}: {e.filename or where}, line {e.lineno}: syntax error: {e.msg}")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if file is None or Path(f.filename) == file]
    at = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else where
    return ConfigError(f"{key}: importing {where} failed at {at}: {type(e).__name__}: {first_line(e)}")


def load(spec: Mapping[str, Any], key: str) -> Callable[..., Any]:
    """The function ``spec`` names, imported here (its module's code runs).

    Raises:
        ConfigError: naming ``key``: the file is missing or does not import (with file and line), the
            name is not defined there, or is not callable.
    """
    name = spec["name"]
    if spec.get("path"):
        path = Path(spec["path"])
        if not path.is_file():
            raise ConfigError(f"{key}.path: {path} is not a file")
        module_name = "shardgen_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError(f"{key}.path: {path} is not a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # its functions pickle by reference, like any module's
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise _import_error(e, str(path), path, key) from e
        where = str(path)
    else:
        where = spec["module"]
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise _import_error(e, where, None, key) from e
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ConfigError(f"{key}.name: {where} defines no {name!r} (its functions: {', '.join(defined) or 'none'})")
    if not callable(fn):
        raise ConfigError(f"{key}.name: {name!r} in {where} is a {type(fn).__name__}, not a function")
    return fn


def line_of(fn: Any) -> Any:
    """The line a function is defined on, for messages ('?' when it has none)."""
    return getattr(getattr(fn, "__code__", None), "co_firstlineno", "?")


def sections(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The config and each of its steps: where a section that names code (``function``, ``rollout``) may be."""
    return [s for s in [config, *(config.get("steps") or [])] if isinstance(s, dict)]  # type: ignore[list-item]


def resolve_path(spec: Any, base: Path) -> None:
    """A spec's ``path`` (``~`` expanded) relative to ``base``, the config file's directory, made absolute."""
    if isinstance(spec, dict) and isinstance(spec.get("path"), str):
        path = Path(os.path.expanduser(spec["path"]))
        spec["path"] = str(path if path.is_absolute() else base / path)
