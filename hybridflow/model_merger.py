"""Merge a sharded FSDP checkpoint (from FSDPCheckpointManager) into a plain Hugging Face model directory.

    python -m hybridflow.model_merger merge --backend fsdp \\
        --local_dir ckpt/global_step_8/actor --target_dir merged/ [--hf_model_path base_model/]

Runs in one process without any process group: DCP's ``.metadata`` lists every tensor's global shape and
dtype, so we allocate those tensors on CPU and ``dcp.load(..., no_dist=True)`` stitches every rank's shards
into them. The model is instantiated on the meta device from ``huggingface/config.json`` (the class recorded
in checkpoint_meta.json, e.g. ``Qwen2ForTokenClassification`` for a critic), the full tensors are assigned to
it after a strict key check, tied weights are re-tied, and ``save_pretrained`` writes safetensors. The
tokenizer/processor files and generation config are copied from ``huggingface/`` (or ``--hf_model_path``).

A LoRA checkpoint (``trainable_only`` in its meta) holds only the adapter. The base model is loaded from
``--base_model_path`` (default: the path recorded in ``huggingface/lora_adapter/adapter_config.json``),
the adapter is attached and filled with the saved tensors, and ``--lora_export merged`` (default) writes
the base model with the adapter merged in, ``--lora_export adapter`` peft's adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``).

    python -m hybridflow.model_merger merge --local_dir ckpt/global_step_8/actor --target_dir out/ \
        [--lora_export merged|adapter] [--base_model_path base_model/]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from hybridflow.utils.checkpoint.fsdp_checkpoint_manager import (
    ADAPTER_DIR,
    HF_DIR,
    MODEL_DIR,
    read_checkpoint_meta,
)

logger = logging.getLogger(__name__)

# Module names that wrappers insert into parameter names (FSDP1, activation checkpointing, torch.compile).
_WRAPPER_COMPONENTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
# Files in the HF source directory that the merged model writes itself, or that are weights.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_NOT_COPIED_NAMES = {"config.json", "generation_config.json"}


def _clean_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in _WRAPPER_COMPONENTS)


def load_dcp_model_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of a DCP model directory, wrapper prefixes stripped; no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(model_dir)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    skipped = set(metadata.state_dict_metadata) - set(state)
    if skipped:
        logger.warning("Ignoring non-tensor checkpoint entries %s", sorted(skipped))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(model_dir), no_dist=True)
    return {_clean_key(key): tensor for key, tensor in state.items()}


def _model_class(class_name: str | None):
    """The transformers class recorded at save time, else AutoModelForCausalLM."""
    import transformers

    model_cls = getattr(transformers, class_name, None) if class_name else None
    if model_cls is None:
        logger.warning("Model class %r not found in transformers; using AutoModelForCausalLM", class_name)
        return transformers.AutoModelForCausalLM
    return model_cls


def _check_keys(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Strict key check; a parameter may be absent only when a name tied to it (same Parameter) is present."""
    expected = set(model.state_dict())
    aliases = defaultdict(set)
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases[id(param)].add(name)
    covered = {name for names in aliases.values() if names & state_dict.keys() for name in names}
    missing = sorted(expected - state_dict.keys() - covered)
    unexpected = sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )


def _build_model(config, model_cls, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Instantiate on the meta device (no memory, no init) and assign the loaded tensors."""
    with torch.device("meta"):
        model = model_cls.from_config(config) if hasattr(model_cls, "from_config") else model_cls(config)
    _check_keys(model, state_dict)
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()  # assign=True replaced shared Parameters (tied embeddings); share them again
    leftover = [name for name, t in model.state_dict().items() if t.is_meta]
    if leftover:
        raise ValueError(f"Weights still uninitialised after loading: {leftover}")
    return model.eval()


def _copy_hf_files(hf_src: Path, target_dir: Path) -> None:
    """Tokenizer/processor files (and anything else small) from the HF source, except config and weights."""
    for path in hf_src.iterdir():
        skip = path.name in _NOT_COPIED_NAMES or path.name.endswith(_NOT_COPIED_SUFFIXES)
        if path.is_file() and not skip:
            shutil.copy2(path, target_dir / path.name)


def _lora_model(local_dir: Path, hf_src: Path, base_model_path: str | Path | None):
    """The base model with the checkpoint's adapter attached and loaded (a peft model, CPU, eval)."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter_dir = local_dir / HF_DIR / ADAPTER_DIR
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"LoRA checkpoint {local_dir} has no {adapter_dir}/adapter_config.json")
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base = Path(base_model_path or recorded or hf_src)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"base model {str(base)!r} for the LoRA checkpoint {local_dir} is not a model directory; "
            "pass --base_model_path"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(adapter_dir)))
    adapter_state = load_dcp_model_state(local_dir / MODEL_DIR)
    expected = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - set(adapter_state)), sorted(set(adapter_state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"LoRA checkpoint {local_dir} does not match its adapter config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    peft_model.load_state_dict(adapter_state, strict=False)
    return peft_model.eval()


def merge_fsdp_checkpoint(
    local_dir: str | Path,
    target_dir: str | Path,
    hf_model_path: str | Path | None = None,
    lora_export: str = "merged",
    base_model_path: str | Path | None = None,
) -> Path:
    """Write ``local_dir``'s weights as a Hugging Face model into ``target_dir``; returns ``target_dir``.

    ``hf_model_path`` overrides where config, generation config and tokenizer come from (default:
    ``local_dir/huggingface``). For a LoRA checkpoint ``lora_export`` picks ``merged`` weights or the
    ``adapter`` alone, on top of the base model at ``base_model_path`` (default: the recorded one).
    """
    from transformers import AutoConfig, GenerationConfig

    local_dir, target_dir = Path(local_dir), Path(target_dir)
    meta = read_checkpoint_meta(local_dir)
    if "model" not in meta["contents"]:
        raise ValueError(f"Checkpoint {local_dir} holds no model weights (contents: {meta['contents']})")
    hf_src = Path(hf_model_path) if hf_model_path is not None else local_dir / HF_DIR
    if not (hf_src / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {hf_src}; pass --hf_model_path (the base model's dir)")

    if lora_export not in ("merged", "adapter"):
        raise ValueError(f"lora_export must be 'merged' or 'adapter', got {lora_export!r}")
    if meta.get("trainable_only"):
        model = _lora_model(local_dir, hf_src, base_model_path)
        model = model.merge_and_unload() if lora_export == "merged" else model
    else:
        config = AutoConfig.from_pretrained(hf_src)
        state_dict = load_dcp_model_state(local_dir / MODEL_DIR)
        model = _build_model(config, _model_class(meta.get("model_class")), state_dict)
    if (hf_src / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf_src)

    target_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target_dir, safe_serialization=True)
    _copy_hf_files(hf_src, target_dir)
    logger.info(
        "Merged %s (step %s, %d ranks) into %s",
        local_dir,
        meta["global_step"],
        meta["world_size"],
        target_dir,
    )
    return target_dir


def main(argv: list[str] | None = None) -> None:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m hybridflow.model_merger", description=description)
    sub = parser.add_subparsers(dest="operation", required=True)
    merge = sub.add_parser("merge", help="merge checkpoint shards into a Hugging Face model directory")
    merge.add_argument("--backend", choices=["fsdp"], default="fsdp", help="training backend that wrote it")
    merge.add_argument("--local_dir", required=True, help="checkpoint dir, e.g. ckpt/global_step_8/actor")
    merge.add_argument("--target_dir", required=True, help="output directory for the Hugging Face model")
    merge.add_argument("--hf_model_path", default=None, help="take config/tokenizer from here instead")
    merge.add_argument(
        "--lora_export",
        choices=["merged", "adapter"],
        default="merged",
        help="LoRA checkpoints: base weights with the adapter merged in, or the peft adapter alone",
    )
    merge.add_argument("--base_model_path", default=None, help="LoRA: the base model (default: recorded)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = merge_fsdp_checkpoint(
        args.local_dir,
        args.target_dir,
        hf_model_path=args.hf_model_path,
        lora_export=args.lora_export,
        base_model_path=args.base_model_path,
    )
    print(f"Saved merged model to {path}")


if __name__ == "__main__":
    main()
