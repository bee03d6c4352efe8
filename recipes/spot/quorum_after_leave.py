"""How long a member of the last quorum holds the next one after it left cleanly: two torchft managers on one
lighthouse, the first forms a quorum and shuts down, the second asks for one; prints JSON.

    python recipes/spot/quorum_after_leave.py                          # the lighthouse's default heartbeat timeout
    python recipes/spot/quorum_after_leave.py --heartbeat-timeout-ms 1500
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=None, help="the lighthouse's (default: torchft's)")
    args = parser.parse_args(argv)
    from torchft._torchft import ManagerClient, ManagerServer
    from torchft.coordination import LighthouseServer

    extra = {} if args.heartbeat_timeout_ms is None else {"heartbeat_timeout_ms": args.heartbeat_timeout_ms}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, **extra)

    def member(replica_id: str) -> ManagerServer:
        return ManagerServer(
            replica_id=replica_id,
            lighthouse_addr=lighthouse.address(),
            hostname="localhost",
            bind="[::]:0",
            store_addr="localhost:1",
            world_size=1,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=timedelta(seconds=5),
            quorum_retries=0,
        )

    def quorum(server: ManagerServer) -> list[str]:
        client = ManagerClient(server.address(), timedelta(seconds=5))
        result = client._quorum(
            group_rank=0,
            step=0,
            checkpoint_metadata="",
            shrink_only=False,
            timeout=timedelta(seconds=30),
            commit_failures=0,
            init_sync=True,
        )
        return list(result.replica_ids)

    first = member("first:0")
    quorum(first)
    first.shutdown()  # a clean leave: no more heartbeats
    second = member("second:0")
    started = time.monotonic()
    members = quorum(second)
    waited = time.monotonic() - started
    second.shutdown()
    lighthouse.shutdown()
    result = {"heartbeat_timeout_ms": args.heartbeat_timeout_ms, "next_quorum_after_s": round(waited, 2)}
    print(json.dumps({**result, "next_quorum_members": members}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
