"""The student's side of a served teacher: the top-k of every response position, over HTTP.

verl's recipe names the teacher by ``actor_rollout_ref.teacher.{server_ip, server_port,
n_server_workers}`` (a ZeroMQ proxy and its workers). Here the transport is HTTP to
``python -m hybridflow.serve`` replicas (:mod:`hybridflow.serve.scoring`): ``n_server_workers`` replicas
listen on ``server_ip`` at ``server_port``, ``server_port + 1``, ... Each batch is cut into requests of
``micro_batch_size`` rows; every request goes to the replica with the fewest requests in flight (the
agent loops' router, :class:`~hybridflow.workers.rollout.agent_loop.server_manager.AsyncLLMServerManager`).
Requests go through :class:`hybridflow.utils.served_client.ServedClient`: timeouts, retries of 503 with
``Retry-After``, a clear error on 401.

**Before training** :meth:`TeacherClient.check_vocab` asks every replica for its vocabulary size and
tokenizer fingerprint; a teacher whose ``token -> id`` map differs from the student's is refused.

**A request that fails for good** (its retries spent) fails alone: its rows get no teacher signal (their
top-k log-probs are ``NO_SIGNAL``, so ``P = 0`` and their distillation loss and gradient are 0), counted
in ``distill/teacher_failed_rows``; the other rows train. If every request fails the step stops with
:class:`TeacherError` naming the replicas and the first failure.

Scoring runs on the client's own event-loop thread, so :meth:`TeacherClient.submit` returns at once (a
``concurrent.futures.Future``) and the scheduler overlaps it with generation and the update
(:mod:`.scheduler`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.rollout.agent_loop.server_manager import AsyncLLMServerManager

NO_SIGNAL = -1.0e4  # log-prob of a row the teacher could not score: exp() == 0, finite products


class TeacherError(RuntimeError):
    """The teacher could not be used (vocabulary mismatch, every replica failing)."""


@dataclass(frozen=True)
class TeacherSettings:
    """``actor_rollout_ref.teacher`` (verl's keys, then ours)."""

    server_ip: str
    server_port: int
    n_server_workers: int = 1
    n_logprobs: int = 16  # k: the teacher's top-k per position (verl: the teacher server's --n-logprobs)
    model: str | None = None  # the served model name (None: whatever the server serves)
    temperature: float = 1.0
    micro_batch_size: int = 8  # rows per /v1/score request
    api_key: str | None = None  # None: $HYBRIDFLOW_API_KEY
    timeout_s: float = 120.0
    max_retries: int = 3

    @classmethod
    def from_config(cls, section) -> TeacherSettings:
        fields = {k: section.get(k) for k in cls.__dataclass_fields__ if section.get(k) is not None}
        return cls(**fields)

    @property
    def addresses(self) -> list[str]:
        return [f"http://{self.server_ip}:{self.server_port + i}" for i in range(self.n_server_workers)]


class TeacherRouter(AsyncLLMServerManager):
    """The agent loops' least-in-flight router over :class:`ServedClient` s instead of Ray handles."""

    async def score(self, request_id: str, body: dict) -> dict:
        index = self._choose_server(request_id)
        self._sticky.pop(request_id, None)  # one request per id: nothing to stick to
        self.in_flight[index] += 1
        self.sent[index] += 1
        try:
            return await self.server_handles[index].post_json("/v1/score", body)
        finally:
            self.in_flight[index] -= 1


def row_sequences(batch: DataProto) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt ids (left padding dropped) and response ids (right padding dropped), by the
    attention mask."""
    responses = batch.batch[keys.RESPONSES]
    width = responses.shape[1]
    mask = batch.batch[keys.ATTENTION_MASK].bool()
    ids = batch.batch[keys.INPUT_IDS]
    prompts = [row[:-width][m[:-width]].tolist() for row, m in zip(ids, mask, strict=True)]
    answers = [row[m[-width:]].tolist() for row, m in zip(responses, mask, strict=True)]
    return prompts, answers


class TeacherClient:
    """Scores batches on the teacher replicas; see the module docstring."""

    def __init__(self, settings: TeacherSettings) -> None:
        from hybridflow.utils.served_client import ServedClient

        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="teacher-client", daemon=True)
        self._thread.start()
        clients = [
            ServedClient(
                address,
                api_key=settings.api_key,
                timeout_s=settings.timeout_s,
                max_retries=settings.max_retries,
            )
            for address in settings.addresses
        ]
        self.router = TeacherRouter(None, clients, names=settings.addresses)
        self._ids = itertools.count()

    def close(self) -> None:
        async def shut() -> None:
            for client in self.router.server_handles:
                await client.aclose()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _run(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    # ------------------------------------------------------------------ before training
    def check_vocab(self, vocab_size: int, fingerprint: str) -> None:
        """Raise :class:`TeacherError` unless every replica has the student's vocabulary."""
        body = {} if self.settings.model is None else {"model": self.settings.model}

        async def ask_all():
            calls = [client.post_json("/v1/score/vocab", body) for client in self.router.server_handles]
            return await asyncio.gather(*calls)

        for name, answer in zip(self.settings.addresses, self._run(ask_all()).result(), strict=True):
            problems = []
            if int(answer["vocab_size"]) != int(vocab_size):
                problems.append(f"vocabulary size {answer['vocab_size']} != the student's {vocab_size}")
            if answer["tokenizer"] != fingerprint:
                problems.append("its tokenizer maps tokens to other ids than the student's")
            if problems:
                raise TeacherError(
                    f"teacher {name} ({answer['model']}) cannot score the student's tokens: "
                    + "; ".join(problems)
                    + ". On-policy distillation needs the same vocabulary (the same tokenizer)."
                )

    # ------------------------------------------------------------------ per batch
    def submit(self, batch: DataProto) -> Future:
        """Start scoring ``batch``'s rows; the future gives ``(top_log_probs (B, T_r, k) float32,
        top_ids (B, T_r, k) int64, metrics)``."""
        prompts, responses = row_sequences(batch)
        width = batch.batch[keys.RESPONSES].shape[1]
        return self._run(self._score(prompts, responses, width))

    async def _score(self, prompts, responses, width: int):
        settings, k = self.settings, self.settings.n_logprobs
        size = settings.micro_batch_size
        chunks = [range(i, min(i + size, len(prompts))) for i in range(0, len(prompts), size)]
        bodies = [
            {
                "prompts": [prompts[i] for i in rows],
                "responses": [responses[i] for i in rows],
                "top_k": k,
                "temperature": settings.temperature,
                **({"model": settings.model} if settings.model else {}),
            }
            for rows in chunks
        ]
        answers = await asyncio.gather(
            *(self.router.score(f"teacher-{next(self._ids)}", body) for body in bodies),
            return_exceptions=True,
        )
        top_log_probs = torch.full((len(prompts), width, k), NO_SIGNAL)
        top_ids = torch.zeros((len(prompts), width, k), dtype=torch.long)
        failures = [
            (rows, a) for rows, a in zip(chunks, answers, strict=True) if isinstance(a, BaseException)
        ]
        if len(failures) == len(chunks):
            raise TeacherError(
                f"every teacher request failed ({', '.join(settings.addresses)}): {failures[0][1]}"
            )
        for rows, answer in zip(chunks, answers, strict=True):
            if isinstance(answer, BaseException):
                continue
            for i, scored in zip(rows, answer["data"], strict=True):
                n = len(scored["top_ids"])
                if n:
                    top_log_probs[i, :n] = torch.tensor(scored["top_logprobs"])
                    top_ids[i, :n] = torch.tensor(scored["top_ids"])
        failed_rows = sum(len(rows) for rows, _ in failures)
        metrics = {"distill/teacher_failed_rows": float(failed_rows)}
        if failures:
            print(
                f"hybridflow: teacher: {len(failures)} of {len(chunks)} requests failed "
                f"({failed_rows} rows get no teacher signal this step): {failures[0][1]}",
                flush=True,
            )
        return top_log_probs, top_ids, metrics
