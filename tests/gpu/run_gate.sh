#!/usr/bin/env bash
# The GPU gate (issue 6): the CUDA copy engine's unit tests, the process-level gate and the gpu benchmark. The process
# gate runs a real orbitkv-manager and separate engine processes that register bf16 KV tensors in their GPU memory
# through CUDA IPC: save, poison, restore through the Manager, compare every byte; an engine killed mid-restore while
# the Manager cleans up alone (stats back to 0, a new engine works); the Manager stopped (kill -STOP) during a CUDA
# IPC restore (the engine's wait returns at its timeout, the unclaimed restore is abandoned and never writes the GPU
# pages, a restore after kill -CONT is exact); split K/V and MLA layouts; a torch tensor
# exported as orbitkv.client exports it; a Manager that sees no GPU refusing CUDA buffers with a clear error.
#
# Usage, from anywhere in the repository:
#   tests/gpu/run_gate.sh pack   On a CPU machine with nvcc (a developer machine or CI): builds the GPU test and bench
#                                binaries, orbitkv-manager and the gate's engine process (gpu_ipc_engine), and bundles
#                                them, with the shared libraries they need that a bare Ubuntu 24.04 lacks, into
#                                BUILD-gpu-gate/ (ignored by git; carry it to the GPU).
#   tests/gpu/run_gate.sh run    On the GPU machine: prints what the machine has, runs the bundled unit tests, the
#                                process gate and the benchmark, and prints the figures against their targets.
# Why a bundle and not a build there: that machine has no network and only part of what the project configures with
# (fmt, spdlog, GoogleTest sources, hwloc, numa, cmake, ninja, nvcc; no liburing), while the bundle needs only
# glibc >= 2.36, libstdc++ and the NVIDIA driver (the CUDA runtime is linked statically). docs/gpu.md has the
# details. With the device tool:
#   tests/gpu/run_gate.sh pack   then   run(command="tests/gpu/run_gate.sh run", carry=["BUILD-gpu-gate"])
#
# Environment: OUT: a folder for the logs and the bench JSON (the device tool sets it); ORBITKV_GPU_GATE_BUNDLE:
# the bundle folder (default BUILD-gpu-gate); ORBITKV_GPU_BENCH_SWEEP=1: the bench also prints a tuning sweep;
# ORBITKV_GPU_GATE_SKIP_BENCH=1: unit tests and process gate only.
# Exit status: 0 all tests passed and every benchmark target was met; 1 a unit test failed; 2 the bench failed; 3 a
# target was missed; 4 no usable bundle; 5 the process gate failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
bundle="${ORBITKV_GPU_GATE_BUNDLE:-BUILD-gpu-gate}"
out="${OUT:-$root/$bundle/out}"
binaries=(src/gpu/gpu_copy_engine_test benches/gpu_bench src/server/orbitkv-manager src/gpu/gpu_ipc_engine)

# system_lib and copy_libs.
# shellcheck source=tests/gpu/bundle_lib.sh
source "$root/tests/gpu/bundle_lib.sh"

pack() {
  local build=BUILD-gpu
  set -e
  # No distributed mode in the bundle (gRPC, UCX): the gate runs single-host Managers.
  cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DORBITKV_BUILD_PYTHON=OFF -DORBITKV_WITH_CUDA=ON \
    -DORBITKV_WITH_ETCD=OFF -DORBITKV_WITH_UCX=OFF >/dev/null
  ninja -C "$build" -j"${ORBITKV_JOBS:-1}" gpu_copy_engine_test gpu_bench orbitkv-manager gpu_ipc_engine
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/tests/gpu" "$bundle/python/orbitkv"
  local binary
  for binary in "${binaries[@]}"; do
    cp "$build/$binary" "$bundle/bin/"
    copy_libs "$build/$binary" "$bundle/lib" || exit 4
  done
  # The torch engine loads its export helper from the client module's source (the GPU machine's Python cannot
  # import the native module built here).
  cp tests/gpu/torch_engine.py "$bundle/tests/gpu/"
  cp python/orbitkv/client.py "$bundle/python/orbitkv/"
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
  # Several GPUs: how they connect (the bench's restore_gpu_64k_all restores on all of them at once).
  if [[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]]; then
    nvidia-smi topo -m 2>&1 | tee "$out/topo.txt" | sed 's/^/  /' || true
  fi
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
  # What a native module for this Python would need, and what torch offers for exporting CUDA tensors.
  python3 - <<'PROBE' 2>&1 | sed 's/^/  /'
import importlib.util, os, sysconfig
print("python", sysconfig.get_python_version(), "Python.h:",
      os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
      "pybind11:", importlib.util.find_spec("pybind11") is not None)
try:
    import torch
    p = torch.cuda.get_device_properties(0)
    x = torch.empty(1024, device="cuda")[16:]
    s = x.untyped_storage()._share_cuda_()
    print("torch", torch.__version__, "pci (domain, bus, device):", p.pci_domain_id, p.pci_bus_id, p.pci_device_id,
          "| _share_cuda_:", len(s), "fields, handle", len(s[1]), "bytes, storage offset", s[3],
          "| tensor storage_offset", x.storage_offset())
except Exception as e:  # a probe: report, do not fail
    print("torch probe failed:", repr(e))
PROBE
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

# Starts orbitkv-manager on socket $1 with log $2 and the remaining flags; sets manager_pid; waits until it serves.
start_manager() {
  local socket=$1 log=$2
  shift 2
  "$bundle/bin/orbitkv-manager" --socket "$socket" --log-file "$log" "$@" >"$log.stdout" 2>&1 &
  manager_pid=$!
  local i
  for i in $(seq 300); do
    # It prints "ready" once it serves (its log file is flushed later).
    grep -q "ready on" "$log.stdout" 2>/dev/null && return 0
    kill -0 "$manager_pid" 2>/dev/null || { echo "  the Manager exited:"; tail -5 "$log" "$log.stdout"; return 1; }
    sleep 0.1
  done
  echo "  the Manager did not start"
  return 1
}

# Stops the Manager with SIGTERM; fails unless it exits 0 (copy engines drained, then the pool, the IPC mappings
# and the CUDA registration of the pool released in order).
stop_manager() {
  kill -TERM "$manager_pid"
  wait "$manager_pid"
  local rc=$?
  [[ $rc -eq 0 ]] || echo "  the Manager exited with status $rc"
  return $rc
}

# One engine process of the gate: $1 = the exit status it must have, then its flags.
engine_step() {
  local expect=$1
  shift
  "$bundle/bin/gpu_ipc_engine" --socket "$socket" "$@" >>"$out/process_gate.jsonl" 2>>"$out/process_gate.err"
  local rc=$?
  printf '  %-62s rc=%-3s %s\n' "$*" "$rc" "$([[ $rc -eq $expect ]] && echo ok || echo "FAILED (want $expect)")"
  [[ $rc -eq $expect ]]
}

process_gate() {
  local dir failed=0 layout base
  dir="$(mktemp -d /tmp/orbitkv-gpu-gate.XXXXXX)"
  : >"$out/process_gate.jsonl"
  : >"$out/process_gate.err"
  socket="$dir/manager.sock"
  start_manager "$socket" "$out/manager.log" --dram 4GiB || return 1
  for layout in kv mla; do
    base=$([[ $layout == kv ]] && echo 10 || echo 20)
    engine_step 0 --layout "$layout" --mode cycle --instance $((base + 1)) --seed $((base + 1)) || failed=1
    # 137: killed by its own SIGKILL while the restore is in flight.
    engine_step 137 --layout "$layout" --mode die --instance $((base + 2)) --seed $((base + 2)) || failed=1
    engine_step 0 --layout "$layout" --mode after-death --instance $((base + 3)) --seed $((base + 2)) || failed=1
    # The Manager stopped (kill -STOP) during a CUDA IPC restore: the engine's wait returns at its timeout, the
    # unclaimed restore is abandoned and never writes the GPU pages, and after kill -CONT a restore is exact.
    engine_step 0 --layout "$layout" --mode stopped --manager-pid "$manager_pid" --instance $((base + 4)) \
      --seed $((base + 4)) || failed=1
  done
  # torch in its own environment (the bundle's libraries are for the bundle's binaries only).
  if env -u LD_LIBRARY_PATH ORBITKV_GATE_LIBRARY_PATH="$LD_LIBRARY_PATH" \
    python3 "$bundle/tests/gpu/torch_engine.py" "$bundle/bin/gpu_ipc_engine" "$socket" \
    >>"$out/process_gate.jsonl" 2>>"$out/process_gate.err"; then
    echo "  torch_engine.py (a torch bf16 tensor exported as orbitkv.client does)           ok"
  else
    echo "  torch_engine.py FAILED"
    failed=1
  fi
  stop_manager || failed=1
  grep -q "GPU(s) usable" "$out/manager.log" || { echo "  the Manager did not find the GPU"; failed=1; }
  # A Manager that sees no GPU serves CPU engines and refuses CUDA buffers with a clear error.
  socket="$dir/nogpu.sock"
  CUDA_VISIBLE_DEVICES="" start_manager "$socket" "$out/manager_nogpu.log" --dram 256MiB || return 1
  engine_step 0 --mode no-gpu --instance 99 || failed=1
  stop_manager || failed=1
  echo "  engine output:"
  sed 's/^/    /' "$out/process_gate.jsonl"
  grep -v '^$' "$out/process_gate.err" | sed 's/^/    stderr: /' | head -20
  grep -E "GPU|CUDA IPC|cleaned up|released|error|warn" "$out/manager.log" "$out/manager_nogpu.log" |
    sed 's/^.*manager: /    manager: /' | head -30
  rm -rf "$dir"
  return $failed
}

run() {
  mkdir -p "$out"
  probe
  local binary
  for binary in gpu_copy_engine_test gpu_bench orbitkv-manager gpu_ipc_engine; do
    if [[ ! -x "$bundle/bin/$binary" ]]; then
      echo "run_gate.sh: no $binary in $bundle; run 'tests/gpu/run_gate.sh pack' on a CPU machine and carry it" >&2
      exit 4
    fi
  done
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
  echo "== process gate (orbitkv-manager and engine processes, CUDA IPC)"
  process_gate
  local gate_rc=$?
  local bench_rc=0 summary_rc=0
  if [[ "${ORBITKV_GPU_GATE_SKIP_BENCH:-0}" != 1 ]]; then
    echo "== benchmark (gpu_bench --json)"
    "$bundle/bin/gpu_bench" --json >"$out/gpu_bench.json" 2>"$out/gpu_bench.err"
    bench_rc=$?
    cat "$out/gpu_bench.err"
    summary_rc=2
    if [[ $bench_rc -eq 0 ]]; then
      summarize "$out/gpu_bench.json"
      summary_rc=$?
    fi
  fi
  echo "== result: unit tests rc=$test_rc, process gate rc=$gate_rc, bench rc=$bench_rc"
  [[ $test_rc -ne 0 ]] && exit 1
  [[ $gate_rc -ne 0 ]] && exit 5
  [[ $bench_rc -ne 0 ]] && exit 2
  exit "$summary_rc"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) sed -n '2,25s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
