// wire.cpp: encoding, decoding and validation of wire protocol messages (see wire.h).
//
// Frames are parsed with msgpack-c under explicit unpack limits (sizes, depth), so that no
// declared length is allocated before it is checked; tensor descriptions are read straight from
// the msgpack objects. The body stays msgpack bytes for runtime/messages.h to read into a typed
// struct. Every failure is a WireError with a code and a sentence.
#include "runtime/wire.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <msgpack.hpp>
#include <xxhash.h>
#include <zstd.h>

#include "runtime/body.h"
#include "runtime/limits.h"
#include "runtime/timing.h"

namespace swarm::wire {

namespace {

constexpr int kMaxDepth = 16;

[[noreturn]] void fail(WireErrc code, const std::string& what) { throw WireError(code, what); }

msgpack::object_handle unpack_frame(const zmq::message_t& f, const char* what) {
  const auto lim = msgpack::unpack_limit(limits::kMaxArrayEntries, limits::kMaxMapEntries,
                                         limits::kMaxStringBytes, limits::kMaxBinBytes, 0, kMaxDepth);
  try {
    size_t off = 0;
    msgpack::object_handle oh =
        msgpack::unpack(static_cast<const char*>(f.data()), f.size(), off, nullptr, nullptr, lim);
    if (off != f.size()) fail(WireErrc::kMalformed, std::string(what) + " has trailing bytes");
    return oh;
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

bool is_str(const msgpack::object& o, const char* s) {
  const size_t n = std::strlen(s);
  return o.type == msgpack::type::STR && o.via.str.size == n && std::memcmp(o.via.str.ptr, s, n) == 0;
}

const msgpack::object* map_get(const msgpack::object& m, const char* key) {
  for (uint32_t i = 0; i < m.via.map.size; ++i)
    if (is_str(m.via.map.ptr[i].key, key)) return &m.via.map.ptr[i].val;
  return nullptr;
}

uint64_t get_u64(const msgpack::object& d, const char* key, const std::string& ctx) {
  const msgpack::object* v = map_get(d, key);
  if (!v || v->type != msgpack::type::POSITIVE_INTEGER)
    fail(WireErrc::kMalformed, ctx + ": field '" + key + "' missing or not an unsigned integer");
  return v->via.u64;
}

TensorDesc parse_desc(const msgpack::object& d, size_t index) {
  const std::string ctx = "tensor " + std::to_string(index);
  if (d.type != msgpack::type::MAP) fail(WireErrc::kMalformed, ctx + ": description is not a map");
  TensorDesc t;
  const msgpack::object* dt = map_get(d, "dtype");
  if (!dt) fail(WireErrc::kBadTensor, ctx + ": dtype must be one of f32, i32, u16");
  if (is_str(*dt, "f32")) t.dtype = DType::kF32;
  else if (is_str(*dt, "i32")) t.dtype = DType::kI32;
  else if (is_str(*dt, "u16")) t.dtype = DType::kU16;
  else fail(WireErrc::kBadTensor, ctx + ": dtype must be one of f32, i32, u16");
  const msgpack::object* sh = map_get(d, "shape");
  if (!sh || sh->type != msgpack::type::ARRAY) fail(WireErrc::kMalformed, ctx + ": shape missing");
  if (sh->via.array.size > limits::kMaxTensorRank) fail(WireErrc::kTooLarge, ctx + ": rank over the limit");
  int64_t numel = 1;
  for (uint32_t i = 0; i < sh->via.array.size; ++i) {
    const msgpack::object& v = sh->via.array.ptr[i];
    if (v.type != msgpack::type::POSITIVE_INTEGER) fail(WireErrc::kBadTensor, ctx + ": shape entries must be non-negative integers");
    const uint64_t n = v.via.u64;
    if (n > uint64_t(limits::kMaxTensorElements)) fail(WireErrc::kTooLarge, ctx + ": dimension over the limit");
    numel *= int64_t(n);
    if (numel > limits::kMaxTensorElements) fail(WireErrc::kTooLarge, ctx + ": more elements than the limit");
    t.shape.push_back(int64_t(n));
  }
  const msgpack::object* cd = map_get(d, "codec");
  if (!cd || cd->type != msgpack::type::STR) fail(WireErrc::kMalformed, ctx + ": codec missing");
  if (cd->via.str.size > compression::kMaxCodecTextBytes) fail(WireErrc::kBadTensor, ctx + ": codec text over the limit");
  const std::string codec(cd->via.str.ptr, cd->via.str.size);
  size_t expected = 0;
  if (t.dtype == DType::kF32) {
    try {
      t.codec = compression::parse_codec(codec);
      expected = compression::encoded_bytes(t.codec, numel);
    } catch (const InputError& e) {
      fail(WireErrc::kBadTensor, ctx + ": " + e.what());
    }
  } else {
    if (codec != "raw") fail(WireErrc::kBadTensor, ctx + ": integer tensors travel with codec 'raw'");
    expected = size_t(numel) * dtype_bytes(t.dtype);
  }
  t.nbytes = get_u64(d, "nbytes", ctx);
  t.checksum = get_u64(d, "xxh64", ctx);
  if (t.nbytes > limits::kMaxTensorBytes) fail(WireErrc::kTooLarge, ctx + ": payload over the limit");
  if (t.nbytes != expected)
    fail(WireErrc::kBadTensor, ctx + ": " + std::to_string(t.nbytes) + " bytes declared but codec " + codec +
                                   " with " + std::to_string(numel) + " elements needs " + std::to_string(expected));
  const bool zstd = t.dtype == DType::kF32 && t.codec.zstd;
  if (zstd) {
    t.zbytes = get_u64(d, "zbytes", ctx);
    if (t.zbytes == 0 || t.zbytes > ZSTD_compressBound(t.nbytes))
      fail(WireErrc::kBadTensor, ctx + ": zstd frame of " + std::to_string(t.zbytes) + " bytes for a payload of " + std::to_string(t.nbytes));
  } else if (map_get(d, "zbytes")) {
    fail(WireErrc::kBadTensor, ctx + ": zbytes given for codec " + codec + ", which is not zstd-packed (entropy=zstd)");
  }
  return t;
}

std::vector<TensorRef> parse_refs(const msgpack::object& a, size_t ntensors, size_t max) {
  if (a.type != msgpack::type::ARRAY) fail(WireErrc::kMalformed, "body.refs is not an array");
  const size_t n = a.via.array.size;
  if (ntensors + n > max)
    fail(WireErrc::kMalformed, "carries at most " + std::to_string(max) + " tensor(s), got " + std::to_string(ntensors) + " and " +
                                   std::to_string(n) + " reference(s)");
  std::vector<TensorRef> out;
  std::vector<bool> taken(ntensors + n, false);
  for (size_t i = 0; i < n; ++i) {
    const msgpack::object& r = a.via.array.ptr[i];
    const std::string ctx = "reference " + std::to_string(i);
    if (r.type != msgpack::type::MAP) fail(WireErrc::kMalformed, ctx + " is not a map");
    TensorRef ref;
    const msgpack::object* d = map_get(r, "desc");
    if (!d) fail(WireErrc::kMalformed, ctx + ": desc missing");
    ref.desc = parse_desc(*d, i);
    const msgpack::object* from = map_get(r, "from");
    if (!from || from->type != msgpack::type::STR || from->via.str.size > kMaxAddressBytes)
      fail(WireErrc::kMalformed, ctx + ": from must be an address of at most " + std::to_string(kMaxAddressBytes) + " bytes");
    ref.from.assign(from->via.str.ptr, from->via.str.size);
    if (const msgpack::object* fk = map_get(r, "from_key")) {
      if (fk->type != msgpack::type::STR || fk->via.str.size != 40) fail(WireErrc::kMalformed, ctx + ": from_key must be a public key (40 characters of Z85)");
      ref.from_key.assign(fk->via.str.ptr, fk->via.str.size);
    }
    if (const msgpack::object* pu = map_get(r, "pushed")) {
      if (pu->type != msgpack::type::BOOLEAN) fail(WireErrc::kMalformed, ctx + ": pushed must be a boolean");
      ref.pushed = pu->via.boolean;
    }
    ref.key = get_u64(r, "key", ctx);
    const uint64_t part = get_u64(r, "part", ctx), slot = get_u64(r, "slot", ctx);
    if (part >= limits::kMaxFrames) fail(WireErrc::kMalformed, ctx + ": part out of range");
    if (slot >= taken.size() || taken[slot])
      fail(WireErrc::kMalformed, ctx + ": slot " + std::to_string(slot) + " is out of range or taken twice");
    taken[slot] = true;
    ref.part = uint32_t(part);
    ref.slot = uint32_t(slot);
    out.push_back(std::move(ref));
  }
  return out;
}

void pack_str(msgpack::packer<msgpack::sbuffer>& pk, const char* s) {
  const size_t n = std::strlen(s);
  pk.pack_str(uint32_t(n));
  pk.pack_str_body(s, uint32_t(n));
}

// Keys in sorted order, as the protocol's worked example shows them.
void pack_desc(msgpack::packer<msgpack::sbuffer>& pk, const TensorDesc& t) {
  const bool zstd = t.dtype == DType::kF32 && t.codec.zstd;
  pk.pack_map(zstd ? 6 : 5);
  pack_str(pk, "codec");
  const std::string codec = t.dtype == DType::kF32 ? t.codec.name() : std::string("raw");
  pk.pack_str(uint32_t(codec.size()));
  pk.pack_str_body(codec.data(), uint32_t(codec.size()));
  pack_str(pk, "dtype");
  pack_str(pk, dtype_name(t.dtype));
  pack_str(pk, "nbytes");
  pk.pack(t.nbytes);
  pack_str(pk, "shape");
  pk.pack_array(uint32_t(t.shape.size()));
  for (int64_t v : t.shape) pk.pack(uint64_t(v));
  pack_str(pk, "xxh64");
  pk.pack(t.checksum);
  if (zstd) {
    pack_str(pk, "zbytes");
    pk.pack(t.zbytes);
  }
}

void pack_refs(msgpack::packer<msgpack::sbuffer>& pk, const std::vector<TensorRef>& refs) {
  pk.pack_array(uint32_t(refs.size()));
  for (const TensorRef& r : refs) {
    pk.pack_map(5 + uint32_t(!r.from_key.empty()) + uint32_t(r.pushed));
    pack_str(pk, "desc");
    pack_desc(pk, r.desc);
    pack_str(pk, "from");
    pk.pack(r.from);
    if (!r.from_key.empty()) {
      pack_str(pk, "from_key");
      pk.pack(r.from_key);
    }
    pack_str(pk, "key");
    pk.pack(r.key);
    pack_str(pk, "part");
    pk.pack(r.part);
    if (r.pushed) {
      pack_str(pk, "pushed");
      pk.pack(true);
    }
    pack_str(pk, "slot");
    pk.pack(r.slot);
  }
}

// The entries of a packed map (after its header) and their count.
std::pair<uint32_t, size_t> map_header(const std::string& body) {
  if (body.empty()) return {0, 0};
  const auto b = uint8_t(body[0]);
  if ((b & 0xf0u) == 0x80u) return {b & 0x0fu, 1};
  if (b == 0xde && body.size() >= 3) return {(uint32_t(uint8_t(body[1])) << 8) | uint8_t(body[2]), 3};
  if (b == 0xdf && body.size() >= 5)
    return {(uint32_t(uint8_t(body[1])) << 24) | (uint32_t(uint8_t(body[2])) << 16) | (uint32_t(uint8_t(body[3])) << 8) | uint8_t(body[4]), 5};
  SWARM_CHECK(false, "a message body is not a msgpack map");
}

zmq::message_t to_frame(const msgpack::sbuffer& b) { return zmq::message_t(b.data(), b.size()); }

}  // namespace

const char* msg_type_name(MsgType t) {
  switch (t) {
    case MsgType::kHello: return "HELLO";
    case MsgType::kWelcome: return "WELCOME";
    case MsgType::kHeartbeat: return "HEARTBEAT";
    case MsgType::kBye: return "BYE";
    case MsgType::kError: return "ERROR";
    case MsgType::kPart: return "PART";
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
    case MsgType::kRoundReduce: return "ROUND_REDUCE";
    case MsgType::kRoundReduced: return "ROUND_REDUCED";
    case MsgType::kFetch: return "FETCH";
    case MsgType::kFetched: return "FETCHED";
    case MsgType::kRelease: return "RELEASE";
    case MsgType::kPeerKeys: return "PEER_KEYS";
    case MsgType::kPush: return "PUSH";
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

bool known_type(int t) { return t > 0 && t <= 1000 && std::strcmp(msg_type_name(static_cast<MsgType>(t)), "?") != 0; }

size_t max_tensors(MsgType t) {
  switch (t) {
    case MsgType::kForward: case MsgType::kResult: case MsgType::kRoundReduced: case MsgType::kFetched:
      return 1;
    case MsgType::kRoundDelta: case MsgType::kRoundApply: return 256;   // one per part (msg::kMaxShards)
    case MsgType::kForwardLoss: case MsgType::kBackward: case MsgType::kEval: return 2;
    case MsgType::kStateReply: case MsgType::kStateLoad: return 5;
    case MsgType::kRoundReduce: return limits::kMaxFrames - 2;
    default: return 0;
  }
}

size_t max_body_bytes(MsgType t) {
  switch (t) {
    case MsgType::kSubmit: case MsgType::kLoadStage: case MsgType::kStatusReply: case MsgType::kPeersReply:
    case MsgType::kRoundReduce:
      return limits::kMaxBodyBytes;
    default: return limits::kMaxSmallBodyBytes;
  }
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

uint64_t zeros_checksum(size_t n) {
  static const std::vector<char> zeros(size_t(1) << 16, 0);
  XXH3_state_t* st = XXH3_createState();
  SWARM_CHECK(st != nullptr && XXH3_64bits_reset(st) == XXH_OK, "cannot start a checksum");
  for (size_t left = n; left > 0;) {
    const size_t k = std::min(left, zeros.size());
    XXH3_64bits_update(st, zeros.data(), k);
    left -= k;
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

Message json_message(MsgType t, uint64_t id, uint32_t attempt, const nlohmann::json& body) {
  return Message(t, id, attempt, pack_json(body.is_null() ? nlohmann::json::object() : body));
}

nlohmann::json body_json(const Message& m) { return unpack_json(m.body, msg_type_name(m.type)); }

Tensor make_tensor(DType dtype, Shape shape, const compression::CodecSpec& codec, size_t nbytes) {
  Tensor t;
  t.desc.dtype = dtype;
  t.desc.shape = shape;
  t.desc.codec = codec;
  t.desc.nbytes = nbytes;
  t.data.rebuild(nbytes);
  return t;
}

namespace {

// Freed buffers by size, at most kPooledPerSize of each; the rest go back to malloc. Never
// destroyed: a frame may be closed by ZeroMQ's I/O thread during exit.
class BufferPool {
 public:
  static BufferPool& get() {
    static BufferPool* pool = new BufferPool;
    return *pool;
  }
  void* take(size_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Free& f : free_)
        if (f.size == n && !f.bufs.empty()) {
          void* p = f.bufs.back();
          f.bufs.pop_back();
          return p;
        }
    }
    void* p = std::malloc(std::max<size_t>(n, 1));
    if (!p) throw std::bad_alloc();
    return p;
  }
  static void give(void* data, void* hint) {
    BufferPool& pool = get();
    const size_t n = reinterpret_cast<size_t>(hint);
    {
      std::lock_guard<std::mutex> lock(pool.mu_);
      Free* slot = nullptr;
      for (Free& f : pool.free_)
        if (f.size == n) slot = &f;
      if (!slot && pool.free_.size() < kSizes) slot = &pool.free_.emplace_back(Free{n, {}});
      if (slot && slot->bufs.size() < kPooledPerSize) {
        slot->bufs.push_back(data);
        return;
      }
    }
    std::free(data);
  }

 private:
  static constexpr size_t kPooledPerSize = 64, kSizes = 8;
  struct Free {
    size_t size;
    std::vector<void*> bufs;
  };
  std::mutex mu_;
  std::vector<Free> free_;
};

}  // namespace

Tensor make_pooled_tensor(DType dtype, Shape shape, const compression::CodecSpec& codec, size_t nbytes) {
  Tensor t = make_tensor(dtype, shape, codec, 0);
  t.desc.nbytes = nbytes;
  t.data = zmq::message_t(BufferPool::get().take(nbytes), nbytes, &BufferPool::give, reinterpret_cast<void*>(nbytes));
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

void decompress(Tensor& t) {
  if (!t.packed) return;
  zmq::message_t raw(t.desc.nbytes);
  const size_t got = ZSTD_decompress(raw.data(), raw.size(), t.data.data(), t.data.size());
  if (ZSTD_isError(got) || got != t.desc.nbytes)
    fail(WireErrc::kBadTensor, "zstd frame does not unpack to the " + std::to_string(t.desc.nbytes) + " bytes declared");
  t.data = std::move(raw);
  t.desc.zbytes = 0;
  t.packed = false;
}

Tensor share(Tensor& t) {
  Tensor c;
  c.desc = t.desc;
  c.packed = t.packed;
  c.data.copy(t.data);
  return c;
}

bool same_tensor(const TensorDesc& a, const TensorDesc& b) {
  return a.dtype == b.dtype && a.shape == b.shape && (a.dtype != DType::kF32 || a.codec == b.codec) && a.nbytes == b.nbytes &&
         a.checksum == b.checksum;
}

void resolve(Message& m, std::vector<Tensor> fetched) {
  SWARM_CHECK(fetched.size() == m.refs.size(), "one fetched tensor per reference");
  const size_t n = m.tensors.size() + m.refs.size();
  std::vector<std::optional<Tensor>> slots(n);
  for (size_t i = 0; i < m.refs.size(); ++i) {
    const TensorRef& r = m.refs[i];
    if (!same_tensor(fetched[i].desc, r.desc))
      fail(WireErrc::kBadTensor, "tensor " + std::to_string(r.slot) + " fetched from " + r.from + " is not the one referenced (" +
                                     std::to_string(fetched[i].desc.nbytes) + " bytes, checksum " + std::to_string(fetched[i].desc.checksum) + ")");
    slots[r.slot] = std::move(fetched[i]);
  }
  size_t next = 0;
  for (auto& t : m.tensors) {
    while (slots[next]) ++next;
    slots[next] = std::move(t);
  }
  m.tensors.clear();
  m.refs.clear();
  for (auto& t : slots) m.tensors.push_back(std::move(*t));
}

namespace {

// Frame 0 as an array of 5 with the magic, else bad_magic: bytes that are not even msgpack are
// not a swarm envelope either.
msgpack::object_handle envelope_object(const std::vector<zmq::message_t>& frames) {
  if (frames.size() < 2) fail(WireErrc::kTruncated, "a message needs an envelope and a body frame, got " + std::to_string(frames.size()) + " frame(s)");
  if (frames.size() > limits::kMaxFrames) fail(WireErrc::kTooLarge, "more frames than the limit");
  if (frames[0].size() > limits::kMaxEnvelopeBytes) fail(WireErrc::kTooLarge, "envelope over the limit");
  msgpack::object_handle oh;
  try {
    oh = unpack_frame(frames[0], "envelope");
  } catch (const WireError& e) {
    fail(WireErrc::kBadMagic, std::string("frame 0 is not a swarm envelope [\"SWRM\", version, type, id, attempt]: ") + e.what());
  }
  const msgpack::object& e = oh.get();
  if (e.type != msgpack::type::ARRAY || e.via.array.size != 5 || e.via.array.ptr[0].type != msgpack::type::STR)
    fail(WireErrc::kBadMagic, "frame 0 is not a swarm envelope [\"SWRM\", version, type, id, attempt]");
  if (!is_str(e.via.array.ptr[0], kMagic)) fail(WireErrc::kBadMagic, "bad magic (expected \"SWRM\")");
  return oh;
}

}  // namespace

std::optional<int> peek_version(const std::vector<zmq::message_t>& frames) {
  try {
    msgpack::object_handle oh = envelope_object(frames);
    const msgpack::object& v = oh.get().via.array.ptr[1];
    if (v.type == msgpack::type::POSITIVE_INTEGER && v.via.u64 <= 1000) return int(v.via.u64);
  } catch (const WireError&) {
  }
  return std::nullopt;
}

std::string printable_id(const std::string& id) {
  bool printable = !id.empty();
  for (unsigned char ch : id) printable &= ch >= 0x20 && ch < 0x7f;
  if (printable) return id;
  static const char* hex = "0123456789abcdef";
  std::string out = "0x";
  for (unsigned char ch : id) {
    out += hex[ch >> 4];
    out += hex[ch & 15];
  }
  return out;
}

std::optional<std::string> id_from_hex(const std::string& text) {
  if (text.size() < 4 || text.size() % 2 || text.compare(0, 2, "0x") != 0) return std::nullopt;
  auto nibble = [](char ch) { return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1; };
  std::string out;
  for (size_t i = 2; i < text.size(); i += 2) {
    const int hi = nibble(text[i]), lo = nibble(text[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out += char(hi * 16 + lo);
  }
  return out;
}

Envelope peek_envelope(const std::vector<zmq::message_t>& frames) {
  msgpack::object_handle oh = envelope_object(frames);
  const msgpack::object* a = oh.get().via.array.ptr;
  // Every version reads an ERROR in a v1 envelope: how a peer learns why it was refused.
  const bool refusal = a[1].type == msgpack::type::POSITIVE_INTEGER && a[1].via.u64 == uint64_t(kVersionForRefusals) &&
                       a[2].type == msgpack::type::POSITIVE_INTEGER && a[2].via.u64 == uint64_t(MsgType::kError);
  if (!refusal && (a[1].type != msgpack::type::POSITIVE_INTEGER || a[1].via.u64 != uint64_t(kVersion)))
    fail(WireErrc::kBadVersion, "protocol version " + (a[1].type == msgpack::type::POSITIVE_INTEGER ? std::to_string(a[1].via.u64) : std::string("?")) +
                                    " is not supported: this side speaks v" + std::to_string(kVersion) +
                                    " (since v2 routing ids are msgpack bin, docs/protocol.md); upgrade the older side");
  if (a[2].type != msgpack::type::POSITIVE_INTEGER || a[2].via.u64 > 1000 || !known_type(int(a[2].via.u64)))
    fail(WireErrc::kUnknownType, "unknown message type " + (a[2].type == msgpack::type::POSITIVE_INTEGER ? std::to_string(a[2].via.u64) : std::string("?")));
  if (a[3].type != msgpack::type::POSITIVE_INTEGER || a[4].type != msgpack::type::POSITIVE_INTEGER || a[4].via.u64 > UINT32_MAX)
    fail(WireErrc::kMalformed, "envelope id and attempt must be unsigned integers");
  Envelope env;
  env.type = static_cast<MsgType>(a[2].via.u64);
  env.version = int(a[1].via.u64);
  env.id = a[3].via.u64;
  env.attempt = uint32_t(a[4].via.u64);
  return env;
}

Message decode(std::vector<zmq::message_t>& frames, bool verify_checksums) {
  const Envelope env = peek_envelope(frames);
  const size_t ntensors = frames.size() - 2;
  if (ntensors > max_tensors(env.type))
    fail(WireErrc::kMalformed, std::string(msg_type_name(env.type)) + " carries at most " + std::to_string(max_tensors(env.type)) +
                                   " tensor(s), got " + std::to_string(ntensors));
  if (frames[1].size() > max_body_bytes(env.type))
    fail(WireErrc::kTooLarge, std::string(msg_type_name(env.type)) + " body of " + std::to_string(frames[1].size()) +
                                  " bytes is over its limit of " + std::to_string(max_body_bytes(env.type)));
  size_t total = 0;
  for (const auto& f : frames) total += f.size();
  if (total > limits::kMaxMessageBytes) fail(WireErrc::kTooLarge, "message over the limit");

  Message m(env.type, env.id, env.attempt);
  m.version = env.version;
  msgpack::object_handle oh = unpack_frame(frames[1], "body");
  const msgpack::object& body = oh.get();
  if (body.type != msgpack::type::MAP) fail(WireErrc::kMalformed, "body is not a map");
  // The keys the wire layer owns: tensor descriptions, references, the hold flag.
  const msgpack::object *descs = nullptr, *refs = nullptr, *hold = nullptr, *within = nullptr;
  for (uint32_t i = 0; i < body.via.map.size; ++i) {
    const auto& kv = body.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) fail(WireErrc::kMalformed, "body key is not a string");
    if (is_str(kv.key, "tensors")) descs = &kv.val;
    else if (is_str(kv.key, "refs")) refs = &kv.val;
    else if (is_str(kv.key, "hold")) hold = &kv.val;
    else if (is_str(kv.key, "fetch_within_ms")) within = &kv.val;
  }
  if (hold) {
    if (hold->type != msgpack::type::BOOLEAN) fail(WireErrc::kMalformed, "body.hold is not a boolean");
    m.hold = hold->via.boolean;
  }
  if (refs) m.refs = parse_refs(*refs, ntensors, max_tensors(env.type));
  if (within) {
    if (within->type != msgpack::type::POSITIVE_INTEGER || within->via.u64 == 0 || within->via.u64 > timing::kMaxFetchWithinMs)
      fail(WireErrc::kMalformed, "body.fetch_within_ms must be an integer in [1, " + std::to_string(timing::kMaxFetchWithinMs) + "]");
    m.fetch_within_ms = uint32_t(within->via.u64);
  }
  const uint32_t wire_keys = uint32_t(descs != nullptr) + uint32_t(refs != nullptr) + uint32_t(hold != nullptr) + uint32_t(within != nullptr);
  if (!descs) {
    if (ntensors != 0) fail(WireErrc::kMalformed, std::to_string(ntensors) + " tensor frame(s) but no descriptions in the body");
    if (wire_keys == 0) {
      m.body.assign(static_cast<const char*>(frames[1].data()), frames[1].size());
      return m;
    }
  } else if (descs->type != msgpack::type::ARRAY) {
    fail(WireErrc::kMalformed, "body.tensors is not an array");
  }
  const uint32_t ndescs = descs ? descs->via.array.size : 0;
  if (ndescs != ntensors)
    fail(WireErrc::kTruncated, "body describes " + std::to_string(ndescs) + " tensor(s) but " + std::to_string(ntensors) + " frame(s) follow");
  // Every description is checked, and their declared sizes summed, before anything is unpacked.
  std::vector<TensorDesc> parsed;
  parsed.reserve(ntensors);
  uint64_t declared = 0;
  for (size_t i = 0; i < ntensors; ++i) {
    parsed.push_back(parse_desc(descs->via.array.ptr[i], i));
    declared += parsed.back().nbytes;
    if (declared > limits::kMaxMessageBytes)
      fail(WireErrc::kTooLarge, "tensors 0.." + std::to_string(i) + " declare " + std::to_string(declared) +
                                    " bytes together, over the message limit of " + std::to_string(limits::kMaxMessageBytes));
    if (frames[i + 2].size() != parsed.back().wire_bytes())
      fail(WireErrc::kTruncated, "tensor " + std::to_string(i) + ": frame has " + std::to_string(frames[i + 2].size()) +
                                     " bytes, description says " + std::to_string(parsed.back().wire_bytes()));
  }
  // The body without its tensor descriptions.
  {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    pk.pack_map(body.via.map.size - wire_keys);
    for (uint32_t i = 0; i < body.via.map.size; ++i) {
      const auto& kv = body.via.map.ptr[i];
      if (&kv.val == descs || &kv.val == refs || &kv.val == hold || &kv.val == within) continue;
      pk.pack(kv.key);
      pk.pack(kv.val);
    }
    m.body.assign(buf.data(), buf.size());
  }
  m.tensors.reserve(ntensors);
  for (size_t i = 0; i < ntensors; ++i) {
    Tensor t;
    t.desc = std::move(parsed[i]);
    zmq::message_t& f = frames[i + 2];
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
  return m;
}

std::optional<uint64_t> peek_id(const std::vector<zmq::message_t>& frames) {
  if (frames.size() < 2) return std::nullopt;
  try {
    return peek_envelope(frames).id;
  } catch (const WireError&) {
    return std::nullopt;
  }
}

std::vector<zmq::message_t> encode(Message& m) {
  std::vector<zmq::message_t> frames;
  frames.reserve(2 + m.tensors.size());
  {
    msgpack::sbuffer b;
    msgpack::packer<msgpack::sbuffer> pk(b);
    pk.pack_array(5);
    pack_str(pk, kMagic);
    SWARM_CHECK(m.version == kVersion || (m.version == kVersionForRefusals && m.type == MsgType::kError),
                "only an ERROR goes out in another envelope version");
    pk.pack(m.version);
    pk.pack(int(m.type));
    pk.pack(m.id);
    pk.pack(m.attempt);
    frames.push_back(to_frame(b));
  }
  if (m.tensors.empty() && m.refs.empty() && !m.hold) {
    if (m.body.empty()) frames.emplace_back("\x80", 1);
    else frames.emplace_back(m.body.data(), m.body.size());
  } else {
    const auto [count, head] = map_header(m.body);
    const bool within = !m.refs.empty() && m.fetch_within_ms > 0;
    msgpack::sbuffer b(m.body.size() + 96 * (m.tensors.size() + m.refs.size()) + 32);
    msgpack::packer<msgpack::sbuffer> pk(b);
    pk.pack_map(count + uint32_t(!m.tensors.empty()) + uint32_t(!m.refs.empty()) + uint32_t(m.hold) + uint32_t(within));
    b.write(m.body.data() + head, m.body.size() - head);
    if (m.hold) {
      pack_str(pk, "hold");
      pk.pack(true);
    }
    if (!m.refs.empty()) {
      pack_str(pk, "refs");
      pack_refs(pk, m.refs);
    }
    if (within) {
      pack_str(pk, "fetch_within_ms");
      pk.pack(m.fetch_within_ms);
    }
    if (!m.tensors.empty()) {
      pack_str(pk, "tensors");
      pk.pack_array(uint32_t(m.tensors.size()));
      for (auto& t : m.tensors) {
        compress(t);
        pack_desc(pk, t.desc);
      }
    }
    frames.push_back(to_frame(b));
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

bool send_frames(zmq::socket_t& s, std::vector<zmq::message_t>& frames, const std::string* route) {
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

bool send(zmq::socket_t& s, Message& m, const std::string* route) {
  std::vector<zmq::message_t> frames = encode(m);
  return send_frames(s, frames, route);
}

}  // namespace swarm::wire
