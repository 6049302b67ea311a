"""``python -m zoo.plugins [OVERRIDES...]``: every plugin, and whether it takes part in that run and why.

    python -m zoo.plugins                        # the default config (embedded Llama)
    python -m zoo.plugins model=gpt2
    python -m zoo.plugins model=qwen2_vl model.path=/ckpt/Qwen2-VL-2B
    python -m zoo.plugins +adapters.sql=/adapters/sql   # also lists the adapters: type, rank, targets
"""

import sys

from zoo.errors import ZooError


def main(argv: list[str]) -> int:
    from zoo.config import compose_config
    from zoo.loader import open_checkpoint
    from zoo.plugins import describe_plugins, load_plugins, plan_plugins

    try:
        config = compose_config(argv)
        pm = load_plugins(disable=config["plugins"]["disable"] or ())
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        architecture = open_checkpoint(config["model"], pm).description.architecture
        print(f"model: {architecture}")
    except ZooError as exc:
        architecture = None
        print(f"model: unknown ({exc})")
    print(f"decoding: {config['decoding']['name']}  processor: {config['processor']['name']}\n")
    try:
        statuses = {row.name: row for row in plan_plugins(pm, config, architecture)}
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    details = {row["name"]: row for row in describe_plugins(pm)}
    for name, status in statuses.items():
        print(f"{name}: {'ACTIVE' if status.active else 'inactive'} ({status.reason})")
        row = details.get(name)
        if row:
            print(f"  module: {row['module']}\n  from: {row['distribution']}\n"
                  f"  hooks: {', '.join(row['hooks']) or '(none)'}")
    adapters = config.get("adapters") or {}
    if adapters:
        from zoo.adapters import describe_folder

        print("\nadapters:")
        for name in adapters:
            print(f"  {name}: {describe_folder(adapters[name])} ({adapters[name]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
