"""``python -m hybridflow.serve``: an OpenAI-compatible server for a local model.

``--backend engine`` (default): hybridflow's engine behind a FastAPI app (:mod:`.app`), started here;
``--backend vllm``: vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) on the same model,
not a re-implementation of it. Both answer the official ``openai`` client the same way for what both
serve (chat and text completions, n, temperature, top_p, max_tokens, stop, seed, log-probs, tool calls,
streaming), including the errors.
"""
