"""What one engine step does on the device, seen from the CPU: aten ops and host reads.

:func:`profile_step` runs one :meth:`LLMEngine.step` under :class:`OpCounter`, a
``TorchDispatchMode`` that counts every aten op dispatched (a CUDA graph replay dispatches none) and
the ops that make the host wait for the device: ``aten._local_scalar_dense`` (``.item()``,
``int(tensor)``) and copies from a device tensor to the CPU. ``.tolist()`` of a CPU tensor dispatches
nothing, so the engine also counts its own read backs (``stats["host_reads"]``: one per decode step,
one per burst). On a GPU each op is at least one kernel launch, so the op count is the launch count a
graph removes; on the CPU it is the step's structure.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class OpCounter(TorchDispatchMode):
    """``ops``: aten op name -> calls; ``device_reads``: ops that wait for the device (see module)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.device_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        if func is _SCALAR_READ or _copies_to_host(func, args, kwargs):
            self.device_reads += 1
        return func(*args, **kwargs)


def _copies_to_host(func, args, kwargs) -> bool:
    """A copy of a non-CPU tensor into CPU memory (``.cpu()``, ``.to("cpu")``, ``copy_``)."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        device = kwargs.get("device")
        return bool(args) and args[0].device.type != "cpu" and device is not None and device.type == "cpu"
    if name == "copy_":
        return len(args) > 1 and args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def profile_step(engine, top: int = 12) -> dict:
    """One ``engine.step()`` counted: ``{"aten_ops", "device_reads", "host_reads", "decode_steps",
    "graph_replays", "ops_per_decode_step", "top_ops"}`` (the ``top`` most called ops)."""
    before = dict(engine.stats)
    counter = OpCounter()
    with counter:
        engine.step()
    decode_steps = engine.stats["decode_steps"] - before["decode_steps"]
    total = sum(counter.ops.values())
    return {
        "aten_ops": total,
        "device_reads": counter.device_reads,
        "host_reads": engine.stats["host_reads"] - before["host_reads"],
        "decode_steps": decode_steps,
        "graph_replays": engine.stats["graph_replays"] - before.get("graph_replays", 0),
        "ops_per_decode_step": round(total / max(1, decode_steps), 1),
        "top_ops": dict(counter.ops.most_common(top)),
    }
