#!/usr/bin/env bash
# GRPO with a LoRA adapter on SmolLM2-135M-Instruct, on CPU, within a time budget.
#
#   examples/gsm8k_smollm2/train_grpo.sh MODEL_DIR RUN_DIR [DATA_DIR] [extra main_ppo overrides...]
#
# MODEL_DIR: the HF directory from `python -m hybridflow.models.import_gguf` (see README.md here).
# RUN_DIR: metrics.jsonl, curves.png, checkpoints and the merged final model (RUN_DIR/merged).
# DATA_DIR: prepare_data.py's --output_dir (default ~/data/gsm8k_smollm2).
# Environment: PYTHON (.venv/bin/python), RG_PRESET (add_2_d1to2), TASK (rg | gsm8k; rg),
# BUDGET_MIN (40: trainer.time_budget_minutes, the run stops after the last step that fits),
# WORKERS (2 processes x 1 thread).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,11p' "$0" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL_DIR="$(cd "$1" && pwd)"
mkdir -p "$2"
RUN_DIR="$(cd "$2" && pwd)"
DATA_DIR="${3:-$HOME/data/gsm8k_smollm2}"
shift $(( $# >= 3 ? 3 : 2 ))
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
RG_PRESET="${RG_PRESET:-add_2_d1to2}"
TASK="${TASK:-rg}"
BUDGET_MIN="${BUDGET_MIN:-40}"
WORKERS="${WORKERS:-2}"

export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$REPO"
if [[ "$TASK" == rg ]]; then
    TRAIN="$DATA_DIR/$RG_PRESET/train.parquet" VAL="$DATA_DIR/$RG_PRESET/test200.parquet"
    PROMPT=64 RESPONSE=64  # prompts are ~47 tokens with SmolLM2's system line; PROMPT is a cap, not a pad width
else
    TRAIN="$DATA_DIR/gsm8k/train.parquet" VAL="$DATA_DIR/gsm8k/test200.parquet" PROMPT=256 RESPONSE=256
fi
if [[ ! -f "$TRAIN" ]]; then
    "$PYTHON" examples/gsm8k_smollm2/prepare_data.py --output_dir "$DATA_DIR" --rg_preset "$RG_PRESET"
fi

# Runs inside RUN_DIR: metrics land in RUN_DIR/outputs/gsm8k_smollm2/grpo_lora_$TASK/.
cd "$RUN_DIR"
# One on-policy update per step (mini-batch = batch, 1 epoch): the rollout's own log-probs are the
# old log-probs once a recompute has matched them (1e-3: merged-LoRA engine vs peft forward over
# 30 layers differ by ~1e-4); no KL term, so no reference forward. T=0.7: at T=1 the base model's
# sampled accuracy is 3% against 31.5% greedy, too few successes for GRPO groups to learn from.
"$PYTHON" -m hybridflow.trainer.main_ppo \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=8 data.max_prompt_length=$PROMPT data.max_response_length=$RESPONSE \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 \
    actor_rollout_ref.model.target_modules=all-linear \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.rollout.kv_cache_memory_gb=1 \
    actor_rollout_ref.rollout.use_rollout_log_probs=true \
    actor_rollout_ref.rollout.log_prob_parity_tolerance=1e-3 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    custom_reward_function.path="$REPO/examples/gsm8k_smollm2/reward.py" \
    custom_reward_function.name=compute_score \
    trainer.n_gpus_per_node="$WORKERS" trainer.num_threads_per_worker=1 \
    trainer.total_training_steps=1000 trainer.time_budget_minutes="$BUDGET_MIN" \
    trainer.test_freq=10 trainer.val_before_train=true trainer.save_freq=1000 \
    trainer.logger='[console,jsonl]' trainer.project_name=gsm8k_smollm2 \
    trainer.experiment_name="grpo_lora_$TASK" \
    trainer.default_local_dir="$RUN_DIR/checkpoints" \
    "$@"

# The adapter-only checkpoint of the last step → a plain HF model for eval.sh.
STEP_DIR="$(ls -d "$RUN_DIR"/checkpoints/global_step_* | sort -t_ -k3 -n | tail -1)"
cd "$REPO"
"$PYTHON" -m hybridflow.model_merger merge --local_dir "$STEP_DIR/actor" --target_dir "$RUN_DIR/merged"
