# cmake -DMODE=installed|components|subdirectory|readme -DTANDEM_SOURCE_DIR=.. -DCONSUMER_SOURCE_DIR=..
#       -DWORK_DIR=.. -DGENERATOR=.. -DCXX_COMPILER=.. -P run_consumer.cmake
# Builds and runs the consumer project in a clean directory; any failing step fails the test.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGV} COMMAND_ECHO STDOUT COMMAND_ERROR_IS_FATAL ANY)
endfunction()

set(common -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release)

if(MODE STREQUAL "installed" OR MODE STREQUAL "components" OR MODE STREQUAL "cuda")
  set(prefix "${WORK_DIR}/prefix")
  set(backends -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=OFF)
  if(MODE STREQUAL "components")
    set(backends -DTANDEM_WITH_GLOO=ON -DTANDEM_WITH_MPI=ON -DTANDEM_WITH_CUDA=OFF)
    set(CONSUMER_SOURCE_DIR "${CONSUMER_SOURCE_DIR}/../components")
  elseif(MODE STREQUAL "cuda")
    set(backends -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=ON)
    set(CONSUMER_SOURCE_DIR "${CONSUMER_SOURCE_DIR}/../cuda")
    list(APPEND common -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
  endif()
  run(${CMAKE_COMMAND} -S "${TANDEM_SOURCE_DIR}" -B "${WORK_DIR}/tandem-build" ${common}
      -DCMAKE_INSTALL_PREFIX=${prefix} ${backends})
  run(${CMAKE_COMMAND} --install "${WORK_DIR}/tandem-build")
  # Headers and package files are all an install may hold: a header-only library ships no binary.
  file(GLOB_RECURSE installed_binaries "${prefix}/*.a" "${prefix}/*.so")
  if(installed_binaries)
    message(FATAL_ERROR "the install holds compiled files: ${installed_binaries}")
  endif()
  run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/consumer-build" ${common}
      -DCMAKE_PREFIX_PATH=${prefix})
elseif(MODE STREQUAL "subdirectory")
  run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/consumer-build" ${common}
      -DTANDEM_SOURCE_DIR=${TANDEM_SOURCE_DIR})
elseif(MODE STREQUAL "readme")
  file(READ "${TANDEM_SOURCE_DIR}/README.md" readme)
  string(FIND "${readme}" "```cpp\n" start)
  if(start EQUAL -1)
    message(FATAL_ERROR "README.md has no ```cpp example")
  endif()
  math(EXPR start "${start} + 7")
  string(SUBSTRING "${readme}" ${start} -1 rest)
  string(FIND "${rest}" "```" length)
  string(SUBSTRING "${rest}" 0 ${length} example)
  file(COPY "${CONSUMER_SOURCE_DIR}/CMakeLists.txt" DESTINATION "${WORK_DIR}/project")
  file(WRITE "${WORK_DIR}/project/main.cpp" "${example}")
  run(${CMAKE_COMMAND} -S "${WORK_DIR}/project" -B "${WORK_DIR}/consumer-build" ${common}
      -DTANDEM_SOURCE_DIR=${TANDEM_SOURCE_DIR})
else()
  message(FATAL_ERROR "MODE must be installed, components, cuda, subdirectory or readme, not '${MODE}'")
endif()

run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build")
if(MODE STREQUAL "cuda")
  # Without a GPU the program exits 77, which ctest reports as skipped (after the build passed).
  execute_process(COMMAND "${WORK_DIR}/consumer-build/consumer" RESULT_VARIABLE result)
  if(result EQUAL 77)
    message("SKIPPED: no CUDA device to run the consumer; it compiled and linked")
    # cmake -P cannot exit 77 itself: the test's SKIP_REGULAR_EXPRESSION reads the line above.
  elseif(NOT result EQUAL 0)
    message(FATAL_ERROR "the CUDA consumer failed: ${result}")
  endif()
else()
  run("${WORK_DIR}/consumer-build/consumer")
endif()
