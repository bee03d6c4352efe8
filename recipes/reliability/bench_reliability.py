"""Fault-injection runs for docs/reliability.md: killed rank, hung peer, crash during a save, corrupted checkpoint,
clean shutdown; then docs/results/reliability.json from these runs and the sibling results.

Each fault run is a torchrun job (``--max-restarts 3``, c10d rendezvous, one agent per node) of
``recipes/reliability/reliability_worker.py``: a tiny model, a checkpoint every ``--every`` steps, auto-resume from the
newest good checkpoint. The fault fires in the first attempt only; the job must finish by itself, and its final
parameters are compared bitwise with an uninterrupted run of the same job.

    python recipes/reliability/bench_reliability.py                        # every scenario (slow on 2 cores)
    python recipes/reliability/bench_reliability.py --quick                # kill + shutdown x2, flexdemo only
    python recipes/reliability/bench_reliability.py --scenarios kill hang --strategies flexdemo --launcher testbed
    python recipes/reliability/bench_reliability.py --aggregate-only  # rebuild reliability.json from the stored results

Raw results go to docs/results/reliability_faults.json (one entry per scenario and strategy, replaced when rerun).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/results"
FAULTS_FILE = RESULTS / "reliability_faults.json"
SUMMARY_FILE = RESULTS / "reliability.json"
WORKER = REPO / "recipes/reliability/reliability_worker.py"
SCENARIOS = ("kill", "hang", "save-kill", "corrupt", "shutdown")
FAULT_OF = {"kill": "kill", "hang": "stop", "save-kill": "save-kill", "corrupt": "corrupt-kill"}


def _torchrun(nodes: int, ranks_per_node: int, max_restarts: int, endpoint: str | None) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks_per_node)]
    command += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.5"]
    if nodes == 1:
        return [*command, "--standalone"]
    return [
        *command,
        "--nnodes",
        str(nodes),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint or "",
        "--rdzv-id",
        "rel",
    ]


def run_job(
    strategy: str,
    out: Path,
    *,
    nodes: int,
    ranks_per_node: int,
    max_steps: int,
    every: int,
    timeout: float,
    fault: str | None = None,
    max_restarts: int = 3,
    launcher: str = "local",
    limit: float = 1500.0,
) -> dict[str, Any]:
    """Run one torchrun job (``nodes`` agents) of the worker; returns exit code, seconds and the log tail."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    worker = [str(WORKER), "--strategy", strategy, "--max-steps", str(max_steps), "--every", str(every)]
    worker += ["--out", str(out), "--timeout", str(timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # The agents' restart counts differ after one node's failure (each agent counts its own), and workers sharing
    # the rendezvous store key their process group by that count: the restarted group then reads the dead round's
    # addresses (gloo "connectFullMesh ... Connection refused"). pytorch/pytorch#135712; a store of their own avoids it.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.pop("LIGHTNING_HETERO_FAULT", None)
    if fault:
        env["LIGHTNING_HETERO_FAULT"] = fault
    start = time.time()
    log = out / "log.txt"
    with open(log, "w") as stream:
        if launcher == "testbed":
            torchrun = " ".join(_torchrun(nodes, ranks_per_node, max_restarts, "$MASTER_ADDR:$MASTER_PORT"))
            # Inside a namespace the hostname does not resolve, so node 0 is told it hosts the rendezvous store.
            # Its workers must also be given the node's own address (torchrun would hand out "localhost").
            host = '--rdzv-conf is_host=$([ "$NODE_RANK" = 0 ] && echo true || echo false)'
            host += " --local-addr 10.213.0.$((NODE_RANK + 1))"
            inner = f"exec {torchrun} {host} {' '.join(worker)}"
            command = [sys.executable, "-m", "lightning_hetero.testbed", "--nodes", str(nodes), "--ranks-per-node"]
            command += [str(ranks_per_node), "--launch", "per-node", "--timeout", str(limit), "--failure-grace", "60"]
            command += ["--run-dir", str(out / "testbed"), "--", "bash", "-c", inner]
            code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
        else:
            from lightning_hetero.testing import find_free_port

            endpoint = f"127.0.0.1:{find_free_port()}"
            agents = [
                subprocess.Popen(
                    [*_torchrun(nodes, ranks_per_node, max_restarts, endpoint), *worker],
                    stdout=stream,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO,
                    start_new_session=True,
                )
                for _ in range(nodes)
            ]
            codes = []
            for agent in agents:
                try:
                    codes.append(agent.wait(timeout=max(1.0, limit - (time.time() - start))))
                except subprocess.TimeoutExpired:
                    os.killpg(agent.pid, 9)
                    codes.append(124)
            code = max(codes, key=abs)
    attempts = (
        [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
        if (out / "attempts.jsonl").is_file()
        else []
    )
    return {
        "exit_code": code,
        "seconds": round(time.time() - start, 1),
        "attempts": attempts,
        "log_tail": log.read_text()[-1500:],
    }


def same_parameters(first: Path, second: Path, world: int) -> bool | None:
    """Bitwise equality of every rank's final parameters (None when a run left none)."""
    import torch

    for rank in range(world):
        a, b = first / f"final_rank{rank}.pt", second / f"final_rank{rank}.pt"
        if not (a.is_file() and b.is_file()):
            return None
        left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        if left.keys() != right.keys() or not all(torch.equal(left[k], right[k]) for k in left):
            return False
    return True


def _errors(out: Path) -> list[dict[str, Any]]:
    return [{"file": p.name, **json.loads(p.read_text())} for p in sorted(out.glob("error_rank*_attempt0.json"))]


def fault_run(args: argparse.Namespace, scenario: str, strategy: str, reference: Path, work: Path) -> dict[str, Any]:
    """One fault scenario on ``strategy``; compares with the uninterrupted ``reference`` run."""
    world = args.nodes * args.ranks_per_node
    rng = random.Random(f"{scenario}-{strategy}-{args.seed}")
    rank = rng.randrange(world) if scenario in ("kill", "hang") else (0 if scenario == "corrupt" else world - 1)
    if scenario in ("kill", "hang"):
        step = rng.choice([s for s in range(2, args.max_steps) if s % args.every])  # not a save step
    elif scenario == "save-kill":
        step = 2 * args.every
    else:
        step = 2 * args.every + 1  # after two checkpoints: the newest gets corrupted, then the rank dies
    fault = f"{FAULT_OF[scenario]}:rank={rank}:step={step}"
    out = work / f"{scenario}-{strategy}"
    timeout = args.hang_timeout if scenario == "hang" else args.timeout
    job = run_job(
        strategy,
        out,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        max_steps=args.max_steps,
        every=args.every,
        timeout=timeout,
        fault=fault,
        launcher=args.launcher,
    )
    resumed = [a for a in job["attempts"] if a["attempt"] > 0]
    fault_record = json.loads((out / "fault.json").read_text()) if (out / "fault.json").is_file() else None
    errors = _errors(out)
    result = {
        "scenario": scenario,
        "strategy": strategy,
        "fault": fault,
        "launcher": args.launcher,
        "world": f"{args.nodes} nodes x {args.ranks_per_node} ranks",
        "fault_fired": fault_record is not None,
        "exit_code": job["exit_code"],
        "seconds": job["seconds"],
        "restarts": len(resumed),
        "resumed_from": resumed[0]["resumed_from"] if resumed else None,
        "resumed_step": resumed[0]["start_step"] if resumed else None,
        "steps_lost": (step - resumed[0]["start_step"]) if resumed else None,
        "survived": job["exit_code"] == 0 and bool(resumed) and fault_record is not None,
        "bit_identical": same_parameters(out, reference, world),
        "errors_first_attempt": [{k: e[k] for k in ("file", "explanation")} for e in errors],
        "log_tail": job["log_tail"] if job["exit_code"] else "",
    }
    if scenario == "hang" and fault_record is not None and errors:
        result["collective_timeout_seconds"] = timeout
        result["seconds_to_first_error"] = round(min(e["time"] for e in errors) - fault_record["time"], 2)
        result["seconds_to_last_error"] = round(max(e["time"] for e in errors) - fault_record["time"], 2)
    return result


def shutdown_runs(args: argparse.Namespace, strategy: str, work: Path) -> dict[str, Any]:
    """``--repeats`` short 2-rank fits of ``strategy`` (``--parallel`` at a time); every exit code recorded."""
    from concurrent.futures import ThreadPoolExecutor

    def one(repeat: int) -> dict[str, Any]:
        job = run_job(
            strategy,
            work / f"shutdown-{strategy}-{repeat}",
            nodes=1,
            ranks_per_node=2,
            max_steps=2,
            every=0,
            timeout=args.timeout,
            max_restarts=0,
            launcher="local",
            limit=1200,
        )
        print(f"shutdown {strategy} #{repeat}: exit {job['exit_code']} ({job['seconds']} s)", flush=True)
        if job["exit_code"]:
            print(job["log_tail"], flush=True)
        return job

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        jobs = list(pool.map(one, range(args.repeats)))
    codes = [job["exit_code"] for job in jobs]
    return {
        "scenario": "shutdown",
        "strategy": strategy,
        "runs": len(codes),
        "exit_codes": codes,
        "clean": sum(c == 0 for c in codes),
        "seconds": [job["seconds"] for job in jobs],
        "failure_logs": [job["log_tail"] for job in jobs if job["exit_code"]],
    }


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def record(entry: dict[str, Any]) -> None:
    """Replace this scenario x strategy's entry in the raw results file (locked: several benches may run at once)."""
    import fcntl

    FAULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "lightning_hetero_reliability_faults.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = _load(FAULTS_FILE) or {"runs": []}
        key = (entry["scenario"], entry["strategy"])
        stored["runs"] = [r for r in stored["runs"] if (r["scenario"], r["strategy"]) != key] + [entry]
        entry["command"] = "python recipes/reliability/bench_reliability.py " + " ".join(sys.argv[1:])
        FAULTS_FILE.write_text(json.dumps(stored, indent=1) + "\n")


def _sibling_count(data: Any, key: str) -> int:
    return int(data[key]) if isinstance(data, dict) and isinstance(data.get(key), (int, float)) else 0


def aggregate() -> dict[str, Any]:
    """docs/results/reliability.json from the fault runs plus R1's resume and R4's input results when present."""
    runs = (_load(FAULTS_FILE) or {}).get("runs", [])
    faults = [r for r in runs if r["scenario"] != "shutdown"]
    shutdown = [r for r in runs if r["scenario"] == "shutdown"]
    resume, inputs = _load(RESULTS / "reliability_resume.json"), _load(RESULTS / "reliability_inputs.json")
    summary = {
        "faults_injected": sum(bool(r.get("fault_fired")) for r in faults),
        "survived": sum(bool(r.get("survived")) for r in faults),
        "bit_identical_resumes": sum(r.get("bit_identical") is True for r in faults)
        + _sibling_count(resume, "bit_identical_resumes"),
        # The hostile-input catalogue's five counts (tried = rejected + accepted_valid + accepted_invalid + crashed).
        "bad_inputs_tried": _sibling_count(inputs, "bad_inputs_tried"),
        "bad_inputs_rejected": _sibling_count(inputs, "bad_inputs_rejected"),
        "bad_inputs_accepted_valid": _sibling_count(inputs, "accepted_valid"),
        "bad_inputs_accepted_invalid": _sibling_count(inputs, "accepted_invalid"),
        "bad_inputs_crashed": _sibling_count(inputs, "crashed"),
        "sources": {
            "faults": FAULTS_FILE.name,
            "resume": "reliability_resume.json" if resume is not None else None,
            "inputs": "reliability_inputs.json" if inputs is not None else None,
        },
        "fault_runs": [
            {
                k: r.get(k)
                for k in (
                    "scenario",
                    "strategy",
                    "fault",
                    "survived",
                    "steps_lost",
                    "bit_identical",
                    "seconds",
                    "seconds_to_last_error",
                    "collective_timeout_seconds",
                )
            }
            for r in faults
        ],
        "clean_shutdown": [{k: r[k] for k in ("strategy", "runs", "clean", "exit_codes")} for r in shutdown],
        "checkpoint_cost": [r["checkpoint_cost"] for r in runs if r.get("checkpoint_cost")],
        "command": "python recipes/reliability/bench_reliability.py --aggregate-only",
    }
    SUMMARY_FILE.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """The fault x strategy table of docs/reliability.md, from the summary."""
    lines = [
        "| fault | strategy | survived | steps lost | resumed state equal | seconds (whole job) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in summary["fault_runs"]:
        lines.append(
            f"| {run['fault']} | {run['strategy']} | {'yes' if run['survived'] else 'NO'} | {run['steps_lost']} | "
            f"{'bit-identical' if run['bit_identical'] else run['bit_identical']} | {run['seconds']} |"
        )
    for run in summary["clean_shutdown"]:
        lines.append(
            f"| clean shutdown x{run['runs']} | {run['strategy']} | {run['clean']}/{run['runs']} exit 0 | | | |"
        )
    return "\n".join(lines)


def checkpoint_cost(reference: Path, strategy: str) -> dict[str, Any] | None:
    saves = _load(reference / "saves.json")
    if not saves:
        return None
    return {
        "strategy": strategy,
        "saves": len(saves),
        "seconds_per_save": [round(s["seconds"], 3) for s in saves],
        "manifest_seconds": [round(s["manifest_seconds"], 3) for s in saves],
        "bytes": saves[-1]["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--strategies", nargs="+", default=["flexdemo"], help="flexdemo matformer subspace sparseflip")
    parser.add_argument("--shutdown-strategies", nargs="+", default=["flexdemo", "matformer", "subspace", "sparseflip"])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout of the fault runs, s")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="collective timeout of the hung-peer run, s")
    parser.add_argument("--repeats", type=int, default=20, help="clean-shutdown fits per strategy")
    parser.add_argument("--parallel", type=int, default=2, help="clean-shutdown fits running at once")
    parser.add_argument("--launcher", choices=["local", "testbed"], default="local")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="run folders (default: a fresh temporary folder)")
    parser.add_argument("--reuse-reference", action="store_true", help="keep a finished reference run in --work")
    parser.add_argument("--quick", action="store_true", help="kill + 2 shutdown fits, flexdemo only")
    parser.add_argument("--aggregate-only", action="store_true")
    args = parser.parse_args()
    if args.aggregate_only:
        summary = aggregate()
        print(json.dumps(summary, indent=1))
        print(markdown_table(summary))
        return
    if args.quick:
        args.scenarios, args.strategies, args.shutdown_strategies, args.repeats = (
            ["kill", "shutdown"],
            ["flexdemo"],
            ["flexdemo"],
            2,
        )
    work = args.work or Path(tempfile.mkdtemp(prefix="lh-reliability-"))
    print(f"run folders in {work}", flush=True)
    for strategy in args.strategies:
        faults = [s for s in args.scenarios if s != "shutdown"]
        if not faults:
            continue
        reference = work / f"reference-{strategy}"
        if args.reuse_reference and (reference / "final_rank0.pt").is_file():
            job = {"exit_code": 0, "seconds": None}
        else:
            job = run_job(
                strategy,
                reference,
                nodes=args.nodes,
                ranks_per_node=args.ranks_per_node,
                max_steps=args.max_steps,
                every=args.every,
                timeout=args.timeout,
                launcher=args.launcher,
            )
        print(f"reference {strategy}: exit {job['exit_code']} ({job['seconds']} s)", flush=True)
        if job["exit_code"]:
            print(job["log_tail"])
            continue
        cost = checkpoint_cost(reference, strategy)
        for scenario in faults:
            result = fault_run(args, scenario, strategy, reference, work)
            result["checkpoint_cost"] = cost if scenario == faults[0] else None
            record(result)
            shown = {k: result[k] for k in ("fault", "exit_code", "survived", "steps_lost", "bit_identical", "seconds")}
            print(f"{scenario} {strategy}: {shown}", flush=True)
            if result["exit_code"]:
                print(result["log_tail"])
    if "shutdown" in args.scenarios:
        for strategy in args.shutdown_strategies:
            record(shutdown_runs(args, strategy, work))
    print(json.dumps(aggregate(), indent=1))


if __name__ == "__main__":
    main()
