// Must NOT compile (a CTest with WILL_FAIL builds it): a Buffer in device memory needs the
// allocator from tandem/cuda.hpp, and without it space_allocator's static_assert explains that.
#include "tandem/tensor/tensor.hpp"

int main() {
  tandem::Buffer<float, tandem::device> buffer(16);
  return buffer.empty() ? 1 : 0;
}
