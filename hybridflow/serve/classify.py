"""``POST /classify`` for a discriminative reward model (DisRM): a sequence-classification model served.

``python -m hybridflow.serve --model RM`` serves this app instead of the engine's when the model is an
``AutoModelForSequenceClassification`` (its config's architecture ends in ``ForSequenceClassification``,
or ``--task classify``). Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /classify`` (vLLM's API):

- request: ``{"model", "input": str | [str, ...] | [int, ...] | [[int, ...], ...], "activation": true}``
  (``use_activation`` is the same field's newer name); strings are tokenised with the model's tokenizer
  (``add_special_tokens``, default true);
- answer: ``{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs",
  "num_classes"}], "usage"}``; ``probs`` are the class probabilities (softmax; sigmoid for one class),
  or the raw logits with ``activation: false``, which verl's reward loop sends and reads
  ``data[-1]["probs"][-1]`` as the score.

**Batching**: requests in flight are gathered by one batching task and run as one forward (right-padded,
the model finds each row's last token through ``pad_token_id``), at most ``max_batch`` inputs at a time,
in a thread so ``/health`` keeps answering. Each row's logits equal an unpadded forward of that input
alone (the test compares them with HF). A bad input (empty, a token outside the vocabulary, longer than
``max_length``) is a 400 naming its index; the other requests go on.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoint's annotations (Request) at build time
import asyncio
import uuid
from typing import Any

from hybridflow.serve.protocol import APIError, now


class Classifier:
    """A sequence-classification model and its tokenizer, batching concurrent requests (module docstring)."""

    def __init__(self, path: str, model_name: str, dtype=None, max_batch: int = 32) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype or torch.float32
        ).eval()
        pad = self.model.config.pad_token_id
        if pad is None:  # the model finds each row's last token by the pad id
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            self.model.config.pad_token_id = pad
        self.pad_id = int(pad)
        self.model_name, self.max_batch = model_name, int(max_batch)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.labels = self.model.config.id2label or {}
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None

    # ------------------------------------------------------------------ inputs
    def token_lists(self, request: dict) -> list[list[int]]:
        data = request.get("input")
        add_special = bool(request.get("add_special_tokens", True))
        if isinstance(data, str) or (
            isinstance(data, list) and data and all(isinstance(t, int) for t in data)
        ):
            data = [data]
        if not isinstance(data, list) or not data:
            raise APIError(400, "input must be a string, a list of strings or token lists", param="input")
        rows = []
        for index, item in enumerate(data):
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=add_special)["input_ids"]
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                ids = list(item)
            else:
                raise APIError(
                    400, f"input[{index}] is neither a string nor a list of token ids", param="input"
                )
            if not ids:
                raise APIError(400, f"input[{index}] is empty", param="input")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(
                    400, f"input[{index}]: token id {bad} is outside [0, {self.vocab_size})", "input"
                )
            if len(ids) > self.max_length:
                raise APIError(
                    400, f"input[{index}] has {len(ids)} tokens; the most is {self.max_length}", "input"
                )
            rows.append(ids)
        return rows

    # ------------------------------------------------------------------ batched forward
    def forward(self, rows: list[list[int]]) -> list[list[float]]:
        """Logits ``(len(rows), num_labels)`` of right-padded ``rows`` in one forward."""
        import torch

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        return logits.float().tolist()

    async def logits(self, rows: list[list[int]]) -> list[list[float]]:
        """``rows`` through the shared batch (with whatever else is waiting)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._batcher = asyncio.ensure_future(self._batch_forever())
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((rows, done))
        return await done

    async def _batch_forever(self) -> None:
        while True:
            waiting = [await self._queue.get()]
            while not self._queue.empty() and sum(len(r) for r, _ in waiting) < self.max_batch:
                waiting.append(self._queue.get_nowait())
            rows = [row for request_rows, _ in waiting for row in request_rows]
            try:
                out = await asyncio.to_thread(self.forward, rows)
            except Exception as error:  # the batch's requests fail, the server goes on
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(
                            APIError(500, f"the classifier failed: {error}", kind="internal_error")
                        )
                continue
            start = 0
            for request_rows, done in waiting:
                if not done.done():
                    done.set_result(out[start : start + len(request_rows)])
                start += len(request_rows)

    # ------------------------------------------------------------------ the endpoint
    async def classify(self, request: dict) -> dict:
        import math

        if request.get("model") not in (None, self.model_name):
            raise APIError(
                404, f"The model `{request.get('model')}` does not exist.", "model", "NotFoundError"
            )
        rows = self.token_lists(request)
        activation = request.get("use_activation", request.get("activation", True))
        data = []
        for index, logits in enumerate(await self.logits(rows)):
            if not activation:
                probs = logits
            elif len(logits) == 1:
                probs = [1.0 / (1.0 + math.exp(-logits[0]))]
            else:
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                probs = [e / sum(exps) for e in exps]
            label = max(range(len(logits)), key=logits.__getitem__)
            name = self.labels.get(label, str(label))
            data.append({"index": index, "label": name, "probs": probs, "num_classes": len(logits)})
        tokens = sum(len(r) for r in rows)
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": now(),
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }


def add_classify_routes(app, classifier: Classifier) -> None:
    """``POST /classify`` on ``app``."""
    from fastapi import Request

    @app.post("/classify")
    async def classify(http_request: Request):
        try:
            body: Any = await http_request.json()
        except ValueError as error:
            raise APIError(400, f"the body is not JSON: {error}") from error
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return await classifier.classify(body)


def build_classify_app(classifier: Classifier, api_key: str | None = None, max_request_bytes: int = 4 << 20):
    """The DisRM's ASGI app: ``/health``, ``/v1/models``, ``/classify``, behind the same gate (API key,
    body size) as the engine's app."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from hybridflow.serve.gate import RequestGate

    app = FastAPI(title="hybridflow.serve (classify)")

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": classifier.model_name, "object": "model", "created": now(), "owned_by": "hybridflow"}
        return {"object": "list", "data": [card]}

    add_classify_routes(app, classifier)
    return RequestGate(app, api_key, max_request_bytes)
