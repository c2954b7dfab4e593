"""The sandbox half of :mod:`hybridflow.utils.reward_score.prime_code`: runs as the sandbox's script,
never imported. Only the standard library may be used here (the sandbox runs ``python -I -S``).

The parent appends ``run(CONFIG)`` with ``CONFIG = {"code", "inputs", "fn_name", "timeout"}``. The
solution runs after verl's prelude of imports. Without ``fn_name`` the whole program runs once per case,
with the case's input on a real stdin (fd 0, a file) and its stdout (fd 1) captured; with ``fn_name``
the program is loaded once as module ``tmp_sol`` and ``fn_name`` (or ``Solution().fn_name`` when the
code has ``class Solution``) is called with each input line parsed as a JSON argument. Each case gets
``timeout`` seconds (SIGALRM). Per case one line ``MARK + JSON`` goes to the original stdout: status
``ok`` with the case's ``stdout`` or its return value as JSON (``value``), or ``compile_error``,
``runtime_error``, ``timeout`` with the error; the first failure ends the run. The expected outputs
never enter the sandbox: the parent compares.
"""

import builtins
import io
import json
import os
import signal
import sys
import traceback

MARK = "@@hybridflow-prime-code@@ "
MAX_CASE_OUTPUT = 1 << 20  # bytes of a case's stdout kept
# verl's prelude: what APPS-style solutions take for granted, builtins restored after the star imports
_STAR_IMPORTS = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
    "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing",
)  # fmt: skip
PRELUDE = (
    "".join(f"from {name} import *\n" for name in _STAR_IMPORTS)
    + "".join(f"import {name}\n" for name in _STAR_IMPORTS[:-2])
    + "sys.setrecursionlimit(6*10**5)\n"
)
STDIN_PATH, STDOUT_PATH = "/tmp/prime_code_stdin", "/tmp/prime_code_stdout"


class CaseTimeout(BaseException):  # noqa: N818  (an interrupt: a solution's `except Exception` misses it)
    pass


def _on_alarm(signum, frame):
    raise CaseTimeout()


def _error(status, exc):
    return {"status": status, "error": repr(exc), "traceback": traceback.format_exc()[-2000:]}


def _run_case(fn, stdin_text, timeout):
    """Run ``fn()`` with ``stdin_text`` on fd 0 and fd 1 captured; the case's report."""
    with open(STDIN_PATH, "w", encoding="utf-8") as stdin_file:
        stdin_file.write(stdin_text)
    stdin_fd = os.open(STDIN_PATH, os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    out_fd = os.open(STDOUT_PATH, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out_fd, 1)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    report = {"status": "ok"}
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fn()
    except SystemExit:  # sys.exit() after printing the answer is fine, as in verl
        pass
    except CaseTimeout as exc:
        report = _error("timeout", exc)
    except BaseException as exc:
        report = _error("runtime_error", exc)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os.lseek(out_fd, 0, os.SEEK_SET)
    report["stdout"] = os.read(out_fd, MAX_CASE_OUTPUT).decode("utf-8", errors="replace")
    os.close(out_fd)
    return report


def _int_keys(value):
    """verl turns a dict argument's keys into ints when they all are."""
    try:
        return {int(k): v for k, v in value.items()}
    except (ValueError, TypeError):
        return value


def _callable(code_text, namespace, fn_name):
    target = namespace["Solution"]() if "class Solution" in code_text else None
    return getattr(target, fn_name) if target is not None else namespace[fn_name]


def run(config):
    real_out = os.dup(1)

    def report(payload):
        os.write(real_out, (MARK + json.dumps(payload) + "\n").encode("utf-8"))

    signal.signal(signal.SIGALRM, _on_alarm)
    timeout, fn_name = config["timeout"], config["fn_name"]
    try:
        code = compile(PRELUDE + config["code"], "<solution>", "exec")
    except BaseException as exc:
        return report(_error("compile_error", exc))
    if fn_name is None:
        for text in config["inputs"]:
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            payload = _run_case(lambda ns=namespace: exec(code, ns), text, timeout)
            report(payload)
            if payload["status"] != "ok":
                return None
        return None
    namespace = {"__name__": "tmp_sol", "__builtins__": builtins}
    loaded = _run_case(lambda: exec(code, namespace), "", timeout)
    if loaded["status"] != "ok":
        return report({**loaded, "status": "compile_error"})
    try:
        method = _callable(config["code"], namespace, fn_name)
    except BaseException as exc:
        return report(_error("compile_error", exc))
    for text in config["inputs"]:
        args = [json.loads(line) for line in text.split("\n")]
        if args and isinstance(args[0], dict):
            args = [_int_keys(args[0])]
        values = []
        payload = _run_case(lambda a=args, out=values: out.append(json.dumps(method(*a))), "", timeout)
        if values:
            payload["value"] = values[0]
        report(payload)
        if payload["status"] != "ok":
            return None
    return None
