#!/usr/bin/env bash
# Runs the test suite with the project venv's python. pytest exit code 5 ("no tests collected")
# counts as success so an empty selection never fails CI.
set -u
PY=${1:-.venv/bin/python}
shift || true
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export HF_HUB_OFFLINE=1
"$PY" -m pytest tests -q -ra --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests; treating as success"
  rc=0
fi
exit "$rc"
