"""How the engine takes each running sequence's next token: choice, stop checks, retirement.

Mixed into :class:`~.llm_engine.LLMEngine`: from a decode or prefill step's logits (B, V), each row's
token is chosen by its request's sampling settings (rows grouped by settings, seeded rows from their
own streams: :mod:`.sampling`), appended with its log-prob, streamed to a listener, and the sequence
retires when it stops (a stop token, its length, its stop checker). A logits processor or stop checker
that raises fails its own request only.
"""

from __future__ import annotations

import torch

from hybridflow.workers.rollout.engine.requests import (
    EngineRequest,
    RunningSequence,
    finished_completion,
    stream_keys,
    top_alternatives,
)
from hybridflow.workers.rollout.engine.sampling import SamplingParams, choose_tokens, seeded_uniforms


class TokenAcceptance:
    """The engine's token choice (needs ``generator``, ``stats``, ``_fail`` and ``_to_loop``)."""

    def _accept(
        self, seqs: list[RunningSequence], logits: torch.Tensor, finished: list[EngineRequest]
    ) -> None:
        """Choose the next token of each sequence from its logits row (B, V) and retire finished ones."""
        tokens, log_probs = self._choose(seqs, logits, finished)
        self.stats["generated_tokens"] += len(seqs)
        self.stats["host_reads"] += 1
        self._take(seqs, tokens.tolist(), log_probs.tolist(), top_alternatives(seqs, logits), finished)

    def _take(
        self,
        seqs: list[RunningSequence],
        tokens: list[int],
        log_probs: list[float],
        tops: dict[int, list[tuple[int, float]]],
        finished: list[EngineRequest],
    ) -> None:
        """Append each sequence's chosen token (and log-prob) and retire those that stop or reach their
        length."""
        for row, (seq, token, log_prob) in enumerate(zip(seqs, tokens, log_probs, strict=True)):
            if seq.pending == -2:  # failed in this step (its logits processor raised)
                continue
            seq.token_ids.append(token)
            seq.log_probs.append(log_prob)
            if row in tops:
                seq.top_log_probs.append(tops[row])
            seq.pending = token
            request = seq.request
            if request.listener is not None:
                self._to_loop(request.listener.put_nowait, (seq.index, token, log_prob, tops.get(row)))
            if token in request.stop_ids:
                reason = "stop"
            elif len(seq.token_ids) >= request.max_new_tokens:
                reason = "length"
            elif request.params.stop_checker is not None and self._stops(seq, finished):
                if seq.pending == -2:
                    continue  # the checker raised: the request failed
                reason = "stop"
            else:
                continue
            request.completions[seq.index] = finished_completion(seq, reason)
            seq.pending = -2  # retired: removed from the batch by _compact
            if request.done:
                finished.append(request)

    def _stops(self, seq: RunningSequence, finished: list[EngineRequest]) -> bool:
        """Whether the request's stop checker (stop strings) ends ``seq`` at its latest token; a checker
        that raises fails the request."""
        try:
            return bool(seq.request.params.stop_checker(seq.token_ids))
        except Exception as error:
            self._fail(seq.request, error, finished)
            return True

    def _choose(
        self, seqs: list[RunningSequence], logits: torch.Tensor, finished: list[EngineRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        processed = [(row, seq) for row, seq in enumerate(seqs) if seq.request.params.logits_processor]
        if processed:
            logits = logits.clone()
            for row, seq in processed:
                try:
                    logits[row] = seq.request.params.logits_processor(seq.token_ids, logits[row])
                except Exception as error:  # this request fails; the row's token is not taken
                    self._fail(seq.request, error, finished)
        groups: dict[tuple, list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(seq.request.params.choice_key(), []).append(row)
        if len(groups) == 1:
            params = seqs[0].request.params
            return choose_tokens(logits, params, self.generator, self._uniforms(seqs, params))
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        log_probs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for rows in groups.values():
            index = torch.tensor(rows, device=logits.device)
            params = seqs[rows[0]].request.params
            uniforms = self._uniforms([seqs[row] for row in rows], params)
            tokens[index], log_probs[index] = choose_tokens(logits[index], params, self.generator, uniforms)
        return tokens, log_probs

    def _uniforms(self, seqs: list[RunningSequence], params: SamplingParams) -> torch.Tensor | None:
        """Each row's draw when any row samples from a seeded stream (see :mod:`.sampling`): seeded rows
        from (seed, sample index, position), the others from the engine's generator. None when no row
        is seeded (or the rows are greedy): :func:`choose_tokens` draws from the generator itself."""
        seeded = [seq.request.params.seed is not None for seq in seqs]
        if params.greedy or not any(seeded):
            return None
        uniforms = (
            1.0 - torch.rand(len(seqs), generator=self.generator, device=self.generator.device).double()
        )
        rows = torch.tensor([row for row, is_seeded in enumerate(seeded) if is_seeded])
        seeds, samples, positions = torch.tensor(stream_keys(seqs), dtype=torch.long)[rows].T
        uniforms[rows] = seeded_uniforms(seeds, samples, positions).to(uniforms.device)
        return uniforms
