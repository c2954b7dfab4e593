"""The manifest of a trainer checkpoint: what ``global_step_N`` holds, so that a resume tells a complete
step from a damaged one by reading sizes and a few bytes, never by loading it.

    global_step_N/checkpoint_manifest.json
      {"format": 1, "step": N, "complete": true,
       "hash": "sha256 of the whole file up to 8 MiB, else of its first and last 1 MiB",
       "files": {"actor/model/__0_0.distcp": {"size": 1630, "sha256": "..."}, "data.pt": {...}, ...},
       "pruned": ["critic"]}

Save order (``TrainerCheckpointer.save``): :func:`begin_manifest` first replaces any manifest of step N by
``{"complete": false}``; the workers write their directories (every rank has returned when the driver's
call returns); the driver writes ``data.pt``; then :func:`write_manifest` lists every file on disk with
its size and hash (temp file + ``os.replace``), and only then does the tracker move. A step whose save
stopped anywhere on the way is marked incomplete, or has no manifest at all if it stopped before that.

:func:`check_step` compares a step directory with its manifest: a missing file, a size that differs
(truncated), a hash that differs, a file that cannot be read, a manifest that cannot be parsed or says
the save did not finish, or a role the resume needs that ``max_*_ckpt_to_keep`` removed. Sizes catch a
truncated shard; the hash catches a rewritten small file (``data.pt``, DCP's ``.metadata``, RNG states)
in full and a large shard's first and last MiB (the zip directory of a ``.pt``, a DCP file's ends).

A step saved before manifests existed (*legacy*) is checked for what can be checked without one: the
parts are there (``data.pt``, each role's ``checkpoint_meta.json``), every DCP shard is as long as its
``.metadata`` says its tensors reach, and each ``.pt`` file is a whole zip archive. It is resumed from
when that holds, and the resume says it had no manifest.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import tempfile
import zipfile

MANIFEST_FILE = "checkpoint_manifest.json"
FORMAT = 1
WHOLE_HASH_BYTES = 8 * 2**20  # files up to this size are hashed whole
END_HASH_BYTES = 2**20  # larger ones: their first and last MiB
HASH_NOTE = "sha256 of the whole file up to 8 MiB, else of its first and last 1 MiB"
ROLES = ("actor", "critic")
_DCP_DIRS = {"model": "model", "optimizer": "optim"}  # checkpoint_meta.json's contents -> DCP directory
_SKIPPED_SUFFIXES = (".tmp", ".old")  # a save's temporary parts: never part of a checkpoint


class CheckpointDamagedError(RuntimeError):
    """No checkpoint to resume from is complete (one line: which step, which file, what is wrong)."""


@dataclasses.dataclass(frozen=True)
class Damage:
    """One thing wrong with a step: ``file`` relative to the step directory, ``what`` is wrong with it."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}" if self.file else self.what


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """What :func:`check_step` found in one step directory (``damage`` empty: complete)."""

    path: str
    step: int | None
    damage: tuple[Damage, ...]
    legacy: bool  # no manifest: saved before hybridflow wrote one

    @property
    def complete(self) -> bool:
        return not self.damage

    def name(self) -> str:
        return f"step {self.step} ({self.path})" if self.step is not None else self.path

    def describe(self) -> str:
        """``step 4 (/ckpt/global_step_4): actor/model/__0_0.distcp: 812 bytes, the manifest says ...``."""
        return f"{self.name()}: " + "; ".join(map(str, self.damage))

    def legacy_note(self) -> str:
        return (
            f"checkpoint {self.name()} has no {MANIFEST_FILE} (saved before hybridflow wrote one): checked "
            "only that its parts exist, its DCP shards are as long as their metadata says and its .pt "
            "files are whole"
        )


# ---------------------------------------------------------------------------------------- writing
def atomic_write(path: str, write_fn) -> None:
    """Call ``write_fn(binary file)`` on a temp file next to ``path``, fsync it, then rename onto ``path``
    (a reader sees the old file or the whole new one, never a part)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _atomic_json(path: str, obj: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def file_hash(path: str, size: int) -> str:
    """sha256 of the file, or of its first and last ``END_HASH_BYTES`` when over ``WHOLE_HASH_BYTES``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
        else:
            digest.update(f.read(END_HASH_BYTES))
            f.seek(size - END_HASH_BYTES)
            digest.update(f.read(END_HASH_BYTES))
    return digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
    """Every file of the step, relative and sorted, without the manifest and a save's temporary parts."""
    found = []
    for dirpath, dirnames, files in os.walk(step_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.endswith(_SKIPPED_SUFFIXES))
        for name in files:
            if name == MANIFEST_FILE or name.endswith(_SKIPPED_SUFFIXES):
                continue
            found.append(os.path.relpath(os.path.join(dirpath, name), step_dir).replace(os.sep, "/"))
    return sorted(found)


def begin_manifest(step_dir: str, step: int) -> None:
    """Before any part of step N is written: mark the step incomplete (a re-save of an existing step
    mixes old and new files until it ends)."""
    _atomic_json(
        os.path.join(step_dir, MANIFEST_FILE), {"format": FORMAT, "step": int(step), "complete": False}
    )


def write_manifest(step_dir: str, step: int) -> dict:
    """After every part of step N is on disk (every worker returned, ``data.pt`` written): record each
    file's size and hash; returns the manifest."""
    files = {}
    for rel in _step_files(step_dir):
        size = os.path.getsize(os.path.join(step_dir, rel))
        files[rel] = {"size": size, "sha256": file_hash(os.path.join(step_dir, rel), size)}
    manifest = {"format": FORMAT, "step": int(step), "complete": True, "hash": HASH_NOTE, "files": files}
    _atomic_json(os.path.join(step_dir, MANIFEST_FILE), manifest)
    return manifest


def read_manifest(step_dir: str) -> dict | None:
    """The step's manifest; None without one; ValueError naming the file when it cannot be parsed."""
    path = os.path.join(step_dir, MANIFEST_FILE)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise ValueError("unreadable (not a hybridflow checkpoint manifest)")
    return manifest


def record_pruned_role(step_dir: str, role: str) -> None:
    """After ``max_{role}_ckpt_to_keep`` removed ``step_dir/role``: drop its files from the manifest and
    say it was pruned (a step without a manifest is left so)."""
    try:
        manifest = read_manifest(step_dir)
    except ValueError:
        return
    if manifest is None:
        return
    manifest["files"] = {k: v for k, v in manifest.get("files", {}).items() if not k.startswith(role + "/")}
    manifest["pruned"] = sorted({*manifest.get("pruned", []), role})
    _atomic_json(os.path.join(step_dir, MANIFEST_FILE), manifest)


# ---------------------------------------------------------------------------------------- checking
def _file_damage(step_dir: str, rel: str, entry: dict) -> Damage | None:
    path = os.path.join(step_dir, rel)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return Damage(rel, "missing")
    except OSError as err:
        return Damage(rel, f"unreadable ({type(err).__name__}: {err.strerror or err})")
    want = int(entry.get("size", -1))
    if size != want:
        how = "truncated" if size < want else "longer than saved"
        return Damage(rel, f"{size} bytes, the manifest says {want} ({how})")
    if "sha256" in entry:
        try:
            digest = file_hash(path, size)
        except OSError as err:
            return Damage(rel, f"unreadable ({type(err).__name__}: {err.strerror or err})")
        if digest != entry["sha256"]:
            return Damage(rel, "its content differs from the manifest's sha256 (the file was changed)")
    return None


def _manifest_damage(step_dir: str, manifest: dict, roles) -> list[Damage]:
    if not manifest.get("complete", False):
        return [Damage(MANIFEST_FILE, "marked incomplete: the save of this step did not finish")]
    damage = [
        d for rel, entry in sorted(manifest["files"].items()) if (d := _file_damage(step_dir, rel, entry))
    ]
    for role in roles:
        if role in manifest.get("pruned", []):
            damage.append(Damage(role, f"removed by trainer.max_{role}_ckpt_to_keep"))
        elif not any(rel.startswith(role + "/") for rel in manifest["files"]):
            damage.append(Damage(role, "not in this checkpoint"))
    return damage


def _zip_damage(step_dir: str, rel: str) -> Damage | None:
    """A torch.save file is a zip archive: its directory sits at the end, so a cut file fails here."""
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
        return Damage(rel, "missing")
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
    except (OSError, zipfile.BadZipFile) as err:
        return Damage(rel, f"not a whole torch.save file ({type(err).__name__}: {err})")
    size = os.path.getsize(path)
    return None if end <= size else Damage(rel, f"{size} bytes, its zip directory says {end} (truncated)")


def _dcp_damage(step_dir: str, rel_dir: str) -> list[Damage]:
    """Each shard of a DCP directory at least as long as the last byte ``.metadata`` says it holds."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = os.path.join(step_dir, rel_dir)
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except FileNotFoundError:
        return [Damage(f"{rel_dir}/.metadata", "missing")]
    except Exception as err:  # a pickle cut short raises anything from EOFError to UnpicklingError
        return [Damage(f"{rel_dir}/.metadata", f"unreadable ({type(err).__name__}: {err})")]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    damage = []
    for name, end in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            damage.append(Damage(f"{rel_dir}/{name}", "missing"))
        elif (size := os.path.getsize(path)) < end:
            damage.append(
                Damage(f"{rel_dir}/{name}", f"{size} bytes, its DCP metadata needs {end} (truncated)")
            )
    return damage


def _legacy_damage(step_dir: str, roles) -> list[Damage]:
    """The checks a step without a manifest allows (see the module doc)."""
    damage = [d for d in [_zip_damage(step_dir, "data.pt")] if d]
    present = [r for r in ROLES if os.path.isdir(os.path.join(step_dir, r))]
    for role in dict.fromkeys([*roles, *present]):  # the needed ones first, each once
        meta_path = os.path.join(step_dir, role, "checkpoint_meta.json")
        if not os.path.isdir(os.path.join(step_dir, role)):
            damage.append(Damage(role, "missing"))
            continue
        try:
            with open(meta_path) as f:
                contents = json.load(f)["contents"]
        except FileNotFoundError:
            damage.append(Damage(f"{role}/checkpoint_meta.json", "missing (the save did not finish)"))
            continue
        except (OSError, ValueError, KeyError, TypeError) as err:
            damage.append(Damage(f"{role}/checkpoint_meta.json", f"unreadable ({type(err).__name__}: {err})"))
            continue
        for content, sub in _DCP_DIRS.items():
            if content in contents:
                damage += _dcp_damage(step_dir, f"{role}/{sub}")
        if "extra" in contents:
            extras = sorted(glob.glob(os.path.join(step_dir, role, "extra_state_rank_*.pt")))
            if not extras:
                damage.append(Damage(f"{role}/extra_state_rank_0.pt", "missing"))
            for path in extras:
                damage += [d for d in [_zip_damage(step_dir, os.path.relpath(path, step_dir))] if d]
    return damage


def check_step(step_dir: str, roles=(), step: int | None = None) -> StepCheck:
    """Compare ``step_dir`` with its manifest (or, without one, the legacy checks); ``roles`` are the
    worker directories the resume needs (``actor``, ``critic``). Reads sizes and hashes, loads nothing."""
    roles = tuple(roles)
    if not os.path.isdir(step_dir):
        return StepCheck(step_dir, step, (Damage("", "the directory does not exist"),), False)
    try:
        manifest = read_manifest(step_dir)
    except ValueError as err:
        return StepCheck(step_dir, step, (Damage(MANIFEST_FILE, str(err)),), False)
    if manifest is None:
        return StepCheck(step_dir, step, tuple(_legacy_damage(step_dir, roles)), True)
    return StepCheck(step_dir, step, tuple(_manifest_damage(step_dir, manifest, roles)), False)


def manifest_shows_damage(step_dir: str) -> bool:
    """Whether the step's manifest shows a file damaged, says the save did not finish, or cannot be read.
    For pruning: a step without a manifest counts as whole, as before manifests."""
    try:
        manifest = read_manifest(step_dir)
    except ValueError:
        return True
    if manifest is None:
        return False
    if not manifest.get("complete", False):
        return True
    return any(_file_damage(step_dir, rel, entry) for rel, entry in manifest["files"].items())
