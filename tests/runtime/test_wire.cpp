// test_wire.cpp: wire protocol v1 round trips and the rejection of every kind of bad message.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <type_traits>

#include <msgpack.hpp>

#include "compression/codec.h"
#include "runtime/limits.h"
#include "runtime/messages.h"
#include "runtime/timing.h"
#include "runtime/parts.h"
#include "runtime/wire.h"

using namespace swarm;
using namespace swarm::wire;
using nlohmann::json;

namespace {

Tensor f32_tensor(std::vector<float> v, std::vector<int64_t> shape) {
  Tensor t = make_tensor(DType::kF32, std::move(shape), compression::CodecSpec{}, v.size() * 4);
  std::memcpy(t.data.data(), v.data(), v.size() * 4);
  seal(t);
  return t;
}

std::vector<zmq::message_t> frames_of(Message m) { return encode(m); }

zmq::message_t packed(const json& j) {
  auto b = json::to_msgpack(j);
  return zmq::message_t(b.data(), b.size());
}

WireErrc code_of(std::vector<zmq::message_t>& frames) {
  try {
    decode(frames);
  } catch (const WireError& e) {
    return e.code();
  }
  return WireErrc(0);
}

}  // namespace

TEST(Wire, RoundTripWithTensors) {
  Message m = wire::json_message(MsgType::kForward, 42, 3, json{{"job_id", 7}, {"mb", 9}});
  m.tensors.push_back(f32_tensor({1, 2, 3, 4, 5, 6}, {2, 3}));
  auto frames = frames_of(std::move(m));
  ASSERT_EQ(frames.size(), 3u);
  Message d = decode(frames);
  EXPECT_EQ(d.type, MsgType::kForward);
  EXPECT_EQ(d.id, 42u);
  EXPECT_EQ(d.attempt, 3u);
  EXPECT_EQ(body_json(d)["mb"], 9);
  EXPECT_FALSE(body_json(d).contains("tensors"));
  ASSERT_EQ(d.tensors.size(), 1u);
  EXPECT_EQ(d.tensors[0].desc.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(static_cast<const float*>(d.tensors[0].data.data())[5], 6.f);
}

// A shape of every rank the wire allows (0 to kMaxTensorRank) comes back as it went; a shape
// cannot grow past that rank; a description copies as plain bytes (the router copies one into
// every reference it sends).
TEST(Wire, ShapesOfEveryAllowedRankRoundTrip) {
  static_assert(std::is_trivially_copyable<TensorDesc>::value, "a TensorDesc copies without the heap");
  for (size_t rank = 0; rank <= limits::kMaxTensorRank; ++rank) {
    std::vector<int64_t> dims;
    for (size_t i = 0; i < rank; ++i) dims.push_back(int64_t(i % 3 + 1));
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    Message m(MsgType::kForward, 1, 0);
    m.tensors.push_back(f32_tensor(std::vector<float>(size_t(n), 1.f), dims));
    auto frames = frames_of(std::move(m));
    Message d = decode(frames);
    ASSERT_EQ(d.tensors.size(), 1u);
    EXPECT_EQ(d.tensors[0].desc.shape.size(), rank);
    EXPECT_EQ(d.tensors[0].desc.shape, Shape(dims)) << "rank " << rank;
    EXPECT_EQ(d.tensors[0].desc.shape.vec(), dims);
    EXPECT_EQ(d.tensors[0].desc.numel(), n);
  }
  Shape full(std::vector<int64_t>(limits::kMaxTensorRank, 1));
  EXPECT_THROW(full.push_back(1), InternalError);
  EXPECT_NE(Shape({2, 3}), Shape({2, 3, 1}));
  EXPECT_NE(Shape({2, 3}), Shape({3, 2}));
}

// The checksum of a payload of zeros, worked out without its bytes, is what sealing it gives.
TEST(Wire, ZerosChecksumIsTheChecksumOfZeros) {
  for (size_t n : {size_t(0), size_t(1), size_t(4096), size_t(1) << 16, (size_t(1) << 16) + 3, size_t(5) << 18}) {
    const std::vector<char> zeros(n, 0);
    EXPECT_EQ(wire::zeros_checksum(n), wire::checksum(zeros.data(), n)) << n << " bytes";
  }
  EXPECT_NE(wire::zeros_checksum(8), wire::zeros_checksum(16));
}

TEST(Wire, Bf16TensorSizeMustMatchCodec) {
  auto bf16 = compression::parse_codec("bf16");
  Tensor t = make_tensor(DType::kF32, {4}, bf16, 8);
  std::memset(t.data.data(), 0, 8);
  seal(t);
  Message m(MsgType::kResult);
  m.tensors.push_back(std::move(t));
  auto frames = frames_of(std::move(m));
  EXPECT_NO_THROW(decode(frames));

  // Declares 4 elements of bf16 (8 bytes) but carries 16.
  Tensor bad = make_tensor(DType::kF32, {4}, bf16, 16);
  std::memset(bad.data.data(), 0, 16);
  seal(bad);
  Message m2(MsgType::kResult);
  m2.tensors.push_back(std::move(bad));
  auto f2 = frames_of(std::move(m2));
  EXPECT_EQ(code_of(f2), WireErrc::kBadTensor);
}

// entropy=zstd: the frame on the wire is the zstd-packed payload; the receiver gets the codec's
// bytes back exactly, and a frame that does not unpack to the declared size is rejected.
TEST(Wire, ZstdPackedPayloadRoundTripsAndIsSmaller) {
  const auto codec = compression::parse_codec("int8:block=1024,entropy=zstd");
  const int64_t n = 1 << 14;
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& x : v) x = normal(rng);
  const size_t nbytes = compression::encoded_bytes(codec, n);
  Tensor t = make_tensor(DType::kF32, {n}, codec, nbytes);
  compression::encode(codec, v.data(), n, static_cast<uint8_t*>(t.data.data()));
  seal(t);
  std::vector<uint8_t> codes(static_cast<uint8_t*>(t.data.data()), static_cast<uint8_t*>(t.data.data()) + nbytes);
  Message m(MsgType::kRoundDelta, 5);
  m.tensors.push_back(share(t));
  auto frames = frames_of(std::move(m));
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_LT(frames[2].size(), nbytes * 95 / 100) << "int8 codes of Gaussian data should pack below 0.95";
  Message d = decode(frames);
  ASSERT_EQ(d.tensors.size(), 1u);
  EXPECT_EQ(d.tensors[0].desc.nbytes, nbytes);
  EXPECT_EQ(d.tensors[0].desc.zbytes, d.tensors[0].desc.wire_bytes());
  EXPECT_LT(d.tensors[0].desc.wire_bytes(), nbytes);
  ASSERT_EQ(d.tensors[0].data.size(), nbytes);
  EXPECT_EQ(std::memcmp(d.tensors[0].data.data(), codes.data(), nbytes), 0);

  // A received tensor forwarded on is packed again.
  auto again = frames_of([&] { Message f(MsgType::kForward, 6); f.tensors.push_back(share(d.tensors[0])); return f; }());
  EXPECT_NO_THROW(decode(again));

  // Damaged zstd frame: rejected as a bad tensor, never a crash.
  Message m2(MsgType::kRoundDelta, 7);
  m2.tensors.push_back(share(t));
  auto bad = frames_of(std::move(m2));
  std::vector<uint8_t> junk(bad[2].size(), 0x5a);
  bad[2] = zmq::message_t(junk.data(), junk.size());
  EXPECT_EQ(code_of(bad), WireErrc::kBadTensor);
}

TEST(Wire, SharedTensorIsZeroCopy) {
  Tensor t = f32_tensor(std::vector<float>(1 << 16, 1.f), {1 << 16});
  Tensor c = share(t);
  EXPECT_EQ(c.data.data(), t.data.data());
  EXPECT_EQ(c.desc.checksum, t.desc.checksum);
}

TEST(Wire, PooledTensorOutlivesItsMakerAndItsBufferIsReusedOnceEveryShareIsClosed) {
  const size_t n = 4097 * 2;   // a size no other test pools
  const void* first = nullptr;
  {
    Tensor t = make_pooled_tensor(DType::kU16, {4097}, compression::CodecSpec{}, n);
    ASSERT_EQ(t.data.size(), n);
    std::memset(t.data.data(), 7, n);
    seal(t);
    first = t.data.data();
    Tensor c = share(t);
    t = Tensor{};   // the maker lets go; the share still reads the bytes
    EXPECT_EQ(static_cast<const unsigned char*>(c.data.data())[n - 1], 7);
    EXPECT_EQ(checksum(c.data.data(), n), c.desc.checksum);
    // While a share is open the buffer is not handed out again.
    Tensor other = make_pooled_tensor(DType::kU16, {4097}, compression::CodecSpec{}, n);
    EXPECT_NE(other.data.data(), first);
  }
  // Both frames closed: their buffers wait in the pool (malloc cannot hand them out), and the
  // next frames of that size take them.
  void* elsewhere = std::malloc(n);
  EXPECT_NE(elsewhere, first);
  std::free(elsewhere);
  Tensor again = make_pooled_tensor(DType::kU16, {4097}, compression::CodecSpec{}, n);
  Tensor third = make_pooled_tensor(DType::kU16, {4097}, compression::CodecSpec{}, n);
  EXPECT_TRUE(again.data.data() == first || third.data.data() == first);
}

TEST(Wire, RejectsTooFewFrames) {
  std::vector<zmq::message_t> frames;
  frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 3, 0, 0})));
  EXPECT_EQ(code_of(frames), WireErrc::kTruncated);
}

TEST(Wire, RejectsBadMagicAndVersion) {
  std::vector<zmq::message_t> a;
  a.emplace_back(packed(json::array({"XXXX", 1, 3, 0, 0})));
  a.emplace_back(packed(json::object()));
  EXPECT_EQ(code_of(a), WireErrc::kBadMagic);
  for (int v : {1, 3}) {  // v1: routing ids were msgpack str
    std::vector<zmq::message_t> b;
    b.emplace_back(packed(json::array({"SWRM", v, 3, 0, 0})));
    b.emplace_back(packed(json::object()));
    EXPECT_EQ(code_of(b), WireErrc::kBadVersion);
    EXPECT_EQ(wire::peek_version(b), v);
  }
  // Bytes that are not msgpack at all are not an envelope either.
  std::vector<zmq::message_t> g;
  g.emplace_back("\xc1\xc1garbage", 9);
  g.emplace_back(packed(json::object()));
  EXPECT_EQ(code_of(g), WireErrc::kBadMagic);
  EXPECT_EQ(wire::peek_version(g), std::nullopt);
  std::vector<zmq::message_t> c;
  c.emplace_back(packed(json::array({"SWRM", wire::kVersion, 999, 0, 0})));
  c.emplace_back(packed(json::object()));
  EXPECT_EQ(code_of(c), WireErrc::kUnknownType);
}

TEST(Wire, RejectsTruncatedBody) {
  auto frames = frames_of(wire::json_message(MsgType::kStatus, 1, 0, json{{"job_id", 123456}, {"x", "some text"}}));
  zmq::message_t cut(frames[1].data(), frames[1].size() - 3);
  frames[1] = std::move(cut);
  EXPECT_EQ(code_of(frames), WireErrc::kTruncated);
}

TEST(Wire, RejectsTensorCountMismatch) {
  Message m(MsgType::kForward, 1, 0);
  m.tensors.push_back(f32_tensor({1, 2}, {2}));
  auto frames = frames_of(std::move(m));
  frames.pop_back();  // description says one tensor, no frame follows
  EXPECT_EQ(code_of(frames), WireErrc::kTruncated);
}

TEST(Wire, RejectsFrameShorterThanDeclared) {
  Message m(MsgType::kForward, 1, 0);
  m.tensors.push_back(f32_tensor({1, 2, 3, 4}, {4}));
  auto frames = frames_of(std::move(m));
  frames[2] = zmq::message_t(frames[2].data(), 8);
  EXPECT_EQ(code_of(frames), WireErrc::kTruncated);
}

TEST(Wire, RejectsCorruptPayload) {
  Message m(MsgType::kForward, 1, 0);
  m.tensors.push_back(f32_tensor({1, 2, 3, 4}, {4}));
  auto frames = frames_of(std::move(m));
  static_cast<uint8_t*>(frames[2].data())[5] ^= 0x40;
  EXPECT_EQ(code_of(frames), WireErrc::kChecksum);
}

TEST(Wire, RejectsHugeDeclaredShapeBeforeAllocating) {
  // A description that claims 2^40 elements must be refused on the numbers alone.
  json desc{{"dtype", "f32"}, {"shape", {uint64_t(1) << 20, uint64_t(1) << 20}}, {"codec", "fp32"}, {"nbytes", 16}, {"xxh64", 0}};
  std::vector<zmq::message_t> frames;
  frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 20, 1, 0})));
  frames.emplace_back(packed(json{{"tensors", {desc}}}));
  frames.emplace_back(zmq::message_t(16));
  EXPECT_EQ(code_of(frames), WireErrc::kTooLarge);
}

TEST(Wire, RejectsBadTensorDescriptions) {
  auto try_desc = [](json desc, size_t payload) {
    std::vector<zmq::message_t> frames;
    frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 20, 1, 0})));
    frames.emplace_back(packed(json{{"tensors", {desc}}}));
    frames.emplace_back(zmq::message_t(payload));
    return code_of(frames);
  };
  EXPECT_EQ(try_desc({{"dtype", "f64"}, {"shape", {2}}, {"codec", "fp32"}, {"nbytes", 16}, {"xxh64", 0}}, 16), WireErrc::kBadTensor);
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {-2}}, {"codec", "fp32"}, {"nbytes", 8}, {"xxh64", 0}}, 8), WireErrc::kBadTensor);
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {2}}, {"codec", "zstd"}, {"nbytes", 8}, {"xxh64", 0}}, 8), WireErrc::kBadTensor);
  EXPECT_EQ(try_desc({{"dtype", "i32"}, {"shape", {2}}, {"codec", "bf16"}, {"nbytes", 8}, {"xxh64", 0}}, 8), WireErrc::kBadTensor);
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {1, 1, 1, 1, 1, 1, 1, 1, 1}}, {"codec", "fp32"}, {"nbytes", 4}, {"xxh64", 0}}, 4), WireErrc::kTooLarge);
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {2}}, {"codec", "fp32"}, {"nbytes", 8}}, 8), WireErrc::kMalformed);
  EXPECT_EQ(try_desc(json::array({1, 2}), 8), WireErrc::kMalformed);
  // A subspace codec whose shape is not whole tokens of its dim, or that names no dim: refused
  // as a bad tensor before any payload is read.
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {2, 5}}, {"codec", "subspace:k=2,dim=4,ids=u8"}, {"nbytes", 18}, {"xxh64", 0}}, 18),
            WireErrc::kBadTensor);
  EXPECT_EQ(try_desc({{"dtype", "f32"}, {"shape", {2, 4}}, {"codec", "subspace:k=2"}, {"nbytes", 16}, {"xxh64", 0}}, 16),
            WireErrc::kBadTensor);
}

// fetch_within_ms belongs to the wire layer: removed from the body, a positive count of ms.
TEST(Wire, AFetchWindowIsAPositiveNumberOfMilliseconds) {
  auto with = [](json within) {
    std::vector<zmq::message_t> frames;
    frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, int(MsgType::kForward), 1, 0})));
    frames.emplace_back(packed(json{{"job_id", 1}, {"fetch_within_ms", within}}));
    return frames;
  };
  auto ok = with(1500);
  const Message m = decode(ok);
  EXPECT_EQ(m.fetch_within_ms, 1500u);
  EXPECT_FALSE(body_json(m).contains("fetch_within_ms"));
  for (const json& bad : {json(0), json(-5), json(1.5), json("1s"), json(timing::kMaxFetchWithinMs + 1)}) {
    auto frames = with(bad);
    EXPECT_EQ(code_of(frames), WireErrc::kMalformed) << bad.dump();
  }
}

TEST(Wire, RejectsDeepNesting) {
  // 100 nested one-element arrays: bounded by the depth limit, no stack exhaustion.
  std::string body(100, char(0x91));
  body.push_back(char(0xc0));
  std::vector<zmq::message_t> frames;
  frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 3, 0, 0})));
  frames.emplace_back(zmq::message_t(body.data(), body.size()));
  EXPECT_EQ(code_of(frames), WireErrc::kTooLarge);
}

TEST(Wire, RejectsOversizedDeclaredArray) {
  // An array header declaring 2^32-1 entries with nothing behind it.
  const unsigned char body[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
  std::vector<zmq::message_t> frames;
  frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 3, 0, 0})));
  frames.emplace_back(zmq::message_t(body, sizeof(body)));
  WireErrc c = code_of(frames);
  EXPECT_TRUE(c == WireErrc::kTooLarge || c == WireErrc::kTruncated);
}

TEST(Wire, RejectsOversizedBodyFrame) {
  std::vector<zmq::message_t> frames;
  frames.emplace_back(packed(json::array({"SWRM", wire::kVersion, 3, 0, 0})));
  frames.emplace_back(zmq::message_t(limits::kMaxBodyBytes + 1));
  EXPECT_EQ(code_of(frames), WireErrc::kTooLarge);
}

TEST(Wire, RandomBytesNeverCrash) {
  std::mt19937 rng(1234);
  int rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<zmq::message_t> frames;
    const int nf = 1 + int(rng() % 4);
    for (int f = 0; f < nf; ++f) {
      std::vector<uint8_t> b(rng() % 64);
      for (auto& x : b) x = uint8_t(rng());
      if (f == 0 && i % 2 == 0) {
        // Half the time a valid envelope, so the body and tensor parsers get fuzzed too.
        auto env = json::to_msgpack(json::array({"SWRM", wire::kVersion, 20, 1, 0}));
        b.assign(env.begin(), env.end());
      }
      frames.emplace_back(b.data(), b.size());
    }
    try {
      decode(frames);
    } catch (const WireError&) {
      rejected++;
    }
  }
  EXPECT_GT(rejected, 2900);
}

TEST(Wire, TruncatedValidMessagesAreRejected) {
  Message m = wire::json_message(MsgType::kBackward, 5, 1, json{{"job_id", 1}, {"mb", 2}});
  m.tensors.push_back(f32_tensor({1, 2, 3}, {3}));
  m.tensors.push_back(f32_tensor({4, 5, 6}, {3}));
  auto good = frames_of(std::move(m));
  for (size_t f = 0; f < good.size(); ++f) {
    for (size_t cut = 0; cut < good[f].size(); ++cut) {
      std::vector<zmq::message_t> frames;
      for (size_t k = 0; k < good.size(); ++k) {
        if (k == f) frames.emplace_back(good[k].data(), cut);
        else frames.emplace_back(good[k].data(), good[k].size());
      }
      EXPECT_THROW(decode(frames), WireError) << "frame " << f << " cut at " << cut;
    }
  }
}

// Thousands of zstd frames, each declaring 1 GiB unpacked: the declared total is over the
// message limit, so the message is refused before any frame is unpacked.
TEST(Wire, DeclaredSizesAreSummedBeforeAnythingIsUnpacked) {
  auto build = [](MsgType type, size_t n) {
    json descs = json::array();
    for (size_t i = 0; i < n; ++i)
      descs.push_back({{"codec", "fp32:entropy=zstd"}, {"dtype", "f32"}, {"nbytes", uint64_t(1) << 30},
                       {"shape", {uint64_t(1) << 28}}, {"xxh64", 0}, {"zbytes", 9}});
    std::vector<zmq::message_t> frames;
    Message env(type, 1);
    frames.push_back(std::move(encode(env)[0]));
    const std::vector<uint8_t> body = json::to_msgpack(json{{"tensors", descs}});
    frames.emplace_back(body.data(), body.size());
    for (size_t i = 0; i < n; ++i) frames.emplace_back("\x28\xb5\x2f\xfd\x00\x00\x00\x00\x00", 9);
    return frames;
  };
  auto many = build(MsgType::kRoundReduce, 3000);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    decode(many);
    FAIL() << "decoded";
  } catch (const WireError& e) {
    EXPECT_EQ(e.code(), WireErrc::kTooLarge);
    EXPECT_NE(std::string(e.what()).find("over the message limit"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  // A message type that takes one tensor is refused for carrying two, whatever they declare.
  auto two = build(MsgType::kResult, 2);
  EXPECT_EQ(code_of(two), WireErrc::kMalformed);
}

TEST(Wire, TypedBodiesCheckEveryField) {
  msg::Result r;
  r.loss = 2.5;
  r.mb = 7;
  Message m = msg::make(r, 3);
  EXPECT_EQ(*msg::read<msg::Result>(m).loss, 2.5);
  for (json bad : {json{{"loss", "x"}}, json{{"mb", -1}}, json{{"mb", 1.5}}, json{{"samples", 1e300}}, json{{"compute_ms", -1}}}) {
    Message b = wire::json_message(MsgType::kResult, 1, 0, bad);
    try {
      msg::read<msg::Result>(b);
      FAIL() << bad.dump();
    } catch (const WireError& e) {
      EXPECT_EQ(e.code(), WireErrc::kMalformed);
      EXPECT_EQ(std::string(e.what()).rfind("RESULT.", 0), 0u) << e.what();
    }
  }
  // Unknown keys are ignored; a missing required field is named.
  Message extra = wire::json_message(MsgType::kStep, 1, 0, json{{"job_id", 4}, {"future_field", true}});
  EXPECT_EQ(msg::read<msg::Step>(extra).job_id, 4u);
  Message missing = wire::json_message(MsgType::kStep, 1, 0, json::object());
  EXPECT_THROW(
      {
        try {
          msg::read<msg::Step>(missing);
        } catch (const WireError& e) {
          EXPECT_STREQ(e.what(), "STEP.job_id is missing");
          throw;
        }
      },
      WireError);
}

// A body is read field by field in whatever order its keys came in; its strings are read from
// the message's own bytes (they are not copied while unpacking), and stay right once read.
TEST(Wire, BodyKeysInAnyOrder) {
  msgpack::sbuffer b;
  msgpack::packer<msgpack::sbuffer> pk(b);
  pk.pack_map(3);
  pk.pack(std::string("reason"));
  pk.pack(std::string("going away for maintenance"));
  pk.pack(std::string("stage"));
  pk.pack(2);
  pk.pack(std::string("mb"));
  pk.pack(7);
  Message m = msg::make(msg::Result{}, 1);
  m.body.assign(b.data(), b.size());
  const msg::Result r = msg::read<msg::Result>(m);
  EXPECT_EQ(r.mb, 7u);
  EXPECT_EQ(r.stage, 2);
  m.type = MsgType::kBye;
  msg::Bye bye = msg::read<msg::Bye>(m);
  m.body.assign(m.body.size(), '\0');   // the message's bytes go; what was read stays
  EXPECT_EQ(bye.reason, "going away for maintenance");
}

// A key said twice means two things to two readers: refused, in writer order or any other.
TEST(Wire, ABodyThatSaysAKeyTwiceIsRefused) {
  for (const bool sorted : {true, false}) {
    msgpack::sbuffer b;
    msgpack::packer<msgpack::sbuffer> pk(b);
    pk.pack_map(3);
    for (const char* k : sorted ? std::vector<const char*>{"mb", "mb", "stage"} : std::vector<const char*>{"stage", "mb", "mb"}) {
      pk.pack(std::string(k));
      pk.pack(1);
    }
    Message m = msg::make(msg::Result{}, 1);
    m.body.assign(b.data(), b.size());
    try {
      msg::read<msg::Result>(m);
      FAIL() << "read a body with a key twice (sorted " << sorted << ")";
    } catch (const WireError& e) {
      EXPECT_EQ(e.code(), WireErrc::kMalformed);
      EXPECT_NE(std::string(e.what()).find("\"mb\" appears twice"), std::string::npos) << e.what();
    }
  }
}

// The body writer packs every value as msgpack-c does (the smallest encoding; a whole double as
// an integer), and the reader reads back what any msgpack encoder may write: each integer
// width, float 32, str 8/16/32, bin, array 16/32, map 16.
TEST(Wire, BodyBytesAreMsgpackCsAndReadBackAtEveryWidth) {
  std::mt19937_64 rng(7);
  std::vector<int64_t> ints{0, 1, 127, 128, 255, 256, 65535, 65536, (int64_t(1) << 32) - 1, int64_t(1) << 32,
                            -1, -32, -33, -128, -129, -32768, -32769, INT32_MIN, int64_t(INT32_MIN) - 1, INT64_MIN, INT64_MAX};
  for (int i = 0; i < 200; ++i) ints.push_back(int64_t(rng()) >> (rng() % 64));
  std::vector<double> doubles{0.0, 1.0, -1.0, 0.5, 1e300, -2.5e-300, 4294967296.0, -9.5, 3.0e18};
  for (int i = 0; i < 100; ++i) doubles.push_back(std::ldexp(double(int64_t(rng())), int(rng() % 80) - 100));
  std::vector<std::string> strings;
  for (size_t n : {0, 1, 31, 32, 255, 256, 65535, 65536}) strings.emplace_back(n, char('a' + n % 26));
  for (size_t n : {size_t(15), size_t(16), size_t(70000)}) {
    std::vector<int64_t> xs(n);
    for (auto& x : xs) x = int64_t(rng() % 100000) - 50000;
    wire::BodyWriter w;
    w.field("a_ints", xs);
    w.field("b_num", int64_t(n));
    w.field("c_ints", ints);
    w.field("d_doubles", doubles);
    w.field("e_strs", strings);
    w.bytes("f_bin", std::string(300, '\x01'));
    w.field("g_yes", true);
    static const char kMore[12][4] = {"h00", "h01", "h02", "h03", "h04", "h05", "h06", "h07", "h08", "h09", "h10", "h11"};
    for (int k = 0; k < 12; ++k) w.field(kMore[k], int64_t(k));   // 19 fields: a map 16
    const std::string mine = w.take();

    msgpack::sbuffer b;
    msgpack::packer<msgpack::sbuffer> pk(b);
    pk.pack_map(19);
    pk.pack(std::string("a_ints"));
    pk.pack(xs);
    pk.pack(std::string("b_num"));
    pk.pack(int64_t(n));
    pk.pack(std::string("c_ints"));
    pk.pack(ints);
    pk.pack(std::string("d_doubles"));
    pk.pack(doubles);
    pk.pack(std::string("e_strs"));
    pk.pack(strings);
    pk.pack(std::string("f_bin"));
    pk.pack_bin(300);
    pk.pack_bin_body(std::string(300, '\x01').data(), 300);
    pk.pack(std::string("g_yes"));
    pk.pack(true);
    for (int k = 0; k < 12; ++k) {
      pk.pack(std::string(kMore[k]));
      pk.pack(int64_t(k));
    }
    EXPECT_EQ(mine, std::string(b.data(), b.size())) << n;
  }

  // Every width of every kind, as another encoder might choose, reads back.
  msgpack::sbuffer b;
  msgpack::packer<msgpack::sbuffer> pk(b);
  pk.pack_map(16);
  auto key = [&](const char* k) { pk.pack(std::string(k)); };
  key("i08"); pk.pack_int8(-5);
  key("i16"); pk.pack_int16(300);
  key("i32"); pk.pack_int32(-70000);
  key("i64"); pk.pack_int64(5);
  key("u08"); pk.pack_uint8(200);
  key("u16"); pk.pack_uint16(7);
  key("u32"); pk.pack_uint32(70000);
  key("u64"); pk.pack_uint64(uint64_t(1) << 40);
  key("v_f32"); pk.pack_float(0.25f);
  key("v_f64"); pk.pack_double(2.5);
  key("w_str16"); pk.pack_str(300), pk.pack_str_body(std::string(300, 'y').data(), 300);
  key("w_str8"); pk.pack_str(40), pk.pack_str_body(std::string(40, 'x').data(), 40);
  key("x_nil"); pk.pack_nil();
  key("y_arr"); pk.pack_array(2), pk.pack_int16(1), pk.pack_float(2.0f);
  key("z_json"); pk.pack_map(1), pk.pack(std::string("k")), pk.pack_array(1), pk.pack_uint32(9);
  key("zz_false"); pk.pack(false);
  const std::string bytes(b.data(), b.size());
  wire::BodyReader r(bytes, "TEST");
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  std::string s;
  bool yes = true;
  std::vector<double> arr;
  json j;
  r.field("i08", i, wire::kRequired);
  EXPECT_EQ(i, -5);
  r.field("i16", i, wire::kRequired);
  EXPECT_EQ(i, 300);
  r.field("i32", i, wire::kRequired);
  EXPECT_EQ(i, -70000);
  r.field("i64", u, wire::kRequired);   // a signed encoding of a non-negative value
  EXPECT_EQ(u, 5u);
  r.field("u08", u, wire::kRequired);
  EXPECT_EQ(u, 200u);
  r.field("u16", i, wire::kRequired);
  EXPECT_EQ(i, 7);
  r.field("u32", u, wire::kRequired);
  EXPECT_EQ(u, 70000u);
  r.field("u64", u, wire::kRequired);
  EXPECT_EQ(u, uint64_t(1) << 40);
  r.field("v_f32", d, wire::kRequired, 0, 1);
  EXPECT_EQ(d, 0.25);
  r.field("v_f64", d, wire::kRequired, 0, 10);
  EXPECT_EQ(d, 2.5);
  r.field("w_str16", s, wire::kRequired, 300);
  EXPECT_EQ(s, std::string(300, 'y'));
  r.field("w_str8", s, wire::kRequired, 64);
  EXPECT_EQ(s, std::string(40, 'x'));
  EXPECT_FALSE(r.has("x_nil"));
  r.field("y_arr", arr, wire::kRequired, 4, 0, 10);
  EXPECT_EQ(arr, (std::vector<double>{1, 2}));
  r.field("z_json", j);
  EXPECT_EQ(j, json({{"k", {9}}}));
  r.field("zz_false", yes);
  EXPECT_FALSE(yes);
  EXPECT_EQ(wire::unpack_json(bytes, "TEST")["w_str8"], std::string(40, 'x'));
}

// Nesting is bounded wherever a body holds free-form JSON: 16 levels read, 17 are refused.
TEST(Wire, BodyNestingIsBoundedAtSixteen) {
  auto nested = [](int levels) {
    json v = 1;
    for (int k = 0; k < levels; ++k) v = json::array({v});
    const std::vector<uint8_t> b = json::to_msgpack(json{{"spec", v}});
    return std::string(b.begin(), b.end());
  };
  json j;
  const std::string fifteen = nested(15), sixteen = nested(16);   // a reader reads the bytes where they lie
  wire::BodyReader ok(fifteen, "TEST");   // the body's map and 15 levels of arrays: 16
  ok.field("spec", j);
  EXPECT_TRUE(j.is_array());
  try {
    wire::BodyReader deep(sixteen, "TEST");
    FAIL() << "read a body nested 17 deep";
  } catch (const WireError& e) {
    EXPECT_EQ(e.code(), WireErrc::kTooLarge) << e.what();
  }
}

TEST(Wire, ZbytesWithoutZstdIsRefused) {
  Tensor t = make_tensor(DType::kF32, {4}, compression::CodecSpec{}, 16);
  std::memset(t.data.data(), 0, 16);
  seal(t);
  Message m(MsgType::kResult);
  m.tensors.push_back(std::move(t));
  auto frames = frames_of(std::move(m));
  json body = json::from_msgpack(std::string(static_cast<const char*>(frames[1].data()), frames[1].size()));
  body["tensors"][0]["zbytes"] = 16;
  const std::vector<uint8_t> b = json::to_msgpack(body);
  frames[1] = zmq::message_t(b.data(), b.size());
  EXPECT_EQ(code_of(frames), WireErrc::kBadTensor);
}

TEST(Wire, ErrorReplyEchoesRequest) {
  Message req(MsgType::kForward, 77, 2);
  Message e = msg::error_reply(&req, WireErrc::kBadTensor, "shape");
  EXPECT_EQ(e.type, MsgType::kError);
  EXPECT_EQ(e.id, 77u);
  EXPECT_EQ(e.attempt, 2u);
  EXPECT_EQ(body_json(e)["name"], "bad_tensor");
}

// docs/protocol.md's worked example, byte for byte, as the router builds a FORWARD.
TEST(Wire, TheProtocolDocsWorkedExampleIsWhatTheEncoderWrites) {
  msg::Hop h;
  h.job_id = 1;
  h.mb = 7;
  h.stage = 1;
  Message m = msg::make(MsgType::kForward, h, 42, 0);
  const auto bf16 = compression::parse_codec("bf16");
  Tensor t = make_tensor(DType::kF32, {2, 4, 8}, bf16, 128);
  for (int i = 0; i < 64; ++i) {
    static_cast<uint8_t*>(t.data.data())[2 * i] = 0x80;
    static_cast<uint8_t*>(t.data.data())[2 * i + 1] = 0x3f;
  }
  seal(t);
  EXPECT_EQ(t.desc.checksum, 0x6496d4161c060cd6ull);
  m.tensors.push_back(std::move(t));
  auto frames = encode(m);
  ASSERT_EQ(frames.size(), 3u);
  auto hex = [](const zmq::message_t& f) {
    std::string s;
    char b[4];
    for (size_t i = 0; i < f.size(); ++i) {
      std::snprintf(b, sizeof b, "%02x", static_cast<const uint8_t*>(f.data())[i]);
      s += b;
    }
    return s;
  };
  auto str = [](const char* s) {
    std::string h;
    char b[4];
    for (const char* p = s; *p; ++p) {
      std::snprintf(b, sizeof b, "%02x", uint8_t(*p));
      h += b;
    }
    return h;
  };
  EXPECT_EQ(hex(frames[0]), "95a45357524d02142a00");
  const std::string body = "85" "a4" + str("eval") + "c2" "a6" + str("job_id") + "01" "a2" + str("mb") + "07" "a5" + str("stage") +
                           "01" "a7" + str("tensors") + "91" "85" "a5" + str("codec") + "a4" + str("bf16") + "a5" + str("dtype") +
                           "a3" + str("f32") + "a6" + str("nbytes") + "cc80" "a5" + str("shape") + "93020408" "a5" + str("xxh64") +
                           "cf6496d4161c060cd6";
  EXPECT_EQ(frames[1].size(), 91u);
  EXPECT_EQ(hex(frames[1]), body);
  EXPECT_EQ(frames[2].size(), 128u);
}

// A refusal reaches a peer of any version: ERROR bad_version goes out in a v1 envelope, which
// every version decodes; no other message may.
TEST(Wire, RefusalsTravelInTheOldestEnvelope) {
  Message e = msg::error_reply(7, 0, WireErrc::kBadVersion, "speak v2");
  e.version = wire::kVersionForRefusals;
  auto frames = wire::encode(e);
  EXPECT_EQ(wire::peek_version(frames), 1);
  Message back = wire::decode(frames);
  EXPECT_EQ(back.type, MsgType::kError);
  EXPECT_EQ(back.version, 1);
  Message hb(MsgType::kHeartbeat);
  hb.version = 1;
  EXPECT_THROW(wire::encode(hb), std::exception);
}

// Routing ids are msgpack bin (v2): any bytes round-trip, and a reader refuses a str id.
TEST(Wire, RoutingIdsAreBinary) {
  msg::Welcome w;
  w.peer_id = std::string("\x00\xff\x80p", 4);
  w.heartbeat_ms = 500;
  Message m = msg::make(w, 1);
  const json j = wire::body_json(m);
  ASSERT_TRUE(j["peer_id"].is_binary());
  EXPECT_EQ(msg::read<msg::Welcome>(m).peer_id, w.peer_id);
  Message old = wire::json_message(MsgType::kWelcome, 1, 0, json{{"peer_id", "p-0123"}});
  EXPECT_THROW(msg::read<msg::Welcome>(old), WireError);
  EXPECT_EQ(wire::printable_id("p-01ab"), "p-01ab");
  EXPECT_EQ(wire::printable_id(std::string("\x00\xff", 2)), "0x00ff");
  EXPECT_EQ(wire::id_from_hex("0x00ff"), std::string("\x00\xff", 2));
  EXPECT_EQ(wire::id_from_hex("p-01"), std::nullopt);
  // CHAOS names a peer by str (a name or a printable id) or by bin (an id only).
  Message byname = wire::json_message(MsgType::kChaos, 2, 0, json{{"peer", "stage1-0"}, {"fault", "crash"}});
  EXPECT_FALSE(msg::read<msg::Chaos>(byname).peer_is_id);
  Message byid = wire::json_message(MsgType::kChaos, 2, 0, json{{"peer", wire::id_json(std::string("\x00\x01", 2))}, {"fault", "crash"}});
  const msg::Chaos ch = msg::read<msg::Chaos>(byid);
  EXPECT_TRUE(ch.peer_is_id);
  EXPECT_EQ(ch.peer, std::string("\x00\x01", 2));
}

// ---- parts ------------------------------------------------------------------------------------

namespace {

// A message with tensors of these many floats each (its frames: envelope, body, tensors).
std::vector<zmq::message_t> message_with(const std::vector<size_t>& floats, MsgType type = MsgType::kStateReply) {
  Message m(type, 7, 1);
  for (size_t i = 0; i < floats.size(); ++i) {
    std::vector<float> v(floats[i]);
    for (size_t k = 0; k < v.size(); ++k) v[k] = float(i * 1000003 + k);
    m.tensors.push_back(f32_tensor(std::move(v), {int64_t(floats[i])}));
  }
  return encode(m);
}

std::vector<std::string> bytes_of(const std::vector<zmq::message_t>& frames) {
  std::vector<std::string> out;
  for (const auto& f : frames) out.emplace_back(static_cast<const char*>(f.data()), f.size());
  return out;
}

// Feeds every part through a joiner; the message they made whole (none: the test fails).
std::vector<zmq::message_t> join_all(PartJoiner& j, std::vector<std::vector<zmq::message_t>> parts, const std::string& from = "a") {
  std::optional<std::vector<zmq::message_t>> whole;
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_FALSE(whole) << "whole before its last part";
    whole = j.take(from, std::move(parts[i]), double(i));
  }
  EXPECT_TRUE(whole);
  return whole ? std::move(*whole) : std::vector<zmq::message_t>{};
}

}  // namespace

TEST(Parts, ALargeMessageGoesInPartsOfAtMostTheLimitAndComesBackTheSameBytes) {
  // 100,000 + 3 + 16,384 floats: one tensor over many parts, one small, one on a part's edge.
  const std::vector<size_t> floats{100000, 3, 16384};
  const std::vector<std::string> want = bytes_of(message_with(floats));
  auto parts = split_parts(message_with(floats));
  uint64_t total = 0;
  for (const auto& w : want) total += w.size();
  ASSERT_EQ(parts.size(), (total + limits::kMaxPartBytes - 1) / limits::kMaxPartBytes);
  for (size_t i = 0; i < parts.size(); ++i) {
    const Envelope env = peek_envelope(parts[i]);
    EXPECT_EQ(env.type, MsgType::kPart);
    EXPECT_EQ(env.id, i);
    size_t bytes = 0;
    for (size_t k = 2; k < parts[i].size(); ++k) bytes += parts[i][k].size();
    EXPECT_LE(bytes, limits::kMaxPartBytes);
    EXPECT_GT(bytes, 0u);
  }
  PartJoiner j;
  std::vector<zmq::message_t> whole = join_all(j, std::move(parts));
  EXPECT_EQ(bytes_of(whole), want);
  EXPECT_EQ(j.unfinished(), 0u);
  const Message m = decode(whole);
  EXPECT_EQ(m.type, MsgType::kStateReply);
  EXPECT_EQ(m.id, 7u);
  ASSERT_EQ(m.tensors.size(), 3u);
  EXPECT_EQ(m.tensors[2].data.size(), 16384u * 4);
}

TEST(Parts, ASmallMessageGoesWholeAndAJoinerPassesWholeMessagesThrough) {
  auto parts = split_parts(message_with({100}));
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(peek_envelope(parts[0]).type, MsgType::kStateReply);
  PartJoiner j;
  auto whole = j.take("a", std::move(parts[0]), 0);
  ASSERT_TRUE(whole);
  EXPECT_EQ(decode(*whole).tensors.size(), 1u);
  // Frames that are not even an envelope come back for decode to report.
  std::vector<zmq::message_t> junk;
  junk.emplace_back("junk", 4);
  auto back = j.take("a", std::move(junk), 0);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->size(), 1u);
}

TEST(Parts, PartsOfAnySizeUpToTheLimitAreTakenAndSendersAreKeptApart) {
  const std::vector<std::string> want_a = bytes_of(message_with({300})), want_b = bytes_of(message_with({500, 7}));
  auto a = split_parts(message_with({300}), 256);
  auto b = split_parts(message_with({500, 7}), 100);
  ASSERT_GT(a.size(), 4u);
  ASSERT_GT(b.size(), 20u);
  // Interleaved, as two senders' parts reach one ROUTER socket.
  PartJoiner j;
  std::optional<std::vector<zmq::message_t>> wa, wb;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i < a.size()) wa = j.take("a", std::move(a[i]), 0);
    if (i < b.size()) wb = j.take("b", std::move(b[i]), 0);
    if (i + 1 < a.size()) EXPECT_FALSE(wa);
    if (i + 1 < b.size()) EXPECT_FALSE(wb);
    EXPECT_LE(j.unfinished(), 2u);
  }
  ASSERT_TRUE(wa && wb);
  EXPECT_EQ(bytes_of(*wa), want_a);
  EXPECT_EQ(bytes_of(*wb), want_b);
}

TEST(Parts, APartOutOfSequenceIsRefusedAndDropsTheUnfinishedMessage) {
  auto parts = split_parts(message_with({3000}), 1000);
  ASSERT_GE(parts.size(), 5u);
  PartJoiner j;
  EXPECT_FALSE(j.take("a", std::move(parts[0]), 0));
  EXPECT_FALSE(j.take("a", std::move(parts[1]), 0));
  try {
    j.take("a", std::move(parts[3]), 0);
    FAIL() << "part 3 after part 1 was taken";
  } catch (const WireError& e) {
    EXPECT_EQ(e.code(), WireErrc::kOutOfOrder);
    EXPECT_NE(std::string(e.what()).find("part 2 was due"), std::string::npos) << e.what();
  }
  EXPECT_EQ(j.unfinished(), 0u);
  // What comes after it, with no part 0 before, is refused too.
  EXPECT_THROW(j.take("a", std::move(parts[4]), 0), WireError);
  // A part 0 starts over (a sender whose connection was made anew), whatever was unfinished.
  auto again = split_parts(message_with({3000}), 1000);
  EXPECT_FALSE(j.take("a", std::move(again[0]), 0));
  auto fresh = split_parts(message_with({3000}), 1000);
  EXPECT_EQ(bytes_of(join_all(j, std::move(fresh))), bytes_of(message_with({3000})));
}

TEST(Parts, PartsThatBreakTheLimitsOrWhatPartZeroDeclaredAreRefused) {
  auto part0 = [](const json& header, std::vector<std::string> pieces) {
    std::vector<zmq::message_t> f;
    f.push_back(packed(json::array({"SWRM", kVersion, int(MsgType::kPart), 0, 0})));
    f.push_back(packed(header));
    for (auto& p : pieces) f.emplace_back(p.data(), p.size());
    return f;
  };
  auto code = [](PartJoiner& j, std::vector<zmq::message_t> f) {
    try {
      j.take("a", std::move(f), 0);
    } catch (const WireError& e) {
      EXPECT_EQ(j.unfinished(), 0u);
      return e.code();
    }
    return WireErrc(0);
  };
  PartJoiner j;
  // More than the message limit declared: refused before anything is allocated.
  EXPECT_EQ(code(j, part0({{"frames", {20, uint64_t(limits::kMaxMessageBytes)}}}, {"x"})), WireErrc::kTooLarge);
  EXPECT_EQ(code(j, part0({{"frames", {20}}}, {"x"})), WireErrc::kMalformed);          // fewer than 2 frames
  EXPECT_EQ(code(j, part0({{"frames", {20, -1}}}, {"x"})), WireErrc::kMalformed);      // not a size
  EXPECT_EQ(code(j, part0({{"parts", 3}}, {"x"})), WireErrc::kMalformed);              // no frames
  EXPECT_EQ(code(j, part0({{"frames", {2, 3}}}, {"abc"})), WireErrc::kMalformed);      // a piece across two frames
  EXPECT_EQ(code(j, part0({{"frames", {2, 3}}}, {"ab", "cdef"})), WireErrc::kMalformed);   // past the last frame
  EXPECT_EQ(code(j, part0({{"frames", {2, 3}}}, {"ab", ""})), WireErrc::kMalformed);   // an empty piece
  EXPECT_EQ(code(j, part0({{"frames", {2, 3}}}, {})), WireErrc::kMalformed);           // no piece at all
  EXPECT_EQ(code(j, part0({{"frames", {40000, 40000}}}, {std::string(40000, 'a'), std::string(30000, 'b')})), WireErrc::kTooLarge);
  EXPECT_EQ(code(j, part0({{"frames", {2, 3}}, {"pad", std::string(limits::kMaxPartHeaderBytes, 'p')}}, {"ab"})), WireErrc::kTooLarge);
  // Sound parts still join after all that (the garbage frames here are not an envelope: decode says so).
  auto whole = j.take("a", part0({{"frames", {2, 3}}}, {"ab", "cde"}), 0);
  ASSERT_TRUE(whole);
  EXPECT_EQ(bytes_of(*whole), (std::vector<std::string>{"ab", "cde"}));
}

TEST(Parts, AnUnfinishedMessageIsForgottenOnceItsSenderFallsSilent) {
  auto parts = split_parts(message_with({3000}), 1000);
  PartJoiner j;
  EXPECT_FALSE(j.take("a", std::move(parts[0]), 10.0));
  EXPECT_FALSE(j.take("a", std::move(parts[1]), 11.0));
  j.expire(12.0, 2.0);
  EXPECT_EQ(j.unfinished(), 1u);
  j.expire(13.5, 2.0);
  EXPECT_EQ(j.unfinished(), 0u);
  EXPECT_THROW(j.take("a", std::move(parts[2]), 14.0), WireError);
}

// The pieces share the frames' buffers: nothing is copied on the way out, and the buffers live
// until the last part that holds a piece of them is gone.
TEST(Parts, PiecesShareTheFramesBuffersUntilTheLastPartIsGone) {
  std::vector<zmq::message_t> frames = message_with({50000});
  const char* tensor = static_cast<const char*>(frames[2].data());
  const std::string want(tensor, frames[2].size());
  auto parts = split_parts(std::move(frames), 4096);
  // Parts 1.. hold pieces of the tensor at consecutive addresses of its buffer.
  const char* at = static_cast<const char*>(parts[1][2].data());
  EXPECT_GE(at, tensor);
  EXPECT_LT(at, tensor + want.size());
  EXPECT_EQ(static_cast<const char*>(parts[2][2].data()), at + parts[1][2].size());
  parts.erase(parts.begin(), parts.end() - 1);
  // The last part alone keeps the buffer alive: its piece still reads the tensor's last bytes.
  const zmq::message_t& last = parts.back().back();
  EXPECT_EQ(std::string(static_cast<const char*>(last.data()), last.size()), want.substr(want.size() - last.size()));
}
