"""A rogue process against a live spot run (tests/dist/test_ft_security.py): it joins the lighthouse's quorum as torchft
lets any process do, and attacks what our code sends. One attack per run, for ``--rounds`` quorums, then it leaves.

- ``nan``: a stranger (another secret) contributes NaN gradients to the step's exchange;
- ``heal``: a stranger claims step 100,000 so every honest replica is told to heal from it, and serves its forged
  state (weights x 1e4) to any request;
- ``download``: a stranger asks an honest replica's recovery server for the model, with no token, a forged token, a
  token under another secret, another path and another method; the answers go to ``<out>/download.json``;
- ``bitflip``: a member (the right secret) whose slot gets bit 7 of one byte flipped after it was tagged, as a
  network path would; it then behaves for ``--honest-rounds`` steps and stays;
- ``replay``: a stranger sends, as its own contribution, an honest replica's tagged slot of an earlier step.

    python tests/dist/ft_rogue.py --lighthouse http://localhost:29510 --attack nan --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from ft_replica_worker import FEATURES, build  # the honest workers' model: the same slot size
from torch.distributed.distributed_c10d import AllgatherOptions

from lightning_hetero.ft.membership import MAC_BYTES
from lightning_hetero.ft.replicas import FaultTolerantReplica
from lightning_hetero.ft.settings import FaultToleranceSettings
from lightning_hetero.ft.transport import SafeCheckpointTransport


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    inputs = torch.randn(32, FEATURES)
    torch.nn.functional.mse_loss(model(inputs), inputs[:, :1]).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float()
    model.zero_grad()
    return flat


def _raw_gather(replica: FaultTolerantReplica, sealed: torch.Tensor) -> list[torch.Tensor] | None:
    """All-gather ``sealed`` (payload || tag) over the quorum whatever this replica's own state (a stranger's view)."""
    count = replica.manager.num_participants()
    outputs = [torch.empty_like(sealed) for _ in range(count)]
    try:
        replica.manager._pg.allgather([outputs], [sealed], AllgatherOptions()).wait()
    except Exception as error:  # noqa: BLE001 - the honest side may drop the collective
        print(f"rogue: gather failed: {error}", flush=True)
        return None
    return outputs


def _seal(replica: FaultTolerantReplica, payload: torch.Tensor) -> torch.Tensor:
    """``payload`` with this process's own tag (a stranger's key gives a tag no member accepts)."""
    count = replica.manager.num_participants()
    slot = replica.manager.participating_rank() or 0
    context = replica.slots.context(count)
    tag = replica.secret.slot_tag(context, slot, memoryview(payload.numpy()))
    return torch.cat((payload, torch.frombuffer(bytearray(tag), dtype=torch.uint8)))


class _ServeAnyone(SafeCheckpointTransport):
    """A forger's recovery server: answers every request (its tag is under its own key, never the cluster's)."""

    def _authenticated(self, path: str, nonce: str | None, token: str | None) -> str | None:
        return nonce if isinstance(nonce, str) else "0" * 32


def _probe(url: str) -> list[dict[str, Any]]:
    """What a stranger gets from a recovery server at ``url`` (``.../checkpoint/``) for every kind of request."""
    nonce = secrets.token_hex(16)
    requests = {
        "no token": ({}, "GET", "1"),
        "forged token": ({"X-LH-Nonce": nonce, "X-LH-Token": "0" * 64}, "GET", "1"),
        "other path": ({}, "GET", "../etc/passwd"),
        "post": ({}, "POST", "1"),
    }
    answers = []
    for name, (headers, method, tail) in requests.items():
        request = urllib.request.Request(f"{url}{tail}", headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answers.append({"request": name, "status": response.status, "body": len(response.read())})
        except urllib.error.HTTPError as error:
            answers.append(
                {
                    "request": name,
                    "status": error.code,
                    "body": len(error.read()),
                    "headers": sorted(k for k in error.headers if k.lower().startswith("x-")),
                }
            )
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--attack", choices=("nan", "heal", "download", "bitflip", "replay"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--honest-rounds", type=int, default=0)
    args = parser.parse_args(argv)
    if args.attack != "bitflip":  # a stranger: its own secret, not the cluster's
        os.environ["LIGHTNING_HETERO_FT_SECRET"] = secrets.token_hex(32)
    model, optimizer = build()
    settings = FaultToleranceSettings(
        lighthouse=args.lighthouse,
        min_replicas=2,
        timeout_s=5.0,
        quorum_timeout_s=60.0,
        replica_id_source="fixed",
        replica_id="rogue9",
    )
    replica = FaultTolerantReplica(settings, model=model, optimizer=optimizer, store_host="localhost")
    report: dict[str, Any] = {"attack": args.attack, "rounds": []}
    if args.attack == "heal":
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1e4)  # its weights: a loss of ~1e8 on the honest data
        served = replica.transport
        forger = _ServeAnyone(replica._receiver_layout, host="localhost", secret=replica.secret)
        replica.manager._checkpoint_transport = forger
        served.shutdown()
        replica.manager.load_state_dict({"step": 100_000, "batches_committed": 0})
    if args.attack == "download":
        original = replica.transport.recv_checkpoint

        def recv(src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            report.setdefault("probes", _probe(metadata))
            report["url"] = metadata
            return original(src_rank, metadata, step, timeout)

        replica.transport.recv_checkpoint = recv  # type: ignore[method-assign]
    recorded: list[torch.Tensor] = []
    try:
        for round_ in range(args.rounds + args.honest_rounds):
            try:
                replica.start_step()
            except Exception as error:  # noqa: BLE001 - a stranger's own heal fails: it goes on attacking
                print(f"rogue: start_step: {error}", flush=True)
            count, step = replica.manager.num_participants(), replica.manager.current_step()
            report["rounds"].append({"participants": count, "step": step})
            if args.attack == "heal":
                replica.manager.should_commit()
                continue
            if args.attack == "bitflip" and round_ >= args.rounds:
                inputs = torch.randn(32, FEATURES)
                torch.nn.functional.mse_loss(model(inputs), inputs[:, :1]).backward()
                replica.average_gradients(model.parameters())
                if replica.should_commit():
                    optimizer.step()
                optimizer.zero_grad()
                continue
            flat = _flat_grad(model)
            if args.attack == "nan":
                flat.fill_(float("nan"))
            sealed = _seal(replica, flat.view(torch.uint8))
            if args.attack == "bitflip":
                sealed[5] ^= 0x80  # bit 7 of one byte, after tagging: what a network path could do
            if args.attack == "replay" and recorded:
                sealed = recorded[0].clone()  # an honest replica's tagged slot of an earlier step
            outputs = _raw_gather(replica, sealed)
            own = replica.manager.participating_rank()
            if outputs is not None:
                recorded = [out for index, out in enumerate(outputs) if index != own] or recorded
                report["rounds"][-1]["slot_bytes"] = int(sealed.numel())
            try:
                replica.manager.should_commit()
            except Exception as error:  # noqa: BLE001
                print(f"rogue: should_commit: {error}", flush=True)
            time.sleep(0.05)
    finally:
        report["mac_bytes"] = MAC_BYTES
        (args.out / f"rogue_{args.attack}.json").write_text(json.dumps(report))
        replica.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
