# membox_cc_library / membox_cc_test: the one way targets are declared
# (abseil's absl_cc_library habit). Warnings and sanitizers are attached per
# target through an interface library, never through CMAKE_CXX_FLAGS.

add_library(membox_build_flags INTERFACE)
target_compile_features(membox_build_flags INTERFACE cxx_std_20)
target_compile_options(membox_build_flags INTERFACE
  -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  target_compile_options(membox_build_flags INTERFACE -Wthread-safety)
endif()
# Warnings in project code fail the build (GCC and clang), with no
# exceptions: the code GCC 12's -Wrestrict / -Wstringop-overflow flagged
# (wire::Writer's appends) was reshaped rather than exempted.
if(MEMBOX_WERROR)
  target_compile_options(membox_build_flags INTERFACE -Werror)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC cannot instrument std::atomic_thread_fence under TSan and says so
    # (-Wtsan); the fences are correct, TSan just cannot see them.
    if(MEMBOX_SANITIZE STREQUAL "thread")
      target_compile_options(membox_build_flags INTERFACE -Wno-error=tsan)
    endif()
  endif()
endif()
if(MEMBOX_SANITIZE)
  target_compile_options(membox_build_flags INTERFACE
    -fsanitize=${MEMBOX_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(membox_build_flags INTERFACE -fsanitize=${MEMBOX_SANITIZE})
endif()
# Fuzzing builds instrument the libraries too: libFuzzer steers by the
# coverage of the decoders it drives, and ASan/UBSan must see inside them
# (instrumenting only the fuzzer's own file left ps_protocol_fuzzer at 56
# coverage points; the decoders give it 567). The fuzzer targets add
# -fsanitize=fuzzer to link libFuzzer's main.
if(MEMBOX_BUILD_FUZZ)
  target_compile_options(membox_build_flags INTERFACE
    -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer)
  target_link_options(membox_build_flags INTERFACE -fsanitize=address,undefined)
endif()

# Private headers and the layering rule (docs/design/layers.md). There is no
# repository-root include path: every target sees include/ (the public
# headers) and, through a directory of its own under build/private/, only
# the private tree of its own layer -- so `#include "src/ps/protocol.h"`
# from the embedding layer does not compile. membox_private_dir(<tree> OUT)
# makes build/private/<name>/<tree> a link to the source tree <tree>
# ("src/ps", "bench", "tests") and returns build/private/<name>.
function(membox_private_dir tree out)
  string(REPLACE "/" "_" name "${tree}")
  set(dir ${PROJECT_BINARY_DIR}/private/${name})
  get_filename_component(parent ${dir}/${tree} DIRECTORY)
  file(MAKE_DIRECTORY ${parent})
  if(NOT EXISTS ${dir}/${tree})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${tree} ${dir}/${tree} SYMBOLIC)
  endif()
  set(${out} ${dir} PARENT_SCOPE)
endfunction()

# The private tree of the directory being configured: src/<layer>, bench or
# tests.
function(membox_own_private_dir out)
  file(RELATIVE_PATH tree ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  membox_private_dir(${tree} dir)
  set(${out} ${dir} PARENT_SCOPE)
endfunction()

# membox_cc_library(NAME n SRCS ... DEPS ...)
function(membox_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS" ${ARGN})
  add_library(${ARG_NAME} STATIC ${ARG_SRCS})
  target_include_directories(${ARG_NAME} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  membox_own_private_dir(private)
  if(CMAKE_CURRENT_SOURCE_DIR MATCHES "/src/")
    target_include_directories(${ARG_NAME} PRIVATE ${private})
  else()
    # bench/: its headers are the interface of the `membox` tool.
    target_include_directories(${ARG_NAME} PUBLIC
      $<BUILD_INTERFACE:${private}>)
  endif()
  target_link_libraries(${ARG_NAME} PUBLIC membox_build_flags ${ARG_DEPS})
  set_target_properties(${ARG_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

# membox_cc_test(NAME n SRCS ... DEPS ... [LABELS ...] [TIMEOUT s])
function(membox_cc_test)
  if(NOT MEMBOX_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  membox_own_private_dir(private)
  # tests/support: helpers every layer's tests share (public headers only).
  membox_private_dir(tests/support support)
  target_include_directories(${ARG_NAME} PRIVATE ${private} ${support})
  target_link_libraries(${ARG_NAME} PRIVATE membox_build_flags ${ARG_DEPS}
    GTest::gtest GTest::gmock GTest::gtest_main)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_test(NAME ${ARG_NAME} COMMAND ${ARG_NAME})
  set_tests_properties(${ARG_NAME} PROPERTIES TIMEOUT ${ARG_TIMEOUT}
    LABELS "unit;${ARG_LABELS}")
endfunction()
