// wire.cpp: encoding, decoding and validation of wire protocol v1 messages (see wire.h).
//
// Bodies are parsed with msgpack-c under explicit unpack limits (sizes, depth) so that no
// declared length is allocated before it is checked, then converted to nlohmann::json for
// field access. Every failure is a WireError with a code and a sentence.
#include "runtime/wire.h"

#include <cstring>

#include <msgpack.hpp>
#include <xxhash.h>
#include <zstd.h>

#include "runtime/limits.h"

namespace swarm::wire {

using nlohmann::json;

namespace {

constexpr int kMaxDepth = 16;

[[noreturn]] void fail(WireErrc code, const std::string& what) { throw WireError(code, what); }

json to_json(const msgpack::object& o, int depth) {
  if (depth > kMaxDepth) fail(WireErrc::kMalformed, "msgpack nesting deeper than " + std::to_string(kMaxDepth));
  switch (o.type) {
    case msgpack::type::NIL: return nullptr;
    case msgpack::type::BOOLEAN: return o.via.boolean;
    case msgpack::type::POSITIVE_INTEGER: return o.via.u64;
    case msgpack::type::NEGATIVE_INTEGER: return o.via.i64;
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return o.via.f64;
    case msgpack::type::STR: return std::string(o.via.str.ptr, o.via.str.size);
    case msgpack::type::BIN: return json::binary(std::vector<uint8_t>(o.via.bin.ptr, o.via.bin.ptr + o.via.bin.size));
    case msgpack::type::ARRAY: {
      json a = json::array();
      for (uint32_t i = 0; i < o.via.array.size; ++i) a.push_back(to_json(o.via.array.ptr[i], depth + 1));
      return a;
    }
    case msgpack::type::MAP: {
      json m = json::object();
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const auto& kv = o.via.map.ptr[i];
        if (kv.key.type != msgpack::type::STR) fail(WireErrc::kMalformed, "map key is not a string");
        m[std::string(kv.key.via.str.ptr, kv.key.via.str.size)] = to_json(kv.val, depth + 1);
      }
      return m;
    }
    default: fail(WireErrc::kMalformed, "unsupported msgpack type (ext)");
  }
}

json unpack_frame(const zmq::message_t& f, const char* what) {
  const auto lim = msgpack::unpack_limit(limits::kMaxArrayEntries, limits::kMaxMapEntries,
                                         limits::kMaxStringBytes, limits::kMaxBinBytes, 0, kMaxDepth);
  try {
    size_t off = 0;
    msgpack::object_handle oh =
        msgpack::unpack(static_cast<const char*>(f.data()), f.size(), off, nullptr, nullptr, lim);
    if (off != f.size()) fail(WireErrc::kMalformed, std::string(what) + " has trailing bytes");
    return to_json(oh.get(), 0);
  } catch (const msgpack::insufficient_bytes&) {
    fail(WireErrc::kTruncated, std::string(what) + " is truncated");
  } catch (const msgpack::depth_size_overflow&) {
    fail(WireErrc::kTooLarge, std::string(what) + " is nested too deeply");
  } catch (const msgpack::size_overflow& e) {
    fail(WireErrc::kTooLarge, std::string(what) + ": " + e.what());
  } catch (const WireError&) {
    throw;
  } catch (const std::exception& e) {
    fail(WireErrc::kMalformed, std::string(what) + " is not valid msgpack: " + e.what());
  }
}

zmq::message_t pack(const json& j) {
  std::vector<uint8_t> bytes = json::to_msgpack(j);
  return zmq::message_t(bytes.data(), bytes.size());
}

bool parse_dtype(const std::string& s, DType* d) {
  if (s == "f32") *d = DType::kF32;
  else if (s == "i32") *d = DType::kI32;
  else if (s == "u16") *d = DType::kU16;
  else return false;
  return true;
}

uint64_t get_u64(const json& j, const char* key, const char* ctx) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned())
    fail(WireErrc::kMalformed, std::string(ctx) + ": field '" + key + "' missing or not an unsigned integer");
  return it->get<uint64_t>();
}

TensorDesc parse_desc(const json& d, size_t index) {
  const std::string ctx = "tensor " + std::to_string(index);
  if (!d.is_object()) fail(WireErrc::kMalformed, ctx + ": description is not a map");
  TensorDesc t;
  auto dt = d.find("dtype");
  if (dt == d.end() || !dt->is_string() || !parse_dtype(dt->get<std::string>(), &t.dtype))
    fail(WireErrc::kBadTensor, ctx + ": dtype must be one of f32, i32, u16");
  auto sh = d.find("shape");
  if (sh == d.end() || !sh->is_array()) fail(WireErrc::kMalformed, ctx + ": shape missing");
  if (sh->size() > limits::kMaxTensorRank) fail(WireErrc::kTooLarge, ctx + ": rank over the limit");
  int64_t numel = 1;
  for (const auto& v : *sh) {
    if (!v.is_number_unsigned()) fail(WireErrc::kBadTensor, ctx + ": shape entries must be non-negative integers");
    uint64_t n = v.get<uint64_t>();
    if (n > uint64_t(limits::kMaxTensorElements)) fail(WireErrc::kTooLarge, ctx + ": dimension over the limit");
    numel *= int64_t(n);
    if (numel > limits::kMaxTensorElements) fail(WireErrc::kTooLarge, ctx + ": more elements than the limit");
    t.shape.push_back(int64_t(n));
  }
  auto cd = d.find("codec");
  if (cd == d.end() || !cd->is_string()) fail(WireErrc::kMalformed, ctx + ": codec missing");
  const std::string codec = cd->get<std::string>();
  size_t expected = 0;
  if (t.dtype == DType::kF32) {
    try {
      t.codec = compression::parse_codec(codec);
      expected = compression::encoded_bytes(t.codec, numel);  // a subspace codec checks the shape's tokens
    } catch (const InputError& e) {
      fail(WireErrc::kBadTensor, ctx + ": " + e.what());
    }
  } else {
    if (codec != "raw") fail(WireErrc::kBadTensor, ctx + ": integer tensors travel with codec 'raw'");
    expected = size_t(numel) * dtype_bytes(t.dtype);
  }
  t.nbytes = get_u64(d, "nbytes", ctx.c_str());
  t.checksum = get_u64(d, "xxh64", ctx.c_str());
  if (t.nbytes > limits::kMaxTensorBytes) fail(WireErrc::kTooLarge, ctx + ": payload over the limit");
  if (t.nbytes != expected)
    fail(WireErrc::kBadTensor, ctx + ": " + std::to_string(t.nbytes) + " bytes declared but codec " + codec +
                                   " with " + std::to_string(numel) + " elements needs " + std::to_string(expected));
  if (t.dtype == DType::kF32 && t.codec.zstd) {
    t.zbytes = get_u64(d, "zbytes", ctx.c_str());
    if (t.zbytes == 0 || t.zbytes > ZSTD_compressBound(t.nbytes))
      fail(WireErrc::kBadTensor, ctx + ": zstd frame of " + std::to_string(t.zbytes) + " bytes for a payload of " + std::to_string(t.nbytes));
  }
  return t;
}

json desc_json(const TensorDesc& t) {
  json shape = json::array();
  for (int64_t v : t.shape) shape.push_back(uint64_t(v));
  json j{{"dtype", dtype_name(t.dtype)},
              {"shape", shape},
              {"codec", t.dtype == DType::kF32 ? t.codec.name() : std::string("raw")},
              {"nbytes", t.nbytes},
              {"xxh64", t.checksum}};
  if (t.dtype == DType::kF32 && t.codec.zstd) j["zbytes"] = t.zbytes;
  return j;
}

}  // namespace

const char* msg_type_name(MsgType t) {
  switch (t) {
    case MsgType::kHello: return "HELLO";
    case MsgType::kWelcome: return "WELCOME";
    case MsgType::kHeartbeat: return "HEARTBEAT";
    case MsgType::kBye: return "BYE";
    case MsgType::kError: return "ERROR";
    case MsgType::kLoadStage: return "LOAD_STAGE";
    case MsgType::kStageReady: return "STAGE_READY";
    case MsgType::kForward: return "FORWARD";
    case MsgType::kForwardLoss: return "FORWARD_LOSS";
    case MsgType::kBackward: return "BACKWARD";
    case MsgType::kEval: return "EVAL";
    case MsgType::kResult: return "RESULT";
    case MsgType::kStep: return "STEP";
    case MsgType::kRoundBegin: return "ROUND_BEGIN";
    case MsgType::kRoundDelta: return "ROUND_DELTA";
    case MsgType::kRoundApply: return "ROUND_APPLY";
    case MsgType::kRoundDone: return "ROUND_DONE";
    case MsgType::kStateRequest: return "STATE_REQUEST";
    case MsgType::kStateReply: return "STATE_REPLY";
    case MsgType::kStateLoad: return "STATE_LOAD";
    case MsgType::kSubmit: return "SUBMIT";
    case MsgType::kSubmitted: return "SUBMITTED";
    case MsgType::kStatus: return "STATUS";
    case MsgType::kStatusReply: return "STATUS_REPLY";
    case MsgType::kCancel: return "CANCEL";
    case MsgType::kPeers: return "PEERS";
    case MsgType::kPeersReply: return "PEERS_REPLY";
    case MsgType::kChaos: return "CHAOS";
    case MsgType::kChaosReply: return "CHAOS_REPLY";
  }
  return "?";
}

bool known_type(int t) {
  return std::string(msg_type_name(static_cast<MsgType>(t))) != "?";
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kI32: return "i32";
    case DType::kU16: return "u16";
  }
  return "?";
}

size_t dtype_bytes(DType d) { return d == DType::kU16 ? 2 : 4; }

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t v : shape) n *= v;
  return n;
}

uint64_t checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

Tensor make_tensor(DType dtype, std::vector<int64_t> shape, const compression::CodecSpec& codec, size_t nbytes) {
  Tensor t;
  t.desc.dtype = dtype;
  t.desc.shape = std::move(shape);
  t.desc.codec = codec;
  t.desc.nbytes = nbytes;
  t.data.rebuild(nbytes);
  return t;
}

void seal(Tensor& t) { t.desc.checksum = checksum(t.data.data(), t.data.size()); }

void compress(Tensor& t) {
  if (t.packed || t.desc.dtype != DType::kF32 || !t.desc.codec.zstd) return;
  zmq::message_t z(ZSTD_compressBound(t.data.size()));
  const size_t n = ZSTD_compress(z.data(), z.size(), t.data.data(), t.data.size(), /*level=*/1);
  if (ZSTD_isError(n)) throw std::runtime_error(std::string("zstd: ") + ZSTD_getErrorName(n));
  t.data = zmq::message_t(z.data(), n);
  t.desc.zbytes = n;
  t.packed = true;
}

Tensor share(Tensor& t) {
  Tensor c;
  c.desc = t.desc;
  c.packed = t.packed;
  c.data.copy(t.data);
  return c;
}

Message decode(std::vector<zmq::message_t>& frames, bool verify_checksums) {
  if (frames.size() < 2) fail(WireErrc::kTruncated, "a message needs an envelope and a body frame, got " + std::to_string(frames.size()) + " frame(s)");
  if (frames.size() > limits::kMaxFrames) fail(WireErrc::kTooLarge, "more frames than the limit");
  if (frames[0].size() > limits::kMaxEnvelopeBytes) fail(WireErrc::kTooLarge, "envelope over the limit");
  if (frames[1].size() > limits::kMaxBodyBytes) fail(WireErrc::kTooLarge, "body over the limit");
  size_t total = 0;
  for (const auto& f : frames) total += f.size();
  if (total > limits::kMaxMessageBytes) fail(WireErrc::kTooLarge, "message over the limit");

  json env = unpack_frame(frames[0], "envelope");
  if (!env.is_array() || env.size() != 5 || !env[0].is_string())
    fail(WireErrc::kBadMagic, "frame 0 is not a swarm envelope [magic, version, type, id, attempt]");
  if (env[0].get<std::string>() != kMagic) fail(WireErrc::kBadMagic, "bad magic (expected \"SWRM\")");
  if (!env[1].is_number_unsigned() || env[1].get<uint64_t>() != uint64_t(kVersion))
    fail(WireErrc::kBadVersion, "protocol version " + env[1].dump() + " is not supported (this side speaks " + std::to_string(kVersion) + ")");
  if (!env[2].is_number_unsigned() || env[2].get<uint64_t>() > 1000 || !known_type(int(env[2].get<uint64_t>())))
    fail(WireErrc::kUnknownType, "unknown message type " + env[2].dump());
  if (!env[3].is_number_unsigned() || !env[4].is_number_unsigned() || env[4].get<uint64_t>() > UINT32_MAX)
    fail(WireErrc::kMalformed, "envelope id and attempt must be unsigned integers");

  Message m;
  m.type = static_cast<MsgType>(env[2].get<uint64_t>());
  m.id = env[3].get<uint64_t>();
  m.attempt = uint32_t(env[4].get<uint64_t>());
  m.body = unpack_frame(frames[1], "body");
  if (!m.body.is_object()) fail(WireErrc::kMalformed, "body is not a map");

  const size_t ntensors = frames.size() - 2;
  auto it = m.body.find("tensors");
  if (it == m.body.end()) {
    if (ntensors != 0) fail(WireErrc::kMalformed, std::to_string(ntensors) + " tensor frame(s) but no descriptions in the body");
    return m;
  }
  if (!it->is_array()) fail(WireErrc::kMalformed, "body.tensors is not an array");
  if (it->size() != ntensors)
    fail(WireErrc::kTruncated, "body describes " + std::to_string(it->size()) + " tensor(s) but " + std::to_string(ntensors) + " frame(s) follow");
  m.tensors.reserve(ntensors);
  for (size_t i = 0; i < ntensors; ++i) {
    Tensor t;
    t.desc = parse_desc((*it)[i], i);
    zmq::message_t& f = frames[i + 2];
    if (f.size() != t.desc.wire_bytes())
      fail(WireErrc::kTruncated, "tensor " + std::to_string(i) + ": frame has " + std::to_string(f.size()) + " bytes, description says " + std::to_string(t.desc.wire_bytes()));
    if (t.desc.zbytes) {
      zmq::message_t raw(t.desc.nbytes);
      const size_t got = ZSTD_decompress(raw.data(), raw.size(), f.data(), f.size());
      if (ZSTD_isError(got) || got != t.desc.nbytes)
        fail(WireErrc::kBadTensor, "tensor " + std::to_string(i) + ": zstd frame does not unpack to the " + std::to_string(t.desc.nbytes) +
                                       " bytes declared" + (ZSTD_isError(got) ? std::string(" (") + ZSTD_getErrorName(got) + ")" : ""));
      f = std::move(raw);
    }
    if (verify_checksums && checksum(f.data(), f.size()) != t.desc.checksum)
      fail(WireErrc::kChecksum, "tensor " + std::to_string(i) + ": checksum mismatch");
    t.data = std::move(f);
    m.tensors.push_back(std::move(t));
  }
  m.body.erase("tensors");
  return m;
}

std::optional<uint64_t> peek_id(const std::vector<zmq::message_t>& frames) {
  if (frames.empty() || frames[0].size() > limits::kMaxEnvelopeBytes) return std::nullopt;
  try {
    json env = unpack_frame(frames[0], "envelope");
    if (!env.is_array() || env.size() != 5 || !env[0].is_string() || env[0].get<std::string>() != kMagic ||
        !env[3].is_number_unsigned())
      return std::nullopt;
    return env[3].get<uint64_t>();
  } catch (const WireError&) {
    return std::nullopt;
  }
}

std::vector<zmq::message_t> encode(Message& m) {
  std::vector<zmq::message_t> frames;
  frames.reserve(2 + m.tensors.size());
  frames.push_back(pack(json::array({kMagic, kVersion, int(m.type), m.id, m.attempt})));
  if (m.tensors.empty()) {
    frames.push_back(pack(m.body));
  } else {
    json descs = json::array();
    for (auto& t : m.tensors) {
      compress(t);
      descs.push_back(desc_json(t.desc));
    }
    m.body["tensors"] = std::move(descs);
    frames.push_back(pack(m.body));
    m.body.erase("tensors");
  }
  for (auto& t : m.tensors) frames.push_back(std::move(t.data));
  m.tensors.clear();
  return frames;
}

std::optional<Received> recv_frames(zmq::socket_t& s, bool with_route, zmq::recv_flags flags) {
  Received r;
  zmq::message_t part;
  if (!s.recv(part, flags)) return std::nullopt;
  bool first = true;
  size_t count = 0;
  bool too_many = false;
  for (;;) {
    const bool more = part.more();
    if (first && with_route) {
      r.route.assign(static_cast<const char*>(part.data()), part.size());
    } else if (++count <= limits::kMaxFrames + 1) {
      r.frames.push_back(std::move(part));
    } else {
      too_many = true;  // keep draining so the socket stays in step
    }
    first = false;
    if (!more) break;
    part = zmq::message_t();
    (void)s.recv(part, zmq::recv_flags::none);
  }
  if (too_many) r.frames.resize(limits::kMaxFrames + 1);  // decode() rejects it as too large
  return r;
}

bool send(zmq::socket_t& s, Message& m, const std::string* route) {
  std::vector<zmq::message_t> frames = encode(m);
  try {
    if (route) {
      if (!s.send(zmq::buffer(*route), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return false;
    }
    for (size_t i = 0; i < frames.size(); ++i) {
      auto fl = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      if (!s.send(frames[i], fl)) return false;
    }
  } catch (const zmq::error_t& e) {
    if (e.num() == EHOSTUNREACH) return false;
    throw;
  }
  return true;
}

Message error_reply(const Message* req, WireErrc code, const std::string& text) {
  Message e(MsgType::kError, req ? req->id : 0, req ? req->attempt : 0,
            json{{"code", int(code)}, {"name", wire_errc_name(code)}, {"message", text}});
  if (req) e.body["request_type"] = int(req->type);
  return e;
}

}  // namespace swarm::wire
