# vcpkg's port helpers as far as they touch tandem's build, for running packaging/vcpkg's
# portfile.cmake without the vcpkg tool (which cannot be installed here). Each one does what
# vcpkg documents it to do to the options, the build and the package's files; downloads,
# triplets, debug builds and binary caching are vcpkg's and are not imitated.
# Needs: FEATURES (the feature list under test), CURRENT_PACKAGES_DIR, WORK_DIR, common (the
# generator and compiler options of run_consumer.cmake).

# OUT_FEATURE_OPTIONS gets -D<option>=ON for each listed feature in FEATURES, =OFF otherwise.
function(vcpkg_check_features)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_FEATURE_OPTIONS" "FEATURES;INVERTED_FEATURES")
  set(options "")
  set(pairs ${arg_FEATURES})
  while(pairs)
    list(POP_FRONT pairs feature option)
    if(feature IN_LIST FEATURES)
      list(APPEND options "-D${option}=ON")
    else()
      list(APPEND options "-D${option}=OFF")
    endif()
  endwhile()
  set(${arg_OUT_FEATURE_OPTIONS} "${options}" PARENT_SCOPE)
endfunction()

# Configures the release build into CURRENT_PACKAGES_DIR with exactly the port's OPTIONS.
function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "SOURCE_PATH" "OPTIONS;OPTIONS_RELEASE")
  message("portfile options: ${arg_OPTIONS} ${arg_OPTIONS_RELEASE}")
  run(${CMAKE_COMMAND} -S "${arg_SOURCE_PATH}" -B "${WORK_DIR}/tandem-build" ${common}
      "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}" ${arg_OPTIONS} ${arg_OPTIONS_RELEASE})
endfunction()

# Builds the install target, as vcpkg's does (so the tools are compiled), then installs.
function(vcpkg_cmake_install)
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/tandem-build" --target install)
endfunction()

# Moves the named executables from bin/ to tools/<port>/; AUTO_CLEAN removes a bin/ left empty.
function(vcpkg_copy_tools)
  cmake_parse_arguments(PARSE_ARGV 0 arg "AUTO_CLEAN" "DESTINATION" "TOOL_NAMES")
  if(NOT arg_DESTINATION)
    set(arg_DESTINATION "${CURRENT_PACKAGES_DIR}/tools/${PORT}")
  endif()
  file(MAKE_DIRECTORY "${arg_DESTINATION}")
  foreach(tool IN LISTS arg_TOOL_NAMES)
    if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/bin/${tool}")
      message(FATAL_ERROR "vcpkg_copy_tools: ${tool} is not in bin/")
    endif()
    file(RENAME "${CURRENT_PACKAGES_DIR}/bin/${tool}" "${arg_DESTINATION}/${tool}")
  endforeach()
  if(arg_AUTO_CLEAN)
    file(GLOB left "${CURRENT_PACKAGES_DIR}/bin/*")
    if(NOT left)
      file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/bin")
    endif()
  endif()
endfunction()

# vcpkg wants the package files in share/<port>; with no CONFIG_PATH there is nothing to move, so
# here the files must already be there (moving them would also need vcpkg's path rewriting).
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "CONFIG_PATH;PACKAGE_NAME" "")
  if(arg_CONFIG_PATH AND NOT arg_CONFIG_PATH STREQUAL "share/${PORT}")
    message(FATAL_ERROR "the port moves its CMake files from ${arg_CONFIG_PATH}; install them to share/${PORT}")
  endif()
  if(NOT EXISTS "${CURRENT_PACKAGES_DIR}/share/${PORT}/${PORT}Config.cmake")
    message(FATAL_ERROR "no share/${PORT}/${PORT}Config.cmake in the package")
  endif()
endfunction()

function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "" "FILE_LIST")
  set(text "")
  foreach(file IN LISTS arg_FILE_LIST)
    file(READ "${file}" part)
    string(APPEND text "${part}")
  endforeach()
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright" "${text}")
endfunction()
