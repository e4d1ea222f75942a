# cmake -DBUILD_DIR=.. -DTARGET=docs_snippets[_torch|_cuda] -DBLOCKS="|doc:line|..."
#       -DMISSING="|doc:line (needs ...)|..." -P run_docs_snippets.cmake
# The test of docs_snippets.cmake: says which blocks it compiles and which this build cannot, then
# builds them (one target, so one build tool runs); a block that does not compile, or does not
# link where it is linked, fails it.
cmake_minimum_required(VERSION 3.25)
string(REPLACE "|" "\n  " blocks "${BLOCKS}")
message("the C++ blocks of the docs this test builds:${blocks}")
if(MISSING)
  string(REPLACE "|" "\n  " missing "${MISSING}")
  message("not compiled by this build (it lacks what they need):${missing}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "a block of the docs above does not compile or link (the build's output "
    "names the doc's line, or the generated source in ${BUILD_DIR}/tests/compile/docs_snippets)")
endif()
