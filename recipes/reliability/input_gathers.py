"""The two collective gathers of the hostile-input catalogue (``reliability_inputs.py``), on spawned gloo ranks.

The subspace export gather and MatFormer's error-feedback gather run in one subprocess (this file, run as a
script) with 2 spawned gloo ranks, rank 1 forging, under a timeout; the catalogue reads rank 0's verdicts as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_hetero.comm.validation import PeerPayloadError

REPO = Path(__file__).resolve().parents[2]
GATHER_TIMEOUT = 90.0  # seconds for the subprocess running both spawned gathers
GATHER_CASES = {
    "subspace export gather": ["negative size", "2**50 size", "bogus safetensors", "NaN weights"],
    "matformer error-feedback gather": ["numel 2**31"],
}
EF_KEY = "0,1|float32|8"


def _subspace_forgery(kind: str) -> tuple[int, bytes | None]:
    from safetensors.torch import save as save_safetensors

    if kind == "negative size":
        return -5, None
    if kind == "2**50 size":
        return 2**50, None
    if kind == "bogus safetensors":
        return 64, b"\x80" * 64
    payload = save_safetensors({"w": torch.tensor([1.0, float("nan")])})
    return len(payload), payload


def _gather_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 forges what a stage (or a MatFormer rank) sends; rank 0 runs the real gather. One verdict per case."""
    from lightning_hetero import comm
    from lightning_hetero.matformer.compressed import CHECKPOINT_LABEL, CompressedExchange
    from lightning_hetero.matformer.layout import widths_for
    from lightning_hetero.matformer.region_groups import RegionGroups
    from lightning_hetero.pipeline.layout import PipelineLayout
    from lightning_hetero.pipeline.stage_gather import EXPORT_LABEL, gather_stage_states

    verdicts: dict[str, Any] = {}

    def verdict(name: str, call: Callable[[], Any]) -> None:
        try:
            verdicts[name] = ("accepted", repr(call())[:200])
        except PeerPayloadError as error:
            verdicts[name] = ("refused", f"PeerPayloadError: {error}"[:300])
        except Exception as error:  # noqa: BLE001 - reported as a crash by the parent
            verdicts[name] = ("escaped", f"{type(error).__name__}: {error}"[:300])

    layout = PipelineLayout(num_stages=2)
    for kind in GATHER_CASES["subspace export gather"]:
        if rank == 1:
            size, payload = _subspace_forgery(kind)
            comm.send(torch.tensor([size], dtype=torch.int64), 0, label=EXPORT_LABEL)
            if payload is not None:
                comm.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, label=EXPORT_LABEL)
            continue
        verdict(kind, lambda: gather_stage_states({"v": torch.ones(2)}, layout, 0, torch.device("cpu")))
    exchange = CompressedExchange(RegionGroups(widths_for([0, 0], 16)), 1 / 8)
    exchange.load_state_dict({EF_KEY: torch.zeros(8)})
    if rank == 1:  # announces 2**31 values (8 GiB) and sends nothing
        every = torch.empty(4, dtype=torch.int64)
        sizes = torch.tensor([len(json.dumps([EF_KEY])), 2**31])
        comm.all_gather_into_tensor(every, sizes, label=CHECKPOINT_LABEL)
    else:
        verdict("numel 2**31", lambda: exchange.gather_state(torch.device("cpu")))
    return verdicts


def gather_main() -> None:
    """This file as a script: run the spawned gathers and print rank 0's verdicts as JSON (run by :func:`_gathers`)."""
    from lightning_hetero.testing import run_distributed

    print(json.dumps(run_distributed(_gather_worker, 2, timeout=GATHER_TIMEOUT - 15)[0]))


@functools.cache
def _gathers() -> dict[str, Any]:
    """Rank 0's verdict for every gather case, or ``{"error": ...}`` when the run failed or hung."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve())],
            capture_output=True,
            text=True,
            timeout=GATHER_TIMEOUT,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"TimeoutError: the spawned gathers did not finish in {GATHER_TIMEOUT:.0f} s (a rank waits)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the spawned gathers failed (exit {done.returncode}): {tail}"}
    return json.loads(lines[-1])


def gather_case(kind: str) -> Callable[[], Any]:
    def run() -> Any:
        verdicts = _gathers()
        if "error" in verdicts:
            raise RuntimeError(verdicts["error"])
        outcome, detail = verdicts[kind]
        if outcome == "refused":
            raise PeerPayloadError(detail.removeprefix("PeerPayloadError: "))
        if outcome == "escaped":
            raise RuntimeError(f"escaped the gather: {detail}")
        return detail

    return run


if __name__ == "__main__":
    gather_main()
