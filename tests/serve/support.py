"""What the server tests share: a tiny model taught to answer with a Hermes tool call, and a way to
start ``python -m hybridflow.serve`` as its own process and wait until it is healthy."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from hybridflow.utils.ports import find_free_port as _free_port

QUESTION = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def teach_tool_call(model_dir: Path) -> None:
    """Fine-tune the model in ``model_dir`` (in place) to answer QUESTION (with the tool offered) with
    CALL and end its turn: teacher-forced cross-entropy on the answer tokens only."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        QUESTION, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    answer = tokenizer.encode(CALL, add_special_tokens=False) + get_generation_eos_ids(model_dir)[:1]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(model_dir)


def start_server(model_dir: str, *extra: str, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "hybridflow.serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    log = Path(model_dir).parent / f"server-{port}.log"  # a file, not a pipe nobody drains
    with open(log, "w") as out:
        process = subprocess.Popen([*command, *extra], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not become healthy")
