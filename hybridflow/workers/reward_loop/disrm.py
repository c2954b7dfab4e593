"""A discriminative reward model (DisRM) in the reward loop, served: ``python -m hybridflow.serve --model RM``
answers ``POST /classify`` for a sequence-classification model (:mod:`hybridflow.serve.classify`).

As verl's ``RewardLoopWorker.compute_score_disrm``: the sample's chat (``raw_prompt``) plus the response
as an assistant turn, rendered by the RM's chat template (a leading BOS removed, the server adds its own),
posted as ``{"model", "input", "activation": false}``; the score is ``data[-1]["probs"][-1]``, the last
raw logit. The server batches the requests that arrive together into one forward.
"""

from __future__ import annotations

from hybridflow.protocol import DataProto
from hybridflow.utils.served_client import ServedClient


class ServedDisRM:
    """``address``: the classify server (``host:port``); ``model_name``: its served name;
    ``input_tokenizer``: the policy's (decodes the response); ``rm_tokenizer``: the RM's (its template)."""

    def __init__(self, address: str, model_name: str, input_tokenizer, rm_tokenizer, **client_kwargs) -> None:
        self.client = ServedClient(address, **client_kwargs)
        self.model_name = model_name
        self.input_tokenizer, self.rm_tokenizer = input_tokenizer, rm_tokenizer

    def prompt(self, data: DataProto) -> str:
        """The RM's input text for the one row of ``data``."""
        if "raw_prompt" not in data.non_tensor_batch:
            raise KeyError("a DisRM scores the chat: the batch needs raw_prompt (data.return_raw_chat=true)")
        chat = list(data.non_tensor_batch["raw_prompt"][0])
        responses = data.batch["responses"]
        n = int(data.batch["attention_mask"][0, -responses.shape[-1] :].sum())
        text = self.input_tokenizer.decode(responses[0, :n].tolist())
        if self.input_tokenizer.eos_token:
            text = text.replace(self.input_tokenizer.eos_token, "")
        chat.append({"role": "assistant", "content": text})
        rendered = self.rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        bos = self.rm_tokenizer.bos_token
        return rendered[len(bos) :] if bos and rendered.startswith(bos) else rendered

    async def score(self, data: DataProto) -> float:
        body = {"model": self.model_name, "input": self.prompt(data), "activation": False}
        answer = await self.client.post_json("/classify", body)
        return float(answer["data"][-1]["probs"][-1])
