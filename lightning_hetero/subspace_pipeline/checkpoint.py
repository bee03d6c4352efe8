"""Per-stage checkpoints of the subspace pipeline: one folder, one file per stage, one metadata file.

Layout of a checkpoint ``path`` (a folder, also when it is named ``*.ckpt``)::

    path/
      meta.json        # format, num_stages, data_parallel_size at save time, stage layer ranges, subspace config
      stage_0.pt       # everything the Trainer/Fabric saves on the rank of stage 0 of replica 0
      stage_1.pt       # ... (model state of that stage only, its optimizer state, loops, callbacks, ...)

Data-parallel replicas of a stage hold bit-identical weights and optimizer state (their gradients are averaged), so
only replica 0 writes; any number of replicas can resume from the folder (every replica of stage ``s`` reads
``stage_s.pt``), so a resume on another world size works when it keeps the stage count (``data_parallel_size``
changes). The stage count, the layer split and the subspace settings must match the run that resumes; otherwise
:func:`check_meta` raises, naming the ``num_stages`` to resume with.

The part files are written and read through :mod:`lightning_hetero.core.checkpoint_dir` (atomic, checksummed,
``weights_only``); this module names them and owns ``meta.json``. Bringing every stage's state to rank 0 for
``export_dense`` is :mod:`lightning_hetero.pipeline.stage_gather`. Nothing here imports Lightning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_FORMAT", "META_FILE", "check_meta", "read_meta", "stage_file", "write_meta"]

CHECKPOINT_FORMAT = "lightning_hetero.subspace_pipeline/1"
"""Value of ``meta.json``'s ``format`` field."""
META_FILE = "meta.json"
"""Name of the metadata file inside a checkpoint folder."""

# Meta fields that must be equal between the saving and the resuming run (the rest is informative).
_MUST_MATCH = ("num_stages", "layer_ranges", "rank", "compress", "mode", "seed", "coord_dtype")


def stage_file(path: str | os.PathLike, stage: int) -> Path:
    """The file of ``stage`` inside checkpoint folder ``path``."""
    return Path(path) / f"stage_{stage}.pt"


def write_meta(path: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write ``meta.json`` (plus the format field) into folder ``path`` (created)."""
    target = Path(path) / META_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"format": CHECKPOINT_FORMAT, **meta}, indent=2, sort_keys=True))
    return target


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``meta.json`` of checkpoint folder ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline checkpoint folder (e.g. a single-file checkpoint of another
            strategy); the message says what a pipeline checkpoint looks like.
    """
    folder = Path(path)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        kind = "a file" if folder.is_file() else "missing" if not folder.exists() else "a folder without meta.json"
        raise FileNotFoundError(
            f"{folder} is {kind}, not a SubspacePipelineStrategy checkpoint (a folder with {META_FILE} and "
            "stage_<s>.pt files, written by trainer.save_checkpoint / fabric.save under this strategy)."
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}.")
    return meta


def check_meta(saved: Mapping[str, Any], current: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Raise a ValueError naming every field in which the saved run and this run differ (stage split, subspace)."""
    differences = [
        f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}"
        for key in _MUST_MATCH
        if key in current and _normalized(saved.get(key)) != _normalized(current.get(key))
    ]
    if differences:
        stages = saved.get("num_stages")
        raise ValueError(
            f"Cannot resume from {path}: the checkpoint was written by a different pipeline ("
            + "; ".join(differences)
            + f"). Resume with SubspacePipelineSettings(pipeline=PipelineSettings(num_stages={stages})) and the same "
            "model and subspace settings (subspace_dim or dim_ratio, compress, mode, seed, pipeline.boundary_dtype; "
            "meta.json names the resolved subspace_dim 'rank' and boundary_dtype 'coord_dtype'); "
            f"pipeline.data_parallel_size may change, so any world size that is a multiple of {stages} works. The "
            "stage count cannot change: each stage file holds its layers' optimizer "
            "state by position and its boundary's subspace statistic, which do not map onto another layer split."
        )


def _normalized(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as read back from JSON
