"""The weight-sync check of the fully-asynchronous trainer: a probe on every replica after every sync.

In ``main_ppo`` a broken weight sync shows as a gap between the rollout's log-probs and the trainer's
recompute of the same tokens (``rollout.log_prob_gap_limit``). In the fully-async trainer the samples of
a step may come from older weights (staleness, syncs every few updates), so their gap says nothing; and
with ``async_training.use_rollout_log_probs`` there is no recompute at all. So after every sync, with
the replicas serving again, :class:`SyncProbe` asks each replica for a few tokens of a fixed prompt
(sampled at ``rollout.temperature`` from the full distribution, with their log-probs), has the trainer's
actor recompute those tokens' log-probs with the weights it just sent, and stops the run when

- a replica reports another parameter version than the one just synced (the weights never arrived), or
- a replica's log-probs differ from the recompute by more than the gap limit (it holds other weights),

naming the replica and the version. The limit is the synchronous trainer's (1e-2 when rollout and actor
compute in fp32, 1.0 otherwise; ``rollout.log_prob_gap_limit`` overrides, a negative value turns the
probe off, as does greedy sampling at a temperature other than 1, whose log-probs are not comparable).
The probe costs one short request per replica and one small forward pass of the actor per sync. With
router replay R3 the answers carry their ``routed_experts`` and the recompute replays them, as the
training batches' do.
"""

from __future__ import annotations

import time
import uuid

import torch

from hybridflow import keys
from hybridflow.protocol import AUTO_PADDING_KEY, DataProto
from hybridflow.utils.rollout_parity import RolloutLogProbGapError

PROBE_TEXT = "Check the weights: 1 2 3"
PROBE_TOKENS = 8  # at most (and at most rollout.response_length)


class SyncProbe:
    """``servers`` / ``names``: the replicas' front doors and how messages name them; ``actor``: the
    trainer's actor group (``compute_log_prob``); ``limit``: the largest gap that counts as the same
    weights; ``rollout_cfg``: the rollout section (temperature, seed)."""

    def __init__(self, tokenizer, rollout_cfg, limit: float, servers: list, names: list[str], actor) -> None:
        self.servers, self.names, self.actor, self.limit = list(servers), list(names), actor, float(limit)
        self.temperature = float(rollout_cfg.get("temperature", 1.0))
        self.seed = int(rollout_cfg.get("seed") or 0)
        self.backend = str(rollout_cfg.get("name", "engine"))
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.tokens = max(1, min(PROBE_TOKENS, int(rollout_cfg.response_length)))
        prompt = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)) or [self.pad_id]
        self.prompt = prompt[: max(1, int(rollout_cfg.prompt_length))]  # within the replicas' lengths

    def check(self, version: int) -> dict[str, float]:
        """Probe every replica for parameter ``version``; raises :class:`RolloutLogProbGapError` naming
        the replica whose weights are not the trainer's. Returns the probe's metrics."""
        import ray

        start = time.perf_counter()
        params = {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "logprobs": True,
            "seed": self.seed + int(version),
        }
        request = f"sync-probe-{version}-{uuid.uuid4().hex}"
        answers = ray.get(
            [
                server.generate.remote(request, prompt_ids=self.prompt, sampling_params=params)
                for server in self.servers
            ]
        )
        for name, answer in zip(self.names, answers, strict=True):
            if answer.weight_version != version:
                raise RolloutLogProbGapError(
                    f"parameter sync to version {version}: {name} reports weights of version "
                    f"{answer.weight_version} after the sync; the trainer's weights did not reach it (a "
                    "broken sync). The run stops before training on its samples"
                )
        recomputed = self._recompute(answers)
        gaps = []
        for name, answer, row in zip(self.names, answers, recomputed, strict=True):
            rollout = torch.tensor(answer.log_probs or [], dtype=torch.float64)
            gap = float((rollout - row[: len(rollout)].double()).abs().max()) if len(rollout) else 0.0
            gaps.append(gap)
            if gap > self.limit:
                raise RolloutLogProbGapError(
                    f"parameter sync to version {version}: {name} (rollout.name={self.backend}) samples "
                    f"with other weights than the trainer's: on a probe of {len(rollout)} tokens its "
                    f"log-probs differ from the actor's recompute by up to {gap:.3g}, beyond "
                    f"rollout.log_prob_gap_limit={self.limit:g} (a broken sync). The run stops before "
                    "training on its samples"
                )
        return {
            "fully_async/param_sync/probe_gap_max": max(gaps, default=0.0),
            "fully_async/param_sync/probe_s": time.perf_counter() - start,
        }

    def _recompute(self, answers) -> torch.Tensor:
        """The actor's log-probs (rows, tokens) of each answer's tokens after the probe prompt."""
        rows, width = len(answers), len(self.prompt)
        prompt = torch.tensor([self.prompt] * rows, dtype=torch.long)
        prompts = DataProto.from_dict(
            {
                keys.INPUT_IDS: prompt,
                keys.ATTENTION_MASK: torch.ones_like(prompt),
                keys.POSITION_IDS: torch.arange(width).expand(rows, width).clone(),
            }
        )
        responses = torch.full((rows, self.tokens), self.pad_id, dtype=torch.long)
        present = torch.zeros(rows, self.tokens, dtype=torch.long)
        for row, answer in enumerate(answers):
            tokens = list(answer.token_ids)[: self.tokens]
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            present[row, : len(tokens)] = 1
        from hybridflow.workers.rollout.base import assemble_output

        batch = assemble_output(prompts, responses, [], self.pad_id, None, present, present)
        routed = [getattr(answer, "routed_experts", None) for answer in answers]
        if any(ids is not None for ids in routed):  # router replay R3: the actor replays the probe's ids
            from hybridflow.workers.rollout.engine.routing import routed_experts_rows

            batch.batch[keys.ROUTED_EXPERTS] = routed_experts_rows(
                torch.ones_like(prompt), routed, self.tokens
            )
        batch.meta_info[AUTO_PADDING_KEY] = True  # one row per replica need not divide the actor's ranks
        return self.actor.compute_log_prob(batch).batch[keys.OLD_LOG_PROBS][:rows].cpu()
