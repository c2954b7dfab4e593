"""Offline generation: ``python -m hybridflow.trainer.main_generation key=value ...`` (verl's shape).

Reads a verl-schema parquet (``data.path``), applies the model's chat template to each row's
``data.prompt_key`` messages (``add_generation_prompt=True``), samples ``data.n_samples`` responses
per prompt in this process (no Ray) with the embedded engine or vLLM (``rollout.name``), and writes
the input table plus a ``responses`` column (a list of ``n_samples`` strings per row, special tokens
skipped) to ``data.output_path``. Keys are those of ``config/generation.yaml``; an unknown key, or a
value whose effect is not delivered here (``honesty.GENERATION_LIMITED_VALUES``), is an error.
Score the result with ``python -m hybridflow.trainer.main_eval``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: no OpenMP spin-waiting
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from hybridflow.trainer.hydra_entry import hydra_entry  # noqa: E402

RESPONSES_COLUMN = "responses"
ENGINE_NAMES = ("engine", "vllm")  # hybridflow's engine, or vLLM itself
HF_NAME = "hf"  # HF generate: image rows of a vision-language model (trainer/vision_generation.py)


@hydra_entry("generation")
def main(config: DictConfig) -> None:
    run_generation(config)


def run_generation(config: DictConfig) -> str:
    """Generate ``data.n_samples`` responses for every row of ``data.path``; returns the output path."""
    import time

    import torch
    from tqdm import tqdm

    from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer
    from hybridflow.workers.model_builder import import_external_lib
    from hybridflow.workers.rollout.base import generation_seed
    from hybridflow.workers.rollout.engine_rollout import engine_sampling_params

    OmegaConf.resolve(config)
    validate_generation_config(config)
    torch.set_num_threads(int(config.trainer.num_threads))
    data, rollout = config.data, config.rollout
    table = _read_table(os.path.expanduser(str(data.path)), str(data.prompt_key))
    model_path = os.path.expanduser(str(config.model.path))
    import_external_lib(config.model.external_lib)
    tokenizer = load_tokenizer(
        model_path,
        trust_remote_code=bool(config.model.trust_remote_code),
        custom_chat_template=config.model.custom_chat_template,
    )
    if rollout.name == HF_NAME:  # image rows: the model's processor and HF generate
        from hybridflow.trainer.vision_generation import hf_generate

        out = write_responses(
            table, hf_generate(config, table, tokenizer), os.path.expanduser(str(data.output_path))
        )
        print(f"generated {len(table)} prompts x {int(data.n_samples)} responses with HF generate -> {out}")
        return out
    prompts = prompt_token_ids(
        table.column(str(data.prompt_key)).to_pylist(),
        tokenizer,
        int(rollout.prompt_length),
        str(data.truncation),
        where=str(data.path),
        template_kwargs=dict(data.get("apply_chat_template_kwargs") or {}),
    )
    n, batch_size = int(data.n_samples), int(data.batch_size)
    engine = build_engine(config)
    params = engine_sampling_params(rollout, {}, get_generation_eos_ids(tokenizer))
    responses: list[list[str]] = []
    generated_tokens, start = 0, time.perf_counter()
    starts = range(0, len(prompts), batch_size)
    try:
        for batch, first in enumerate(tqdm(starts, desc="generate", unit="batch")):
            engine.reseed(generation_seed(int(rollout.seed), batch, 0))
            with torch.no_grad():
                results = engine.generate_batch(prompts[first : first + batch_size], params, n=n)
            for result in results:
                ids = [completion.token_ids for completion in result.completions]
                generated_tokens += sum(len(t) for t in ids)
                responses.append(tokenizer.batch_decode(ids, skip_special_tokens=True))
    finally:
        if hasattr(engine, "shutdown"):  # vLLM in this process: its process groups go with it
            engine.shutdown()
    elapsed = time.perf_counter() - start
    out = write_responses(table, responses, os.path.expanduser(str(data.output_path)))
    print(
        f"generated {len(responses)} prompts x {n} responses ({generated_tokens} tokens, "
        f"{generated_tokens / max(elapsed, 1e-9):.0f} tokens/s) -> {out}"
    )
    return out


def validate_generation_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem of a composed generation config."""
    from hybridflow.trainer.config import CONFIG_DIR, ConfigError, device_problems
    from hybridflow.trainer.config.honesty import generation_problems
    from hybridflow.trainer.config.mistakes import unknown_key_problems
    from hybridflow.utils.dataset.rl_dataset import TRUNCATIONS
    from hybridflow.workers.rollout.engine_rollout import DTYPES

    schema = OmegaConf.load(CONFIG_DIR / "generation.yaml")
    problems = unknown_key_problems(config, schema, "generation.yaml")
    data, rollout, trainer = config.data, config.rollout, config.trainer
    if not data.path or not os.path.isfile(os.path.expanduser(str(data.path))):
        problems.append(f"data.path: input parquet {data.path!r} does not exist")
    if not data.output_path:
        problems.append("data.output_path: required (where the responses parquet is written)")
    if not config.model.path or not os.path.isdir(os.path.expanduser(str(config.model.path))):
        problems.append(f"model.path: {config.model.path!r} is not a local model directory")
    positive = {
        "data.n_samples": data.n_samples,
        "data.batch_size": data.batch_size,
        "rollout.prompt_length": rollout.prompt_length,
        "rollout.response_length": rollout.response_length,
        "rollout.max_num_seqs": rollout.max_num_seqs,
        "trainer.num_threads": trainer.num_threads,
    }
    problems += [
        f"{key}={value} must be a positive integer" for key, value in positive.items() if not _positive(value)
    ]
    if (
        _positive(data.n_samples)
        and _positive(rollout.max_num_seqs)
        and data.n_samples > rollout.max_num_seqs
    ):
        problems.append(
            f"data.n_samples={data.n_samples} exceeds rollout.max_num_seqs={rollout.max_num_seqs} "
            "(the samples of one prompt run together)"
        )
    max_len = rollout.max_model_len
    if max_len is not None and _positive(rollout.prompt_length) and int(max_len) <= rollout.prompt_length:
        problems.append(
            f"rollout.max_model_len={rollout.max_model_len} leaves no room to generate after "
            f"rollout.prompt_length={rollout.prompt_length}"
        )
    if data.truncation not in TRUNCATIONS:
        problems.append(f"data.truncation={data.truncation!r}; choose one of {list(TRUNCATIONS)}")
    if rollout.dtype not in DTYPES and rollout.dtype != "auto":
        problems.append(f"rollout.dtype={rollout.dtype!r}; choose one of {sorted(DTYPES) + ['auto']}")
    if rollout.name not in (*ENGINE_NAMES, HF_NAME):
        problems.append(
            f"rollout.name={rollout.name!r}; generation runs on one of {(*ENGINE_NAMES, HF_NAME)}"
        )
    elif rollout.name == "vllm":
        from hybridflow.workers.rollout.vllm_rollout import vllm_unavailable_reason

        reason = vllm_unavailable_reason(str(trainer.device))
        if reason is not None:
            problems.append(f"rollout.name=vllm cannot run: {reason}")
    problems += device_problems(str(trainer.device), local_workers=1)  # generates in this process
    problems += generation_problems(config)  # values whose effect is not delivered here
    if problems:
        raise ConfigError("invalid generation config:\n  - " + "\n  - ".join(problems))


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _read_table(path: str, prompt_key: str):
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if prompt_key not in table.column_names:
        raise ValueError(
            f"{path} has no column data.prompt_key={prompt_key!r} (columns: {table.column_names})"
        )
    return table


def prompt_token_ids(
    messages_per_row: list,
    tokenizer,
    prompt_length: int,
    truncation: str,
    where: str = "data",
    template_kwargs: dict | None = None,
) -> list[list[int]]:
    """Chat-templated prompt ids per row (no special tokens beyond the template; ``template_kwargs``:
    ``data.apply_chat_template_kwargs``, verl's, e.g. ``{enable_thinking: false}``).

    A prompt longer than ``prompt_length`` tokens raises ``ValueError`` naming its row when
    ``truncation`` is ``error``; otherwise it is cut as :data:`rl_dataset.TRUNCATIONS` says.
    """
    from hybridflow.utils.dataset.rl_dataset import TRUNCATIONS

    texts = []
    for row, messages in enumerate(messages_per_row):
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where} row {row}: the prompt must be a non-empty list of chat messages")
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{where} row {row}: each prompt message needs string 'role' and 'content'")
        texts.append(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
            )
        )
    ids_per_row = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    too_long = [row for row, ids in enumerate(ids_per_row) if len(ids) > prompt_length]
    cut = TRUNCATIONS[truncation]
    if too_long and cut is None:
        row = too_long[0]
        raise ValueError(
            f"{where} row {row}: prompt is {len(ids_per_row[row])} tokens after the chat template, longer "
            f"than rollout.prompt_length={prompt_length} ({len(too_long)} rows are too long); raise "
            "rollout.prompt_length or set data.truncation=left|right|middle"
        )
    return [cut(ids, prompt_length) if len(ids) > prompt_length else ids for ids in ids_per_row]


def build_engine(config: DictConfig):
    """The generation engine on ``model.path``'s weights: vLLM reading the directory itself
    (``rollout.name=vllm``), or the embedded engine holding a copy (the HF module is dropped)."""
    if config.rollout.name == "vllm":
        return _start_vllm(config)
    from hybridflow.workers.model_builder import load_hf_model
    from hybridflow.workers.rollout.engine import EngineModel
    from hybridflow.workers.rollout.engine_rollout import build_llm_engine, engine_dtype, engine_max_len

    dtype = engine_dtype(config.rollout.dtype, str(config.trainer.device))
    module = load_hf_model(config.model, "causal_lm", dtype).to(str(config.trainer.device)).eval()
    model = EngineModel.from_hf_module(module, engine_max_len(config.rollout), dtype=dtype)
    del module
    threads = int(config.trainer.num_threads)
    if threads > 1 and str(config.trainer.device) == "cpu":  # one decode thread per core, as the rollout
        from hybridflow.workers.rollout.engine.threaded import ThreadedEngines

        engines = [build_llm_engine(model, config.rollout, share=threads) for _ in range(threads)]
        for engine in engines:
            engine.resume()
        return ThreadedEngines(engines)
    return build_llm_engine(model, config.rollout)


def _start_vllm(config: DictConfig):
    """vLLM in this process on ``model.path``'s own weights (load_format auto: no actor syncs them here)."""
    from hybridflow.workers.model_builder import import_external_lib
    from hybridflow.workers.rollout.engine_rollout import engine_dtype, engine_max_len
    from hybridflow.workers.rollout.vllm_rollout.config import start_vllm

    import_external_lib(config.model.external_lib)
    rollout = OmegaConf.merge(config.rollout, {"load_format": "auto"})
    return start_vllm(
        os.path.expanduser(str(config.model.path)),
        rollout,
        engine_dtype(config.rollout.dtype, str(config.trainer.device)),
        engine_max_len(config.rollout),
        trust_remote_code=bool(config.model.trust_remote_code),
    )


def write_responses(table, responses: list[list[str]], output_path: str) -> str:
    """Write ``table`` plus (or with a replaced) ``responses`` column; parent folders are created."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(responses, type=pa.list_(pa.string()))
    if RESPONSES_COLUMN in table.column_names:
        table = table.set_column(table.column_names.index(RESPONSES_COLUMN), RESPONSES_COLUMN, column)
    else:
        table = table.append_column(RESPONSES_COLUMN, column)
    parent = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(parent, exist_ok=True)
    partial = f"{output_path}.partial"
    pq.write_table(table, partial)
    os.replace(partial, output_path)  # never leaves a half-written file at output_path
    return output_path


if __name__ == "__main__":
    main()
