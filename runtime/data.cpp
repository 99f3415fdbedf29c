// data.cpp: loading token data, the train/val split, the unigram baseline and the
// deterministic microbatch sampler (runtime/data.h).
//
// The sampler is counter-based: the start offset of sample s of microbatch i is a pure
// function of (seed, split, i, s) through splitmix64, so any process (the router, the
// single-process reference, a restarted router) draws exactly the same microbatches.
#include "runtime/data.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "runtime/errors.h"
#include "runtime/random.h"

namespace swarm {
namespace {

// The file's bytes, when it is a regular file and `budget` (bytes left of the job's data cap)
// holds it; the size is checked before anything is read, so a device or a huge file costs nothing.
std::string read_file(const std::string& path, uint64_t& budget) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw SpecError("data.path: \"" + path + "\" is a directory; list the files in it instead");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw SpecError("data.path: cannot read \"" + path + "\" (" + std::strerror(errno) +
                    "); check the path in the job spec's data.path");
  }
  if (!S_ISREG(st.st_mode)) {
    throw SpecError("data.path: \"" + path + "\" is not a regular file (a device, FIFO or socket); name a file of training data");
  }
  if (uint64_t(st.st_size) > budget) {
    throw SpecError("data.path: \"" + path + "\" (" + std::to_string(st.st_size) + " bytes) takes the job's data past the " +
                    "limit this loader was given (" + std::to_string(budget) + " bytes left); use fewer or smaller files, "
                    "or raise the limit (swarm-router --max-data-bytes)");
  }
  budget -= uint64_t(st.st_size);
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    throw SpecError("data.path: cannot read \"" + path + "\" (" + std::strerror(errno) +
                    "); check the path in the job spec's data.path");
  }
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw SpecError("data.path: error while reading \"" + path + "\"");
  return bytes;
}

std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", f * 100.0);
  return buf;
}

}  // namespace

TokenData TokenData::load(const DataSpec& data, int seq_len, int vocab_size, uint64_t max_bytes) {
  if (data.format != "text" && data.format != "bin") {
    throw SpecError("data.format: must be \"text\" or \"bin\", got \"" + data.format + "\"");
  }
  if (data.paths.empty()) throw SpecError("data.path: no files given; name at least one file");
  if (!(data.val_fraction > 0.0 && data.val_fraction < 1.0)) {
    throw SpecError("data.val_fraction: must be between 0 and 1 (exclusive)");
  }
  if (seq_len < 1) throw SpecError("model.seq_len: must be at least 1");
  if (vocab_size < 1) throw SpecError("model.vocab_size: must be at least 1");

  std::vector<uint16_t> all;
  uint64_t budget = max_bytes;
  for (const auto& path : data.paths) {
    std::string bytes = read_file(path, budget);
    if (bytes.empty()) {
      throw SpecError("data.path: \"" + path + "\" is empty; remove it from data.path or give a file with data");
    }
    size_t base = all.size();
    if (data.format == "text") {
      all.reserve(base + bytes.size());
      for (unsigned char c : bytes) all.push_back(uint16_t(c));
    } else {
      if (bytes.size() % 2 != 0) {
        throw SpecError("data.path: \"" + path + "\" has " + std::to_string(bytes.size()) +
                        " bytes, an odd count, so it is not a file of uint16 tokens (data.format \"bin\"); "
                        "use data.format \"text\" for plain text");
      }
      all.reserve(base + bytes.size() / 2);
      for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
        all.push_back(uint16_t(uint16_t(uint8_t(bytes[i])) | (uint16_t(uint8_t(bytes[i + 1])) << 8)));
      }
    }
    for (size_t i = base; i < all.size(); ++i) {
      if (int(all[i]) >= vocab_size) {
        throw SpecError("data.path: \"" + path + "\": token " + std::to_string(all[i]) + " at position " +
                        std::to_string(i - base) + " of the file is >= model.vocab_size " +
                        std::to_string(vocab_size) + "; raise model.vocab_size to cover the tokenizer's "
                        "vocabulary or check that the file was written with it");
      }
    }
  }

  const size_t n = all.size();
  size_t n_val = size_t(std::llround(double(n) * data.val_fraction));
  if (n_val > n) n_val = n;
  const size_t n_train = n - n_val;
  const size_t need = size_t(seq_len) + 1;
  auto too_short = [&](const char* which, size_t have, const std::string& share) {
    throw SpecError("data: the " + std::string(which) + " split holds " + std::to_string(have) + " tokens (" +
                    share + " of " + std::to_string(n) + "), fewer than model.seq_len + 1 = " +
                    std::to_string(need) + " needed for one sample; use more data, change data.val_fraction, "
                    "or lower model.seq_len");
  };
  if (n_train < need) too_short("training", n_train, pct(1.0 - data.val_fraction));
  if (n_val < need) too_short("validation", n_val, pct(data.val_fraction));

  TokenData d;
  d.train_.assign(all.begin(), all.begin() + std::ptrdiff_t(n_train));
  d.val_.assign(all.begin() + std::ptrdiff_t(n_train), all.end());
  d.seal();
  return d;
}

void TokenData::seal() {
  const uint64_t t = wire::checksum(train_.data(), train_.size() * sizeof(uint16_t));
  const uint64_t v = wire::checksum(val_.data(), val_.size() * sizeof(uint16_t));
  hash_ = t ^ (v * 0x9E3779B97F4A7C15ull + train_.size());
}

TokenData TokenData::synthetic(const DataSpec& data, int seq_len, int vocab_size, size_t tokens, uint64_t seed) {
  const size_t need = size_t(seq_len) + 1;
  const size_t n_val = std::max(need, size_t(std::llround(double(tokens) * data.val_fraction)));
  const size_t n_train = std::max(need, tokens > n_val ? tokens - n_val : 0);
  TokenData d;
  SWARM_CHECK(vocab_size <= 65536, "a vocabulary of at most 65,536 (what data.format allows)");
  auto fill = [&](std::vector<uint16_t>& v, size_t n, uint64_t stream) {
    v.resize(n);
    for (size_t i = 0; i < n; ++i) v[i] = uint16_t(counter_draw(seed, i, 0, stream) % uint64_t(std::max(1, vocab_size)));
  };
  fill(d.train_, n_train, 1);
  fill(d.val_, n_val, 2);
  d.seal();
  return d;
}

double TokenData::unigram_loss() const {
  if (val_.empty()) return 0.0;
  std::vector<uint64_t> counts(size_t(1) << 16, 0);
  for (uint16_t t : val_) counts[t] += 1;
  const double total = double(val_.size());
  double h = 0.0;
  for (uint64_t c : counts) {
    if (c == 0) continue;
    const double p = double(c) / total;
    h -= p * std::log(p);
  }
  return h;
}

Microbatch sample_microbatch(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                             int samples, int seq_len) {
  Microbatch mb;
  mb.samples = samples;
  mb.seq_len = seq_len;
  mb.x.resize(size_t(std::max(0, samples)) * size_t(std::max(0, seq_len)));
  mb.y.resize(mb.x.size());
  sample_microbatch_into(data, split, seed, index, samples, seq_len, mb.x.data(), mb.y.data());
  return mb;
}

namespace {

template <class Out>
void sample_into(const TokenData& data, Split split, uint64_t seed, uint64_t index, int samples, int seq_len, Out* x,
                 Out* y) {
  SWARM_CHECK(samples >= 1, "samples must be positive");
  SWARM_CHECK(seq_len >= 1, "seq_len must be positive");
  const std::vector<uint16_t>& toks = split == Split::kTrain ? data.train() : data.val();
  if (toks.size() < size_t(seq_len) + 1) {
    throw SpecError(std::string("data: the ") + (split == Split::kTrain ? "training" : "validation") +
                    " split holds " + std::to_string(toks.size()) + " tokens, fewer than seq_len + 1 = " +
                    std::to_string(seq_len + 1));
  }
  // Valid starts o satisfy o + seq_len <= size - 1 (y needs one token past x): size - seq_len of them.
  const uint64_t n_starts = uint64_t(toks.size()) - uint64_t(seq_len);
  const uint64_t key = splitmix64(splitmix64(seed) ^ (split == Split::kTrain ? 0x7472616eull : 0x76616cull));

  const size_t T = size_t(seq_len);
  const uint64_t per_index = splitmix64(key ^ splitmix64(index));
  for (int s = 0; s < samples; ++s) {
    const uint64_t r = splitmix64(per_index ^ splitmix64(uint64_t(s) + 0x5a5a5a5aull));
    // Multiply-high maps r to [0, n_starts) with a bias below n_starts / 2^64.
    const uint64_t o = uint64_t((unsigned __int128)r * n_starts >> 64);
    const uint16_t* src = toks.data() + o;
    if (x) std::copy(src, src + T, x + size_t(s) * T);
    if (y) std::copy(src + 1, src + 1 + T, y + size_t(s) * T);
  }
}

}  // namespace

void sample_microbatch_into(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                            int samples, int seq_len, int32_t* x, int32_t* y) {
  sample_into(data, split, seed, index, samples, seq_len, x, y);
}

void sample_microbatch_into(const TokenData& data, Split split, uint64_t seed, uint64_t index,
                            int samples, int seq_len, uint16_t* x, uint16_t* y) {
  sample_into(data, split, seed, index, samples, seq_len, x, y);
}

wire::Tensor microbatch_tensor(const TokenData& data, uint64_t seed, uint64_t index, bool eval, bool targets, int samples, int seq_len) {
  const size_t n = size_t(samples) * size_t(seq_len);
  wire::Tensor t = wire::make_pooled_tensor(wire::DType::kU16, {samples, seq_len}, compression::CodecSpec{}, n * 2);
  auto* out = static_cast<uint16_t*>(t.data.data());
  sample_microbatch_into(data, eval ? Split::kVal : Split::kTrain, seed, index, samples, seq_len, targets ? nullptr : out, targets ? out : nullptr);
  wire::seal(t);
  return t;
}

}  // namespace swarm
