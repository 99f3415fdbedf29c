// fuzz_wire_decode.cpp: libFuzzer target for wire::decode, the first code to touch what any
// process that reaches a swarm port sends, and for what a receiver does next with the result.
//
// Input: the frames of one message, laid out as tests/fuzz/fuzz_frames.h says. Checked on
// every input (a failure aborts, ASan and UBSan findings abort too):
//   - decode returns a Message or throws WireError; any other exception escapes (a crash);
//   - the tensors of a decoded message hold at most limits::kMaxMessageBytes, unpacked: the
//     message limit must bound the memory a message costs, not only its bytes on the wire;
//   - every f32 tensor of up to kMaxDecodedElements values decodes through its codec or throws
//     CodecError (what a stage does with an activation, a peer with an outer gradient);
//   - the body reads as its type's struct (runtime/messages.h) or throws WireError, and a body
//     "spec" (SUBMIT, LOAD_STAGE) parses as a job spec or throws InputError (what the router
//     and a stage do with it, without reading the data files);
//   - the message encodes again (what a router forwarding it does) into frames that decode to
//     the same message, and come back the same through PARTs (wire::split_parts, PartJoiner).
// A PART in the input goes through a PartJoiner first, as a receiver takes it.
// Run with -rss_limit_mb=2048 -malloc_limit_mb=1100 (docs/fuzzing.md).
#include <cstring>
#include <optional>
#include <vector>

#include "compression/codec.h"
#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "runtime/limits.h"
#include "runtime/messages.h"
#include "runtime/parts.h"
#include "runtime/wire.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_frames.h"

using namespace swarm;
using nlohmann::json;

namespace {

// Codec decodes of larger tensors are skipped: their float output (4 bytes a value) next to the
// payload would take the fuzzer past its memory limit for no new coverage.
constexpr int64_t kMaxDecodedElements = int64_t(1) << 24;

bool same_bytes(const zmq::message_t& a, const zmq::message_t& b) {
  return a.size() == b.size() && (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

void decode_payloads(const wire::Message& m) {
  for (const wire::Tensor& t : m.tensors) {
    if (t.desc.dtype != wire::DType::kF32) continue;
    const int64_t n = t.desc.numel();
    if (n > kMaxDecodedElements) continue;
    std::vector<float> out(static_cast<size_t>(n));
    try {
      compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), n, out.data());
    } catch (const CodecError&) {
    }
  }
}

template <class M>
void read_as(const wire::Message& m) {
  try {
    (void)msg::read<M>(m);
  } catch (const WireError& e) {
    FUZZ_CHECK(e.code() == WireErrc::kMalformed || e.code() == WireErrc::kTooLarge || e.code() == WireErrc::kTruncated,
               "a typed body failed with an unexpected code");
  }
}

void read_body(const wire::Message& m) {
  using wire::MsgType;
  switch (m.type) {
    case MsgType::kHello: return read_as<msg::Hello>(m);
    case MsgType::kWelcome: return read_as<msg::Welcome>(m);
    case MsgType::kHeartbeat: return read_as<msg::Heartbeat>(m);
    case MsgType::kBye: return read_as<msg::Bye>(m);
    case MsgType::kError: return read_as<msg::Error>(m);
    case MsgType::kStageReady: return read_as<msg::StageReady>(m);
    case MsgType::kForward: case MsgType::kForwardLoss: case MsgType::kBackward: case MsgType::kEval: return read_as<msg::Hop>(m);
    case MsgType::kResult: return read_as<msg::Result>(m);
    case MsgType::kStep: return read_as<msg::Step>(m);
    case MsgType::kRoundBegin: return read_as<msg::RoundBegin>(m);
    case MsgType::kRoundDelta: return read_as<msg::RoundDelta>(m);
    case MsgType::kRoundReduce: return read_as<msg::RoundReduce>(m);
    case MsgType::kRoundReduced: return read_as<msg::RoundReduced>(m);
    case MsgType::kRoundApply: return read_as<msg::RoundApply>(m);
    case MsgType::kRoundDone: return read_as<msg::RoundDone>(m);
    case MsgType::kStateRequest: return read_as<msg::StateRequest>(m);
    case MsgType::kStateReply: return read_as<msg::StateReply>(m);
    case MsgType::kStateLoad: return read_as<msg::StateLoad>(m);
    case MsgType::kStatus: return read_as<msg::Status>(m);
    case MsgType::kCancel: return read_as<msg::Cancel>(m);
    case MsgType::kPeers: return read_as<msg::Peers>(m);
    case MsgType::kChaos: return read_as<msg::Chaos>(m);
    case MsgType::kChaosReply: return read_as<msg::ChaosReply>(m);
    case MsgType::kSubmitted: return read_as<msg::Submitted>(m);
    case MsgType::kLoadStage: case MsgType::kSubmit: break;
    default: return;
  }
  // SUBMIT and LOAD_STAGE carry a job spec: parsed as the router and a stage do.
  try {
    const nlohmann::json spec = m.type == MsgType::kSubmit ? msg::read<msg::Submit>(m).spec.value_or(json()) : msg::read<msg::LoadStage>(m).spec;
    if (m.type == MsgType::kSubmit) {
      try {
        (void)msg::read<msg::Submit>(m).bench();
      } catch (const WireError&) {
      }
    }
    if (!spec.is_null()) (void)parse_job_spec(spec, /*check_files=*/false);
  } catch (const InputError&) {
  }
}

// Encodes m again and checks that the frames decode to the same message. Moves m's payloads.
void check_round_trip(wire::Message& m, bool verify) {
  const std::string body = m.body;
  std::vector<wire::Tensor> kept;
  for (wire::Tensor& t : m.tensors) kept.push_back(wire::share(t));
  const wire::MsgType type = m.type;
  const uint64_t id = m.id;
  const uint32_t attempt = m.attempt;
  std::vector<zmq::message_t> frames = wire::encode(m);
  // The encoder writes the tensor descriptions in its own (minimal) form: a body near its limit
  // whose descriptions were written differently may not fit again. Not a decode bug.
  if (frames[1].size() > wire::max_body_bytes(type)) return;
  // In PARTs (small ones, so that most messages take several) the same frames come back.
  {
    std::vector<zmq::message_t> copy;
    for (const zmq::message_t& f : frames) copy.emplace_back(f.data(), f.size());
    wire::PartJoiner parts;
    std::optional<std::vector<zmq::message_t>> whole;
    for (auto& part : wire::split_parts(std::move(copy), 512)) {
      FUZZ_CHECK(!whole, "a message was whole before its last part");
      whole = parts.take("fuzz", std::move(part), 0);   // must not throw
    }
    FUZZ_CHECK(whole && whole->size() == frames.size(), "the parts did not make the message whole");
    for (size_t i = 0; i < frames.size(); ++i) FUZZ_CHECK(same_bytes((*whole)[i], frames[i]), "a frame changed in parts");
  }
  wire::Message again = wire::decode(frames, verify);   // must not throw
  FUZZ_CHECK(again.type == type && again.id == id && again.attempt == attempt, "envelope changed");
  FUZZ_CHECK(again.body == body, "body changed");
  FUZZ_CHECK(again.tensors.size() == kept.size(), "tensor count changed");
  for (size_t i = 0; i < kept.size(); ++i) {
    const wire::TensorDesc& a = kept[i].desc;
    const wire::TensorDesc& b = again.tensors[i].desc;
    FUZZ_CHECK(a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes && a.checksum == b.checksum,
               "tensor description changed");
    FUZZ_CHECK(a.dtype != wire::DType::kF32 || a.codec == b.codec, "tensor codec changed");
    FUZZ_CHECK(same_bytes(kept[i].data, again.tensors[i].data), "tensor payload changed");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One more frame than the wire allows, so that decode sees (and rejects) too many.
  fuzz::FuzzFrames in = fuzz::split_frames(data, size, limits::kMaxFrames + 1);
  wire::Message m;
  try {
    // What a router or a stage server does first: a PART is kept until its message is whole (one
    // part can carry a whole message); anything else passes through untouched.
    wire::PartJoiner parts;
    std::optional<std::vector<zmq::message_t>> whole = parts.take("fuzz", std::move(in.frames), 0);
    if (!whole) return 0;
    m = wire::decode(*whole, in.verify_checksums);
  } catch (const WireError&) {
    return 0;
  }
  uint64_t held = 0;
  for (const wire::Tensor& t : m.tensors) held += t.data.size();
  FUZZ_CHECK(held <= limits::kMaxMessageBytes,
             ("a decoded message holds " + std::to_string(held) + " payload bytes, over limits::kMaxMessageBytes").c_str());
  decode_payloads(m);
  read_body(m);
  check_round_trip(m, in.verify_checksums);
  return 0;
}
