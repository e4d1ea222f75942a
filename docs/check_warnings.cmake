# cmake -DDOXYGEN=<doxygen> -DDOXYFILE=<Doxyfile> -DWARNINGS=<its warnings log> -DKNOWN=<file>
#       -DSOURCE_DIR=<tandem> -P check_warnings.cmake
# Runs Doxygen and fails on any warning, except the ones docs/known-warnings.txt still lists
# (headers whose owners have yet to document them; one "path: name" a line, no line numbers so
# that edits elsewhere in the file do not matter). A listed warning that is gone is reported so
# that its line can be removed.
cmake_minimum_required(VERSION 3.25)
if(NOT DOXYGEN)
  message("SKIPPED: no doxygen (scripts/setup.sh installs it)")
  return()
endif()
file(REMOVE "${WARNINGS}")
execute_process(COMMAND "${DOXYGEN}" "${DOXYFILE}" RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "doxygen failed: ${result}")
endif()
file(STRINGS "${WARNINGS}" warnings)
set(known "")
if(EXISTS "${KNOWN}")
  file(STRINGS "${KNOWN}" known REGEX "^[^#]")
endif()

set(new "")
set(seen "")
foreach(warning IN LISTS warnings)
  # "<path>:<line>: warning: <text>" -> "<path relative to the tree>: <text>"
  string(REPLACE "${SOURCE_DIR}/" "" warning "${warning}")
  if(warning MATCHES "^([^:]+):[0-9]+: warning: (.*)$")
    set(key "${CMAKE_MATCH_1}: ${CMAKE_MATCH_2}")
  else()
    set(key "${warning}")  # a continuation line or a warning without a place
  endif()
  if(key IN_LIST known)
    list(APPEND seen "${key}")
  else()
    list(APPEND new "${warning}")
  endif()
endforeach()

foreach(entry IN LISTS known)
  if(NOT entry IN_LIST seen)
    message("fixed, remove it from docs/known-warnings.txt: ${entry}")
  endif()
endforeach()
list(LENGTH warnings total)
list(LENGTH new new_count)
list(LENGTH seen seen_count)
message("doxygen: ${total} warnings, ${seen_count} of them listed in docs/known-warnings.txt")
if(new_count GREATER 0)
  list(JOIN new "\n" text)
  message(FATAL_ERROR "${new_count} Doxygen warnings (document these public names):\n${text}")
endif()
