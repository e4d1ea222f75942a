// What every fuzz target shares: an invariant that must hold for any input, checked in every
// build (a failed one aborts, which libFuzzer and the replay test both report as a crash).
#pragma once

#include <cstdio>
#include <cstdlib>

/// Aborts with the condition's text and place when it is false.
#define FUZZ_CHECK(condition)                                                                     \
  do {                                                                                            \
    if (!(condition)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                               \
    }                                                                                             \
  } while (false)
