"""``python -m hybridflow.serve`` under hostile and careless clients: an API key, bounded requests and
queue, one bad request beside good ones, clients that leave, and a fuzz of malformed requests.

The server runs a random model wide and long enough (2048 positions) that a request can outlast the
client that sent it."""

import asyncio
import json
import random
import time

import pytest

from tests.serve.support import start_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-test-hybridflow"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ["--max-num-seqs", "4", "--max-waiting", "10", "--max-n", "4", "--max-prompts", "3"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    from hybridflow.models.tiny import build_tiny_model

    model = str(
        build_tiny_model(
            tmp_path_factory.mktemp("guarded") / "model",
            hidden_size=128,
            num_layers=4,
            intermediate_size=352,
            max_position_embeddings=2048,
        )
    )
    process, url = start_server(
        model, "--api-key", KEY, "--max-model-len", "2048", "--max-request-bytes", "65536", *LIMITS
    )
    yield url, model
    process.terminate()
    process.wait(timeout=30)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", headers=AUTH).json()


def _wait_idle(url: str, timeout_s: float = 15.0) -> dict:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        stats = _stats(url)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine still holds requests after {timeout_s} s: {_stats(url)}")


def test_the_api_key_guards_v1_and_stats_but_not_health(guarded):
    url, model = guarded
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/stats"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            reply = httpx.get(f"{url}{path}", headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    unauthorised = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthorised.completions.create(model=model, prompt="1 + 1", max_tokens=2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=model, prompt="1 + 1", max_tokens=2).usage.completion_tokens >= 1


def test_requests_beyond_the_limits_are_4xx_before_the_engine(guarded):
    url, model = guarded
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    vocab = 512  # build_tiny_model's vocabulary
    before = _stats(url)
    with pytest.raises(openai.BadRequestError, match=rf"Token id {vocab} is outside the model's vocabulary"):
        client.completions.create(model=model, prompt=[3, vocab], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Token id -1 is outside"):
        client.completions.create(model=model, prompt=[[-1, 4]], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=model, prompt="1 +", max_tokens=2, seed=2**64)
    with pytest.raises(openai.BadRequestError, match="n=5 is above this server's limit of 4"):
        client.completions.create(model=model, prompt="1 +", max_tokens=2, n=5)
    with pytest.raises(openai.BadRequestError, match="4 prompts in one request; the most is 3"):
        client.completions.create(model=model, prompt=["1", "2", "3", "4"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="The prompt is empty"):
        client.completions.create(model=model, prompt=[], max_tokens=2)
    huge = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"model": model, "prompt": "x" * 70_000})
    assert huge.status_code == 413 and "65536 bytes" in huge.json()["error"]["message"]
    after = _stats(url)
    assert after["prefill_tokens"] == before["prefill_tokens"]  # none of them reached the engine


def test_a_poison_request_beside_eight_good_ones_leaves_them_finishing(guarded):
    url, model = guarded

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
            good = [
                client.completions.create(model=model, prompt=f"{i} + {i} =", max_tokens=6, seed=i)
                for i in range(8)
            ]
            poison = client.completions.create(model=model, prompt=[5, 10**9], max_tokens=6)
            return await asyncio.gather(poison, *good, return_exceptions=True)

    poison, *good = asyncio.run(run())
    assert isinstance(poison, openai.BadRequestError)
    assert all(not isinstance(r, Exception) and r.usage.completion_tokens >= 1 for r in good)


def test_a_full_queue_answers_503_and_clients_that_leave_free_their_slots(guarded):
    """24 long requests at once against 4 slots and a waiting list of 10: the ones that find the list
    full get 503 with Retry-After; the clients then leave, and every slot and queue entry is freed
    without decoding on to 1500 tokens."""
    url, model = guarded
    before = _stats(url)

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=2.0) as client:
            body = {"model": model, "prompt": "1 + 1 =", "max_tokens": 1500, "ignore_eos": True}
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(24)), return_exceptions=True
            )
        return replies

    replies = asyncio.run(run())
    busy = [r for r in replies if isinstance(r, httpx.Response) and r.status_code == 503]
    assert len(busy) >= 10 and all(r.headers["retry-after"] == "1" for r in busy)
    assert busy[0].json()["error"]["type"] == "server_busy"
    timed_out = [r for r in replies if isinstance(r, httpx.TimeoutException)]
    assert len(timed_out) + len(busy) == 24  # the others were still generating when their clients left
    after = _wait_idle(url)
    assert after["aborted_requests"] - before["aborted_requests"] == len(timed_out)
    assert after["generated_tokens"] - before["generated_tokens"] < len(timed_out) * 1500 / 2


def test_a_stream_whose_client_leaves_is_aborted_and_health_answers_meanwhile(guarded):
    url, model = guarded
    before = _stats(url)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=30) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        chunks = [next(lines) for _ in range(6)]
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=1.0).status_code == 200
        assert time.monotonic() - start < 1.0
    assert any(c.startswith("data: ") for c in chunks)
    after = _wait_idle(url)
    assert after["aborted_requests"] - before["aborted_requests"] == 1
    assert after["generated_tokens"] - before["generated_tokens"] < 1900


def _junk(rng: random.Random, depth: int = 0):
    """A random JSON value: the types and sizes a careless or hostile client sends."""
    kinds = ["int", "huge", "float", "str", "unicode", "long", "bool", "none", "list", "dict", "empty"]
    kind = rng.choice(kinds if depth < 3 else kinds[:8])
    if kind == "int":
        return rng.randint(-5, 600)
    if kind == "huge":
        return rng.choice([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, -1e-308, 3.7, 2.0000001])
    if kind == "str":
        return rng.choice(["", " ", "null", "1", "gpt-4", "<tool_call>", "\x00", "{", "user"])
    if kind == "unicode":
        return "".join(
            chr(rng.choice([0x1F600, 0x202E, 0xFEFF, 0x4E2D, 0x0301, 0xD7FF, 0x10FFFF])) for _ in range(5)
        )
    if kind == "long":
        return "a" * rng.choice([1000, 20_000])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "none":
        return None
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        return {rng.choice(["role", "content", "x", "", "type"]): _junk(rng, depth + 1) for _ in range(3)}
    return {} if rng.random() < 0.5 else []


def _hostile_request(rng: random.Random, model: str) -> tuple[str, dict, bytes]:
    """(path, headers, body): a valid request with fields replaced, dropped or added, or a raw body."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": model, "max_tokens": 3}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "1 + 1"})
    odd_keys = [{}, {"Authorization": "Bearer \u00e9".encode()}]  # none, or one that is not ASCII
    headers = dict(AUTH) if rng.random() < 0.9 else rng.choice(odd_keys)
    headers["content-type"] = "application/json"
    roll = rng.random()
    if roll < 0.15:
        raw = rng.choice(
            [
                b"",
                b"{",
                b"[]",
                b"null",
                b'"text"',
                b"\xff\xfe\x00",
                b"{" * 5000,
                b"[" * 30000,
                b'{"model": NaN}',
            ]
        )
        return path, headers, raw
    fields = [
        "model", "messages", "prompt", "n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed",
        "stream", "logprobs", "top_logprobs", "tools", "tool_choice", "echo", "ignore_eos",
        "max_completion_tokens", "stream_options",
    ]  # fmt: skip
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(fields)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = _junk(rng)
    if body.get("max_tokens") not in (None,) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8) if body["max_tokens"] > 0 else body["max_tokens"]
    body.setdefault("max_tokens", 3)
    return path, headers, json.dumps(body).encode()


def test_two_hundred_and_forty_hostile_requests_get_no_500_and_the_server_still_answers(guarded):
    url, model = guarded
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(240):
            path, headers, body = _hostile_request(rng, model)
            reply = client.post(path, headers=headers, content=body)
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
            assert reply.status_code < 500, (path, body[:300], reply.status_code, reply.text[:300])
            if reply.status_code >= 400:
                assert "error" in reply.json()
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) >= 150  # most of them are refused
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length") and _wait_idle(url)["running"] == 0
