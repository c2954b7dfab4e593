"""hybridflow: HybridFlow-style RL post-training of LLMs (single controller over SPMD worker groups).

Importing the package is cheap: heavy modules (torch, Ray, transformers) load when their submodule
is imported, e.g. ``from hybridflow.protocol import DataProto``. With ``HYBRIDFLOW_VERL_ALIAS=1`` in
the environment, importing the package also turns on the ``verl`` alias (:mod:`hybridflow.verl_compat`).
"""

import os as _os

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("DataProto", "DataProtoFuture"):
        from hybridflow import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


if _os.environ.get("HYBRIDFLOW_VERL_ALIAS"):
    from hybridflow.verl_compat import install_from_env as _install_verl_alias

    _install_verl_alias()
