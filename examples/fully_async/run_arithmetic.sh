#!/usr/bin/env bash
# Fully asynchronous GRPO on the built-in arithmetic task, on CPU: one trainer process, one rollout
# process, staleness 1, partial rollout, token-level IS correction (old log-probs recomputed by the
# trainer, weighted against the rollout's: algorithm.rollout_correction.rollout_is=token;
# docs/async_training.md).
#
#   examples/fully_async/run_arithmetic.sh RUN_DIR [MODEL_DIR] [extra fully_async_main overrides...]
#
# Without MODEL_DIR a tiny random model is built (the reward stays near 0). To see it learn, use the
# demo's warm-started model and data (after `make demo`):
#   DATA_DIR=outputs/quickstart/data examples/fully_async/run_arithmetic.sh runs/async outputs/quickstart/sft_model
# RUN_DIR receives metrics.jsonl, curves.png and checkpoints (and the data when DATA_DIR is unset).
# Environment: PYTHON (.venv/bin/python), STEPS (20), DATA_DIR (RUN_DIR/data, written if missing).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,13p' "$0" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$1"
RUN_DIR="$(cd "$1" && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
STEPS="${STEPS:-20}"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ $# -ge 2 && "$2" != *=* ]]; then
    MODEL_DIR="$(cd "$2" && pwd)"
    shift 2
else
    MODEL_DIR="$RUN_DIR/model"
    [[ -d "$MODEL_DIR" ]] || "$PYTHON" -m hybridflow.models.tiny --out "$MODEL_DIR"
    shift 1
fi
DATA_DIR="${DATA_DIR:-$RUN_DIR/data}"
[[ -f "$DATA_DIR/train.parquet" ]] || "$PYTHON" -m hybridflow.tasks.arithmetic --out "$DATA_DIR"
DATA_DIR="$(cd "$DATA_DIR" && pwd)"

cd "$RUN_DIR"
exec "$PYTHON" -m hybridflow.trainer.fully_async_main \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    data.max_prompt_length=64 data.max_response_length=16 \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.calculate_log_probs=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-5 \
    trainer.device=cpu trainer.n_gpus_per_node=1 rollout.n_gpus_per_node=1 \
    trainer.num_threads_per_worker=1 trainer.total_training_steps="$STEPS" \
    trainer.test_freq=10 trainer.save_freq=10 trainer.logger='[console,jsonl]' \
    async_training.staleness_threshold=1 async_training.trigger_parameter_sync_step=1 \
    async_training.partial_rollout=true async_training.use_rollout_log_probs=false \
    algorithm.rollout_correction.rollout_is=token \
    "$@"
