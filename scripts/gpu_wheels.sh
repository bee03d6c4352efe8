#!/usr/bin/env bash
# Download, here, the pure-Python wheels that the lent GPU machine lacks, for scripts/gpu_check.sh to install there.
#
# The device machine has no network. Its python3 (/opt/torch/.venv, Python 3.12) holds torch, transformers,
# safetensors, torchmetrics and pytorch-lightning, but not jsonargparse, and its lightning / pytest / hypothesis may
# differ from the versions this project is tested with. So the wheels below are the versions installed on THIS
# machine (what our CPU test runs use), pure Python only (never torch or anything compiled), saved into the ignored
# folder .gpu_wheels/ that the device `run` call names in `carry`.
#
#   bash scripts/gpu_wheels.sh            # writes .gpu_wheels/*.whl and .gpu_wheels/MANIFEST.txt
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
LIMIT_BYTES=$((16 * 1024 * 1024)) # the working tree that travels is limited to 64 MiB: stay far below
# The project's runtime and test needs that are pure Python, and their small pure dependencies.
PACKAGES=(
  lightning lightning-utilities jsonargparse docstring-parser typeshed-client importlib-resources
  pytest pytest-timeout pluggy iniconfig hypothesis sortedcontainers attrs
)
PY="${PYTHON:-python3}"
rm -rf "$DEST"
mkdir -p "$DEST"
specs=()
for name in "${PACKAGES[@]}"; do
  # Pin to the version installed here; fall back to the newest one the index has when it is not installed here.
  version=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")
  if [[ -n "$version" ]]; then specs+=("$name==$version"); else specs+=("$name"); fi
done
echo "downloading: ${specs[*]}"
# --only-binary with a py3.12 target: pip refuses sdists and compiled wheels of another interpreter, so what lands
# here installs on the device as is.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  --platform any -d "$DEST" "${specs[@]}"
for wheel in "$DEST"/*.whl; do
  case "$wheel" in
  *-none-any.whl) ;;
  *) echo "error: $wheel is not a pure-Python wheel; remove it from PACKAGES" >&2 && exit 1 ;;
  esac
done
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
(cd "$DEST" && printf '%s\n' *.whl) >"$DEST/MANIFEST.txt"
echo "$(wc -l <"$DEST/MANIFEST.txt") wheels, $total bytes in $DEST"
if ((total > LIMIT_BYTES)); then
  echo "error: $total bytes of wheels is over $LIMIT_BYTES; the carried tree must stay under 64 MiB" >&2
  exit 1
fi
