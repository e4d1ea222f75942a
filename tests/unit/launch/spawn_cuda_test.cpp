// tandem::spawn refuses to fork once CUDA is initialised in the parent. Needs a GPU: without
// libcuda.so.1 or a device it says why and exits 77 (skipped).
#include <dlfcn.h>

#include <cstdio>
#include <string>

#include "tandem/core/error.hpp"
#include "tandem/launch/spawn.hpp"

int main() {
  if (tandem::launch::detail::cuda_initialised()) {
    std::puts("FAILED: CUDA reported initialised before anything initialised it");
    return 1;
  }
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    std::puts("SKIPPED: no libcuda.so.1 (no NVIDIA driver)");
    return 77;
  }
  if (tandem::launch::detail::cuda_initialised()) {
    std::puts("FAILED: loading libcuda.so.1 alone counted as initialising CUDA");
    return 1;
  }
  using cu_init_fn = int (*)(unsigned int);
  auto init = reinterpret_cast<cu_init_fn>(::dlsym(library, "cuInit"));
  if (init == nullptr || init(0) != 0 || tandem::launch::detail::cuda_device_count() < 1) {
    std::puts("SKIPPED: the CUDA driver found no usable GPU");
    return 77;
  }
  try {
    tandem::spawn(2, [](int) {});
  } catch (const tandem::Error& error) {
    if (std::string(error.what()).find("CUDA is already initialised") != std::string::npos) {
      std::printf("PASSED: %s\n", error.what());
      return 0;
    }
    std::printf("FAILED: unexpected error: %s\n", error.what());
    return 1;
  }
  std::puts("FAILED: spawn forked although CUDA was initialised");
  return 1;
}
