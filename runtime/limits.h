// limits.h: every limit on what the network may send us, in one place.
//
// Each is checked before anything is allocated for the message it bounds. A message over a
// limit gets WireErrc::kTooLarge and is dropped. Change them here and in docs/protocol.md.
#pragma once

#include <cstddef>
#include <cstdint>

namespace swarm::limits {

constexpr size_t kMaxFrames = 4096;                   // frames in one multipart message
constexpr size_t kMaxEnvelopeBytes = 256;             // frame 0
constexpr size_t kMaxBodyBytes = 4u << 20;            // frame 1 (msgpack body; job specs live here)
constexpr size_t kMaxTensorBytes = 1u << 30;          // one tensor frame
constexpr size_t kMaxMessageBytes = size_t(2) << 30;  // all frames of one message together
constexpr size_t kMaxTensorRank = 8;
constexpr int64_t kMaxTensorElements = int64_t(1) << 31;
constexpr size_t kMaxStringBytes = 64u << 10;        // any one string in a body
constexpr size_t kMaxJobSpecBytes = 1u << 20;        // the job spec JSON text
constexpr size_t kMaxMapEntries = 1024;              // entries in one msgpack map
constexpr size_t kMaxArrayEntries = 65536;           // entries in one msgpack array (a status's loss history)
constexpr size_t kMaxBinBytes = 1u << 20;            // one msgpack bin value in a body
constexpr size_t kMaxPeerIdBytes = 64;
constexpr int kMaxStages = 256;

}  // namespace swarm::limits
