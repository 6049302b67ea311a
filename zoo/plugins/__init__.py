"""Plugin discovery.

Built-in and third-party plugins alike are modules named by an entry point in
the ``zoo.plugins`` group. ``ZOO_PLUGINS`` (comma-separated names) keeps only
those; ``plugins.disable`` in the config (or ``disable=`` here) drops some.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable

import pluggy

from zoo import hookspecs
from zoo.errors import ZooError

ENTRY_POINT_GROUP = "zoo.plugins"
hookimpl = pluggy.HookimplMarker("zoo")


def _origin(entry_point) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"distribution {dist.name} {dist.version}"


def plugin_entry_points() -> list:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def load_plugins(disable: Iterable[str] = (), extra: Iterable[object] = ()) -> pluggy.PluginManager:
    """Register every allowed entry-point plugin, then ``extra`` objects."""
    pm = pluggy.PluginManager("zoo")
    pm.add_hookspecs(hookspecs)
    allow = os.environ.get("ZOO_PLUGINS")
    allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
    disabled = set(disable)
    known = set()
    origins = pm.zoo_origins = {}  # plugin name -> (module, distribution), for listings and errors
    for ep in plugin_entry_points():
        known.add(ep.name)
        if ep.name in disabled or (allowed is not None and ep.name not in allowed):
            continue
        if pm.has_plugin(ep.name):
            continue  # the same distribution seen twice on sys.path
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
            raise ZooError(f"plugin {ep.name!r} ({ep.value}, from {_origin(ep)}) failed to import: "
                           f"{type(exc).__name__}: {exc}") from None
        _register(pm, module, ep.name, f"{ep.value}, from {_origin(ep)}")
        origins[ep.name] = (ep.value, _origin(ep))
    for name in sorted((allowed or set()) - known):
        raise ZooError(f"ZOO_PLUGINS names {name!r}, but no installed package provides a zoo plugin of that "
                       f"name (known: {', '.join(sorted(known))})")
    for obj in extra:
        _register(pm, obj, getattr(obj, "name", None) or type(obj).__name__, "passed in by the caller")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin)
        module, dist = origins.get(name, ("", "passed in by the caller"))
        raise ZooError(f"plugin {name!r} ({module}, from {dist}) is invalid: {exc}") from None
    return pm


def _register(pm: pluggy.PluginManager, plugin: object, name: str, origin: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise ZooError(f"plugin {name!r} ({origin}) is invalid: {exc}") from None
    except ValueError as exc:
        raise ZooError(f"plugin {name!r} ({origin}) could not be registered: {exc}") from None


def describe_plugins(pm: pluggy.PluginManager) -> list[dict]:
    """One row per registered plugin: name, module, distribution, hooks."""
    origins = getattr(pm, "zoo_origins", {})
    rows = []
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        hooks = sorted(
            hook.name for hook in pm.get_hookcallers(plugin) or []
        )
        module, dist = origins.get(name, (getattr(plugin, "__name__", repr(plugin)), "passed in by the caller"))
        rows.append({"name": name, "module": module, "distribution": dist, "hooks": hooks})
    return rows
