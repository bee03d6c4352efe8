"""The strategy tests' shared fixtures are declared once, in ``tests/fixtures.py`` and ``tests/token_data.py``."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHARED = ("TokenData", "ValidatedTokenData", "TinyLlama", "TinyLlamaModule", "StrategyStepLlama", "Recorder")
OWNERS = {Path("fixtures.py"), Path("token_data.py")}
DECLARATION = re.compile(rf"^(?:class ({'|'.join(SHARED)})\b|(TINY_LLAMA|SMALL|SMALL_HEADS) = )", re.MULTILINE)


def redeclarations(root: Path) -> list[str]:
    """``path: name`` for every declaration of a shared fixture under ``root`` outside its owner modules."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative in OWNERS:
            continue
        found += [f"{relative}: {m.group(1) or m.group(2)}" for m in DECLARATION.finditer(path.read_text())]
    return found


def test_shared_fixtures_are_declared_once() -> None:
    assert not redeclarations(TESTS), "import these from tests.fixtures / tests.token_data instead"
