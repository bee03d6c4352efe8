"""A process in which nothing may unpickle: the check that a heal, a payload or a checkpoint load never does.

The fault-tolerant workers of the recipes and of the tests call :func:`forbid_pickle` before training (their
``--forbid-pickle`` flag); every rejoin they survive is then also a proof that the recovery path read no pickle.
"""

from __future__ import annotations

import pickle

import torch

__all__ = ["forbid_pickle"]

MESSAGE = "forbid_pickle: something tried to unpickle"


def forbid_pickle() -> None:
    """Make ``pickle.load``, ``pickle.loads``, ``pickle.Unpickler`` and ``torch.load`` raise ``RuntimeError`` in this
    process, for the rest of its life."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(MESSAGE)

    class RefusingUnpickler(pickle.Unpickler):  # a class: torch subclasses pickle.Unpickler at import time
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError(MESSAGE)

    pickle.load, pickle.loads, pickle.Unpickler = refuse, refuse, RefusingUnpickler  # type: ignore[assignment,misc]
    torch.load = refuse  # type: ignore[assignment]
