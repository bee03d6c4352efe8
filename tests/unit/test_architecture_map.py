"""docs/architecture.md's file map names every module of the package under its own folder, so it stays true to the
code: a new module without a line there fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lightning_hetero"
HEADER = re.compile(r"^      (\S+/)(?:\s|$)")  # a folder's first line in the map: six spaces, then "name/"


def _map_blocks() -> dict[str, str]:
    """Folder (relative to the package, e.g. ``strategies/matformer/``) -> the text of its lines in the map."""
    text = (REPO / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout") : text.index("## The shared strategy lifecycle")]
    blocks: dict[str, str] = {"": ""}
    current: str | None = None  # None: lines outside the package (recipes/, configs/ ...)
    for line in layout.splitlines():
        header = HEADER.match(line)
        if header:
            current = header.group(1)
            blocks[current] = blocks.get(current, "") + line
        elif line.startswith("       "):  # a continuation line
            if current is not None:
                blocks[current] += " " + line.strip()
        elif line.startswith("      ") and not line.startswith("      ---"):
            current = ""  # a top-level file line (``__init__.py, fabric.py ...``)
            blocks[""] += " " + line
        elif line.startswith("    ") and not line.startswith("      "):
            current = None
    return blocks


def test_every_module_is_in_the_map_under_its_folder() -> None:
    blocks = _map_blocks()
    missing = []
    for module in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in module.parts or module.name == "__init__.py" and module.parent != PACKAGE:
            continue
        folder = module.parent.relative_to(PACKAGE).as_posix()
        folder = f"{folder}/" if folder != "." else ""
        if folder not in blocks or not re.search(rf"(?<![\w/]){re.escape(module.name)}\b", blocks[folder]):
            missing.append(f"{folder}{module.name}")
    assert not missing, f"docs/architecture.md's Layout does not name: {missing}"


def test_the_map_names_no_module_that_is_gone() -> None:
    blocks = _map_blocks()
    gone = []
    for folder, text in blocks.items():
        if folder and not (PACKAGE / folder).is_dir():
            gone.append(folder)
            continue
        for name in re.findall(r"(?<![\w/.])([a-z_]+\.py)\b", text):
            if not (PACKAGE / folder / name).exists():
                gone.append(f"{folder}{name}")
    assert not gone, f"docs/architecture.md's Layout names what does not exist: {gone}"
