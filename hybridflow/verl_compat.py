"""Opt-in ``verl`` alias: a file written against verl (``from verl.… import …``) runs on hybridflow.

The switch (any one of them; see docs/coming_from_verl.md):

- in code: ``import hybridflow.verl_compat; hybridflow.verl_compat.install()``;
- in the environment: ``HYBRIDFLOW_VERL_ALIAS=1``;
- for a script: ``python -m hybridflow.verl_compat my_recipe.py [args]``.

The alias follows the process tree. ``install()`` sets ``HYBRIDFLOW_VERL_ALIAS=1`` in ``os.environ``,
so every process started afterwards inherits it (spawn, forkserver, ``subprocess``, a Ray cluster
started from here); in each new interpreter the start hook (the one line of
``hybridflow_verl_alias.pth`` in site-packages, written by ``make install`` or
``python -m hybridflow.verl_compat --install-hook`` and shipped in hybridflow's wheel) reads the
variable. Unset, it does nothing; set, it puts a placeholder finder on ``sys.meta_path`` that imports
nothing until the first ``import verl``, then turns the alias on (or steps aside for a real verl). Only
``fork`` children need none of this: they inherit the parent's ``sys.meta_path``.

``install()`` puts a finder at the front of ``sys.meta_path``. It answers for ``verl`` and the
``verl.…`` names in :data:`MODULE_TABLE` (an explicit map, because our layout differs from verl's in
places, e.g. ``verl.tools`` lives under ``hybridflow.workers.rollout.tools``, and verl's one
``agent_loop.py`` is four modules here, searched in order); a ``verl.a.b`` that the table does not
list resolves to ``hybridflow.a.b`` when that module exists, and otherwise is not found.

Each ``verl.X`` is a thin alias module: reading, setting or deleting an attribute on it acts on the
hybridflow module behind it, so ``mock.patch("verl.trainer.ppo.metric_utils.f")`` or rebinding
``verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY`` reaches the code that uses it. Submodules the
import system attaches to an alias stay on the alias, so our own packages never grow verl's names.

A real verl install always wins: if ``import verl`` would find an installed verl, ``install()`` does
nothing, warns (once), and returns False; the start hook decides at the first ``import verl``, when
``sys.path`` is complete, so a verl checkout in the script's folder is found too. With the alias on,
Hydra finds our configs where verl code looks for verl's (:func:`hydra_config_source`). This module
imports only the standard library, and nothing that Python has not loaded at start already.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

ENV_SWITCH = "HYBRIDFLOW_VERL_ALIAS"
ROOT = "verl"
_OFF = ("", "0", "false", "no")  # values of ENV_SWITCH that mean "off"

# verl's module path -> ours. Paths that differ from a plain ``verl.`` -> ``hybridflow.`` swap, and the
# verl modules users import most, are listed here; the test suite checks every target exists. Where
# one verl module is split over several of ours, the entry is a tuple: names are looked up in order
# (the first module is imported with the alias, the others when a name is not found before them).
_LOOP = "hybridflow.workers.rollout.agent_loop"
MODULE_TABLE: dict[str, str | tuple[str, ...]] = {
    "verl.protocol": "hybridflow.protocol",
    "verl.base_config": "hybridflow.utils.config",
    # single controller: verl's base/ package is our package root
    "verl.single_controller": "hybridflow.single_controller",
    "verl.single_controller.base": "hybridflow.single_controller",
    "verl.single_controller.base.decorator": "hybridflow.single_controller.decorator",
    "verl.single_controller.base.worker": "hybridflow.single_controller.worker",
    "verl.single_controller.base.worker_group": "hybridflow.single_controller.base",
    "verl.single_controller.ray": "hybridflow.single_controller.ray",
    "verl.single_controller.ray.base": "hybridflow.single_controller.ray.base",
    # trainer
    "verl.trainer": "hybridflow.trainer",
    "verl.trainer.config": "hybridflow.trainer.config",
    "verl.trainer.config.algorithm": "hybridflow.algorithms.config",
    "verl.trainer.main_ppo": "hybridflow.trainer.main_ppo",
    "verl.trainer.ppo": "hybridflow.trainer.ppo",
    "verl.trainer.ppo.core_algos": "hybridflow.trainer.ppo.core_algos",
    "verl.trainer.ppo.metric_utils": "hybridflow.trainer.ppo.metric_utils",
    "verl.trainer.ppo.ray_trainer": "hybridflow.trainer.ppo.ray_trainer",
    # utils
    "verl.utils": "hybridflow.utils",
    "verl.utils.config": "hybridflow.utils.config",
    "verl.utils.device": "hybridflow.utils.device",
    "verl.utils.flops_counter": "hybridflow.utils.flops_counter",
    "verl.utils.metric": "hybridflow.utils.metric",
    "verl.utils.metric.utils": "hybridflow.utils.metric.utils",
    "verl.utils.model": "hybridflow.utils.model",
    "verl.utils.reward_score": "hybridflow.utils.reward_score",
    "verl.utils.reward_score.gsm8k": "hybridflow.utils.reward_score.gsm8k",
    "verl.utils.reward_score.math_reward": "hybridflow.utils.reward_score.math_reward",
    "verl.utils.reward_score.sandbox_fusion": "hybridflow.utils.reward_score.sandbox_fusion",
    "verl.utils.reward_score.sandbox_fusion.utils": "hybridflow.utils.reward_score.sandbox_fusion.utils",
    "verl.utils.rollout_trace": "hybridflow.utils.rollout_trace",
    "verl.utils.seqlen_balancing": "hybridflow.utils.seqlen_balancing",
    "verl.utils.tensordict_utils": "hybridflow.utils.tensordict_utils",
    "verl.utils.torch_functional": "hybridflow.utils.torch_functional",
    "verl.utils.tracking": "hybridflow.utils.tracking",
    # verl's checkpoint engine (issue 50): our package under workers/
    "verl.checkpoint_engine": "hybridflow.workers.checkpoint_engine",
    "verl.checkpoint_engine.base": "hybridflow.workers.checkpoint_engine.base",
    "verl.checkpoint_engine.nccl_checkpoint_engine": "hybridflow.workers.checkpoint_engine.collective",
    # workers
    "verl.workers": "hybridflow.workers",
    "verl.workers.reward_manager": "hybridflow.workers.reward_manager",
    "verl.workers.reward_manager.registry": "hybridflow.workers.reward_manager.registry",
    "verl.workers.reward_manager.abstract": "hybridflow.workers.reward_manager.abstract",
    "verl.workers.reward_manager.naive": "hybridflow.workers.reward_manager.naive",
    "verl.workers.reward_manager.batch": "hybridflow.workers.reward_manager.batch",
    "verl.workers.reward_manager.dapo": "hybridflow.workers.reward_manager.dapo",
    "verl.workers.reward_manager.prime": "hybridflow.workers.reward_manager.prime",
    "verl.workers.rollout": "hybridflow.workers.rollout",
    "verl.workers.rollout.base": "hybridflow.workers.rollout.base",
    "verl.tools": "hybridflow.workers.rollout.tools",
    "verl.tools.base_tool": "hybridflow.workers.rollout.tools.base_tool",
    "verl.tools.gsm8k_tool": "hybridflow.workers.rollout.tools.gsm8k_tool",
    "verl.tools.schemas": "hybridflow.workers.rollout.tools.schemas",
    "verl.tools.sandbox_fusion_tools": "hybridflow.workers.rollout.tools.sandbox_fusion_tool",
    "verl.tools.search_tool": "hybridflow.workers.rollout.tools.search_tool",
    "verl.tools.utils.search_r1_like_utils": "hybridflow.workers.rollout.tools.search_r1_like_utils",
    # verl's MCP tools (issue 49): verl's mcp_clients/ package is our one mcp_client module
    "verl.tools.mcp_base_tool": "hybridflow.workers.rollout.tools.mcp_base_tool",
    "verl.tools.mcp_search_tool": "hybridflow.workers.rollout.tools.mcp_search_tool",
    "verl.tools.utils.mcp_clients.McpClientManager": "hybridflow.workers.rollout.tools.mcp_client",
    "verl.tools.utils.mcp_clients.utils": "hybridflow.workers.rollout.tools.mcp_client",
    # verl's interactions (issue 49): verl's utils/ package is our registry module
    "verl.interactions": "hybridflow.workers.rollout.interactions",
    "verl.interactions.base": "hybridflow.workers.rollout.interactions.base",
    "verl.interactions.gsm8k_interaction": "hybridflow.workers.rollout.interactions.gsm8k_interaction",
    "verl.interactions.utils": "hybridflow.workers.rollout.interactions.registry",
    "verl.interactions.utils.interaction_registry": "hybridflow.workers.rollout.interactions.registry",
    # verl's agent_loop.py is our base, server_manager, worker and manager modules
    "verl.experimental.agent_loop": (_LOOP, f"{_LOOP}.manager", f"{_LOOP}.worker"),
    "verl.experimental.agent_loop.agent_loop": (
        f"{_LOOP}.base",
        f"{_LOOP}.server_manager",
        f"{_LOOP}.worker",
        f"{_LOOP}.manager",
    ),
    "verl.experimental.agent_loop.single_turn_agent_loop": f"{_LOOP}.single_turn",
    "verl.experimental.agent_loop.tool_agent_loop": f"{_LOOP}.tool_agent",
    # verl's reward loop (issue 35): the package, its managers and their registry
    "verl.experimental.reward_loop": "hybridflow.workers.reward_loop",
    "verl.experimental.reward_loop.reward_loop": "hybridflow.workers.reward_loop.loop",
    "verl.experimental.reward_loop.reward_manager": "hybridflow.workers.reward_loop",
    "verl.experimental.reward_loop.reward_manager.base": "hybridflow.workers.reward_loop.base",
    "verl.experimental.reward_loop.reward_manager.registry": "hybridflow.workers.reward_loop.registry",
    "verl.experimental.reward_loop.reward_manager.naive": "hybridflow.workers.reward_loop.naive",
    "verl.experimental.reward_loop.reward_manager.dapo": "hybridflow.workers.reward_loop.dapo",
    "verl.experimental.reward_loop.reward_manager.limited": "hybridflow.workers.reward_loop.limited",
    "verl.experimental.reward_loop.reward_manager.remote": "hybridflow.workers.reward_loop.remote",
}

# verl packages with no hybridflow module of their own: the alias gives an empty package, so that
# their listed children (``verl.experimental.agent_loop``) import.
EMPTY_PACKAGES = frozenset({"verl.experimental", "verl.tools.utils", "verl.tools.utils.mcp_clients"})

# Attributes an alias keeps for itself (the import system writes them); everything else is forwarded.
_OWN = frozenset(
    {"__name__", "__loader__", "__package__", "__spec__", "__path__", "__file__", "__cached__", "__doc__"}
)


def targets_of(name: str) -> tuple[str, ...]:
    """The hybridflow module(s) behind verl's module ``name``, in lookup order (empty: not aliased,
    or an empty package). ``verl`` itself stands for the ``hybridflow`` package (``verl.DataProto``)."""
    entry = MODULE_TABLE.get(name)
    if entry is not None:
        return (entry,) if isinstance(entry, str) else tuple(entry)
    target = target_of(name)
    return () if target is None else (target,)


def target_of(name: str) -> str | None:
    """The (first) hybridflow module behind verl's module ``name``; ``None``: not aliased, or an
    empty package. A name the table does not list falls back to its mirrored ``hybridflow`` path."""
    if name == ROOT:
        return "hybridflow"
    if name in MODULE_TABLE:
        return targets_of(name)[0]
    if name in EMPTY_PACKAGES or not name.startswith(ROOT + "."):
        return None
    mirrored = "hybridflow" + name[len(ROOT) :]
    try:
        found = importlib.util.find_spec(mirrored)
    except (ImportError, ValueError, AttributeError):
        return None
    return mirrored if found is not None else None


class AliasModule(types.ModuleType):
    """verl's name for a hybridflow module. Attribute reads, writes and deletes act on the hybridflow
    module (``_alias_target``); submodule aliases attached by the import system stay here."""

    def __getattr__(self, name: str):
        target = self.__dict__.get("_alias_target")
        if target is None or name.startswith("_alias"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        try:
            return getattr(target, name)
        except AttributeError:
            pass
        more = self.__dict__.get("_alias_more", ())
        for module_name in more:  # the other modules verl's one module is split into, imported now
            module = importlib.import_module(module_name)
            if hasattr(module, name):
                return getattr(module, name)
        where = ", ".join((target.__name__, *more))
        raise AttributeError(f"module {self.__name__!r} (alias of {where}) has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        target = self.__dict__.get("_alias_target")
        if target is None or name in _OWN or name.startswith("_alias") or isinstance(value, AliasModule):
            super().__setattr__(name, value)
        else:
            setattr(target, name, value)

    def __delattr__(self, name: str) -> None:
        target = self.__dict__.get("_alias_target")
        if name in self.__dict__ or target is None:
            super().__delattr__(name)
        else:
            delattr(target, name)

    def __dir__(self) -> list[str]:
        target = self.__dict__.get("_alias_target")
        return sorted(set(self.__dict__) | set(dir(target) if target is not None else ()))

    def __repr__(self) -> str:
        target = self.__dict__.get("_alias_target")
        return f"<verl alias {self.__name__!r} -> {target.__name__ if target else 'empty package'!r}>"


class _AliasLoader:
    """The loader of every alias module (importlib's Loader protocol; ``importlib.abc`` is not imported
    because it costs more than the whole alias at interpreter start)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> AliasModule:
        module = AliasModule(spec.name)
        names = targets_of(spec.name)
        if names:
            module._alias_target = _import_target(spec.name, names[0])
            module._alias_more = names[1:]
            module.__doc__ = module._alias_target.__doc__
            module.__file__ = getattr(module._alias_target, "__file__", None)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the hybridflow module was imported by :meth:`create_module`."""


def _import_target(verl_name: str, target_name: str) -> types.ModuleType:
    try:
        missing = importlib.util.find_spec(target_name) is None
    except ModuleNotFoundError:
        missing = True
    if missing:
        raise ModuleNotFoundError(
            f"{verl_name} is aliased to {target_name}, which this hybridflow does not have (yet); "
            f"see hybridflow.verl_compat.MODULE_TABLE and docs/coming_from_verl.md",
            name=verl_name,
        )
    return importlib.import_module(target_name)


class VerlAliasFinder:
    """Finds ``verl`` and ``verl.…`` as aliases of hybridflow modules (see the module docstring)."""

    _loader = _AliasLoader()

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        known = fullname == ROOT or fullname in MODULE_TABLE or fullname in EMPTY_PACKAGES
        if not known and target_of(fullname) is None:
            return None
        # Every alias is a package as far as the import system cares, so its listed children import.
        return importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)


_FINDER = VerlAliasFinder()
_WARNED: set[str] = set()  # the real verls this process has warned about (once each)


def real_verl_location() -> str | None:
    """Where an installed verl lives, or None. A directory named ``verl`` without ``__init__.py``
    (a namespace package, e.g. a checkout's config folder) does not count."""
    existing = sys.modules.get(ROOT)
    if existing is not None and not isinstance(existing, AliasModule):
        return getattr(existing, "__file__", None) or repr(existing)
    if is_installed():
        return None
    spec = importlib.util.find_spec(ROOT)
    if spec is None or spec.origin in (None, "namespace"):
        return None
    return spec.origin


def is_installed() -> bool:
    """True while the alias is on in this process (its finder is on ``sys.meta_path``)."""
    return _FINDER in sys.meta_path


def _remove_start_hooks() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "hybridflow_verl_hook", False)]


def install() -> bool:
    """Turn the alias on (idempotent), in this process and, through ``HYBRIDFLOW_VERL_ALIAS=1`` in
    ``os.environ``, in every Python process started from it afterwards. Returns False, with a
    warning (once per process), when a real verl is installed; then the variable is left alone."""
    _remove_start_hooks()
    if not is_installed():
        location = real_verl_location()
        if location is not None:
            if location not in _WARNED:
                _WARNED.add(location)
                warnings.warn(
                    f"hybridflow.verl_compat: a real verl is installed ({location}); the verl alias "
                    "stays off and `import verl` imports that verl.",
                    stacklevel=2,
                )
            return False
        sys.meta_path.insert(0, _FINDER)
    os.environ[ENV_SWITCH] = "1"
    return True


def uninstall() -> None:
    """Turn the alias off, in this process and in the processes it starts from now on (it removes
    ``HYBRIDFLOW_VERL_ALIAS`` from ``os.environ``), and forget the ``verl`` aliases already imported."""
    _remove_start_hooks()
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    os.environ.pop(ENV_SWITCH, None)
    for name in [n for n, m in sys.modules.items() if isinstance(m, AliasModule)]:
        del sys.modules[name]


def install_from_env() -> bool:
    """``install()`` when ``HYBRIDFLOW_VERL_ALIAS`` is set to something other than ``0``/empty."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in _OFF:
        return False
    return install()


# ---------------------------------------------------------------- the start hook (.pth)
PTH_NAME = "hybridflow_verl_alias.pth"

# What the .pth line runs when HYBRIDFLOW_VERL_ALIAS is on. It imports nothing (sys is loaded): the
# placeholder finder waits for the first `import verl`, then leaves sys.meta_path and hands over to
# install(), which sees the complete sys.path (a real verl in the script's folder wins). Returning
# the spec itself (never None after leaving) keeps the import system's walk over sys.meta_path,
# which this call has just shortened, from skipping the next finder.
_HOOK_SOURCE = '''\
import sys


class HybridflowVerlHook:
    """hybridflow's verl alias, armed at interpreter start (hybridflow/verl_compat.py)."""

    hybridflow_verl_hook = True

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "verl" and not name.startswith("verl."):
            return None
        while cls in sys.meta_path:
            sys.meta_path.remove(cls)
        try:
            from hybridflow import verl_compat
        except ImportError:  # hybridflow left this environment: `import verl` goes on as usual
            verl_compat = None
        if verl_compat is not None and verl_compat.install_from_env():
            return verl_compat.VerlAliasFinder().find_spec(name, path, target)
        import importlib.util

        return importlib.util.find_spec(name)


if not any(getattr(f, "hybridflow_verl_hook", False) for f in sys.meta_path):  # lib64 -> lib: read twice
    sys.meta_path.insert(0, HybridflowVerlHook)
'''


def pth_text() -> str:
    """The one line of ``hybridflow_verl_alias.pth`` (``site`` executes a .pth line that starts with
    ``import``). With ``HYBRIDFLOW_VERL_ALIAS`` unset or off it costs one environment lookup."""
    switch_on = f"os.environ.get({ENV_SWITCH!r}, '').strip().lower() not in {_OFF!r}"
    return f"import os; exec({_HOOK_SOURCE!r}, {{}}) if {switch_on} else None\n"


def hook_path(site_dir: str | None = None) -> str:
    """Where the start hook lives: ``site_dir``, by default this interpreter's site-packages."""
    import sysconfig

    return os.path.join(site_dir or sysconfig.get_path("purelib"), PTH_NAME)


def hook_is_current(site_dir: str | None = None) -> bool:
    """True when the start hook is in place and is this version's."""
    try:
        with open(hook_path(site_dir), encoding="utf-8") as f:
            return f.read() == pth_text()
    except OSError:
        return False


def write_hook(site_dir: str | None = None) -> str:
    """Write (or refresh) the start hook into ``site_dir`` (default: this interpreter's
    site-packages); ``make install`` runs this. Returns its path."""
    path = hook_path(site_dir)
    if hook_is_current(site_dir):
        return path
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"no site-packages folder at {os.path.dirname(path)}: name an existing one")
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(pth_text())
        os.replace(partial, path)
    except OSError as error:
        raise PermissionError(
            f"cannot write the verl alias start hook at {path} ({error}); run "
            "`python -m hybridflow.verl_compat --install-hook SITE_PACKAGES_DIR` with a folder you can write"
        ) from error
    return path


def remove_hook(site_dir: str | None = None) -> bool:
    """Delete the start hook; False when there was none."""
    try:
        os.remove(hook_path(site_dir))
    except FileNotFoundError:
        return False
    return True


# ---------------------------------------------------------------- Hydra: verl's config folder
OUR_CONFIG_SOURCE = "pkg://hybridflow.trainer.config"
_VERL_CONFIG_DIR = ["verl", "trainer", "config"]


def hydra_config_source(entry: str) -> str | None:
    """What Hydra should search instead of ``entry`` (a config search path entry), or None to keep it.

    verl's tests and scripts compose ``ppo_trainer`` from verl's own config folder, e.g.
    ``initialize_config_dir(os.path.abspath("verl/trainer/config"))`` from a verl checkout. While the
    alias is on, a ``…/verl/trainer/config`` folder that does not exist, or ``pkg://verl.trainer.config``,
    stands for our configs; a folder that exists (a verl checkout) is kept. hybridflow's Hydra search
    path plugin (``hydra_plugins/hybridflow_searchpath``) applies this to every entry."""
    if not is_installed():
        return None
    if entry.rstrip("/") == "pkg://verl.trainer.config":
        return OUR_CONFIG_SOURCE
    folder = entry[len("file://") :] if entry.startswith("file://") else entry
    if "://" in folder or not folder:
        return None
    parts = os.path.normpath(folder).replace(os.sep, "/").split("/")
    if parts[-3:] != _VERL_CONFIG_DIR or os.path.isdir(folder):
        return None
    return OUR_CONFIG_SOURCE


# ---------------------------------------------------------------- python -m hybridflow.verl_compat
_USAGE = """usage: python -m hybridflow.verl_compat SCRIPT.py [ARGS...]   run a script with the verl alias on
       python -m hybridflow.verl_compat --install-hook [SITE_DIR]  write the start hook (make install does)
       python -m hybridflow.verl_compat --remove-hook [SITE_DIR]   delete it"""


def _run_script(argv: list[str]) -> None:
    """``python -m hybridflow.verl_compat script.py [args]``: run ``script.py`` with the alias on
    (and in the processes it starts); ``--install-hook`` / ``--remove-hook`` manage the start hook."""
    import runpy

    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return
    if not argv:
        raise SystemExit(_USAGE)
    if argv[0] in ("--install-hook", "--remove-hook"):
        if len(argv) > 2:
            raise SystemExit(_USAGE)
        if argv[0] == "--install-hook":
            print(f"hybridflow: verl alias start hook at {write_hook(*argv[1:])}")
        elif not remove_hook(*argv[1:]):
            print(f"hybridflow: no verl alias start hook at {hook_path(*argv[1:])}")
        return
    if not install():
        raise SystemExit("a real verl is installed; run the script with python directly")
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _run_script(sys.argv[1:])
