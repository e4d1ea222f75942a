# Helpers of the top-level CMakeLists for tandem's optional parts (gloo, mpi, shm, cuda, nccl,
# data, io, torch).

# tandem_add_component(name dependency...): the INTERFACE target tandem_<name>, tandem::<name> to
# the programs that use it and in the install's export set, linking `dependency...`.
function(tandem_add_component name)
  add_library(tandem_${name} INTERFACE)
  add_library(tandem::${name} ALIAS tandem_${name})
  set_target_properties(tandem_${name} PROPERTIES EXPORT_NAME ${name})
  target_link_libraries(tandem_${name} INTERFACE ${ARGN})
endfunction()

# tandem_find_optional(option "doc" package arg...): the AUTO/ON/OFF cache option `option` and
# find_package(package arg...) as it asks: required when ON, quietly when AUTO, not at all when
# OFF (then <package>_FOUND is FALSE). A macro: what the package finds is the caller's.
macro(tandem_find_optional option doc package)
  set(${option} AUTO CACHE STRING "${doc}: ON, OFF, or AUTO (on when found)")
  set_property(CACHE ${option} PROPERTY STRINGS AUTO ON OFF)
  set(${package}_FOUND FALSE)
  if(${option} STREQUAL "ON")
    find_package(${package} ${ARGN} REQUIRED)
  elseif(NOT ${option} STREQUAL "OFF")
    find_package(${package} ${ARGN} QUIET)
  endif()
endmacro()
