import pytest

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    RegistryError,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)


def _fn_a(x):
    return x


def _fn_b(x):
    return -x


def test_register_get_alias_and_names():
    reg = Registry("thing")
    reg.register("k1", "kl")(_fn_a)
    reg.register("zeta")(_fn_b)
    assert reg.get("kl") is reg.get("k1") is _fn_a
    assert reg.names() == ["k1", "kl", "zeta"]
    assert "kl" in reg and "nope" not in reg and len(reg) == 3


def test_reregistering_same_function_is_noop():
    reg = Registry("thing")
    reg.register("a")(_fn_a)
    assert reg.register("a")(_fn_a) is _fn_a
    assert reg.names() == ["a"]


def test_conflicting_registration_raises_and_binds_nothing():
    reg = Registry("thing")
    reg.register("a")(_fn_a)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("b", "a")(_fn_b)
    assert reg.names() == ["a"]  # "b" was not half-registered


def test_unknown_name_lists_sorted_names_and_is_key_and_value_error():
    reg = Registry("thing")
    reg.register("zeta")(_fn_a)
    reg.register("alpha")(_fn_b)
    with pytest.raises(KeyError) as excinfo:
        reg.get("beta")
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, RegistryError)
    assert str(excinfo.value) == "Unknown thing 'beta'. Registered: alpha, zeta"


def test_global_registries_contents():
    assert ADV_ESTIMATORS.names() == sorted(
        [
            "gae",
            "grpo",
            "grpo_vectorized",
            "rloo",
            "rloo_vectorized",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "remax",
            "opo",
            "gpg",
            "grpo_passk",
        ]
    )
    assert POLICY_LOSSES.names() == sorted(
        ["vanilla", "gspo", "gpg", "cispo", "sapo", "clip_cov", "kl_cov", "bypass_mode"]
    )
    assert LOSS_AGG_MODES.names() == sorted(
        ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    )
    assert KL_ESTIMATORS.names() == sorted(["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])


def test_global_unknown_names_list_everything():
    with pytest.raises(ValueError) as excinfo:
        get_adv_estimator_fn("ppo2")
    assert ", ".join(ADV_ESTIMATORS.names()) in str(excinfo.value)
    with pytest.raises(KeyError) as excinfo:
        get_policy_loss_fn("dpo")
    assert ", ".join(POLICY_LOSSES.names()) in str(excinfo.value)


def test_global_conflicts_raise_without_changing_registry():
    before = ADV_ESTIMATORS.get("grpo")
    with pytest.raises(ValueError):
        register_adv_est("grpo")(_fn_a)
    assert ADV_ESTIMATORS.get("grpo") is before
    with pytest.raises(ValueError):
        register_policy_loss("vanilla")(_fn_a)


def test_registry_is_a_dict_like_mapping_as_verls_registries_are():
    reg = Registry("thing")
    reg.register("a")(_fn_a)
    reg.update({"b": _fn_b})  # plain assignment replaces on purpose; register() is the checked path
    assert reg["a"] is _fn_a and dict(reg.items()) == {"a": _fn_a, "b": _fn_b}
    assert reg.get("zzz", None) is None
    del reg["a"]
    assert list(reg) == ["b"]
    reg.clear()
    assert len(reg) == 0
    with pytest.raises(KeyError):
        reg["b"]


def test_register_in_applies_the_rules_to_a_plain_dict():
    from enum import Enum

    from hybridflow.utils.registry import lookup_in, register_in

    class Names(Enum):
        A = "a"

    entries = {}
    register_in(entries, "thing", Names.A)(_fn_a)
    register_in(entries, "thing", "a")(_fn_a)  # the same function again: no-op
    with pytest.raises(ValueError, match="already registered"):
        register_in(entries, "thing", "a")(_fn_b)
    assert lookup_in(entries, Names.A, "Unknown thing: A") is _fn_a
    with pytest.raises(ValueError, match="^Unknown thing: c. Registered: a$"):
        lookup_in(entries, "c", "Unknown thing: c")
