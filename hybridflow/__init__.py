"""hybridflow: HybridFlow-style RL post-training of LLMs (single controller over SPMD worker groups).

Importing the package is cheap: heavy modules (torch, Ray, transformers) load when their submodule
is imported, e.g. ``from hybridflow.protocol import DataProto``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("DataProto", "DataProtoFuture"):
        from hybridflow import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
