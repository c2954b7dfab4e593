"""The driver: the program :mod:`hybridflow.sandbox.runner` runs inside the sandbox for one request.

Never imported. The runner sends this file's text followed by one line, ``main("<job>")`` (the job as
base64 JSON), as the sandbox's ``/sandbox/main.py``. Only the standard library is used. The driver:

1. makes itself non-dumpable (so the code, which runs under the same uid, can neither read its memory
   nor open its ``/proc/<pid>/fd`` to write into the report channel) and deletes ``main.py``, the only
   copy of the job, before any of the request's code runs;
2. writes the request's files and the code into ``/sandbox`` (paths that leave it are refused);
3. runs the compile command (if any) and then the run command, each as its own process group with the
   step's timeout (wall clock, and CPU seconds via RLIMIT_CPU), the request's memory limit
   (RLIMIT_AS), the request's stdin, and at most ``output_limit`` bytes kept of stdout and of stderr;
   the run step is skipped when compiling failed;
4. reads the files asked for (regular files inside ``/sandbox`` only, ``fetch_limit`` bytes in all);
5. prints one report, a JSON object framed by ``\\x1e<nonce>\\x1e`` on both sides, to its stdout.

The nonce comes with the job and is never written where the code could read it, so output the code
manages to put on the driver's stdout cannot pass for a report. Everything the code started is killed
when its step ends (its process group), and by the sandbox when the driver exits (the pid namespace).
"""

import base64
import ctypes
import json
import math
import os
import resource
import selectors
import signal
import stat
import subprocess
import sys
import time

WORKDIR = "/sandbox"
PYTHON = "<python>"
PR_SET_DUMPABLE = 4
CHUNK = 65536


def main(job_text):
    job = json.loads(base64.b64decode(job_text))
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.remove(os.path.join(WORKDIR, "main.py"))
    report = {"compile": None, "run": None, "files": {}, "skipped_files": [], "error": None}
    try:
        os.chdir(WORKDIR)
        write_inputs(job)
        compiled = True
        if job["compile"]:
            report["compile"] = run_step(job["compile"], None, job["compile_timeout"], job)
            compiled = report["compile"]["status"] == "Finished" and report["compile"]["return_code"] == 0
        if compiled:
            report["run"] = run_step(job["run"], job["stdin"], job["run_timeout"], job)
        report["files"], report["skipped_files"] = fetch_files(job["fetch_files"], job["fetch_limit"])
    except Exception as error:  # a driver failure is reported, never a traceback in place of the report
        report["error"] = f"{type(error).__name__}: {error}"
    emit(report, job["nonce"])


def inside(name):
    """The absolute path of ``name`` (relative to the run's directory) if it stays inside, else None."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return None
    path = os.path.normpath(os.path.join(WORKDIR, name))
    return path if path.startswith(WORKDIR + "/") else None


def write_inputs(job):
    for name, content in job["files"].items():
        path = inside(name)
        if path is None:
            raise ValueError(f"file path {name!r} leaves the run's directory")
        if content is None:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(content))
    with open(os.path.join(WORKDIR, job["source"]), "w", encoding="utf-8") as handle:
        handle.write(job["code"])


def step_limits(timeout, memory_bytes):
    """The preexec function of a step: its CPU seconds and address space, lowered in the child only."""
    cpu_seconds = int(math.ceil(timeout)) + 1

    def apply():
        _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        if cpu_hard == resource.RLIM_INFINITY or cpu_seconds < cpu_hard:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_hard))
        if memory_bytes:
            _, as_hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = memory_bytes if as_hard == resource.RLIM_INFINITY else min(memory_bytes, as_hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def run_step(argv, stdin_text, timeout, job):
    """One step as a dict in the shape of SandboxFusion's CommandRunResult (output base64-encoded)."""
    argv = [sys.executable if word == PYTHON else word for word in argv]
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=WORKDIR,
            env=job["env"],
            start_new_session=True,
            preexec_fn=step_limits(timeout, job["memory_bytes"]),
        )
    except OSError as error:
        message = f"cannot start {argv[0]}: {error}".encode()
        return step_result("Error", time.monotonic() - started, None, b"", message)
    data = (stdin_text or "").encode("utf-8")
    stdout, stderr, timed_out, ended = pump(process, data, started + timeout, job)
    kill_group(process.pid)
    if timed_out:
        process.wait()
        return step_result("TimeLimitExceeded", ended - started, None, stdout, stderr)
    code = process.wait()
    if code == -signal.SIGXCPU:  # its CPU seconds ran out before the wall clock: a time limit too
        return step_result("TimeLimitExceeded", ended - started, None, stdout, stderr)
    return step_result("Finished", ended - started, code, stdout, stderr)


def pump(process, data, deadline, job):
    """Feed ``data`` to stdin and collect stdout/stderr until the process has exited and both pipes
    closed, or ``deadline``; returns ``(stdout, stderr, timed_out, end time)``."""
    limit = job["output_limit"]
    kept = {process.stdout: bytearray(), process.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in kept:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    written = 0
    if data:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin, selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    ended = None
    while True:
        if ended is None and process.poll() is not None:
            ended = time.monotonic()
            kill_group(process.pid)  # what it left running would hold the pipes open
        if not any(key.fileobj is not process.stdin for key in selector.get_map().values()):
            break
        now = time.monotonic()
        if now >= deadline:
            return bytes(kept[process.stdout]), bytes(kept[process.stderr]), ended is None, ended or now
        for key, _ in selector.select(min(deadline - now, 0.05)):
            stream = key.fileobj
            if stream is process.stdin:
                try:
                    written += os.write(stream.fileno(), data[written : written + CHUNK])
                except BlockingIOError:
                    continue
                except OSError:  # the program closed its stdin or exited
                    written = len(data)
                if written >= len(data):
                    selector.unregister(stream)
                    stream.close()
                continue
            chunk = os.read(stream.fileno(), CHUNK)
            if not chunk:
                selector.unregister(stream)
                continue
            room = limit - len(kept[stream])
            if room > 0:
                kept[stream] += chunk[:room]
    if not process.stdin.closed:
        selector.unregister(process.stdin)
        process.stdin.close()
    if ended is None:  # both pipes closed while it still runs: wait for it within the deadline
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return bytes(kept[process.stdout]), bytes(kept[process.stderr]), True, time.monotonic()
        ended = time.monotonic()
    return bytes(kept[process.stdout]), bytes(kept[process.stderr]), False, ended


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def step_result(status, seconds, code, stdout, stderr):
    return {
        "status": status,
        "execution_time": round(seconds, 6),
        "return_code": code,
        "stdout": base64.b64encode(stdout).decode("ascii"),
        "stderr": base64.b64encode(stderr).decode("ascii"),
    }


def fetch_files(names, budget):
    """``({name: base64}, [names not returned])``: regular files inside the run's directory (links are
    not followed), while their sizes together stay within ``budget`` bytes."""
    found, skipped = {}, []
    for name in names:
        path = inside(name)
        if path is None:
            skipped.append(name)
            continue
        try:
            handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            continue  # absent: left out, as SandboxFusion does
        except OSError:  # a link (not followed), a directory, ...
            skipped.append(name)
            continue
        try:
            info = os.fstat(handle)
            if not stat.S_ISREG(info.st_mode) or info.st_size > budget:
                skipped.append(name)
                continue
            content = b""
            while len(content) <= info.st_size and (chunk := os.read(handle, CHUNK)):
                content += chunk
        finally:
            os.close(handle)
        budget -= len(content)
        found[name] = base64.b64encode(content).decode("ascii")
    return found, skipped


def emit(report, nonce):
    frame = f"\x1e{nonce}\x1e".encode("ascii")
    payload = frame + json.dumps(report).encode("ascii") + frame
    while payload:
        payload = payload[os.write(1, payload) :]
