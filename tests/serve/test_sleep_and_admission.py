"""``python -m hybridflow.serve`` under concurrent control calls and wide requests: ``/wake_up`` while
``/sleep`` drains, two ``/sleep`` at once (:mod:`hybridflow.serve.sleep`), and admission that counts a
request's ``n`` samples, not the request (:meth:`hybridflow.serve.app.EngineService.admitted`).

The server runs a random model long enough (2048 positions) that a request outlasts the calls made
around it, with 4 cache slots and ``--max-waiting 4``: 8 sequences at once."""

import asyncio
import time

import pytest

from tests.serve.support import start_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

LIMITS = ["--max-num-seqs", "4", "--max-waiting", "4", "--max-n", "4", "--max-prompts", "3"]
LONG = 1500  # tokens: a request that runs for seconds
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hybridflow.models.tiny import build_tiny_model

    model = str(
        build_tiny_model(
            tmp_path_factory.mktemp("sleepy") / "model",
            hidden_size=128,
            num_layers=4,
            intermediate_size=352,
            max_position_embeddings=2048,
        )
    )
    process, url = start_server(model, "--max-model-len", "2048", *LIMITS)
    yield url, model
    process.terminate()
    process.wait(timeout=30)


async def _until(client, path: str, check, timeout_s: float = 20.0) -> dict:
    """GET ``path`` until ``check`` holds for its JSON."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        answer = (await client.get(path)).json()
        if check(answer):
            return answer
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never satisfied the check: {answer}")


def _long_request(client, model: str):
    body = {"model": model, "prompt": "1 + 1 =", "max_tokens": LONG, "ignore_eos": True}
    return asyncio.ensure_future(client.post("/v1/completions", json=body))


def test_a_wake_up_while_sleep_drains_calls_the_sleep_off_and_the_server_serves(server):
    """The sleep answers 409 at once, the cache is never released, the running request ends whole and
    new requests are served (before the fix the sleep released the cache after the wake: 500s)."""
    url, model = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            long = _long_request(client, model)
            await _until(client, "/stats", lambda s: s["running"] == 1)
            sleep = asyncio.ensure_future(client.post("/sleep"))
            await _until(client, "/is_sleeping", lambda s: s["is_sleeping"])
            draining = await client.post("/v1/chat/completions", json={"model": model, "messages": HI})
            woke = await client.post("/wake_up")
            running = (await client.get("/stats")).json()["running"]
            slept = await asyncio.wait_for(sleep, 5)  # called off, not waiting for the long request
            return draining, woke, running, slept, await long

    draining, woke, running, slept, long = asyncio.run(run())
    assert draining.status_code == 503 and draining.headers["retry-after"] == "1"  # admission closed
    assert woke.status_code == 200 and woke.json()["sleeping"] is False and woke.json()["kv_bytes"] > 0
    assert running == 1  # the wake came while the drain still waited for the long request
    assert slept.status_code == 409 and slept.json()["error"]["type"] == "conflict"
    assert "wake_up" in slept.json()["error"]["message"]
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == LONG
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert httpx.post(f"{url}/sleep").json()["freed_kv_bytes"] > 0  # and it still sleeps and wakes
    assert httpx.post(f"{url}/wake_up").json()["kv_bytes"] > 0
    assert httpx.get(f"{url}/stats").json()["in_flight"] == 0


def test_a_second_sleep_while_the_first_drains_answers_once_the_cache_is_released(server):
    url, model = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            long = _long_request(client, model)
            await _until(client, "/stats", lambda s: s["running"] == 1)
            first = asyncio.ensure_future(client.post("/sleep"))
            await _until(client, "/is_sleeping", lambda s: s["is_sleeping"])
            second = asyncio.ensure_future(client.post("/sleep"))
            await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
            stats = (await client.get("/stats")).json()  # at the first answer: nothing runs any more
            return await first, await second, stats, await long

    first, second, stats, long = asyncio.run(run())
    assert stats["running"] == stats["waiting"] == stats["in_flight"] == 0
    assert first.status_code == second.status_code == 200
    assert first.json()["sleeping"] is second.json()["sleeping"] is True
    assert first.json()["freed_kv_bytes"] > 0 and second.json()["freed_kv_bytes"] == 0  # released once
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == LONG
    asleep = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": HI})
    assert asleep.status_code == 503 and "asleep" in asleep.text
    assert httpx.post(f"{url}/wake_up").json()["kv_bytes"] == first.json()["freed_kv_bytes"]
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.chat.completions.create(model=model, messages=HI, max_tokens=4).choices


def test_admission_counts_samples_and_gives_back_what_it_took(server):
    """4 slots + ``--max-waiting 4`` hold 8 sequences: a request of more is a 400 naming n and the limit;
    with 8 held (a 4-sample request running and a streamed 4-sample one queued) even n=1 gets 503; once
    their clients leave every place is free again, and a request of exactly 8 is served."""
    url, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(
        openai.BadRequestError, match=r"n=4 x 3 prompts = 12 sequences is above the 8 sequences this server"
    ):
        client.completions.create(model=model, prompt=["1", "2", "3"], n=4, max_tokens=2)
    before = httpx.get(f"{url}/stats").json()

    async def hold_and_ask():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"model": model, "max_tokens": LONG, "ignore_eos": True, "n": 4}
            running = asyncio.ensure_future(http.post("/v1/completions", json={**body, "prompt": "1 + 1 ="}))
            await _until(http, "/stats", lambda s: s["running"] == 4)
            chat = {**body, "messages": HI, "stream": True}
            queued = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat))
            await _until(http, "/stats", lambda s: s["waiting"] == 1)
            async with openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10
            ) as async_client:
                try:
                    await async_client.chat.completions.create(model=model, messages=HI, max_tokens=2)
                    busy = None
                except openai.APIError as error:
                    busy = error
            held = (await http.get("/stats")).json()["in_flight"]
            for holder in (running, queued):  # the clients leave
                holder.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
            return busy, held

    busy, held = asyncio.run(hold_and_ask())
    assert isinstance(busy, openai.APIStatusError) and busy.status_code == 503, busy
    assert busy.response.headers["retry-after"] == "1" and "sequences are waiting" in busy.message
    assert held == 8
    start = time.monotonic()
    while time.monotonic() - start < 30:
        stats = httpx.get(f"{url}/stats").json()
        if stats["in_flight"] == stats["running"] == stats["waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["in_flight"] == stats["running"] == stats["waiting"] == 0, stats
    assert stats["aborted_requests"] - before["aborted_requests"] == 2
    whole = client.completions.create(model=model, prompt=["1 +", "2 +"], n=4, max_tokens=3)
    assert len(whole.choices) == 8
    assert httpx.get(f"{url}/stats").json()["in_flight"] == 0
