"""verl_tests/ holds verl's files, run by test_verl_reward_loop_tests.py through the alias, not collected.

``genrm``: a GenRM judge on our engine for the whole session, two ``python -m hybridflow.serve`` replicas
of the tiny model (served as ``judge``) behind ``python -m hybridflow.serve.router``, started at once."""

import pytest

collect_ignore = ["verl_tests"]


@pytest.fixture(scope="session")
def genrm(tiny_model_dir, tmp_path_factory):
    from hybridflow.workers.reward_loop.servers import RewardModelServers

    log_dir = tmp_path_factory.mktemp("genrm")
    with RewardModelServers(tiny_model_dir, replicas=2, served_name="judge", log_dir=str(log_dir)) as servers:
        yield servers
