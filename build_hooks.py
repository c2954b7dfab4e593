"""setuptools hook of hybridflow's build (``[tool.setuptools.cmdclass]`` in pyproject.toml).

``build_py`` also puts ``hybridflow_verl_alias.pth``, the start hook of the ``verl`` alias (see
hybridflow/verl_compat.py), at the top of the wheel: pip installs it into site-packages beside the
package, lists it in the install record and removes it with the package. A wheel built for
``pip install -e`` (PEP 660) gets it too. Where a setuptools version builds editable wheels in a way
this hook does not recognise, it writes nothing; ``make install`` writes the hook in every case
(``python -m hybridflow.verl_compat --install-hook``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _verl_compat():
    """hybridflow/verl_compat.py, loaded by path (it needs only the standard library)."""
    spec = importlib.util.spec_from_file_location(
        "_hybridflow_build_verl_compat", HERE / "hybridflow" / "verl_compat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPy(build_py):
    """setuptools' ``build_py``, plus the verl alias start hook at the top of the wheel."""

    def _hook_folder(self) -> str | None:
        if not getattr(self, "editable_mode", False):
            return self.build_lib
        # PEP 660: setuptools points `install` at the folder it zips into the editable wheel
        # (named after the wheel); anything else is not a folder of this wheel.
        folder = self.get_finalized_command("install").install_lib or ""
        return folder if Path(folder).name.endswith(".whl") and os.path.isdir(folder) else None

    def run(self) -> None:
        super().run()
        folder = self._hook_folder()
        if folder is not None:
            compat = _verl_compat()
            self.mkpath(folder)
            Path(folder, compat.PTH_NAME).write_text(compat.pth_text(), encoding="utf-8")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, _verl_compat().PTH_NAME))
        return outputs
