"""``python -m zoo.plugins``: list every registered plugin and its hooks."""

import sys

from zoo.errors import ZooError
from zoo.plugins import describe_plugins, load_plugins


def main() -> int:
    try:
        pm = load_plugins()
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in describe_plugins(pm):
        print(f"{row['name']}\n  module: {row['module']}\n  from: {row['distribution']}\n"
              f"  hooks: {', '.join(row['hooks']) or '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
