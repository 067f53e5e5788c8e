"""Choosing protocols, LR policies (and transports) by name.

Built-in names come from a table; third parties register entry points in the groups
``rudra_async.protocols`` and ``rudra_async.lr_policies``; ``module:attr`` loads anything
else. An unknown name fails with the list of known ones. Whatever a name resolves to must
be a class (or factory) producing a :class:`~rudra_async.sync.SyncProtocol` or
:class:`~rudra_async.lr.LRPolicy`; this is checked at load time with an error naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .errors import ConfigError


def entry_points(group: str, name: str | None = None) -> Any:
    """The installed entry points of ``group`` (``importlib.metadata``, imported here: it loads
    ``email`` and with it ``socket``, which importing the I/O-free core must not)."""
    from importlib import metadata

    found = metadata.entry_points(group=group)
    return found if name is None else found.select(name=name)


PROTOCOLS = {
    "async": "rudra_async.sync:Async",
    "softsync": "rudra_async.sync:Softsync",
    "adaptive": "rudra_async.sync:AdaptiveSoftsync",
    "hardsync": "rudra_async.sync:Hardsync",
    "bounded": "rudra_async.sync:Bounded",
    "backup": "rudra_async.sync:Backup",
}
LR_POLICIES = {
    "compensated": "rudra_async.lr:Compensated",
    "constant": "rudra_async.lr:Constant",
    "staleness": "rudra_async.lr:Staleness",
    "staleness-plus-one": "rudra_async.lr:StalenessPlusOne",
    "mean-staleness": "rudra_async.lr:MeanStaleness",
}
GROUPS = {"protocol": ("rudra_async.protocols", PROTOCOLS), "lr policy": ("rudra_async.lr_policies", LR_POLICIES)}


def _import(path: str, kind: str, name: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {kind} {name!r} from {path!r}: {exc}") from None


def known(kind: str) -> list[str]:
    group, table = GROUPS[kind]
    return sorted(set(table) | {ep.name for ep in entry_points(group=group)})


def load_entry_point(group: str, name: str, kind: str) -> Any | None:
    """The object registered as ``name`` in an entry-point group, or None; a plugin that
    fails to import is a ConfigError naming its distribution."""
    for ep in entry_points(group=group, name=name):
        try:
            return ep.load()
        except Exception as exc:
            dist = ep.dist.name if ep.dist else "?"
            raise ConfigError(f"{kind} plugin {name!r} from {dist} failed to load: {exc}") from None
    return None


def resolve(kind: str, name: str) -> Callable[..., Any]:
    """The class registered as ``name`` for ``kind`` ('protocol' or 'lr policy')."""
    group, table = GROUPS[kind]
    found: Callable[..., Any] | None = None
    if name in table:
        found = _import(table[name], kind, name)
    else:
        found = load_entry_point(group, name, kind)
        if found is None and ":" in name:
            found = _import(name, kind, name)
    if found is not None:
        return found
    raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(known(kind))} (or module:attr)")


def create(kind: str, name: str, options: dict[str, Any], base: type) -> Any:
    """Instantiate ``name`` with ``options``; check it is a ``base``. Errors name the plugin."""
    cls = resolve(kind, name)
    try:
        obj = cls(**options)
    except TypeError as exc:
        raise ConfigError(f"{kind} {name!r} rejected its options {options}: {exc}") from None
    if not isinstance(obj, base):
        raise ConfigError(f"{kind} {name!r} is not a {base.__module__}.{base.__qualname__}")
    return obj
