// body.cpp: implements runtime/body.h on msgpack-c: bounded unpacking, typed field reads with
// checks, field writes, and the msgpack <-> JSON conversions.
#include "runtime/body.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include <msgpack.hpp>

#include "runtime/errors.h"
#include "runtime/limits.h"

namespace swarm::wire {

namespace {

constexpr int kMaxDepth = 16;

[[noreturn]] void fail_wire(WireErrc code, const std::string& what) { throw WireError(code, what); }

msgpack::unpack_limit unpack_limits() {
  return msgpack::unpack_limit(limits::kMaxArrayEntries, limits::kMaxMapEntries, limits::kMaxStringBytes,
                               limits::kMaxBinBytes, 0, kMaxDepth);
}

// Strings and bins point into the bytes unpacked instead of being copied into the zone: every
// caller reads the objects while those bytes live.
bool refer_to_input(msgpack::type::object_type, size_t, void*) { return true; }

// Unpacks into `z` (the objects live as long as it does, and point into `data`).
msgpack::object unpack_bounded(msgpack::zone& z, const char* data, size_t size, const char* what) {
  try {
    size_t off = 0;
    const msgpack::object o = msgpack::unpack(z, data, size, off, refer_to_input, nullptr, unpack_limits());
    if (off != size) fail_wire(WireErrc::kMalformed, std::string(what) + " has trailing bytes");
    return o;
  } catch (const msgpack::insufficient_bytes&) {
    fail_wire(WireErrc::kTruncated, std::string(what) + " is truncated");
  } catch (const msgpack::depth_size_overflow&) {
    fail_wire(WireErrc::kTooLarge, std::string(what) + " is nested too deeply");
  } catch (const msgpack::size_overflow& e) {
    fail_wire(WireErrc::kTooLarge, std::string(what) + ": " + e.what());
  } catch (const WireError&) {
    throw;
  } catch (const std::exception& e) {
    fail_wire(WireErrc::kMalformed, std::string(what) + " is not valid msgpack: " + e.what());
  }
}

// A zone's first chunk sized to the body (msgpack's default is 8 KiB, for every message): it
// grows, chunk by chunk, when a body needs more.
size_t zone_chunk(size_t body_bytes) { return std::min<size_t>(MSGPACK_ZONE_CHUNK_SIZE, 256 + 4 * body_bytes); }

nlohmann::json to_json(const msgpack::object& o, int depth) {
  if (depth > kMaxDepth) fail_wire(WireErrc::kMalformed, "msgpack nesting deeper than " + std::to_string(kMaxDepth));
  switch (o.type) {
    case msgpack::type::NIL: return nullptr;
    case msgpack::type::BOOLEAN: return o.via.boolean;
    case msgpack::type::POSITIVE_INTEGER: return o.via.u64;
    case msgpack::type::NEGATIVE_INTEGER: return o.via.i64;
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return o.via.f64;
    case msgpack::type::STR: return std::string(o.via.str.ptr, o.via.str.size);
    case msgpack::type::BIN: return nlohmann::json::binary(std::vector<uint8_t>(o.via.bin.ptr, o.via.bin.ptr + o.via.bin.size));
    case msgpack::type::ARRAY: {
      nlohmann::json a = nlohmann::json::array();
      for (uint32_t i = 0; i < o.via.array.size; ++i) a.push_back(to_json(o.via.array.ptr[i], depth + 1));
      return a;
    }
    case msgpack::type::MAP: {
      nlohmann::json m = nlohmann::json::object();
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        const auto& kv = o.via.map.ptr[i];
        if (kv.key.type != msgpack::type::STR) fail_wire(WireErrc::kMalformed, "map key is not a string");
        m[std::string(kv.key.via.str.ptr, kv.key.via.str.size)] = to_json(kv.val, depth + 1);
      }
      return m;
    }
    default: fail_wire(WireErrc::kMalformed, "unsupported msgpack type (ext)");
  }
}

std::string type_text(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "nil";
    case msgpack::type::BOOLEAN: return o.via.boolean ? "true" : "false";
    case msgpack::type::POSITIVE_INTEGER: return std::to_string(o.via.u64);
    case msgpack::type::NEGATIVE_INTEGER: return std::to_string(o.via.i64);
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: {
      std::ostringstream s;
      s << o.via.f64;
      return s.str();
    }
    case msgpack::type::STR: {
      std::string s(o.via.str.ptr, std::min<uint32_t>(o.via.str.size, 32));
      for (char& c : s)
        if (c < 0x20 || c >= 0x7f) c = '?';
      return "\"" + s + (o.via.str.size > 32 ? "...\"" : "\"");
    }
    case msgpack::type::BIN: return "binary (" + std::to_string(o.via.bin.size) + " bytes)";
    case msgpack::type::ARRAY: return "an array";
    case msgpack::type::MAP: return "a map";
    default: return "an ext value";
  }
}

std::string num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

}  // namespace

// ---- reader ---------------------------------------------------------------------------------

struct BodyReader::Impl {
  explicit Impl(size_t body_bytes) : zone(zone_chunk(body_bytes)) {}
  msgpack::zone zone;
  const char* what;
  std::vector<std::pair<std::string_view, const msgpack::object*>> fields;

  const msgpack::object* find(const char* key) const {
    const std::string_view k(key);
    for (const auto& [name, obj] : fields)
      if (name == k) return obj->type == msgpack::type::NIL ? nullptr : obj;
    return nullptr;
  }
};

BodyReader::BodyReader(const std::string& bytes, const char* what) : impl_(std::make_unique<Impl>(bytes.size())) {
  impl_->what = what;
  if (bytes.empty()) return;
  const msgpack::object o = unpack_bounded(impl_->zone, bytes.data(), bytes.size(), what);
  if (o.type != msgpack::type::MAP) fail_wire(WireErrc::kMalformed, std::string(what) + ": the body is not a map");
  impl_->fields.reserve(o.via.map.size);
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const auto& kv = o.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) fail_wire(WireErrc::kMalformed, std::string(what) + ": a body key is not a string");
    impl_->fields.emplace_back(std::string_view(kv.key.via.str.ptr, kv.key.via.str.size), &kv.val);
  }
}

BodyReader::~BodyReader() = default;

bool BodyReader::has(const char* key) const { return impl_->find(key) != nullptr; }

void BodyReader::fail(const char* key, const std::string& what) const {
  throw WireError(WireErrc::kMalformed, std::string(impl_->what) + "." + key + " " + what);
}

// The field's object, or nullptr when it is absent and optional.
#define SWARM_FIND(key, need)                                      \
  const msgpack::object* o = impl_->find(key);                     \
  if (!o) {                                                        \
    if ((need) == kOptional) return;                               \
    fail(key, "is missing");                                       \
  }

void BodyReader::field(const char* key, bool& v, Need need) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::BOOLEAN) fail(key, "must be true or false, got " + type_text(*o));
  v = o->via.boolean;
}

void BodyReader::field(const char* key, int64_t& v, Need need, int64_t lo, int64_t hi) {
  SWARM_FIND(key, need);
  bool ok = false;
  int64_t x = 0;
  if (o->type == msgpack::type::POSITIVE_INTEGER && o->via.u64 <= uint64_t(kIntMax)) {
    x = int64_t(o->via.u64);
    ok = true;
  } else if (o->type == msgpack::type::NEGATIVE_INTEGER) {
    x = o->via.i64;
    ok = true;
  }
  if (!ok || x < lo || x > hi)
    fail(key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + type_text(*o));
  v = x;
}

void BodyReader::field(const char* key, int32_t& v, Need need, int64_t lo, int64_t hi) {
  int64_t x = v;
  field(key, x, need, std::max<int64_t>(lo, INT32_MIN), std::min<int64_t>(hi, INT32_MAX));
  v = int32_t(x);
}

void BodyReader::field(const char* key, uint64_t& v, Need need, uint64_t hi) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::POSITIVE_INTEGER || o->via.u64 > hi)
    fail(key, "must be an unsigned integer up to " + std::to_string(hi) + ", got " + type_text(*o));
  v = o->via.u64;
}

void BodyReader::field(const char* key, double& v, Need need, double lo, double hi) {
  SWARM_FIND(key, need);
  double x = NAN;
  if (o->type == msgpack::type::FLOAT32 || o->type == msgpack::type::FLOAT64) x = o->via.f64;
  else if (o->type == msgpack::type::POSITIVE_INTEGER) x = double(o->via.u64);
  else if (o->type == msgpack::type::NEGATIVE_INTEGER) x = double(o->via.i64);
  if (!std::isfinite(x) || x < lo || x > hi) fail(key, "must be a number in [" + num(lo) + ", " + num(hi) + "], got " + type_text(*o));
  v = x;
}

void BodyReader::field(const char* key, std::string& v, Need need, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::STR) fail(key, "must be a string, got " + type_text(*o));
  if (o->via.str.size > max_bytes) fail(key, "is " + std::to_string(o->via.str.size) + " bytes, over the limit of " + std::to_string(max_bytes));
  v.assign(o->via.str.ptr, o->via.str.size);
}

void BodyReader::bytes(const char* key, std::string& v, Need need, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::BIN) fail(key, "must be binary (msgpack bin), got " + type_text(*o));
  if (o->via.bin.size > max_bytes) fail(key, "is " + std::to_string(o->via.bin.size) + " bytes, over the limit of " + std::to_string(max_bytes));
  v.assign(o->via.bin.ptr, o->via.bin.size);
}

bool BodyReader::text_or_bytes(const char* key, std::string& v, Need need, size_t max_bytes, bool fallback) {
  if (!has(key) && need == kOptional) return fallback;
  if (impl_->find(key) && impl_->find(key)->type == msgpack::type::BIN) {
    bytes(key, v, need, max_bytes);
    return true;
  }
  field(key, v, need, max_bytes);
  return false;
}

void BodyReader::field(const char* key, nlohmann::json& v, Need need) {
  SWARM_FIND(key, need);
  v = to_json(*o, 1);
}

void BodyReader::field(const char* key, std::vector<double>& v, Need need, size_t max_n, double lo, double hi) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::ARRAY || o->via.array.size > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " numbers, got " + type_text(*o));
  std::vector<double> out;
  out.reserve(o->via.array.size);
  for (uint32_t i = 0; i < o->via.array.size; ++i) {
    const msgpack::object& e = o->via.array.ptr[i];
    double x = NAN;
    if (e.type == msgpack::type::FLOAT32 || e.type == msgpack::type::FLOAT64) x = e.via.f64;
    else if (e.type == msgpack::type::POSITIVE_INTEGER) x = double(e.via.u64);
    else if (e.type == msgpack::type::NEGATIVE_INTEGER) x = double(e.via.i64);
    if (!std::isfinite(x) || x < lo || x > hi)
      fail(key, "entry " + std::to_string(i) + " must be a number in [" + num(lo) + ", " + num(hi) + "], got " + type_text(e));
    out.push_back(x);
  }
  v = std::move(out);
}

void BodyReader::field(const char* key, std::vector<int64_t>& v, Need need, size_t max_n, int64_t lo, int64_t hi) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::ARRAY || o->via.array.size > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " integers, got " + type_text(*o));
  std::vector<int64_t> out;
  out.reserve(o->via.array.size);
  for (uint32_t i = 0; i < o->via.array.size; ++i) {
    const msgpack::object& e = o->via.array.ptr[i];
    bool ok = false;
    int64_t x = 0;
    if (e.type == msgpack::type::POSITIVE_INTEGER && e.via.u64 <= uint64_t(kIntMax)) {
      x = int64_t(e.via.u64);
      ok = true;
    } else if (e.type == msgpack::type::NEGATIVE_INTEGER) {
      x = e.via.i64;
      ok = true;
    }
    if (!ok || x < lo || x > hi)
      fail(key, "entry " + std::to_string(i) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + type_text(e));
    out.push_back(x);
  }
  v = std::move(out);
}

void BodyReader::field(const char* key, std::vector<std::string>& v, Need need, size_t max_n, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o->type != msgpack::type::ARRAY || o->via.array.size > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " strings, got " + type_text(*o));
  std::vector<std::string> out;
  out.reserve(o->via.array.size);
  for (uint32_t i = 0; i < o->via.array.size; ++i) {
    const msgpack::object& e = o->via.array.ptr[i];
    if (e.type != msgpack::type::STR || e.via.str.size > max_bytes)
      fail(key, "entry " + std::to_string(i) + " must be a string of at most " + std::to_string(max_bytes) + " bytes, got " + type_text(e));
    out.emplace_back(e.via.str.ptr, e.via.str.size);
  }
  v = std::move(out);
}

#undef SWARM_FIND

int BodyReader::choice(const char* key, const std::vector<const char*>& names, Need need, int fallback) {
  std::string s;
  if (!has(key)) {
    if (need == kOptional) return fallback;
    fail(key, "is missing");
  }
  field(key, s, kRequired, 64);
  for (size_t i = 0; i < names.size(); ++i)
    if (s == names[i]) return int(i);
  std::string allowed;
  for (const char* n : names) allowed += std::string(allowed.empty() ? "" : ", ") + "\"" + n + "\"";
  fail(key, "must be one of " + allowed + ", got \"" + s + "\"");
}

// ---- writer ---------------------------------------------------------------------------------

struct BodyWriter::Impl {
  msgpack::sbuffer buf{256};   // a message body is small (msgpack's default start is 8 KiB)
  msgpack::packer<msgpack::sbuffer> pk{buf};
  uint32_t count = 0;
  void key(const char* k) {
    const size_t n = std::strlen(k);
    pk.pack_str(uint32_t(n));
    pk.pack_str_body(k, uint32_t(n));
    count++;
  }
};

BodyWriter::BodyWriter() : impl_(std::make_unique<Impl>()) {}
BodyWriter::~BodyWriter() = default;

void BodyWriter::field(const char* key, bool v, Need) {
  impl_->key(key);
  impl_->pk.pack(v);
}
void BodyWriter::field(const char* key, int32_t v, Need, int64_t, int64_t) {
  impl_->key(key);
  impl_->pk.pack(int64_t(v));
}
void BodyWriter::field(const char* key, int64_t v, Need, int64_t, int64_t) {
  impl_->key(key);
  impl_->pk.pack(v);
}
void BodyWriter::field(const char* key, uint64_t v, Need, uint64_t) {
  impl_->key(key);
  impl_->pk.pack(v);
}
void BodyWriter::field(const char* key, double v, Need, double, double) {
  impl_->key(key);
  impl_->pk.pack(v);
}
void BodyWriter::field(const char* key, const std::string& v, Need, size_t) {
  impl_->key(key);
  impl_->pk.pack_str(uint32_t(v.size()));
  impl_->pk.pack_str_body(v.data(), uint32_t(v.size()));
}
void BodyWriter::bytes(const char* key, const std::string& v, Need, size_t) {
  impl_->key(key);
  impl_->pk.pack_bin(uint32_t(v.size()));
  impl_->pk.pack_bin_body(v.data(), uint32_t(v.size()));
}
void BodyWriter::field(const char* key, const nlohmann::json& v, Need) {
  impl_->key(key);
  const std::vector<uint8_t> b = nlohmann::json::to_msgpack(v);
  impl_->buf.write(reinterpret_cast<const char*>(b.data()), b.size());
}
void BodyWriter::field(const char* key, const std::vector<double>& v, Need, size_t, double, double) {
  impl_->key(key);
  impl_->pk.pack_array(uint32_t(v.size()));
  for (double x : v) impl_->pk.pack(x);
}
void BodyWriter::field(const char* key, const std::vector<int64_t>& v, Need, size_t, int64_t, int64_t) {
  impl_->key(key);
  impl_->pk.pack_array(uint32_t(v.size()));
  for (int64_t x : v) impl_->pk.pack(x);
}
void BodyWriter::field(const char* key, const std::vector<std::string>& v, Need, size_t, size_t) {
  impl_->key(key);
  impl_->pk.pack_array(uint32_t(v.size()));
  for (const auto& s : v) {
    impl_->pk.pack_str(uint32_t(s.size()));
    impl_->pk.pack_str_body(s.data(), uint32_t(s.size()));
  }
}
int BodyWriter::choice(const char* key, const std::vector<const char*>& names, Need, int value) {
  SWARM_CHECK(value >= 0 && size_t(value) < names.size(), "enum value out of range");
  field(key, std::string(names[size_t(value)]));
  return value;
}

std::string BodyWriter::take() {
  // The map's header (msgpack: fixmap, map 16 or map 32 by the count), then the fields.
  const uint32_t n = impl_->count;
  char head[5];
  size_t h = 0;
  if (n < 16) {
    head[h++] = char(0x80 | n);
  } else if (n < 65536) {
    head[h++] = char(0xde);
    head[h++] = char(n >> 8);
    head[h++] = char(n);
  } else {
    head[h++] = char(0xdf);
    for (int shift = 24; shift >= 0; shift -= 8) head[h++] = char(n >> shift);
  }
  std::string out;
  out.reserve(h + impl_->buf.size());
  out.append(head, h);
  out.append(impl_->buf.data(), impl_->buf.size());
  return out;
}

// ---- JSON -----------------------------------------------------------------------------------

std::string pack_json(const nlohmann::json& j) {
  const std::vector<uint8_t> b = nlohmann::json::to_msgpack(j);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

nlohmann::json unpack_json(const std::string& bytes, const char* what) {
  if (bytes.empty()) return nlohmann::json::object();
  msgpack::zone z(zone_chunk(bytes.size()));
  return to_json(unpack_bounded(z, bytes.data(), bytes.size(), what), 0);
}

}  // namespace swarm::wire
