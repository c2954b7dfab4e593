"""hybridflow.utils.served_client against a real ``python -m hybridflow.serve`` (chat, 401 with and
without the key, 503 + Retry-After under a full waiting list) and against a real HTTP judge that hangs,
answers garbage, 500s or 429s."""

import asyncio
import time

import pytest

from hybridflow.utils.served_client import (
    CallStats,
    ServedClient,
    ServedModelError,
    base_url,
    chat_complete,
    post_json,
    recording,
)
from tests.reward_loop.support import BadJudge
from tests.serve.support import start_server

KEY = "sk-judge"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    """One slot and no waiting list: a second request in flight is answered 503 + Retry-After."""
    process, url = start_server(tiny_model_dir, "--api-key", KEY, "--max-num-seqs", "1", "--max-waiting", "0")
    yield url
    process.kill()
    process.wait()


def _request(model: str, max_tokens: int = 4) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "1+2="}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def test_base_url_forms():
    assert base_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert base_url("https://h:1") == "https://h:1"


def test_chat_complete_on_the_served_engine_with_its_key(keyed_server, tiny_model_dir):
    address = keyed_server.removeprefix("http://")  # verl's router address: host:port
    with recording() as stats:
        result = asyncio.run(chat_complete(address, _request(tiny_model_dir), api_key=KEY))
    assert result.choices[0].message.role == "assistant"
    assert isinstance(result.choices[0].message.content, str)
    assert result.usage.completion_tokens <= 4
    assert stats.requests == 1 and len(stats.latencies_s) == 1 and stats.retries == 0


def test_401_is_not_retried_and_says_what_to_do(keyed_server, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_API_KEY", raising=False)
    with recording() as stats, pytest.raises(ServedModelError, match="HYBRIDFLOW_API_KEY") as caught:
        asyncio.run(chat_complete(keyed_server, _request(tiny_model_dir), max_retries=5))
    assert caught.value.kind == "unauthorized" and caught.value.status == 401
    assert stats.retries == 0 and stats.failures == {"unauthorized": 1}
    monkeypatch.setenv("HYBRIDFLOW_API_KEY", KEY)  # the environment's key is the default
    assert asyncio.run(chat_complete(keyed_server, _request(tiny_model_dir))).choices


def test_503_with_retry_after_is_retried_until_served(keyed_server, tiny_model_dir):
    """Two requests at once on a one-slot server with no waiting list: without retries one gets the
    503; with them both are answered, after at least one retry honouring Retry-After (1 s)."""

    async def two(max_retries: int):
        async with ServedClient(keyed_server, api_key=KEY, max_retries=max_retries) as client:
            calls = [client.chat_complete(_request(tiny_model_dir, 48)) for _ in range(2)]
            return await asyncio.gather(*calls, return_exceptions=True)

    with recording() as stats:
        results = asyncio.run(two(0))
    refused = [r for r in results if isinstance(r, ServedModelError)]
    assert len(refused) == 1 and refused[0].status == 503, results
    assert stats.failures == {"http_503": 1} and stats.retries == 0
    start = time.monotonic()
    with recording() as stats:
        results = asyncio.run(two(3))
    assert all(not isinstance(r, Exception) for r in results), results
    assert stats.retries >= 1 and not stats.failures
    assert time.monotonic() - start >= 0.9  # the server's Retry-After: 1 was waited


@pytest.mark.parametrize(
    ("mode", "kind", "requests"),
    [("garbage", "bad_json", 1), ("500", "http_500", 1), ("429", "http_429", 3)],
)
def test_a_judge_that_misbehaves_fails_clearly(mode, kind, requests):
    judge = BadJudge(mode)
    try:
        with recording() as stats, pytest.raises(ServedModelError) as caught:
            asyncio.run(post_json(judge.address, "/v1/chat/completions", {}, max_retries=2, backoff_s=0.01))
    finally:
        judge.close()
    assert caught.value.kind == kind and judge.address in caught.value.url
    assert judge.requests == requests  # 500 and garbage: not retried; 429: retried twice
    assert stats.failures == {kind: 1} and stats.retries == requests - 1


def test_a_hanging_judge_times_out_and_is_retried_only_when_asked():
    judge = BadJudge("hang")
    try:
        start = time.monotonic()
        with pytest.raises(ServedModelError, match="no answer within") as caught:
            asyncio.run(post_json(judge.address, "/x", {}, timeout_s=0.3, max_retries=3))
        assert caught.value.kind == "timeout" and judge.requests == 1
        assert time.monotonic() - start < 2
        stats = CallStats()
        with recording(stats), pytest.raises(ServedModelError):
            asyncio.run(post_json(judge.address, "/x", {}, timeout_s=0.3, max_retries=1, retry_timeouts=True,
                                  backoff_s=0.01))  # fmt: skip
        assert judge.requests == 3 and stats.retries == 1 and stats.failures == {"timeout": 1}
        with pytest.raises(ServedModelError, match="all attempts"):  # the whole call's limit binds first
            asyncio.run(post_json(judge.address, "/x", {}, timeout_s=5, total_timeout_s=0.3))
    finally:
        judge.close()


def test_a_flaky_judge_is_answered_after_retries_and_nothing_is_counted_as_failed():
    judge = BadJudge("flaky", failures=2, content="correct")
    try:
        with recording() as stats:
            result = asyncio.run(chat_complete(judge.address, {"messages": []}, backoff_s=0.01))
    finally:
        judge.close()
    assert result.choices[0].message.content == "correct"
    assert judge.requests == 3 and stats.retries == 2 and not stats.failures and len(stats.latencies_s) == 3


def test_nobody_there_is_a_connect_error():
    with pytest.raises(ServedModelError) as caught:
        asyncio.run(post_json("127.0.0.1:1", "/x", {}, max_retries=1, backoff_s=0.01))
    assert caught.value.kind == "connect" and caught.value.attempts == 2
