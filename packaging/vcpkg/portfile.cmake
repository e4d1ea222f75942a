# An overlay port that packages the tandem checkout it sits in:
#   vcpkg install tandem[gloo,mpi] --overlay-ports=<tandem>/packaging/vcpkg
# Header-only: the headers and tandem's CMake package, with one component per feature; the tools
# feature (a default one) adds tandemrun and, with io, tandem-ckpt under tools/tandem.
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../..")
set(VCPKG_BUILD_TYPE release)  # only the tools are compiled, and they need no debug flavour

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    gloo TANDEM_WITH_GLOO
    mpi  TANDEM_WITH_MPI
    cuda TANDEM_WITH_CUDA
    data TANDEM_WITH_DATA
    io   TANDEM_WITH_IO
    torch TANDEM_WITH_TORCH
    tools TANDEM_BUILD_TOOLS)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DTANDEM_BUILD_TESTS=OFF
    -DTANDEM_BUILD_EXAMPLES=OFF
    -DTANDEM_BUILD_BENCH=OFF
    -DTANDEM_INSTALL_CMAKEDIR=share/${PORT}
    ${FEATURE_OPTIONS})
vcpkg_cmake_install()
vcpkg_cmake_config_fixup()  # the package files are already where vcpkg wants them
if("tools" IN_LIST FEATURES)
  set(tools tandemrun)
  if("io" IN_LIST FEATURES)
    list(APPEND tools tandem-ckpt)
  endif()
  vcpkg_copy_tools(TOOL_NAMES ${tools} AUTO_CLEAN)
endif()

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
