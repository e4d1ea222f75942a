# Included by Conan's CMakeDeps after it has made tandem's targets: each engine component found
# through the engine's own CMake package, which knows its include and library directories (the
# component's system library alone says only its name).
if(TARGET tandem::gloo)
  find_package(Gloo CONFIG REQUIRED)
  target_link_libraries(tandem::gloo INTERFACE gloo)
endif()
if(TARGET tandem::mpi)
  set(MPI_CXX_SKIP_MPICXX TRUE)
  find_package(MPI REQUIRED COMPONENTS CXX)
  target_link_libraries(tandem::mpi INTERFACE MPI::MPI_CXX)
endif()
if(TARGET tandem::cuda)
  find_package(CUDAToolkit REQUIRED)
  target_link_libraries(tandem::cuda INTERFACE CUDA::cudart)
  target_link_directories(tandem::cuda INTERFACE "${CUDAToolkit_LIBRARY_DIR}")
  # CMake before 3.28 does not know that nvcc 13 speaks C++20 and would fall back to C++17.
  target_compile_options(tandem::cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
endif()
if(TARGET tandem::nccl)
  list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
  find_package(NCCL 2.18 REQUIRED)
  target_link_libraries(tandem::nccl INTERFACE NCCL::nccl)
endif()
if(TARGET tandem::io)
  find_package(nlohmann_json 3.2 CONFIG REQUIRED)  # header-only: its include directory
  target_link_libraries(tandem::io INTERFACE nlohmann_json::nlohmann_json)
endif()
if(TARGET tandem::data)
  find_package(ZLIB REQUIRED)
  target_link_libraries(tandem::data INTERFACE ZLIB::ZLIB)
endif()
if(TARGET tandem::torch)
  find_package(Torch REQUIRED)  # Debian's libtorch-dev, or PyTorch's wheel on CMAKE_PREFIX_PATH
  # Gloo's library before libtorch's where Gloo is here, as tandem's own CMakeLists.txt does:
  # PyTorch 2.x's libtorch_cpu exports its own Gloo, which would otherwise take GlooComm's calls.
  target_link_libraries(tandem::torch INTERFACE
    $<$<TARGET_EXISTS:gloo>:$<TARGET_LINKER_FILE:gloo>> ${TORCH_LIBRARIES})
endif()
