// compute_threads.h: one knob for a process's CPU compute threads.
//
// Debian's libtorch calls a pthreads OpenBLAS that starts its own pool (one thread per core)
// beside libtorch's intra-op pool: with both at n threads a 2-core machine runs 2.5x slower
// than with either alone (measured: `swarm reference` 20 steps, 10.7 s vs 3.6-4.1 s). So the
// matrix products get the n threads and libtorch's pointwise pool one.
#pragma once

namespace swarm {

// n <= 0 keeps the libraries' defaults. Returns a short description for logs.
const char* set_compute_threads(int n);

}  // namespace swarm
