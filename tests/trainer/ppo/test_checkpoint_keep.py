"""``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``: each bounds its own role's
``global_step_N/{actor,critic}`` directories (verl); a step left with neither is removed whole."""

from omegaconf import OmegaConf

from hybridflow.trainer.ppo.checkpointing import TrainerCheckpointer


def _layout(root, steps, roles=("actor", "critic")):
    for step in steps:
        for role in roles:
            (root / f"global_step_{step}" / role).mkdir(parents=True)
        (root / f"global_step_{step}" / "data.pt").write_bytes(b"state")


def _contents(root) -> dict[int, list[str]]:
    return {
        int(d.name.removeprefix("global_step_")): sorted(p.name for p in d.iterdir())
        for d in sorted(root.iterdir())
        if d.name.startswith("global_step_")
    }


def _checkpointer(root, actor_keep, critic_keep) -> TrainerCheckpointer:
    cfg = {"default_local_dir": str(root), "max_actor_ckpt_to_keep": actor_keep}
    return TrainerCheckpointer(OmegaConf.create({**cfg, "max_critic_ckpt_to_keep": critic_keep}))


def test_each_role_keeps_its_own_number(tmp_path):
    _layout(tmp_path, [1, 2, 3, 4])
    _checkpointer(tmp_path, actor_keep=2, critic_keep=1).prune(protect=4)
    # actor: newest two (4, 3); critic: newest one (4); steps 1 and 2 hold neither -> gone with data.pt
    assert _contents(tmp_path) == {3: ["actor", "data.pt"], 4: ["actor", "critic", "data.pt"]}


def test_critic_limit_alone_leaves_the_actor_history(tmp_path):
    _layout(tmp_path, [2, 4, 6])
    _checkpointer(tmp_path, actor_keep=None, critic_keep=1).prune(protect=6)
    assert _contents(tmp_path) == {
        2: ["actor", "data.pt"],
        4: ["actor", "data.pt"],
        6: ["actor", "critic", "data.pt"],
    }


def test_actor_only_run_prunes_whole_steps_and_protects_the_tracked_one(tmp_path):
    _layout(tmp_path, [1, 2, 3, 9], roles=("actor",))  # 9: left over from an abandoned, longer run
    removed = _checkpointer(tmp_path, actor_keep=1, critic_keep=5).prune(protect=3)
    assert _contents(tmp_path) == {3: ["actor", "data.pt"], 9: ["actor", "data.pt"]}
    assert sorted(removed) == sorted(
        str(tmp_path / f"global_step_{s}" / p) for s in (1, 2) for p in ("actor", "")
    )
    assert _checkpointer(tmp_path, actor_keep=None, critic_keep=None).prune(protect=3) == []
