#!/usr/bin/env bash
# The engine-level GPU gates (issues 7 and 8) on the GPU machine: the vLLM connector's correctness gate with the
# reference engine and its KV caches on CUDA (python/tests/test_vllm_refengine.py: logits and tokens bit-identical
# with and without OrbitKV restoring the prefixes through CUDA IPC, SWA + full hybrid, a Manager killed mid-restore),
# the SGLang gate (python/tests/test_sglang_gate.py: the reference engine served SGLang-style with its device KV pool
# on CUDA, through the CPU host pool + OrbitKV L3 and through OrbitKVLinker with the pool registered by CUDA IPC;
# tokens and logits bit-identical to a recompute on the same GPU), and the TTFT benchmark
# (benches/ttft_bench.py on the Qwen3-8B-shaped model, medians of 5 runs, both load modes; targets of issue 23:
# ttft_8k_cached (layer-wise) at most 0.9x the serial ttft_8k_ideal, ttft_8k_recompute at least 10x
# ttft_8k_cached, and at every length ttft_*_cached_vs_recompute at most 1.02).
#
# Usage, from anywhere in the repository:
#   tests/gpu/run_engines.sh pack   On a CPU machine: runs `tests/gpu/run_gate.sh pack` (orbitkv-manager and its
#                                   libraries into BUILD-gpu-gate/) and builds orbitkv._native for the GPU machine's
#                                   Python 3.12 as a fallback (BUILD-py312local with $ORBITKV_PY312, default the
#                                   pyenv 3.12 interpreter), copied with libspdlog/libfmt into BUILD-engines-carry/.
#   tests/gpu/run_engines.sh run    On the GPU machine: builds orbitkv._native there (cmake + ninja in BUILD-py312,
#                                   only what the module needs); if that configure or build fails, installs the
#                                   carried module instead. Checks that a Manager started there finds the GPU, then
#                                   runs the gates and the bench; the tests and the bench start their own Managers.
# With the device tool:
#   tests/gpu/run_engines.sh pack   then
#   run(command="tests/gpu/run_engines.sh run", carry=["BUILD-gpu-gate", "BUILD-engines-carry"])
# Every step runs under `timeout`, so a hang costs at most its limit (about 9 minutes in all, 2-4 normally).
#
# The gates include the TP=2 ones (two ranks, each its shard of the heads, its own KV caches and connector or
# linker, meeting in the model's all-reduces): one rank per GPU where the machine has two, else both on one GPU.
# Environment: OUT: folder for the logs, ttft.json and ttft.png (the device tool sets it); ORBITKV_TTFT_LENGTHS:
# the bench's prompt lengths (default 1024,4096,8192,16384); ORBITKV_ENGINES_GATES: the gate files (default the
# vLLM refengine, SGLang and vLLM connector gates); ORBITKV_ENGINES_SKIP_GATES=1 / ORBITKV_ENGINES_SKIP_BENCH=1:
# leave the gates / the bench out;
# ORBITKV_ENGINES_CARRIED=1: install the carried orbitkv._native without trying a build there (saves minutes).
# Exit status: 0 every gate passed and both TTFT targets were met; 1 no usable orbitkv._native; 2 a gate failed;
# 3 the bench failed; 4 a TTFT target was missed; 5 no usable Manager bundle.
set -uo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
bundle=BUILD-gpu-gate
carried=BUILD-engines-carry
out="${OUT:-$root/BUILD-engines-out}"

pack() {
  set -e
  tests/gpu/run_gate.sh pack
  local py="${ORBITKV_PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}"
  cmake -G Ninja -S . -B BUILD-py312local -DCMAKE_BUILD_TYPE=Release -DORBITKV_BUILD_TESTS=OFF \
    -DORBITKV_BUILD_BENCHMARKS=OFF -DORBITKV_WITH_UCX=OFF -DORBITKV_WITH_ETCD=OFF -DORBITKV_WITH_IO_URING=OFF \
    -DORBITKV_WITH_CUDA=OFF -DORBITKV_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" >/dev/null
  ninja -C BUILD-py312local -j"${ORBITKV_JOBS:-2}" orbitkv_native
  rm -rf "$carried"
  mkdir -p "$carried"
  cp python/orbitkv/_native.cpython-312-x86_64-linux-gnu.so "$carried/"
  # Ubuntu 24.04 has libfmt9 but spdlog 1.12: the module's spdlog 1.10 travels (and fmt, to match it).
  cp -L "$bundle/lib/libspdlog.so.1.10" "$bundle/lib/libfmt.so.9" "$carried/"
  ls -l "$carried"
}

# Builds orbitkv._native with this machine's python3, or installs the carried one; sets build_dir.
native() {
  local py pybind
  py="$(command -v python3)"
  pybind="$(python3 -m pybind11 --cmakedir 2>/dev/null)"
  echo "== orbitkv._native for $("$py" --version) ($py)"
  if [[ "${ORBITKV_ENGINES_CARRIED:-0}" != 1 ]] && timeout 90 cmake -G Ninja -S . -B BUILD-py312 -DCMAKE_BUILD_TYPE=Release -DORBITKV_BUILD_TESTS=OFF \
      -DORBITKV_BUILD_BENCHMARKS=OFF -DORBITKV_WITH_UCX=OFF -DORBITKV_WITH_ETCD=OFF -DORBITKV_WITH_IO_URING=OFF \
      -DORBITKV_WITH_CUDA=OFF -DORBITKV_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" ${pybind:+-Dpybind11_DIR="$pybind"} \
      >"$out/native_build.log" 2>&1 &&
    timeout 240 ninja -C BUILD-py312 -j"$(nproc)" orbitkv_native >>"$out/native_build.log" 2>&1; then
    echo "  built here (BUILD-py312)"
    build_dir=BUILD-py312
  else
    if [[ "${ORBITKV_ENGINES_CARRIED:-0}" == 1 ]]; then
      echo "  no build here (ORBITKV_ENGINES_CARRIED=1)"
    else
      echo "  the build here failed (BUILD-py312; last lines of native_build.log):"
      grep -E "Could NOT|not found|Error|error" "$out/native_build.log" | head -8 | sed 's/^/    /'
    fi
    if [[ ! -f "$carried/_native.cpython-312-x86_64-linux-gnu.so" ]]; then
      echo "  and no carried module in $carried: run 'tests/gpu/run_engines.sh pack' and carry it"
      return 1
    fi
    cp "$carried/_native.cpython-312-x86_64-linux-gnu.so" python/orbitkv/
    # Only the module's own libraries (not the bundle's libcrypto, which torch's process must not see).
    export LD_LIBRARY_PATH="$root/$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "  installed the module carried in $carried (built on the CPU machine for Python 3.12)"
    # The tests find the Manager under a build directory (ORBITKV_BUILD_DIR); this one holds only the bundle's.
    build_dir=BUILD-engines
    mkdir -p "$build_dir"
    echo "# run_engines.sh: no CMake build on this machine; src/server/orbitkv-manager is the bundle's" \
      >"$build_dir/build.ninja"
  fi
  (cd python && python3 -c "import orbitkv, orbitkv._native as n; print('  import ok:', n.__file__)") ||
    return 1
}

# The Manager: the bundle's binary behind a wrapper that gives it (and only it) the bundle's libraries.
manager() {
  [[ -x "$bundle/bin/orbitkv-manager" ]] || { echo "no $bundle/bin/orbitkv-manager: pack and carry it"; return 1; }
  mkdir -p "$build_dir/src/server"
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$root/$bundle/lib" "$root/$bundle/bin/orbitkv-manager" \
    >"$build_dir/src/server/orbitkv-manager"
  chmod +x "$build_dir/src/server/orbitkv-manager"
  echo "== Manager (bundle: $(head -1 "$bundle/MANIFEST" 2>/dev/null))"
  local dir pid i
  dir="$(mktemp -d /tmp/orbitkv-engines.XXXXXX)"
  "$build_dir/src/server/orbitkv-manager" --socket "$dir/m.sock" --dram 1GiB --log-file "$out/manager.log" \
    >"$dir/stdout" 2>&1 &
  pid=$!
  for i in $(seq 200); do
    grep -q "ready on" "$dir/stdout" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -TERM "$pid" 2>/dev/null
  timeout 30 tail --pid="$pid" -f /dev/null
  sleep 0.5
  grep -hE "GPU|ready on" "$dir/stdout" "$out/manager.log" 2>/dev/null | sed 's/^/  /' | head -5
  grep -q "GPU(s) usable" "$out/manager.log" "$dir/stdout" 2>/dev/null || { echo "  the Manager found no GPU"; return 1; }
}

ttft_summary() {
  python3 - "$out/ttft.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
# Issue 23: the layer-wise restore beats the serial ideal; a cached request is never slower than recompute.
targets = {"ttft_8k_cached": ("<=", 0.9), "ttft_8k_recompute": (">=", 10.0), "restore_8k_gbps": (">=", 0.95),
           **{f"ttft_{k}_cached_vs_recompute": ("<=", 1.02) for k in ("1k", "4k", "8k", "16k")}}
missed = 0
for r in report["results"]:
    op, bound = targets.get(r["metric"], (None, None))
    verdict = ""
    if op:
        ok = r["ratio"] <= bound if op == "<=" else r["ratio"] >= bound
        missed += not ok
        verdict = f"target ratio {op} {bound}: {'met' if ok else 'MISSED'}"
    print(f"  {r['metric']:30} {r['value']:10.2f} {r['unit']:4} {r['baseline_metric']:>22} {r['baseline']:10.2f}"
          f"  ratio {r['ratio']:7.3f}  {verdict}")
env = report["env"]
print("  " + ", ".join(f"{k}={env[k]}" for k in ("device", "model", "chunk", "pinned_h2d_peak_gbps") if k in env))
for row in env["rows"]:
    print(f"    {row}")
sys.exit(4 if missed else 0)
EOF
}

run() {
  mkdir -p "$out"
  echo "== GPU machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  python3 -c "import sys, torch; print('  python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.cuda.is_available())"
  # The TP=2 gates (vLLM and SGLang, *tensor_parallel*) put rank r on GPU r % count: one GPU per rank on a
  # two-GPU machine, both ranks side by side on one GPU otherwise.
  local gpus
  gpus="$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)"
  if [[ "$gpus" -ge 2 ]]; then
    echo "  $gpus GPUs: the TP=2 gates run one rank per GPU (cuda:0, cuda:1)"
    nvidia-smi topo -m 2>&1 | sed 's/^/  /' | tee "$out/topo.txt" | head -12
  else
    echo "  $gpus GPU: the TP=2 gates run both ranks on cuda:0 (two ranks on one device)"
  fi
  native || exit 1
  manager || exit 5
  export ORBITKV_BUILD_DIR="$build_dir" PYTHONUNBUFFERED=1 PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  local gates=0
  if [[ "${ORBITKV_ENGINES_SKIP_GATES:-0}" != 1 ]]; then
  echo "== gates (pytest)"
  local per_test=()
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
  local files=(${ORBITKV_ENGINES_GATES:-python/tests/test_vllm_refengine.py python/tests/test_sglang_gate.py
    python/tests/test_vllm_connector.py})
  timeout 300 python3 -m pytest "${files[@]}" -p no:cacheprovider -q -rA "${per_test[@]}" >"$out/gates.log" 2>&1
  gates=$?
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gates.log" | grep -v "^PASSED.*connector" | head -40
  [[ $gates -eq 0 ]] || grep -B2 -A25 -m3 "^_____" "$out/gates.log" | head -80
  fi
  if [[ "${ORBITKV_ENGINES_SKIP_BENCH:-0}" == 1 ]]; then
    echo "== result: gates rc=$gates (bench left out: ORBITKV_ENGINES_SKIP_BENCH=1)"
    [[ $gates -ne 0 ]] && exit 2
    exit 0
  fi
  echo "== TTFT bench (benches/ttft_bench.py --json)"
  timeout 480 python3 benches/ttft_bench.py --json --plot "$out/ttft.png" \
    --lengths "${ORBITKV_TTFT_LENGTHS:-1024,4096,8192,16384}" >"$out/ttft.json" 2>"$out/ttft.err"
  local bench=$? summary=3
  tail -5 "$out/ttft.err"
  if [[ $bench -eq 0 ]]; then
    ttft_summary
    summary=$?
  fi
  echo "== result: gates rc=$gates, bench rc=$bench"
  [[ $gates -ne 0 ]] && exit 2
  [[ $bench -ne 0 ]] && exit 3
  exit "$summary"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) sed -n '2,34s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
