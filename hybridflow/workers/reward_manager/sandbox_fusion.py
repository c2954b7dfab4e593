"""verl's ``reward_model.sandbox_fusion`` section: the default scorer with a SandboxFusion server bound.

::

    reward_model:
      sandbox_fusion:
        url: http://127.0.0.1:8080/run_code   # null: off
        max_concurrent: 64                    # requests to the server in flight at once
        memory_limit_mb: 1024                 # each test case's memory limit

With a URL and no ``custom_reward_function``, the reward manager's ``compute_score`` is
``default_compute_score`` with ``sandbox_fusion_url``, ``concurrent_semaphore`` and
``memory_limit_mb`` bound, as verl's ``load_reward_manager`` builds it; rows of the code data sources
(``codecontests``, ``apps``, ``codeforces``, ``taco``) then run their test cases on that server, other
rows score as before. verl's semaphore is one ``multiprocessing.Manager`` semaphore shared by every
process; here each process that scores (the trainer, a ``prime`` manager's workers) holds its own of
``max_concurrent``.
"""

from __future__ import annotations

import threading
from typing import Any

from hybridflow.utils.reward_score import default_compute_score


def _get(section: Any, key: str, default: Any = None) -> Any:
    if section is None:
        return default
    value = section.get(key, default) if hasattr(section, "get") else getattr(section, key, default)
    return default if value is None else value


class SandboxFusionComputeScore:
    """``default_compute_score`` with the server bound; pickles as its settings (the semaphore is made
    again in each process, at its first call)."""

    def __init__(self, url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024) -> None:
        if int(max_concurrent) < 1:
            raise ValueError(f"reward_model.sandbox_fusion.max_concurrent must be >= 1, got {max_concurrent}")
        self.url, self.max_concurrent, self.memory_limit_mb = (
            str(url),
            int(max_concurrent),
            int(memory_limit_mb),
        )
        self._semaphore: threading.BoundedSemaphore | None = None
        self._lock = threading.Lock()

    def semaphore(self) -> threading.BoundedSemaphore:
        with self._lock:
            if self._semaphore is None:
                self._semaphore = threading.BoundedSemaphore(self.max_concurrent)
            return self._semaphore

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return default_compute_score(
            data_source,
            solution_str,
            ground_truth,
            extra_info,
            sandbox_fusion_url=self.url,
            concurrent_semaphore=self.semaphore(),
            memory_limit_mb=self.memory_limit_mb,
            **kwargs,
        )

    def __getstate__(self) -> dict:
        return {
            "url": self.url,
            "max_concurrent": self.max_concurrent,
            "memory_limit_mb": self.memory_limit_mb,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["max_concurrent"], state["memory_limit_mb"])

    def __repr__(self) -> str:
        return f"SandboxFusionComputeScore({self.url!r}, max_concurrent={self.max_concurrent})"


def sandbox_fusion_compute_score(reward_model_cfg: Any) -> SandboxFusionComputeScore | None:
    """The bound scorer when ``reward_model.sandbox_fusion.url`` is set, else None."""
    section = _get(reward_model_cfg, "sandbox_fusion")
    url = _get(section, "url")
    if not url:
        return None
    return SandboxFusionComputeScore(
        url, _get(section, "max_concurrent", 64), _get(section, "memory_limit_mb", 1024)
    )
