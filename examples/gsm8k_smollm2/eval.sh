#!/usr/bin/env bash
# Greedy pass@1 of a model directory on the recipe's two fixed 200-question test sets.
#
#   examples/gsm8k_smollm2/eval.sh MODEL_DIR OUT_DIR [DATA_DIR]
#
# DATA_DIR is prepare_data.py's --output_dir (default ~/data/gsm8k_smollm2; it is created with
# prepare_data.py when missing). For each task: main_generation (n_samples=1, greedy) then main_eval.
#   gsm8k : DATA_DIR/gsm8k/test200.parquet (first 200 GSM8K test questions), response_length 256,
#           built-in strict "#### N" scorer (headline) + flexible (last number) via reward.py
#   rg    : DATA_DIR/$RG_PRESET/test200.parquet, response_length 64, reward.py (answer after "####",
#           else boxed / "answer is" / last number; headline) + strict (only "#### N")
# Writes OUT_DIR/metrics.json: accuracy, rows, generated tokens, tokens/s, wall time and peak RSS
# of each generation run; generations and logs stay in OUT_DIR.
#
# Environment: PYTHON (.venv/bin/python), RG_PRESET (add_2_d1to2), NUM_THREADS (1),
# KV_CACHE_GB (2), GSM8K_RESPONSE_LENGTH (256), RG_RESPONSE_LENGTH (64), DTYPE (fp32),
# TASKS ("gsm8k rg").
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,18p' "$0" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL_DIR="$(cd "$1" && pwd)"
mkdir -p "$2"
OUT_DIR="$(cd "$2" && pwd)"
DATA_DIR="${3:-$HOME/data/gsm8k_smollm2}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
RG_PRESET="${RG_PRESET:-add_2_d1to2}"
NUM_THREADS="${NUM_THREADS:-1}"
KV_CACHE_GB="${KV_CACHE_GB:-2}"
GSM8K_RESPONSE_LENGTH="${GSM8K_RESPONSE_LENGTH:-256}"
RG_RESPONSE_LENGTH="${RG_RESPONSE_LENGTH:-64}"
DTYPE="${DTYPE:-fp32}"
TASKS="${TASKS:-gsm8k rg}"
REWARD="$REPO/examples/gsm8k_smollm2/reward.py"

export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="$NUM_THREADS" MKL_NUM_THREADS="$NUM_THREADS"
cd "$REPO"

if [[ ! -f "$DATA_DIR/gsm8k/test200.parquet" || ! -f "$DATA_DIR/$RG_PRESET/test200.parquet" ]]; then
    "$PYTHON" examples/gsm8k_smollm2/prepare_data.py --output_dir "$DATA_DIR" --rg_preset "$RG_PRESET"
fi

HYDRA=(hydra.run.dir="$OUT_DIR/hydra" hydra.output_subdir=null)

# run_timed NAME CMD...: runs CMD, logs to OUT_DIR/NAME.log, writes {wall_s, peak_rss_mb} to NAME.time.json
run_timed() {
    local name="$1"
    shift
    "$PYTHON" - "$OUT_DIR/$name.time.json" "$OUT_DIR/$name.log" "$@" <<'EOF'
import json, resource, subprocess, sys, time
out, log, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
start = time.perf_counter()
with open(log, "w") as f:
    rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
wall = time.perf_counter() - start
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
json.dump({"wall_s": round(wall, 1), "peak_rss_mb": round(peak_kb / 1024, 1), "rc": rc}, open(out, "w"))
sys.exit(rc)
EOF
}

# generate TASK DATA RESPONSE_LENGTH
generate() {
    local task="$1" data="$2" length="$3"
    echo "[eval.sh] generating $task ($data, response_length=$length)" >&2
    run_timed "gen_$task" "$PYTHON" -m hybridflow.trainer.main_generation \
        model.path="$MODEL_DIR" \
        data.path="$data" \
        data.output_path="$OUT_DIR/gen_$task.parquet" \
        data.n_samples=1 \
        data.batch_size=64 \
        rollout.do_sample=false \
        rollout.temperature=0 \
        rollout.prompt_length=256 \
        rollout.response_length="$length" \
        rollout.dtype="$DTYPE" \
        rollout.kv_cache_memory_gb="$KV_CACHE_GB" \
        trainer.num_threads="$NUM_THREADS" \
        "${HYDRA[@]}" || { tail -20 "$OUT_DIR/gen_$task.log" >&2; exit 1; }
}

# evaluate TASK NAME [overrides...]: main_eval's JSON to OUT_DIR/eval_TASK_NAME.json
evaluate() {
    local task="$1" name="$2"
    shift 2
    "$PYTHON" -m hybridflow.trainer.main_eval data.path="$OUT_DIR/gen_$task.parquet" "${HYDRA[@]}" "$@" \
        > "$OUT_DIR/eval_${task}_$name.json"
}

for task in $TASKS; do
    case "$task" in
        gsm8k)
            generate gsm8k "$DATA_DIR/gsm8k/test200.parquet" "$GSM8K_RESPONSE_LENGTH"
            evaluate gsm8k strict
            evaluate gsm8k flexible custom_reward_function.path="$REWARD" \
                +custom_reward_function.reward_kwargs.gsm8k_method=flexible
            ;;
        rg)
            generate rg "$DATA_DIR/$RG_PRESET/test200.parquet" "$RG_RESPONSE_LENGTH"
            evaluate rg flexible custom_reward_function.path="$REWARD"
            evaluate rg strict custom_reward_function.path="$REWARD" \
                +custom_reward_function.reward_kwargs.strict=true
            ;;
        *) echo "unknown task $task (gsm8k | rg)" >&2; exit 2 ;;
    esac
done

"$PYTHON" - "$OUT_DIR" "$MODEL_DIR" "$RG_PRESET" "$TASKS" <<'EOF'
import json, re, sys
from pathlib import Path
out, model, preset, tasks = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split()
headline = {"gsm8k": "strict", "rg": "flexible"}
metrics = {"model": model, "rg_preset": preset, "tasks": {}}
for task in tasks:
    entry = {"headline_scorer": headline[task]}
    for scorer in ("strict", "flexible"):
        text = (out / f"eval_{task}_{scorer}.json").read_text()
        per_source = json.loads(text[text.index("{"):])
        (source, m), = per_source.items()
        entry["data_source"] = source
        entry["num_rows"] = m["num_rows"]
        entry[f"pass@1_{scorer}"] = m["pass@1"]
    entry["pass@1"] = entry[f"pass@1_{headline[task]}"]
    log = (out / f"gen_{task}.log").read_text()
    found = re.search(r"generated (\d+) prompts x (\d+) responses \((\d+) tokens, (\d+) tokens/s\)", log)
    if found:
        entry["generated_tokens"] = int(found.group(3))
        # generated tokens / generation-loop time (prompt prefill included)
        entry["generated_tokens_per_s"] = int(found.group(4))
    timing = json.loads((out / f"gen_{task}.time.json").read_text())
    entry["generation_wall_s"] = timing["wall_s"]  # whole process: imports, model load, generation
    entry["generation_peak_rss_mb"] = timing["peak_rss_mb"]
    metrics["tasks"][task] = entry
(out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
print(json.dumps(metrics, indent=2))
EOF
