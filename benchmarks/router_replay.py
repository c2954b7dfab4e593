"""Router replay R3 on a tiny mixture of experts: how far the trainer's routing and log-probs are from the
rollout's, with R3 off and on.

    python benchmarks/router_replay.py [--family qwen3_moe --experts 16 --top-k 2 --layers 4 --hidden 128
        --prompts 16 --prompt-len 24 --new-tokens 32 --threads 1 --seed 0]

A random Qwen3-MoE (or Qwen2-MoE / Mixtral) from a transformers config. The embedded engine generates in
bf16 (``rollout.dtype=bf16``) and records each token's experts (``enable_rollout_routing_replay``); the
trainer's forward (the actor's ``compute_log_prob``, the CPU training attention) recomputes the sampled
tokens' log-probs in bf16 (the engine's precision, other kernels) and in fp32 (the actor's default on the
CPU), each with ``router_replay.mode`` disabled (its own top-k) and R3 (the engine's ids).

One JSON line per (trainer dtype, mode): ``expert_set_mismatch`` (share of the prompt and generated tokens,
the last one excepted, whose expert set differs from the engine's in some MoE layer),
``expert_set_mismatch_per_layer`` (share of (token, layer) pairs), verl's
``training/rollout_probs_diff_mean`` / ``_max`` (|p_rollout - p_trainer| on the response tokens),
``training/rollout_log_probs_diff_mean`` / ``_max``, and the rollout-correction gap metrics
``rollout_corr/kl`` and ``rollout_corr/k3_kl``
(:func:`hybridflow.algorithms.rollout_correction.offpolicy_metrics`). Weights are drawn with
``--init-std`` (larger than HF's 0.02: peaked next-token distributions, decisive routers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "mixtral"])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.08)
    return parser.parse_args(argv)


def build_model(args):
    import torch
    import transformers

    from hybridflow.models.attention import register_cpu_attention

    common = dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=args.vocab, max_position_embeddings=256, num_experts_per_tok=args.top_k,
        initializer_range=args.init_std,
    )  # fmt: skip
    if args.family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=args.experts, intermediate_size=64)
    elif args.family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common, num_experts=args.experts, moe_intermediate_size=64, shared_expert_intermediate_size=128,
            intermediate_size=256,
        )  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=args.experts, moe_intermediate_size=64, norm_topk_prob=True, head_dim=32
        )
    config._attn_implementation = register_cpu_attention()
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def rollout(model, args):
    """The engine's bf16 rollout: the batch (prompts left-padded, responses right-padded) with
    ``rollout_log_probs`` and ``routed_experts``."""
    import torch

    from hybridflow import keys
    from hybridflow.protocol import DataProto
    from hybridflow.workers.rollout.base import completions_output
    from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
    from hybridflow.workers.rollout.engine.routing import routed_experts_rows

    max_len = args.prompt_len + args.new_tokens
    engine_model = EngineModel.from_hf_module(model, max_len, dtype=torch.bfloat16)
    engine = LLMEngine(engine_model, args.prompts, max_len, eos_token_ids=[], record_routing=True)
    generator = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=generator)
    prompts = [torch.randint(3, args.vocab, (int(n),), generator=generator).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate_batch(prompts, params)
    seconds = time.perf_counter() - start
    ids = torch.tensor([[0] * (args.prompt_len - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (args.prompt_len - len(p)) + [1] * len(p) for p in prompts])
    data = DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        }
    )
    completions = [r.completions[0] for r in results]
    batch = completions_output(data, completions, args.new_tokens, 0, True)
    batch.batch[keys.ROUTED_EXPERTS] = routed_experts_rows(
        mask, [c.routed_experts for c in completions], args.new_tokens
    )
    return batch, seconds


def trainer_pass(model, batch, mode: str):
    """The actor's log-probs of the batch, and the expert ids its routers used (B, T, L, k)."""
    import torch
    from omegaconf import OmegaConf

    from hybridflow.workers import packed_rows, router_replay
    from hybridflow.workers.actor.dp_actor import DataParallelPPOActor, response_log_probs

    config = OmegaConf.create({"router_replay": {"mode": mode}})
    actor = DataParallelPPOActor(config, model)
    replay = router_replay.install(model)
    batching = OmegaConf.create(
        {"log_prob_micro_batch_size_per_gpu": 4, "log_prob_use_dynamic_bsz": False,
         "log_prob_max_token_len_per_gpu": 1 << 20}
    )  # fmt: skip
    log_probs, _ = actor.compute_log_prob(batch, batching)
    # the ids each forward routed with: record in a plain (R3: replaying) pass, whole batch, padded layout
    used = []
    hooks = [r.register_forward_hook(lambda m, i, out: used.append(out[2])) for r in replay.routers]
    fraction = packed_rows.MAX_TOKEN_FRACTION
    packed_rows.MAX_TOKEN_FRACTION = -1.0  # the padded layout: ids in the batch's columns
    try:
        with router_replay.acting(model, router_replay.REPLAY if mode == "R3" else None), torch.no_grad():
            response_log_probs(model, batch, 1.0)
    finally:
        packed_rows.MAX_TOKEN_FRACTION = fraction
        for hook in hooks:
            hook.remove()
    return log_probs, used


def mismatch(batch, used, num_layers: int) -> tuple[float, float]:
    """(share of tokens with some layer's expert set differing, share of (token, layer) pairs)."""
    import torch

    from hybridflow import keys
    from hybridflow.workers.forward import attended_span

    prompt_len = batch.batch[keys.INPUT_IDS].shape[1] - batch.batch[keys.RESPONSES].shape[1]
    first, end = attended_span(batch.batch[keys.ATTENTION_MASK], prompt_len)
    mask = batch.batch[keys.ATTENTION_MASK][:, first:end].bool().clone()
    last = mask.long().cumsum(-1).argmax(-1)  # each row's last attended column: fed by no rollout forward
    mask[torch.arange(len(mask)), last] = False
    engine = batch.batch[keys.ROUTED_EXPERTS][:, first:end].long().sort(-1).values
    trainer = torch.stack(used[-num_layers:], 1).view(*engine.shape).sort(-1).values
    differs = (engine != trainer).any(-1)  # (B, T, L)
    return float(differs.any(-1)[mask].float().mean()), float(differs[mask].float().mean())


def main(argv=None) -> None:
    import torch

    from hybridflow import keys
    from hybridflow.algorithms.rollout_correction import offpolicy_metrics
    from hybridflow.utils.rollout_parity import rollout_parity_metrics

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    batch, seconds = rollout(model, args)
    rollout_lp, response = batch.batch[keys.ROLLOUT_LOG_PROBS], batch.batch[keys.RESPONSE_MASK]
    num_layers = batch.batch[keys.ROUTED_EXPERTS].shape[2]
    for dtype in ("fp32", "bf16"):  # fp32 first: the master weights, then their bf16 copy
        trainer = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        for mode in ("disabled", "R3"):
            log_probs, used = trainer_pass(trainer, batch, mode)
            tokens, pairs = mismatch(batch, used, num_layers)
            gap = offpolicy_metrics(log_probs.float(), rollout_lp, response.float())
            record = {
                "benchmark": "router_replay",
                "family": args.family,
                "experts": args.experts,
                "top_k": args.top_k,
                "moe_layers": num_layers,
                "rollout_dtype": "bf16",
                "trainer_dtype": dtype,
                "router_replay": "R3" if mode == "R3" else "off",
                "response_tokens": int(response.sum()),
                "expert_set_mismatch": round(tokens, 5),
                "expert_set_mismatch_per_layer": round(pairs, 5),
                **{
                    k: round(v, 6) for k, v in rollout_parity_metrics(rollout_lp, log_probs, response).items()
                },
                "rollout_corr/kl": round(gap["kl"], 6),
                "rollout_corr/k3_kl": round(gap["k3_kl"], 6),
                "rollout_seconds": round(seconds, 2),
                "threads": args.threads,
                "machine": platform.processor() or platform.machine(),
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
