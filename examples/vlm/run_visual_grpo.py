"""Vision-language GRPO that learns on the CPU: the synthetic visual task (hybridflow/tasks/visual.py) on a
tiny Qwen2.5-VL-architecture model, end to end in one command::

    python examples/vlm/run_visual_grpo.py --out outputs/vlm_example [--grpo-minutes 10]

1. builds the tiny model offline (hybridflow/models/tiny_vlm.py) and writes the task's parquet files in
   verl's geo3k layout: train, a held-out test split, and the same test split with every image replaced
   by a blank one (data_source ``hybridflow/visual_blank``: the control);
2. SFT warm start on a weak teacher (``hybridflow.tasks.visual.weak_teacher_answer``: right with
   probability --teacher-accuracy, 0.4, else a fixed wrong word of the question type, so its most
   frequent answer is wrong), a plain torch loop in this process, bounded by --sft-minutes;
3. GRPO through ``python -m hybridflow.trainer.main_ppo`` (verl's keys, rollout.name=hf), stopped by
   ``trainer.time_budget_minutes``; every --test-freq steps the trainer validates greedily on both test
   files: ``val-core/hybridflow/visual/reward/mean@1`` is the held-out accuracy,
   ``val-core/hybridflow/visual_blank/reward/mean@1`` the blank-image control.

The GRPO recipe (the defaults): lr 3e-4 and verl's KL loss against the SFT model
(``actor.use_kl_loss=true``, ``kl_loss_type=low_var_kl``, ``kl_loss_coef=0.05``), grad_clip 1.0, no
entropy bonus. lr 1e-3 without KL learned as fast but collapsed (entropy 0.01) and ended far below its
peak (docs/vlm.md, run A).

It prints JSON lines: the chance level, the learning curve and the FINAL model's accuracies against the
model before GRPO (no best checkpoint is picked).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SOURCE, BLANK_SOURCE = "hybridflow/visual", "hybridflow/visual_blank"


def write_data(out: Path, train_per_answer: int, test_per_answer: int) -> dict[str, str]:
    from hybridflow.tasks.visual import make_rows, write_parquet

    test_blank = make_rows(test_per_answer, seed=0, split="test", blank=True)
    for row in test_blank:
        row["data_source"] = BLANK_SOURCE
    return {
        "train": write_parquet(make_rows(train_per_answer, seed=0, split="train"), out / "train.parquet"),
        "test": write_parquet(make_rows(test_per_answer, seed=0, split="test"), out / "test.parquet"),
        "test_blank": write_parquet(test_blank, out / "test_blank.parquet"),
    }


def sft_warm_start(
    model_dir: str, train_file: str, out_dir: Path, minutes: float, accuracy: float, seed: int = 0
) -> dict:
    """Cross-entropy on ``prompt -> teacher answer + <|im_end|>`` (response tokens only), images in the
    forward through the same dataset and vision path as RL; saves the model to ``out_dir``."""
    import shutil

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.visual import weak_teacher_answer
    from hybridflow.utils.dataset import RLHFDataset
    from hybridflow.utils.mrope import mrope_position_ids

    torch.manual_seed(seed)
    torch.set_num_threads(2)  # the whole machine: the example runs alone (heavy lock)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    from hybridflow.utils.dataset.multimodal import load_processor

    processor = load_processor(model_dir, tokenizer)
    dataset = RLHFDataset(train_file, tokenizer, {"max_prompt_length": 64}, processor=processor)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, steps, losses = time.time(), 0, []
    while time.time() - start < minutes * 60:
        batch = [dataset[i] for i in rng.sample(range(len(dataset)), 32)]
        rows, images, grids = [], [], []
        for item in batch:
            kind = item["extra_info"]["question_type"]
            answer = weak_teacher_answer(item["reward_model"]["ground_truth"], kind, rng, accuracy)
            response = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
            rows.append((item["raw_prompt_ids"], response))
            images.append(item["multi_modal_inputs"]["pixel_values"])
            grids.append(item["multi_modal_inputs"]["image_grid_thw"])
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for k, (prompt, response) in enumerate(rows):  # left-padded like the RL rows
            seq = prompt + response
            ids[k, width - len(seq) :] = torch.tensor(seq)
            mask[k, width - len(seq) :] = 1
            labels[k, width - len(response) :] = torch.tensor(response)
        grid = torch.cat(grids)
        vision = (ids == processor.image_token_id) & mask.bool()
        positions = mrope_position_ids(ids, mask, vision, grid, processor.merge_size)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            pixel_values=torch.cat(images),
            image_grid_thw=grid,
            labels=labels,
        )
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        losses.append(float(out.loss))
        if steps % 20 == 0:
            print(
                f"sft step {steps}: loss {sum(losses[-20:]) / 20:.3f} ({time.time() - start:.0f} s)",
                flush=True,
            )
    model.save_pretrained(out_dir)
    for name in os.listdir(model_dir):  # tokenizer, chat template, preprocessor config
        if not name.startswith(("model", "config")):
            shutil.copy(os.path.join(model_dir, name), out_dir / name)
    return {"sft_steps": steps, "sft_s": round(time.time() - start, 1), "sft_final_loss": losses[-1]}


def grpo(model_dir: str, data: dict, out: Path, args: argparse.Namespace) -> Path:
    reward = Path(__file__).resolve().parents[2] / "hybridflow" / "tasks" / "visual.py"
    overrides = [
        "algorithm.adv_estimator=grpo",
        "data.image_key=images",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=hf",
        f"custom_reward_function.path={reward}",
        f"data.train_files={data['train']}",
        f"data.val_files=[{data['test']},{data['test_blank']}]",
        "data.train_batch_size=32",
        "data.max_prompt_length=32",
        "data.max_response_length=3",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.entropy_coeff={args.entropy_coeff}",
        f"actor_rollout_ref.actor.grad_clip={args.grad_clip}",
        "trainer.total_training_steps=100000",
        f"trainer.time_budget_minutes={args.grpo_minutes}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.val_before_train=true",
        "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.num_threads_per_worker={args.threads}",
        "trainer.project_name=vlm_example",
        "trainer.experiment_name=visual_grpo",
    ]
    if args.kl_coef > 0:  # verl's KL loss against the reference (the SFT model)
        overrides += [
            "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.actor.kl_loss_coef={args.kl_coef}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        ]
    overrides += args.override  # last, so they win
    subprocess.run([sys.executable, "-m", "hybridflow.trainer.main_ppo", *overrides], check=True, cwd=out)
    return out / "outputs" / "vlm_example" / "visual_grpo" / "metrics.jsonl"


def summarise(metrics_file: Path, chance: float) -> None:
    """The learning curve (one point per validation) and a summary of the FINAL model against the
    model before GRPO: no best checkpoint is picked. ``grpo_s`` sums the trainer's step and validation
    times up to the point (the GRPO wall clock without Ray's start)."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    key, blank = f"val-core/{SOURCE}/reward/mean@1", f"val-core/{BLANK_SOURCE}/reward/mean@1"
    curve, clock = [], 0.0
    for r in records:
        clock += r.get("timing_s/step", 0.0) + r.get("timing_s/testing", 0.0)
        if key in r:
            entropy = r.get("actor/entropy")
            curve.append(
                {
                    "step": r["step"],
                    "grpo_s": round(clock, 1),
                    "acc": round(r[key], 3),
                    "blank_acc": round(r[blank], 3),
                    "entropy": None if entropy is None else round(entropy, 3),
                }
            )
    for point in curve:
        print(json.dumps({"metric": "vlm_learning_curve", **point}))
    first, last = curve[0], curve[-1]
    print(
        json.dumps(
            {
                "metric": "vlm_grpo_summary",
                "chance": round(chance, 4),
                "acc_before": first["acc"],
                "acc_after": last["acc"],
                "gain_points": round(100 * (last["acc"] - first["acc"]), 1),
                "after_minus_chance_points": round(100 * (last["acc"] - chance), 1),
                "blank_acc_after": last["blank_acc"],
                "blank_minus_chance_points": round(100 * (last["blank_acc"] - chance), 1) + 0.0,
                "steps": records[-1]["step"],
                "grpo_s": last["grpo_s"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()).removesuffix("::") + "."
    )
    parser.add_argument("--out", default="outputs/vlm_example")
    parser.add_argument("--sft-minutes", type=float, default=4.0)
    parser.add_argument("--teacher-accuracy", type=float, default=0.4)
    parser.add_argument("--grpo-minutes", type=float, default=10.0)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-per-answer", type=int, default=60)
    parser.add_argument("--test-per-answer", type=int, default=36)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kl-coef", type=float, default=0.05, help="> 0: verl's low_var_kl KL loss")
    parser.add_argument("--entropy-coeff", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--sft-dir", default=None, help="reuse this SFT model (skip the build and SFT)")
    parser.add_argument(
        "--override", action="append", default=[], help="a main_ppo key=value override (repeatable)"
    )
    args = parser.parse_args()
    from hybridflow.models.tiny_vlm import build_tiny_vlm
    from hybridflow.tasks.visual import QUESTION_TYPES, chance

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = write_data(out, args.train_per_answer, args.test_per_answer)
    sft_dir = Path(args.sft_dir).resolve() if args.sft_dir else out / "sft"
    if not args.sft_dir:
        base = build_tiny_vlm(
            out / "base", hidden_size=128, num_layers=4, intermediate_size=352, vision_hidden_size=64
        )
        sft = sft_warm_start(str(base), data["train"], sft_dir, args.sft_minutes, args.teacher_accuracy)
        print(json.dumps({"metric": "vlm_sft", **sft}), flush=True)
    metrics = grpo(str(sft_dir), data, out, args)
    types = [q.name for q in QUESTION_TYPES for _ in q.answers]  # the balanced split's rows, per answer
    summarise(metrics, chance(types))


if __name__ == "__main__":
    main()
