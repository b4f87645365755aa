#!/usr/bin/env bash
# The checks a first run on one lent GPU (an 80 GB H100, a 128 GiB host) must pass, as one script that ends in one
# table.
#   bash experiments/gpu_checks.sh [OUT_DIR]           on a CUDA machine: every step on GPU 0
#   bash experiments/gpu_checks.sh --cpu [OUT_DIR]     the same steps and table on the CPU, tiny shapes
#   bash experiments/gpu_checks.sh --dry-run [--cpu]   print the steps, their caps, the budget and the files it writes;
#                                                      run nothing (exit 1 when the caps add up to more than the budget)
#   (TSRL_GPU_CHECKS_DEVICE=cpu is the same as --cpu)
# Runs from the repository root without installing the package (PYTHONPATH=.), with whatever torch, transformers and
# peft the machine has (PYTHON=... picks the interpreter). Writes three files under OUT_DIR (default $OUT, else
# results/gpu, results/gpu-dry-run for --cpu): table.md (every check's verdict), env.txt (the software and the GPU)
# and steps.tar.gz (steps.tsv and each step's stdout <step>.out and stderr <step>.log), the tarball refreshed after
# every step so that a run stopped early still leaves what it did. Run directories stay in a temporary folder.
#
# Steps (each line below is what the step proves; a GPU-only claim is judged on a GPU only):
#   exact_one_device      float64: stream's weights equal sync's (<= 1e-9, the same tokens) with the rollout
#                         engine and the learner on one device
#   plan_vs_measured      tsrl plan's fake-tensor figures for the learner's pass, AdamW's step and the teacher's
#                         costliest forward against torch.cuda.max_memory_allocated (<= 10 %; Qwen3-1.7B's config,
#                         random bf16 weights, 4096 tokens), and the CUDA context plus the allocator's slack against
#                         the plan's CUDA allowance (the CPU run: against the tracker on real tensors)
#   fsdp_rank_8b          rank 0 of a 4-rank FSDP2 group at Qwen3-8B's shapes through the fake process group
#                         (experiments/fsdp_rank.py: float32 masters of bf16 weights, activation checkpointing,
#                         chunked logits, one 32768-token row a pass, host folds into pinned sets, one AdamW step):
#                         peak device memory against tsrl plan, the pinned bytes against its request, the fold
#                         queue's depth and the pass time (the CPU run: a tiny Qwen3, no device counters)
#   compute_full_device   learner compute and peak memory, sync against stream per arrival (K=1) and micro-
#   compute_full_host     batched (K=8), Qwen3-1.7B shapes, bf16, 2 groups of 4, micro-batches of 4096 tokens: full
#   compute_lora          fine-tuning with the buffers on the device (5 sets of 6.9 GB), in pinned host memory (the
#                         same 5 sets: 47 GiB held with one fold's staging, pinned_block_bytes' rounding), and LoRA
#                         r16. Targets (GPU): micro-batched stream <= 1.10x sync's compute; stream's peak over
#                         sync's <= 1.05 for LoRA and for buffers in host memory
#   engine_rounds_hf      two stream rounds on the device: round 2's behavior log-probs match the learner's under the
#                         round-1 checkpoint better than under the initial weights (the engine took the published
#                         weights); generation tokens/s
#   host_fold             a fold into pinned host buffers (event, copy stream, the add over 1, 4 and 8 threads): GB/s
# A learner group over two GPUs and vLLM's engine need what one lent machine lacks (a second GPU; vLLM, which it
# does not have and cannot fetch): the group is checked on CPU ranks by tests/rl/test_group.py, vLLM by the
# vllm-marked tests (.ci/run).
# Exit 1 when a step did not finish (error, timeout, out of the time budget) or a correctness check failed
# (exactness, the engine's weights, the plan's figures); performance targets are reported as met or missed.
# Every step has a cap (STEPS below), and the caps add up to at most the budget, TSRL_GPU_CHECKS_BUDGET_S seconds
# (default 450, 7.5 minutes; --dry-run checks the sum): a step that would start with less than 20 s of the budget
# left is not run, and says so. On the CPU every cap and the default budget are CPU_SCALE times the GPU's.
# TSRL_GPU_CHECKS_STEPS=a,b runs those steps only (a rerun).
set -euo pipefail

# name|cap in seconds on the GPU|what it proves
STEPS=(
  "exact_one_device|40|float64 stream == sync, rollout and learner on one device"
  "plan_vs_measured|70|tsrl plan's learner, step and teacher figures within 10 % of the allocations"
  "fsdp_rank_8b|150|one rank of a 4-rank FSDP2 group at Qwen3-8B shapes against tsrl plan"
  "compute_full_device|40|learner compute and peak, full fine-tuning, buffers on the device"
  "compute_full_host|60|learner compute and peak, full fine-tuning, buffers in pinned host memory"
  "compute_lora|30|learner compute and peak, LoRA r16"
  "engine_rounds_hf|30|the hf engine takes the published weights each round"
  "host_fold|20|a fold's GB/s into pinned host buffers"
)
OUTPUTS=(table.md env.txt steps.tar.gz)  # everything written under OUT_DIR: at most 8 files come back from a lent GPU
CPU_SCALE=3

DEVICE=${TSRL_GPU_CHECKS_DEVICE:-cuda}
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) DEVICE=cpu; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) break ;;
  esac
done
case "$DEVICE" in cpu|cuda) ;; *) echo "gpu_checks: TSRL_GPU_CHECKS_DEVICE must be cpu or cuda, got $DEVICE" >&2; exit 2 ;; esac
SCALE=1
if [ "$DEVICE" = cpu ]; then SCALE=$CPU_SCALE; fi
BUDGET_S=${TSRL_GPU_CHECKS_BUDGET_S:-$(( 450 * SCALE ))}

cap_of() {  # name -> its cap in seconds on this device
  local entry
  for entry in "${STEPS[@]}"; do
    IFS='|' read -r n c _ <<< "$entry"
    if [ "$n" = "$1" ]; then echo $(( c * SCALE )); return 0; fi
  done
  echo "gpu_checks: no step $1 in STEPS" >&2
  exit 2
}

proves_of() {
  local entry
  for entry in "${STEPS[@]}"; do
    IFS='|' read -r n _ p <<< "$entry"
    if [ "$n" = "$1" ]; then echo "$p"; return 0; fi
  done
}

if [ "$DRY_RUN" = 1 ]; then
  total=0
  echo "gpu_checks --dry-run on $DEVICE: ${#STEPS[@]} steps, budget $BUDGET_S s"
  printf '%-22s %6s  %s\n' step cap_s proves
  for entry in "${STEPS[@]}"; do
    IFS='|' read -r n _ p <<< "$entry"
    c=$(cap_of "$n")
    total=$(( total + c ))
    printf '%-22s %6s  %s\n' "$n" "$c" "$p"
  done
  echo "outputs: ${OUTPUTS[*]} (${#OUTPUTS[@]} files)"
  if [ "$total" -gt "$BUDGET_S" ] || [ "${#OUTPUTS[@]}" -gt 8 ]; then
    echo "gpu_checks: caps $total s > budget $BUDGET_S s, or more than 8 output files"
    exit 1
  fi
  echo "caps $total s <= budget $BUDGET_S s"
  exit 0
fi

if [ "$DEVICE" = cpu ]; then DEFAULT_OUT=results/gpu-dry-run; else DEFAULT_OUT=results/gpu; fi
OUT_DIR=${1:-${OUT:-$DEFAULT_OUT}}
mkdir -p "$OUT_DIR"
rm -f -- "${OUTPUTS[@]/#/$OUT_DIR/}"  # an earlier call's
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tsrl-gpu-checks.XXXXXX")
trap 'rm -rf -- "$WORK"' EXIT
LOGS="$WORK/logs"
mkdir -p "$LOGS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START_S=$(date +%s)
printf 'step\trc\tseconds\tproves\n' > "$LOGS/steps.tsv"

pack() {  # the logs so far, into OUT_DIR
  tar -czf "$OUT_DIR/steps.tar.gz" -C "$LOGS" .
}

step() {  # name, command...: never stops the script; records rc and seconds
  local name=$1 cap proves
  shift
  cap=$(cap_of "$name")
  proves=$(proves_of "$name")
  if [ -n "${TSRL_GPU_CHECKS_STEPS:-}" ] && [[ ",$TSRL_GPU_CHECKS_STEPS," != *",$name,"* ]]; then
    echo "=== $name: skipped, not in TSRL_GPU_CHECKS_STEPS"
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 "not in TSRL_GPU_CHECKS_STEPS" >> "$LOGS/steps.tsv"
    return 0
  fi
  local left=$(( BUDGET_S - ($(date +%s) - START_S) ))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: not run, $left s of the ${BUDGET_S} s budget left"
    printf '%s\t%s\t%s\t%s\n' "$name" "budget" 0 "$proves" >> "$LOGS/steps.tsv"
    pack
    return 0
  fi
  local t=$(( cap < left ? cap : left ))
  echo "=== $name ($proves): $*"
  local t0 rc
  t0=$(date +%s)
  if timeout "$t" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.log"; then rc=0; else rc=$?; fi
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s (cap $t s)"
  if [ "$rc" -ne 0 ]; then tail -n 12 "$LOGS/$name.log"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$proves" >> "$LOGS/steps.tsv"
  pack
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
print("gpus", n, [torch.cuda.get_device_name(i) for i in range(n)],
      [f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} GiB" for i in range(n)])
if sys.argv[1] == "cuda" and n == 0:
    sys.exit("gpu_checks: no CUDA GPU here; run the CPU run with --cpu")
EOF

if [ "$DEVICE" = cuda ]; then
  ONE=(--learners 0 --rollout 0)
  PLAN=(--device cuda --config experiments/node8/models/Qwen3-1.7B --tokens 4096)
  FSDP=(--device cuda)
  COMPUTE=(--device cuda --preset qwen3-1.7b --dtype bfloat16 --groups 2 --group-size 4 --length 1024
           --max-tokens 4096 --bursts "1,8" --repeats 1)
  ENGINE=(--device cuda:0 --dtype float32)
  FOLD=(--device cuda:0 --threads "1,4,8" --grad-dtype bfloat16)
else
  ONE=(--learners cpu --rollout cpu)
  PLAN=(--device cpu --tiny)
  FSDP=(--device cpu --tiny)
  COMPUTE=(--device cpu --preset small --dtype float64 --groups 2 --group-size 4 --length 64 --max-tokens 1024
           --bursts "1,8" --repeats 1)
  ENGINE=(--device cpu --dtype float64)
  FOLD=(--device cpu --threads "1,2" --elements 4194304 --repeats 2)
fi

step exact_one_device "$PY" experiments/group_exact.py "${ONE[@]}" --rounds 2 --out "$WORK/runs/exact_one_device"
step plan_vs_measured "$PY" experiments/plan_vs_cuda.py "${PLAN[@]}" --json
step fsdp_rank_8b "$PY" experiments/fsdp_rank.py "${FSDP[@]}" --json
step compute_full_device "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --json
step compute_full_host "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --buffer-device cpu --json
step compute_lora "$PY" experiments/learner_compute.py "${COMPUTE[@]}" --lora-rank 16 --json
step engine_rounds_hf "$PY" experiments/engine_rounds.py --engine hf "${ENGINE[@]}" --out "$WORK/runs/engine_rounds" --json
step host_fold "$PY" experiments/host_fold.py "${FOLD[@]}" --json

# the table: every step's verdict from its JSON (the last JSON line of its stdout)
set +e
"$PY" - "$LOGS" "$DEVICE" <<'EOF' | tee "$OUT_DIR/table.md"
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
        row(name, s["proves"], f"no result (rc {rc}; see {name}.log in steps.tar.gz)", "-", "ERROR")
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
    elif name == "fsdp_rank_8b":
        note = f"; the templates' {gib(d['templates_bytes'])} are not in the plan"
        for k, what in (("pass_memory", "peak device memory, the passes"), ("step_memory", "peak device memory, "
                                                                                           "hand-over and AdamW")):
            r = d.get(k)
            if r is None:
                row(name, what, "no device counter on the CPU", "-", "CPU run")
                continue
            span = gib(r["plan_bytes"]) if r["plan_low_bytes"] == r["plan_bytes"] else \
                f"{gib(r['plan_low_bytes'])}-{gib(r['plan_bytes'])}"
            row(name, what, f"{gib(r['measured_bytes'])} vs plan {span} ({r['rel_diff']:+.1%}{note})",
                "within the plan +- 10 %", "PASS" if r["ok"] else "FAIL")
        r = d["pinned_buffers"]
        row(name, "pinned buffer sets vs the plan's request", f"{gib(r['measured_bytes'])} vs {gib(r['plan_bytes'])}",
            "equal", "PASS" if r["ok"] else "FAIL")
        r = d.get("pinned_held")
        if r is not None:
            row(name, "pinned bytes held vs the plan's blocks", f"{gib(r['measured_bytes'])} vs {gib(r['plan_bytes'])} "
                f"({r['rel_diff']:+.1%})", "<= 10 %", "PASS" if r["ok"] else "FAIL")
        row(name, "fold queue and pass time", f"queued passes {d['queued_passes']}, {d['fold_waits']} waits "
            f"({d['fold_wait_s']:.1f} s); passes {', '.join(f'{x:.1f}' for x in d['pass_s'])} s, close "
            f"{d['close_s']:.1f} s, hand-over and step {d['step_s']:.1f} s", "reported", "-")
    elif name.startswith("compute"):
        runs = d["runs"]
        micro = max((k for k in runs if k.startswith("stream")), key=lambda k: int(k.split("=")[1]))
        ratio = runs[micro]["compute_over_sync"]
        exact = max(r["grad_max_rel_diff"] for r in runs.values())
        row(name, f"learner compute, {micro} / sync", f"{ratio:.2f}x (K=1: {runs['stream K=1']['compute_over_sync']:.2f}x)",
            "<= 1.10x", ("met" if ratio <= 1.10 else "missed") if gpu else "CPU run")
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
                "the CPU)", "-", "CPU run")
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
    row(name, "seconds", f"{s['seconds']} s", "within the step's cap", "-")
    if rc != "0" and name not in failed:  # a non-zero exit that no check above explains
        row(name, "exit status", f"rc {rc} (see {name}.log in steps.tar.gz)", "0", "ERROR")

print(f"gpu_checks on {device}" + ("" if gpu else " (the CPU run: tiny shapes, GPU targets not judged)"))
print()
print("| step | check | result | target | verdict |")
print("|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
print()
print("gpu_checks: " + ("every check passed" if not failed else "FAILED: " + ", ".join(dict.fromkeys(failed))))
sys.exit(1 if failed else 0)
EOF
rc=${PIPESTATUS[0]}
pack
exit "$rc"
