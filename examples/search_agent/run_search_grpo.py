"""A search agent that learns on the CPU: a tiny model looks up facts it never saw through verl's search tool
and a local retrieval server, trained with GRPO through the agent loop; the control trains the same model
on the same budget without the tool. One command::

    python examples/search_agent/run_search_grpo.py --out outputs/search_agent [--control]

1. writes the synthetic knowledge task (hybridflow/tasks/search_facts.py: invented people, their city and
   job; a corpus of one passage per fact; test questions about people the training never mentions);
2. starts ``python -m hybridflow.retrieval serve`` over the corpus (BM25) and writes verl's search tool
   config pointing at it;
3. builds a tiny Qwen2-architecture model whose tokenizer is trained on the task text, and warm-starts it
   with SFT on a reluctant searcher: first every conversation searches the asked fact and answers with
   the value that came back (the copies: name and fact into the query, the passage's value into the
   answer), until the loss says the copies are learned (--sft-copy-loss) or --sft-copy-minutes are up;
   then, for --sft-decision-minutes, only --teacher-search of them (0.3) search, the others answer
   from memory (:func:`~hybridflow.tasks.search_facts.teacher_answer`, right with probability
   --teacher-accuracy on the training people). The warm-started model can use the tool, but prefers not
   to: greedy, it answers from memory; learning that the search pays is left to GRPO. The tool turns
   are laid out token for token as the tool agent loop lays them out (the tool's real answers, rendered
   by the loop's own :class:`~hybridflow.workers.rollout.multi_turn.ToolTurnRenderer`), only the
   assistant's tokens are trained; a plain torch loop;
4. GRPO through ``python -m hybridflow.trainer.main_ppo`` with verl's keys (``rollout.mode=async``: the
   ``tool_agent`` loop on generation servers; ``multi_turn.tool_config_path``; the task file as
   ``custom_reward_function``), stopped by ``trainer.time_budget_minutes``, validating greedily on the
   held-out split every --test-freq steps.

``--control`` then runs the same steps without the tool (prompts that do not offer it, a teacher that
answers from memory, :func:`~hybridflow.tasks.search_facts.teacher_answer`, no tool config) and writes
``search_agent_curve.png`` with both curves.
The script prints JSON lines: the SFT summary, the learning curve and a summary of the FINAL model (no
best checkpoint is picked) against the model before GRPO and chance. What it measured:
examples/search_agent/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VAL_KEY = "val-core/hybridflow/search_facts/reward/mean@1"


def start_retrieval_server(corpus: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m hybridflow.retrieval serve`` on a free port; returns the process and its /retrieve URL
    once ``GET /health`` answers."""
    from hybridflow.utils.ports import find_free_port

    port = find_free_port()
    command = [sys.executable, "-m", "hybridflow.retrieval", "serve", "--corpus", str(corpus)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as answer:  # noqa: S310 (local)
                json.load(answer)
            return server, f"{base}/retrieve"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the retrieval server did not start: see {log}") from None
            time.sleep(0.3)


def tool_texts(url: str, queries: list[str], topk: int) -> dict[str, str]:
    """The search tool's text for each of ``queries``, asked of the server at ``url`` and formatted by
    the tool's own code: what the agent loop will show the model."""
    from hybridflow.workers.rollout.tools.search_r1_like_utils import call_search_api, search_result

    texts = {}
    for start in range(0, len(queries), 200):
        chunk = queries[start : start + 200]
        response, error = call_search_api(url, chunk, topk, return_scores=True)
        if error:
            raise RuntimeError(f"the retrieval server at {url} failed: {error}")
        for query, hits in zip(chunk, response["result"]):
            texts[query] = search_result([query], {"result": [hits]}, None)[0]
    return texts


def sft_warm_start(model_dir: Path, train_file: Path, out_dir: Path, args, tool_text: dict | None) -> dict:
    """Cross-entropy on the reluctant searcher's conversations (assistant tokens only), left-padded batches of
    ``--sft-batch``; ``tool_text`` None: the no-tool control (the answer right after the prompt)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.search_facts import (
        answer_text,
        passage_value,
        search_query,
        teacher_answer,
        tool_call_text,
    )
    from hybridflow.utils.dataset import RLHFDataset
    from hybridflow.workers.rollout.multi_turn import ToolTurnRenderer

    torch.manual_seed(args.seed)
    torch.set_num_threads(2)  # the whole machine: nothing else runs during SFT
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(str(model_dir))
    eos = tokenizer.eos_token_id
    renderer = ToolTurnRenderer(tokenizer, [eos])
    dataset = RLHFDataset(str(train_file), tokenizer, {"max_prompt_length": args.max_prompt_length})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    start, steps, losses = time.time(), 0, []
    copy_s = copy_steps = None  # when the tool arm's copy phase ended
    while True:
        elapsed = time.time() - start
        if tool_text is None:  # the control: as long as the tool arm's longest warm start
            if elapsed >= (args.sft_copy_minutes + args.sft_decision_minutes) * 60:
                break
        else:
            learned = len(losses) >= 25 and sum(losses[-25:]) / 25 < args.sft_copy_loss
            if copy_s is None and (learned or elapsed >= args.sft_copy_minutes * 60):
                copy_s, copy_steps = elapsed, steps
                print(f"sft: copy phase over after {steps} steps ({elapsed:.0f} s)", flush=True)
            if copy_s is not None and elapsed - copy_s >= args.sft_decision_minutes * 60:
                break
        rows = []
        for index in rng.sample(range(len(dataset)), args.sft_batch):
            item = dataset[index]
            info, truth = item["extra_info"], item["reward_model"]["ground_truth"]["target"][0]
            kind = info["question_type"]
            searches = tool_text is not None and (copy_s is None or rng.random() < args.teacher_search)
            if not searches:  # the control, or the reluctant searcher: an answer from memory
                answer = encode(teacher_answer(truth, kind, rng, args.teacher_accuracy)) + [eos]
                rows.append((list(item["raw_prompt_ids"]), [(answer, True)]))
                continue
            query = search_query(info["name"], kind)
            call = encode(tool_call_text(query)) + [eos]
            tool = renderer.tool_turn_ids([tool_text[query]])
            answer = encode(answer_text(passage_value(tool_text[query]))) + [eos]  # what came back
            rows.append((list(item["raw_prompt_ids"]), [(call, True), (tool, False), (answer, True)]))
        lengths = [len(p) + sum(len(t) for t, _ in turns) for p, turns in rows]
        width = max(lengths)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for k, ((prompt, turns), length) in enumerate(zip(rows, lengths)):
            at = width - length
            ids[k, at : at + len(prompt)] = torch.tensor(prompt)
            at += len(prompt)
            for tokens, trained in turns:
                ids[k, at : at + len(tokens)] = torch.tensor(tokens)
                if trained:
                    labels[k, at : at + len(tokens)] = torch.tensor(tokens)
                at += len(tokens)
            mask[k, width - length :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        losses.append(float(loss.detach()))
        if steps % 25 == 0:
            print(
                f"sft step {steps}: loss {sum(losses[-25:]) / 25:.3f} ({time.time() - start:.0f} s)",
                flush=True,
            )
    model.save_pretrained(out_dir)
    for name in os.listdir(model_dir):  # tokenizer, chat template, generation config
        if not name.startswith(("model", "config")):
            shutil.copy(model_dir / name, out_dir / name)
    copied = {} if copy_s is None else {"copy_steps": copy_steps, "copy_s": round(copy_s, 1)}
    return {
        "sft_steps": steps,
        "sft_s": round(time.time() - start, 1),
        **copied,
        "sft_final_loss": round(losses[-1], 4),
    }


def grpo(model_dir: Path, data: dict, out: Path, args, tools: Path | None, name: str) -> Path:
    reward = Path(__file__).resolve().parents[2] / "hybridflow" / "tasks" / "search_facts.py"
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.agent.num_workers={args.agent_workers}",
        f"custom_reward_function.path={reward}",
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        f"data.train_batch_size={args.prompts_per_step}",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.max_response_length}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "trainer.total_training_steps=100000",
        f"trainer.time_budget_minutes={args.grpo_minutes}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.val_before_train=true",
        "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out / 'ckpt' / name}",
        f"trainer.n_gpus_per_node={args.workers}",
        "trainer.project_name=search_agent",
        f"trainer.experiment_name={name}",
    ]
    if tools is not None:
        overrides += [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={args.max_assistant_turns}",
        ]
    if args.kl_coef > 0:  # verl's KL loss against the reference (the SFT model)
        overrides += [
            "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.actor.kl_loss_coef={args.kl_coef}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        ]
    overrides += args.override  # last, so they win
    subprocess.run([sys.executable, "-m", "hybridflow.trainer.main_ppo", *overrides], check=True, cwd=out)
    return out / "outputs" / "search_agent" / name / "metrics.jsonl"


def curve_of(metrics_file: Path, sft_s: float) -> list[dict]:
    """One point per validation: step, minutes since the run began (SFT, then the trainer's step and
    validation times: the wall clock without Ray's start), held-out accuracy, tool calls per sample."""
    points, clock = [], sft_s
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        clock += record.get("timing_s/step", 0.0) + record.get("timing_s/testing", 0.0)
        if VAL_KEY in record:
            point = {
                "step": record["step"],
                "minutes": round(clock / 60, 2),
                "acc": round(record[VAL_KEY], 3),
            }
            if "tool_calls/mean" in record:
                point["tool_calls"] = round(record["tool_calls/mean"], 2)
            points.append(point)
    return points


def run(args, out: Path, with_tool: bool) -> dict:
    """One arm (with or without the tool): data, server, model, SFT, GRPO; returns its summary."""
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.search_facts import (
        QUESTIONS,
        chance,
        make_people,
        search_query,
        split_people,
        task_texts,
        tool_config,
        write_task,
    )

    name = "with_tool" if with_tool else "no_tool"
    arm = out / name
    arm.mkdir(parents=True, exist_ok=True)
    data = write_task(arm / "data", args.num_people, args.num_test, args.seed, with_tool)
    people = make_people(args.num_people, args.seed)
    train_people, _ = split_people(people, args.num_test)
    base = build_tiny_model(
        out / "base",  # the same initial model for both arms
        texts=task_texts(people),
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=args.hidden_size * 8 // 3,
        max_position_embeddings=512,
        vocab_size=768,
        seed=args.seed,
    )
    server, tools = None, None
    try:
        text = None
        if with_tool:
            server, url = start_retrieval_server(data["corpus"], arm / "retrieval_server.log")
            tools = arm / "search_tool_config.yaml"
            tools.write_text(json.dumps(tool_config(url, args.topk), indent=2))  # JSON is valid YAML
            asked = [(p.name, kind) for p in train_people for kind in QUESTIONS]
            queries = [search_query(name, kind) for name, kind in asked]
            text = tool_texts(url, queries, args.topk)
        sft_dir = arm / "sft"
        sft = sft_warm_start(base, data["train"], sft_dir, args, text)
        print(json.dumps({"metric": "search_agent_sft", "arm": name, **sft}), flush=True)
        metrics = grpo(sft_dir, data, arm, args, tools, name)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    curve = curve_of(metrics, sft["sft_s"])
    for point in curve:
        print(json.dumps({"metric": "search_agent_curve", "arm": name, **point}), flush=True)
    first, last = curve[0], curve[-1]
    summary = {
        "metric": "search_agent_summary",
        "arm": name,
        "chance": round(chance(), 4),
        "acc_before_grpo": first["acc"],
        "acc_final": last["acc"],
        "grpo_gain_points": round(100 * (last["acc"] - first["acc"]), 1),
        "steps": last["step"],
        "minutes": last["minutes"],
    }
    print(json.dumps(summary), flush=True)
    (arm / "summary.json").write_text(json.dumps({"summary": summary, "curve": curve}, indent=2))
    return {"summary": summary, "curve": curve}


def plot(arms: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridflow.tasks.search_facts import chance

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for name, arm in arms.items():
        curve = arm["curve"]
        label = "with the search tool" if name == "with_tool" else "without the tool (control)"
        axis.plot([p["minutes"] for p in curve], [100 * p["acc"] for p in curve], marker="o", label=label)
    axis.axhline(100 * chance(), color="grey", linestyle=":", label="chance")
    axis.set_xlabel("minutes (SFT warm start, then GRPO steps and validations)")
    axis.set_ylabel("held-out accuracy, % (greedy)")
    axis.set_ylim(0, 100)
    axis.set_title("Search agent on invented facts: tiny model, 2 CPU cores")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()).removesuffix("::")
    )
    parser.add_argument("--out", default="outputs/search_agent")
    parser.add_argument("--control", action="store_true", help="also run the no-tool control and plot both")
    parser.add_argument(
        "--no-tool-only",
        action="store_true",
        help="run only the control (compared with a with_tool arm already in --out)",
    )
    parser.add_argument("--num-people", type=int, default=1200)
    parser.add_argument("--num-test", type=int, default=200, help="people of the held-out split")
    parser.add_argument("--topk", type=int, default=1, help="passages per search (verl's default: 3)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument(
        "--sft-copy-minutes",
        type=float,
        default=11.5,
        help="at most this long, every warm-start conversation searches (the copies are taught)",
    )
    parser.add_argument(
        "--sft-copy-loss",
        type=float,
        default=0.02,
        help="the copy phase ends early once the loss (mean of 25 steps) is below this: copies learned",
    )
    parser.add_argument(
        "--sft-decision-minutes",
        type=float,
        default=1.0,
        help="then this long the teacher searches only --teacher-search of the time (the no-tool "
        "control's SFT: --sft-copy-minutes + --sft-decision-minutes)",
    )
    parser.add_argument(
        "--teacher-search",
        type=float,
        default=0.3,
        help="after the copy phase: how often the teacher searches (else it answers from memory)",
    )
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--sft-batch", type=int, default=16, help="conversations per SFT step")
    parser.add_argument(
        "--teacher-accuracy",
        type=float,
        default=0.4,
        help="how often the teacher's answers from memory are right (training people only)",
    )
    parser.add_argument("--grpo-minutes", type=float, default=6.0)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group size)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0: verl's low_var_kl KL loss")
    parser.add_argument("--test-freq", type=int, default=4)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--max-response-length", type=int, default=128)
    parser.add_argument("--max-assistant-turns", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="trainer ranks (1: the engine gets the cores)")
    parser.add_argument("--agent-workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[], help="a main_ppo key=value (repeatable)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    arms = {}
    if not args.no_tool_only:
        arms["with_tool"] = run(args, out, with_tool=True)
    if args.control or args.no_tool_only:
        arms["no_tool"] = run(args, out, with_tool=False)
    earlier = out / "with_tool" / "summary.json"
    if "with_tool" not in arms and earlier.exists():  # --no-tool-only next to an earlier arm with the tool
        arms = {"with_tool": json.loads(earlier.read_text()), **arms}
    if len(arms) == 2:
        tool, control = arms["with_tool"]["summary"], arms["no_tool"]["summary"]
        gap = round(100 * (tool["acc_final"] - control["acc_final"]), 1)
        print(json.dumps({"metric": "search_agent_vs_control", "points": gap}), flush=True)
        plot(arms, out / "search_agent_curve.png")
        print(f"curve: {out / 'search_agent_curve.png'}", flush=True)


if __name__ == "__main__":
    main()
