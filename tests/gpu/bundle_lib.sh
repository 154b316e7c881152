# Shared by the GPU bundles' `pack` (run_gate.sh, run_cluster.sh): what a bare Ubuntu 24.04 already has, and the
# copy of every other shared library a binary loads.
# shellcheck shell=bash

# The C library and its parts, the dynamic loader and the compiler runtime: every glibc system has them, never
# carried (Ubuntu 24.04's libstdc++ and libgcc_s are newer than this machine's, and backward compatible).
system_lib() {
  [[ "$1" =~ ^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+\.|libgcc_s\.) ]]
}

# Copies into $2 every shared library binary $1 loads that a bare system lacks (as ldd resolves them, recursively);
# fails naming the library when one is not found here.
copy_libs() {
  local lib path
  while read -r lib _ path _; do
    system_lib "$lib" && continue
    [[ -f "$path" ]] || { echo "pack: $1 needs $lib, not found here" >&2; return 1; }
    [[ -f "$2/$lib" ]] || cp -L "$path" "$2/$lib"
  done < <(ldd "$1" | grep '=>')
}
