"""Offline generation (main_generation) and scoring (main_eval) on the tiny model and arithmetic data."""

import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main_eval import k_values, pass_at_k, run_eval
from hybridflow.trainer.main_generation import prompt_token_ids, run_generation

SOURCE = "hybridflow/arithmetic"


@pytest.fixture(scope="module")
def six_rows(arithmetic_data, tmp_path_factory):
    """The arithmetic test split's first 6 rows as their own parquet."""
    path = tmp_path_factory.mktemp("gen_input") / "six.parquet"
    pq.write_table(pq.read_table(arithmetic_data[1]).slice(0, 6), path)
    return str(path)


def _gen_config(model_dir, data_path, output_path, *overrides):
    return load_config(
        [
            f"model.path={model_dir}",
            f"data.path={data_path}",
            f"data.output_path={output_path}",
            "rollout.prompt_length=64",
            "rollout.response_length=8",
            *overrides,
        ],
        config_name="generation",
    )


def _write_eval_parquet(path, rows):
    """rows: (ground_truth, [responses]) of the arithmetic data source."""
    table = pa.table(
        {
            "data_source": [SOURCE] * len(rows),
            "reward_model": [{"style": "rule", "ground_truth": gt} for gt, _ in rows],
            "responses": [list(responses) for _, responses in rows],
        }
    )
    pq.write_table(table, path)
    return str(path)


def _eval_config(data_path, *overrides):
    return load_config([f"data.path={data_path}", *overrides], config_name="evaluation")


def test_generation_writes_n_responses_per_row(tiny_model_dir, six_rows, tmp_path):
    out = tmp_path / "nested" / "dir" / "gen.parquet"
    config = _gen_config(
        tiny_model_dir,
        six_rows,
        out,
        "data.n_samples=2",
        "data.batch_size=4",  # two engine calls: 4 + 2 prompts
        "rollout.do_sample=true",
        "rollout.temperature=1.0",
        "rollout.seed=3",
    )
    assert run_generation(config) == str(out)
    written, source = pq.read_table(out), pq.read_table(six_rows)
    assert written.column_names == [*source.column_names, "responses"]
    assert written.drop(["responses"]).to_pylist() == source.to_pylist()
    responses = written.column("responses").to_pylist()
    assert len(responses) == 6
    assert all(len(row) == 2 and all(isinstance(r, str) for r in row) for row in responses)
    assert any(row[0] != row[1] for row in responses)  # sampled, not greedy
    # the same seed reproduces the same samples
    again = tmp_path / "again.parquet"
    run_generation(
        _gen_config(
            tiny_model_dir, six_rows, again, "data.n_samples=2", "data.batch_size=4", "rollout.seed=3"
        )
    )
    assert pq.read_table(again).column("responses").to_pylist() == responses


def test_greedy_generation_equals_hf_generate(tiny_model_dir, six_rows, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer

    out = tmp_path / "greedy.parquet"
    run_generation(
        _gen_config(
            tiny_model_dir,
            six_rows,
            out,
            "rollout.do_sample=false",
            "data.n_samples=2",
            "rollout.response_length=12",
        )
    )
    responses = pq.read_table(out).column("responses").to_pylist()
    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for row, messages in enumerate(pq.read_table(six_rows).column("prompt").to_pylist()[:2]):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            full = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=get_generation_eos_ids(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
            )
        expected = tokenizer.decode(full[0, ids.shape[1] :], skip_special_tokens=True)
        assert expected  # a non-empty continuation: the comparison means something
        assert responses[row] == [expected, expected]


def test_generation_cli_overrides_and_unknown_keys(tiny_model_dir, six_rows, tmp_path):
    config = _gen_config(
        tiny_model_dir, six_rows, tmp_path / "o.parquet", "data.n_samples=4", "rollout.top_k=5"
    )
    assert config.data.n_samples == 4 and config.rollout.top_k == 5 and config.trainer.num_threads == 1
    with pytest.raises(ConfigError, match="data.no_such_key"):
        load_config(["data.no_such_key=1"], config_name="generation")
    with pytest.raises(ConfigError, match="unknown config key 'rollout.extra'"):
        run_generation(_gen_config(tiny_model_dir, six_rows, tmp_path / "o.parquet", "+rollout.extra=1"))


def test_generation_missing_input_file(tiny_model_dir, tmp_path):
    missing = tmp_path / "absent.parquet"
    with pytest.raises(ConfigError, match=r"data.path: input parquet .*absent.parquet.* does not exist"):
        run_generation(_gen_config(tiny_model_dir, missing, tmp_path / "o.parquet"))
    assert not (tmp_path / "o.parquet").exists()


def test_generation_overlong_prompt(tiny_model_dir, six_rows, tmp_path):
    with pytest.raises(
        ValueError, match=r"six.parquet row 0: prompt is \d+ tokens .* rollout.prompt_length=5"
    ):
        run_generation(
            _gen_config(tiny_model_dir, six_rows, tmp_path / "o.parquet", "rollout.prompt_length=5")
        )
    out = run_generation(
        _gen_config(
            tiny_model_dir,
            six_rows,
            tmp_path / "o.parquet",
            "rollout.prompt_length=5",
            "data.truncation=left",
        )
    )
    assert len(pq.read_table(out).column("responses").to_pylist()) == 6


def test_prompt_truncation_sides(tiny_model_dir):
    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [[{"role": "user", "content": "What is 12 + 34? Compute the result."}]]
    (full,) = prompt_token_ids(messages, tokenizer, 1000, "error")
    assert prompt_token_ids(messages, tokenizer, 4, "left") == [full[-4:]]
    assert prompt_token_ids(messages, tokenizer, 4, "right") == [full[:4]]
    with pytest.raises(ValueError, match="my.parquet row 0"):
        prompt_token_ids(messages, tokenizer, 4, "error", where="my.parquet")


def test_pass_at_k_estimator():
    assert k_values(1) == [1] and k_values(3) == [1, 2, 3] and k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]
    assert pass_at_k(4, 2, 1) == 0.5
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert (
        pass_at_k(4, 2, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(5, 1, 3) == pytest.approx(0.6)
    )


def test_eval_exact_metrics(tmp_path):
    path = _write_eval_parquet(
        tmp_path / "responses.parquet",
        [
            ("12", ["12", "the answer is 13", "7 then 12", "no number"]),  # c = 2 of 4
            ("5", ["5", "5", "it is 5", "5"]),  # c = 4
            ("30", ["3", "31", "-30", "x"]),  # c = 0
        ],
    )
    metrics = run_eval(_eval_config(path))
    assert set(metrics) == {SOURCE}
    got = metrics[SOURCE]
    assert got["num_rows"] == 3 and got["num_responses"] == 12
    assert got["mean_reward"] == pytest.approx(6 / 12)
    assert got["first_response_reward"] == pytest.approx(2 / 3)
    assert got["pass@1"] == pytest.approx((2 / 4 + 1 + 0) / 3)
    assert got["pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2) + 1 + 0) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    assert set(got) == {
        "num_rows",
        "num_responses",
        "mean_reward",
        "first_response_reward",
        "pass@1",
        "pass@2",
        "pass@4",
    }


def test_eval_custom_function_and_scorer_error(tmp_path):
    path = _write_eval_parquet(tmp_path / "r.parquet", [("1", ["1", "one"]), ("2", ["boom", "2"])])
    scorer = tmp_path / "my_reward.py"
    scorer.write_text(
        "def half(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    if solution_str == 'boom':\n"
        "        raise RuntimeError('cannot score')\n"
        "    return {'score': scale * float(solution_str == ground_truth), 'note': 'x'}\n"
    )
    custom = [f"custom_reward_function.path={scorer}", "custom_reward_function.name=half"]
    with pytest.raises(
        RuntimeError, match=r"r.parquet row 1 \(data_source 'hybridflow/arithmetic'\), response 0"
    ):
        run_eval(_eval_config(path, *custom))
    ok = _write_eval_parquet(tmp_path / "ok.parquet", [("1", ["1", "one"]), ("2", ["2", "2"])])
    metrics = run_eval(_eval_config(ok, *custom, "+custom_reward_function.reward_kwargs.scale=0.5"))[SOURCE]
    assert metrics["mean_reward"] == pytest.approx(0.5 * 3 / 4)
    assert metrics["pass@1"] == 0.0  # 0.5 < the pass threshold 1.0


def test_eval_cli_prints_json(tmp_path):
    path = _write_eval_parquet(tmp_path / "cli.parquet", [("7", ["7", "8"]), ("9", ["1", "2"])])
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.trainer.main_eval",
            f"data.path={path}",
            "data.response_key=responses",
        ],
        cwd=tmp_path,  # Hydra's run folder goes here
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout[done.stdout.index("{") :])
    assert metrics[SOURCE]["pass@2"] == 0.5 and metrics[SOURCE]["mean_reward"] == 0.25


def test_generation_rejects_an_unknown_device(tiny_model_dir, six_rows, tmp_path):
    with pytest.raises(ConfigError, match="trainer.device must be cpu or cuda, not 'tpu'"):
        run_generation(_gen_config(tiny_model_dir, six_rows, tmp_path / "o.parquet", "trainer.device=tpu"))
    assert not (tmp_path / "o.parquet").exists()


# ------------------------------------------------ honest config: generation.yaml and evaluation.yaml
def _ids(cases):
    return [override for override, _ in cases]


GENERATION_REJECTED = [
    ("trainer.nnodes=2", "trainer.nnodes=2 is not supported (generation runs in this one process"),
    ("trainer.n_gpus_per_node=8", "trainer.n_gpus_per_node=8 is not supported (one process generates"),
    ("rollout.mode=async", "rollout.mode='async' is not supported"),
    ("rollout.n=4", "rollout.n=4 is not supported (data.n_samples sets the responses per prompt"),
    ("rollout.tensor_model_parallel_size=2", "tensor-parallel generation is not implemented"),
    ("rollout.enable_chunked_prefill=true", "the embedded engine prefills whole prompts"),
    ("rollout.disable_log_stats=false", "the engine logs no periodic stats"),
    ("rollout.calculate_log_probs=true", "no log-probs column"),
]


@pytest.mark.parametrize(("override", "message"), GENERATION_REJECTED, ids=_ids(GENERATION_REJECTED))
def test_generation_rejects_undelivered_settings(tiny_model_dir, six_rows, tmp_path, override, message):
    out = tmp_path / "o.parquet"
    with pytest.raises(ConfigError) as info:
        run_generation(_gen_config(tiny_model_dir, six_rows, out, override))
    assert message in str(info.value)
    assert not out.exists()


def test_generation_rejections_are_listed_together(tiny_model_dir, six_rows, tmp_path):
    overrides = ("rollout.mode=async", "rollout.n=2", "trainer.n_gpus_per_node=2")
    with pytest.raises(ConfigError) as info:
        run_generation(_gen_config(tiny_model_dir, six_rows, tmp_path / "o.parquet", *overrides))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid generation config:" and len(lines) == 4
    assert [line.split("=")[0] for line in lines[1:]] == [
        "  - trainer.n_gpus_per_node",
        "  - rollout.mode",
        "  - rollout.n",
    ]


def test_generation_accepted_verl_keys_give_the_same_responses(tiny_model_dir, six_rows, tmp_path):
    """load_format, free_cache_engine and the log-prob micro batch sizes ("accepted: ...") run, and
    change nothing in greedy output."""
    greedy = ("rollout.do_sample=false", "data.n_samples=2")
    default = run_generation(_gen_config(tiny_model_dir, six_rows, tmp_path / "a.parquet", *greedy))
    verl_keys = (
        "rollout.load_format=hf",
        "rollout.free_cache_engine=false",
        "rollout.log_prob_micro_batch_size=4",
        "rollout.log_prob_micro_batch_size_per_gpu=2",
    )
    again = run_generation(_gen_config(tiny_model_dir, six_rows, tmp_path / "b.parquet", *greedy, *verl_keys))
    responses = pq.read_table(default).column("responses").to_pylist()
    assert pq.read_table(again).column("responses").to_pylist() == responses


def test_eval_rejects_a_ray_timeline(tmp_path):
    path = _write_eval_parquet(tmp_path / "r.parquet", [("1", ["1"])])
    with pytest.raises(ConfigError, match=r"ray_init.timeline_json_file='/tmp/t.json' is not supported"):
        run_eval(_eval_config(path, "ray_init.timeline_json_file=/tmp/t.json"))


def test_eval_accepted_verl_keys_change_nothing(tmp_path):
    path = _write_eval_parquet(tmp_path / "r.parquet", [("1", ["1", "2"]), ("3", ["0", "0"])])
    expected = run_eval(_eval_config(path))
    assert run_eval(_eval_config(path, "data.prompt_key=no_such_column", "ray_init.num_cpus=2")) == expected


def _write_mixed_parquet(path):
    """A MATH row whose answer only Math-Verify accepts (2/4 == 0.5), and an arithmetic row."""
    table = pa.table(
        {
            "data_source": ["lighteval/MATH", SOURCE],
            "reward_model": [{"style": "rule", "ground_truth": truth} for truth in ("0.5", "4")],
            "responses": [[r"so \boxed{\frac{2}{4}}"], ["4"]],
        }
    )
    pq.write_table(table, path)
    return str(path)


def test_eval_reward_kwargs_reach_the_builtin_scorers_that_take_them(tmp_path):
    path = _write_mixed_parquet(tmp_path / "mixed.parquet")
    plain = run_eval(_eval_config(path))
    assert plain["lighteval/MATH"]["mean_reward"] == 0.0  # verl's string equivalence: 2/4 is not 0.5
    verified = run_eval(_eval_config(path, "+custom_reward_function.reward_kwargs.use_math_verify=true"))
    assert verified["lighteval/MATH"]["mean_reward"] == 1.0
    assert verified[SOURCE]["mean_reward"] == 1.0  # the arithmetic scorer does not take it: not passed


def test_eval_reward_kwargs_no_scorer_takes_are_rejected_before_scoring(tmp_path):
    path = _write_eval_parquet(tmp_path / "r.parquet", [("1", ["1"])])
    with pytest.raises(ConfigError) as info:
        run_eval(_eval_config(path, "+custom_reward_function.reward_kwargs.use_math_verify=true"))
    message = str(info.value)
    expected = "custom_reward_function.reward_kwargs: reward kwarg 'use_math_verify' is accepted by no scorer"
    assert expected in message
    assert "hybridflow/arithmetic accepts none" in message and "lighteval/MATH" in message
    scorer = tmp_path / "mine.py"
    scorer.write_text("def mine(data_source, solution_str, ground_truth, scale=1.0):\n    return scale\n")
    custom = [f"custom_reward_function.path={scorer}", "custom_reward_function.name=mine"]
    with pytest.raises(ConfigError, match=r"kwarg 'scael' is not a parameter of mine .* it takes scale"):
        run_eval(_eval_config(path, *custom, "+custom_reward_function.reward_kwargs.scael=2"))
