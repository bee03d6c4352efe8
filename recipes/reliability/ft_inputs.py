"""The hostile-input catalogue's cases for the fault-tolerant path: recovery blobs
(``recipes/reliability/reliability_inputs.py``).

Each case hands a joining replica's transport (:meth:`SafeCheckpointTransport.accept`: the blob's HMAC tag, then
the codec against the joiner's own layout, then :func:`~lightning_hetero.ft.checks.validate_recovered`) one forged
blob: unauthenticated (no tag, another secret, a flipped bit after tagging, a replay of another step or quorum) or
authenticated by a member but off the rule (Adam ``exp_avg_sq = -1``, ``lr = 1e18``, ``betas = (5, -3)``, a negative
or fractional step, a torchft step of ``2**63 - 1``, invalid RNG states, permuted parameters, NaN weights). Random
bytes carry a valid tag (a member sending garbage), so only the codec and the checks stand between them and the
joiner. Every outcome is counted by the catalogue's rules.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from lightning_hetero.ft.checks import validate_recovered
from lightning_hetero.ft.codec import StateLayout, encode_state
from lightning_hetero.ft.membership import ClusterSecret

__all__ = ["recovery_cases"]

SECRET = ClusterSecret(b"catalogue-cluster-secret-0123456789", "catalogue")
STRANGER = ClusterSecret(b"a-stranger-s-own-secret-9876543210", "stranger")
STEP, NONCE, PEER = 5, "0f" * 16, 1
DECODER = "ft recovery blob (tag, codec, checks)"


def _honest() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model(torch.randn(4, 3)).square().mean().backward()
    optimizer.step()
    user = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.Generator().manual_seed(1).get_state(), "python": random.Random(1).getstate()},
        "extra": {},
    }
    return {"user": {"default": user}, "torchft": {"step": STEP, "batches_committed": 2 * STEP}}


def _layout(own: dict[str, Any]) -> StateLayout:
    shapes = {0: (2, 3), 1: (2,)}
    return StateLayout.of(own, {("user", "default", "optimizer", "state"): shapes})


def _tag(secret: ClusterSecret, blob: bytes, step: int = STEP, nonce: str = NONCE) -> str:
    return ClusterSecret.finish_blob_tag(secret.blob_tagger("", step, blob), nonce)


def _accept(blob: bytes, tag: str | None) -> Any:
    """The joiner's transport on ``blob`` as fetched with ``tag``."""
    from lightning_hetero.ft.transport import SafeCheckpointTransport  # needs torchft: the ft extra

    own = _honest()
    transport = SafeCheckpointTransport(
        lambda: _layout(own),
        timeout=timedelta(seconds=5),
        host="localhost",
        secret=SECRET,
        validate=lambda state, peer, step: validate_recovered(state, own, step=step, peer=peer),
    )
    try:
        return transport.accept(blob, tag, NONCE, src_rank=PEER, step=STEP, layout=_layout(own))
    finally:
        transport.shutdown()


def _member(edit: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
    """A blob a member tagged correctly, its state edited by ``edit``."""

    def run() -> Any:
        state = copy.deepcopy(_honest())
        edit(state)
        blob = encode_state(state, STEP)
        return _accept(blob, _tag(SECRET, blob))

    return run


def _tagged(tag_of: Callable[[bytes], str | None], flip: bool = False) -> Callable[[], Any]:
    """An honest blob with the tag ``tag_of`` gives (a stranger's, none, another step's), optionally a bit flipped
    after tagging."""

    def run() -> Any:
        blob = encode_state(_honest(), STEP)
        tag = tag_of(blob)
        if flip:
            blob = bytearray(blob)
            blob[len(blob) // 2] ^= 0x80
            blob = bytes(blob)
        return _accept(blob, tag)

    return run


def _optim(state: dict[str, Any]) -> dict[str, Any]:
    return state["user"]["default"]["optimizer"]


def _random_blob(seed: int) -> Callable[[], Any]:
    def run() -> Any:
        blob = bytes(torch.randint(0, 256, (64 + 37 * seed,), generator=torch.Generator().manual_seed(seed)).tolist())
        return _accept(blob, _tag(SECRET, blob))

    return run


def recovery_cases(random_cases: int) -> list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]]:
    """``(decoder, bad input, run, is_valid)`` for the recovery blobs: every forged input is invalid by
    construction; a random blob is valid only if it decodes to a state passing every check."""
    forged = lambda out: False  # noqa: E731 - a forged input accepted at all is accepted_invalid
    cases: list[tuple[str, str, Callable[[], Any], Callable[[Any], bool]]] = [
        (DECODER, "no tag (a stranger's heal)", _tagged(lambda blob: None), forged),
        (DECODER, "tag under another secret", _tagged(lambda blob: _tag(STRANGER, blob)), forged),
        (DECODER, "one flipped bit after tagging", _tagged(lambda blob: _tag(SECRET, blob), flip=True), forged),
        (DECODER, "tag of an earlier step (replay)", _tagged(lambda blob: _tag(SECRET, blob, step=STEP - 1)), forged),
        (
            DECODER,
            "answer to another nonce (replay)",
            _tagged(lambda blob: _tag(SECRET, blob, nonce="0" * 32)),
            forged,
        ),
        (DECODER, "Adam exp_avg_sq = -1", _member(lambda s: _optim(s)["state"][0]["exp_avg_sq"].fill_(-1)), forged),
        (DECODER, "lr = 1e18", _member(lambda s: _optim(s)["param_groups"][0].update(lr=1e18)), forged),
        (DECODER, "betas = (5, -3)", _member(lambda s: _optim(s)["param_groups"][0].update(betas=(5.0, -3.0))), forged),
        (DECODER, "params permuted", _member(lambda s: _optim(s)["param_groups"][0].update(params=[1, 0])), forged),
        (DECODER, "negative Adam step", _member(lambda s: _optim(s)["state"][0]["step"].fill_(-3)), forged),
        (DECODER, "torchft step 2**63 - 1", _member(lambda s: s["torchft"].update(step=2**63 - 1)), forged),
        (DECODER, "negative batches_committed", _member(lambda s: s["torchft"].update(batches_committed=-1)), forged),
        (DECODER, "invalid torch RNG state", _member(lambda s: s["user"]["default"]["rng"]["torch"].zero_()), forged),
        (
            DECODER,
            "invalid python RNG state",
            _member(lambda s: s["user"]["default"]["rng"].update(python=(3, tuple([2**40] * 625), None))),
            forged,
        ),
        (
            DECODER,
            "NaN weights",
            _member(lambda s: s["user"]["default"]["model"]["weight"].fill_(float("nan"))),
            forged,
        ),
    ]
    for seed in range(random_cases):
        # Accepted at all, it passed the tag, the codec and every check: as valid as an honest member's state.
        cases.append((DECODER, f"random bytes (seed {seed})", _random_blob(seed), lambda out: isinstance(out, dict)))
    return cases
