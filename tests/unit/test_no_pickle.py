"""Nothing in the package (or the recipes and scripts) unpickles data: a repo-wide guard, by syntax tree.

Peer bytes are decoded by explicit codecs, checkpoints load with ``torch.load(..., weights_only=True)`` and exported
weights are safetensors. This test walks every module and fails on any call that could run a pickle:

- ``torch.load`` without ``weights_only=True`` (a missing keyword relies on torch's default, which older versions
  set to False);
- ``pickle`` / ``cPickle`` / ``dill`` / ``cloudpickle`` ``load``, ``loads`` or ``Unpickler``; ``marshal.load(s)``,
  ``shelve.open``, ``joblib.load``, ``pandas.read_pickle``;
- ``numpy.load(..., allow_pickle=True)``;
- ``yaml.load`` without a safe loader, ``yaml.unsafe_load`` / ``full_load``.

A use that is truly needed goes into :data:`ALLOWED` with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("lightning_hetero", "recipes", "scripts")

ALLOWED: dict[tuple[str, str], str] = {
    ("lightning_hetero/testing/multiprocess.py", "pickle.loads"): (
        "run_distributed's parent reads the return value of the test function from the ranks it spawned itself, "
        "over a multiprocessing queue (which pickles anyway); no peer or file data is involved"
    ),
}
"""(path, call) -> why it is safe."""

_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle"}
_UNSAFE_YAML_LOADERS = {"Loader", "UnsafeLoader", "FullLoader"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin for ``import x as y`` / ``from x import y as z``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def unsafe_calls(source: str) -> list[tuple[int, str, str]]:
    """``(line, call, why)`` of every call in ``source`` that may unpickle."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        module, _, attr = full.rpartition(".")
        why = ""
        if full == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            why = "torch.load without weights_only=True"
        elif module.split(".")[0] in _PICKLE_MODULES and attr in ("load", "loads", "Unpickler"):
            why = "unpickles"
        elif full in ("marshal.load", "marshal.loads", "shelve.open", "joblib.load", "pandas.read_pickle"):
            why = "unpickles (or unmarshals)"
        elif full in ("numpy.load", "np.load") and _is_true(_keyword(node, "allow_pickle")):
            why = "numpy.load with allow_pickle=True"
        elif full in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
            why = "yaml loader that constructs Python objects"
        elif full == "yaml.load":
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader).rpartition(".")[2] in _UNSAFE_YAML_LOADERS:
                why = "yaml.load without a safe loader"
        if why:
            found.append((node.lineno, full, why))
    return found


def _modules() -> list[Path]:
    return sorted(p for folder in SCANNED if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py"))


def test_the_package_never_unpickles():
    offences = []
    for path in _modules():
        relative = path.relative_to(ROOT).as_posix()
        for line, call, why in unsafe_calls(path.read_text(encoding="utf-8")):
            if (relative, call) not in ALLOWED:
                offences.append(f"{relative}:{line}: {call} ({why})")
    assert not offences, "Unpickling calls (use weights_only=True, safetensors or an explicit codec):\n" + "\n".join(
        offences
    )


def test_every_allow_list_entry_is_still_needed():
    used = {
        (path.relative_to(ROOT).as_posix(), call)
        for path in _modules()
        for _, call, _ in unsafe_calls(path.read_text(encoding="utf-8"))
    }
    assert set(ALLOWED) <= used, f"stale allow-list entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("import torch\ntorch.load(f)", True),
        ("import torch\ntorch.load(f, weights_only=False)", True),
        ("import torch\ntorch.load(f, map_location='cpu', weights_only=True)", False),
        ("from torch import load\nload(f)", True),
        ("import torch as t\nt.load(f, weights_only=True)", False),
        ("import pickle\npickle.loads(b)", True),
        ("from pickle import Unpickler\nUnpickler(f)", True),
        ("import dill\ndill.load(f)", True),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", True),
        ("import numpy as np\nnp.load(f)", False),
        ("import numpy as np\nnp.loadtxt(f)", False),
        ("import yaml\nyaml.load(s)", True),
        ("import yaml\nyaml.load(s, Loader=yaml.SafeLoader)", False),
        ("import yaml\nyaml.safe_load(s)", False),
        ("import marshal\nmarshal.loads(b)", True),
        ("import json\njson.loads(s)", False),
        ("import pickle\npickle.dumps(x)", False),
    ],
)
def test_the_guard_catches_what_it_should(source, flagged):
    assert bool(unsafe_calls(source)) is flagged
