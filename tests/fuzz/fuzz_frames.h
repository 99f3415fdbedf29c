// fuzz_frames.h: how a fuzz input becomes the ZeroMQ frames of one wire message, and back.
//
// Defines swarm::fuzz::FuzzFrames, `split_frames` (fuzz input -> frames + options) and
// `join_frames` (frames + options -> fuzz input, for the seed corpus). The one place that knows
// the layout, so the targets adapt here when the wire layer changes.
//
// Layout of an input (docs/fuzzing.md):
//   byte 0          options; bit 0 set: decode without verifying checksums (what a peer that
//                   computes correct checksums over bad bytes reaches); other bits ignored
//   bytes 1..       the frames, joined by the 8-byte separator kSeparator
// So an input of k separators gives k + 1 frames (an empty input: no frames at all). A
// separator rather than length prefixes: a mutation that grows or shrinks one frame leaves
// the others whole. 0xC1 is the one byte msgpack never uses, so the separator cannot occur in
// an envelope or body the encoder writes; `join_frames` refuses frames that contain it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

namespace swarm::fuzz {

constexpr std::string_view kSeparator{"\xc1" "FRAME\xc1\n", 8};
constexpr uint8_t kSkipChecksums = 1;

struct FuzzFrames {
  bool verify_checksums = true;
  std::vector<zmq::message_t> frames;
};

// Stops after max_frames frames (the rest of the input joins the last one), so that an input
// of separators alone cannot make millions of frames; the wire limit is below that anyway.
FuzzFrames split_frames(const uint8_t* data, size_t size, size_t max_frames);

// Throws std::invalid_argument if a frame contains kSeparator.
std::string join_frames(const std::vector<zmq::message_t>& frames, bool verify_checksums = true);

}  // namespace swarm::fuzz
