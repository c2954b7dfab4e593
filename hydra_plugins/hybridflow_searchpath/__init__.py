"""Lets a user YAML list ``ppo_trainer`` in its Hydra defaults from any directory (as verl users do)."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class HybridflowSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="hybridflow", path="pkg://hybridflow.trainer.config")
