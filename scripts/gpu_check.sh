#!/usr/bin/env bash
# Issue 26's one command for a GPU host: every figure as a JSON line in $OUT/gpu_check.jsonl.
#
#   scripts/gpu_check.sh tests            # run 1 (<=10 min): tests/cuda, then the suite with the GPU visible
#   scripts/gpu_check.sh bench [--with-trl]
#                                         # run 2 (<=10 min): a 6-step GRPO main_ppo on CUDA with a save and
#                                         # an exact resume, engine vs HF generate (512 rows x 256 tokens,
#                                         # bf16), a GRPO step on TRL's workload (64 prompts x 8, 256
#                                         # tokens, SmolLM2-135M's shape), and with --with-trl TRL's own
#                                         # GRPOTrainer step on the same model and prompts, same host
#   scripts/gpu_check.sh all [--with-trl] # both, one after the other
#   add --dry-run to print the commands instead of running them
#
# Run from the project's root after ../shared/device/README.md's install (PYTHONPATH=/tmp/site:$PWD).
# Environment: PY (python3), OUT ($OUT or ./gpu_check_out), XDIST (8: pytest-xdist processes for the
# suite), PEERS (../shared/peers or ./shared/peers: trl/trl_grpo_bench.py for --with-trl).
set -uo pipefail

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
    tests | bench | all) ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY=${PY:-python3}
OUT=${OUT:-$ROOT/gpu_check_out}
XDIST=${XDIST:-8}
if [ -z "${PEERS:-}" ]; then  # the device machine gets shared/ inside the checkout
    PEERS=$ROOT/../shared/peers
    [ -d "$ROOT/shared/peers" ] && PEERS=$ROOT/shared/peers
fi
RESULTS="$OUT/gpu_check.jsonl"
WORK="$OUT/work"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
FAILED=0

# step NAME CMD...: run CMD (its output in $OUT/NAME.log); its JSON lines (lines starting with "{")
# go to $RESULTS, and a line {"check": NAME, "rc": ..., "wall_s": ...} after them.
step() {
    local name=$1
    shift
    if [ "$DRY" = 1 ]; then
        echo "[$name] $*"
        return 0
    fi
    echo "gpu_check: $name ..." >&2
    local start rc
    start=$(date +%s)
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    grep '^{' "$OUT/$name.log" >> "$RESULTS"
    printf '{"check": "%s", "rc": %d, "wall_s": %d}\n' "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$RESULTS"
    [ "$rc" = 0 ] || { FAILED=1; tail -n 30 "$OUT/$name.log" >&2; }
}

# pytest_summary NAME XML: one JSON line of a junit file's counts
pytest_summary() {
    "$PY" - "$1" "$2" <<'PY'
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

run_tests() {
    step tests_cuda "$PY" -m pytest tests/cuda -q -rs -p no:cacheprovider --junitxml="$OUT/tests_cuda.xml"
    [ "$DRY" = 1 ] || pytest_summary tests_cuda "$OUT/tests_cuda.xml" | tee -a "$RESULTS"
    # the CPU suite with the GPU visible (tests/conftest.py pins it to the CPU device layer)
    step tests_suite "$PY" -m pytest tests -q -rs -p no:cacheprovider -n "$XDIST" --ignore=tests/cuda \
        --junitxml="$OUT/tests_suite.xml"
    [ "$DRY" = 1 ] || pytest_summary tests_suite "$OUT/tests_suite.xml" | tee -a "$RESULTS"
}

run_bench() {
    step resume_check "$PY" benchmarks/resume_check.py --device cuda --steps 6 --save-at 3
    step rollout_engine_vs_hf "$PY" benchmarks/rollout.py --model smollm2 --device cuda --dtype bf16 \
        --prompts 128 --n 4 --new-tokens 256 --max-prompt 64 --max-num-seqs 512
    # one model and one prompt set for both trainers: SmolLM2-135M's shape, the arithmetic task
    step assets "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import grpo_step, pathlib, json; \
m, t = grpo_step.default_assets(pathlib.Path('$WORK'), 'smollm2'); print(json.dumps({'model': m, 'train': t}))"
    local model="$WORK/model" train="$WORK/data/train.parquet"
    step grpo_step "$PY" benchmarks/grpo_step.py --device cuda --workers 1 --model "$model" --train-file "$train" \
        --prompts 64 --n 8 --max-prompt-length 64 --max-response-length 256 --steps 5 --kl-coef 0 --lr 1e-5
    if [ "$WITH_TRL" = 1 ]; then
        # TRL's table: the same prompts as plain text (idx, prompt, ground_truth)
        step trl_data "$PY" -c "import pandas as pd; d = pd.read_parquet('$train'); pd.DataFrame({'idx': range(len(d)), \
'prompt': [p[-1]['content'] for p in d['prompt']], 'ground_truth': [r['ground_truth'] for r in d['reward_model']]}) \
.to_parquet('$WORK/trl_train.parquet'); print('{\"trl_rows\": %d}' % len(d))"
        step trl_grpo_step "$PY" "$PEERS/trl/trl_grpo_bench.py" --model "$model" --train-file "$WORK/trl_train.parquet" \
            --prompt-format plain --prompts-per-step 64 --num-generations 8 --max-prompt-length 64 \
            --max-completion-length 256 --steps 5 --lr 1e-5 --bf16 true --out "$OUT/trl.jsonl"
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
    fi
}

if [ "$DRY" = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: no CUDA GPU is visible to $PY" >&2; exit 1; }
    mkdir -p "$OUT" "$WORK"
    "$PY" -c "import json, torch; print(json.dumps({'gpu_check': '$PHASE', 'torch': torch.__version__, \
'gpu': torch.cuda.get_device_name()}))" | tee -a "$RESULTS"
fi
case "$PHASE" in
    tests) run_tests ;;
    bench) run_bench ;;
    all) run_tests; run_bench ;;
esac
[ "$DRY" = 1 ] || echo "gpu_check: results in $RESULTS" >&2
exit "$FAILED"
