"""The standard DataProto batch keys, declared once with their shapes.

Every module refers to batch fields through these constants (or the identical strings), so that a
field means the same thing everywhere. Shapes use:

- ``B``      rows in the batch (prompts x ``rollout.n`` once responses exist),
- ``T_p``    prompt length (left-padded),
- ``T_r``    response length (right-padded),
- ``T``      ``T_p + T_r``, the full sequence.

Log-probabilities are per *response* token: entry ``t`` is ``log pi(responses[:, t] | prefix)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeySpec:
    """One standard batch field: its name, shape, dtype and meaning."""

    name: str
    shape: str
    dtype: str
    doc: str


INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
PROMPTS = "prompts"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROB = "ref_log_prob"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
VALUES = "values"
TOKEN_LEVEL_SCORES = "token_level_scores"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
REWARD_BASELINES = "reward_baselines"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_logps"  # verl's gkd recipe names
TEACHER_TOPK_IDS = "teacher_topk_indices"
ROUTED_EXPERTS = "routed_experts"  # verl's router replay (R2/R3)

# Non-tensor (numpy object array) fields that travel with the batch.
UID = "uid"  # (B,) group id: responses to the same prompt share it (GRPO/RLOO grouping)
DATA_SOURCE = "data_source"  # (B,) dataset name, selects the reward scorer
# Vision-language rows (verl's names; hybridflow/utils/dataset/multimodal.py):
MULTI_MODAL_DATA = "multi_modal_data"  # (B,) {"image": [PIL images]} per row, for rollout engines
MULTI_MODAL_INPUTS = "multi_modal_inputs"  # (B,) {"pixel_values", "image_grid_thw"} per row ({} text rows)

SCHEMA: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        KeySpec(INPUT_IDS, "(B, T)", "int64", "prompt + response token ids"),
        KeySpec(ATTENTION_MASK, "(B, T)", "int64", "1 on real tokens, 0 on padding"),
        KeySpec(POSITION_IDS, "(B, T)", "int64", "positions counted over real tokens only"),
        KeySpec(PROMPTS, "(B, T_p)", "int64", "left-padded prompt ids"),
        KeySpec(RESPONSES, "(B, T_r)", "int64", "right-padded generated ids"),
        KeySpec(RESPONSE_MASK, "(B, T_r)", "int64", "1 on trained (model-generated) response tokens"),
        KeySpec(OLD_LOG_PROBS, "(B, T_r)", "float32", "log pi_old(a_t|s_t) from the behaviour policy"),
        KeySpec(REF_LOG_PROB, "(B, T_r)", "float32", "log pi_ref(a_t|s_t) from the frozen reference"),
        KeySpec(ROLLOUT_LOG_PROBS, "(B, T_r)", "float32", "log-probs reported by the rollout engine"),
        KeySpec(
            ROLLOUT_IS_WEIGHTS, "(B, T_r)", "float32", "rollout correction: truncated pi_old / pi_rollout"
        ),
        KeySpec(VALUES, "(B, T_r)", "float32", "critic value V(s_t) per response token"),
        KeySpec(TOKEN_LEVEL_SCORES, "(B, T_r)", "float32", "reward-function score, on the last token"),
        KeySpec(TOKEN_LEVEL_REWARDS, "(B, T_r)", "float32", "scores minus the in-reward KL penalty"),
        KeySpec(ADVANTAGES, "(B, T_r)", "float32", "advantage estimate A_t"),
        KeySpec(RETURNS, "(B, T_r)", "float32", "return targets for the critic"),
        KeySpec(REWARD_BASELINES, "(B,)", "float32", "ReMax: reward of the prompt's greedy response"),
        KeySpec(
            TEACHER_TOPK_LOG_PROBS, "(B, T_r, k)", "float32", "distillation: the teacher's top-k log-probs"
        ),
        KeySpec(TEACHER_TOPK_IDS, "(B, T_r, k)", "int64", "distillation: the teacher's top-k token ids"),
        KeySpec(
            ROUTED_EXPERTS,
            "(B, T, L_moe, k)",
            "uint8 | int16",
            "router replay: each token's top-k expert ids per MoE layer (0 on padding), input_ids' columns",
        ),
    )
}


def describe(name: str) -> str:
    """One-line description of a standard key, e.g. ``responses: (B, T_r) int64 — right-padded ...``."""
    spec = SCHEMA[name]
    return f"{spec.name}: {spec.shape} {spec.dtype} — {spec.doc}"
