"""The 3D-HybridEngine on 4 gloo processes: the actor trained with tensor parallelism t (t = 1: FSDP only)
is resharded into engines of generation groups of t_g ranks, for every t, t_g in {1, 2, 4}.

Each engine must hold exactly its share of the HF weights (bit for bit), receive exactly the bytes it
lacks (hand-derived below per layout pair), generate the same greedy tokens and log-probs as the
one-process engine, and sample the same tokens from the same seed (every rank of a generation group
samples identically, or the group would deadlock)."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.workers.fsdp_utils import build_device_mesh
from hybridflow.workers.fsdp_workers import generation_shard
from hybridflow.workers.model_builder import build_fsdp_module
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.parallel import take_shard
from hybridflow.workers.rollout.engine.reshard import ReshardLayout, reshard_weights
from hybridflow.workers.rollout.engine.weight_sync import sync_weights
from hybridflow.workers.tensor_parallel import split_dim
from tests.utils.checkpoint.fsdp_toy import free_port, gloo_group

WORLD, MAX_LEN = 4, 48
SIZES = (1, 2, 4)
PROMPTS = [[1, 9, 14, 22, 5], [1, 30, 7], [1, 11, 12, 13, 40, 41, 42]]
GREEDY = SamplingParams(max_new_tokens=6, do_sample=False)
SAMPLED = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.0)

# Bytes each rank receives per sync, as fractions of (S0, S1, R): the column-split matrices (q/k/v,
# gate/up, embedding, LM head), the row-split ones (o_proj, down_proj) and the replicated norms.
# Training block of rank (d, i): TP shard i (1/t), FSDP rows chunk d (1/dp); generation shard g: 1/t_g.
RECEIVED = {
    (1, 1): (3 / 4, 3 / 4, 3 / 4),  # the all-gather sync: everything but the own FSDP chunk
    (1, 2): (1 / 4, 3 / 8, 3 / 4),  # own rows quarter is half of the gen rows; o/down: 3/4 rows x 1/2 cols
    (1, 4): (0, 3 / 16, 3 / 4),  # own rows quarter is the gen shard; o/down: 3/4 rows x 1/4 cols
    (2, 1): (3 / 4, 3 / 4, 1 / 2),  # norms: dp = 2 chunks, one held
    (2, 2): (1 / 4, 1 / 4, 1 / 2),  # the TP shard minus its own FSDP half
    (2, 4): (0, 1 / 8, 1 / 2),  # o/down: the other rows half of its cols quarter
    (4, 1): (3 / 4, 3 / 4, 0),  # dp = 1: the norms are whole on every rank
    (4, 2): (1 / 4, 1 / 4, 0),  # the micro-DP peer's shard: (t - t_g) / (t_g t) M, HybridFlow's Table
    (4, 4): (0, 0, 0),  # the generation layout is the training layout
}


def _pairs():
    return [(t, tg) for t in SIZES for tg in SIZES]


def _full_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())


def _generate(engine: EngineModel, params: SamplingParams, n: int) -> tuple[list, list]:
    llm = LLMEngine(engine, max_num_seqs=16, max_model_len=MAX_LEN, eos_token_ids=[2], seed=7)
    results = llm.generate_batch(PROMPTS, params, n)
    completions = [c for r in results for c in r.completions]
    return [c.token_ids for c in completions], [c.log_probs for c in completions]


def _one_layout(model_dir: str, t: int, tg: int, full: dict, rank: int) -> dict:
    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(WORLD, "cpu", t)
    )
    layout = ReshardLayout(WORLD, t, tg)
    shard = generation_shard(layout, rank)
    engine = EngineModel.empty_like_hf_module(module, MAX_LEN, shard=shard)
    stats = sync_weights(engine, module) if layout.trivial else reshard_weights(engine, module, layout, rank)
    exact = all(
        torch.equal(engine.target(name), take_shard(name, weight.detach(), shard))
        for name, weight in full.items()
    )
    greedy_tokens, greedy_log_probs = _generate(engine, GREEDY, 1)
    sampled_tokens, _ = _generate(engine, SAMPLED, 2)
    return {
        "group": layout.gen_coords(rank)[0],
        "exact": exact,
        "received": stats.received_bytes,
        "peak": stats.peak_extra_bytes,
        "engine_bytes": engine.parameter_bytes(),
        "greedy": greedy_tokens,
        "log_probs": greedy_log_probs,
        "sampled": sampled_tokens,
    }


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from hybridflow.workers.rollout.engine import reshard

    torch.set_num_threads(1)
    reshard.BUCKET_BYTES = 16 * 1024  # cut every unit into several exchanges (the embedding is 128 KiB)
    full = _full_weights(model_dir)
    with gloo_group(rank, WORLD, port):
        results = {pair: _one_layout(model_dir, *pair, full, rank) for pair in _pairs()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tp_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("resharding")
    mp.spawn(_rank_main, args=(free_port(), tp_model_dir, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _bytes_by_kind(full: dict) -> tuple[int, int, int]:
    kinds = [0, 0, 0]
    for name, weight in full.items():
        dim = split_dim(name)
        kinds[2 if dim is None else dim] += weight.numel() * weight.element_size()
    return tuple(kinds)


@pytest.mark.parametrize("pair", _pairs(), ids=lambda p: f"t{p[0]}_tg{p[1]}")
def test_each_rank_receives_exactly_its_missing_share(runs, tp_model_dir, pair):
    full = _full_weights(tp_model_dir)
    column, row, replicated = _bytes_by_kind(full)
    total = column + row + replicated
    want = sum(f * b for f, b in zip(RECEIVED[pair], (column, row, replicated), strict=True))
    for rank in range(WORLD):
        got = runs[rank][pair]
        assert got["exact"], f"rank {rank}: engine weights differ from its share of the HF weights"
        assert got["received"] == pytest.approx(want, abs=0.5)
        assert got["engine_bytes"] == (column + row) // pair[1] + replicated  # its share, the norms whole
        if pair[1] > 1:  # no rank ever holds the whole model: one unit's buffers at a time
            assert got["peak"] < total / 2


def test_generation_groups_match_the_one_process_engine(runs, tp_model_dir):
    from transformers import AutoModelForCausalLM

    reference = EngineModel.from_hf_module(AutoModelForCausalLM.from_pretrained(tp_model_dir), MAX_LEN)
    want_greedy, want_log_probs = _generate(reference, GREEDY, 1)
    want_sampled, _ = _generate(reference, SAMPLED, 2)
    for pair in _pairs():
        for rank in range(WORLD):
            got = runs[rank][pair]
            assert got["greedy"] == want_greedy, (pair, rank)
            for row, want in zip(got["log_probs"], want_log_probs, strict=True):
                torch.testing.assert_close(torch.tensor(row), torch.tensor(want), rtol=0, atol=2e-5)
            assert got["sampled"] == want_sampled, (pair, rank)
        groups = {runs[r][pair]["group"] for r in range(WORLD)}
        assert len(groups) == WORLD // pair[1]  # world / t_g generation groups
