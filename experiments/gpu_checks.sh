#!/usr/bin/env bash
# The checks a first GPU run must pass, as one script that ends in one table.
#   bash experiments/gpu_checks.sh [OUT_DIR]         on a CUDA machine: every step on the GPUs, in under 8 minutes
#   bash experiments/gpu_checks.sh --cpu [OUT_DIR]   the dry run: the same steps and table on the CPU, tiny shapes
#   (TSRL_GPU_CHECKS_DEVICE=cpu is the same as --cpu)
# Runs from the repository root without installing the package (PYTHONPATH=.), with whatever torch, transformers,
# peft and vLLM the machine has (PYTHON=... picks the interpreter). Writes each step's log and JSON, env.txt and
# table.md under OUT_DIR (default results/gpu, results/gpu-dry-run for --cpu).
#
# Steps (each line below is what the step proves; a GPU-only claim is judged on a GPU only):
#   exact_one_device      float64: stream's weights equal sync's (<= 1e-9, the same tokens) with the rollout
#                         engine and the learner on one device; the weight bus joins those co-located members
#                         over gloo through host copies (NCCL refuses two ranks on one GPU)
#   plan_vs_measured      tsrl plan's fake-tensor figures for the learner's pass, AdamW's step and the teacher's
#                         costliest forward against torch.cuda.max_memory_allocated (<= 10 %; Qwen3-1.7B's
#                         config, random bf16 weights, 4096 tokens), and the CUDA context plus the allocator's
#                         slack against the plan's CUDA allowance (the dry run: against the tracker on real tensors)
#   compute_full_device   learner compute and peak memory, sync against stream per arrival (K=1) and micro-
#   compute_full_host     batched (K=8), Qwen3-1.7B shapes, bf16: full fine-tuning with the buffers on the device,
#   compute_lora          in pinned host memory, and LoRA r16. Targets (GPU): micro-batched stream <= 1.10x sync's
#                         compute; stream's peak over sync's <= 1.05 for LoRA and for buffers in host memory
#   exact_group_grpo      with >= 2 GPUs: a learner group on GPUs 0,1 (NCCL; the bus NCCL to the engine on GPU 1)
#   exact_group_opd_lora  streamed equals one learner's sync, float64 (<= 1e-9); OPD with LoRA, engine on GPU 0
#                         (dry run: two CPU ranks over gloo)
#   engine_rounds_hf      two stream rounds on the device: round 2's behavior log-probs match the learner's under the
#   engine_rounds_vllm    round-1 checkpoint better than under the initial weights (the engine took the published
#                         weights); generation tokens/s. vLLM where it is installed (not in the dry run)
#   host_fold             a fold into pinned host buffers (event, copy stream, the add over 1, 4 and 8 threads): GB/s
# Exit 1 when a step did not finish (error, timeout, out of the time budget) or a correctness check failed
# (exactness, the engine's weights, the plan within 10 %); performance targets are reported as met or missed.
# Every step has a timeout inside one budget of TSRL_GPU_CHECKS_BUDGET_S seconds (default 450): a step that would
# start with less than 20 s left is not run, and says so. TSRL_GPU_CHECKS_STEPS=a,b runs those steps only (a rerun).
set -euo pipefail

DEVICE=${TSRL_GPU_CHECKS_DEVICE:-cuda}
if [ "${1:-}" = "--cpu" ]; then
  DEVICE=cpu
  shift
fi
case "$DEVICE" in cpu|cuda) ;; *) echo "gpu_checks: TSRL_GPU_CHECKS_DEVICE must be cpu or cuda, got $DEVICE" >&2; exit 2 ;; esac
if [ "$DEVICE" = cpu ]; then DEFAULT_OUT=results/gpu-dry-run; else DEFAULT_OUT=results/gpu; fi
OUT_DIR=${1:-${OUT:-$DEFAULT_OUT}}
mkdir -p "$OUT_DIR"
rm -rf -- "$OUT_DIR/runs"  # the training runs of an earlier call (a run directory is never overwritten)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET_S=${TSRL_GPU_CHECKS_BUDGET_S:-450}
START_S=$(date +%s)
STEPS="$OUT_DIR/steps.tsv"
printf 'step\trc\tseconds\tproves\n' > "$STEPS"

step() {  # name, cap seconds, what it proves, command...: never stops the script; records rc and seconds
  local name=$1 cap=$2 proves=$3
  shift 3
  if [ -n "${TSRL_GPU_CHECKS_STEPS:-}" ] && [[ ",$TSRL_GPU_CHECKS_STEPS," != *",$name,"* ]]; then
    skip "$name" "not in TSRL_GPU_CHECKS_STEPS"
    return 0
  fi
  local left=$(( BUDGET_S - ($(date +%s) - START_S) ))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: not run, $left s of the ${BUDGET_S} s budget left"
    printf '%s\t%s\t%s\t%s\n' "$name" "budget" 0 "$proves" >> "$STEPS"
    return 0
  fi
  local t=$(( cap < left ? cap : left ))
  echo "=== $name ($proves): $*"
  local t0 rc
  t0=$(date +%s)
  if timeout "$t" "$@" > "$OUT_DIR/$name.out" 2> "$OUT_DIR/$name.log"; then rc=0; else rc=$?; fi
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s (timeout $t s)"
  if [ "$rc" -ne 0 ]; then tail -n 12 "$OUT_DIR/$name.log"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$proves" >> "$STEPS"
}

skip() {  # name, why
  echo "=== $1: skipped, $2"
  printf '%s\t%s\t%s\t%s\n' "$1" "skipped" 0 "$2" >> "$STEPS"
}

"$PY" - "$DEVICE" <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import sys
import torch, transformers
try:
    import peft; pv = peft.__version__
except ImportError:
    pv = None
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("device", sys.argv[1], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "peft", pv)
print("gpus", n, [torch.cuda.get_device_name(i) for i in range(n)])
if sys.argv[1] == "cuda" and n == 0:
    sys.exit("gpu_checks: no CUDA GPU here; run the dry run with --cpu")
EOF
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
HAS_VLLM=0
if [ "$DEVICE" = cuda ] && "$PY" -c "import vllm" 2> /dev/null; then HAS_VLLM=1; fi

if [ "$DEVICE" = cuda ]; then
  ONE=(--learners 0 --rollout 0)
  GROUP_GRPO=(--learners "0,1" --rollout 1)
  GROUP_OPD=(--learners "0,1" --rollout 0)
  PLAN=(--device cuda --config experiments/node8/models/Qwen3-1.7B --tokens 4096)
  COMPUTE=(--device cuda --preset qwen3-1.7b --dtype bfloat16 --groups 4 --group-size 8 --length 1024
           --max-tokens 16384 --bursts "1,8")
  ENGINE=(--device cuda:0 --dtype float32)
  FOLD=(--device cuda:0 --threads "1,4,8" --grad-dtype bfloat16)
else
  ONE=(--learners cpu --rollout cpu)
  GROUP_GRPO=(--learners cpu:2 --rollout cpu)
  GROUP_OPD=(--learners cpu:2 --rollout cpu)
  PLAN=(--device cpu --tiny)
  COMPUTE=(--device cpu --preset small --dtype float64 --groups 2 --group-size 4 --length 64 --max-tokens 1024
           --bursts "1,8" --repeats 1)
  ENGINE=(--device cpu --dtype float64)
  FOLD=(--device cpu --threads "1,2" --elements 4194304 --repeats 2)
fi

step exact_one_device 120 "float64 stream == sync, rollout and learner on one device" \
  "$PY" experiments/group_exact.py "${ONE[@]}" --rounds 2 --out "$OUT_DIR/runs/exact_one_device"
step plan_vs_measured 120 "tsrl plan's learner, step and teacher figures within 10 % of the allocations" \
  "$PY" experiments/plan_vs_cuda.py "${PLAN[@]}" --json
step compute_full_device 90 "learner compute and peak, full fine-tuning, buffers on the device" \
  "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --json
step compute_full_host 90 "learner compute and peak, full fine-tuning, buffers in pinned host memory" \
  "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --buffer-device cpu --json
step compute_lora 90 "learner compute and peak, LoRA r16" \
  "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --lora-rank 16 --json
if [ "$DEVICE" = cpu ] || [ "$NGPU" -ge 2 ]; then
  step exact_group_grpo 120 "float64 a 2-rank learner group's stream == one learner's sync, GRPO" \
    "$PY" experiments/group_exact.py "${GROUP_GRPO[@]}" --rounds 2 --out "$OUT_DIR/runs/exact_group_grpo"
  step exact_group_opd_lora 120 "float64 a 2-rank learner group's stream == one learner's sync, OPD with LoRA" \
    "$PY" experiments/group_exact.py "${GROUP_OPD[@]}" --rounds 2 --objective opd --lora-rank 8 \
    --out "$OUT_DIR/runs/exact_group_opd_lora"
else
  skip exact_group_grpo "$NGPU GPU here: a learner group needs 2"
  skip exact_group_opd_lora "$NGPU GPU here: a learner group needs 2"
fi
step engine_rounds_hf 90 "the hf engine takes the published weights each round" \
  "$PY" experiments/engine_rounds.py --engine hf "${ENGINE[@]}" --out "$OUT_DIR/runs/engine_rounds" --json
if [ "$HAS_VLLM" = 1 ]; then
  step engine_rounds_vllm 150 "the vLLM engine takes the published weights each round" \
    "$PY" experiments/engine_rounds.py --engine vllm --device cuda:0 --out "$OUT_DIR/runs/engine_rounds" --json
elif [ "$DEVICE" = cpu ]; then
  skip engine_rounds_vllm "the dry run uses the hf engine (vLLM on CPU: the vllm-marked tests)"
else
  skip engine_rounds_vllm "vLLM is not installed here"
fi
step host_fold 45 "a fold's GB/s into pinned host buffers" \
  "$PY" experiments/host_fold.py "${FOLD[@]}" --json

# the table: every step's verdict from its JSON (the last JSON line of its stdout)
"$PY" - "$OUT_DIR" "$DEVICE" <<'EOF' | tee "$OUT_DIR/table.md"
import csv
import json
import sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
gpu = device == "cuda"
steps = list(csv.DictReader((out / "steps.tsv").open(), delimiter="\t"))


def doc(name):
    f = out / f"{name}.out"
    for line in reversed(f.read_text().splitlines() if f.is_file() else []):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            return d
    return None


def gib(b):
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


rows, failed = [], []


def row(step, check, result, target, verdict):
    rows.append((step, check, result, target, verdict))
    if verdict in ("FAIL", "ERROR"):
        failed.append(step)


for s in steps:
    name, rc = s["step"], s["rc"]
    if rc == "skipped":
        row(name, s["proves"], "skipped", "-", "skipped")
        continue
    d = doc(name)
    if rc == "budget":
        row(name, s["proves"], "not run: out of the time budget", "-", "ERROR")
        continue
    if d is None:
        row(name, s["proves"], f"no result (rc {rc}; see {name}.log)", "-", "ERROR")
        continue
    if name.startswith("exact"):
        ok = d["tokens_identical"] and d["weights_max_rel_diff"] <= 1e-9
        row(name, "sync == stream, float64", f"tokens identical {d['tokens_identical']}, weights "
            f"{d['weights_max_rel_diff']:.1e}", "<= 1e-9", "PASS" if ok else "FAIL")
    elif name == "plan_vs_measured":
        for k in ("pass", "step", "teacher"):
            r = d[k]
            row(name, f"plan vs measured: {k}", f"{gib(r['plan_bytes'])} vs {gib(r['measured_bytes'])} "
                f"({r['rel_diff']:.1%})", "<= 10 %", "PASS" if r["ok"] else "FAIL")
        if gpu:
            row(name, "CUDA context + allocator slack", f"{gib(d['cuda_context_bytes'])} + "
                f"{gib(d['allocator_slack_bytes'])}", f"<= {gib(d['cuda_runtime_allowance_bytes'])} (the plan's "
                "allowance)", "PASS" if d["runtime_within_allowance"] else "FAIL")
    elif name.startswith("compute"):
        runs = d["runs"]
        micro = max((k for k in runs if k.startswith("stream")), key=lambda k: int(k.split("=")[1]))
        ratio = runs[micro]["compute_over_sync"]
        exact = max(r["grad_max_rel_diff"] for r in runs.values())
        row(name, f"learner compute, {micro} / sync", f"{ratio:.2f}x (K=1: {runs['stream K=1']['compute_over_sync']:.2f}x)",
            "<= 1.10x", ("met" if ratio <= 1.10 else "missed") if gpu else "dry run")
        streams = [k for k in runs if k.startswith("stream")]
        placement = {"compute_full_device": "buffers on the device", "compute_full_host": "buffers in host memory",
                     "compute_lora": "LoRA"}[name]
        if runs["sync"]["peak_device_bytes"] is not None:  # the worst stream run's peak against sync's
            top = max(streams, key=lambda k: runs[k]["peak_device_bytes"])
            peak = runs[top]["peak_device_over_sync"]
            target = "reported" if name == "compute_full_device" else "<= 1.05"
            verdict = "-" if name == "compute_full_device" else ("met" if peak <= 1.05 else "missed")
            row(name, f"peak stream / sync, {placement}", f"{gib(runs['sync']['peak_device_bytes'])} -> "
                f"{gib(runs[top]['peak_device_bytes'])} ({top}: {peak:.3f}x)", target, verdict)
        else:
            top = max(streams, key=lambda k: runs[k]["accumulator_peak_bytes"])
            acc = runs[top]["accumulator_peak_bytes"] / runs["sync"]["accumulator_peak_bytes"]
            row(name, f"accumulator peak stream / sync, {placement}", f"{acc:.2f}x ({top}; no device counter on "
                "the CPU)", "-", "dry run")
        if d["dtype"] == "float64":
            row(name, "stream's gradient vs sync's", f"{exact:.1e}", "<= 1e-9 (float64)", "PASS" if exact <= 1e-9 else "FAIL")
        else:  # bf16 sums round differently in sync's p.grad and stream's float32 buffers: not an exactness check
            row(name, "stream's gradient vs sync's", f"{exact:.1e}", f"reported ({d['dtype']})", "-")
    elif name.startswith("engine_rounds"):
        ok = d["took_new_weights"]
        row(name, "round 2 generated with round 1's weights", f"gap {d['round2_vs_round1_ckpt']['max']:.1e} vs initial "
            f"{d['round2_vs_initial']['max']:.1e}; {sum(d['gen_tokens_per_s']) / len(d['gen_tokens_per_s']):.0f} tokens/s",
            "smaller than the initial weights' gap", "PASS" if ok else "FAIL")
    elif name == "host_fold":
        best = max(r["gb_per_s"] for r in d["rows"])
        row(name, "fold into pinned host buffers", f"{best:.2f} GB/s (threads {','.join(str(r['threads']) for r in d['rows'])})",
            "reported", "-")
    if rc != "0" and name not in failed:  # a non-zero exit that no check above explains
        row(name, "exit status", f"rc {rc} (see {name}.log)", "0", "ERROR")

print(f"gpu_checks on {device}" + ("" if gpu else " (the dry run: tiny shapes, GPU targets not judged)"))
print()
print("| step | check | result | target | verdict |")
print("|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
print()
print("gpu_checks: " + ("every check passed" if not failed else "FAILED: " + ", ".join(dict.fromkeys(failed))))
sys.exit(1 if failed else 0)
EOF
