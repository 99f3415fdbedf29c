// subspace.cpp: implements compression/subspace.h: the seeded basis, the payload (token ids
// then coefficients), the job-level checks and the deterministic projections.
//
// Built with -O3 -ffp-contract=off (compression/CMakeLists.txt): the projection loops
// vectorise over contiguous rows without reassociating any sum, and without fused multiply-adds
// every machine rounds them the same way. Where the CPU has AVX2 the projections are cloned for
// it (as codec.cpp's loops): wider lanes, the same sums in the same order, the same bits.
#include "compression/subspace.h"

#include <cmath>
#include <cstring>

#include "runtime/errors.h"
#include "runtime/random.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__ELF__) && \
    !defined(SWARM_NO_CLONES)
#define SWARM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SWARM_CLONES
#endif

namespace swarm::compression {
namespace {

[[noreturn]] void fail(const std::string& what) { throw CodecError(what); }

// Uniform in (0, 1]: 53 random bits, never 0 so that log() is finite.
double uniform_open0(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

void check_bound(const CodecSpec& spec) {
  validate(spec);
  if (spec.codec != Codec::kSubspace) fail("codec " + spec.name() + " is not a subspace codec");
  if (spec.dim == 0) fail("codec " + spec.name() + ": not bound to a model (dim=d_model unknown)");
}

}  // namespace

std::vector<float> subspace_basis(int dim, int k, uint64_t seed) {
  SWARM_CHECK(dim >= 1 && k >= 1 && k <= dim, "subspace basis needs 1 <= k <= dim");
  // Stream keyed by the seed and the shape, apart from every parameter's init stream.
  const uint64_t key = splitmix64(seed ^ splitmix64(0x5355425350414345ull ^ (uint64_t(dim) << 24) ^ uint64_t(k)));
  const double two_pi = 6.283185307179586476925;
  // q: k columns of length dim, column-major while we orthonormalise.
  std::vector<double> q(size_t(dim) * size_t(k));
  for (size_t i = 0; i < q.size(); i += 2) {
    const double u1 = uniform_open0(splitmix64(key + i));
    const double u2 = uniform_open0(splitmix64(key + i + 1));
    const double r = std::sqrt(-2.0 * std::log(u1));
    q[i] = r * std::cos(two_pi * u2);
    if (i + 1 < q.size()) q[i + 1] = r * std::sin(two_pi * u2);
  }
  for (int j = 0; j < k; ++j) {
    double* v = &q[size_t(j) * dim];
    for (int pass = 0; pass < 2; ++pass) {  // Gram-Schmidt twice: orthogonal to double precision
      for (int i = 0; i < j; ++i) {
        const double* u = &q[size_t(i) * dim];
        double dot = 0;
        for (int r = 0; r < dim; ++r) dot += u[r] * v[r];
        for (int r = 0; r < dim; ++r) v[r] -= dot * u[r];
      }
    }
    double norm = 0;
    for (int r = 0; r < dim; ++r) norm += v[r] * v[r];
    norm = std::sqrt(norm);
    SWARM_CHECK(norm > 1e-6, "degenerate Gaussian draw in the subspace basis");
    for (int r = 0; r < dim; ++r) v[r] /= norm;
  }
  std::vector<float> U(size_t(dim) * size_t(k));
  for (int r = 0; r < dim; ++r)
    for (int j = 0; j < k; ++j) U[size_t(r) * k + j] = float(q[size_t(j) * dim + r]);
  return U;
}

int64_t subspace_tokens(const CodecSpec& spec, int64_t n) {
  check_bound(spec);
  if (n < 0 || n % spec.dim != 0)
    fail("codec " + spec.name() + ": " + std::to_string(n) + " values are not whole tokens of " + std::to_string(spec.dim));
  return n / spec.dim;
}

void encode_subspace(const CodecSpec& spec, const float* coef, const int64_t* ids, int64_t n, uint8_t* dst) {
  const int64_t tokens = subspace_tokens(spec, n);
  const size_t w = size_t(spec.id_bytes);
  if (w > 0) {
    const uint64_t limit = w == 4 ? (uint64_t(1) << 32) : (uint64_t(1) << (8 * w));
    for (int64_t t = 0; t < tokens; ++t) {
      if (ids[t] < 0 || uint64_t(ids[t]) >= limit)
        fail("codec " + spec.name() + ": token id " + std::to_string(ids[t]) + " does not fit in " +
             std::to_string(8 * w) + " bits");
      const uint32_t v = uint32_t(ids[t]);
      std::memcpy(dst + size_t(t) * w, &v, w);  // little-endian: the low bytes first
    }
  }
  encode(spec.coefficients(), coef, tokens * spec.k, dst + size_t(tokens) * w);
}

void decode_subspace(const CodecSpec& spec, const uint8_t* src, size_t nbytes, int64_t n, float* coef,
                     int64_t* ids) {
  const int64_t tokens = subspace_tokens(spec, n);
  const size_t want = encoded_bytes(spec, n);
  if (nbytes != want)
    fail("codec " + spec.name() + ": " + std::to_string(tokens) + " tokens need " + std::to_string(want) +
         " encoded bytes, got " + std::to_string(nbytes));
  const size_t w = size_t(spec.id_bytes);
  decode(spec.coefficients(), src + size_t(tokens) * w, nbytes - size_t(tokens) * w, tokens * spec.k, coef);
  if (ids && w > 0) {
    for (int64_t t = 0; t < tokens; ++t) {
      uint32_t v = 0;
      std::memcpy(&v, src + size_t(t) * w, w);
      ids[t] = int64_t(v);
    }
  }
}

SWARM_CLONES void project_columns(const float* U, int dim, int k, float* W, int64_t cols) {
  // A = U^T W [k, cols], then W = U A, each sum in double in a fixed order.
  std::vector<double> A(size_t(k) * size_t(cols), 0.0);
  std::vector<double> row(static_cast<size_t>(cols));
  for (int i = 0; i < dim; ++i) {
    const float* w = W + size_t(i) * cols;
    for (int j = 0; j < k; ++j) {
      const double u = U[size_t(i) * k + j];
      double* a = &A[size_t(j) * cols];
      for (int64_t c = 0; c < cols; ++c) a[c] += u * double(w[c]);
    }
  }
  for (int i = 0; i < dim; ++i) {
    std::fill(row.begin(), row.end(), 0.0);
    for (int j = 0; j < k; ++j) {
      const double u = U[size_t(i) * k + j];
      const double* a = &A[size_t(j) * cols];
      for (int64_t c = 0; c < cols; ++c) row[c] += u * a[c];
    }
    float* w = W + size_t(i) * cols;
    for (int64_t c = 0; c < cols; ++c) w[c] = float(row[c]);
  }
}

SWARM_CLONES void project_rows(const float* U, int dim, int k, float* W, int64_t rows, const float* offset) {
  std::vector<double> z(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows; ++r) {
    float* w = W + size_t(r) * dim;
    std::fill(z.begin(), z.end(), 0.0);
    for (int i = 0; i < dim; ++i) {  // z = U^T w
      const double x = w[i];
      const float* u = U + size_t(i) * k;
      for (int j = 0; j < k; ++j) z[j] += double(u[j]) * x;
    }
    const float* off = offset ? offset + size_t(r) * dim : nullptr;
    for (int i = 0; i < dim; ++i) {  // w = U z + offset
      const float* u = U + size_t(i) * k;
      double v = off ? double(off[i]) : 0.0;
      for (int j = 0; j < k; ++j) v += double(u[j]) * z[j];
      w[i] = float(v);
    }
  }
}

}  // namespace swarm::compression
