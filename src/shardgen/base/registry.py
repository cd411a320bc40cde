"""Where features plug into the core: registries that the features fill when imported, and that import
them the first time they are read.

The core (config, sources, tasks, engine, formats) names no feature; each feature registers its kinds
and checks with the layers below it when its module is imported. ``import shardgen`` imports no feature
(the status check and the CLI's start stay light): the first read of any registry imports every module
of ``shardgen.FEATURES``, so every config is still checked, fingerprinted and run with every feature,
whoever reads it first.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import shardgen  # the package's list of features (shardgen.FEATURES); it imports none of them

_lock = threading.RLock()
_state = {"loaded": False, "loading": False}


def load_features() -> None:
    """Import every feature module (``shardgen.FEATURES``), once. A registry read while they are being
    imported (a feature reading another's registration) sees what is registered so far, as an import
    in that order would."""
    if _state["loaded"]:
        return
    with _lock:  # another thread waits until every feature is in
        if _state["loaded"] or _state["loading"]:  # loading: this thread, reading while it imports them
            return
        _state["loading"] = True
        try:
            for name in shardgen.FEATURES:
                importlib.import_module(f"shardgen.{name}")
        finally:
            _state["loading"] = False
        _state["loaded"] = True


def _load(features: tuple[str, ...] | None) -> None:
    if features is None:
        load_features()
    else:  # a registry only these features fill
        for name in features:
            importlib.import_module(f"shardgen.{name}")


class _LoadsOnRead:
    """Reading imports the features that fill it (every feature, or the ``features`` named: those that
    fill it, where its readers must stay light); registering does not."""

    def __init__(self, *args: Any, features: tuple[str, ...] | None = None) -> None:
        super().__init__(*args)
        self.features = features

    def __getitem__(self, key: Any) -> Any:
        _load(self.features)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        _load(self.features)
        return super().__contains__(key)

    def __iter__(self):
        _load(self.features)
        return super().__iter__()

    def __len__(self) -> int:
        _load(self.features)
        return super().__len__()

    def __repr__(self) -> str:
        _load(self.features)
        return super().__repr__()


class Registry(_LoadsOnRead, dict):
    """A name -> kind registry (``_LoadsOnRead``)."""

    def get(self, key: Any, default: Any = None) -> Any:
        _load(self.features)
        return super().get(key, default)

    def keys(self):
        _load(self.features)
        return super().keys()

    def values(self):
        _load(self.features)
        return super().values()

    def items(self):
        _load(self.features)
        return super().items()


class Hooks(_LoadsOnRead, list):
    """A list of hooks, checks or resolvers (``_LoadsOnRead``), read in the order of ``shardgen.FEATURES``
    (the core's own first, then each feature's in the order it registered them), whichever feature was
    imported first: a config with two mistakes is told the same one in every process."""

    def _ordered(self) -> list[Any]:
        rank = {f"shardgen.{name}": i for i, name in enumerate(shardgen.FEATURES)}
        return sorted(list.__iter__(self), key=lambda hook: rank.get(getattr(hook, "__module__", ""), -1))

    def __iter__(self):
        _load(self.features)
        return iter(self._ordered())

    def __getitem__(self, index: Any) -> Any:
        _load(self.features)
        return self._ordered()[index]
