"""The child half of :mod:`hybridflow.utils.sandbox`: runs as a script, never imported.

``sandbox.run_python`` starts ``python -I -S -B -X utf8 _sandbox_child.py CONFIG_JSON`` in the run's
host directory, which holds the untrusted ``main.py`` and two empty mount points (``root``,
``scratch``). Three processes follow, each still single-threaded when it forks:

1. the **supervisor** (this process, with the parent's privileges) sets the resource limits, enters new
   mount, pid, IPC, UTS and cgroup namespaces and, unless disabled, a network namespace (all inside a
   new user namespace when not root), forks the init, and finally exits the way the code's process
   ended (its exit code, or killed by its signal), so the parent reads the code's outcome off this
   process;
2. the **init** (pid 1 of the new pid namespace) builds the code's filesystem, drops every privilege,
   reports which mechanisms hold as one JSON object on the status pipe, forks the code's process and
   reaps until that ends. When the init exits the kernel kills every process left in the namespace,
   so nothing the code started outlives the run;
3. the **code's process** runs ``/sandbox/main.py`` as ``__main__``.

The filesystem is a new root (a tmpfs, read-only once built, entered with ``pivot_root``; the host's
tree is detached) holding only: read-only, nosuid, nodev binds of /usr (and /bin, /lib, ... as on the
host), of the interpreter's prefix and of every directory holding a library the interpreter has
mapped; a generated /etc (passwd, group, hostname, hosts, plus the host's ld.so.cache and localtime);
/dev with null, zero, full, random and urandom; a read-only /proc of the new pid namespace; and one
size-capped tmpfs, private to the run and gone with it, behind /sandbox (working directory and HOME),
/tmp, /var/tmp and /dev/shm. Nothing else of the host exists in it: no /root (beyond the path to an
interpreter living there), /home, /etc/shadow, /run, /sys, Ray's session directory or unix socket.

Privileges: the capability bounding set is emptied, then the uid/gid switch (when started as root with
a ``uid``) clears the other sets, which are also zeroed explicitly and checked in /proc/self/status;
``no_new_privs`` is set, so neither set-uid binaries nor file capabilities grant anything. A seccomp
filter refuses new user namespaces (inside one the code would hold a full capability set over
namespaces of its own) and the kernel keyring calls, after the init joined a fresh session keyring.

Python-level guards remain only where the kernel does not act: ``socket`` stubs when the network
namespace is disabled, and a process count when the code runs as uid 0 (RLIMIT_NPROC does not apply to
root). Only the standard library may be imported here (``-I`` drops the project from sys.path).
"""

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
import traceback
import types

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
KEYCTL_JOIN_SESSION_KEYRING = 1
# per architecture: audit arch, then the system calls the filter looks at
SECCOMP_ARCHES = {
    "x86_64": (
        0xC000003E,
        {"clone": 56, "unshare": 272, "clone3": 435, "add_key": 248, "request_key": 249, "keyctl": 250},
    ),
    "aarch64": (
        0xC00000B7,
        {"clone": 220, "unshare": 97, "clone3": 435, "add_key": 217, "request_key": 218, "keyctl": 219},
    ),
}
SETUP_FAILED_EXIT_CODE = 125
CODE_PATH = "/sandbox/main.py"
SYSTEM_DIRECTORIES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FROM_HOST = ("/etc/ld.so.cache", "/etc/localtime")
# a mapped library found under these is never a reason to bind its directory
NEVER_BOUND = ("/etc", "/dev", "/proc", "/sys", "/run", "/tmp", "/var/tmp", "/home", "/root/")
DEVICES = ("null", "zero", "full", "random", "urandom")
# writable places, all on the run's one scratch tmpfs: path in the sandbox -> mode
SCRATCH_DIRECTORIES = {"/sandbox": 0o700, "/tmp": 0o1777, "/var/tmp": 0o1777, "/dev/shm": 0o1777}
# statvfs flags a bind mount must keep when remounted inside a user namespace -> mount flags
KEPT_MOUNT_FLAGS = {
    os.ST_RDONLY: MS_RDONLY,
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def set_resource_limits(config: dict) -> bool:
    """Apply the limits; returns whether RLIMIT_NPROC will be enforced (it is not for uid 0)."""
    nproc = config["max_processes"] + 1  # the namespace's init runs under the code's uid too
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


def enter_namespaces(config: dict) -> None:
    """New mount, pid, IPC, UTS, cgroup (and network) namespaces; as non-root inside a user namespace
    that maps only the caller's own uid and gid."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if config["network_namespace"]:
        flags |= CLONE_NEWNET
    try:
        if os.geteuid() != 0:
            uid, gid = os.geteuid(), os.getegid()
            _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as map_file:
                    map_file.write(text)
        _check(libc.unshare(flags), "unshare")
    except OSError as error:
        raise OSError(
            error.errno,
            f"cannot create the sandbox's namespaces ({error}); "
            "it needs root or unprivileged user namespaces",
        ) from None


def interpreter_directories(site_packages: bool) -> list[str]:
    """Directories the code's interpreter needs, outermost only: its prefix, the directory of every
    shared library it has mapped (for a subprocess of the interpreter, or a library loaded later from
    beside them) and, with ``site_packages``, its environment and import path."""
    paths = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    if site_packages:
        paths |= {sys.prefix, sys.exec_prefix, *sys.path}
    with open("/proc/self/maps") as maps:
        for line in maps:  # "address perms offset dev inode path": executable file mappings only
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and "x" in fields[1] and fields[5].startswith("/"):
                library_directory = os.path.dirname(os.path.realpath(fields[5].removesuffix(" (deleted)")))
                if not any(library_directory.startswith(d) for d in NEVER_BOUND):
                    paths.add(library_directory)
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)} - {"/"})
    covered = [*SYSTEM_DIRECTORIES]
    kept = []
    for path in real:
        if not any(path == c or path.startswith(c + "/") for c in covered):
            kept.append(path)
            covered.append(path)
    return kept


class FilesystemBuilder:
    """Builds the code's root on a tmpfs at ``<host_dir>/root`` and switches into it."""

    def __init__(self, config: dict, owner: int) -> None:
        self.host_dir, self.owner = config["host_dir"], owner
        self.root = os.path.join(self.host_dir, "root")
        self.scratch = os.path.join(self.host_dir, "scratch")
        self.config = config

    def build(self) -> None:
        with open(os.path.join(self.host_dir, self.config["source"]), "rb") as source_file:
            code = source_file.read()
        directories = interpreter_directories(self.config["site_packages"])
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
        mount("tmpfs", self.root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
        inodes = max(1024, self.config["disk_mb"] * 64)
        mount(
            "tmpfs",
            self.scratch,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"mode=0755,size={self.config['disk_mb']}m,nr_inodes={inodes}",
        )
        for path in SYSTEM_DIRECTORIES:
            if os.path.islink(path):
                os.symlink(os.readlink(path), self.inside(path))
            elif os.path.isdir(path):
                self.bind(path, MS_RDONLY | MS_NOSUID | MS_NODEV)
        for path in directories:
            self.bind(path, MS_RDONLY | MS_NOSUID | MS_NODEV)
        self.make_etc()
        self.make_dev()
        for path, mode in SCRATCH_DIRECTORIES.items():
            source = os.path.join(self.scratch, path.strip("/").replace("/", "_"))
            os.mkdir(source)
            os.chmod(source, mode)
            if path == "/sandbox":
                self.write_owned(os.path.join(source, "main.py"), code)
                self.chown(source)
            self.bind(source, MS_NOSUID | MS_NODEV, target=path)
        self.makedirs(self.inside("/proc"))
        mount("proc", self.inside("/proc"), "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount(None, self.inside("/dev"), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        mount(None, self.root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        self.enter()

    def inside(self, path: str) -> str:
        return self.root + path

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o755, exist_ok=True)

    def bind(self, source: str, flags: int, target: str | None = None) -> None:
        """Bind ``source`` (not its submounts) at ``target`` inside (default: the same path), then remount
        it with ``flags`` plus the flags the source mount already has (a user namespace must keep them)."""
        target = self.inside(target or source)
        if os.path.isdir(source):
            self.makedirs(target)
        else:
            self.makedirs(os.path.dirname(target))
            open(target, "a").close()
        mount(source, target, None, MS_BIND)
        kept = os.statvfs(source).f_flag
        flags |= sum(flag for st_flag, flag in KEPT_MOUNT_FLAGS.items() if kept & st_flag)
        mount(None, target, None, MS_REMOUNT | MS_BIND | flags)

    def make_etc(self) -> None:
        self.makedirs(self.inside("/etc"))
        for path in ETC_FROM_HOST:
            if os.path.islink(path):
                os.symlink(os.readlink(path), self.inside(path))
            elif os.path.isfile(path):
                self.bind(path, MS_RDONLY | MS_NOSUID | MS_NODEV)
        uid = self.owner
        files = {
            "passwd": f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}::/sandbox:/bin/sh\n",
            "group": f"root:x:0:\nsandbox:x:{uid}:\n",
            "hostname": "sandbox\n",
            "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        }
        for name, text in files.items():
            with open(self.inside(f"/etc/{name}"), "w") as etc_file:
                etc_file.write(text)

    def make_dev(self) -> None:
        dev = self.inside("/dev")
        self.makedirs(dev)
        mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
        for name in DEVICES:
            self.bind(f"/dev/{name}", MS_NOSUID | MS_NOEXEC)
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            os.symlink(target, os.path.join(dev, name))

    def write_owned(self, path: str, data: bytes) -> None:
        with open(path, "wb") as file:
            file.write(data)
        self.chown(path)

    def chown(self, path: str) -> None:
        if os.stat(path).st_uid != self.owner:
            os.chown(path, self.owner, self.owner)

    def enter(self) -> None:
        """Make the new root the process's ``/`` and detach the host's tree from this namespace."""
        os.chdir(self.root)
        number = SYS_PIVOT_ROOT.get(platform.machine())
        if number is not None and libc.syscall(number, b".", b".") == 0:
            _check(libc.umount2(b".", MNT_DETACH), "umount the host's root")
        else:  # the kernel refused pivot_root (e.g. an initramfs root): move the mount over / and chroot
            mount(self.root, "/", None, MS_MOVE)
            os.chroot(".")
        os.chdir("/sandbox")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_privileges(uid: int | None) -> None:
    """Empty every capability set, switch to ``uid`` (when given) with no groups, set no_new_privs;
    raises unless /proc/self/status shows exactly that."""
    with open("/proc/sys/kernel/cap_last_cap") as last_cap:
        last = int(last_cap.read())
    for capability in range(last + 1):  # needs CAP_SETPCAP, so before the uid switch
        _check(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"dropping capability {capability}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header, data = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    with open("/proc/self/status") as status_file:
        fields = dict(line.split(":", 1) for line in status_file if ":" in line)
    capability_sets = {
        name: int(fields[name], 16) for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
    }
    if any(capability_sets.values()) or int(fields["NoNewPrivs"]) != 1:
        raise OSError(
            f"privileges were not dropped: {capability_sets}, NoNewPrivs={fields['NoNewPrivs'].strip()}"
        )
    if uid is not None and (os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3):
        raise OSError("the uid switch did not take effect")


def seccomp_program(audit_arch: int, numbers: dict[str, int]) -> list[tuple[int, int, int, int]]:
    """Classic BPF (code, jt, jf, k) for the filter of :func:`install_seccomp_filter`."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    arg0_low = 16 if sys.byteorder == "little" else 20  # the flags' low 32 bits in struct seccomp_data
    program = [  # (code, k, jump-if-true label, jump-if-false label); None falls through
        (ld, 4, None, None),  # the calling convention
        (jeq, audit_arch, None, "nosys"),  # a foreign one (i386 on x86_64) could bypass the numbers
        (ld, 0, None, None),  # the system call number
        (jge, 0x40000000, "nosys", None),  # the x32 ABI
        *[(jeq, numbers[name], "nosys", None) for name in ("clone3", "add_key", "request_key", "keyctl")],
        (jeq, numbers["unshare"], "flags", None),
        (jeq, numbers["clone"], "flags", None),
        (ret, SECCOMP_RET_ALLOW, None, None),
        ("flags", None, None, None),
        (ld, arg0_low, None, None),
        (jset, CLONE_NEWUSER, "eperm", None),
        (ret, SECCOMP_RET_ALLOW, None, None),
        ("nosys", None, None, None),
        (ret, SECCOMP_RET_ERRNO | errno.ENOSYS, None, None),
        ("eperm", None, None, None),
        (ret, SECCOMP_RET_ERRNO | errno.EPERM, None, None),
    ]
    labels, instructions = {}, []
    for code, *rest in program:
        if isinstance(code, str):
            labels[code] = len(instructions)
        else:
            instructions.append((code, *rest))
    return [
        (code, labels[yes] - i - 1 if yes else 0, labels[no] - i - 1 if no else 0, k)
        for i, (code, k, yes, no) in enumerate(instructions)
    ]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def install_seccomp_filter() -> bool:
    """Refuse new user namespaces (which would hand the code a full capability set over namespaces of
    its own) and the kernel keyring calls; clone3 says ENOSYS so libc falls back to clone, whose flags a
    filter can read. Returns False on architectures without a table here (nothing is filtered)."""
    if platform.machine() not in SECCOMP_ARCHES:
        return False
    audit_arch, numbers = SECCOMP_ARCHES[platform.machine()]
    if libc.syscall(numbers["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:  # drop the parent's keys
        _check(-1, "joining a fresh session keyring")
    program = seccomp_program(audit_arch, numbers)
    filters = (_SockFilter * len(program))(*[_SockFilter(*instruction) for instruction in program])
    fprog = _SockFprog(len(program), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")
    return True


def install_fork_guard(max_processes: int) -> None:
    """Where the kernel ignores RLIMIT_NPROC (uid 0), refuse process creation once the pid namespace,
    which holds only this run, has ``max_processes`` processes besides the init.

    Processes that check at the same moment can overshoot the count, at most about twofold."""
    import _posixsubprocess

    def count() -> int:
        return sum(1 for pid in os.listdir("/proc") if pid.isdigit()) - 1

    def limited(real_function):
        def create_process(*args, **kwargs):
            if count() >= max_processes:
                raise BlockingIOError(errno.EAGAIN, "[sandbox] process limit reached")
            return real_function(*args, **kwargs)

        return create_process

    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, limited(getattr(os, name)))
    _posixsubprocess.fork_exec = limited(_posixsubprocess.fork_exec)


def block_sockets() -> None:
    """Used only when the network namespace is disabled; ctypes gets around it."""
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
    with open(path, encoding="utf-8", errors="replace") as source_file:
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


def fail(config: dict, status: dict, error: BaseException) -> None:
    """Report a setup failure and exit without running anything (fail closed)."""
    status["error"] = f"{type(error).__name__}: {error}"
    report_status(config, status)
    print(f"sandbox setup failed: {status['error']}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED_EXIT_CODE)


def report_status(config: dict, status: dict) -> None:
    os.write(config["status_fd"], json.dumps(status).encode())
    os.close(config["status_fd"])


def exit_like(wait_status: int) -> None:
    """Exit with the code's exit code, or die by the signal that killed it (without a core dump)."""
    if os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        try:
            signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        except (OSError, ValueError):  # SIGKILL/SIGSTOP: already default
            pass
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(wait_status))


def supervise(init_pid: int, outcome_read: int) -> None:
    """The supervisor's part: wait for the init, then exit as the code's process did."""
    _, init_status = os.waitpid(init_pid, 0)
    reported = os.read(outcome_read, 32)
    exit_like(int(reported) if reported else init_status)


def be_init(config: dict, status: dict, outcome_write: int) -> None:
    """The init's part: contain, report, fork the code's process and reap. Returns only in that child."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-handled signals from inside
        os.umask(0o022)
        libc.sethostname(b"sandbox", 7)
        owner = config["uid"] if config["uid"] is not None else os.getuid()
        FilesystemBuilder(config, owner).build()
        drop_privileges(config["uid"])
        status["seccomp"] = install_seccomp_filter()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the uid switch cleared it
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code (same uid) cannot ptrace the init
        status.update(filesystem="private-root", pid_namespace=True, capabilities="none")
        status["uid"] = owner
        code_pid = os.fork()
    except Exception as error:  # fail closed: never run the code half-contained
        fail(config, status, error)
    if code_pid == 0:
        os.close(outcome_write)
        return
    report_status(config, status)
    while True:
        pid, wait_status = os.wait()
        if pid == code_pid:
            os.write(outcome_write, str(wait_status).encode())
            os._exit(0)  # the kernel now kills whatever the code left running in the namespace


def main() -> None:
    config = json.loads(sys.argv[1])
    status: dict = {"network": "none", "uid": os.getuid()}
    executable = os.path.realpath(sys.executable)  # the venv's link does not exist inside
    try:
        status["nproc_enforced"] = set_resource_limits(config)
        enter_namespaces(config)
        status["network"] = "netns" if config["network_namespace"] else "python-guard"
        outcome_read, outcome_write = os.pipe()
        init_pid = os.fork()
    except Exception as error:
        fail(config, status, error)
    if init_pid:
        os.close(outcome_write)
        os.close(config["status_fd"])
        supervise(init_pid, outcome_read)
    os.close(outcome_read)
    be_init(config, status, outcome_write)
    # the code's process: undo what only the init needed, then run the code
    signal.signal(signal.SIGINT, signal.default_int_handler)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    sys.executable = sys._base_executable = executable
    if status["network"] == "python-guard":
        block_sockets()
    if not status["nproc_enforced"]:
        install_fork_guard(config["max_processes"])
    run_user_code(CODE_PATH)


if __name__ == "__main__":
    main()
