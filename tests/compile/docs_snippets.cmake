# Every C++ block of docs/*.md compiles and links with the CMake components it names: included
# by tests/compile/CMakeLists.txt where a Python 3 is found. docs_snippets.py writes the sources at
# configure time (a doc's change re-runs it at the next build: one source shared by the blocks of
# a kind, a file of its own for a block that needs nvcc) and says how a block that is a fragment
# is marked. The blocks are built by their tests, not by `all`:
#   docs_snippets        the blocks that need no libtorch and no nvcc
#   docs_snippets_torch  those that include tandem/torch.hpp (where the torch component is)
#   docs_snippets_cuda   those that need nvcc (where the cuda and nccl components are, and
#                        libtorch with CUDA for a libtorch block)
# Each test prints the blocks it compiles and those this build cannot (a component missing).
set(tandem_docs_out ${CMAKE_CURRENT_BINARY_DIR}/docs_snippets)
file(GLOB tandem_docs_pages CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
  ${tandem_docs_pages} ${CMAKE_CURRENT_SOURCE_DIR}/docs_snippets.py)
execute_process(
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/docs_snippets.py
    ${PROJECT_SOURCE_DIR}/docs ${tandem_docs_out}
  RESULT_VARIABLE tandem_docs_result ERROR_VARIABLE tandem_docs_error)

set(tandem_docs_groups docs_snippets docs_snippets_torch docs_snippets_cuda)
foreach(group IN LISTS tandem_docs_groups)
  add_custom_target(${group})
  set(${group}_blocks "")
endforeach()
set(tandem_docs_missing "")

# tandem_doc_snippet(NAME target SOURCE file WHERE doc:line NEEDS component... LINKS component...
#                    [LINKED] [SHARED]) (called by the manifest): the block joins its group when
# this build has what it needs; otherwise it joins the list of blocks this build cannot compile.
# A SHARED block is a section of a source shared with the blocks of its kind (docs_snippets.py):
# it is collected here and built by that source's target (below), which defines its macro and
# links the components of all its blocks. Any other block (one that needs nvcc) is its own
# executable. A LINKED block (its "CMake:" comment names its components) and a CUDA block are
# linked; any other is compiled only (syntax_only.sh: -fsyntax-only, which still instantiates
# every template the block uses; about 40 % of a block's compile time is code generation).
function(tandem_doc_snippet)
  cmake_parse_arguments(arg "LINKED;SHARED" "NAME;SOURCE;WHERE" "NEEDS;LINKS" ${ARGN})
  set(group docs_snippets)
  set(lacking "")
  foreach(component IN LISTS arg_NEEDS arg_LINKS)
    if(NOT TARGET tandem::${component})
      list(APPEND lacking tandem::${component})
    endif()
    if(component STREQUAL "torch" AND NOT group STREQUAL "docs_snippets_cuda")
      set(group docs_snippets_torch)
    elseif(component MATCHES "^(cuda|nccl)$")
      set(group docs_snippets_cuda)
    endif()
  endforeach()
  if(group STREQUAL "docs_snippets_cuda" AND "torch" IN_LIST arg_NEEDS AND NOT C10_CUDA_LIBRARY)
    list(APPEND lacking "libtorch with CUDA")
  endif()
  if(lacking)
    list(REMOVE_DUPLICATES lacking)
    string(REPLACE ";" ", " lacking "${lacking}")
    set(tandem_docs_missing "${tandem_docs_missing}|${arg_WHERE} (needs ${lacking})" PARENT_SCOPE)
    return()
  endif()
  if(arg_LINKED OR group STREQUAL "docs_snippets_cuda")
    set(where "${arg_WHERE} (compiled and linked)")
  else()
    set(where "${arg_WHERE} (compiled)")
  endif()
  set(${group}_blocks "${${group}_blocks}|${where}" PARENT_SCOPE)
  if(arg_SHARED)
    get_filename_component(shared ${arg_SOURCE} NAME_WE)
    set_property(GLOBAL APPEND PROPERTY tandem_docs_sources ${arg_SOURCE})
    set_property(GLOBAL PROPERTY tandem_docs_${shared}_group ${group})
    set_property(GLOBAL APPEND PROPERTY tandem_docs_${shared}_blocks TANDEM_DOC_${arg_NAME})
    set_property(GLOBAL APPEND PROPERTY tandem_docs_${shared}_links ${arg_LINKS})
    return()
  endif()
  add_executable(${arg_NAME} EXCLUDE_FROM_ALL ${arg_SOURCE})
  target_link_libraries(${arg_NAME} PRIVATE tandem::tandem)
  foreach(component IN LISTS arg_LINKS)
    target_link_libraries(${arg_NAME} PRIVATE tandem::${component})
  endforeach()
  add_dependencies(${group} ${arg_NAME})
endfunction()

# The target of each shared source that has blocks this build compiles: an executable for the
# linked ones, a syntax-only object library for the others.
function(tandem_docs_shared_targets)
  get_property(sources GLOBAL PROPERTY tandem_docs_sources)
  list(REMOVE_DUPLICATES sources)
  foreach(source IN LISTS sources)
    get_filename_component(shared ${source} NAME_WE)
    get_property(group GLOBAL PROPERTY tandem_docs_${shared}_group)
    get_property(blocks GLOBAL PROPERTY tandem_docs_${shared}_blocks)
    get_property(links GLOBAL PROPERTY tandem_docs_${shared}_links)
    set(target docs_${shared})
    if(shared MATCHES "_linked$")
      add_executable(${target} EXCLUDE_FROM_ALL ${source})
    else()
      add_library(${target} OBJECT EXCLUDE_FROM_ALL ${source})
      set_target_properties(${target} PROPERTIES
        CXX_COMPILER_LAUNCHER ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/syntax_only.sh)
    endif()
    target_compile_definitions(${target} PRIVATE ${blocks})
    # A block's main() is an ordinary function in its namespace there: no implicit return 0.
    target_compile_options(${target} PRIVATE -Wno-return-type)
    target_link_libraries(${target} PRIVATE tandem::tandem)
    if(links)
      list(REMOVE_DUPLICATES links)
      foreach(component IN LISTS links)
        target_link_libraries(${target} PRIVATE tandem::${component})
      endforeach()
    endif()
    add_dependencies(${group} ${target})
  endforeach()
endfunction()

if(tandem_docs_result EQUAL 0)
  include(${tandem_docs_out}/manifest.cmake)
  tandem_docs_shared_targets()
  foreach(group IN LISTS tandem_docs_groups)
    if(NOT ${group}_blocks)
      continue()
    endif()
    add_test(NAME ${group}
      COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${CMAKE_BINARY_DIR} -DTARGET=${group}
        "-DBLOCKS=${${group}_blocks}" "-DMISSING=${tandem_docs_missing}"
        -P ${CMAKE_CURRENT_SOURCE_DIR}/run_docs_snippets.cmake)
    set(labels docs compile)
    if(group STREQUAL "docs_snippets_torch")
      list(APPEND labels torch)
    elseif(group STREQUAL "docs_snippets_cuda")
      list(APPEND labels cuda)
    endif()
    # PROCESSORS 2: the build runs as many compilers as the machine has cores (as the consumer
    # tests do).
    set_tests_properties(${group} PROPERTIES LABELS "${labels}" TIMEOUT 1500 PROCESSORS 2)
  endforeach()
else()
  # A doc the script cannot read (a block never closed, a fragment without its function head):
  # the test fails and says why, the rest of the build goes on.
  string(REPLACE ";" "," tandem_docs_error "${tandem_docs_error}")
  add_test(NAME docs_snippets
    COMMAND ${CMAKE_COMMAND} -E echo "docs_snippets.py failed: ${tandem_docs_error}")
  set_tests_properties(docs_snippets PROPERTIES LABELS "docs;compile" WILL_FAIL TRUE)
endif()
