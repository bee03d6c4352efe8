"""Surviving faults: verified checkpoint discovery with fallback, fault injection, collective timeouts.

Framework-free (torch only); the Lightning pieces are :class:`lightning_hetero.callbacks.VerifiedCheckpoint` and the
strategies' lifecycle. See ``docs/reliability.md``.
"""

from lightning_hetero.core.checkpoint_dir import CorruptCheckpointError
from lightning_hetero.reliability.checkpoints import (
    MANIFEST_SUFFIX,
    CheckpointScan,
    IncompleteCheckpointError,
    NoGoodCheckpointError,
    UnverifiedCheckpointWarning,
    checkpoint_bytes,
    latest_good_checkpoint,
    manifest_file,
    remove_manifest,
    scan_checkpoints,
    verify_checkpoint,
    verify_resume_checkpoint,
    write_manifest,
)
from lightning_hetero.reliability.faults import ENV_VAR, FAULT_KINDS, FaultPlan, corrupt_file, restart_count
from lightning_hetero.reliability.shutdown import destroy_process_group_at_exit, release_process_groups
from lightning_hetero.reliability.timeouts import explain_collective_error, group_default_timeout, inherit_group_timeout

__all__ = [
    "ENV_VAR",
    "FAULT_KINDS",
    "MANIFEST_SUFFIX",
    "CheckpointScan",
    "CorruptCheckpointError",
    "FaultPlan",
    "IncompleteCheckpointError",
    "NoGoodCheckpointError",
    "UnverifiedCheckpointWarning",
    "checkpoint_bytes",
    "corrupt_file",
    "destroy_process_group_at_exit",
    "explain_collective_error",
    "group_default_timeout",
    "inherit_group_timeout",
    "latest_good_checkpoint",
    "manifest_file",
    "release_process_groups",
    "remove_manifest",
    "restart_count",
    "scan_checkpoints",
    "verify_checkpoint",
    "verify_resume_checkpoint",
    "write_manifest",
]
