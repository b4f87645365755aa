#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script (about 5 minutes on one H200).
#   bash experiments/gpu_checks.sh [OUT_DIR]
# Runs from the repository root without installing the package (PYTHONPATH=.), with whatever torch,
# transformers and peft the machine has. Writes logs and JSON under OUT_DIR (default results/gpu).
#   1. float64 sync == stream with every process on cuda:0 (tests/rl/test_lora_devices.py, the gpu test)
#   2. stream's extra memory, full fine-tuning against LoRA, on Qwen3-1.7B shapes (random weights)
#   3. tsrl bench speedup with rollout and learner processes on cuda:0 (toy workload; labelled so)
set -u -o pipefail
OUT_DIR=${1:-${OUT:-results/gpu}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
run() {  # name, timeout seconds, command...: never stops the script, records the exit code
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -n 15 "$OUT_DIR/$name.log"
}
$PY - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, transformers
try:
    import peft; pv = peft.__version__
except ImportError:
    pv = None
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "peft", pv)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF
run pytest_cuda 300 $PY -m pytest -q -p no:cacheprovider tests/rl/test_lora_devices.py tests/test_streaming_exact.py -x
for args in "--lora-rank 16" "--lora-rank 8 --max-open-groups 1"; do
  tag=$(echo "$args" | tr -d ' -')
  run "memory_$tag" 300 $PY experiments/memory_lora.py --device cuda --preset qwen3-1.7b --dtype bfloat16 \
      --length 1024 --groups 4 --group-size 8 $args --json
done
run bench_gpu_h128 400 $PY -m tsrl_cli bench speedup --rounds 6 --set devices.rollout=0 --set devices.learner=0 \
    --set devices.teacher=0 --out /tmp/tsrl_gpu_bench_h128 --json
if [ -f data/cache/toy/h256-l8/config.json ]; then
  run bench_gpu_h256l8 400 $PY -m tsrl_cli bench speedup --rounds 6 --hidden 256 --layers 8 --tool-latency 0.3 \
      --set devices.rollout=0 --set devices.learner=0 --out /tmp/tsrl_gpu_bench_h256 --json
fi
echo "done; logs in $OUT_DIR"
