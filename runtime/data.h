// data.h: training data as tokens, the deterministic microbatch sampler and the unigram baseline.
//
// Defines swarm::TokenData (the whole token stream split into train and validation) and
// `sample_microbatch`, which maps (seed, split, microbatch index) to the samples of that
// microbatch. The router and the single-process reference both sample through it, so the
// same job sees the same data in the same order wherever it runs, and a data position is just
// the next microbatch index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/job_spec.h"
#include "runtime/wire.h"

namespace swarm {

class TokenData {
 public:
  // Loads data.paths as data.format ("text": every byte is a token; "bin": little-endian
  // uint16 tokens, as nanoGPT's prepare scripts write). Throws SpecError on missing/empty files,
  // anything but regular files, files that together pass `max_bytes`, or when a split is too
  // short for one sample of seq_len + 1 tokens.
  static TokenData load(const DataSpec& data, int seq_len, int vocab_size, uint64_t max_bytes = kDefaultMaxDataBytes);
  static constexpr uint64_t kDefaultMaxDataBytes = uint64_t(1) << 30;
  // Made-up tokens for a simulated job whose data files are not at hand (sim/, `swarm sim`):
  // `tokens` uniform draws over the vocabulary from `seed`, split as data.val_fraction says
  // (each split at least seq_len + 1 tokens).
  static TokenData synthetic(const DataSpec& data, int seq_len, int vocab_size, size_t tokens, uint64_t seed);

  // Two bytes a token: every id fits (text: bytes; bin: uint16 on disk; the job spec allows
  // neither a larger vocabulary), and the router holds the whole stream.
  const std::vector<uint16_t>& train() const { return train_; }
  const std::vector<uint16_t>& val() const { return val_; }

  // Entropy in nats per token of the validation split's own token frequencies.
  double unigram_loss() const;
  // XXH3-64 of both splits: two copies with the same hash sample the same microbatches (a stage
  // server with the job's data samples its own tokens, docs/protocol.md "Tokens at the peers").
  uint64_t hash() const { return hash_; }

 private:
  std::vector<uint16_t> train_, val_;
  uint64_t hash_ = 0;
  void seal();
};

enum class Split { kTrain, kVal };

// One microbatch: x and y are [samples, seq_len] row-major int32, y is x shifted by one.
struct Microbatch {
  int samples = 0;
  int seq_len = 0;
  std::vector<int32_t> x, y;
};

// Deterministic: sample s of microbatch `index` starts at an offset drawn from a counter-based
// generator keyed by (seed, split, index, s). Validation microbatch i is always the same text.
Microbatch sample_microbatch(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                             int samples, int seq_len);
// The same tokens written in place: x and y each hold samples * seq_len, or are null where that
// half is not wanted (the router writes one of them straight into a tensor as it sends it).
void sample_microbatch_into(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                            int samples, int seq_len, int32_t* x, int32_t* y);
// As u16, what the router sends (half the bytes): for a vocabulary of at most 65,536.
void sample_microbatch_into(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                            int samples, int seq_len, uint16_t* x, uint16_t* y);
// A hop's tokens (x) or, with `targets`, its targets (y) of microbatch `index` of the job's
// split (validation for an eval batch): [samples, seq_len] u16, sealed, its buffer from the
// tensor pool. The router attaches them to a hop; a stage server that holds the data makes the
// very same tensor instead.
wire::Tensor microbatch_tensor(const TokenData& data, uint64_t seed, uint64_t index, bool eval, bool targets, int samples, int seq_len);

}  // namespace swarm
