// The simulated NCCL's test program: doctest, or one rank of a multi-process test when started
// as `--child <scenario> <rank> <nranks> <unique id>` by process_test.cpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstring>

namespace simtest {
int child_main(int argc, char** argv);
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--child") == 0) return simtest::child_main(argc, argv);
  doctest::Context context(argc, argv);
  return context.run();
}
