"""The child half of :mod:`hybridflow.workers.rollout.tools.sandbox`: runs as a script, never imported.

``sandbox.run_python`` starts ``python -I -S -B -X utf8 _sandbox_child.py CONFIG_JSON`` in a fresh
working directory holding the untrusted ``main.py``. Before any untrusted code runs, this script, still
single-threaded and with the parent's privileges, sets up the containment, in this order:

1. resource limits (RLIMIT_CORE=0, CPU, AS, FSIZE, NOFILE, NPROC), lowered hard limits included;
2. a new network namespace (``unshare(CLONE_NEWNET)``, or ``CLONE_NEWUSER | CLONE_NEWNET`` when not
   root): only a downed loopback device exists there, so nothing can be reached;
3. ``PR_SET_NO_NEW_PRIVS`` (set-uid binaries grant nothing), then, when started as root, a switch to the
   fresh unprivileged uid/gid chosen by the parent (no supplementary groups). If the interpreter's own
   files are not readable by other users (e.g. a Python under a 0700 ``/root``), the one capability
   CAP_DAC_READ_SEARCH is kept (and made ambient) so imports work: reads are then unrestricted, writes
   are still checked by the kernel as the unprivileged uid;
4. Python-level guards (not a security boundary; ctypes or ``_io`` get around them): writes through
   ``open``/``os.*`` outside the working directory raise PermissionError, ``os.setsid``/``setpgid``
   raise (so forks stay in the process group the parent kills), where RLIMIT_NPROC is not enforced
   (root without the uid switch) process creation fails once the group holds ``max_processes``, and,
   only if the namespace could not be made, ``socket`` is replaced by stubs raising PermissionError.

It reports which of these held as one JSON line on the status pipe, closes it, and runs ``main.py``
as ``__main__``. Only the standard library may be imported here (``-I`` drops the project from sys.path).
"""

import builtins
import ctypes
import errno
import io
import json
import os
import resource
import stat
import sys
import traceback
import types

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 8, 38, 47, 2
CAP_DAC_READ_SEARCH = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SETUP_FAILED_EXIT_CODE = 125
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITABLE_DEVICES = ("/dev/null",)
# os functions that change the filesystem: name -> ((argument position, keyword, dir_fd keyword), ...)
GUARDED_OS_FUNCTIONS = {
    "remove": ((0, "path", "dir_fd"),),
    "unlink": ((0, "path", "dir_fd"),),
    "rmdir": ((0, "path", "dir_fd"),),
    "mkdir": ((0, "path", "dir_fd"),),
    "mkfifo": ((0, "path", "dir_fd"),),
    "mknod": ((0, "path", "dir_fd"),),
    "chmod": ((0, "path", "dir_fd"),),
    "chown": ((0, "path", "dir_fd"),),
    "lchown": ((0, "path", None),),
    "truncate": ((0, "path", None),),
    "utime": ((0, "path", "dir_fd"),),
    "rename": ((0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")),
    "replace": ((0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")),
    "link": ((1, "dst", "dst_dir_fd"),),
    "symlink": ((1, "dst", "dir_fd"),),
}
libc = ctypes.CDLL(None, use_errno=True)


def set_resource_limits(config: dict) -> bool:
    """Apply the limits; returns whether RLIMIT_NPROC will be enforced (it is not for root)."""
    nproc = config["max_processes"]
    if config["uid"] is None and os.getuid() != 0:  # the count is per user: leave room for what runs
        nproc += sum(1 for pid in os.listdir("/proc") if pid.isdigit() and _owned_by_me(pid))
    wanted = {
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_CPU: (config["cpu_time_s"], config["cpu_time_s"] + 1),
        resource.RLIMIT_AS: (config["memory_mb"] * 2**20,) * 2,
        resource.RLIMIT_FSIZE: (config["max_file_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (config["max_open_files"],) * 2,
        resource.RLIMIT_NPROC: (nproc, nproc),
    }
    for which, (soft, hard) in wanted.items():
        _, current_hard = resource.getrlimit(which)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))
    return config["uid"] is not None or os.getuid() != 0


def _owned_by_me(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def enter_network_namespace() -> bool:
    """A new, empty network namespace; as non-root only possible inside a new user namespace."""
    if libc.unshare(CLONE_NEWNET) == 0:
        return True
    return os.getuid() != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


def _others_can_read(path: str) -> bool:
    """Whether a user with no relation to the file's owner can reach and list ``path``."""
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            if path == os.path.dirname(path):
                return True
            path = os.path.dirname(path)
    except OSError:
        return False


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_privileges(uid: int) -> bool:
    """Become ``uid``/``uid`` with no groups; returns whether CAP_DAC_READ_SEARCH had to be kept."""
    keep_read_capability = not all(_others_can_read(p) for p in sys.path if os.path.isdir(p))
    if keep_read_capability and libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS) failed")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if keep_read_capability:
        header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        data[0].effective = data[0].permitted = data[0].inheritable = 1 << CAP_DAC_READ_SEARCH
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset failed")
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0)  # keep it across exec
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
        raise OSError("the uid switch did not take effect")
    return keep_read_capability


def _is_inside(path, workdir: str, dir_fd=None) -> bool:
    if isinstance(path, int):  # an already-open file descriptor
        return True
    try:
        path = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        real = os.path.realpath(path)
    except (OSError, TypeError, ValueError):
        return False
    return real == workdir or real.startswith(workdir + os.sep) or real in WRITABLE_DEVICES


def _refuse(path) -> None:
    raise PermissionError(f"[sandbox] writing outside the working directory is not allowed: {path!r}")


def install_python_guards(workdir: str, block_sockets: bool) -> None:
    """Monkey-patches that catch the ordinary ways of writing elsewhere, leaving the group, or networking."""
    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(flag in str(mode) for flag in "wax+") and not _is_inside(file, workdir):
            _refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
        if flags & WRITE_FLAGS and not _is_inside(path, workdir, dir_fd):
            _refuse(path)
        return real_os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    def guard(name: str, checked_arguments):
        real_function = getattr(os, name)

        def guarded(*args, **kwargs):
            for position, keyword, dir_fd_keyword in checked_arguments:
                path = args[position] if len(args) > position else kwargs.get(keyword)
                if not _is_inside(path, workdir, kwargs.get(dir_fd_keyword) if dir_fd_keyword else None):
                    _refuse(path)
            return real_function(*args, **kwargs)

        return guarded

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open
    for name, checked_arguments in GUARDED_OS_FUNCTIONS.items():
        if hasattr(os, name):
            setattr(os, name, guard(name, checked_arguments))

    def refuse_new_group(*args, **kwargs):
        raise PermissionError("[sandbox] leaving the process group is not allowed")

    os.setsid = os.setpgid = os.setpgrp = refuse_new_group
    if block_sockets:
        _block_sockets()


def install_fork_guard(max_processes: int) -> None:
    """Where the kernel ignores RLIMIT_NPROC (root), refuse process creation once the group is full.

    Processes that check at the same moment can overshoot the count, at most about twofold."""
    import _posixsubprocess

    def group_size() -> int:
        group, size = os.getpgrp(), 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with builtins.open(f"/proc/{pid}/stat", "rb") as stat_file:
                    size += int(stat_file.read().rsplit(b")", 1)[1].split()[2]) == group
            except (OSError, IndexError, ValueError):
                pass
        return size

    def limited(real_function):
        def create_process(*args, **kwargs):
            if group_size() >= max_processes:
                raise BlockingIOError(errno.EAGAIN, "[sandbox] process limit reached")
            return real_function(*args, **kwargs)

        return create_process

    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, limited(getattr(os, name)))
    _posixsubprocess.fork_exec = limited(_posixsubprocess.fork_exec)


def _block_sockets() -> None:
    import _socket
    import socket

    def refuse_network(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    class RefusedSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            refuse_network()

    socket.socket = socket.SocketType = _socket.socket = RefusedSocket
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, refuse_network)


def run_user_code(path: str) -> None:
    """Run ``path`` as ``__main__``, printing tracebacks without this script's frames."""
    with builtins.open(path, encoding="utf-8", errors="replace") as source_file:
        source = source_file.read()
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    try:
        code = compile(source, path, "exec")
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as error:  # report it the way the interpreter would
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(1)


def main() -> None:
    config = json.loads(sys.argv[1])
    workdir = os.path.realpath(os.getcwd())
    status: dict = {"network": "none", "uid": os.getuid(), "read_capability": False}
    try:
        status["nproc_enforced"] = set_resource_limits(config)
        if config["network_namespace"] and enter_network_namespace():
            status["network"] = "netns"
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if config["uid"] is not None:
            status["read_capability"] = drop_privileges(config["uid"])
            status["uid"] = config["uid"]
        if status["network"] != "netns":
            status["network"] = "python-guard"
        install_python_guards(workdir, block_sockets=status["network"] != "netns")
        if not status["nproc_enforced"]:
            install_fork_guard(config["max_processes"])
    except Exception as error:  # fail closed: never run the code half-contained
        status["error"] = f"{type(error).__name__}: {error}"
    os.write(config["status_fd"], json.dumps(status).encode())
    os.close(config["status_fd"])
    if "error" in status:
        print(f"sandbox setup failed: {status['error']}", file=sys.stderr)
        sys.exit(SETUP_FAILED_EXIT_CODE)
    run_user_code(config["source"])


if __name__ == "__main__":
    main()
