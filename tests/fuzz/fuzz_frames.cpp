// fuzz_frames.cpp: the fuzz input <-> frames layout of fuzz_frames.h.
#include "tests/fuzz/fuzz_frames.h"

#include <stdexcept>

namespace swarm::fuzz {

FuzzFrames split_frames(const uint8_t* data, size_t size, size_t max_frames) {
  FuzzFrames out;
  if (size == 0) return out;
  out.verify_checksums = (data[0] & kSkipChecksums) == 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  size_t at = 0;
  while (out.frames.size() + 1 < max_frames) {
    const size_t sep = in.find(kSeparator, at);
    if (sep == std::string_view::npos) break;
    out.frames.emplace_back(in.data() + at, sep - at);
    at = sep + kSeparator.size();
  }
  out.frames.emplace_back(in.data() + at, in.size() - at);
  return out;
}

std::string join_frames(const std::vector<zmq::message_t>& frames, bool verify_checksums) {
  std::string out(1, char(verify_checksums ? 0 : kSkipChecksums));
  for (size_t i = 0; i < frames.size(); ++i) {
    const std::string_view f(static_cast<const char*>(frames[i].data()), frames[i].size());
    if (f.find(kSeparator) != std::string_view::npos)
      throw std::invalid_argument("frame " + std::to_string(i) + " contains the fuzz frame separator");
    if (i) out += kSeparator;
    out += f;
  }
  return out;
}

}  // namespace swarm::fuzz
