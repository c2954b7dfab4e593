"""Distillation with a served teacher through ``run_ppo``: two ``hybridflow.serve`` replicas (HTTP, with
an API key) behind the least-in-flight router, 3 steps in each ``trainer.scheduler`` mode.

All three modes train step 1 on the same batch (the initial weights); one_step_off and two_step_off both
train step 2 on a batch from the initial weights, so their step 2 is the same; at step 3 two_step_off
still trains on the initial weights' batch and one_step_off on a batch one update old."""

import json
import math
import shutil
import socket
import threading
import time

import httpx
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from hybridflow.utils.ports import find_free_port
from tests.tiny_run import as_overrides, tiny_run_values

KEY = "teacher-key"


def _consecutive_ports() -> int:
    for _ in range(50):
        port = find_free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    """A teacher: the tiny model with perturbed weights (the same tokenizer), on two replicas."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("teacher") / "model"
    shutil.copytree(tiny_model_dir, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(path)
    port = _consecutive_ports()
    servers = [_serve_in_thread(str(path), port + i) for i in range(2)]
    try:
        yield "127.0.0.1", port
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=10)


def _serve_in_thread(model_dir: str, port: int):
    """``python -m hybridflow.serve --api-key KEY`` as a uvicorn server on a thread of this process (a
    real HTTP server; the seconds of a new process's imports saved)."""
    import uvicorn

    from hybridflow.serve.__main__ import build_service, parse_args
    from hybridflow.serve.app import build_app

    args = parse_args(["--model", model_dir, "--port", str(port), "--api-key", KEY, "--max-num-seqs", "8"])
    app = build_app(build_service(args), api_key=KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            return server, thread
        time.sleep(0.05)
    raise RuntimeError(f"the teacher on port {port} did not start")


def _run(model_dir, data, tmp, teacher, scheduler: str) -> dict[int, dict]:
    host, port = teacher
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": scheduler,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 3,
            "trainer.scheduler": scheduler,
            "data.shuffle": False,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.teacher.server_ip": host,
            "actor_rollout_ref.teacher.server_port": port,
            "actor_rollout_ref.teacher.n_server_workers": 2,
            "actor_rollout_ref.teacher.n_logprobs": 4,
            "actor_rollout_ref.teacher.micro_batch_size": 2,
            "actor_rollout_ref.teacher.api_key": KEY,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    tmp.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config)
    lines = (tmp / "outputs" / "hybridflow" / scheduler / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


SAME = ("actor/distill_loss", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


@pytest.mark.slow  # a whole run; its parts are checked in the fast tier (make test <= 15 min)
def test_three_steps_in_each_scheduler_mode(ray_session, tiny_model_dir, arithmetic_data, tmp_path, teacher):
    runs = {
        mode: _run(tiny_model_dir, arithmetic_data, tmp_path / mode, teacher, mode)
        for mode in ("sequential", "one_step_off", "two_step_off")
    }
    for depth, (mode, steps) in enumerate(runs.items()):
        assert sorted(steps) == [1, 2, 3], mode
        for step in (1, 2, 3):
            record = steps[step]
            assert record["distill/staleness"] == min(depth, step - 1), (mode, step)
            assert record["distill/teacher_failed_rows"] == 0
            assert 0 < record["actor/distill_teacher_topk_mass"] <= 1
            # not a divergence on a truncated top-k: Q can exceed P there, and the loss dip below 0
            assert math.isfinite(record["actor/distill_loss"])
        wait = {0: "get_teacher_knowledge", 1: "wait_prev_teacher", 2: "wait_prev_prev_teacher"}[depth]
        assert all(f"timing_s/{wait}" in steps[s] for s in (1, 2, 3))
        assert "timing_s/wait_prev_gen" in steps[1] and "timing_s/sync_rollout_weights" in steps[1]
    seq, one, two = runs["sequential"], runs["one_step_off"], runs["two_step_off"]
    for key in SAME:
        assert one[1][key] == pytest.approx(seq[1][key], rel=1e-5) == two[1][key], key
        assert two[2][key] == pytest.approx(one[2][key], rel=1e-5), key
    assert one[2]["actor/distill_loss"] != pytest.approx(seq[2]["actor/distill_loss"], rel=1e-4)
    assert two[3]["actor/distill_loss"] != pytest.approx(one[3]["actor/distill_loss"], rel=1e-4)


def test_the_teacher_refuses_another_vocabulary_and_a_wrong_key(teacher, tiny_model_dir):
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.trainer.distill import TeacherClient, TeacherError, TeacherSettings
    from hybridflow.utils.served_client import ServedModelError
    from hybridflow.utils.vocab_fingerprint import vocab_fingerprint

    host, port = teacher
    fingerprint = vocab_fingerprint(load_tokenizer(tiny_model_dir))
    client = TeacherClient(TeacherSettings(host, port, n_server_workers=2, api_key=KEY))
    try:
        client.check_vocab(512, fingerprint)  # the same vocabulary: accepted
        with pytest.raises(TeacherError, match="vocabulary size 512 != the student's 513"):
            client.check_vocab(513, fingerprint)
        with pytest.raises(TeacherError, match="maps tokens to other ids"):
            client.check_vocab(512, "sha256:other")
    finally:
        client.close()
    wrong = TeacherClient(TeacherSettings(host, port, api_key="wrong", max_retries=0))
    try:
        with pytest.raises(ServedModelError, match="401"):
            wrong.check_vocab(512, fingerprint)
    finally:
        wrong.close()
    answer = httpx.post(
        f"http://{host}:{port}/v1/score",
        json={"prompts": [[1, 2]], "responses": [[3, 9999]], "top_k": 2},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert answer.status_code == 400 and "responses[0]" in answer.json()["error"]["param"]


def test_a_failing_replica_costs_only_its_rows(teacher):
    """Replica 2 is not there (a dead port): its requests fail for good, their rows get no teacher signal
    (P = 0: no loss, no gradient), the rows scored by the live replica carry the teacher's top-k."""
    from hybridflow import keys
    from hybridflow.protocol import DataProto
    from hybridflow.trainer.distill import TeacherClient, TeacherError, TeacherSettings
    from hybridflow.trainer.distill.teacher import NO_SIGNAL

    host, port = teacher
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])
    responses = torch.tensor([[10, 11, 0], [12, 0, 0], [13, 14, 15], [16, 17, 0]])
    mask = torch.cat([prompts != 0, torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])], dim=1)
    batch = DataProto.from_dict(
        {
            keys.INPUT_IDS: torch.cat([prompts, responses], 1),
            keys.ATTENTION_MASK: mask,
            keys.RESPONSES: responses,
        }
    )
    dead = _consecutive_ports()  # nobody listens there
    client = TeacherClient(
        TeacherSettings(host, port, n_logprobs=3, micro_batch_size=1, api_key=KEY, max_retries=0)
    )
    client.router.server_handles.append(
        type(client.router.server_handles[0])(f"http://{host}:{dead}", api_key=KEY, max_retries=0)
    )
    client.router.names.append(f"http://{host}:{dead}")
    client.router.in_flight.append(0)
    client.router.sent.append(0)
    try:
        top_log_probs, top_ids, metrics = client.submit(batch).result(timeout=60)
    finally:
        client.close()
    scored = (top_log_probs[:, 0, 0] > NO_SIGNAL).tolist()
    assert 0 < sum(scored) < 4 and metrics["distill/teacher_failed_rows"] == 4 - sum(scored)
    for row, ok in enumerate(scored):
        length = int(mask[row, 3:].sum())
        if ok:  # the valid positions hold k descending log-probs; the padding none
            assert (top_log_probs[row, :length].diff(dim=-1) <= 0).all()
            assert (top_log_probs[row, length:] == NO_SIGNAL).all()
        else:
            assert (top_log_probs[row] == NO_SIGNAL).all()
    everyone_dead = TeacherClient(TeacherSettings(host, dead, max_retries=0))
    try:
        with pytest.raises(TeacherError, match="every teacher request failed"):
            everyone_dead.submit(batch).result(timeout=60)
    finally:
        everyone_dead.close()
