"""The paged KV cache and its prefix cache: the same tokens and log-probs with the cache on or off, shared
prompt blocks counted, the flush at a weight update, preemption under a small pool, abort and resume."""

from dataclasses import replace

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.block_pool import BlockPool, block_keys
from tests.workers.rollout.test_engine import EOS, _prompts, _random_model

GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)
SEEDED = SamplingParams(max_new_tokens=10, temperature=0.8, seed=11)


@pytest.fixture(scope="module")
def model():
    return _random_model("qwen2")


def _engine(model, caching=True, blocks=None, max_len=160, rows=16, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, max_len),
        rows,
        max_len,
        eos_token_ids=[EOS],
        num_blocks=blocks,
        block_size=8,
        enable_prefix_caching=caching,
        **kwargs,
    )


def _conversation(engine, params, turns=4, n=1):
    """Four turns of six conversations: each turn's prompt is the last one's context, its first
    sample's answer and a new user message. Returns every sample's (tokens, log-probs) per turn."""
    prompts = _prompts(6, seed=2)
    out = []
    for turn in range(turns):
        results = engine.generate_batch(prompts, params, n=n)
        out.append([(c.token_ids, c.log_probs) for r in results for c in r.completions])
        prompts = [
            r.prompt_token_ids + r.completions[0].token_ids + [5 + turn, 9, 11 + i]
            for i, r in enumerate(results)
        ]
    return out


def _assert_same(a, b, atol=1e-5):
    assert [[t for t, _ in turn] for turn in a] == [[t for t, _ in turn] for turn in b]
    for turn_a, turn_b in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(turn_a, turn_b, strict=True):
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=atol, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_caching_changes_no_token_and_prefills_only_the_new_tokens(model, params):
    on, off = _engine(model), _engine(model, caching=False)
    with_cache, without = _conversation(on, params, n=2), _conversation(off, params, n=2)
    _assert_same(with_cache, without)
    assert on.pool.stats["prefix_hits"] > 0 and off.pool.stats["prefix_hits"] == 0
    # every turn after the first finds the last turn's context: far fewer tokens prefilled
    assert on.stats["prefill_tokens"] < 0.5 * off.stats["prefill_tokens"]


def test_the_samples_of_a_prompt_share_its_full_blocks(model):
    """A 40-token prompt with n=4 on blocks of 8: its 5 full blocks once, one block per sample (the
    first token's), not 4 x 6."""
    engine = _engine(model)
    engine.add_request(list(range(3, 43)), replace(GREEDY, max_new_tokens=3, ignore_eos=True), n=4)
    engine.step()  # the prefill and the first decode (position 40: each sample's own block)
    assert engine.pool.num_used == 5 + 4
    assert sorted(engine.pool.refs).count(4) == 5  # the shared blocks, held by the four samples


def test_a_weight_update_flushes_the_prefix_cache(model):
    """Cached keys and values were computed with the old weights: after a sync the same prompt gives
    what a fresh engine with the new weights gives, and nothing is found in the cache."""
    engine = _engine(model)
    prompt = list(range(3, 60))
    engine.generate_batch([prompt], GREEDY)
    assert engine.pool.num_cached > 0
    changed = {}
    for name, tensor in model.named_parameters():
        if name.endswith("mlp.down_proj.weight"):
            changed[name] = tensor.detach() * -1.5
            engine.model.load_weight(name, changed[name])
    hits = engine.pool.stats["prefix_hits"]
    after = engine.generate_batch([prompt], GREEDY)[0].completions[0]
    assert engine.stats["prefix_cache_flushes"] == 1 and engine.pool.stats["prefix_hits"] == hits
    fresh_model = EngineModel.from_hf_module(model, 160)
    for name, tensor in changed.items():
        fresh_model.load_weight(name, tensor)
    fresh = LLMEngine(fresh_model, 16, 160, [EOS], block_size=8).generate_batch([prompt], GREEDY)[0]
    assert after.token_ids == fresh.completions[0].token_ids
    torch.testing.assert_close(torch.tensor(after.log_probs), torch.tensor(fresh.completions[0].log_probs))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_under_a_small_pool_gives_the_large_pools_output(model, params):
    """24 blocks of 8 cannot hold 12 sequences growing to ~30 positions: the newest are preempted and
    recomputed, and every token and log-prob is what a pool that holds them all gives."""
    params = replace(params, max_new_tokens=20, ignore_eos=True)
    prompts = _prompts(6, seed=4)
    large = _engine(model).generate_batch(prompts, params, n=2)
    small_engine = _engine(model, blocks=24)
    small = small_engine.generate_batch(prompts, params, n=2)
    assert small_engine.stats["preemptions"] > 0
    tokens = [[c.token_ids for r in run for c in r.completions] for run in (small, large)]
    assert tokens[0] == tokens[1]
    got = torch.tensor([x for r in small for c in r.completions for x in c.log_probs])
    want = torch.tensor([x for r in large for c in r.completions for x in c.log_probs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert small_engine.pool.num_used == 0  # every block back


def test_abort_frees_the_blocks_and_a_resumed_request_continues_from_the_cache(model):
    """A partial rollout: aborted mid-way (its blocks back in the pool), then resumed as prompt +
    partial output, which finds the aborted request's full blocks and ends as an uninterrupted run."""
    params = replace(GREEDY, max_new_tokens=24, ignore_eos=True)
    prompt = list(range(3, 30))
    whole = _engine(model).generate_batch([prompt], params)[0].completions[0].token_ids
    engine = _engine(model)
    request = engine.add_request(prompt, params, request_id="partial")
    for _ in range(9):
        engine.step()
    partial = engine.abort("partial").completions[0]
    assert partial.finish_reason == "abort" and engine.pool.num_used == 0
    hits = engine.pool.stats["prefix_hits"]
    rest = replace(params, max_new_tokens=24 - len(partial.token_ids))
    resumed = engine.generate_batch([prompt + partial.token_ids], rest)[0].completions[0]
    assert engine.pool.stats["prefix_hits"] - hits >= 4 * 8  # prompt and partial output: 4+ blocks
    assert partial.token_ids + resumed.token_ids == whole
    assert request.done


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_new_requests_admitted_together_share_their_common_prefix(model, params):
    """Six new prompts that start with the same 24-token system prompt (3 blocks of 8) and arrive at
    once: the first prompt's prefill computes those blocks and the other five read them in the same
    prefill (no block of them taken twice, 5 x 24 positions not recomputed), with every token and
    log-prob what an engine without a prefix cache gives."""
    system = list(range(3, 27))
    prompts = [system + [30 + i, 31, 32 + i, 33 + i, 34] for i in range(6)]
    on, off = _engine(model), _engine(model, caching=False)
    with_cache = [
        [(c.token_ids, c.log_probs) for r in on.generate_batch(prompts, params) for c in r.completions]
    ]
    without = [
        [(c.token_ids, c.log_probs) for r in off.generate_batch(prompts, params) for c in r.completions]
    ]
    _assert_same(with_cache, without)
    assert off.stats["prefill_tokens"] == 6 * 29
    assert on.stats["prefill_tokens"] == 29 + 5 * 5  # the system prompt's blocks once
    assert on.pool.stats["prefix_hits"] == 5 * 24 and on.pool.stats["prefix_queries"] == 6 * 29


def test_a_failed_prefill_fails_the_requests_that_read_its_blocks_and_no_other(model, monkeypatch):
    """The round's prefill raises and each item is retried alone: a request whose prompt failed takes
    down the later request that shares its first blocks (never written), not a third one."""
    params = replace(GREEDY, ignore_eos=True)
    system = list(range(3, 27))
    good = [60, 61, 62, 63, 64, 65, 66, 67, 68]
    expected = _engine(model, caching=False).generate_batch([good], params)[0].completions[0].token_ids
    engine = _engine(model)
    real = engine.model.prefill

    def prefill(tokens, *args, **kwargs):
        if (tokens == 90).any():
            raise RuntimeError("kernel failure")
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    lender = engine.add_request(system + [90, 5], params)
    borrower = engine.add_request(system + [40, 41], params)
    other = engine.add_request(good, params)
    while engine.has_unfinished():
        engine.step()
    assert lender.result().error == "RuntimeError: kernel failure"
    assert "shares its first blocks with failed" in borrower.result().error
    assert other.result().error is None and other.completions[0].token_ids == expected
    assert engine.pool.num_used == 0


def test_the_pool_counts_and_evicts_least_recently_released_first():
    pool = BlockPool(4, 2)
    keys = block_keys([1, 2, 3, 4, 5, 6], 2)
    first = [pool.take() for _ in range(3)]
    for block, key in zip(first, keys, strict=True):
        pool.register(block, key)
    pool.drop(first[::-1])  # released last block first: it is evicted first
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.lookup(block_keys([1, 2, 3, 4, 9, 9], 2)) == first[:2]
    taken = [pool.take(), pool.take()]  # the never-keyed block, then the oldest release (the third)
    assert first[2] in taken and pool.stats["evictions"] == 1 and pool.num_cached == 2
    with pytest.raises(RuntimeError, match="released more often"):
        pool.drop([first[0]])
    assert block_keys([1, 2, 3, 4], 2, extra=b"image") != block_keys([1, 2, 3, 4], 2)
