#!/bin/bash
# The GPU tests, one pytest process per test file, each under its own time limit, so that a run of
# limited length can take a chosen part of the suite (the whole of `pytest -m gpu tests/` takes more
# than 9 minutes on an H100). Logs go to $OUT, or out/ without it; a summary line per file is printed.
#
#   bash scripts/gpu_tests.sh                                  # every file with GPU tests, 300 s each
#   LIMIT=200 bash scripts/gpu_tests.sh tests/test_kernels.py  # chosen files
#   PYTEST_ARGS="-x" PYTEST_K="gluon or route_paths" bash scripts/gpu_tests.sh tests/test_kernels.py
# PYTEST_ARGS is split on spaces (so `-k "a or b"` in it would break: that is what PYTEST_K is for).
# A fresh machine compiles every Triton kernel: give it LIMIT=400 or more per file.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
fi
status=0
for f in "${files[@]}"; do
  log="$out/gpu_$(basename "$f" .py).log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  kexpr=()
  [ -n "${PYTEST_K:-}" ] && kexpr=(-k "$PYTEST_K")
  timeout -s KILL "${LIMIT:-300}" python -m pytest -q -m gpu -p no:cacheprovider "$f" ${PYTEST_ARGS:-} \
    "${kexpr[@]}" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "passed|failed|error|skipped|no tests ran" "$log" | tail -1)
  [ $rc -eq 137 ] && summary="KILLED at ${LIMIT:-300} s after: $(tail -c 200 "$log" | tr -d '\n')"
  echo "$f: rc=$rc $(($(date +%s) - start)) s: $summary"
  # pytest's 5 means every GPU test of the file was deselected by PYTEST_ARGS / PYTEST_K: not a failure here
  [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
done
exit $status
