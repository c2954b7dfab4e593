"""verl's reward-manager registry names: ``register``, ``get_reward_manager_cls`` and the
dict-like ``REWARD_MANAGER_REGISTRY`` (the same registry the trainer builds managers from)."""

import pytest

from hybridflow.workers.reward_manager import registry


@pytest.fixture
def scratch(monkeypatch):
    monkeypatch.setattr(registry.REWARD_MANAGERS, "_entries", dict(registry.REWARD_MANAGERS._entries))
    return registry.REWARD_MANAGER_REGISTRY


def test_verl_names_reach_the_trainers_registry(scratch):
    assert scratch is registry.REWARD_MANAGERS
    assert registry.get_reward_manager_cls("naive").__name__ == "NaiveRewardManager"

    @registry.register("my_manager")
    class MyManager:
        pass

    assert scratch["my_manager"] is MyManager
    with pytest.raises(ValueError):

        @registry.register("my_manager")
        class Other:
            pass


def test_unknown_and_wrong_case_names_are_value_errors_in_verls_words(scratch):
    with pytest.raises(ValueError, match="^Unknown reward manager: Naive. Registered: .*naive"):
        registry.get_reward_manager_cls("Naive")
    scratch.clear()
    with pytest.raises(ValueError, match="^Unknown reward manager: naive. Registered: $"):
        registry.get_reward_manager_cls("naive")


def test_package_exports_verls_names():
    import hybridflow.workers.reward_manager as package

    assert (
        package.register is registry.register and package.REWARD_MANAGER_REGISTRY is registry.REWARD_MANAGERS
    )
