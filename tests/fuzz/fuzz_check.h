// fuzz_check.h: FUZZ_CHECK, the invariant check of the fuzz targets.
//
// A failed invariant prints what broke and aborts, so that libFuzzer (or the corpus replay)
// reports it as a crash and keeps the input. Not SWARM_CHECK: that throws, and a target must
// not confuse its own verdict with an exception from the code under test.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, what)                                                          \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "fuzz invariant failed at %s:%d: %s (%s)\n", __FILE__,       \
                   __LINE__, #cond, what);                                              \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
