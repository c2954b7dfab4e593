#!/usr/bin/env bash
# The one command for a GPU host (issue 33): every figure as a JSON line in $OUT/gpu_check.jsonl, written as
# each phase ends, the most important first, each phase under its own `timeout` so that a run cut off at the
# host's limit still brings back what finished.
#
#   scripts/gpu_check.sh all [--with-trl]   # one call (<= 8 min with the ~25 s install): the plan below
#   scripts/gpu_check.sh bench [--with-trl] # engine vs HF (with a profile of one decode step), ours vs TRL
#   scripts/gpu_check.sh tests              # tests/cuda only (the graph tests, then the rest)
#   scripts/gpu_check.sh suite              # the CPU suite with the GPU visible (a call of its own, ~10 min)
#   add --dry-run to print the plan (each phase's command and time limit, their sum) instead of running it
#
# The plan of `all`, in priority order: engine vs HF generate at 512 rows x 256 tokens, bf16, SmolLM2-135M's
# shape, with one decode step's profile (rollout.py --profile-step); ours vs TRL on TRL's GRPO workload (64
# prompts x 8, 256 tokens; TRL's own GRPOTrainer on the same model and prompts with --with-trl); tests/cuda
# (the captured decode step first); a GRPO main_ppo on CUDA with a save and an exact resume.
#
# Run from the project's root, hybridflow installed with a CUDA torch (docs/gpu.md), or on a lent host as below.
# Environment: PY (python3), OUT ($OUT or ./gpu_check_out), XDIST (8: pytest-xdist processes for `suite`),
# PEERS (../shared/peers or ./shared/peers: trl/trl_grpo_bench.py for --with-trl), INSTALL_S (25: the
# install's seconds, counted in the plan), BUDGET_S (480: the plan must fit it).
set -uo pipefail

# On a lent, time-limited GPU host (how this project measures; a user with a GPU needs none of it): the host
# gives 15 minutes, its 1-2 minute start included, and at most one 10-minute command. So the check is one call:
# the install from ../shared/device (one carried folder, ~25 s, PYTHONPATH=/tmp/site), then this script, whose
# phases run in priority order, each under its own `timeout`, each figure appended to $OUT/gpu_check.jsonl as
# its phase ends ($OUT comes back even when the command is cut off):
#
#   bash .device/install.sh && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 && \
#     OUT=$OUT PY=python3 scripts/gpu_check.sh all --with-trl
#
# `all --with-trl --dry-run` prints the plan, and tests/test_gpu_check_script.py holds it to <= 8 min with the
# install. The phases of `all`, with their limits:
#   engine_vs_hf          110 s  engine vs HF generate, 512 rows x 256 tokens, bf16, SmolLM2-135M's shape, fixed
#                                and variable length, with step_profile: one full-batch decode step's aten ops,
#                                host reads, ms per step, the profiler's kernel count, top kernels and GPU busy
#                                time (benchmarks/rollout.py --profile-step)
#   assets, grpo_step      15 + 80 s  our GRPO step on TRL's workload (64 prompts x 8, 256 tokens), one warm-up
#                                step and one measured
#   trl_data, trl_grpo_step 10 + 90 s  with --with-trl: TRL's GRPOTrainer on the same model and prompts (two
#                                steps), then vs_trl (needs $PEERS/trl, the peer harness outside the repository)
#   tests_cuda_graphs      45 s  tests/cuda/test_cuda_graphs.py: the captured step's tokens against the eager
#                                step's, bf16 near-ties counted, one read per burst, padding, weight updates,
#                                re-capture time
#   resume_check          100 s  main_ppo on CUDA, 3 GRPO steps saved at 2, the resume repeating step 3 exactly
# `tests` (the graph tests, then the rest of tests/cuda: GRPO, PPO, LoRA, exact resume and the merger through
# main_ppo, > 80 s of Ray start) and `suite` (the CPU suite with the GPU visible) are calls of their own; `bench`
# is the first two rows. Record the JSON lines in docs/benchmarks.md with the date and the machine.

PHASE=${1:-}
shift || true
WITH_TRL=0
DRY=0
for arg in "$@"; do
    case "$arg" in
        --with-trl) WITH_TRL=1 ;;
        --dry-run) DRY=1 ;;
        *) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done
case "$PHASE" in
    all | bench | tests | suite) ;;
    *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY=${PY:-python3}
OUT=${OUT:-$ROOT/gpu_check_out}
XDIST=${XDIST:-8}
INSTALL_S=${INSTALL_S:-25}
BUDGET_S=${BUDGET_S:-480}
if [ -z "${PEERS:-}" ]; then  # the device machine gets shared/ inside the checkout
    PEERS=$ROOT/../shared/peers
    [ -d "$ROOT/shared/peers" ] && PEERS=$ROOT/shared/peers
fi
RESULTS="$OUT/gpu_check.jsonl"
WORK="$OUT/work"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
FAILED=0
PLANNED=0

# step NAME LIMIT_S CMD...: run CMD under `timeout LIMIT_S` (its output in $OUT/NAME.log); its JSON lines
# (lines starting with "{") go to $RESULTS, then {"check": NAME, "rc": ..., "wall_s": ..., "limit_s": ...}.
step() {
    local name=$1 limit=$2
    shift 2
    PLANNED=$((PLANNED + limit))
    if [ "$DRY" = 1 ]; then
        echo "[$name] timeout $limit $*"
        return 0
    fi
    echo "gpu_check: $name (at most ${limit}s) ..." >&2
    local start rc
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    grep '^{' "$OUT/$name.log" >> "$RESULTS"
    printf '{"check": "%s", "rc": %d, "wall_s": %d, "limit_s": %d}\n' "$name" "$rc" \
        "$(($(date +%s) - start))" "$limit" | tee -a "$RESULTS"
    [ "$rc" = 0 ] || { FAILED=1; tail -n 30 "$OUT/$name.log" >&2; }
}

# pytest_summary NAME XML: one JSON line of a junit file's counts
pytest_summary() {
    [ "$DRY" = 1 ] || [ ! -f "$2" ] && return 0
    "$PY" - "$1" "$2" <<'PY' | tee -a "$RESULTS"
import json, sys, xml.etree.ElementTree as ET
name, path = sys.argv[1], sys.argv[2]
suites = ET.parse(path).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
count = lambda key: sum(int(s.get(key, 0)) for s in suites)
failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
          if c.find("failure") is not None or c.find("error") is not None]
print(json.dumps({"pytest": name, "tests": count("tests"), "failures": count("failures"),
                  "errors": count("errors"), "skipped": count("skipped"), "failed": failed[:20]}))
PY
}

engine_vs_hf() {  # 1: the engine's decode speed against HF generate, and where one decode step's time goes
    step engine_vs_hf 110 "$PY" benchmarks/rollout.py --model smollm2 --device cuda --dtype bf16 \
        --prompts 128 --n 4 --new-tokens 256 --max-prompt 64 --max-num-seqs 512 --profile-step
}

ours_vs_trl() {  # 2: a GRPO step on TRL's workload, ours and (--with-trl) TRL's, same model and prompts
    step assets 15 "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import grpo_step, pathlib, json; \
m, t = grpo_step.default_assets(pathlib.Path('$WORK'), 'smollm2'); print(json.dumps({'model': m, 'train': t}))"
    local model="$WORK/model" train="$WORK/data/train.parquet"
    step grpo_step 80 "$PY" benchmarks/grpo_step.py --device cuda --workers 1 --model "$model" \
        --train-file "$train" --prompts 64 --n 8 --max-prompt-length 64 --max-response-length 256 --steps 2 \
        --kl-coef 0 --lr 1e-5
    [ "$WITH_TRL" = 1 ] || return 0
    # TRL's table: the same prompts as plain text (idx, prompt, ground_truth)
    step trl_data 10 "$PY" -c "import pandas as pd; d = pd.read_parquet('$train'); pd.DataFrame({'idx': range(len(d)), \
'prompt': [p[-1]['content'] for p in d['prompt']], 'ground_truth': [r['ground_truth'] for r in d['reward_model']]}) \
.to_parquet('$WORK/trl_train.parquet'); print('{\"trl_rows\": %d}' % len(d))"
    step trl_grpo_step 90 "$PY" "$PEERS/trl/trl_grpo_bench.py" --model "$model" --train-file "$WORK/trl_train.parquet" \
        --prompt-format plain --prompts-per-step 64 --num-generations 8 --max-prompt-length 64 \
        --max-completion-length 256 --steps 2 --lr 1e-5 --bf16 true --out "$OUT/trl.jsonl"
    [ "$DRY" = 1 ] || "$PY" - "$RESULTS" <<'PY' | tee -a "$RESULTS"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ours = next((l for l in reversed(lines) if l.get("benchmark") == "grpo_step"), None)
trl = next((l for l in reversed(lines) if "throughput" in l), None)
if ours and trl:
    ratio = ours["tokens_per_s"] / trl["throughput"]["tokens_per_s"]
    print(json.dumps({"vs_trl": {"ours_tokens_per_s": ours["tokens_per_s"],
                                 "trl_tokens_per_s": trl["throughput"]["tokens_per_s"],
                                 "ours_step_s": ours["step_s"], "trl_step_s": trl["throughput"]["s_per_step"],
                                 "ratio": round(ratio, 2)}}))
PY
}

tests_cuda() {  # 3: the captured decode step's tests (seconds, no Ray); `tests` adds the rest of tests/cuda
    step tests_cuda_graphs 45 "$PY" -m pytest tests/cuda/test_cuda_graphs.py -q -rs -s -p no:cacheprovider \
        --junitxml="$OUT/tests_cuda_graphs.xml"
    pytest_summary tests_cuda_graphs "$OUT/tests_cuda_graphs.xml"
}

tests_cuda_rest() {  # GRPO / PPO / LoRA / resume / merger through main_ppo on CUDA (a Ray start: > 80 s)
    step tests_cuda 300 "$PY" -m pytest tests/cuda -q -rs -p no:cacheprovider \
        --ignore=tests/cuda/test_cuda_graphs.py --junitxml="$OUT/tests_cuda.xml"
    pytest_summary tests_cuda "$OUT/tests_cuda.xml"
}

resume() {  # 4: main_ppo on CUDA, a save, and a resume that repeats the uninterrupted run's last step
    step resume_check 100 "$PY" benchmarks/resume_check.py --device cuda --steps 3 --save-at 2
}

suite() {  # the CPU suite with the GPU visible (tests/conftest.py pins it to the CPU device layer)
    step tests_suite 570 "$PY" -m pytest tests -q -rs -p no:cacheprovider -n "$XDIST" --ignore=tests/cuda \
        --junitxml="$OUT/tests_suite.xml"
    pytest_summary tests_suite "$OUT/tests_suite.xml"
}

if [ "$DRY" = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: no CUDA GPU is visible to $PY" >&2; exit 1; }
    mkdir -p "$OUT" "$WORK"
    "$PY" -c "import json, torch; print(json.dumps({'gpu_check': '$PHASE', 'torch': torch.__version__, \
'gpu': torch.cuda.get_device_name()}))" | tee -a "$RESULTS"
fi
case "$PHASE" in
    all) engine_vs_hf; ours_vs_trl; tests_cuda; resume ;;
    bench) engine_vs_hf; ours_vs_trl ;;
    tests) tests_cuda; tests_cuda_rest ;;
    suite) suite ;;
esac
if [ "$DRY" = 1 ]; then
    TOTAL=$((PLANNED + INSTALL_S))
    FITS=yes
    [ "$PHASE" = all ] && [ "$TOTAL" -gt "$BUDGET_S" ] && FITS=no
    echo "plan: ${PLANNED}s of phase limits + ${INSTALL_S}s install = ${TOTAL}s (budget ${BUDGET_S}s for all: $FITS)"
else
    echo "gpu_check: results in $RESULTS" >&2
fi
exit "$FAILED"
