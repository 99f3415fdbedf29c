// compute_threads.cpp: set_compute_threads (see compute_threads.h).
#include "stages/compute_threads.h"

#include <dlfcn.h>

#include <torch/torch.h>

namespace swarm {

const char* set_compute_threads(int n) {
  if (n <= 0) return "library defaults";
  // Looked up at run time: present with OpenBLAS, absent with other BLAS builds (MKL, CUDA).
  using SetThreads = void (*)(int);
  auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas) {
    openblas(n);
    torch::set_num_threads(1);
    return "OpenBLAS threads = n, libtorch intra-op threads = 1";
  }
  torch::set_num_threads(n);
  return "libtorch intra-op threads = n";
}

}  // namespace swarm
