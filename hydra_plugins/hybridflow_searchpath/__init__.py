"""Lets a user YAML list ``ppo_trainer`` in its Hydra defaults from any directory (as verl users do).

With hybridflow's ``verl`` alias on, verl code that composes from verl's own config folder (a
``verl/trainer/config`` folder that does not exist here, or ``pkg://verl.trainer.config``) gets ours
instead: see :func:`hybridflow.verl_compat.hydra_config_source`.
"""

import sys

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class HybridflowSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        verl_compat = sys.modules.get("hybridflow.verl_compat")  # loaded whenever the alias is on
        if verl_compat is not None:
            for element in search_path.get_path():
                ours = verl_compat.hydra_config_source(element.path)
                if ours is not None:
                    element.path = ours
        search_path.append(provider="hybridflow", path="pkg://hybridflow.trainer.config")
