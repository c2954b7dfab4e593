"""Shared fixtures. One Ray session serves the whole test suite (starting Ray costs ~4 s)."""

import os

# Before torch is imported anywhere: two shared cores, no OpenMP spin-waiting (PLATFORM_NOTES).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the whole session; never attaches to another cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=8,  # logical CPUs: lets 2-4 fractional workers and colocated groups fit
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
