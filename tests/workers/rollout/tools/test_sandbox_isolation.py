"""Escapes from the Python sandbox, each tried for real: the code attempts it, and the test checks both
what the code saw and, where the host could be touched, the host itself afterwards."""

import asyncio
import json
import os
import secrets
import socket
import stat
import subprocess
import sys

import pytest

from hybridflow.utils.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.usefixtures("sandbox_available")
AS_ROOT = os.geteuid() == 0

# The code records each attempt as "ok: <value>" or "refused: <exception>" and prints them as JSON.
# File operations go straight to libc, past any Python-level guard, as an attacker's would.
PRELUDE = """
import ctypes, json, os
results = {}
libc = ctypes.CDLL(None, use_errno=True)
def attempt(label, action):
    try:
        results[label] = "ok: " + repr(action())[:300]
    except Exception as error:
        results[label] = "refused: " + type(error).__name__ + ": " + str(error)[:300]
def raw(name, *args):
    args = [a.encode() if isinstance(a, str) else a for a in args]
    result = getattr(libc, name)(*args)
    if result == -1:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return result
def raw_read(path):
    fd, buffer = raw("open", path, os.O_RDONLY), ctypes.create_string_buffer(65536)
    try:
        size = raw("read", fd, buffer, 65536)
        return buffer.raw[:size]
    finally:
        libc.close(fd)
def raw_write(path, data=b"sandbox"):
    fd = raw("open", path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return raw("write", fd, data, len(data))
    finally:
        libc.close(fd)
"""


SANDBOX_TOP_LEVEL = set("bin dev etc lib lib32 lib64 libx32 proc sandbox sbin tmp usr var".split())


def attempts(body: str, **limits) -> tuple[dict, object]:
    code = PRELUDE + body + "\nprint(json.dumps(results))\n"
    result = asyncio.run(run_python(code, SandboxLimits(wall_timeout_s=10.0, cpu_time_s=10, **limits)))
    assert result.exit_code == 0 and result.killed_reason is None, result
    return json.loads(result.stdout), result


def assert_refused(results: dict, *labels: str) -> None:
    for label in labels:
        assert results[label].startswith("refused"), f"{label}: {results[label]}"


def test_host_files_cannot_be_read_or_listed(tmp_path):
    token = secrets.token_hex(8)
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    secret.chmod(0o600)  # a 0600 file of the test's user (root in CI)
    body = f"""
attempt("shadow", lambda: raw_read("/etc/shadow"))
attempt("secret", lambda: raw_read({str(secret)!r}))
attempt("bashrc", lambda: raw_read("/root/.bashrc"))
attempt("home", lambda: os.listdir("/home"))
attempt("proc_init_environ", lambda: raw_read("/proc/1/environ"))
results["root"] = os.listdir("/root") if os.path.isdir("/root") else []
results["top"] = os.listdir("/")
results["etc"] = os.listdir("/etc")
"""
    results, result = attempts(body)
    assert_refused(results, "shadow", "secret", "bashrc", "home", "proc_init_environ")
    # /root exists only as the path to an interpreter living under it (pyenv here): nothing else in it
    prefix_parts = os.path.realpath(sys.base_prefix).split(os.sep)
    assert results["root"] == ([prefix_parts[2]] if prefix_parts[1] == "root" else [])
    assert set(results["top"]) <= {*SANDBOX_TOP_LEVEL, *prefix_parts[1:2]}
    assert set(results["etc"]) <= {"passwd", "group", "hostname", "hosts", "ld.so.cache", "localtime"}
    assert token not in result.stdout + result.stderr


@pytest.mark.parametrize("drop_privileges", [True, False])  # False: uid 0 inside, still no capability
def test_no_capability_and_no_way_to_gain_one(drop_privileges):
    body = """
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
results["status"] = {k: v.strip() for k, v in status.items() if k.startswith(("Cap", "NoNew", "Seccomp"))}
open("locked", "w").write("x"); os.chmod("locked", 0)
os.mkdir("locked_dir"); os.chmod("locked_dir", 0)
attempt("read_mode_000_file", lambda: raw_read("locked"))  # needs CAP_DAC_OVERRIDE
attempt("list_mode_000_dir", lambda: os.listdir("locked_dir"))  # needs CAP_DAC_READ_SEARCH
attempt("chown", lambda: raw("chown", "main.py", 4242, 4242))  # needs CAP_CHOWN
attempt("setuid", lambda: raw("setuid", 4242))  # needs CAP_SETUID
attempt("mount", lambda: raw("mount", "none", "/tmp", "tmpfs", 0, None))  # needs CAP_SYS_ADMIN
attempt("user_namespace", lambda: raw("unshare", 0x10000000))  # would hand out a full set of its own
attempt("unshare_r", lambda: __import__("subprocess").run(["unshare", "-r", "true"], check=True))
results["uid"] = os.getuid()
"""
    results, result = attempts(body, drop_privileges=drop_privileges)
    assert_refused(results, "read_mode_000_file", "list_mode_000_dir", "chown", "setuid", "mount")
    assert_refused(results, "user_namespace", "unshare_r")
    status = results["status"]
    assert {status[name] for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0" * 16}
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == ("2" if result.isolation["seccomp"] else "0")
    if AS_ROOT:
        assert (results["uid"] != 0) == drop_privileges == (result.isolation["uid"] != 0)


def test_writes_go_to_a_private_tmpfs_that_is_gone_after_the_run(tmp_path):
    token = secrets.token_hex(8)
    host_files = [f"/tmp/{token}-host", f"/dev/shm/{token}-host", f"/var/tmp/{token}-host"]
    for path in host_files:
        with open(path, "w") as host_file:
            host_file.write("host")
    try:
        body = f"""
results["before"] = {{d: os.listdir(d) for d in ("/tmp", "/dev/shm", "/var/tmp")}}
results["sandbox_before"] = os.listdir("/sandbox")
for d in ("/tmp", "/dev/shm", "/var/tmp", "/sandbox"):
    attempt("write " + d, lambda: raw_write(d + "/{token}"))
for path in ({str(tmp_path / "outside.txt")!r}, "/usr/x", "/etc/passwd", "/x", "/proc/sys/kernel/hostname",
             "/root/x", "/dev/x"):
    attempt("write " + path, lambda: raw_write(path))
"""
        first, _ = attempts(body)
        second, _ = attempts(body)
        for results in (first, second):
            assert results["before"] == {"/tmp": [], "/dev/shm": [], "/var/tmp": []}  # private and empty
            assert results["sandbox_before"] == ["main.py"]  # nothing of an earlier run is left
            assert all(results[f"write {d}"].startswith("ok") for d in ("/tmp", "/dev/shm", "/var/tmp"))
            assert_refused(
                results,
                *(
                    label
                    for label in results
                    if label.startswith("write /")
                    and label.split()[1] not in ("/tmp", "/dev/shm", "/var/tmp", "/sandbox")
                ),
            )
        for directory in ("/tmp", "/dev/shm", "/var/tmp"):
            assert not os.path.exists(f"{directory}/{token}")  # nothing reached the host
        assert list(tmp_path.iterdir()) == []
        assert all(open(path).read() == "host" for path in host_files)
    finally:
        for path in host_files:
            os.remove(path)


def test_total_disk_use_is_capped():
    body = """
for i in range(3):
    attempt(f"file {i}", lambda: open(f"/tmp/f{i}", "wb").write(b"x" * 1000000))
"""
    results, _ = attempts(body, max_disk_mb=2, max_file_bytes=1_000_000)
    assert results["file 0"] == "ok: 1000000" and results["file 1"] == "ok: 1000000"
    assert results["file 2"].startswith("refused: OSError: [Errno 28]")  # ENOSPC: the tmpfs is full


@pytest.fixture
def shared_session_dir(tmp_path):
    """A Ray-like session directory: mode 0777 without the sticky bit, a root-owned file, a log
    directory and a listening, world-writable unix socket; plus a listening abstract socket."""
    session = tmp_path / "session"
    session.mkdir()
    (session / "logs").mkdir()
    (session / "victim.txt").write_text("keep me")
    for path in (tmp_path, session):
        path.chmod(0o777)
    unix_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_server.bind(str(session / "raylet"))
    os.chmod(session / "raylet", 0o777)
    abstract_name = f"\0hybridflow-sandbox-test-{secrets.token_hex(6)}"
    abstract_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_server.bind(abstract_name)
    for server in (unix_server, abstract_server):
        server.listen(4)
        server.settimeout(0.5)
    yield session, abstract_name, (unix_server, abstract_server)
    for server in (unix_server, abstract_server):
        server.close()


def test_world_writable_host_directories_and_sockets_are_out_of_reach(shared_session_dir):
    session, abstract_name, servers = shared_session_dir
    body = f"""
import socket
session = {str(session)!r}
def connect(address):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(2)
    client.connect(address)
attempt("delete_root_file", lambda: raw("unlink", session + "/victim.txt"))
attempt("rename_logs", lambda: raw("rename", session + "/logs", session + "/logs.old"))
attempt("replace_socket", lambda: (raw_write("fake"), raw("rename", "fake", session + "/raylet")))
attempt("connect_socket", lambda: connect(session + "/raylet"))
attempt("connect_abstract", lambda: connect({abstract_name!r}))
"""
    results, _ = attempts(body)
    assert_refused(results, "delete_root_file", "rename_logs", "replace_socket")
    assert_refused(results, "connect_socket", "connect_abstract")
    assert (session / "victim.txt").read_text() == "keep me" and (session / "logs").is_dir()
    assert stat.S_ISSOCK(os.stat(session / "raylet").st_mode)
    for server in servers:  # no connection ever arrived
        with pytest.raises(TimeoutError):
            server.accept()


def test_a_setuid_copy_grants_nothing_and_does_not_persist():
    body = """
import shutil, subprocess
for path in ("/tmp/sh", "/sandbox/sh"):
    shutil.copy("/bin/sh", path)
    os.chmod(path, 0o4755)
out = subprocess.run(["/tmp/sh", "-p", "-c", "grep -E '^(Uid|Gid|CapEff)' /proc/self/status"],
                     capture_output=True, text=True).stdout
results["shell"] = dict(line.split(":", 1) for line in out.splitlines())
results["suid_mounts"] = [line for line in open("/proc/self/mountinfo") if "nosuid" not in line]
results["uid"] = os.getuid()
"""
    results, result = attempts(body)
    uid = results["uid"]
    assert results["shell"]["Uid"].split() == [str(uid)] * 4  # the set-uid bit changed nothing
    assert results["shell"]["CapEff"].strip() == "0" * 16
    assert results["suid_mounts"] == []  # every mount is nosuid: a root set-uid binary grants nothing either
    if AS_ROOT:  # the run had its own uid: nothing it owned may be left on the host
        assert uid != 0
        for directory in ("/tmp", "/dev/shm", "/var/tmp"):
            assert [
                name for name in os.listdir(directory) if os.lstat(f"{directory}/{name}").st_uid == uid
            ] == []


def test_other_processes_are_invisible():
    token = secrets.token_hex(8)
    host_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        body = f"""
pids = sorted(p for p in os.listdir("/proc") if p.isdigit())
results["pids"] = pids
results["cmdlines"] = [open(f"/proc/{{p}}/cmdline", "rb").read().decode(errors="replace") for p in pids]
attempt("signal_host_process", lambda: os.kill({host_process.pid}, 0))
"""
        results, result = attempts(body)
    finally:
        host_process.kill()
        host_process.wait()
    assert results["pids"] == ["1", "2"]  # the namespace's init and the code itself, nothing else
    assert token not in result.stdout
    assert_refused(results, "signal_host_process")
