"""Plugin discovery, and the choice of which plugins take part in a run.

Built-in and third-party plugins alike are modules named by an entry point in
the ``zoo.plugins`` group. ``ZOO_PLUGINS`` (comma-separated names) keeps only
those; ``plugins.disable`` in the config (or ``disable=`` here) drops some.

Which of the loaded plugins take part is decided once, when the engine knows
its config and the checkpoint's architecture (:func:`select_plugins`); the
others are unregistered, so no hook implementation has to ask "is this mine?":

- a plugin that registers architectures (``zoo_model_architectures``) takes
  part only for a checkpoint of one of them;
- a plugin with ``zoo_scope = Scope(option="decoding=eagle")`` only when that
  config option is chosen, ``Scope(config_key="adapters")`` only when that key
  is set and not empty, ``Scope(on_demand=True)`` only when a plugin that takes
  part ``requires`` it;
- any other plugin always.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable
from dataclasses import dataclass

import pluggy

from zoo import hookspecs
from zoo.errors import ZooError

ENTRY_POINT_GROUP = "zoo.plugins"
hookimpl = pluggy.HookimplMarker("zoo")


@dataclass(frozen=True)
class Scope:
    """When a feature plugin takes part; a plugin module sets ``zoo_scope = Scope(...)``.

    Conditions given together must all hold. ``requires`` names plugins that must
    take part whenever this one does (a missing or disabled one is an error at start).
    """

    option: str | None = None  # "group=name": that config group option is chosen
    config_key: str | None = None  # a dotted config key that is set and not empty
    on_demand: bool = False  # only when a plugin that takes part requires it
    requires: tuple[str, ...] = ()


@dataclass
class PluginStatus:
    name: str
    active: bool
    reason: str
    request_fields: tuple[str, ...] = ()  # what it reads from requests (zoo_request_fields), active or not
    decoding_methods: tuple[str, ...] = ()  # what it registers (zoo_decoding_methods), active or not


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
    pm.zoo_left_out = {}  # plugin name -> why it was not loaded
    for ep in plugin_entry_points():
        known.add(ep.name)
        if ep.name in disabled or (allowed is not None and ep.name not in allowed):
            pm.zoo_left_out[ep.name] = "disabled (plugins.disable)" if ep.name in disabled else "not in ZOO_PLUGINS"
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
    for name in sorted(disabled - known):
        import difflib

        close = difflib.get_close_matches(name, sorted(known), n=1)
        raise ZooError(f"plugins.disable names {name!r}, which is no installed plugin"
                       + (f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(known))})"))
    for obj in extra:
        name = getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__
        _register(pm, obj, name, "passed in by the caller")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin)
        module, dist = origins.get(name, ("", "passed in by the caller"))
        raise ZooError(f"plugin {name!r} ({module}, from {dist}) is invalid: {exc}") from None
    return pm


def left_out_note(pm: pluggy.PluginManager) -> str:
    """``; left out: eagle (disabled (plugins.disable))`` when some installed plugins were not loaded: an
    error about something no plugin provides names them, since one of them may be what the run needs."""
    left = getattr(pm, "zoo_left_out", {})
    return f"; left out: {', '.join(f'{n} ({why})' for n, why in sorted(left.items()))}" if left else ""


def _register(pm: pluggy.PluginManager, plugin: object, name: str, origin: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise ZooError(f"plugin {name!r} ({origin}) is invalid: {exc}") from None
    except ValueError as exc:
        raise ZooError(f"plugin {name!r} ({origin}) could not be registered: {exc}") from None


def registered_names(hook_caller, what: str) -> dict[str, tuple[str, object]]:
    """``{name: (plugin name, value)}`` from a hook whose implementations return dicts; a name twice is an error."""
    owners: dict[str, tuple[str, object]] = {}
    for impl in hook_caller.get_hookimpls():
        for name, value in (impl.function() or {}).items():
            if name in owners:
                raise ZooError(f"plugins {owners[name][0]!r} and {impl.plugin_name!r} both register {what} {name!r}")
            owners[name] = (impl.plugin_name, value)
    return owners


def architecture_owners(pm: pluggy.PluginManager) -> dict[str, tuple[str, object]]:
    """``{HF architecture: (plugin name, describe)}`` over every loaded plugin."""
    return registered_names(pm.hook.zoo_model_architectures, "architecture")


def _config_value(config, dotted: str):
    node = config
    for part in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return None
        node = node.get(part)
    return node


def _own_verdict(scope: Scope | None, claimed: list[str], config, architecture: str | None) -> tuple[bool, str]:
    """Whether a plugin takes part on its own account (before ``requires``), and why."""
    if claimed:
        if architecture in claimed:
            return True, f"the checkpoint's architecture {architecture} is one it registers"
        return False, f"registers {', '.join(sorted(claimed))}; the checkpoint is {architecture or 'unknown'}"
    if scope is None:
        return True, "no scope declared: always takes part"
    reasons = []
    if scope.option:
        group, _, option = scope.option.partition("=")
        chosen = _config_value(config, f"{group}.name")
        if chosen != option:
            return False, f"needs {scope.option}; {group}={chosen} is chosen"
        reasons.append(f"{scope.option} is chosen")
    if scope.config_key:
        if not _config_value(config, scope.config_key):
            return False, f"needs {scope.config_key} to be set"
        reasons.append(f"{scope.config_key} is set")
    if scope.on_demand:
        return False, "takes part only when a plugin that takes part requires it"
    return True, "; ".join(reasons) or "its scope sets no condition"


def plan_plugins(pm: pluggy.PluginManager, config, architecture: str | None) -> list[PluginStatus]:
    """Which loaded plugins take part in a run of ``config`` on ``architecture``, and why."""
    claimed: dict[str, list[str]] = {}
    for arch, (owner, _) in architecture_owners(pm).items():
        claimed.setdefault(owner, []).append(arch)
    plugins = dict(pm.list_name_plugin())
    scopes = {name: getattr(plugin, "zoo_scope", None) for name, plugin in plugins.items()}
    verdicts = {name: _own_verdict(scopes[name], claimed.get(name, []), config, architecture) for name in plugins}
    pending = [name for name, (active, _) in verdicts.items() if active]
    while pending:  # switch on what the active plugins require, and what those require
        name = pending.pop()
        for needed in (scopes[name].requires if scopes[name] else ()):
            if needed not in plugins:
                why = getattr(pm, "zoo_left_out", {}).get(needed, "not installed")
                raise ZooError(f"plugin {name!r} needs plugin {needed!r}, which is {why}")
            if not verdicts[needed][0]:
                verdicts[needed] = (True, f"required by {name}")
                pending.append(needed)
    rows = [PluginStatus(name, *verdicts[name], tuple(_hook_result(plugins[name], "zoo_request_fields")),
                         tuple(_hook_result(plugins[name], "zoo_decoding_methods")))
            for name in sorted(plugins)]
    rows += [PluginStatus(name, False, why) for name, why in sorted(getattr(pm, "zoo_left_out", {}).items())]
    return rows


def _hook_result(plugin, hook_name: str) -> list[str]:
    """What a registration-style hook of one plugin returns (names only), whether it takes part or not."""
    hook = getattr(plugin, hook_name, None)
    return list(hook() or []) if callable(hook) else []


def select_plugins(pm: pluggy.PluginManager, config, architecture: str | None) -> list[PluginStatus]:
    """Unregister the plugins that do not take part; returns every plugin's status."""
    rows = plan_plugins(pm, config, architecture)
    for row in rows:
        if not row.active and pm.has_plugin(row.name):
            pm.unregister(name=row.name)
    return rows


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
