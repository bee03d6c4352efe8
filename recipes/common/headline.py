"""Shared writer of ``docs/results/headline.json``: each benchmark updates only its own section.

The headline file collects the few figures the README quotes (MatFormer, FlexDeMo, subspace). Benchmarks write it
themselves, never by hand: :func:`update_headline` reads the current file, replaces one section, stamps it with the
git revision and the UTC time, and atomically replaces the file (write to a temporary file in the same folder, then
``os.replace``), so concurrent writers of different sections never leave a half-written file. A lock on the
folder serialises the read-modify-write, so two benchmarks finishing at once do not drop each other's section.

    from headline import update_headline          # recipes/common/ is on sys.path when a recipe runs
    update_headline("matformer", {"params": 134515008, "mem_saving_of_analytic_pct": 99.7})
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HEADLINE = REPO / "docs" / "results" / "headline.json"


def git_revision(repo: Path = REPO) -> str:
    """The checkout's commit (``<sha>-dirty`` when tracked files differ from it), or ``"unknown"`` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=repo, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux; ``platform.processor()`` is empty there)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_metadata() -> dict[str, Any]:
    """Git revision, torch/transformers versions, machine and UTC time of a benchmark run (for its results.json)."""
    import platform

    import torch
    import transformers

    return {
        "git_revision": git_revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {cpu_model()}",
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def update_headline(
    section: str, values: dict[str, Any], path: Path = HEADLINE, revision: str | None = None
) -> dict[str, Any]:
    """Replace ``section`` of the headline JSON with ``values`` (+ ``git_revision``, ``updated_utc``), atomically.

    Other sections are kept as they are. ``revision`` is the git revision the figures were measured at (default:
    this checkout's, for a benchmark writing its own fresh results). Returns the whole document as written.

    Raises:
        ValueError: ``section`` is empty, or ``values`` is not a dict of JSON-serialisable values.
    """
    if not section or not isinstance(section, str):
        raise ValueError(f"section must be a non-empty string such as 'matformer', got {section!r}.")
    if not isinstance(values, dict):
        raise ValueError(f"values must be a dict of figures, got {type(values).__name__}.")
    entry = {
        **values,
        "git_revision": revision or git_revision(),
        "updated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    json.dumps(entry)  # fail before touching the file if a value is not JSON-serialisable
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)  # lock the folder itself: no lock file left behind
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # serialise read-modify-write between benchmarks finishing together
        document = json.loads(path.read_text()) if path.is_file() else {}
        document[section] = entry
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as stream:
            stream.write(json.dumps(document, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)
    finally:
        os.close(folder)  # also releases the lock
    return document
