"""What the trainer's tests share: a small valid main_ppo command line on the tiny model and task data."""

import pytest


@pytest.fixture()
def base_overrides(tiny_model_dir, arithmetic_data):
    """A valid config's overrides: the tiny model (4 heads, 2 key-value heads, MLP 128, vocabulary 512),
    the arithmetic parquet files, 4 prompts x 2 samples in mini-batches of 2."""
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
    ]
