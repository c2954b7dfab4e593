"""The call-a-function harness for test cases with ``fn_name`` (LeetCode-style Python problems).

verl's ``check_correctness`` turns a solution that defines a function (or a ``Solution`` class with a
method) into a program: the case's stdin holds one JSON value per line, the function's arguments;
the program calls ``fn_name`` with them and prints the result, JSON for lists, dicts, tuples,
``None`` and booleans and ``str()`` for anything else, so it can be compared with the expected output.
A harness error (bad JSON, no such function, an exception inside) goes to stderr and prints nothing.

The solution runs after the imports such problems take for granted (``List``, ``defaultdict``,
``heapq``, ``lru_cache``...), with the builtins restored last so ``math.pow`` and friends do not
shadow them.
"""

from __future__ import annotations

import json

PRELUDE = """\
import bisect, collections, copy, datetime, functools, heapq, io, itertools, json, math, operator
import random, re, statistics, string, sys
from bisect import *
from collections import *
from copy import *
from functools import *
from heapq import *
from itertools import *
from math import *
from operator import *
from statistics import *
from string import *
from typing import *
from builtins import *
"""

CALLER = """

def __harness_main(function_name):
    import json as _json
    import sys as _sys
    import traceback as _traceback

    text = _sys.stdin.read()
    try:
        arguments = [_json.loads(line) for line in text.split("\\n") if line.strip()]
    except ValueError as error:
        _sys.stderr.write(f"harness: the input is not one JSON value a line: {error}\\n")
        return
    try:
        if function_name in globals():
            target = globals()[function_name]
        elif "Solution" in globals():
            target = getattr(globals()["Solution"](), function_name)
        else:
            _sys.stderr.write(f"harness: no function or Solution method named {function_name!r}\\n")
            return
        result = target(*arguments)
    except Exception:
        _sys.stderr.write("harness: calling " + function_name + " failed:\\n" + _traceback.format_exc())
        return
    if result is None or isinstance(result, (bool, dict, list, tuple)):
        print(_json.dumps(result))
    else:
        print(str(result))


if __name__ == "__main__":
    __harness_main(FUNCTION_NAME)
"""


def wrap_function_call(generation: str, fn_name: str) -> str:
    """The program that runs ``generation`` and calls ``fn_name`` on each case's JSON input lines."""
    caller = CALLER.replace("FUNCTION_NAME", json.dumps(str(fn_name)))
    return f"{PRELUDE}\n# --- the solution ---\n{generation}\n# --- the harness ---{caller}"
