#!/usr/bin/env bash
# The checks that need CUDA GPUs, as one script (about 6 minutes on one H200; more GPUs add step 2).
#   bash experiments/gpu_checks.sh [OUT_DIR]
# Runs from the repository root without installing the package (PYTHONPATH=.), with whatever torch,
# transformers and peft the machine has. Writes logs and JSON under OUT_DIR (default results/gpu).
#   1. the CUDA tests: float64 sync == stream with every process on cuda:0
#   2. with >= 2 GPUs: a learner group on GPUs 0,1 (NCCL) against one learner, float64 (<= 1e-9)
#   3. learner compute and peak device memory at Qwen3-1.7B shapes (random weights, bf16): sync against
#      stream per arrival (K=1) and micro-batched (K=8); full fine-tuning with the buffers on the
#      device and in host memory, and LoRA. Targets: micro-batched stream <= 1.10x sync's compute;
#      stream's peak over sync's <= +5 % for LoRA and for full fine-tuning with buffers on the host
#   4. tsrl bench speedup on the toy workload with the processes on cuda:0 (labelled toy scale)
#   5. two stream rounds with the vllm engine (where vLLM is installed) and with hf, on cuda:0: round 2's
#      behavior log-probs against the learner's under the round-1 checkpoint, and generation tokens/s
#   6. a fold into pinned host buffers from cuda:0 (event, copy stream, the add over 1, 4 and 8 CPU threads):
#      GB/s, for the arithmetic of the host folds' share of a node round (results/LOG.md)
#   7. NEEDS A GPU: tsrl plan's learner figure (fake CPU tensors) against torch.cuda.max_memory_allocated of the same
#      pass and AdamW step on cuda:0, Qwen3-1.7B's config with random weights, bf16, 4096 tokens (<= 10 %)
# Steps 1, 4 and 5 (and step 2's OPD run) put the rollout engine and the learner's rank 0 on cuda:0. NCCL
# refuses two ranks of one communicator on one GPU, so the weight bus's auto backend joins co-located
# members over gloo through host copies (rl/weightbus.py choose_backend); step 2's GRPO run puts the
# engine on GPU 1 and the learner's rank 0 on GPU 0, so with >= 2 GPUs the bus also runs over NCCL.
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
  tail -n 12 "$OUT_DIR/$name.log"
}
$PY - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, transformers
try:
    import peft; pv = peft.__version__
except ImportError:
    pv = None
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "peft", pv)
print("gpus", n, [torch.cuda.get_device_name(i) for i in range(n)])
EOF
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
run pytest_cuda 240 $PY -m pytest -q -p no:cacheprovider tests/rl/test_lora_devices.py -x
if [ "${NGPU:-0}" -ge 2 ]; then
  run group_exact_grpo 240 $PY experiments/group_exact.py --learners 0,1 --rollout 1  # bus: NCCL, cuda:0 -> cuda:1
  run group_exact_opd_lora 240 $PY experiments/group_exact.py --learners 0,1 --rollout 0 --objective opd --lora-rank 8  # bus: gloo
else
  echo "=== group_exact: skipped, $NGPU GPU(s) here (a learner group needs 2)"
fi
COMPUTE="$PY experiments/learner_compute.py --device cuda --preset qwen3-1.7b --dtype bfloat16 --groups 4 --group-size 8 --length 1024 --max-tokens 16384 --bursts 1,8 --json"
run compute_full_device 150 $COMPUTE
run compute_full_host 150 $COMPUTE --buffer-device cpu
run compute_lora 150 $COMPUTE --lora-rank 16
run bench_gpu_h128 200 $PY -m tsrl_cli bench speedup --rounds 4 --schedules sync,stream --set devices.rollout=0 \
    --set devices.learner=0 --out /tmp/tsrl_gpu_bench_h128 --json
run engine_rounds_hf 200 $PY experiments/engine_rounds.py --engine hf --device cuda:0 --dtype float32 --json
if $PY -c "import vllm" 2>/dev/null; then
  run engine_rounds_vllm 300 $PY experiments/engine_rounds.py --engine vllm --device cuda:0 --json
else
  echo "=== engine_rounds_vllm: skipped, vLLM is not installed here"
fi
# a fold into pinned host buffers as the learner runs it (event, copy stream, parallel add), by thread count
run host_fold 60 $PY experiments/host_fold.py --device cuda:0 --threads 1,4,8 --grad-dtype bfloat16 --json
run plan_vs_cuda 200 $PY experiments/plan_vs_cuda.py --config experiments/node8/models/Qwen3-1.7B --tokens 4096 --json
echo "done; logs in $OUT_DIR"
