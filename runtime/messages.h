// messages.h: one struct per message body of the wire protocol (docs/protocol.md).
//
// Each struct names its message type (kType, or kTypes when several types share a body) and
// lists its fields once, in `visit(V&)`, with each field's limits: the same list encodes
// (BodyWriter) and decodes (BodyReader, which checks every field's msgpack type and range and
// throws WireError(kMalformed) naming the field). Code behind the edge only sees these structs.
// `make` builds a wire::Message from a struct; `read` reads one back. The bodies of
// STATUS_REPLY and PEERS_REPLY are JSON objects for people and scripts (wire::json_message).
// Fields are listed in alphabetical order, the order the C++ encoder writes them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/body.h"
#include "runtime/limits.h"
#include "runtime/wire.h"

namespace swarm::msg {

using wire::kOptional;
using wire::kRequired;
using wire::MsgType;

constexpr int64_t kMaxStageIndex = limits::kMaxStages - 1;
constexpr double kMaxMs = 1e9;          // any duration in milliseconds (11 days)
constexpr uint64_t kMaxCount = uint64_t(1) << 53;  // counters, sample counts

// A peer's role in HELLO.
enum class Role { kStage = 0, kClient = 1 };
inline const std::vector<const char*>& role_names() {
  static const std::vector<const char*> n{"stage", "client"};
  return n;
}

// What a within-stage round exchanges: DiLoCo outer gradients theta_g - theta ("delta"), or the
// gradient sums of one data-parallel step ("grad": diloco.sync every_step and the warm start).
enum class RoundWhat { kDelta = 0, kGrad = 1 };
inline const std::vector<const char*>& round_what_names() {
  static const std::vector<const char*> n{"delta", "grad"};
  return n;
}
inline const char* round_what_name(RoundWhat w) { return round_what_names()[size_t(w)]; }

struct Hello {
  static constexpr MsgType kType = MsgType::kHello;
  std::optional<int64_t> device_memory_bytes;       // total memory of the device [bytes]
  std::optional<int64_t> device_memory_free_bytes;  // free memory of the device when it said HELLO [bytes]
  std::string device = "cpu";
  std::string device_name;
  bool echo = false;                 // transport-benchmark peer
  double emulate = 1;                // compute slow-down factor (--emulate)
  std::string listen;                // where other peers fetch tensors from it (tcp://host:port); empty: none (relayed)
  std::string metrics;               // its own /metrics (http://host:port/metrics, swarm-stage --http); empty: none
  std::string name;                  // shown in `swarm peers`; the router keeps 64 bytes of it
  bool parts = false;                // it takes a large message in PARTs (wire::PartJoiner): the router sends it so
  int64_t pid = 0;
  int32_t prefer_stage = -1;
  std::string precision;             // what it computes in unless a job pins one ("fp32", "bf16", "fp16")
  std::string profile;
  Role role = Role::kStage;
  int32_t stage = -1;
  int32_t threads = 0;
  int64_t version = 0;               // checked by the receiver: bad_version unless wire::kVersion
  template <class V>
  void visit(V& v) {
    v.field("device", device, kOptional, size_t(64));
    v.field("device_memory_bytes", device_memory_bytes, kOptional, int64_t(0), wire::kIntMax);
    v.field("device_memory_free_bytes", device_memory_free_bytes, kOptional, int64_t(0), wire::kIntMax);
    v.field("device_name", device_name, kOptional, size_t(255));
    v.field("echo", echo, kOptional);
    v.field("emulate", emulate, kOptional, 1.0, 1e6);
    v.field("listen", listen, kOptional, wire::kMaxAddressBytes);
    v.field("metrics", metrics, kOptional, wire::kMaxAddressBytes);
    v.field("name", name, kOptional, size_t(255));
    v.field("parts", parts, kOptional);
    v.field("pid", pid, kOptional, int64_t(0), wire::kIntMax);
    v.field("precision", precision, kOptional, size_t(16));
    v.field("prefer_stage", prefer_stage, kOptional, -1, kMaxStageIndex);
    v.field("profile", profile, kOptional, size_t(64));
    role = Role(v.choice("role", role_names(), kRequired, int(role)));
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    v.field("threads", threads, kOptional, 0, 1 << 16);
    v.field("version", version, kOptional, wire::kIntMin, wire::kIntMax);
  }
};

struct Welcome {
  static constexpr MsgType kType = MsgType::kWelcome;
  std::optional<int32_t> heartbeat_ms;   // to a stage: the pace of heartbeats
  std::optional<int32_t> liveness;       // to a stage: heartbeats missed before it is dead
  bool parts = false;                    // the router takes a large message in PARTs: send it so
  std::optional<std::string> peer_id;    // to a stage: its routing id (msgpack bin)
  std::optional<std::string> role;       // to a client: "client"
  std::optional<int64_t> version;        // to a client
  template <class V>
  void visit(V& v) {
    v.field("heartbeat_ms", heartbeat_ms, kOptional, 1, 3600 * 1000);
    v.field("liveness", liveness, kOptional, 1, 1000);
    v.field("parts", parts, kOptional);
    v.bytes("peer_id", peer_id, kOptional, size_t(255));   // msgpack bin: a routing id is any bytes
    v.field("role", role, kOptional, size_t(16));
    v.field("version", version, kOptional, int64_t(0), wire::kIntMax);
  }
};

// A stage server's heartbeat (the router's own heartbeats have an empty body).
struct Heartbeat {
  static constexpr MsgType kType = MsgType::kHeartbeat;
  uint64_t backwards = 0, cache_hits = 0, errors = 0, forwards = 0;
  std::optional<int64_t> cache_entries;  // graphs its affinity cache may keep for the loaded stage (sized to its memory)
  uint64_t job_id = 0;
  double loss_scale = 0;       // its current loss scale; 0: no loss scaling
  double ms_per_unit = 0;      // the peer's own EMA of compute ms per work unit; 0: not measured
  uint64_t overflows = 0;      // backwards whose gradients overflowed (mixed precision)
  uint64_t queue = 0;          // requests waiting for its compute thread
  bool ready = false;
  bool receiving = false;     // a large message from the router is coming in PARTs: its replies come after it
  uint64_t recomputes = 0;
  uint64_t skipped_steps = 0;  // optimizer steps skipped for an overflow
  int32_t stage = -1;
  uint64_t steps = 0;
  template <class V>
  void visit(V& v) {
    v.field("backwards", backwards, kOptional, kMaxCount);
    v.field("cache_entries", cache_entries, kOptional, int64_t(0), wire::kIntMax);
    v.field("cache_hits", cache_hits, kOptional, kMaxCount);
    v.field("errors", errors, kOptional, kMaxCount);
    v.field("forwards", forwards, kOptional, kMaxCount);
    v.field("job_id", job_id, kOptional, kMaxCount);
    v.field("loss_scale", loss_scale, kOptional, 0.0, 1e30);
    v.field("ms_per_unit", ms_per_unit, kOptional, 0.0, kMaxMs);
    v.field("overflows", overflows, kOptional, kMaxCount);
    v.field("queue", queue, kOptional, kMaxCount);
    v.field("ready", ready, kOptional);
    v.field("receiving", receiving, kOptional);
    v.field("recomputes", recomputes, kOptional, kMaxCount);
    v.field("skipped_steps", skipped_steps, kOptional, kMaxCount);
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    v.field("steps", steps, kOptional, kMaxCount);
  }
};

struct Bye {
  static constexpr MsgType kType = MsgType::kBye;
  std::string reason;
  template <class V>
  void visit(V& v) { v.field("reason", reason, kOptional, limits::kMaxTextBytes); }
};

struct Error {
  static constexpr MsgType kType = MsgType::kError;
  int32_t code = 0;                     // a WireErrc
  std::string message;                  // a sentence for a person
  std::string name;                     // the code's name ("malformed", "bad_job_spec", ...)
  std::optional<int32_t> request_type;  // the offending request's type, when it could be decoded
  std::optional<int32_t> tensor;        // bad_tensor about a request tensor: its index (its maker is to blame)
  // unreachable: the holder sent this peer a tensor within timing::kHeardWithinS, so its link is
  // busy rather than cut (the router sends the hop again before it relays anything).
  bool reached = false;
  template <class V>
  void visit(V& v) {
    v.field("code", code, kRequired, 0, 1000);
    v.field("message", message, kOptional, size_t(8192));
    v.field("name", name, kOptional, size_t(64));
    v.field("request_type", request_type, kOptional, 0, 1000);
    v.field("tensor", tensor, kOptional, 0, int64_t(limits::kMaxFrames));
    v.field("reached", reached, kOptional);
  }
};

struct LoadStage {
  static constexpr MsgType kType = MsgType::kLoadStage;
  uint64_t job_id = 0;
  nlohmann::json spec;     // the job spec with every default filled in (parse_job_spec checks it)
  int32_t stage = 0;
  // The first and last stages: TokenData::hash of the router's copy of the job's data. A stage
  // server that may read the spec's data files (swarm-stage --data-root) and finds the same
  // tokens there samples each hop's tokens or targets itself (StageReady.data, Hop.own_tokens).
  std::optional<uint64_t> data_hash;
  template <class V>
  void visit(V& v) {
    v.field("job_id", job_id, kRequired, kMaxCount);
    v.field("spec", spec, kRequired);
    v.field("stage", stage, kRequired, 0, kMaxStageIndex);
    v.field("data_hash", data_hash, kOptional);
  }
};

struct StageReady {
  static constexpr MsgType kType = MsgType::kStageReady;
  std::optional<bool> data;   // it loaded the job's data and found LoadStage.data_hash: send it no tokens
  bool echo = false;
  double fwd_ms = 0;       // one measured forward [ms]
  uint64_t hash = 0;       // state hash of theta_g and momentum
  uint64_t job_id = 0;
  int64_t params = 0;      // the stage's parameter count
  std::string precision;   // what it computes this stage in
  int32_t stage = -1;
  template <class V>
  void visit(V& v) {
    v.field("data", data, kOptional);
    v.field("echo", echo, kOptional);
    v.field("fwd_ms", fwd_ms, kOptional, 0.0, kMaxMs);
    v.field("hash", hash, kOptional);
    v.field("job_id", job_id, kOptional, kMaxCount);
    v.field("params", params, kOptional, int64_t(0), int64_t(1) << 40);
    v.field("precision", precision, kOptional, size_t(16));
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
  }
};

// FORWARD, FORWARD_LOSS, BACKWARD and EVAL.
struct Hop {
  static constexpr MsgType kTypes[] = {MsgType::kForward, MsgType::kForwardLoss, MsgType::kBackward, MsgType::kEval};
  bool eval = false;
  uint64_t job_id = 0;
  uint64_t mb = 0;         // the microbatch's data index (the validation batch's for EVAL)
  int32_t stage = 0;
  // A training BACKWARD or FORWARD_LOSS under `async`: no other microbatch of this job step is
  // left to run its backward at this stage, so the peer may take the step once this one's
  // gradients are added (instead of waiting for the next step's first backward). Sent only
  // when true: other hops carry no byte more.
  std::optional<bool> closes_step;
  // Peer to peer, with hold: push the output to this listen address (its key `push_to_key` under
  // CURVE) as soon as it is made, as PUSH would: the peer the router expects to take the next hop.
  std::optional<std::string> push_to, push_to_key;
  // The hop carries no tokens (stage 0) or targets (the last stage's FORWARD_LOSS and EVAL): the
  // peer samples them from its own copy of the job's data (StageReady.data), as
  // microbatch_tensor (runtime/data.h) makes them for `mb`, and puts them in with put_own.
  std::optional<bool> own_tokens;
  // Training hops: a stage server keeps a copy of each tensor it fetched (or was pushed) for one,
  // so that a BACKWARD that comes back to the peer of its forward finds its input there, until
  // the router RELEASEs it with the microbatch's other tensors. What an EVAL or a round fetched
  // is used once, and not kept.
  static bool keeps_copies(MsgType t) { return t == MsgType::kForward || t == MsgType::kForwardLoss || t == MsgType::kBackward; }
  // Whether a hop of type `t` at `stage` of `stages` goes with tokens (the first stage) and with
  // targets (the last stage's FORWARD_LOSS and EVAL).
  static bool takes_tokens(int stage) { return stage == 0; }
  static bool takes_targets(MsgType t, int stage, int stages) {
    return stage == stages - 1 && (t == MsgType::kForwardLoss || t == MsgType::kEval);
  }
  // An own_tokens hop made whole, before its references are resolved: the tokens become slot 0,
  // ahead of what the message carries (the router numbered its references without them: each
  // moves up one, so every slot the peer reports, in RESULT.fetched or an ERROR, counts the
  // tokens as slot 0), and the targets the last slot.
  static void put_own(wire::Message& m, std::optional<wire::Tensor> tokens, std::optional<wire::Tensor> targets) {
    if (tokens) {
      for (wire::TensorRef& r : m.refs) r.slot++;
      m.tensors.insert(m.tensors.begin(), std::move(*tokens));
    }
    if (targets) m.tensors.push_back(std::move(*targets));
  }
  template <class V>
  void visit(V& v) {
    v.field("eval", eval, kOptional);
    v.field("job_id", job_id, kRequired, kMaxCount);
    v.field("mb", mb, kRequired);
    v.field("stage", stage, kRequired, 0, kMaxStageIndex);
    v.field("closes_step", closes_step, kOptional);
    v.field("push_to", push_to, kOptional, wire::kMaxAddressBytes);
    v.field("push_to_key", push_to_key, kOptional, size_t(40));
    v.field("own_tokens", own_tokens, kOptional);
  }
};

// The reply to a hop or a STEP.
struct Result {
  static constexpr MsgType kType = MsgType::kResult;
  std::optional<bool> cached;                 // BACKWARD: the forward's graph was still cached
  std::optional<std::vector<double>> codec_us;  // [act encode, act decode, grad encode, grad decode] [us]
  std::optional<double> compute_ms;           // compute time of a hop [ms], padded by --emulate
  std::optional<double> fetch_ms;             // peer to peer: from the request's arrival until its last fetched or pushed tensor came [ms]
  std::optional<std::vector<int64_t>> fetched;  // bytes of each request tensor fetched from another peer (0: it was local or inline)
  std::optional<double> loss;                 // FORWARD_LOSS, last-stage EVAL: mean cross-entropy
  std::optional<double> loss_scale;           // STEP: the peer's loss scale after it (with loss scaling)
  uint64_t mb = 0;
  std::optional<int64_t> push_late;           // of the request's pushed references, those fetched after all (not there in time)
  std::optional<bool> overflow;               // a backward's gradients overflowed (with loss scaling)
  std::optional<int64_t> samples;
  std::optional<bool> skipped;                // STEP: the step was skipped
  int32_t stage = -1;
  std::optional<int64_t> steps;               // STEP: inner steps taken so far
  template <class V>
  void visit(V& v) {
    v.field("cached", cached, kOptional);
    v.field("codec_us", codec_us, kOptional, size_t(4), 0.0, 1e15);
    v.field("compute_ms", compute_ms, kOptional, 0.0, kMaxMs);
    v.field("fetch_ms", fetch_ms, kOptional, 0.0, kMaxMs);
    v.field("fetched", fetched, kOptional, size_t(4), int64_t(0), int64_t(limits::kMaxMessageBytes));
    v.field("loss", loss, kOptional, 0.0, 1e6);
    v.field("loss_scale", loss_scale, kOptional, 0.0, 1e30);
    v.field("mb", mb, kOptional);
    v.field("overflow", overflow, kOptional);
    v.field("push_late", push_late, kOptional, int64_t(0), int64_t(4));
    v.field("samples", samples, kOptional, int64_t(0), int64_t(kMaxCount));
    v.field("skipped", skipped, kOptional);
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    v.field("steps", steps, kOptional, int64_t(0), int64_t(kMaxCount));
  }
};

struct Step {
  static constexpr MsgType kType = MsgType::kStep;
  uint64_t job_id = 0;
  bool skip = false;       // drop the step's gradients: a backward of this step overflowed on some stage
  template <class V>
  void visit(V& v) {
    v.field("job_id", job_id, kRequired, kMaxCount);
    v.field("skip", skip, kOptional);
  }
};

// The round's identity, shared by ROUND_BEGIN, ROUND_REDUCE and ROUND_APPLY.
constexpr int32_t kMaxShards = 256;   // parts a round's values are cut into (peer to peer: one owner each)

struct RoundRef {
  int32_t fragment = 0;
  int32_t fragments = 1;
  uint64_t job_id = 0;
  uint64_t round = 0;
  int32_t shard = 0;       // ROUND_REDUCE: the part it reduces
  int32_t shards = 1;      // the round's values cut into this many contiguous parts (diloco::fragment_range)
  int32_t stage = 0;
  RoundWhat what = RoundWhat::kDelta;
  template <class V>
  void visit(V& v) {
    v.field("fragment", fragment, kOptional, 0, 4095);
    v.field("fragments", fragments, kOptional, 1, 4096);
    v.field("job_id", job_id, kRequired, kMaxCount);
    v.field("round", round, kRequired, kMaxCount);
    v.field("shard", shard, kOptional, 0, kMaxShards - 1);
    v.field("shards", shards, kOptional, 1, kMaxShards);
    v.field("stage", stage, kRequired, 0, kMaxStageIndex);
    what = RoundWhat(v.choice("what", round_what_names(), kOptional, int(what)));
  }
};

struct RoundBegin : RoundRef {
  static constexpr MsgType kType = MsgType::kRoundBegin;
  // A round alongside training (async): every microbatch of job steps 1..step has completed; a
  // peer holding gradients of one of them takes that step before it computes its delta.
  std::optional<uint64_t> step;
  template <class V>
  void visit(V& v) {
    RoundRef::visit(v);
    v.field("step", step, kOptional, kMaxCount);
  }
};

struct RoundDelta {
  static constexpr MsgType kType = MsgType::kRoundDelta;
  uint64_t round = 0;
  int64_t samples = 0;     // what the peer says it trained on; the router weighs by what it counted
  int32_t stage = -1;
  RoundWhat what = RoundWhat::kDelta;
  template <class V>
  void visit(V& v) {
    v.field("round", round, kRequired, kMaxCount);
    v.field("samples", samples, kOptional, int64_t(0), int64_t(kMaxCount));
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    what = RoundWhat(v.choice("what", round_what_names(), kOptional, int(what)));
  }
};

// To the round's reducer: every member's outer gradient (one tensor each) and its weight, as the
// router counted it. "delta": the reducer forms sum(w_i d_i) / sum(w_i); "grad": sum(d_i).
struct RoundReduce : RoundRef {
  static constexpr MsgType kType = MsgType::kRoundReduce;
  std::vector<double> weights;
  template <class V>
  void visit(V& v) {
    RoundRef::visit(v);
    v.field("weights", weights, kRequired, limits::kMaxFrames, 0.0, double(kMaxCount));
  }
};

struct RoundReduced {
  static constexpr MsgType kType = MsgType::kRoundReduced;
  uint64_t round = 0;
  int32_t stage = -1;
  std::vector<int64_t> outliers;   // contributions (their index in the ROUND_REDUCE) left out of the mean
  std::vector<int64_t> far;        // those of them far past any honest spread (diloco::kBlameFactor)
  template <class V>
  void visit(V& v) {
    v.field("round", round, kRequired, kMaxCount);
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    v.field("outliers", outliers, kOptional, size_t(256), int64_t(0), int64_t(255));
    v.field("far", far, kOptional, size_t(256), int64_t(0), int64_t(255));
  }
};

struct RoundApply : RoundRef {
  static constexpr MsgType kType = MsgType::kRoundApply;
  int32_t contributors = 0;
  int64_t samples = 0;     // the group's samples this round ("grad": the step's sample count)
  template <class V>
  void visit(V& v) {
    RoundRef::visit(v);
    v.field("contributors", contributors, kOptional, 0, 1 << 20);
    v.field("samples", samples, kOptional, int64_t(0), int64_t(kMaxCount));
  }
};

struct RoundDone {
  static constexpr MsgType kType = MsgType::kRoundDone;
  uint64_t hash = 0;
  uint64_t round = 0;
  int32_t stage = -1;
  template <class V>
  void visit(V& v) {
    v.field("hash", hash, kRequired);
    v.field("round", round, kOptional, kMaxCount);
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
  }
};

struct StateRequest {
  static constexpr MsgType kType = MsgType::kStateRequest;
  bool full = false;       // also theta, AdamW moments and step (snapshots, every_step joiners)
  uint64_t job_id = 0;
  template <class V>
  void visit(V& v) {
    v.field("full", full, kOptional);
    v.field("job_id", job_id, kRequired, kMaxCount);
  }
};

struct StateReply {
  static constexpr MsgType kType = MsgType::kStateReply;
  std::optional<int64_t> adam_step;
  bool full = false;
  uint64_t hash = 0;
  double loss_scale = 0;              // full: its loss scale (0: no loss scaling)
  int64_t loss_scale_good_steps = 0;  // full: good steps since the scale last changed
  int32_t stage = -1;
  std::optional<int64_t> steps;
  template <class V>
  void visit(V& v) {
    v.field("adam_step", adam_step, kOptional, int64_t(0), int64_t(kMaxCount));
    v.field("full", full, kOptional);
    v.field("hash", hash, kOptional);
    v.field("loss_scale", loss_scale, kOptional, 0.0, 1e30);
    v.field("loss_scale_good_steps", loss_scale_good_steps, kOptional, int64_t(0), int64_t(kMaxCount));
    v.field("stage", stage, kOptional, -1, kMaxStageIndex);
    v.field("steps", steps, kOptional, int64_t(0), int64_t(kMaxCount));
  }
};

struct StateLoad {
  static constexpr MsgType kType = MsgType::kStateLoad;
  std::optional<int64_t> adam_step;   // required with 5 tensors
  uint64_t job_id = 0;
  double loss_scale = 0;              // with 5 tensors: the loss scale to continue with (0: keep its own)
  int64_t loss_scale_good_steps = 0;
  template <class V>
  void visit(V& v) {
    v.field("adam_step", adam_step, kOptional, int64_t(0), int64_t(kMaxCount));
    v.field("job_id", job_id, kRequired, kMaxCount);
    v.field("loss_scale", loss_scale, kOptional, 0.0, 1e30);
    v.field("loss_scale_good_steps", loss_scale_good_steps, kOptional, int64_t(0), int64_t(kMaxCount));
  }
};

// A transport benchmark: `count` FORWARDs of `bytes` bytes to echo peers, `inflight` at a time.
struct BenchTransport {
  int64_t bytes = 0;
  int64_t count = 0;
  int32_t inflight = 8;
};

struct Submit {
  static constexpr MsgType kType = MsgType::kSubmit;
  std::optional<nlohmann::json> bench_transport;   // {bytes, count, inflight?}: see bench()
  std::string resume;                              // a checkpoint dir or step dir, as the router sees it
  std::optional<nlohmann::json> spec;              // a job spec (parse_job_spec checks it)
  template <class V>
  void visit(V& v) {
    v.field("bench_transport", bench_transport, kOptional);
    v.field("resume", resume, kOptional, size_t(4096));
    v.field("spec", spec, kOptional);
  }
  // bench_transport, checked: 0 < bytes <= the tensor limit, 0 < count <= kMaxBenchCount,
  // 1 <= inflight <= kMaxInflight. Throws WireError(kMalformed) saying which.
  BenchTransport bench() const;
};

struct Submitted {
  static constexpr MsgType kType = MsgType::kSubmitted;
  uint64_t job_id = 0;
  template <class V>
  void visit(V& v) { v.field("job_id", job_id, kRequired, kMaxCount); }
};

struct Status {
  static constexpr MsgType kType = MsgType::kStatus;
  std::optional<uint64_t> job_id;      // none: the newest job
  template <class V>
  void visit(V& v) { v.field("job_id", job_id, kOptional, kMaxCount); }
};

struct Cancel {
  static constexpr MsgType kType = MsgType::kCancel;
  uint64_t job_id = 0;
  template <class V>
  void visit(V& v) { v.field("job_id", job_id, kRequired, kMaxCount); }
};

struct Peers {
  static constexpr MsgType kType = MsgType::kPeers;
  uint64_t limit = limits::kMaxPeersPerReply;
  uint64_t offset = 0;
  template <class V>
  void visit(V& v) {
    v.field("limit", limit, kOptional, uint64_t(limits::kMaxPeersPerReply));
    v.field("offset", offset, kOptional, kMaxCount);
  }
};

// Client -> router: {peer, fault}; router -> stage server: {fault} (a map).
// FETCH (a peer or the router -> a holder) and its reply FETCHED (tensors [the tensor]).
struct Fetch {
  static constexpr MsgType kTypes[] = {MsgType::kFetch, MsgType::kFetched};
  uint64_t key = 0;        // the request whose reply made the tensor (TensorRef.key)
  int32_t part = 0;        // its index among that reply's tensors
  template <class V>
  void visit(V& v) {
    v.field("key", key, kRequired);
    v.field("part", part, kOptional, 0, int32_t(limits::kMaxFrames));
  }
};

// PUSH (router -> holder): send part `part` of request `key`'s reply to the peer listening at
// `to` (its public key `to_key` in CURVE swarms) now, as a FETCHED nobody asked for; the router
// names it in the hop it sends there (TensorRef.pushed). A notice: no reply.
struct Push {
  static constexpr MsgType kType = MsgType::kPush;
  uint64_t key = 0;
  int32_t part = 0;
  std::string to, to_key;
  template <class V>
  void visit(V& v) {
    v.field("key", key, kRequired);
    v.field("part", part, kOptional, 0, int32_t(limits::kMaxFrames));
    v.field("to", to, kRequired, wire::kMaxAddressBytes);
    v.field("to_key", to_key, kOptional, size_t(40));
  }
};

// RELEASE (router -> holder): drop the tensors of these requests' replies.
struct Release {
  static constexpr MsgType kType = MsgType::kRelease;
  static constexpr size_t kMaxKeys = 1024;
  std::vector<int64_t> keys;
  template <class V>
  void visit(V& v) { v.field("keys", keys, kRequired, kMaxKeys, int64_t(0), wire::kIntMax); }
};

// PART 0's header (docs/protocol.md#parts): the byte size of each frame of the message it starts.
struct PartHeader {
  static constexpr MsgType kType = MsgType::kPart;
  std::vector<int64_t> frames;
  template <class V>
  void visit(V& v) { v.field("frames", frames, kRequired, limits::kMaxFrames, int64_t(0), int64_t(limits::kMaxMessageBytes)); }
};

// PEER_KEYS (router -> stage server, CURVE swarms only): public keys of stage servers that may
// now fetch from this one (add) and that no longer may (remove).
struct PeerKeys {
  static constexpr MsgType kType = MsgType::kPeerKeys;
  static constexpr size_t kMaxKeys = 1024;
  std::vector<std::string> add, remove;
  template <class V>
  void visit(V& v) {
    v.field("add", add, kOptional, kMaxKeys, size_t(40));
    v.field("remove", remove, kOptional, kMaxKeys, size_t(40));
  }
};

struct Chaos {
  static constexpr MsgType kType = MsgType::kChaos;
  nlohmann::json fault;    // text "ACTION[,key=value...]" or a map (runtime/fault.h parses it)
  std::string peer;        // client -> router: the peer's name (str) or routing id (str or bin)
  bool peer_is_id = false; // it came as bin: a routing id, never a name
  template <class V>
  void visit(V& v) {
    v.field("fault", fault, kRequired);
    peer_is_id = v.text_or_bytes("peer", peer, kOptional, size_t(255), peer_is_id);
  }
};

struct ChaosReply {
  static constexpr MsgType kType = MsgType::kChaosReply;
  std::string fault, name, peer;
  template <class V>
  void visit(V& v) {
    v.field("fault", fault, kRequired, limits::kMaxTextBytes);
    v.field("name", name, kRequired, size_t(255));
    v.bytes("peer", peer, kRequired, size_t(255));   // its routing id, msgpack bin
  }
};

// ---- building and reading -----------------------------------------------------------------

template <class M>
std::string pack(const M& body) {
  wire::BodyWriter w;
  const_cast<M&>(body).visit(w);
  return w.take();
}

// A message of M's type (or of `type`, for bodies several types share) carrying `body`.
template <class M>
wire::Message make(const M& body, uint64_t id = 0, uint32_t attempt = 0) {
  return wire::Message(M::kType, id, attempt, pack(body));
}
template <class M>
wire::Message make(MsgType type, const M& body, uint64_t id = 0, uint32_t attempt = 0) {
  return wire::Message(type, id, attempt, pack(body));
}

// Reads m's body as an M; throws WireError(kMalformed) naming the field that is wrong.
template <class M>
M read(const wire::Message& m) {
  wire::BodyReader r(m.body, wire::msg_type_name(m.type));
  M out;
  out.visit(r);
  return out;
}

// An ERROR answering `req` (null: a message that could not be decoded; id and attempt 0).
wire::Message error_reply(const wire::Message* req, WireErrc code, const std::string& text);
// The same, answering a request known only by its envelope.
wire::Message error_reply(uint64_t id, uint32_t attempt, WireErrc code, const std::string& text);

}  // namespace swarm::msg
