#!/usr/bin/env bash
# Builds the orbitkv wheels into dist/: one for Debian's Python (3.11, the one scripts/bootstrap records) and one for
# each further CPython given in ORBITKV_WHEEL_PYTHONS (space-separated paths; default: a pyenv 3.12 if this machine
# has one, for the GPU machine's Ubuntu 24.04). The build runs under Debian's Python either way (setup.py tags the
# wheel for its target), reusing the scripts/test tree, so after scripts/test it takes seconds.
# Usage: packaging/build_wheels.sh [OUTDIR]     then: pip install dist/orbitkv-*-cp311-*.whl   (docs/install.md)
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"
orbitkv_bootstrap
out="${1:-dist}"
mkdir -p "$out"
pythons=("$ORBITKV_PYTHON")
if [[ -n "${ORBITKV_WHEEL_PYTHONS:-}" ]]; then
  read -r -a extra <<<"$ORBITKV_WHEEL_PYTHONS"
  pythons+=("${extra[@]}")
else
  for candidate in /root/.pyenv/versions/3.12*/bin/python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    [[ -x "$candidate" ]] && { pythons+=("$candidate"); break; }
  done
fi
for python in "${pythons[@]}"; do
  echo "build_wheels: the wheel for $("$python" --version) ($python)" >&2
  ORBITKV_WHEEL_PYTHON="$python" "$ORBITKV_PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index -q \
    -w "$out" .
done
ls -l "$out"/orbitkv-*.whl
