#!/usr/bin/env bash
# Set-up, lint and the test suite (CPU). Extra arguments go to pytest.
#   bash launch/test.sh [-k pattern ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
PY=${VENV:-.venv}/bin/python
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# the venv's programs first, as in an activated venv: verifiers runs its harness programs with `uv`, and
# without one on PATH it would install one into ~/.local
export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"
"$PY" -m ruff check slime_rl tools tests bench
# --only-gpu-skips: a skipped test that is not marked gpu fails the run, its reason printed (a real part
# that is not installed must not pass unseen); --durations=30: where the time went, every run
exec "$PY" -m pytest -q -p no:cacheprovider --only-gpu-skips --durations=30 "$@"
