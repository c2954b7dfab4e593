"""What a run says at its start and end (issue 46 item 3): its folders, whether and from which step it
resumes (and how to start fresh), the model family, backend and device; at the end where its outputs are."""

import os

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.run_summary import end_lines, start_lines


def test_start_lines_name_the_folders_the_resume_and_the_model(tiny_model_dir, tmp_path):
    config = load_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"trainer.default_local_dir={tmp_path}/ckpt",
            "trainer.experiment_name=exp1",
        ]
    )
    folders, resume, model = start_lines(config, latest=None)
    assert os.path.join("outputs", str(config.trainer.project_name), "exp1") in folders
    assert f"{tmp_path}/ckpt" in folders and "none saved" in folders
    assert resume.startswith("starting fresh: no checkpoint in") and "resume_mode=auto" in resume
    assert "(qwen2)" in model and "rollout engine (sync) on cpu" in model
    step_dir = f"{tmp_path}/ckpt/global_step_6"
    _, resume, _ = start_lines(config, latest=step_dir)
    assert resume.startswith(f"resuming from step 6 ({step_dir})")
    assert "trainer.resume_mode=disable" in resume  # how to start fresh instead
    disabled = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.resume_mode=disable"])
    assert start_lines(disabled, latest=step_dir)[1].startswith("starting fresh (trainer.resume_mode=disable")


def test_end_lines_say_where_the_outputs_are(tmp_path):
    config = load_config(["trainer.experiment_name=exp2", "trainer.logger=[console,jsonl]"])
    metrics, checkpoints = end_lines(config, 4, latest=f"{tmp_path}/global_step_4")
    assert metrics.startswith("stopped after step 4: metrics outputs/") and "exp2/curves.png" in metrics
    assert checkpoints == f"checkpoints: {tmp_path}/global_step_4"
    assert end_lines(config, 4, latest=None)[1].startswith("checkpoints: none saved")
