// subspace.h: the arithmetic of the subspace codec that needs no libtorch.
//
// Defines `subspace_basis` (the job's shared orthonormal basis U, a pure function of the
// seed), the payload of a subspace-coded tensor (`encode_subspace`, `decode_subspace`) and the
// deterministic projections that keep parameters in the constraint set (`project_columns`,
// `project_rows`). What a job's codecs ask of it (`SubspaceJob`, `subspace_job`) is part of the
// codec grammar, runtime/codec_spec.h. The model side (which parameters, the embedding's fixed
// part, torch tensors) is stages/subspace.h; the method, its byte layout and what was left out:
// docs/compression.md.
//
// A subspace-coded tensor stands for n = tokens * dim fp32 values (its frame keeps the shape
// [B, T, dim]) and carries, per token, an optional token id and k coefficients:
//   [tokens x id, little-endian, spec.id_bytes each] [the coefficients through spec.coefficients()]
// so its size, encoded_bytes(spec, n), is a pure function of the codec text and n.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "compression/codec.h"

namespace swarm::compression {

// U [dim, k] row-major with orthonormal columns: Gaussian draws keyed by (seed, dim, k), then
// Gram-Schmidt (twice) in double. The same bits on every machine, so every peer of every stage
// derives the same basis from the job's seed without sending it.
std::vector<float> subspace_basis(int dim, int k, uint64_t seed);

// Tokens (n / spec.dim) of a subspace payload standing for n values; CodecError if n is not
// whole tokens or the spec is not a bound subspace codec.
int64_t subspace_tokens(const CodecSpec& spec, int64_t n);

// coef: [tokens, k] fp32; ids: [tokens] (read only when spec.id_bytes > 0; each must fit that
// many bytes, else CodecError); dst: encoded_bytes(spec, n) bytes.
void encode_subspace(const CodecSpec& spec, const float* coef, const int64_t* ids, int64_t n, uint8_t* dst);

// Checks nbytes == encoded_bytes(spec, n) and the coefficient codes (CodecError otherwise),
// then writes [tokens, k] coefficients to coef and, when ids is not null and spec.id_bytes > 0,
// the tokens' ids. Needs no model: the router checks a hop with it without rebuilding anything.
void decode_subspace(const CodecSpec& spec, const uint8_t* src, size_t nbytes, int64_t n, float* coef,
                     int64_t* ids);

// W [dim, cols] row-major <- U U^T W: every column projected into span(U) (an output
// projection's weight [C, in], or a bias with cols = 1). Fixed loop order with double
// accumulation and no threads, so every machine gets the same bits: peers that must agree bit
// for bit (a group's global weights) can all run it.
void project_columns(const float* U, int dim, int k, float* W, int64_t cols);

// W [rows, dim] row-major <- W U U^T + offset: every row keeps its component in span(U) and
// takes offset's row (the fixed part, [rows, dim] row-major; null for zero) for the rest.
// Deterministic as project_columns.
void project_rows(const float* U, int dim, int k, float* W, int64_t rows, const float* offset);

}  // namespace swarm::compression
