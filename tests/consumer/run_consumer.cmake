# cmake -DMODE=installed|components|cuda|subdirectory|readme|vcpkg -DTANDEM_SOURCE_DIR=..
#       -DCONSUMER_SOURCE_DIR=.. -DWORK_DIR=.. -DGENERATOR=.. -DCXX_COMPILER=.. [-DCUDA_COMPILER=..]
#       [-DFEATURES=gloo,mpi] -P run_consumer.cmake
# Builds and runs the consumer project in a clean directory; any failing step fails the test.
# MODE=vcpkg runs packaging/vcpkg/portfile.cmake for FEATURES with vcpkg's helpers imitated
# (vcpkg_helpers.cmake), then builds the usage file's snippets for those features.
cmake_minimum_required(VERSION 3.25)  # policies of today (IN_LIST, ...) in script mode
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGV} COMMAND_ECHO STDOUT COMMAND_ERROR_IS_FATAL ANY)
endfunction()

# Unoptimised, without debug information: these builds prove the package's CMake (found,
# linked, installed, run), which the build type does not change, and -O3 made each compile about
# 2.3 times as long (tandemrun: 16.7 CPU-s against 7.4), which CI's 25 minutes cannot spare.
set(common -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Debug
    -DCMAKE_CXX_FLAGS_DEBUG= -DCMAKE_CUDA_FLAGS_DEBUG=)

if(MODE STREQUAL "installed" OR MODE STREQUAL "components" OR MODE STREQUAL "cuda")
  set(prefix "${WORK_DIR}/prefix")
  set(backends -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=OFF)
  if(MODE STREQUAL "components")
    set(backends -DTANDEM_WITH_GLOO=ON -DTANDEM_WITH_MPI=ON -DTANDEM_WITH_CUDA=OFF)
    set(CONSUMER_SOURCE_DIR "${CONSUMER_SOURCE_DIR}/../components")
  elseif(MODE STREQUAL "cuda")
    # The tools' install is consumer_installed's to prove; here they would only cost CI a build.
    set(backends -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=ON
                 -DTANDEM_BUILD_TOOLS=OFF)
    set(CONSUMER_SOURCE_DIR "${CONSUMER_SOURCE_DIR}/../cuda")
    list(APPEND common -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
  endif()
  if(MODE STREQUAL "components")
    # A user without CLI11 still installs the headers: the tools are left out, and an install
    # of a tree whose tools were not built says so instead of failing.
    list(APPEND backends -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=TRUE)
  endif()
  run(${CMAKE_COMMAND} -S "${TANDEM_SOURCE_DIR}" -B "${WORK_DIR}/tandem-build" ${common}
      -DCMAKE_INSTALL_PREFIX=${prefix} ${backends})
  if(MODE STREQUAL "components")
    execute_process(COMMAND ${CMAKE_COMMAND} --install "${WORK_DIR}/tandem-build"
      OUTPUT_VARIABLE install_output ERROR_VARIABLE install_output COMMAND_ERROR_IS_FATAL ANY)
    message("${install_output}")
    if(EXISTS "${prefix}/bin/tandemrun")
      message(FATAL_ERROR "tandemrun was installed though CLI11 was not to be found")
    endif()
    if(NOT install_output MATCHES "tandem-ckpt was not built")
      message(FATAL_ERROR "installing without building did not say that tandem-ckpt is missing")
    endif()
  else()
    # The README's way: build (the tools), then install; the tools land in <prefix>/bin and run.
    run(${CMAKE_COMMAND} --build "${WORK_DIR}/tandem-build")
    run(${CMAKE_COMMAND} --install "${WORK_DIR}/tandem-build")
    if(NOT MODE STREQUAL "cuda")
      foreach(tool IN ITEMS tandemrun tandem-ckpt)
        run("${prefix}/bin/${tool}" --help)
      endforeach()
    endif()
  endif()
  # Headers, package files and the tools are all an install may hold: no library is compiled.
  file(GLOB_RECURSE installed_binaries "${prefix}/*.a" "${prefix}/*.so")
  if(installed_binaries)
    message(FATAL_ERROR "the install holds compiled files: ${installed_binaries}")
  endif()
  run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/consumer-build" ${common}
      -DCMAKE_PREFIX_PATH=${prefix})
elseif(MODE STREQUAL "vcpkg")
  string(REPLACE "," ";" FEATURES "${FEATURES}")
  set(PORT tandem)
  set(CURRENT_PACKAGES_DIR "${WORK_DIR}/prefix")
  if("cuda" IN_LIST FEATURES)
    list(APPEND common -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
  endif()
  include("${CMAKE_CURRENT_LIST_DIR}/vcpkg_helpers.cmake")
  include("${TANDEM_SOURCE_DIR}/packaging/vcpkg/portfile.cmake")
  file(GLOB_RECURSE installed_binaries "${CURRENT_PACKAGES_DIR}/*.a" "${CURRENT_PACKAGES_DIR}/*.so")
  if(installed_binaries)
    message(FATAL_ERROR "the port installed compiled files: ${installed_binaries}")
  endif()
  # The tools feature puts tandemrun and tandem-ckpt (with io) where vcpkg keeps tools.
  if("tools" IN_LIST FEATURES)
    run("${CURRENT_PACKAGES_DIR}/tools/${PORT}/tandemrun" --help)
    if("io" IN_LIST FEATURES)
      run("${CURRENT_PACKAGES_DIR}/tools/${PORT}/tandem-ckpt" --help)
    endif()
  elseif(EXISTS "${CURRENT_PACKAGES_DIR}/tools" OR EXISTS "${CURRENT_PACKAGES_DIR}/bin")
    message(FATAL_ERROR "the port installed tools without the tools feature")
  endif()
  if(EXISTS "${CURRENT_PACKAGES_DIR}/bin")
    message(FATAL_ERROR "the port left executables in bin/ (vcpkg wants them in tools/${PORT})")
  endif()

  # The usage file's snippets (runs of indented lines) whose components these features provide.
  file(STRINGS "${CURRENT_PACKAGES_DIR}/share/${PORT}/usage" usage_lines)
  set(provided ${FEATURES})
  if("cuda" IN_LIST FEATURES)
    list(APPEND provided nccl)  # NCCL comes with the CUDA feature where the toolkit has it
  endif()
  set(snippets "")
  set(block "")
  set(block_ok TRUE)
  list(APPEND usage_lines "")
  foreach(line IN LISTS usage_lines)
    if(line MATCHES "^  [^ ]")
      string(APPEND block "${line}\n")
      if(line MATCHES "COMPONENTS ([a-z ]+)\\)")
        string(REPLACE " " ";" wanted "${CMAKE_MATCH_1}")
        foreach(component IN LISTS wanted)
          if(NOT component IN_LIST provided)
            set(block_ok FALSE)
          endif()
        endforeach()
      endif()
    else()
      if(block AND block_ok)
        string(APPEND snippets "${block}")
      endif()
      set(block "")
      set(block_ok TRUE)
    endif()
  endforeach()
  if(NOT snippets MATCHES "find_package\\(tandem")
    message(FATAL_ERROR "the usage file has no find_package(tandem ...) snippet")
  endif()
  string(REPLACE "target_link_libraries(main " "target_link_libraries(consumer " snippets "${snippets}")
  message("usage snippets for [${FEATURES}]:\n${snippets}")

  set(languages CXX)
  set(source "${CONSUMER_SOURCE_DIR}/main.cpp")
  if("cuda" IN_LIST FEATURES)
    set(languages CXX CUDA)
    set(source "${CONSUMER_SOURCE_DIR}/../cuda/main.cu")
  elseif("gloo" IN_LIST FEATURES AND "mpi" IN_LIST FEATURES)
    set(source "${CONSUMER_SOURCE_DIR}/../components/main.cpp")
  endif()
  get_filename_component(source_name "${source}" NAME)
  file(COPY "${source}" DESTINATION "${WORK_DIR}/project")
  file(WRITE "${WORK_DIR}/project/CMakeLists.txt"
    "cmake_minimum_required(VERSION 3.25)\n"
    "project(tandem_vcpkg_consumer LANGUAGES ${languages})\n"
    "add_executable(consumer ${source_name})\n"
    "${snippets}")
  run(${CMAKE_COMMAND} -S "${WORK_DIR}/project" -B "${WORK_DIR}/consumer-build" ${common}
      -DCMAKE_PREFIX_PATH=${CURRENT_PACKAGES_DIR})
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
  message(FATAL_ERROR "MODE must be installed, components, cuda, subdirectory, readme or vcpkg, not '${MODE}'")
endif()

run(${CMAKE_COMMAND} --build "${WORK_DIR}/consumer-build")
if(MODE STREQUAL "cuda" OR source_name MATCHES "[.]cu$")
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
