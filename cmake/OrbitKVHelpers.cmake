# Helpers every module uses, so that warnings, sanitizers and test registration stay uniform.
#
#   orbitkv_add_library(NAME base SOURCES a.cc ... PUBLIC_DEPS ... PRIVATE_DEPS ...)
#       -> target orbitkv_<NAME>, alias orbitkv::<NAME>; include root is src/ so internal headers read
#          "base/status.h".
#   orbitkv_add_test(NAME status_test SOURCES status_test.cc DEPS orbitkv::base [LABELS unit])
#       -> a GoogleTest binary whose cases ctest discovers at test time, with one label: "unit" (default),
#          "integration" or "concurrency". Concurrency tests run in every suite (ctest -L 'unit|concurrency')
#          and alone under TSan. One label only: gtest_discover_tests cannot carry a list-valued property.
#   orbitkv_add_executable(NAME orbitkv-state-demo SOURCES ... DEPS ...)

function(orbitkv_target_defaults target)
  target_compile_options(${target} PRIVATE ${ORBITKV_WARNINGS})
endfunction()

function(orbitkv_add_library)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(target orbitkv_${ARG_NAME})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(orbitkv::${ARG_NAME} ALIAS ${target})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  orbitkv_target_defaults(${target})
endfunction()

function(orbitkv_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT ORBITKV_BUILD_TESTS)
    return()
  endif()
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  list(LENGTH ARG_LABELS label_count)
  if(NOT label_count EQUAL 1)
    message(FATAL_ERROR "orbitkv_add_test(${ARG_NAME}): give exactly one label, not '${ARG_LABELS}'")
  endif()
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  orbitkv_target_defaults(${ARG_NAME})
  # PRE_TEST discovery keeps the build fast and works under sanitizers. The `distributed` suites build network
  # namespaces with fixed addresses: they run one at a time.
  set(serial FALSE)
  if(ARG_LABELS STREQUAL "distributed")
    set(serial TRUE)
  endif()
  gtest_discover_tests(${ARG_NAME} DISCOVERY_MODE PRE_TEST PROPERTIES LABELS "${ARG_LABELS}" RUN_SERIAL ${serial})
endfunction()

function(orbitkv_add_executable)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;DEPS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS})
  orbitkv_target_defaults(${ARG_NAME})
endfunction()

# orbitkv_add_grpc_proto(NAME target PROTOS dir/a.proto dir/b.proto [SERVICES dir/b.proto])
#   Generates C++ for the protos (paths relative to src/) and, for SERVICES, their gRPC stubs, into a static library
#   `target` whose include root is the generated tree (as system headers: generated code is not ours to warn
#   about). PkgConfig::GRPCPP and PkgConfig::PROTOBUF must be found in the calling directory.
function(orbitkv_add_grpc_proto)
  cmake_parse_arguments(ARG "" "NAME" "PROTOS;SERVICES" ${ARGN})
  set(out ${CMAKE_CURRENT_BINARY_DIR}/gen)
  set(sources "")
  set(headers "")
  set(depends "")
  foreach(proto ${ARG_PROTOS})
    string(REGEX REPLACE "\\.proto$" "" stem ${proto})
    list(APPEND sources ${out}/${stem}.pb.cc)
    list(APPEND headers ${out}/${stem}.pb.h)
    list(APPEND depends ${PROJECT_SOURCE_DIR}/src/${proto})
  endforeach()
  foreach(proto ${ARG_SERVICES})
    string(REGEX REPLACE "\\.proto$" "" stem ${proto})
    list(APPEND sources ${out}/${stem}.grpc.pb.cc)
    list(APPEND headers ${out}/${stem}.grpc.pb.h)
  endforeach()
  add_custom_command(
    OUTPUT ${sources} ${headers}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${out}
    COMMAND ${ORBITKV_PROTOC} -I${PROJECT_SOURCE_DIR}/src --cpp_out=${out} --grpc_out=${out}
            --plugin=protoc-gen-grpc=${ORBITKV_GRPC_CPP_PLUGIN} ${ARG_PROTOS}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/src
    DEPENDS ${depends}
    COMMENT "Generating ${ARG_NAME} (protoc + grpc_cpp_plugin)"
    VERBATIM)
  add_library(${ARG_NAME} STATIC ${sources})
  target_include_directories(${ARG_NAME} SYSTEM PUBLIC ${out})
  target_link_libraries(${ARG_NAME} PUBLIC PkgConfig::GRPCPP PkgConfig::PROTOBUF)
endfunction()

