# Finds required and optional dependencies and records a line for the configure summary per dependency.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
# Abseil's SwissTables for the block table and the inventory view (libabsl-dev; gRPC needs it too).
find_package(absl REQUIRED CONFIG)
# The core pool binds arenas to NUMA nodes (libnuma) and finds the nodes near each device (hwloc).
pkg_check_modules(NUMA REQUIRED IMPORTED_TARGET numa)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
if(ORBITKV_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
if(ORBITKV_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
endif()

set(ORBITKV_SUMMARY "")
macro(orbitkv_summary_line text)
  list(APPEND ORBITKV_SUMMARY "${text}")
endmacro()

# xxh3 checksums (transfer fragments, SSD records) through orbitkv::xxh3 (src/base/xxh3.h): libxxhash's
# runtime-dispatched entry points where it has them (AVX2 or AVX-512 when the CPU has them: about twice as fast as
# its SSE2 default on the 2-core VM), the plain ones otherwise. The same hash either way.
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET GLOBAL libxxhash)
include(CheckCXXSourceCompiles)
set(CMAKE_REQUIRED_LIBRARIES PkgConfig::XXHASH)
check_cxx_source_compiles("
#include <xxhash.h>
#include <xxh_x86dispatch.h>
int main() { XXH3_state_t* s = XXH3_createState(); XXH3_64bits_update_dispatch(s, \"a\", 1);
  return static_cast<int>(XXH3_64bits_dispatch(\"a\", 1) & 1); }" ORBITKV_HAVE_XXH3_DISPATCH)
unset(CMAKE_REQUIRED_LIBRARIES)
add_library(orbitkv_xxh3 INTERFACE)
add_library(orbitkv::xxh3 ALIAS orbitkv_xxh3)
target_link_libraries(orbitkv_xxh3 INTERFACE PkgConfig::XXHASH)
if(ORBITKV_HAVE_XXH3_DISPATCH)
  target_compile_definitions(orbitkv_xxh3 INTERFACE ORBITKV_XXH3_DISPATCH=1)
  orbitkv_summary_line("xxh3: libxxhash ${XXHASH_VERSION}, dispatched to the CPU's widest vectors")
else()
  orbitkv_summary_line("xxh3: libxxhash ${XXHASH_VERSION}, its default (no runtime dispatch in this build)")
endif()

# orbitkv_optional_dependency(NAME FOUND_VAR DETAIL): applies the AUTO|ON|OFF rule for ORBITKV_WITH_<NAME>
# and sets ORBITKV_HAVE_<NAME>.
function(orbitkv_optional_dependency name found detail)
  set(mode "${ORBITKV_WITH_${name}}")
  if(mode STREQUAL "OFF")
    set(ORBITKV_HAVE_${name} OFF PARENT_SCOPE)
    set(line "${name}: off (ORBITKV_WITH_${name}=OFF)")
  elseif(${found})
    set(ORBITKV_HAVE_${name} ON PARENT_SCOPE)
    set(line "${name}: yes (${detail})")
  elseif(mode STREQUAL "ON")
    message(FATAL_ERROR "ORBITKV_WITH_${name}=ON but ${name} was not found (${detail}); "
                        "run scripts/bootstrap or configure with -DORBITKV_WITH_${name}=AUTO")
  else()
    set(ORBITKV_HAVE_${name} OFF PARENT_SCOPE)
    set(line "${name}: skipped, not found (${detail})")
  endif()
  set(ORBITKV_SUMMARY ${ORBITKV_SUMMARY} "${line}" PARENT_SCOPE)
endfunction()

# CUDA: nvcc compiles here even without a driver; the GPU module (DESIGN.md §3) builds whenever it is found.
set(cuda_found OFF)
set(cuda_detail "nvcc not found")
if(NOT ORBITKV_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(cuda_found ON)
    set(cuda_detail "${CMAKE_CUDA_COMPILER}")
  endif()
endif()
orbitkv_optional_dependency(CUDA cuda_found "${cuda_detail}")

set(uring_found OFF)
if(NOT ORBITKV_WITH_IO_URING STREQUAL "OFF")
  pkg_check_modules(LIBURING IMPORTED_TARGET liburing)
  set(uring_found ${LIBURING_FOUND})
endif()
orbitkv_optional_dependency(IO_URING uring_found "liburing ${LIBURING_VERSION}")

set(ucx_found OFF)
if(NOT ORBITKV_WITH_UCX STREQUAL "OFF")
  pkg_check_modules(UCX IMPORTED_TARGET ucx)
  set(ucx_found ${UCX_FOUND})
endif()
orbitkv_optional_dependency(UCX ucx_found "ucx ${UCX_VERSION}")

# ETCD: the cluster module needs gRPC C++ with its protoc plugin; its tests need a real etcd binary.
set(etcd_found OFF)
set(etcd_detail "needs grpc++, protoc, grpc_cpp_plugin")
if(NOT ORBITKV_WITH_ETCD STREQUAL "OFF")
  pkg_check_modules(GRPCPP IMPORTED_TARGET grpc++)
  find_program(ORBITKV_PROTOC protoc)
  find_program(ORBITKV_GRPC_CPP_PLUGIN grpc_cpp_plugin)
  find_program(ORBITKV_ETCD_BIN etcd PATHS /usr/bin /usr/sbin)
  if(GRPCPP_FOUND AND ORBITKV_PROTOC AND ORBITKV_GRPC_CPP_PLUGIN)
    set(etcd_found ON)
    set(etcd_detail "grpc++ ${GRPCPP_VERSION}, etcd binary: ${ORBITKV_ETCD_BIN}")
  endif()
endif()
orbitkv_optional_dependency(ETCD etcd_found "${etcd_detail}")

function(orbitkv_print_summary)
  message(STATUS "")
  message(STATUS "OrbitKV ${PROJECT_VERSION} configuration")
  message(STATUS "  build type: ${CMAKE_BUILD_TYPE}, compiler: ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}")
  message(STATUS "  ccache: ${ORBITKV_CCACHE}")
  message(STATUS "  sanitizer: ${ORBITKV_SANITIZER}  werror: ${ORBITKV_WERROR}")
  message(STATUS "  tests: ${ORBITKV_BUILD_TESTS}  benchmarks: ${ORBITKV_BUILD_BENCHMARKS}  "
                 "fuzzers: ${ORBITKV_BUILD_FUZZERS}  python: ${ORBITKV_BUILD_PYTHON}")
  foreach(line IN LISTS ORBITKV_SUMMARY)
    message(STATUS "  ${line}")
  endforeach()
  message(STATUS "")
endfunction()
