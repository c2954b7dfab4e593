"""A DisRM served by ``python -m hybridflow.serve`` (POST /classify on a sequence-classification model):
its scores equal an HF forward of each input alone, concurrent requests batched together included, and
the reward loop scores a batch's samples through it as verl's reward loop does."""

import asyncio

import httpx
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.utils.served_client import ServedClient
from hybridflow.workers.reward_loop import RewardLoop
from hybridflow.workers.reward_loop.disrm import ServedDisRM
from tests.serve.support import start_server
from tests.workers.reward_manager.test_reward_managers import make_batch


@pytest.fixture(scope="module")
def disrm(tiny_model_dir, tmp_path_factory):
    """The tiny model with a fresh one-logit classification head, served."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("disrm") / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    process, url = start_server(str(path), "--served-model-name", "rm")
    yield str(path), url
    process.kill()
    process.wait()


def _hf_scores(path: str, texts: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, -1]) for t in texts]


TEXTS = ["1 + 2 = 3", "what is 7 + 5? it is 12, I think", "9"]


def test_classify_equals_an_hf_forward_of_each_input_alone(disrm):
    path, url = disrm
    answer = httpx.post(f"{url}/classify", json={"model": "rm", "input": TEXTS, "activation": False}).json()
    served = [row["probs"][-1] for row in answer["data"]]
    assert served == pytest.approx(_hf_scores(path, TEXTS), abs=1e-5)
    probs = httpx.post(f"{url}/classify", json={"model": "rm", "input": TEXTS[0]}).json()["data"][0]["probs"][
        0
    ]
    assert probs == pytest.approx(1 / (1 + np.exp(-served[0])), abs=1e-6)  # activation: sigmoid, one class

    async def concurrent():  # 12 requests in flight at once: batched by the server, each its own answer
        async with ServedClient(url) as client:
            calls = [
                client.post_json("/classify", {"input": TEXTS[i % 3], "activation": False}) for i in range(12)
            ]
            return await asyncio.gather(*calls)

    for i, out in enumerate(asyncio.run(concurrent())):
        assert out["data"][0]["probs"][0] == pytest.approx(served[i % 3], abs=1e-5)


def test_bad_inputs_are_400_naming_the_input(disrm):
    _, url = disrm
    empty = httpx.post(f"{url}/classify", json={"input": ["ok", []]})
    assert empty.status_code == 400 and "input[1]" in empty.json()["error"]["message"]
    outside = httpx.post(f"{url}/classify", json={"input": [[1, 99999]]})
    assert outside.status_code == 400 and "99999" in outside.json()["error"]["message"]
    assert httpx.post(f"{url}/classify", json={"model": "other", "input": "x"}).status_code == 404
    assert httpx.post(f"{url}/classify", json={"input": "1 + 1"}).status_code == 200  # still serving


def test_the_reward_loop_scores_through_the_served_disrm(disrm):
    from transformers import AutoTokenizer

    path, url = disrm
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = make_batch(tokenizer, ["3", "5 apples", "12"], ["3", "4", "12"])
    chats = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(3)]
    batch.non_tensor_batch["raw_prompt"] = np.array(chats + [None], dtype=object)[:3]
    config = OmegaConf.create(
        {"reward_model": {"reward_manager": "naive"}, "custom_reward_function": {"path": None}}
    )
    served = ServedDisRM(url, "rm", tokenizer, tokenizer)
    loop = RewardLoop(config, tokenizer, disrm=served)
    reward = loop(batch)
    expected = _hf_scores(path, [served.prompt(batch[i : i + 1]) for i in range(3)])
    assert reward.sum(-1).tolist() == pytest.approx(expected, abs=1e-5)
    assert loop.pop_metrics()["reward/disrm/mean"] == pytest.approx(np.mean(expected), abs=1e-5)
