"""Composing the run config from ``conf/`` (the CLI and ``zoo.LLM`` share this)."""

from __future__ import annotations

import re
import sys

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.errors import EXIT_BAD_SETTING, ZooError
from zoo.plugins import load_plugins

CONFIG_MODULE = "zoo_conf"
_registered = False


def register_plugin_configs() -> None:
    """Let every plugin add options to config groups (once per process)."""
    global _registered
    if not _registered:
        load_plugins().hook.zoo_config_register(config_store=ConfigStore.instance())
        _registered = True


def compose_config(overrides: list[str] = (), name: str = "config") -> DictConfig:
    """A primary config of ``conf/`` (``config`` for zoo.run, ``train``, ``pretrain``) with overrides."""
    register_plugin_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            return compose(config_name=name, overrides=list(overrides))
    except MissingConfigException as exc:
        if exc.options is None:
            raise ZooError(f"bad config override: {exc}") from None
        group, _, option = str(exc.missing_cfg_file).rpartition("/")
        raise ZooError(f"{group}={option}: no such option (available: {', '.join(exc.options)})") from None
    except (HydraException, OmegaConfBaseException) as exc:
        unknown = re.match(r"Could not override '([\w.]+)'", str(exc))
        if unknown:  # a key the config may not have: name the nearest one that it does
            from omegaconf import OmegaConf

            from zoo.settings import suggest

            base, key = compose_config([], name), unknown.group(1)
            section, _, leaf = key.rpartition(".")
            node = OmegaConf.select(base, section) if section else base
            if not (hasattr(node, "keys") and leaf in node):
                raise ZooError(suggest(key, base)) from None
        raise ZooError("bad config override: " + " ".join(str(exc).split())) from None


def check_overrides(argv: list[str], name: str) -> None:
    """The command line's overrides compose (Hydra would print its search path or a stack-trace hint, exit 1):
    all of them for a single run, the ``group=option`` ones for a sweep (``-m``), whose values hold commas."""
    overrides = [a for a in argv if not a.startswith("-")]
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return  # --cfg, --help, --info...: Hydra's own
    if "-m" in argv or "--multirun" in argv:
        groups = {"model", "decoding", "runtime", "processor", "experiment"}
        overrides = [a for a in overrides if "=" in a and a.split("=", 1)[0] in groups and "," not in a]
    if overrides:
        compose_config(overrides, name)


def to_plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


FREE_TEXT_KEYS = ("prompt",)  # values people type as plain text: `prompt="def main():"` must just work


def quote_free_text(argv: list[str]) -> list[str]:
    """Quote free-text values for Hydra's override grammar, which reads ``(``, ``:``, ``[`` and such."""
    quoted = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in FREE_TEXT_KEYS and not (value[:1] in "'\"" and value[-1:] == value[:1]
                                                                and len(value) > 1):
            # Hydra's quoted strings escape quotes and the backslashes right before them.
            escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
            escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped).replace("${", "\\${")  # no interpolation
            arg = f"{key}='{escaped}'"
        quoted.append(arg)
    return quoted


def cli_main(hydra_main, name: str = "config") -> None:
    """A command's entry: free text quoted, overrides checked (one line and exit 2 if bad), then Hydra."""
    sys.argv[1:] = quote_free_text(sys.argv[1:])
    exit_on_error(lambda: (register_plugin_configs(), check_overrides(sys.argv[1:], name)))
    hydra_main()


def exit_on_error(call):
    """``call()``'s result; a ZooError becomes one ``error:`` line on stderr and exit status 2
    (``EXIT_BAD_SETTING``)."""
    try:
        return call()
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_SETTING)
