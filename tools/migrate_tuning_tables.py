"""Migrate tuning tables to the current format (rtckern.tuning.migrate): format 1 rows get the device class of the
GPU their `versions` name. Deterministic: running it twice changes nothing.

    python3 tools/migrate_tuning_tables.py [TABLE.json ...]   (default: every shipped table)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rtckern import tuning


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted(tuning.SHIPPED_DIR.glob("*.json"))
    for p in paths:
        text = p.read_text()
        new = json.dumps(tuning.migrate(json.loads(text)), indent=1) + "\n"
        tuning.parse_table(json.loads(new), p)  # refuse to write a table that would not load
        if new != text:
            p.write_text(new)
            print(f"migrated {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
