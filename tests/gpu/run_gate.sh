#!/usr/bin/env bash
# The GPU gate of the CUDA copy engine (issue 6): unit tests and the gpu benchmark on the GPU machine.
#
# Usage, from anywhere in the repository:
#   tests/gpu/run_gate.sh pack   On a CPU machine with nvcc (a developer machine or CI): builds the GPU test and
#                                bench binaries and bundles them, with the shared libraries they need that a bare
#                                Ubuntu 24.04 lacks, into BUILD-gpu-gate/ (ignored by git; carry it to the GPU).
#   tests/gpu/run_gate.sh run    On the GPU machine: prints what the machine has, runs the bundled unit tests and
#                                benchmark, and prints the figures against their targets.
# Why a bundle and not a build there: that machine has no network and only part of what the project configures with
# (fmt, spdlog, GoogleTest sources, hwloc, numa, cmake, ninja, nvcc; no liburing), while the bundle needs only
# glibc >= 2.36, libstdc++ and the NVIDIA driver (the CUDA runtime is linked statically), and it is 5 MB. docs/gpu.md
# has the details. With the device tool:
#   tests/gpu/run_gate.sh pack   then   run(command="tests/gpu/run_gate.sh run", carry=["BUILD-gpu-gate"])
#
# Environment: OUT: a folder for the logs and the bench JSON (the device tool sets it); ORBITKV_GPU_GATE_BUNDLE:
# the bundle folder (default BUILD-gpu-gate); ORBITKV_GPU_BENCH_SWEEP=1: the bench also prints a tuning sweep.
# Exit status: 0 all tests passed and every benchmark target was met; 1 a test failed; 2 the bench failed; 3 a
# target was missed; 4 no usable bundle.
set -uo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
bundle="${ORBITKV_GPU_GATE_BUNDLE:-BUILD-gpu-gate}"
out="${OUT:-$root/$bundle/out}"
binaries=(src/gpu/gpu_copy_engine_test benches/gpu_bench)

# Libraries every glibc system has, never carried: the C library and its parts, the dynamic loader, and the
# compiler runtime (Ubuntu 24.04's libstdc++ and libgcc_s are newer than this machine's, and backward compatible).
system_lib() {
  [[ "$1" =~ ^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+\.|libgcc_s\.) ]]
}

pack() {
  local build=BUILD-gpu
  set -e
  if [[ ! -f "$build/build.ninja" ]]; then
    cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DORBITKV_BUILD_PYTHON=OFF -DORBITKV_WITH_CUDA=ON
  fi
  ninja -C "$build" -j"${ORBITKV_JOBS:-1}" gpu_copy_engine_test gpu_bench
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib"
  local binary lib path
  for binary in "${binaries[@]}"; do
    cp "$build/$binary" "$bundle/bin/"
    while read -r lib _ path _; do
      system_lib "$lib" && continue
      [[ -f "$path" ]] || { echo "run_gate.sh: $binary needs $lib, not found here" >&2; exit 4; }
      cp -L "$path" "$bundle/lib/$lib"
    done < <(ldd "$build/$binary" | grep '=>')
  done
  {
    echo "commit: $(git rev-parse HEAD 2>/dev/null) (plus the working tree)"
    echo "built: $(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
    echo "compilers: $(c++ --version | head -1); $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  } >"$bundle/MANIFEST"
  echo "run_gate.sh: bundle in $bundle ($(du -sh "$bundle" | cut -f1)):"
  ls -l "$bundle/bin" "$bundle/lib"
}

probe() {
  echo "== GPU machine"
  nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total --format=csv,noheader 2>&1 || true
  echo "$(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r), $(ldd --version | head -1), $(nproc) cores"
  local tool
  for tool in cmake ninja g++ nvcc python3; do
    printf '  %-8s %s\n' "$tool" "$( (command -v "$tool" && "$tool" --version 2>&1 | grep -m1 -iE 'version|release') | tr '\n' ' ')"
  done
  local lib
  for lib in libfmt libspdlog libgtest libgmock libnuma libhwloc liburing libcrypto libudev libcuda; do
    printf '  %-10s %s\n' "$lib" "$(ldconfig -p | grep -m2 "$lib\." | awk '{print $1}' | tr '\n' ' ')"
  done
  printf '  headers:  %s\n' "$(ls -d /usr/include/{fmt,spdlog,gtest,hwloc.h,numa.h,liburing.h} 2>/dev/null | tr '\n' ' ')"
  numactl --hardware 2>/dev/null | head -2 || true
  echo "  NUMA nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l); memlock: $(ulimit -l);" \
    "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)," \
    "shmem $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null);" \
    "$(grep -m1 HugePages_Total /proc/meminfo)"
}

summarize() {
  python3 - "$1" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
targets = {"save_restore_concurrent": 0.85}
missed = 0
print(f"{'metric':26} {'GB/s':>7} {'baseline':>18} {'GB/s':>7} {'ratio':>6}  target")
for r in report["results"]:
    target = targets.get(r["metric"], 0.9)
    ok = r["ratio"] >= target
    missed += not ok
    print(f"{r['metric']:26} {r['value']:7.1f} {r['baseline_metric']:>18} {r['baseline']:7.1f} "
          f"{r['ratio']:6.3f}  >= {target} {'met' if ok else 'MISSED'}")
for key, value in report["env"].items():
    print(f"  {key}: {value}")
sys.exit(3 if missed else 0)
EOF
}

run() {
  mkdir -p "$out"
  probe
  if [[ ! -x "$bundle/bin/gpu_copy_engine_test" || ! -x "$bundle/bin/gpu_bench" ]]; then
    echo "run_gate.sh: no bundle in $bundle; run 'tests/gpu/run_gate.sh pack' on a CPU machine and carry it" >&2
    exit 4
  fi
  [[ -f "$bundle/MANIFEST" ]] && sed 's/^/  bundle /' "$bundle/MANIFEST"
  export LD_LIBRARY_PATH="$root/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local missing
  missing="$(ldd "$bundle"/bin/* | grep 'not found' | sort -u || true)"
  if [[ -n "$missing" ]]; then
    echo "run_gate.sh: the bundle lacks libraries: $missing" >&2
    exit 4
  fi
  echo "== unit tests (gpu_copy_engine_test)"
  "$bundle/bin/gpu_copy_engine_test" --gtest_color=no >"$out/gpu_test.log" 2>&1
  local test_rc=$?
  grep -E '^\[ +(OK|FAILED|PASSED) +\]|Failure|CHECK failed' "$out/gpu_test.log" | sed 's/ (.*ms)//' | sort -u | head -60
  tail -3 "$out/gpu_test.log"
  echo "== benchmark (gpu_bench --json)"
  "$bundle/bin/gpu_bench" --json >"$out/gpu_bench.json" 2>"$out/gpu_bench.err"
  local bench_rc=$?
  cat "$out/gpu_bench.err"
  local summary_rc=2
  if [[ $bench_rc -eq 0 ]]; then
    summarize "$out/gpu_bench.json"
    summary_rc=$?
  fi
  echo "== result: tests rc=$test_rc, bench rc=$bench_rc"
  [[ $test_rc -ne 0 ]] && exit 1
  [[ $bench_rc -ne 0 ]] && exit 2
  exit "$summary_rc"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) sed -n '2,21s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
