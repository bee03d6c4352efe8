"""Spot recipe through Lightning: FlexDeMo Trainers on torchft, with kills, a freeze, a lighthouse restart and a
period below ``min_replicas``; writes ``docs/results/spot.json``.

Each node is one process of ``recipes/spot/spot_trainer_worker.py`` (``Trainer(strategy=FlexDeMoStrategy(settings=
FlexDeMoSettings(fault_tolerance=...)))``, one rank, gloo, its own torchrun-style environment and
``REPLICA_GROUP_ID``), training llama-tiny on ``ShakespeareDataModule`` with ``num_replica_groups`` = the node count
(each node its own shard of one training set), every worker with the cluster secret (``LIGHTNING_HETERO_FT_SECRET``,
``require_secret``) and ``--forbid-pickle``. The lighthouse is docs/spot.md's command (``torchft_lighthouse
--min_replicas 2 --bind [::]:PORT --join_timeout_ms 500 --heartbeat_timeout_ms 1500``). The schedule
(recipes/spot/spot_report.py ``plan``): SIGKILL node 2 and restart it, SIGKILL node 1 and restart it, SIGSTOP node 1
past the quorum timeout then SIGCONT, SIGKILL the lighthouse and restart it on the same address, SIGKILL nodes 1 and 2
together and restart them ``--below-min`` seconds later (node 0 alone is below ``min_replicas`` and waits). Then the
run trains ``--tail`` more seconds and stops at one committed step.

Alongside, from the same moment, ONE node trains alone (its own lighthouse with ``--min_replicas 1``, the whole
training set, otherwise the same settings) and is stopped at the same moment: ``val_loss_vs_one_node_pct`` compares
the final validation losses (same 40 validation batches; negative: the extra nodes helped). Every node, the lone one
included, is a machine of its own: its processes (a restarted node's too) run in a cgroup of the testbed
(:mod:`lightning_hetero.testbed.cgroups`) with ``--node-cpu`` cores of CPU, enforced by the kernel, whatever else runs
on the host; ``--node-cpu 0`` runs them unconfined on the shared cores (as before, where three synchronous nodes
competed with the lone one for the same cores). Needs root and the cgroup ``cpu`` controller.

    python recipes/spot/spot_recipe.py                    # about 16 minutes; 4 nodes of 0.45 core each
    python recipes/spot/spot_recipe.py --smoke --out /tmp/spot.json   # a tiny schedule, about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spot_report as report  # noqa: E402 - the recipe's own planning and reporting

from lightning_hetero.testbed.cgroups import (
    CgroupUnavailable,
    NodeLimits,
    RunCgroups,
    create_node_cgroups,
    join_command,
    select_layout,
)
from lightning_hetero.testbed.netns import TestbedError
from lightning_hetero.testing import find_free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "recipes" / "spot" / "spot_trainer_worker.py"
NODES, MIN_REPLICAS = 3, 2
LIGHTHOUSE_FLAGS = ("--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500")  # docs/spot.md's command


class Cluster:
    """A lighthouse and its nodes (worker processes), with their logs under ``out``."""

    def __init__(
        self, out: Path, min_replicas: int, worker_args: list[str], machines: list[list[str]] | None = None
    ) -> None:
        self.out, self.min_replicas, self.worker_args = out, min_replicas, worker_args
        self.machines = machines
        """Per node, the ``cgroup.procs`` files its processes join (its own CPU quota); None: unconfined."""
        self.port = find_free_port()
        self.lighthouse: subprocess.Popen | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}
        out.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        """The lighthouse command line."""
        return [
            "torchft_lighthouse",
            "--min_replicas",
            str(self.min_replicas),
            "--bind",
            f"[::]:{self.port}",
            *LIGHTHOUSE_FLAGS,
        ]

    def start_lighthouse(self) -> None:
        log = (self.out / "lighthouse.log").open("a")
        env = {**os.environ, "RUST_LOG": "warn"}
        self.lighthouse = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill_lighthouse(self) -> None:
        assert self.lighthouse is not None
        self.lighthouse.send_signal(signal.SIGKILL)
        self.lighthouse.wait()

    def start(self, node: int) -> None:
        env = {
            **os.environ,
            "RUST_LOG": "warn",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # What `torchrun --nnodes 1 --nproc-per-node 1` gives its one rank: each node is its own job.
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port()),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "REPLICA_GROUP_ID": str(node),
        }
        log = (self.out / f"worker_{node}_{time.monotonic_ns()}.log").open("w")
        command = [sys.executable, str(WORKER), "--lighthouse", f"http://localhost:{self.port}", "--out", str(self.out)]
        command += ["--min-replicas", str(self.min_replicas), *self.worker_args]
        if self.machines is not None:
            command = join_command(self.machines[node], command)  # the node's own CPU, from its first instruction
        self.procs[node] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.starts[node] = self.starts.get(node, 0) + 1

    def signal(self, node: int, sig: signal.Signals) -> None:
        self.procs[node].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[node].wait()

    def records(self) -> dict[int, list[dict]]:
        return {node: report.read_records(self.out, node) for node in self.procs}

    def committed(self, node: int, after: float = 0.0, participants: int | None = None) -> int:
        return sum(
            1
            for r in report.steps(report.read_records(self.out, node))
            if r["time"] > after and (participants is None or r["participants"] == participants)
        )

    def last_step(self) -> int:
        return max((r["step"] for rs in self.records().values() for r in report.steps(rs)), default=0)

    def stop(self, step: int, timeout: float = 300, grace: float = 60) -> list[int]:
        """Every node's ``max_steps`` becomes ``step``; wait for them to exit cleanly. Returns the nodes stranded one
        step short: left out of the last quorum, such a node waits for peers that already stopped; it is killed
        ``grace`` seconds after the last clean exit."""
        (self.out / "stop").write_text(str(step))
        deadline, last_exit = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            codes = {node: proc.poll() for node, proc in self.procs.items()}
            for node, code in codes.items():
                if code not in (None, 0):
                    raise RuntimeError(f"node {node} exited with {code}; see {self.out}")
            running = [node for node, code in codes.items() if code is None]
            if not running:
                return []
            if len(running) < len(codes):
                last_exit = last_exit or time.monotonic()
                if time.monotonic() - last_exit > grace:
                    for node in running:
                        self.signal(node, signal.SIGKILL)
                    return running
            time.sleep(0.5)
        raise TimeoutError(f"the nodes did not stop at step {step}; see {self.out}")

    def shutdown(self) -> None:
        for proc in [*self.procs.values(), self.lighthouse]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


def wait(condition: Any, what: str, cluster: Cluster, timeout: float = 400.0) -> None:
    """Poll ``condition``; raise if a node not being faulted exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for node, proc in cluster.procs.items():
            if proc.poll() not in (None, -signal.SIGKILL):
                raise RuntimeError(f"node {node} exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_for_rejoin(cluster: Cluster, node: int, back_at: float) -> dict[str, Any]:
    """The node's first commit after ``back_at``, compared with its peers' (recipes/spot/spot_report.py ``rejoin``)."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        found = report.rejoin(cluster.records(), node, back_at)
        if found is not None:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for node {node}'s rejoin; see {cluster.out}")


def run_fault(cluster: Cluster, fault: report.Fault, nodes: int) -> dict[str, Any]:
    """Apply one fault, bring the victims back, and measure the stall and the rejoins."""
    survivors = [n for n in range(nodes) if n not in fault.nodes]
    fault_at = time.time()
    if fault.kind == "lighthouse":
        cluster.kill_lighthouse()
        time.sleep(fault.hold_s)
        cluster.start_lighthouse()
    else:
        for node in fault.nodes:
            cluster.signal(node, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        if len(survivors) >= cluster.min_replicas:
            wait(
                lambda: all(cluster.committed(n, fault_at, len(survivors)) >= 3 for n in survivors),
                f"survivors {survivors} to commit 3 steps",
                cluster,
            )
        time.sleep(max(0.0, fault_at + fault.hold_s - time.time()))
        for node in fault.nodes:
            if fault.kind == "kill":
                cluster.start(node)
            else:
                cluster.signal(node, signal.SIGCONT)
    back_at = time.time()
    wait(
        lambda: all(cluster.committed(n, back_at, nodes) >= 3 for n in range(nodes)),
        "all nodes together again",
        cluster,
    )
    rejoins = [wait_for_rejoin(cluster, node, back_at) for node in fault.nodes]
    # To a moment when all commit again: the gap ends at the survivors' first commit after the fault.
    gap = report.longest_gap(cluster.records(), survivors, fault_at, time.time()) if survivors else 0.0
    result = {
        "kind": fault.kind,
        "victims": list(fault.nodes),
        "held_s": round(back_at - fault_at, 1),
        "stall_s": round(gap, 3),
        "rejoins": rejoins,
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "spot.json")
    parser.add_argument("--timeout", type=float, default=10.0, help="FaultToleranceSettings.timeout_s")
    parser.add_argument("--quorum-timeout", type=float, default=30.0, help="... .quorum_timeout_s")
    parser.add_argument("--freeze", type=float, default=45.0, help="SIGSTOP lasts this long (> --quorum-timeout)")
    parser.add_argument("--outage", type=float, default=10.0, help="seconds the lighthouse stays down")
    parser.add_argument("--below-min", type=float, default=160.0, help="seconds below min_replicas")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of training before the first fault")
    parser.add_argument("--tail", type=float, default=600.0, help="seconds of training after the last fault")
    parser.add_argument(
        "--node-cpu",
        type=float,
        default=None,
        help="cores of CPU per node (each of the 3 spot nodes and the lone one), a cgroup quota; 0: unconfined "
        "(default 0.45; 0 with --smoke)",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny schedule (seconds, not minutes)")
    parser.add_argument("--work", type=Path, default=None, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.node_cpu is None:
        args.node_cpu = 0.0 if args.smoke else 0.45
    if args.smoke:
        args.timeout, args.quorum_timeout, args.freeze, args.outage = 3.0, 5.0, 7.0, 3.0
        args.below_min, args.warmup, args.tail = 12.0, 5.0, 5.0
    schedule = report.plan(
        NODES,
        MIN_REPLICAS,
        freeze_s=args.freeze,
        outage_s=args.outage,
        below_min_s=args.below_min,
        quorum_timeout_s=args.quorum_timeout,
    )
    os.environ["LIGHTNING_HETERO_FT_SECRET"] = secrets.token_hex(32)  # the cluster secret, shared by every node
    from lightning_hetero.data.shakespeare import ShakespeareDataModule

    ShakespeareDataModule(seq_len=64, batch_size=8, seed=42).prepare_data()  # once, before any node reads the cache
    common = [
        *("--corpus", "shakespeare", "--kept-fraction", "0.03125", "--chunk", "64", "--values", "bf16"),
        "--timeout",
        str(args.timeout),
        "--quorum-timeout",
        str(args.quorum_timeout),
        "--val-batches",
        "40",
        "--require-secret",
        "--forbid-pickle",
    ]
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    started = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the clean-up below (cgroups)
    machines = node_machines(args.node_cpu, NODES + 1)
    with TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        spot_machines = None if machines is None else [machines.procs_files(n) for n in range(NODES)]
        lone_machine = None if machines is None else [machines.procs_files(NODES)]
        spot = Cluster(work / "spot", MIN_REPLICAS, [*common, "--shard-groups", str(NODES)], spot_machines)
        alone = Cluster(work / "alone", 1, [*common, "--shard-groups", "1"], lone_machine)
        faults = []
        try:
            for cluster, count in ((spot, NODES), (alone, 1)):
                cluster.start_lighthouse()
                for node in range(count):
                    cluster.start(node)
            wait(lambda: all(spot.committed(n, participants=NODES) >= 5 for n in range(NODES)), "3 nodes", spot)
            time.sleep(args.warmup)
            for fault in schedule:
                faults.append(run_fault(spot, fault, NODES))
            time.sleep(args.tail)
            stop_spot, stop_alone = spot.last_step() + 3, alone.last_step() + 3
            (alone.out / "stop").write_text(str(stop_alone))  # both stop at the same moment
            stranded = spot.stop(stop_spot)
            alone.stop(stop_alone)
        finally:
            spot.shutdown()
            alone.shutdown()
            if machines is not None:
                machines.remove()
        wall = time.time() - started
        result = summarize(spot, alone, faults, args, wall, stranded)
        result["lighthouse_command"] = " ".join(spot.command()).replace(str(spot.port), "PORT")
        result["worker_command"] = (
            "REPLICA_GROUP_ID=<node> LIGHTNING_HETERO_FT_SECRET=<secret> python "
            f"recipes/spot/spot_trainer_worker.py --lighthouse http://localhost:PORT "
            f"--out DIR --min-replicas {MIN_REPLICAS} " + " ".join([*common, "--shard-groups", str(NODES)])
        )
        given = list(argv if argv is not None else sys.argv[1:])
        paths = {"--work", "--out", str(args.work), str(args.out)}  # where logs and results go: not how the run ran
        shown = [a for a in given if a not in paths and not a.startswith(("--work=", "--out="))]
        result["command"] = " ".join(["python recipes/spot/spot_recipe.py", *shown])
        result["git_revision"] = revision.stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def node_machines(cpu: float, count: int) -> RunCgroups | None:
    """One cgroup per node with ``cpu`` cores (None for ``cpu`` 0); raise naming ``--node-cpu`` when it cannot be."""
    if cpu <= 0:
        return None
    try:
        return create_node_cgroups(secrets.token_hex(4), [NodeLimits(cpu_quota=cpu)] * count, select_layout({"cpu"}))
    except (CgroupUnavailable, TestbedError, OSError) as error:  # no root, no cpu controller: say how to run without
        raise SystemExit(
            f"--node-cpu {cpu}: cannot give each node its own CPU quota ({error}); run as root on a "
            "machine with the cgroup cpu controller, or pass --node-cpu 0 to share the cores."
        ) from None


def summarize(
    spot: Cluster, alone: Cluster, faults: list[dict], args: argparse.Namespace, wall: float, stranded: list[int]
) -> dict:
    """The JSON fields, from the two runs' records."""
    records = spot.records()
    finals = [next(r for r in records[n] if r.get("final")) for n in range(NODES) if n not in stranded]
    lone = next(r for r in alone.records()[0] if r.get("final"))
    rejoins = [j for f in faults for j in f["rejoins"]]
    below = next(f for f in faults if f["kind"] == "kill" and len(f["victims"]) > 1)
    waits = sum(log.read_text().count("waiting for replicas") for log in spot.out.glob("worker_0_*.log"))
    stalls = [f["stall_s"] for f in faults]
    return {
        "engine": "torchft",
        "lightning": True,
        "strategy": "FlexDeMoStrategy (demo, kept_fraction 1/32, chunk 64, bf16), llama-tiny, ShakespeareDataModule",
        "nodes": NODES,
        "ranks_per_node": 1,
        "min_replicas": MIN_REPLICAS,
        "kills": sum(len(f["victims"]) for f in faults if f["kind"] == "kill"),
        "sigstops": sum(len(f["victims"]) for f in faults if f["kind"] == "stop"),
        "lighthouse_restarts": sum(f["kind"] == "lighthouse" for f in faults),
        "rejoins": len(rejoins),
        "below_min_wait_s": below["stall_s"],
        "below_min_waiting_log_lines": waits,
        "survivor_restarts": report.survivor_restarts(records, spot.starts),
        "survivor_steps_lost": report.steps_lost(records),
        "max_stall_s": stalls,
        "max_stall_s_overall": max(stalls),
        "stall_target_s": args.timeout + 2,  # for a kill or a freeze; the lighthouse and below-min waits are longer
        "kill_and_freeze_stalls_within_target": all(
            f["stall_s"] <= args.timeout + 2 for f in faults if f["kind"] in ("kill", "stop") and len(f["victims"]) == 1
        ),
        "rejoined_bit_identical": all(j["bit_identical"] for j in rejoins),
        "rejoined_global_step_is_committed_step": all(j["global_step"] == j["rejoined_at_step"] for j in rejoins),
        "final_replicas_identical": len({f["digest"] for f in finals}) == 1,
        "stranded_at_stop": stranded,
        **report.batch_checks(records),
        "batches_dropped_after_in_place_heals": report.dropped_batches(records),
        "val_loss": finals[0]["val_loss"],
        "val_loss_one_node": lone["val_loss"],
        "val_loss_vs_one_node_pct": report.pct(finals[0]["val_loss"], lone["val_loss"]),
        "steps": finals[0]["global_step"],
        "steps_one_node": lone["global_step"],
        **report.link_ratio(records, NODES),
        "link": "loopback (localhost gloo, no bandwidth limit): R = median exchange s / median rest of a step",
        "timeout_s": args.timeout,
        "quorum_timeout_s": args.quorum_timeout,
        "cluster_secret": True,
        "pickle_free_transport": True,  # every worker ran with --forbid-pickle and every rejoin healed
        "faults": faults,
        "wall_s": round(wall, 1),
        "node_cpu_cores": args.node_cpu or None,
        "machine": (
            f"localhost, {os.cpu_count()} CPU cores; each node (3 spot, 1 alone) in its own cgroup with a "
            f"{args.node_cpu}-core CPU quota, gloo"
            if args.node_cpu
            else f"localhost, {os.cpu_count()} CPU cores shared by every node and other jobs (timings noisy), gloo"
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
