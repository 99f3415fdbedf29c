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
//   - a body "spec" (SUBMIT, LOAD_STAGE) parses as a job spec with its codecs, or throws
//     InputError (what the router and a stage do with it, without reading the data files);
//   - the message encodes again (what a router forwarding it does) into frames that decode to
//     the same message.
// Run with -rss_limit_mb=2048 -malloc_limit_mb=1100 (docs/fuzzing.md).
#include <cstring>
#include <vector>

#include "compression/codec.h"
#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "runtime/limits.h"
#include "runtime/wire.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_frames.h"

using namespace swarm;
using nlohmann::json;

namespace {

// Codec decodes of larger tensors are skipped: their float output (4 bytes a value) next to the
// payload would take the fuzzer past its memory limit for no new coverage.
constexpr int64_t kMaxDecodedElements = int64_t(1) << 24;

std::vector<uint8_t> msgpack_of(const json& j) { return json::to_msgpack(j); }

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

void parse_spec(const wire::Message& m) {
  auto it = m.body.find("spec");
  if (it == m.body.end()) return;
  try {
    JobSpec s = parse_job_spec(*it, /*check_files=*/false);
    compression::parse_codec(s.compression.activations);
    compression::parse_codec(s.compression.gradients);
    compression::parse_codec(s.compression.outer);
  } catch (const InputError&) {
  }
}

// Encodes m again and checks that the frames decode to the same message. Moves m's payloads.
void check_round_trip(wire::Message& m, bool verify) {
  const std::vector<uint8_t> body = msgpack_of(m.body);
  std::vector<wire::Tensor> kept;
  for (wire::Tensor& t : m.tensors) kept.push_back(wire::share(t));
  const wire::MsgType type = m.type;
  const uint64_t id = m.id;
  const uint32_t attempt = m.attempt;
  std::vector<zmq::message_t> frames = wire::encode(m);
  // nlohmann writes some values wider than msgpack-c accepted them (a float32 NaN as float64):
  // a body near the limit may not fit again. That is the encoder's choice, not a decode bug.
  if (frames[1].size() > limits::kMaxBodyBytes) return;
  wire::Message again = wire::decode(frames, verify);   // must not throw
  FUZZ_CHECK(again.type == type && again.id == id && again.attempt == attempt, "envelope changed");
  FUZZ_CHECK(msgpack_of(again.body) == body, "body changed");
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
    m = wire::decode(in.frames, in.verify_checksums);
  } catch (const WireError&) {
    return 0;
  }
  uint64_t held = 0;
  for (const wire::Tensor& t : m.tensors) held += t.data.size();
  FUZZ_CHECK(held <= limits::kMaxMessageBytes,
             ("a decoded message holds " + std::to_string(held) + " payload bytes, over limits::kMaxMessageBytes").c_str());
  decode_payloads(m);
  parse_spec(m);
  check_round_trip(m, in.verify_checksums);
  return 0;
}
