"""Write docs/env.md from rtckern/config.py: ``python tools/gen_env_doc.py`` (tests/unit/test_config.py checks it)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rtckern.config import env_doc  # noqa: E402

if __name__ == "__main__":
    (REPO / "docs" / "env.md").write_text(env_doc())
