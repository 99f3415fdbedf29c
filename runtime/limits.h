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
constexpr size_t kMaxBodyBytes = 4u << 20;            // frame 1 of SUBMIT, LOAD_STAGE, ROUND_REDUCE and the
                                                      // client replies (job specs and statuses live there)
constexpr size_t kMaxSmallBodyBytes = 16u << 10;      // frame 1 of every other message type
constexpr size_t kMaxTensorBytes = 1u << 30;          // one tensor frame
constexpr size_t kMaxMessageBytes = size_t(2) << 30;  // all frames of one message together
constexpr size_t kMaxPartBytes = 64u << 10;            // the pieces of one PART together (router connections)
constexpr size_t kMaxPartHeaderBytes = 64u << 10;      // frame 1 of a PART (part 0 lists every frame's size)
constexpr size_t kMaxTensorRank = 8;
constexpr int64_t kMaxTensorElements = int64_t(1) << 31;
constexpr size_t kMaxStringBytes = 64u << 10;        // any one string in a body
constexpr size_t kMaxJobSpecBytes = 1u << 20;        // the job spec JSON text
constexpr size_t kMaxMapEntries = 1024;              // entries in one msgpack map
constexpr size_t kMaxArrayEntries = 65536;           // entries in one msgpack array (a status's loss history)
constexpr size_t kMaxBinBytes = 1u << 20;            // one msgpack bin value in a body
constexpr size_t kMaxPeerIdBytes = 64;
constexpr size_t kMaxTextBytes = 1024;                // a free-text field: an error message, a reason, a device name
constexpr int kMaxStages = 256;

// What one job or one router may hold, so that no request makes the router allocate without bound.
constexpr int kMaxInflight = 4096;                    // max_inflight of a job (microbatches in flight)
constexpr int64_t kMaxSteps = int64_t(1) << 31;       // steps of a job
constexpr size_t kMaxDataPaths = 256;                 // data.path entries of a job spec
constexpr size_t kMaxPeers = 16384;                   // stage servers registered with one router at once
constexpr size_t kMaxClients = 1024;                  // client sessions the router keeps at once
constexpr size_t kMaxJobs = 1024;                     // jobs the router keeps (the oldest finished are forgotten)
constexpr size_t kMaxPeersPerReply = 1000;            // peers in one PEERS_REPLY (clients page through the rest)
constexpr int64_t kMaxBenchCount = 10000000;          // FORWARDs of one transport benchmark
constexpr int64_t kMaxMicrobatchBytes = int64_t(1) << 30;  // one activation [B, T, d_model] in fp32

}  // namespace swarm::limits
