"""Colocated roles: several worker classes living in one Ray actor process.

HybridFlow places e.g. actor + rollout + reference (or critic + reward model) in the same process so
they share the devices and can hand tensors to each other without copies. The combined class holds
one instance per role and exposes each role's registered methods as ``<role>_<method>``;
``RayWorkerGroup.spawn(roles)`` then gives one group view per role with the plain method names.
"""

from __future__ import annotations

from hybridflow.single_controller.base import ClassWithInitArgs
from hybridflow.single_controller.decorator import MAGIC_ATTR, RegisterSpec, registered_methods
from hybridflow.single_controller.ray.base import RayClassWithInitArgs
from hybridflow.single_controller.worker import Worker


def _role_proxy(role: str, method: str, spec: RegisterSpec):
    def proxy(self, *args, **kwargs):
        return getattr(self.worker_dict[role], method)(*args, **kwargs)

    proxy.__name__ = f"{role}_{method}"
    setattr(proxy, MAGIC_ATTR, spec)
    return proxy


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class that constructs every ``class_dict[role]`` in its own process."""
    attrs: dict = {}
    role_methods: dict[str, dict[str, str]] = {}
    for role, cls_with_init in class_dict.items():
        role_methods[role] = {}
        for method, spec in registered_methods(cls_with_init.cls).items():
            remote_name = f"{role}_{method}"
            attrs[remote_name] = _role_proxy(role, method, spec)
            role_methods[role][method] = remote_name
    inits = {role: (c.cls, c.args, c.kwargs) for role, c in class_dict.items()}

    def __init__(self):
        Worker.__init__(self)
        self.worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in inits.items()}

    def query_dispatch_info(self, mesh_name: str, role: str | None = None):
        owner = self.worker_dict[role] if role is not None else self
        return Worker.query_dispatch_info(owner, mesh_name)

    attrs.update(__init__=__init__, query_dispatch_info=query_dispatch_info, role_methods=role_methods)
    name = "Colocated_" + "_".join(class_dict)
    return RayClassWithInitArgs(type(name, (Worker,), attrs))
