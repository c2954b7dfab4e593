"""The documentation's links, named files and commands point at things that exist (issue 46).

Walks ``README.md``, ``docs/*.md`` and ``examples/*/README.md`` and fails naming ``file:line`` for:

- a relative link ``[text](path)`` whose target is not in the repository, or whose ``#anchor`` is not
  the GitHub slug of a heading of the target file (or of the file itself for ``(#anchor)``);
- a repository path written in backticks (``hybridflow/...py``, ``docs/...md``, ``scripts/...``, ...)
  that does not exist, and a module run with ``python -m hybridflow...`` that does not exist;
- a ``~`` right after ``key=`` in a Hydra override (``data.train_files=~/...``): bash does not expand it
  there and Hydra's parser rejects it (``LexerNoViableAltException``): write ``$HOME/...``;
- a path into ``../shared/``, a folder beside this repository that a clone does not have.

Text only, no imports of the package: well under a second.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")])

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")  # [text](target), not images
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# Top-level folders and files of the repository a doc may name in backticks.
REPO_PREFIXES = ("hybridflow/", "docs/", "scripts/", "examples/", "tests/", "benchmarks/", "hydra_plugins/")
REPO_FILES = {"README.md", "Makefile", "pyproject.toml", "constraints.txt", "MANIFEST.in", "build_hooks.py"}
# A Hydra override whose value starts with ~ (the key has a dot, or is a +/++ addition).
TILDE_OVERRIDE = re.compile(r"(?<![\w$])(\+{0,2}[A-Za-z_][\w-]*(?:\.[\w-]+)+)=~")
PYTHON_M = re.compile(r"python3?\s+-m\s+(hybridflow(?:\.\w+)*)")
SHARED = re.compile(r"\.\./shared/")
# Names that look like repository paths but are not ours, with the reason.
NOT_OURS = {
    "docs/advance/async-on-policy-distill.md": "verl's documentation",
    "hybridflow/actor_rollout": "a worker group's name, quoted from an error message",
}


@functools.cache
def _verl_test_paths(root: Path) -> set[str]:
    """verl's own paths of the test files vendored in tests/verl_compat/verl_tests (its README's table)."""
    table = root / "tests" / "verl_compat" / "verl_tests" / "README.md"
    if not table.is_file():
        return set()
    return set(re.findall(r"^\| `[^`]+` \| `(tests/[^`]+)` \|", table.read_text(encoding="utf-8"), re.M))


def _lines(path: Path) -> list[tuple[int, str, bool]]:
    """``(line number, text, inside a fenced code block)`` for every line of ``path``."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append((number, line, True))
            continue
        out.append((number, line, fenced))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation removed (word
    characters, hyphens and spaces kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](link) -> text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of ``path``, repeated headings numbered as GitHub does (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line, fenced in _lines(path):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        slug = github_slug(match.group(2))
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _check_link(doc: Path, target: str, cache: dict[Path, set[str]]) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    dest = (doc.parent / path_part).resolve() if path_part else doc
    if not dest.exists():
        return f"link to a missing file: {target}"
    if ROOT not in dest.parents and dest != ROOT:
        return f"link outside the repository: {target}"
    if anchor and dest.suffix == ".md":
        if dest not in cache:
            cache[dest] = anchors(dest)
        if anchor not in cache[dest]:
            return (
                f"link to a missing heading: {target} (no heading of {dest.relative_to(ROOT)} has that slug)"
            )
    return None


def _repo_path_problem(token: str) -> str | None:
    token = token.strip("'\",;()").rstrip(".:")
    token = re.sub(r"::.*$", "", token)  # a pytest node id: tests/x.py::test_y
    token = re.sub(r":\d+(-\d+)?$", "", token)  # file.py:12 or file.py:12-20
    if not (token.startswith(REPO_PREFIXES) or token in REPO_FILES):
        return None
    if token in NOT_OURS or token in _verl_test_paths(ROOT):
        return None
    if any(ch in token for ch in "*<>{}[]$|") or "..." in token or "=" in token:
        return None  # a pattern or a placeholder, not a file name
    if token.startswith(("hybridflow/", "tests/", "benchmarks/", "scripts/", "examples/", "docs/")):
        last = token.rstrip("/").rsplit("/", 1)[-1]
        if last.isupper() or last in {"N", "DIR", "OUT", "X"}:
            return None  # a placeholder such as examples/DIR
    if not (ROOT / token).exists():
        return f"names a repository path that does not exist: {token}"
    return None


def _module_problem(module: str) -> str | None:
    base = ROOT / module.replace(".", "/")
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return None
    return f"`python -m {module}`: no such module file ({module.replace('.', '/')}.py)"


def problems_in(doc: Path) -> list[str]:
    where = doc.relative_to(ROOT)
    found, cache = [], {}
    for number, line, fenced in _lines(doc):
        spans = [m.group(2) for m in INLINE_CODE.finditer(line)] if not fenced else []
        checks = []
        if not fenced:
            prose = INLINE_CODE.sub("", line)
            checks += [_check_link(doc, m.group(1), cache) for m in LINK.finditer(prose)]
            checks += [_repo_path_problem(token) for span in spans for token in span.split()]
        checks += [
            f"`~` after `{m.group(1)}=`: bash leaves it unexpanded and Hydra rejects it; write $HOME/..."
            for m in TILDE_OVERRIDE.finditer(line)
        ]
        checks += [_module_problem(m.group(1)) for m in PYTHON_M.finditer(line)]
        if SHARED.search(line):
            checks.append("points into ../shared/, a folder beside this repository that a clone lacks")
        found += [f"{where}:{number}: {problem}" for problem in checks if problem]
    return found


def test_the_docs_are_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {"README.md", "docs/configuration.md", "docs/gpu.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_paths_and_overrides(doc: Path):
    problems = problems_in(doc)
    assert not problems, "\n".join(problems)


def test_the_checker_catches_each_mistake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each kind of mistake is reported with its file and line (the checker is not vacuous)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## A heading: with `code` (and more)\n")
    doc = tmp_path / "docs" / "a.md"
    doc.write_text(
        "# A\n"
        "[ok](b.md#a-heading-with-code-and-more) [ok too](#a) [web](https://example.com/x#y)\n"
        "[gone](missing.md)\n"
        "[bad anchor](b.md#nope)\n"
        "see `docs/b.md` and `docs/nothing.md`\n"
        "```bash\n"
        "python -m hybridflow.trainer.main_ppo data.train_files=~/data/x.parquet\n"
        "python -m hybridflow.no_such_module --out $HOME/x\n"
        "```\n"
        "data in `../shared/data`\n"
    )
    (tmp_path / "hybridflow" / "trainer").mkdir(parents=True)
    (tmp_path / "hybridflow" / "trainer" / "main_ppo.py").write_text("")
    found = problems_in(doc)
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "7", "8", "10"], found
    assert "missing.md" in found[0] and "#nope" in found[1] and "docs/nothing.md" in found[2]
    assert "data.train_files=" in found[3] and "no_such_module" in found[4] and "shared" in found[5]


def test_github_slugs():
    assert github_slug("Tensor parallelism: the 3D-HybridEngine (HybridFlow §5)") == (
        "tensor-parallelism-the-3d-hybridengine-hybridflow-5"
    )
    assert (
        github_slug("Speed against TRL (same CPU, same assets)") == "speed-against-trl-same-cpu-same-assets"
    )
    assert github_slug("The OpenAI server (`python -m hybridflow.serve`)") == (
        "the-openai-server-python--m-hybridflowserve"
    )


def test_the_architecture_page_names_every_room_of_the_floors_contract():
    """docs/architecture.md's floors block names every module of pyproject.toml's layers contracts."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    rooms = {
        name.strip().strip("()")
        for contract in contracts
        for layer in contract["layers"]
        for name in re.split(r"[|:]", layer)
    }
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    floors = page[page.index("## The floors") :]
    block = floors[floors.index("```") : floors.index("```", floors.index("```") + 3)]
    missing = sorted(room for room in rooms if not re.search(rf"(?<![\w/]){re.escape(room)}\b", block))
    assert not missing, (
        f"docs/architecture.md's floors block lacks {missing} (pyproject.toml [tool.importlinter])"
    )
