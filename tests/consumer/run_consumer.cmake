# cmake -DMODE=installed|components|subdirectory|readme -DTANDEM_SOURCE_DIR=.. -DCONSUMER_SOURCE_DIR=..
#       -DWORK_DIR=.. -DGENERATOR=.. -DCXX_COMPILER=.. -P run_consumer.cmake
# Builds and runs the consumer project in a clean directory; any failing step fails the test.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGV} COMMAND_ECHO STDOUT COMMAND_ERROR_IS_FATAL ANY)
endfunction()

set(common -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release)

if(MODE STREQUAL "installed" OR MODE STREQUAL "components")
  set(prefix "${WORK_DIR}/prefix")
  set(backends -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF)
  if(MODE STREQUAL "components")
    set(backends -DTANDEM_WITH_GLOO=ON -DTANDEM_WITH_MPI=ON)
    set(CONSUMER_SOURCE_DIR "${CONSUMER_SOURCE_DIR}/../components")
  endif()
  run(${CMAKE_COMMAND} -S "${TANDEM_SOURCE_DIR}" -B "${WORK_DIR}/tandem-build" ${common}
      -DCMAKE_INSTALL_PREFIX=${prefix} -DTANDEM_WITH_CUDA=OFF ${backends})
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
  message(FATAL_ERROR "MODE must be installed or subdirectory, not '${MODE}'")
endif()

run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build")
run("${WORK_DIR}/consumer-build/consumer")
