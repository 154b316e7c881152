#!/usr/bin/env bash
# Distributed mode on the GPU machine (issue 57): three Managers as three hosts on one machine (etcd and three
# orbitkv-managers on loopback, each with its own pool, socket, gRPC peer port and UCX port; UCX over TCP on `lo`, so
# the figures compare with this machine's), the gate across hosts and the remote-fetch figures.
#
# Usage, from anywhere in the repository:
#   tests/gpu/run_cluster.sh pack        Here (a CPU machine with nvcc): builds orbitkv-manager with UCX, gRPC and CUDA,
#                                        the orbitkv CLI, the transfer bench and its test peer (BUILD-gpu-cluster/),
#                                        and bundles them with this machine's etcd and iperf3, every shared library
#                                        they load that a bare Ubuntu 24.04 lacks, and UCX's transport modules,
#                                        stripped and compressed, into BUILD-cluster-carry/cluster.tar.xz. Fails
#                                        with a clear message when the working tree and everything the GPU runs carry
#                                        pass 56 MiB (the device tool's limit is 64). Also runs
#                                        `tests/gpu/run_engines.sh pack` when BUILD-engines-carry/ is missing (the
#                                        Python 3.12 orbitkv._native the engines need there).
#   tests/gpu/run_cluster.sh run gates   On the GPU machine: unpacks the bundle, installs the carried orbitkv._native,
#                                        and runs python/tests/cluster_gate.py (etcd and three Managers it starts and
#                                        prints; the vLLM reference engine with CUDA KV caches saves through host a,
#                                        hosts b and c restore after a peer fetch through CUDA IPC, bit-identical to a
#                                        recompute; an engine killed mid-restore; the SGLang linker once).
#   tests/gpu/run_cluster.sh run figures On the GPU machine: benches/distributed_bench.py --loopback (remote_fetch_gbps
#                                        against transfer_read_1m and iperf3 on the same loopback, CPU seconds per GB,
#                                        the fetch workers at 2, 4 and 8, and the GPU TTFT of 4K and 8K
#                                        Qwen3-8B-shaped prefixes from a peer, local DRAM and recompute, plotted).
#   tests/gpu/run_cluster.sh run         Both, gates first.
#   tests/gpu/run_cluster.sh run --cpu   Here, with build/'s binaries (ORBITKV_BUILD_DIR) and the CPU reference
#                                        engine: the same gate, shared-memory KV caches (part of scripts/test).
# With the device tool (two calls: the gates, then the figures):
#   tests/gpu/run_cluster.sh pack   then
#   run(command="tests/gpu/run_cluster.sh run gates", carry=["BUILD-cluster-carry", "BUILD-engines-carry"])
# Environment: OUT: a folder for the logs, the bench JSON and the plot (the device tool sets it);
# ORBITKV_JOBS: build jobs for pack (default 2).
# Exit status: 0 all passed; 1 no usable bundle or orbitkv._native; 2 the gate failed; 3 the figures failed; 4 the
# bundle is too large (pack).
set -uo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
carry=BUILD-cluster-carry
build=BUILD-gpu-cluster
out="${OUT:-$root/BUILD-cluster-out}"
limit_mib=56

# system_lib and copy_libs.
# shellcheck source=tests/gpu/bundle_lib.sh
source "$root/tests/gpu/bundle_lib.sh"

pack() {
  set -e
  [[ -f BUILD-engines-carry/_native.cpython-312-x86_64-linux-gnu.so ]] || tests/gpu/run_engines.sh pack
  command -v etcd >/dev/null && command -v iperf3 >/dev/null ||
    { echo "run_cluster.sh: etcd and iperf3 must be installed here (scripts/bootstrap)" >&2; exit 1; }
  cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DORBITKV_BUILD_PYTHON=OFF -DORBITKV_WITH_CUDA=ON \
    -DORBITKV_WITH_ETCD=ON -DORBITKV_WITH_UCX=ON >/dev/null
  ninja -C "$build" -j"${ORBITKV_JOBS:-2}" orbitkv-manager orbitkv transfer_bench transfer_test_peer
  local stage binary ucx_modules
  stage="$(mktemp -d /tmp/orbitkv-cluster-pack.XXXXXX)"
  mkdir -p "$stage/bin" "$stage/lib/ucx"
  for binary in src/server/orbitkv-manager tools/orbitkv benches/transfer_bench src/transfer/transfer_test_peer; do
    cp "$build/$binary" "$stage/bin/"
  done
  cp "$(command -v etcd)" "$(command -v iperf3)" "$stage/bin/"
  for binary in "$stage"/bin/*; do copy_libs "$binary" "$stage/lib"; done
  # UCX loads its transport modules at start-up from UCX_MODULE_DIR (run sets it): every one here, and what they
  # load (verbs, rdmacm), so no module is missing there (the runs use tcp, which lives in libuct itself).
  ucx_modules="$(pkg-config --variable=libdir ucx)/ucx"
  cp -L "$ucx_modules"/*.so.0 "$stage/lib/ucx/"
  for binary in "$stage"/lib/ucx/*.so.0; do copy_libs "$binary" "$stage/lib"; done
  strip --strip-unneeded "$stage"/bin/orbitkv-manager "$stage"/bin/orbitkv "$stage"/bin/transfer_bench \
    "$stage"/bin/transfer_test_peer "$stage"/lib/*.so* "$stage"/lib/ucx/*.so* 2>/dev/null || true
  {
    echo "commit: $(git rev-parse HEAD 2>/dev/null) (plus the working tree)"
    echo "built: $(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1)"
    echo "etcd: $(etcd --version | head -1); iperf3: $(iperf3 --version | head -1)"
  } >"$stage/MANIFEST"
  rm -rf "$carry"
  mkdir -p "$carry"
  tar -C "$stage" -cf - . | xz -T2 -6 >"$carry/cluster.tar.xz"
  rm -rf "$stage"
  # What a GPU run carries: the working tree (tracked and untracked files git does not ignore) and the bundles.
  local tree bundles total
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  bundles=$(du -cb "$carry" BUILD-engines-carry $([[ -d BUILD-gpu-gate ]] && echo BUILD-gpu-gate) | tail -1 |
    cut -f1)
  total=$(( (tree + bundles) >> 20 ))
  echo "run_cluster.sh: $carry/cluster.tar.xz $(( $(stat -c %s "$carry/cluster.tar.xz") >> 20 )) MiB; with the" \
    "working tree and the other bundles $total MiB (limit $limit_mib)"
  if (( total > limit_mib )); then
    echo "run_cluster.sh: $total MiB would travel, over $limit_mib MiB (the device tool takes 64): make the bundle" \
      "smaller (fewer binaries, stronger compression) or carry fewer bundles in the same call" >&2
    exit 4
  fi
}

# The carried orbitkv._native for this machine's Python 3.12 (built by run_engines.sh pack), imported once.
native() {
  local module=BUILD-engines-carry/_native.cpython-312-x86_64-linux-gnu.so
  [[ -f "$module" ]] || { echo "no $module: run 'tests/gpu/run_cluster.sh pack' and carry BUILD-engines-carry"; return 1; }
  cp "$module" python/orbitkv/
  export LD_LIBRARY_PATH="$root/BUILD-engines-carry${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  (cd python && python3 -c "import orbitkv._native as n; print('  orbitkv._native:', n.__file__)")
}

# Unpacks the bundle into BUILD-cluster/ and makes it look like a build tree (src/server/orbitkv-manager, tools/orbitkv,
# benches/, src/transfer/) of wrappers that give the bundle's binaries (and only them) its libraries.
unpack() {
  [[ -f "$carry/cluster.tar.xz" ]] || { echo "no $carry/cluster.tar.xz: run 'tests/gpu/run_cluster.sh pack' and carry it"; return 1; }
  local dir="$root/BUILD-cluster" wrapper
  rm -rf "$dir"
  mkdir -p "$dir/bundle" "$dir/src/server" "$dir/tools" "$dir/benches" "$dir/src/transfer" "$dir/bin"
  xz -dc "$carry/cluster.tar.xz" | tar -C "$dir/bundle" -xf - || return 1
  for wrapper in src/server/orbitkv-manager tools/orbitkv benches/transfer_bench src/transfer/transfer_test_peer \
      bin/etcd bin/iperf3; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" UCX_MODULE_DIR="%s" exec "%s" "$@"\n' "$dir/bundle/lib" \
      "$dir/bundle/lib/ucx" "$dir/bundle/bin/$(basename "$wrapper")" >"$dir/$wrapper"
    chmod +x "$dir/$wrapper"
  done
  # The bench rebuilds nothing where there is no CMake tree: it checks for build.ninja.
  echo "# run_cluster.sh: the bundle's binaries behind wrappers; no CMake build on this machine" >"$dir/build.ninja"
  export PATH="$dir/bin:$PATH" ORBITKV_BUILD_DIR="$dir"
  echo "== bundle: $(head -1 "$dir/bundle/MANIFEST")"
  echo "  $(etcd --version | head -1); $(iperf3 --version | head -1)"
}

gates() {
  echo "== the gate across hosts (python/tests/cluster_gate.py)"
  local per_test=()
  local py="${ORBITKV_PYTHON:-python3}"
  "$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 240)
  PYTHONUNBUFFERED=1 timeout "${ORBITKV_CLUSTER_GATE_TIMEOUT:-420}" "$py" -m pytest python/tests/cluster_gate.py \
    -p no:cacheprovider -q -rA "${per_test[@]}" 2>&1 | tee "$out/cluster_gate.log" |
    grep -E "^cluster_gate:|^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error"
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || grep -B2 -A40 -m3 "^_____" "$out/cluster_gate.log" | head -120
  return "$rc"
}

figures() {
  echo "== the figures (benches/distributed_bench.py --loopback --fetch-workers 2,4,8 --gpu-ttft 4096,8192)"
  PYTHONUNBUFFERED=1 timeout "${ORBITKV_CLUSTER_FIGURES_TIMEOUT:-480}" python3 benches/distributed_bench.py --json \
    --loopback --fetch-workers 2,4,8 --gpu-ttft 4096,8192 --plot "$out/ttft_gpu_remote.png" \
    >"$out/distributed.json" 2>"$out/distributed.err"
  local rc=$?
  tail -15 "$out/distributed.err"
  [[ $rc -eq 0 ]] && python3 - "$out/distributed.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
for r in report["results"]:
    ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
    print(f"  {r['metric']:44} {r['value']:12.4f} {r['unit']:8} {r['baseline_metric']:40} {r['baseline']:10.4f} {ratio}")
for k, v in report["env"].items():
    print(f"  {k}: {v}")
EOF
  return "$rc"
}

run() {
  mkdir -p "$out"
  local what="${1:-all}"
  if [[ "$what" == "--cpu" ]]; then
    echo "== run_cluster.sh run --cpu: the gate across hosts with $ORBITKV_BUILD_DIR's binaries, CPU engines"
    ORBITKV_CLUSTER_GATE_MEMORY=shm gates || exit 2
    exit 0
  fi
  echo "== GPU machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)," \
    "$(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB"
  python3 -c "import sys, torch; print('  python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.cuda.is_available())"
  native || exit 1
  unpack || exit 1
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  local rc=0
  if [[ "$what" == all || "$what" == gates ]]; then
    gates || rc=2
  fi
  if [[ "$what" == all || "$what" == figures ]]; then
    figures || { [[ $rc -eq 0 ]] && rc=3; }
  fi
  echo "== result: exit $rc"
  exit "$rc"
}

case "${1:-}" in
  pack) pack ;;
  run)
    if [[ "${2:-}" == "--cpu" ]]; then
      export ORBITKV_BUILD_DIR="${ORBITKV_BUILD_DIR:-build}"
      # The Python that sees Debian's torch (scripts/bootstrap records it), as scripts/test uses.
      # shellcheck disable=SC1091
      [[ -n "${ORBITKV_PYTHON:-}" ]] || { [[ -f .bootstrap/env ]] && source .bootstrap/env && export ORBITKV_PYTHON; }
    fi
    run "${2:-all}" ;;
  *) sed -n '2,36s/^# \{0,1\}//p' "$0"; exit 2 ;;
esac
