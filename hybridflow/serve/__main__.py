"""``python -m hybridflow.serve --model PATH [--backend engine|vllm] [--host] [--port] ...``."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.serve", description=__doc__)
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
    parser.add_argument("--backend", choices=("engine", "vllm"), default="engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send as `model` (default: --model)"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine's weights and KV cache live (cuda: the first visible GPU)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's max positions")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="key full KV blocks and share them across requests (vLLM's flag; default on)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="positions per KV block (default 16)")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV budget (default 1.0 without --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="KV budget: this fraction of free memory (RAM on CPU)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="padded prompt tokens per prefill"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDFLOW_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* and /stats (default: $HYBRIDFLOW_API_KEY; "
        "unset: open)",
    )
    parser.add_argument("--max-n", type=int, default=32, help="samples per request at most")
    parser.add_argument("--max-prompts", type=int, default=32, help="prompts per /v1/completions request")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="sequences (n per request) queued beyond the KV-cache slots before 503 + Retry-After",
    )
    parser.add_argument("--max-request-bytes", type=int, default=4 << 20, help="the largest request body")
    parser.add_argument(
        "--task",
        choices=("auto", "generate", "classify"),
        default="auto",
        help="classify: serve POST /classify for a sequence-classification model (a DisRM; "
        "hybridflow.serve.classify); auto: classify when the architecture is *ForSequenceClassification",
    )
    args = parser.parse_args(argv)
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization={args.gpu_memory_utilization:g} must be in (0, 1]")
    if args.kv_cache_memory_gb is not None and args.kv_cache_memory_gb <= 0:
        parser.error(f"--kv-cache-memory-gb={args.kv_cache_memory_gb:g} must be > 0")
    return args


def run_vllm(args: argparse.Namespace) -> None:
    """Replace this process with vLLM's own OpenAI server on the same model."""
    from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

    reason = vllm_unavailable_reason("cpu")
    if reason is not None:
        sys.exit(f"hybridflow.serve --backend vllm: {reason}")
    import transformers

    from hybridflow.workers.rollout.vllm_rollout.config import model_problems

    problems = model_problems(transformers.AutoConfig.from_pretrained(os.path.expanduser(args.model)))
    if problems:
        sys.exit(f"hybridflow.serve --backend vllm: {'; '.join(problems)}")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM-CPU's legacy variable would override the flag
    os.execv(sys.executable, vllm_command(args))


def vllm_command(args: argparse.Namespace) -> list[str]:
    """vLLM's OpenAI server command for these flags: the model, limits, KV budget (:func:`vllm_kv_bytes`),
    batched tokens and API key reach it as vLLM's own flags."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model,
        "--served-model-name", args.served_model_name or args.model,
        "--host", args.host,
        "--port", str(args.port),
        "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
        "--max-num-seqs", str(args.max_num_seqs),
        "--enforce-eager",
    ]  # fmt: skip
    command.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.block_size:
        command += ["--block-size", str(args.block_size)]
    if _has_hermes_tokens(args.model):  # vLLM's Hermes parser needs <tool_call> in the vocabulary
        command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.api_key:  # vLLM's server guards /v1/* with the same bearer key
        command += ["--api-key", args.api_key]
    command += ["--max-num-batched-tokens", str(max(args.max_num_batched_tokens, args.max_model_len or 0))]
    command += ["--kv-cache-memory-bytes", str(vllm_kv_bytes(args))]
    return command


def vllm_kv_bytes(args: argparse.Namespace) -> int:
    """The KV budget handed to vLLM: ``--kv-cache-memory-gb``, else ``--gpu-memory-utilization`` x the
    free RAM (as the engine sizes its own), else 1 GiB."""
    if args.kv_cache_memory_gb is not None:
        return int(args.kv_cache_memory_gb * 2**30)
    if args.gpu_memory_utilization is not None:
        from hybridflow.workers.rollout.engine_rollout import available_ram_bytes

        return int(args.gpu_memory_utilization * available_ram_bytes())
    return 2**30


def _has_hermes_tokens(model: str) -> bool:
    from hybridflow.models.loading import load_tokenizer

    vocab = load_tokenizer(os.path.expanduser(model)).get_vocab()
    return "<tool_call>" in vocab and "</tool_call>" in vocab


def build_service(args: argparse.Namespace):
    """hybridflow's engine on the model's weights, its KV cache allocated for serving."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer
    from hybridflow.serve.app import EngineService, ServerLimits
    from hybridflow.workers.rollout.engine import EngineModel
    from hybridflow.workers.rollout.engine_rollout import build_llm_engine

    path = os.path.expanduser(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    max_len = int(args.max_model_len or module.config.max_position_embeddings)
    model = EngineModel.from_hf_module(module, max_len, dtype=dtype, device=torch.device(args.device))
    del module
    settings = {
        "max_model_len": max_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    if args.kv_cache_memory_gb is None and args.gpu_memory_utilization is None:
        settings["kv_cache_memory_gb"] = 1.0
    engine = build_llm_engine(model, OmegaConf.create(settings))
    engine.resume()  # a server keeps its cache
    engine.step_in_thread = True  # the event loop keeps answering (/health) while the engine steps
    tokenizer = load_tokenizer(path)
    limits = ServerLimits(max_n=args.max_n, max_prompts=args.max_prompts, max_waiting=args.max_waiting)
    return EngineService(
        engine, tokenizer, args.served_model_name or args.model, get_generation_eos_ids(path), limits
    )


def model_dir_problem(model: str) -> str | None:
    """Why ``--model`` is not a local Hugging Face model directory (None when it is one)."""
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        return f"--model {model}: the model directory {what} (give a local Hugging Face model directory)"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model {model}: the directory has no config.json (not a Hugging Face model directory)"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    problem = model_dir_problem(args.model)
    if problem is not None:  # one line, before anything loads (not transformers' traceback about repo ids)
        print(f"hybridflow.serve: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.device == "cuda" and args.backend == "engine":
        import torch

        if not torch.cuda.is_available():
            print("hybridflow.serve: error: --device cuda: no CUDA GPU is visible here", file=sys.stderr)
            sys.exit(2)
    if args.backend == "vllm":
        run_vllm(args)
        return
    import uvicorn

    from hybridflow.serve.app import build_app

    if args.task == "classify" or (args.task == "auto" and _is_classifier(args.model)):
        serve_classifier(args)
        return
    service = build_service(args)
    guard = "API key required" if args.api_key else "no API key: open to anyone who can reach it"
    print(
        f"hybridflow.serve: {service.model_name} on http://{args.host}:{args.port}/v1 (engine; {guard})",
        flush=True,
    )
    app = build_app(service, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def _is_classifier(model: str) -> bool:
    from hybridflow.models.loading import is_sequence_classifier

    return is_sequence_classifier(model)


def serve_classifier(args: argparse.Namespace) -> None:
    """A DisRM: ``POST /classify`` on the model's sequence-classification head (:mod:`.classify`)."""
    import torch
    import uvicorn

    from hybridflow.serve.classify import Classifier, build_classify_app

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    classifier = Classifier(os.path.expanduser(args.model), args.served_model_name or args.model, dtype)
    print(f"hybridflow.serve: {classifier.model_name} on http://{args.host}:{args.port}/classify", flush=True)
    app = build_classify_app(classifier, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
