#!/usr/bin/env bash
# Runs the test suite with the project venv's python. pytest exit code 5 ("no tests collected")
# counts as success so an empty selection never fails CI.
set -u
PY=${1:-.venv/bin/python}
shift || true
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export HF_HUB_OFFLINE=1
# Two pytest processes (pytest-xdist), a test file each at a time (module fixtures are built once):
# the suite is CPU-bound, and one process left a core idle through every single-process test
# (measured 2026-11-26 on 2 cores: 27.5 min in one process, 21 min in two, 97% of both cores busy).
# HYBRIDFLOW_TEST_WORKERS=0 runs it in one process.
WORKERS=${HYBRIDFLOW_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  set -- -n "$WORKERS" --dist loadfile "$@"
fi
# Which tests: "fast" (make test: all but the `slow` marker's), "slow" (make test-slow: faults injected
# into whole running processes and clusters, timed runs compared, whole runs resumed or compared), "all". .ci/run runs fast, then slow.
case "${HYBRIDFLOW_TEST_TIER:-fast}" in
  fast) set -- -m "not slow" "$@" ;;
  slow) set -- -m slow "$@" ;;
  all) ;;
  *) echo "HYBRIDFLOW_TEST_TIER must be fast, slow or all" >&2; exit 2 ;;
esac
"$PY" -m pytest tests -q -ra --durations=40 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests; treating as success"
  rc=0
fi
exit "$rc"
