"""How hybridflow starts a Ray instance of its own on this machine.

Ray prestarts one idle Python worker per logical CPU when the first driver connects
(``prestart_worker_first_driver``). hybridflow's roles are actors started with their own environment
(threads, device variables), which Ray never places in those prestarted workers: they are imported,
wait idle and are killed at shutdown. Measured 2026-11-26 on a 2-core AVX2 CPU: ``ray.init(num_cpus=4)``
costs 8.5 CPU-seconds with them and 6.5 without, and they compete with the roles' own start.
"""

from __future__ import annotations

# ``_system_config`` of every Ray instance hybridflow starts (``ray.init(address="local")`` and the
# head of ``python -m hybridflow.placement.local_cluster``); joining a running cluster keeps its own.
LOCAL_RAY_SYSTEM_CONFIG: dict = {"prestart_worker_first_driver": False}
