# cmake -DCONAN=<conan> -DTANDEM_SOURCE_DIR=.. -DWORK_DIR=.. -DGENERATOR=.. -DCXX_COMPILER=..
#       [-DWITH_GLOO=ON] [-DWITH_TORCH=ON] -P run_conan.cmake
# `conan create packaging/conan` as a user runs it, offline: a Conan home of its own in WORK_DIR
# (a detected profile, no remotes), C++20, and test_package built and run from a copy in WORK_DIR
# so the source tree stays clean. With WITH_GLOO, the gloo option on and test_package's Gloo run;
# with WITH_TORCH, the torch option on and test_package linked to tandem::torch (libtorch).
cmake_minimum_required(VERSION 3.25)
if(NOT CONAN)
  message("SKIPPED: no conan on PATH (scripts/setup.sh installs it)")
  return()
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(ENV{CONAN_HOME} "${WORK_DIR}/home")
set(ENV{CXX} "${CXX_COMPILER}")

function(run)
  execute_process(COMMAND ${ARGV} COMMAND_ECHO STDOUT COMMAND_ERROR_IS_FATAL ANY)
endfunction()

run(${CONAN} profile detect)
run(${CONAN} remote remove "*")  # offline: every package comes from this machine
file(COPY "${TANDEM_SOURCE_DIR}/packaging/conan/test_package" DESTINATION "${WORK_DIR}")

set(options "")
if(WITH_GLOO)
  list(APPEND options -o "tandem/*:gloo=True")
endif()
list(APPEND options -o "tandem/*:io=True")
if(WITH_TORCH)
  list(APPEND options -o "tandem/*:torch=True")
endif()
if(GENERATOR STREQUAL "Ninja")
  list(APPEND options -c tools.cmake.cmaketoolchain:generator=Ninja)
endif()
execute_process(
  COMMAND ${CONAN} create "${TANDEM_SOURCE_DIR}/packaging/conan"
          --test-folder "${WORK_DIR}/test_package" -s compiler.cppstd=20 -s build_type=Debug
          -c "tools.cmake.cmaketoolchain:extra_variables={'CMAKE_CXX_FLAGS_DEBUG': ''}" ${options}
  OUTPUT_VARIABLE output ERROR_VARIABLE output RESULT_VARIABLE result)
message("${output}")
if(NOT result EQUAL 0)
  message(FATAL_ERROR "conan create failed: ${result}")
endif()
# The test program's own lines, so that a test_package that ran nothing cannot pass.
if(NOT output MATCHES "LocalComm all_reduce over 4 ranks ok")
  message(FATAL_ERROR "test_package did not report its LocalComm all_reduce")
endif()
if(WITH_GLOO AND NOT output MATCHES "GlooComm all_reduce over 1 rank ok")
  message(FATAL_ERROR "test_package did not report its Gloo all_reduce")
endif()
if(WITH_TORCH AND NOT output MATCHES "the torch component found and linked")
  message(FATAL_ERROR "test_package did not link tandem::torch (torch option)")
endif()
if(NOT output MATCHES "safetensors round trip ok")
  message(FATAL_ERROR "test_package did not report its safetensors round trip (io option)")
endif()
# The tools option (on by default): the package's bin/ holds tandemrun and tandem-ckpt, and they run.
foreach(tool IN ITEMS tandemrun tandem-ckpt)
  if(NOT output MATCHES "${tool} --help ok")
    message(FATAL_ERROR "test_package did not run ${tool} --help from the package")
  endif()
endforeach()
