# Shared by scripts/*: project root, bootstrap-if-needed, and the one configure+build step every entry point
# uses, so that `scripts/test`, `scripts/run` and `scripts/bench` build the same tree the same way.
# shellcheck shell=bash
unset CDPATH  # cd must never print: scripts/bench keeps stdout for JSON.
ORBITKV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ORBITKV_ROOT"

orbitkv_bootstrap() {
  scripts/bootstrap --quiet
  # shellcheck disable=SC1091
  source .bootstrap/env
  export ORBITKV_PYTHON
}

# The flags of the main tree (`build`): scripts/test builds it with these, and the wheel (setup.py) reuses that tree.
ORBITKV_MAIN_BUILD_ARGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DORBITKV_WERROR=ON -DORBITKV_BUILD_PYTHON=ON)

# orbitkv_build DIR [cmake args...]: configure (first time or when args change) and build with Ninja.
# ORBITKV_BUILD_TARGETS (space-separated) builds only those targets instead of everything.
orbitkv_build() {
  local dir="$1"
  shift
  local args=(-G Ninja -DPython_EXECUTABLE="$ORBITKV_PYTHON" -DPYTHON_EXECUTABLE="$ORBITKV_PYTHON" "$@")
  local stamp="$dir/.orbitkv-configure-args"
  if [[ ! -f "$dir/build.ninja" || ! -f "$stamp" || "$(cat "$stamp")" != "${args[*]}" ]]; then
    cmake -S . -B "$dir" "${args[@]}"
    printf '%s' "${args[*]}" >"$stamp"
  fi
  local targets=()
  # shellcheck disable=SC2206
  [[ -n "${ORBITKV_BUILD_TARGETS:-}" ]] && targets=(--target ${ORBITKV_BUILD_TARGETS})
  cmake --build "$dir" "${targets[@]}" -- -j"$(nproc)"
}
