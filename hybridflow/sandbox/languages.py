"""How the server builds and runs each language, and which of them this machine can run.

A :class:`Language` names the file the code is written to (in the run's directory, ``/sandbox``), an
optional compile command and the run command. ``PYTHON`` in a command stands for the interpreter the
sandbox runs (the server's own Python, the only one certain to be visible inside it). A language is
available when every tool its commands name resolves, on this machine, to a file under a directory
the sandbox shows (``/usr``, ``/bin``, ``/lib``...): a compiler under ``/opt`` or ``~`` would exist on
the host but not inside the sandbox, so it does not count. :func:`unavailable_reason` says why a
language cannot run, naming it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from hybridflow.sandbox.api import SANDBOX_FUSION_LANGUAGES

PYTHON = "<python>"  # replaced inside the sandbox by the interpreter's real path
# host directories the sandbox binds read-only (hybridflow.utils._sandbox_child)
VISIBLE_PREFIXES = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/")


@dataclass(frozen=True)
class Language:
    """``source``: the file name the code is written to; ``compile``/``run``: argv lists (``None``: no
    compile step); the tools are the first word of each command."""

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None

    @property
    def tools(self) -> tuple[str, ...]:
        commands = [self.run] + ([self.compile] if self.compile else [])
        return tuple(command[0] for command in commands if command[0] != PYTHON and "/" not in command[0])


LANGUAGES: dict[str, Language] = {
    language.name: language
    for language in (
        Language("python", "main.py", (PYTHON, "main.py")),
        Language("bash", "main.sh", ("bash", "main.sh")),
        Language(
            "cpp", "main.cpp", ("./main",), ("g++", "-std=c++17", "-O2", "-pthread", "main.cpp", "-o", "main")
        ),
    )
}


def tool_path(tool: str) -> str | None:
    """The real path of ``tool`` on this machine if the sandbox can see it, else None."""
    found = shutil.which(tool)
    if found is None:
        return None
    real = os.path.realpath(found)
    return real if real.startswith(VISIBLE_PREFIXES) else None


def unavailable_reason(name: str) -> str | None:
    """Why this server cannot run language ``name`` (None: it can)."""
    language = LANGUAGES.get(name)
    if language is None:
        known = (
            "a SandboxFusion language this server does not run"
            if name in SANDBOX_FUSION_LANGUAGES
            else ("not a SandboxFusion language")
        )
        return f"language {name!r} is {known}; this server runs: {', '.join(available_languages())}"
    missing = [tool for tool in language.tools if tool_path(tool) is None]
    if missing:
        return (
            f"language {name!r} needs {', '.join(missing)}, which this machine does not have where the "
            f"sandbox can see it (under {', '.join(p.rstrip('/') for p in VISIBLE_PREFIXES[:3])}, ...)"
        )
    return None


def available_languages() -> list[str]:
    """The languages this machine can run, sorted."""
    return sorted(name for name, language in LANGUAGES.items() if all(tool_path(t) for t in language.tools))


def commands_for(language: Language) -> tuple[list[str] | None, list[str]]:
    """``(compile argv or None, run argv)`` with each tool resolved to its real path (the sandbox has no
    /etc/alternatives, so a link through it would not resolve inside)."""

    def resolve(command: tuple[str, ...]) -> list[str]:
        head = command[0]
        if head != PYTHON and "/" not in head:
            head = tool_path(head) or head
        return [head, *command[1:]]

    return (resolve(language.compile) if language.compile else None), resolve(language.run)
