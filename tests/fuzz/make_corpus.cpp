// make_corpus.cpp: writes the fuzz targets' seed corpus, tests/fuzz/corpus/<target>/, from real
// encoded messages and real job specs, so that it can be regenerated when the wire changes:
//   build/tests/fuzz/fuzz_make_corpus [OUT_DIR]     (default: the source tree's corpus)
//
// fuzz_wire_decode/seed-*: one message of every type with the bodies the router, the stage
// server and the CLI send, every codec with and without entropy=zstd, integer and empty
// tensors, each laid out by fuzz::join_frames. fuzz_wire_decode/regress-*: inputs that once
// broke runtime/wire.cpp (docs/fuzzing.md). fuzz_job_spec/seed-*: the example job and variants that turn
// on each part of the spec, as JSON text. fuzz_router_core/seed-*: programs that run a job
// through peers that die, go silent and lie. Payloads are deterministic (no random draws), so
// regenerating gives the same files.
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "runtime/job_spec.h"
#include "runtime/limits.h"
#include "runtime/messages.h"
#include "runtime/parts.h"
#include "runtime/wire.h"
#include "tests/fuzz/fuzz_frames.h"

using namespace swarm;
using nlohmann::json;
using wire::DType;
using wire::Message;
using wire::MsgType;
namespace fs = std::filesystem;

namespace {

fs::path g_out;

void write_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

void wire_seed(const std::string& name, Message m, bool verify = true) {
  std::vector<zmq::message_t> frames = wire::encode(m);
  write_file(g_out / "fuzz_wire_decode" / name, fuzz::join_frames(frames, verify));
}

// n values of a smooth signal with a few outliers, like activations: deterministic.
std::vector<float> signal(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = scale * float(std::sin(0.37 * double(i)) + (i % 97 == 0 ? 4.0 : 0.0));
  return v;
}

wire::Tensor f32(const std::string& codec_text, std::vector<int64_t> shape, float scale = 1.0f) {
  const compression::CodecSpec codec = compression::parse_codec(codec_text);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const std::vector<float> v = signal(n, scale);
  wire::Tensor t = wire::make_tensor(DType::kF32, std::move(shape), codec, compression::encoded_bytes(codec, n));
  compression::encode(codec, v.data(), n, static_cast<uint8_t*>(t.data.data()));
  wire::seal(t);
  return t;
}

template <typename T>
wire::Tensor ints(DType dtype, std::vector<int64_t> shape, int mod) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  wire::Tensor t = wire::make_tensor(dtype, std::move(shape), compression::CodecSpec{}, size_t(n) * sizeof(T));
  T* p = static_cast<T*>(t.data.data());
  for (int64_t i = 0; i < n; ++i) p[i] = T((i * 31 + 7) % mod);
  wire::seal(t);
  return t;
}

template <typename... Ts>
Message with(Message m, Ts&&... ts) {
  (m.tensors.push_back(std::move(ts)), ...);
  return m;
}

json example_spec_json() {
  std::ifstream f(std::string(SWARM_SOURCE_DIR) + "/examples/tiny_gpt/job.json");
  return json::parse(f);
}

void wire_seeds() {
  const json spec = to_json(parse_job_spec(example_spec_json(), /*check_files=*/false));
  const json hb{{"stage", 1}, {"job_id", 1}, {"ready", true}, {"queue", 2}, {"ms_per_unit", 3.25},
                {"forwards", 120}, {"backwards", 118}, {"cache_hits", 90}, {"recomputes", 28}, {"steps", 14}, {"errors", 0}};
  // Session.
  wire_seed("seed-hello-stage", wire::json_message(MsgType::kHello, 0, 0,
      json{{"role", "stage"}, {"version", wire::kVersion}, {"name", "stage1-0"}, {"device", "cpu"},
           {"device_name", "x86_64 cpu"}, {"device_memory_bytes", uint64_t(8) << 30}, {"stage", -1},
           {"prefer_stage", 1}, {"emulate", 1.0}, {"profile", ""}, {"threads", 1}, {"pid", 4242}, {"echo", false}}));
  wire_seed("seed-hello-client", wire::json_message(MsgType::kHello, 1, 0, json{{"role", "client"}, {"version", wire::kVersion}}));
  wire_seed("seed-welcome", wire::json_message(MsgType::kWelcome, 0, 0, json{{"peer_id", wire::id_json("p-0123456789ab")}, {"heartbeat_ms", 500}, {"liveness", 3}}));
  wire_seed("seed-heartbeat", wire::json_message(MsgType::kHeartbeat, 0, 0, hb));
  wire_seed("seed-bye", wire::json_message(MsgType::kBye, 0, 0, json{{"reason", "shutting down"}}));
  Message req(MsgType::kForward, 77, 2);
  wire_seed("seed-error", msg::error_reply(&req, WireErrc::kChecksum, "tensor 0: checksum mismatch"));

  // Router -> stage and the replies, with the tensors each carries.
  wire_seed("seed-load-stage", wire::json_message(MsgType::kLoadStage, 5, 0, json{{"job_id", 1}, {"stage", 2}, {"spec", spec}}));
  wire_seed("seed-stage-ready", wire::json_message(MsgType::kStageReady, 5, 0,
      json{{"job_id", 1}, {"stage", 2}, {"params", 198272}, {"fwd_ms", 1.5}, {"device", "cpu"}}));
  const json hop{{"job_id", 1}, {"mb", 17}, {"stage", 1}, {"eval", false}};
  wire_seed("seed-forward-tokens-i32", with(wire::json_message(MsgType::kForward, 10, 0, hop), ints<int32_t>(DType::kI32, {2, 8}, 256)));
  wire_seed("seed-forward-tokens-u16", with(wire::json_message(MsgType::kForward, 11, 0, hop), ints<uint16_t>(DType::kU16, {2, 8}, 50257)));
  wire_seed("seed-forward-fp32", with(wire::json_message(MsgType::kForward, 12, 1, hop), f32("fp32", {2, 8, 16})));
  wire_seed("seed-forward-loss-bf16", with(wire::json_message(MsgType::kForwardLoss, 13, 0, hop),
                                           f32("bf16", {2, 8, 16}), ints<int32_t>(DType::kI32, {2, 8}, 256)));
  wire_seed("seed-backward-int8", with(wire::json_message(MsgType::kBackward, 14, 0, hop),
                                       f32("int8:block=64", {2, 8, 16}), f32("int8:block=64", {2, 8, 16}, 1e-3f)));
  wire_seed("seed-eval", with(wire::json_message(MsgType::kEval, 15, 0, json{{"job_id", 1}, {"mb", 3}, {"stage", 3}, {"eval", true}}),
                              f32("fp16", {2, 8, 16}), ints<int32_t>(DType::kI32, {2, 8}, 256)));
  wire_seed("seed-result-loss", with(wire::json_message(MsgType::kResult, 13, 0,
      json{{"mb", 17}, {"stage", 3}, {"loss", 2.875}, {"samples", 2}, {"compute_ms", 4.5}, {"cached", false}}),
      f32("int4:block=64,scale=fp16", {2, 8, 16}, 1e-2f)));
  wire_seed("seed-result-empty-tensor", with(wire::json_message(MsgType::kResult, 14, 0, json{{"mb", 17}, {"stage", 0}, {"samples", 2}}),
                                             f32("bf16", {0, 8, 16})));
  wire_seed("seed-step", wire::json_message(MsgType::kStep, 16, 0, json{{"job_id", 1}}));
  wire_seed("seed-result-step", wire::json_message(MsgType::kResult, 16, 0, json{{"mb", 0}, {"stage", 2}, {"steps", 9}}));

  // The round, and state transfer.
  const json round{{"job_id", 1}, {"round", 4}, {"stage", 2}, {"what", "delta"}, {"fragment", 1}, {"fragments", 4}};
  wire_seed("seed-round-begin", wire::json_message(MsgType::kRoundBegin, 20, 0, round));
  json rolling = round;
  rolling["step"] = 120;   // a round alongside training (async)
  wire_seed("seed-round-begin-step", wire::json_message(MsgType::kRoundBegin, 20, 0, rolling));
  wire_seed("seed-round-delta-topk", with(wire::json_message(MsgType::kRoundDelta, 20, 0,
      json{{"round", 4}, {"stage", 2}, {"samples", 320}, {"what", "delta"}}), f32("topk:block=1024,fraction=0.01", {3000}, 1e-3f)));
  wire_seed("seed-round-delta-int8-zstd", with(wire::json_message(MsgType::kRoundDelta, 21, 0,
      json{{"round", 4}, {"stage", 2}, {"samples", 320}, {"what", "delta"}}), f32("int8:block=1024,entropy=zstd", {3000}, 1e-3f)));
  json reduce = round;
  reduce["weights"] = {320, 288};
  wire_seed("seed-round-reduce-int8", with(wire::json_message(MsgType::kRoundReduce, 25, 0, reduce),
      f32("int8:block=1024", {3000}, 1e-3f), f32("int8:block=1024", {3000}, 2e-3f)));
  wire_seed("seed-round-reduced", with(wire::json_message(MsgType::kRoundReduced, 25, 0, json{{"round", 4}, {"stage", 2}}),
      f32("int8:block=1024", {3000}, 1e-3f)));
  wire_seed("seed-error-bad-tensor", wire::json_message(MsgType::kError, 14, 0,
      json{{"code", 8}, {"name", "bad_tensor"}, {"message", "non-finite values in the stage input"}, {"request_type", 22}, {"tensor", 0}}));
  json apply = round;
  apply["contributors"] = 2;
  apply["samples"] = 640;
  wire_seed("seed-round-apply-zstd", with(wire::json_message(MsgType::kRoundApply, 22, 0, apply),
                                          f32("int8:block=64,scale=fp16,entropy=zstd", {1000}, 1e-3f)));
  wire_seed("seed-round-done", wire::json_message(MsgType::kRoundDone, 22, 0, json{{"round", 4}, {"stage", 2}, {"hash", 0x9f3c2a7b11e04d55ull}}));
  wire_seed("seed-state-request", wire::json_message(MsgType::kStateRequest, 23, 0, json{{"job_id", 1}, {"full", true}}));
  wire_seed("seed-state-reply-zstd", with(wire::json_message(MsgType::kStateReply, 23, 0, json{{"stage", 2}, {"hash", 0x9f3c2a7b11e04d55ull}, {"full", true}}),
                                          f32("fp32:entropy=zstd", {512}), f32("fp32:entropy=zstd", {512}, 0.0f)));
  wire_seed("seed-state-load", with(wire::json_message(MsgType::kStateLoad, 24, 0, json{{"job_id", 1}, {"adam_step", 40}}),
                                    f32("fp32", {256}), f32("fp32", {256}, 1e-2f)));
  // PARTs (docs/protocol.md#parts): a STATE_LOAD whole in one part 0, and the first part of one
  // cut into parts of 256 bytes (its header declares the frames; the rest never comes).
  {
    Message load = with(wire::json_message(MsgType::kStateLoad, 24, 0, json{{"job_id", 1}, {"adam_step", 40}}),
                        f32("fp32", {64}), f32("fp32", {64}, 1e-2f));
    std::vector<zmq::message_t> frames = wire::encode(load);
    json sizes = json::array();
    for (const auto& f : frames) sizes.push_back(f.size());
    auto packed = [](const json& j) {
      const std::vector<uint8_t> b = json::to_msgpack(j);
      return zmq::message_t(b.data(), b.size());
    };
    std::vector<zmq::message_t> part;
    part.push_back(packed(json::array({wire::kMagic, wire::kVersion, int(MsgType::kPart), 0, 0})));
    part.push_back(packed(json{{"frames", sizes}}));
    for (auto& f : frames) part.push_back(std::move(f));
    write_file(g_out / "fuzz_wire_decode" / "seed-part-whole", fuzz::join_frames(part));
    Message again = with(wire::json_message(MsgType::kStateLoad, 24, 0, json{{"job_id", 1}, {"adam_step", 40}}),
                         f32("fp32", {64}), f32("fp32", {64}, 1e-2f));
    write_file(g_out / "fuzz_wire_decode" / "seed-part-first", fuzz::join_frames(wire::split_parts(wire::encode(again), 256).front()));
  }

  // Client -> router and the replies.
  wire_seed("seed-submit", wire::json_message(MsgType::kSubmit, 2, 0, json{{"spec", spec}}));
  wire_seed("seed-submit-bench", wire::json_message(MsgType::kSubmit, 2, 0, json{{"bench_transport", {{"bytes", 4096}, {"count", 2000}, {"inflight", 8}}}}));
  wire_seed("seed-submitted", wire::json_message(MsgType::kSubmitted, 2, 0, json{{"job_id", 1}}));
  wire_seed("seed-status", wire::json_message(MsgType::kStatus, 3, 0, json{{"job_id", 1}}));
  json history = json::array();
  for (int i = 0; i < 8; ++i) history.push_back(json{{"step", i * 10}, {"loss", 5.5 - 0.3 * i}});
  wire_seed("seed-status-reply", wire::json_message(MsgType::kStatusReply, 3, 0,
      json{{"job_id", 1}, {"state", "running"}, {"steps_done", 80}, {"history", history},
           {"microbatches", {{"taken", 320}, {"completed", 316}, {"resent", 3}, {"duplicates", 0}, {"lost", 0}}}}));
  wire_seed("seed-cancel", wire::json_message(MsgType::kCancel, 4, 0, json{{"job_id", 1}}));
  wire_seed("seed-peers", wire::json_message(MsgType::kPeers, 5, 0, json::object()));
  wire_seed("seed-peers-reply", wire::json_message(MsgType::kPeersReply, 5, 0,
      json{{"peers", json::array({json{{"id", wire::id_json("p-0123456789ab")}, {"name", "stage1-0"}, {"stage", 1}, {"device", "cpu"},
                                      {"ms_per_unit", 3.25}, {"results", 40}, {"failures", 0}, {"banned_s", 0.0}}})}}));
  // Peer to peer: a hop whose tensors are held elsewhere, to be fetched within 1.5 s, asked to
  // hold its own; a reply that holds; FETCH, FETCHED, RELEASE.
  {
    auto ref = [](uint32_t slot, const std::string& from, uint64_t key, const wire::Tensor& t) {
      wire::TensorRef r;
      r.slot = slot;
      r.from = from;
      r.key = key;
      r.desc = t.desc;
      return r;
    };
    Message bw = with(wire::json_message(MsgType::kBackward, 40, 0, hop), ints<int32_t>(DType::kI32, {2, 8}, 256));
    bw.refs.push_back(ref(1, "tcp://10.0.0.7:6000", 38, f32("int8:block=64", {2, 8, 16})));
    bw.hold = true;
    bw.fetch_within_ms = 1500;
    wire_seed("seed-backward-refs-hold", std::move(bw));
    Message fw = msg::make(MsgType::kForward, msg::Hop{}, 41);
    fw.refs.push_back(ref(0, "tcp://[::1]:6001", 40, f32("fp32:entropy=zstd", {2, 8, 16})));
    wire_seed("seed-forward-ref-zstd", std::move(fw));
    Message held = wire::json_message(MsgType::kResult, 41, 0, json{{"mb", 3}, {"stage", 1}, {"fetched", {2048, 0}}});
    held.refs.push_back(ref(0, "", 41, f32("fp32", {2, 8, 16})));
    wire_seed("seed-result-held", std::move(held));
    wire_seed("seed-fetch", wire::json_message(MsgType::kFetch, 7, 0, json{{"key", 41}, {"part", 0}}));
    wire_seed("seed-fetched", with(wire::json_message(MsgType::kFetched, 7, 0, json{{"key", 41}, {"part", 0}}), f32("bf16", {2, 8, 16})));
    wire_seed("seed-release", wire::json_message(MsgType::kRelease, 0, 0, json{{"keys", {38, 40, 41}}}));
    wire_seed("seed-push", wire::json_message(MsgType::kPush, 0, 0, json{{"key", 41}, {"part", 0}, {"to", "tcp://10.0.0.8:6000"}}));
    Message pushed = msg::make(MsgType::kForward, msg::Hop{}, 42);
    pushed.refs.push_back(ref(0, "tcp://10.0.0.7:6000", 41, f32("int8:block=64", {2, 8, 16})));
    pushed.refs.back().pushed = true;
    wire_seed("seed-forward-ref-pushed", std::move(pushed));
    wire_seed("seed-result-push-late", wire::json_message(MsgType::kResult, 42, 0, json{{"mb", 3}, {"stage", 1}, {"push_late", 1}}));
  }
  wire_seed("seed-chaos", wire::json_message(MsgType::kChaos, 6, 0, json{{"peer", "stage2-1"}, {"fault", "slow,factor=4"}}));
  wire_seed("seed-chaos-reply", wire::json_message(MsgType::kChaosReply, 6, 0, json{{"peer", "p-0123456789ab"}, {"name", "stage2-1"}, {"fault", "slow,factor=4"}}));

  // Every codec, plain and zstd-packed; the zstd ones also without checksum verification, so
  // the fuzzer reaches the codec decoders with bytes it mutated.
  for (const char* c : {"fp32", "fp16", "bf16", "int8:block=64", "int8:block=256,scale=fp16", "int4:block=64",
                        "int4:block=128,scale=fp16", "topk:block=1024,fraction=0.05"}) {
    for (bool zstd : {false, true}) {
      std::string text = c;
      if (zstd) text += text.find(':') == std::string::npos ? ":entropy=zstd" : ",entropy=zstd";
      std::string name = "seed-codec-" + text;
      for (char& ch : name) if (ch == ':' || ch == ',' || ch == '=') ch = '_';
      // 700 values: not a multiple of any block, so every codec has a short last block.
      wire_seed(name, with(wire::json_message(MsgType::kResult, 30, 0, json{{"mb", 1}, {"stage", 1}, {"samples", 2}}), f32(text, {7, 100})));
      wire_seed(name + "-unverified", with(wire::json_message(MsgType::kResult, 30, 0, json{{"mb", 1}, {"stage", 1}}), f32(text, {700})),
                /*verify=*/false);
    }
  }
}

// A regression of issue 12's bug 2: three zstd-packed tensors of 1 GiB of zeros, 32 KiB each on
// the wire, declare 3 GiB unpacked together, over limits::kMaxMessageBytes: decode must refuse
// the message before it unpacks any of them.
void crash_unpacked_total() {
  const auto codec = compression::parse_codec("fp32:entropy=zstd");
  const int64_t n = int64_t(limits::kMaxTensorBytes / 4);
  wire::Tensor t = wire::make_tensor(DType::kF32, {n}, codec, limits::kMaxTensorBytes);
  std::memset(t.data.data(), 0, t.data.size());
  wire::seal(t);
  wire::compress(t);
  Message m = wire::json_message(MsgType::kRoundReduce, 21, 0, json{{"job_id", 1}, {"round", 4}, {"stage", 2}, {"what", "delta"}, {"weights", {1, 1, 1}}});
  for (int i = 0; i < 3; ++i) m.tensors.push_back(wire::share(t));
  wire_seed("regress-unpacked-total", std::move(m));
}

// Found by fuzz_wire_decode in seconds, a regression seed since: an envelope whose version or
// type is a string that is not UTF-8 (decode once quoted it with json::dump(), which threw
// nlohmann's type_error instead of WireError and ended the router's loop).
void crash_envelope_not_utf8(const std::string& name, const json& envelope) {
  std::vector<zmq::message_t> frames;
  const std::vector<uint8_t> env = json::to_msgpack(envelope);
  const std::vector<uint8_t> body = json::to_msgpack(json::object());
  frames.emplace_back(env.data(), env.size());
  frames.emplace_back(body.data(), body.size());
  write_file(g_out / "fuzz_wire_decode" / name, fuzz::join_frames(frames));
}

// fuzz_router_core programs (tests/fuzz/fuzz_router_core.cpp): each step is an opcode, the
// index of the peer it is about, then its operands.
void router_seed(const std::string& name, const std::vector<uint8_t>& program) {
  write_file(g_out / "fuzz_router_core" / name, std::string(program.begin(), program.end()));
}

void router_seeds() {
  enum : uint8_t { kRun = 0, kJoin = 1, kSubmit = 2, kKill = 3, kSilence = 4, kWrongShape = 5, kBadInputs = 6,
                   kFrames = 7, kBody = 8, kResult = 9, kClient = 10 };
  // Two stages, two peers each (join operand: stage + 1), a 2-stage job of 2 steps (spec byte 4).
  const std::vector<uint8_t> swarm = {kJoin, 0, 1, kJoin, 0, 1, kJoin, 0, 2, kJoin, 0, 2, kSubmit, 0, 4};
  auto run = [](int n) {
    std::vector<uint8_t> v;
    for (int i = 0; i < n; ++i) v.insert(v.end(), {kRun, 0, 255});
    return v;
  };
  auto cat = [](std::vector<uint8_t> a, const std::vector<uint8_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  router_seed("seed-job-to-the-end", cat(swarm, run(12)));
  router_seed("seed-peer-killed", cat(cat(cat(swarm, run(2)), {kKill, 1, kKill, 3}), run(12)));
  router_seed("seed-peer-silenced", cat(cat(cat(swarm, run(1)), {kSilence, 0}), run(30)));
  router_seed("seed-liars", cat(cat(swarm, {kWrongShape, 1, 15, kBadInputs, 2, 3}), run(20)));
  // async, two fragments, a checkpoint every step (spec byte 0x80 | 0x40 | 0x30 | 5).
  router_seed("seed-async-streaming-checkpoints",
              cat({kJoin, 0, 1, kJoin, 0, 2, kJoin, 0, 0, kSubmit, 0, 0xF5}, run(20)));
  router_seed("seed-garbage", cat(cat(swarm, {kRun, 0, 100, kBody, 0, 5, 1, 3, 0x81, 0xa1, 0x78, kBody, 1, 1, 1, 2, 0x81, 0xc0,
                                              kResult, 2, 0, 200, 8, 1, 7, kFrames, 0, 4, 'S', 'W', 'R', 'M', 1,
                                              kClient, 0, 1, kClient, 0, 2}), run(10)));
  // Peer to peer: peers that take fetches (join operand's high bit; 0x83: stage 0, 0x84: stage 1).
  const std::vector<uint8_t> p2p = {kJoin, 0, 0x83, kJoin, 0, 0x83, kJoin, 0, 0x84, kJoin, 0, 0x84, kSubmit, 0, 4};
  router_seed("seed-p2p-job-to-the-end", cat(p2p, run(12)));
  router_seed("seed-p2p-holder-killed", cat(cat(cat(p2p, run(1)), {kKill, 2}), run(14)));
  // Peer 0 unreachable for the others (silence operand's high bit): its tensors are relayed.
  router_seed("seed-p2p-unreachable", cat(cat(p2p, {kSilence, 0x80}), run(20)));
  // A result answered with a reference to another request, from elsewhere (how = 1 | 2 | 16).
  router_seed("seed-p2p-lying-reference", cat(cat(cat(p2p, run(1)), {kResult, 0, 10, 2, 2, 0x13, 15}), run(12)));
}

void spec_seed(const std::string& name, const json& j) {
  write_file(g_out / "fuzz_job_spec" / name, j.dump(2) + "\n");
}

void spec_seeds() {
  const json ex = example_spec_json();
  spec_seed("seed-example.json", ex);
  spec_seed("seed-canonical.json", to_json(parse_job_spec(ex, /*check_files=*/false)));
  spec_seed("seed-minimal.json", json{{"data", {{"path", "/usr/share/games/fortunes/fortunes"}}}});
  json v = ex;
  v["compression"] = {{"activations", "int8:block=64,entropy=zstd"}, {"gradients", "int4:block=128,scale=fp16"},
                      {"outer", "topk:block=1024,fraction=0.01"}};
  spec_seed("seed-codecs.json", v);
  v = ex;
  v["diloco"] = {{"inner_steps", 50}, {"outer_lr", 0.7}, {"outer_momentum", 0.9}, {"nesterov", true}, {"deadline_s", 30},
                 {"sync", "rounds"}, {"warm_start_steps", 20}, {"streaming", {{"fragments", 4}, {"overlap_steps", 2}}}};
  spec_seed("seed-streaming.json", v);
  v = ex;
  v["diloco"] = {{"sync", "every_step"}};
  v["optimizer"] = {{"name", "sgd"}, {"lr", 0.1}, {"min_lr", 0.0}, {"warmup_steps", 0}, {"grad_clip", 0}};
  spec_seed("seed-every-step-sgd.json", v);
  v = ex;
  v["schedule"] = "async";
  v["max_inflight"] = 8;
  v["batch"] = {{"batch_size", 64}, {"microbatch_size", 8}, {"inner_batch", 16}};
  v["routing"] = {{"mode", "static"}, {"rebalance", false}, {"rebalance_period_s", 60}, {"min_gain", 0.2}, {"cooldown_s", 120}};
  v["timeouts"] = {{"forward_s", 10}, {"backward_s", 20.5}, {"max_attempts", 3}};
  v["checkpoint"] = {{"dir", "/tmp/ckpt"}, {"every_steps", 100}, {"keep", 2}, {"snapshot_every_steps", 10}};
  spec_seed("seed-async-routing-checkpoint.json", v);
  v = ex;
  v["data"] = {{"format", "bin"}, {"path", "train.bin"}, {"val_fraction", 0.05}};
  v["model"] = {{"vocab_size", 50257}, {"d_model", 96}, {"n_head", 6}, {"n_layer", 7}, {"seq_len", 32}, {"max_seq_len", 128}, {"bias", false}};
  v["partition"] = {{"stages", 3}, {"layers_per_stage", {3, 2, 2}}};
  spec_seed("seed-bin-uneven.json", v);
  // Rejected specs: the error paths (unknown key with a suggestion, a wrong type, a wrong rule).
  v = ex;
  v["stpes"] = 10;
  spec_seed("seed-typo.json", v);
  v = ex;
  v["model"]["n_head"] = 5;
  spec_seed("seed-bad-heads.json", v);
  v = ex;
  v["batch"]["microbatch_size"] = "8";
  spec_seed("seed-bad-type.json", v);
}

}  // namespace

int main(int argc, char** argv) {
  g_out = argc > 1 ? fs::path(argv[1]) : fs::path(SWARM_SOURCE_DIR) / "tests/fuzz/corpus";
  try {
    wire_seeds();
    crash_unpacked_total();
    crash_envelope_not_utf8("regress-envelope-not-utf8", json::array({wire::kMagic, std::string("\xae"), 2, 0, 0}));
    crash_envelope_not_utf8("regress-envelope-type-not-utf8", json::array({wire::kMagic, wire::kVersion, std::string("\xae"), 0, 0}));
    spec_seeds();
    router_seeds();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_make_corpus: %s\n", e.what());
    return 1;
  }
  std::printf("fuzz_make_corpus: wrote the seeds under %s\n", g_out.c_str());
  return 0;
}
