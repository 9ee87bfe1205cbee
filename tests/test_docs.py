"""The configuration reference in docs/ is generated from the settings classes and must
match them, so a new or renamed setting cannot leave the docs behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_doc_matches_the_settings_classes():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "settings_table.py")],
        capture_output=True, text=True, check=True,
    ).stdout
    documented = (ROOT / "docs" / "configuration.md").read_text()
    assert documented == generated, (
        "docs/configuration.md is stale: run "
        "`python scripts/settings_table.py > docs/configuration.md`"
    )
