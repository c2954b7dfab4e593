"""Ulysses sequence parallelism is exact: on 4 gloo processes (fp32), SP = 2 x DP = 2 gives the log-probs,
entropies, values, reward-model scores, actor and critic losses, gradient norms and updated parameters of
SP = 1 x DP = 4 on the same batch (the SP = 2 actor with gradient checkpointing: its all-to-alls run
again in the backward), and SP = 4 x DP = 1 (2 kv heads repeated over 4 ranks) the same log-probs.

The batch has odd lengths, a GRPO group sharing its prompt, and a micro-batch of one row whose 2 tokens
are fewer than SP = 4 (two ranks hold only padding). Micro-batches hold one row.
"""

import os

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.ulysses import head_split_problem, padded_length
from tests.utils.checkpoint.fsdp_toy import free_port, gloo_group
from tests.workers.test_loss_normalisation import _actor_config

WORLD = 4
PROMPTS = [5, 5, 5, 5, 3, 3, 1, 2]  # real prompt tokens per row (rows 0-3 share one, rows 4-5 another)
RESPONSES = [7, 1, 3, 4, 5, 2, 1, 6]  # real response tokens per row
T_P, T_R = 5, 7
BATCHING = {
    "log_prob_micro_batch_size_per_gpu": 1,
    "log_prob_use_dynamic_bsz": False,
    "log_prob_max_token_len_per_gpu": None,
}


def _batch() -> DataProto:
    """8 rows ``[prompt, left-padded | response, right-padded]`` with advantages and returns."""
    gen = torch.Generator().manual_seed(0)
    prompt_a, prompt_b = (
        torch.randint(4, 90, (T_P,), generator=gen),
        torch.randint(4, 90, (T_P,), generator=gen),
    )
    ids = torch.randint(4, 90, (len(PROMPTS), T_P + T_R), generator=gen)
    ids[:4, :T_P], ids[4:6, :T_P] = prompt_a, prompt_b
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        mask[row, T_P - p : T_P + r] = 1
    ids = ids * mask  # padding is token 0
    response_mask = mask[:, T_P:]
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, T_P:],
            keys.RESPONSE_MASK: response_mask,
            keys.ADVANTAGES: torch.randn(len(PROMPTS), 1, generator=gen) * response_mask,
            keys.RETURNS: torch.randn(len(PROMPTS), T_R, generator=gen) * response_mask,
        }
    )


def _critic_config(rows: int):
    return OmegaConf.create(
        {
            "forward_micro_batch_size_per_gpu": 1,
            "forward_max_token_len_per_gpu": None,
            "use_dynamic_bsz": False,
            "ppo_mini_batch_size": rows,
            "ppo_micro_batch_size_per_gpu": 1,
            "ppo_max_token_len_per_gpu": None,
            "ppo_epochs": 1,
            "shuffle": False,
            "cliprange_value": 0.5,
            "loss_agg_mode": "token-mean",
            "grad_clip": 1.0,
        }
    )


def _parts(model_dir: str, kind: str, sp: int):
    from hybridflow.workers.fsdp_utils import build_device_mesh
    from hybridflow.workers.model_builder import build_training_parts
    from hybridflow.workers.ulysses import apply_sequence_parallel, sequence_parallel_groups

    # SP = 2 also recomputes its layers in the backward (their all-to-alls run again there)
    checkpointing = sp == 2 and kind == "causal_lm"
    parts = build_training_parts(
        OmegaConf.create({"path": model_dir, "enable_gradient_checkpointing": checkpointing}),
        OmegaConf.create({}),
        OmegaConf.create({"lr": 1e-2}),
        build_device_mesh(WORLD, "cpu"),
        kind=kind,
    )
    if sp > 1:
        apply_sequence_parallel(parts.module, sequence_parallel_groups(WORLD, sp, "cpu"))
    # SGD: AdamW's first step, lr * g / (|g| + eps), turns 1e-9 differences of near-zero gradients into
    # lr-sized ones, so it cannot show the gradients agree; SGD's update is lr * g
    parts.optimizer = torch.optim.SGD(parts.module.parameters(), lr=0.1)
    return parts


def _weights(module) -> dict:
    return {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()}


def _layout(model_dir: str, sp: int, out_dir: str) -> None:
    """One actor update and one critic update of this rank's rows under (WORLD / sp, sp)."""
    from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
    from hybridflow.workers.critic.dp_critic import DataParallelPPOCritic

    rank, dp = torch.distributed.get_rank(), WORLD // sp
    per_dp = len(PROMPTS) // dp
    rows = list(range(rank // sp * per_dp, (rank // sp + 1) * per_dp))
    data = _batch().select_idxs(torch.tensor(rows))

    actor_parts = _parts(model_dir, "causal_lm", sp)
    initial = _weights(actor_parts.module)
    actor = DataParallelPPOActor(
        _actor_config("token-mean", per_dp, 1), actor_parts.module, actor_parts.optimizer, response_length=T_R
    )
    log_probs, entropy = actor.compute_log_prob(data, OmegaConf.create(BATCHING), calculate_entropy=True)
    data.batch[keys.OLD_LOG_PROBS] = log_probs
    actor_metrics = actor.update_policy(data)

    critic_parts = _parts(model_dir, "token_value", sp)
    critic = DataParallelPPOCritic(_critic_config(per_dp), critic_parts.module, critic_parts.optimizer)
    values = critic.compute_values(data)
    data.batch[keys.VALUES] = values + 0.1 * data.batch[keys.RESPONSE_MASK]  # a clip range to act on
    critic_metrics = critic.update_critic(data)
    scores = _rm_scores(model_dir, sp, data)
    result = {
        "rows": rows,
        "log_probs": log_probs,
        "entropy": entropy,
        "values": values,
        "actor": actor_metrics,
        "critic": critic_metrics,
        "actor_weights": _weights(actor_parts.module),
        "actor_moved": max(
            float((w - initial[n]).abs().max()) for n, w in _weights(actor_parts.module).items()
        ),
        "critic_weights": _weights(critic_parts.module),
        "scores": scores,
    }
    torch.save(result, os.path.join(out_dir, f"sp{sp}_rank{rank}.pt"))


def _rm_scores(model_dir: str, sp: int, data: DataProto) -> torch.Tensor:
    """A reward model's scores (the value head at each row's last attended token), one row at a time."""
    from hybridflow.workers.fsdp_utils import build_device_mesh
    from hybridflow.workers.model_builder import build_fsdp_module
    from hybridflow.workers.reward_model_worker import score_sequences
    from hybridflow.workers.ulysses import enable_sequence_parallel

    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}),
        OmegaConf.create({}),
        build_device_mesh(WORLD, "cpu"),
        kind="token_value",
        trainable=False,
    )
    enable_sequence_parallel(module, sp, WORLD, "cpu")
    inputs = data.select(batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS])
    return score_sequences(module, inputs, 1)


def _sp4_log_probs(model_dir: str, out_dir: str) -> None:
    """SP = 4, DP = 1: every rank the whole batch, one row per micro-batch (row 6 is 2 tokens)."""
    from hybridflow.workers.actor.dp_actor import DataParallelPPOActor

    actor = DataParallelPPOActor(None, _parts(model_dir, "causal_lm", 4).module)
    log_probs, entropy = actor.compute_log_prob(_batch(), OmegaConf.create(BATCHING), calculate_entropy=True)
    torch.save((log_probs, entropy), os.path.join(out_dir, f"sp4_rank{torch.distributed.get_rank()}.pt"))


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, port):
        for sp in (1, 2):
            _layout(model_dir, sp, out_dir)
        _sp4_log_probs(model_dir, out_dir)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    import torch.multiprocessing as mp
    from transformers import Qwen2ForCausalLM

    from tests.tiny_configs import tiny_decoder_config

    root = tmp_path_factory.mktemp("ulysses")
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_decoder_config("qwen2")).save_pretrained(root / "model")
    mp.spawn(_rank_main, args=(free_port(), str(root / "model"), str(root)), nprocs=WORLD, join=True)
    return {f.stem: torch.load(f) for f in root.glob("sp*_rank*.pt")}


def _whole_batch(runs: dict, sp: int, name: str) -> torch.Tensor:
    """A per-row result of layout ``sp`` for all 8 rows (each dp rank's first SP rank)."""
    parts = [runs[f"sp{sp}_rank{r}"] for r in range(0, WORLD, sp)]
    return torch.cat([p[name] for p in parts])


def test_sp2_dp2_equals_sp1_dp4(sp_runs):
    mask = _batch().batch[keys.RESPONSE_MASK].bool()
    scores = _whole_batch(sp_runs, 2, "scores"), _whole_batch(sp_runs, 1, "scores")
    torch.testing.assert_close(*scores, rtol=0, atol=1e-5)  # the reward model's
    for name in ("log_probs", "entropy", "values"):
        got, want = _whole_batch(sp_runs, 2, name), _whole_batch(sp_runs, 1, name)
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5, msg=name)
        assert (got[~mask] == 0).all() if name != "entropy" else True
    for rank in range(WORLD):  # the two ranks of an SP group hand back the same tensors
        other = sp_runs[f"sp2_rank{rank ^ 1}"]
        for name in ("log_probs", "entropy", "values"):
            torch.testing.assert_close(sp_runs[f"sp2_rank{rank}"][name], other[name], rtol=0, atol=0)

    def loss(sp: int, role: str, key: str) -> float:  # the mini-batch loss: the dp ranks' shares
        return sum(sp_runs[f"sp{sp}_rank{r}"][role][key][0] for r in range(0, WORLD, sp)) / (WORLD // sp)

    for role, key in (("actor", "actor/pg_loss"), ("critic", "critic/vf_loss")):
        assert loss(2, role, key) == pytest.approx(loss(1, role, key), abs=1e-5), key
    for role, key in (("actor", "actor/grad_norm"), ("critic", "critic/grad_norm")):
        norms = [sp_runs[f"sp{sp}_rank{r}"][role][key][0] for sp in (1, 2) for r in range(WORLD)]
        assert max(norms) - min(norms) < 1e-5 * max(1.0, max(norms)), (key, norms)
        assert norms[0] > 1e-3  # a gradient flowed
    sp1 = sp_runs["sp1_rank0"]
    assert sp1["actor_moved"] > 1e-3 and sp_runs["sp2_rank0"]["actor_moved"] > 1e-3
    for role in ("actor_weights", "critic_weights"):
        for name, want in sp1[role].items():
            torch.testing.assert_close(sp_runs["sp2_rank0"][role][name], want, rtol=0, atol=1e-6, msg=name)


def test_sp4_repeats_kv_heads_and_pads_short_sequences(sp_runs):
    mask = _batch().batch[keys.RESPONSE_MASK].bool()
    want_lp, want_ent = _whole_batch(sp_runs, 1, "log_probs"), _whole_batch(sp_runs, 1, "entropy")
    for rank in range(WORLD):
        log_probs, entropy = sp_runs[f"sp4_rank{rank}"]
        torch.testing.assert_close(log_probs[mask], want_lp[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[mask], want_ent[mask], rtol=0, atol=1e-5)


def test_head_split_rule_and_padding():
    assert head_split_problem(4, 2, 2) is None  # kv heads split
    assert head_split_problem(4, 2, 4) is None  # kv heads repeated twice
    assert "num_attention_heads=6" in head_split_problem(6, 2, 4)
    assert "num_key_value_heads=3" in head_split_problem(6, 3, 2)
    assert [padded_length(n, 4) for n in (0, 1, 4, 5, 8)] == [4, 4, 4, 8, 8]


def test_a_single_packed_row_takes_sdpas_causal_kernel(monkeypatch):
    """A long single sequence (one row per micro-batch, SP's case) leaves the matmul form for SDPA; its
    mask is then plain causal and SDPA gets ``is_causal`` instead of the (Q, K) mask: same output."""
    from hybridflow.models import attention
    from hybridflow.workers.packed_rows import plan_packed_rows

    data = _batch().select_idxs(torch.tensor([0]))
    packed = plan_packed_rows(data, T_P + T_R, always=True)
    tokens = packed.input_ids.shape[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, 8, generator=gen) for heads in (4, 2, 2))
    module = torch.nn.Module().eval()
    matmul, _ = attention.cpu_attention_forward(module, q, k, v, packed.attention_mask)
    monkeypatch.setattr(attention, "EAGER_MAX_BYTES", 0)
    sdpa, _ = attention.cpu_attention_forward(module, q, k, v, packed.attention_mask)
    torch.testing.assert_close(sdpa, matmul, rtol=0, atol=1e-5)
