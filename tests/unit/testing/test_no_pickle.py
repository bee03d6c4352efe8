"""forbid_pickle, in a fresh interpreter (it changes pickle and torch for the rest of the process): every way to
unpickle raises, and safetensors, which the heals use, still loads."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import io, pickle, torch
from safetensors.torch import load, save
from lightning_hetero.testing.no_pickle import forbid_pickle

blob = pickle.dumps({"a": 1})
buffer = io.BytesIO(); torch.save({"w": torch.ones(2)}, buffer)
forbid_pickle()
refused = 0
for attempt in (lambda: pickle.loads(blob), lambda: pickle.load(io.BytesIO(blob)),
                lambda: pickle.Unpickler(io.BytesIO(blob)).load(), lambda: torch.load(io.BytesIO(buffer.getvalue()))):
    try:
        attempt()
    except RuntimeError as error:
        refused += "forbid_pickle" in str(error)
print(refused, float(load(save({"w": torch.ones(2)}))["w"].sum()))
"""


def test_every_unpickling_path_raises_and_safetensors_still_loads() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["4", "2.0"], result.stdout + result.stderr
