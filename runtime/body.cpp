// body.cpp: implements runtime/body.h: msgpack read where it lies with every size bounded,
// typed field reads with checks, field writes, and the msgpack <-> JSON conversions.
#include "runtime/body.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "runtime/errors.h"
#include "runtime/limits.h"

namespace swarm::wire {

namespace {

constexpr int kMaxDepth = 16;

[[noreturn]] void fail_wire(WireErrc code, const std::string& what) { throw WireError(code, what); }

// ---- msgpack read in place ------------------------------------------------------------------
// A body is read where it lies: one pass records each key and where its value starts, and a
// field's value is decoded when the message asks for it. No object tree, no copy, no allocation
// for a body of up to kInlineFields fields. Every size is checked against runtime/limits.h
// before it is trusted, and nesting against kMaxDepth.

enum class Kind : uint8_t { kNil, kBool, kUint, kInt, kFloat, kStr, kBin, kArray, kMap };

// One msgpack value's header: its kind and scalar, or its bytes (str, bin), or its count of
// entries (array, map; the entries follow the header).
struct Item {
  Kind kind = Kind::kNil;
  bool b = false;
  uint64_t u = 0;    // kUint: a non-negative integer, however it was encoded (as msgpack-c reads it)
  int64_t i = 0;     // kInt: a negative integer
  double f = 0;      // kFloat
  const char* ptr = nullptr;  // kStr, kBin
  uint32_t n = 0;             // kStr, kBin: bytes; kArray, kMap: entries
};

// The whole size of a value that has one by its first byte (0: it depends on what follows).
struct FixedSizes {
  uint8_t size[256] = {};
  constexpr FixedSizes() {
    for (int b = 0; b <= 0x7f; ++b) size[b] = 1;
    for (int b = 0xe0; b <= 0xff; ++b) size[b] = 1;
    size[0xc0] = size[0xc2] = size[0xc3] = 1;
    size[0xcc] = size[0xd0] = 2;
    size[0xcd] = size[0xd1] = 3;
    size[0xce] = size[0xd2] = size[0xca] = 5;
    size[0xcf] = size[0xd3] = size[0xcb] = 9;
  }
  uint8_t operator[](uint8_t b) const { return size[b]; }
};
constexpr FixedSizes kFixedSize{};

class In {
 public:
  In(const char* p, const char* end, const char* what) : p_(p), end_(end), what_(what) {}
  const char* pos() const { return p_; }
  bool done() const { return p_ == end_; }

  // Reads one value's header (and a str's or bin's bytes).
  [[gnu::always_inline]] Item next() {
    const uint8_t b = byte();
    if (b <= 0x7f) return uint_item(b);
    if ((b & 0xe0) == 0xa0) return str(Kind::kStr, b & 0x1f);
    return next_slow(b);
  }

  // Reads a string of up to 31 bytes (a fixstr: every key a writer here writes); false, having
  // read nothing, for anything else.
  [[gnu::always_inline]] bool short_str(std::string_view& out) {
    if (p_ == end_ || (uint8_t(*p_) & 0xe0) != 0xa0) return false;
    const size_t n = uint8_t(*p_) & 0x1f;
    if (size_t(end_ - p_) < 1 + n) truncated();
    out = std::string_view(p_ + 1, n);
    p_ += 1 + n;
    return true;
  }

  // Steps over one whole value; `depth` counts the containers around it (1 in a body).
  void skip(int depth) {
    if (p_ != end_) {
      // A number, nil, a boolean or a short string: its size from its first byte alone.
      const uint8_t b = uint8_t(*p_);
      const size_t n = (b & 0xe0) == 0xa0 ? 1 + (b & 0x1f) : kFixedSize[b];
      if (n > 0) {
        if (size_t(end_ - p_) < n) truncated();
        p_ += n;
        return;
      }
    }
    const Item it = next();
    if (it.kind != Kind::kArray && it.kind != Kind::kMap) return;
    if (depth >= kMaxDepth) fail_wire(WireErrc::kTooLarge, std::string(what_) + " is nested too deeply");
    const uint64_t values = it.kind == Kind::kMap ? 2 * uint64_t(it.n) : it.n;
    for (uint64_t k = 0; k < values; ++k) skip(depth + 1);
  }

 private:

  Item next_slow(uint8_t b) {
    Item it;
    if (b >= 0xe0) return int_item(int8_t(b));
    if (b >= 0xa0 && b <= 0xbf) return str(Kind::kStr, b & 0x1f);
    if (b >= 0x90 && b <= 0x9f) return container(Kind::kArray, b & 0x0f);
    if (b >= 0x80 && b <= 0x8f) return container(Kind::kMap, b & 0x0f);
    switch (b) {
      case 0xc0: return it;
      case 0xc2: case 0xc3: it.kind = Kind::kBool; it.b = b == 0xc3; return it;
      case 0xcc: return uint_item(be(1));
      case 0xcd: return uint_item(be(2));
      case 0xce: return uint_item(be(4));
      case 0xcf: return uint_item(be(8));
      case 0xd0: return int_item(int8_t(be(1)));
      case 0xd1: return int_item(int16_t(be(2)));
      case 0xd2: return int_item(int32_t(be(4)));
      case 0xd3: return int_item(int64_t(be(8)));
      case 0xca: {
        const uint32_t bits = uint32_t(be(4));
        float x;
        std::memcpy(&x, &bits, 4);
        it.kind = Kind::kFloat;
        it.f = x;
        return it;
      }
      case 0xcb: {
        const uint64_t bits = be(8);
        std::memcpy(&it.f, &bits, 8);
        it.kind = Kind::kFloat;
        return it;
      }
      case 0xd9: return str(Kind::kStr, be(1));
      case 0xda: return str(Kind::kStr, be(2));
      case 0xdb: return str(Kind::kStr, be(4));
      case 0xc4: return str(Kind::kBin, be(1));
      case 0xc5: return str(Kind::kBin, be(2));
      case 0xc6: return str(Kind::kBin, be(4));
      case 0xdc: return container(Kind::kArray, be(2));
      case 0xdd: return container(Kind::kArray, be(4));
      case 0xde: return container(Kind::kMap, be(2));
      case 0xdf: return container(Kind::kMap, be(4));
      case 0xc1: fail_wire(WireErrc::kMalformed, std::string(what_) + " is not valid msgpack (byte 0xc1)");
      default: fail_wire(WireErrc::kMalformed, std::string(what_) + " holds a msgpack ext value, which no message uses");
    }
  }

  uint8_t byte() {
    if (p_ == end_) truncated();
    return uint8_t(*p_++);
  }
  uint64_t be(int bytes) {
    if (end_ - p_ < bytes) truncated();
    uint64_t v = 0;
    for (int k = 0; k < bytes; ++k) v = (v << 8) | uint8_t(p_[k]);
    p_ += bytes;
    return v;
  }
  [[gnu::always_inline]] static Item uint_item(uint64_t v) {
    Item it;
    it.kind = Kind::kUint;
    it.u = v;
    return it;
  }
  static Item int_item(int64_t v) {
    if (v >= 0) return uint_item(uint64_t(v));
    Item it;
    it.kind = Kind::kInt;
    it.i = v;
    return it;
  }
  Item str(Kind kind, uint64_t n) {
    const size_t limit = kind == Kind::kStr ? limits::kMaxStringBytes : limits::kMaxBinBytes;
    if (n > limit)
      fail_wire(WireErrc::kTooLarge, std::string(what_) + ": a " + (kind == Kind::kStr ? "string" : "bin") + " of " +
                                         std::to_string(n) + " bytes is over the limit of " + std::to_string(limit));
    if (uint64_t(end_ - p_) < n) truncated();
    Item it;
    it.kind = kind;
    it.ptr = p_;
    it.n = uint32_t(n);
    p_ += n;
    return it;
  }
  Item container(Kind kind, uint64_t n) {
    const size_t limit = kind == Kind::kArray ? limits::kMaxArrayEntries : limits::kMaxMapEntries;
    if (n > limit)
      fail_wire(WireErrc::kTooLarge, std::string(what_) + ": " + (kind == Kind::kArray ? "an array" : "a map") + " of " +
                                         std::to_string(n) + " entries is over the limit of " + std::to_string(limit));
    // Every entry takes at least a byte: a count the bytes cannot hold is a truncation, found now.
    if (uint64_t(end_ - p_) < (kind == Kind::kMap ? 2 * n : n)) truncated();
    Item it;
    it.kind = kind;
    it.n = uint32_t(n);
    return it;
  }
  [[noreturn]] void truncated() const { fail_wire(WireErrc::kTruncated, std::string(what_) + " is truncated"); }

  const char* p_;
  const char* end_;
  const char* what_;
};

nlohmann::json to_json(In& in, int depth) {
  const Item it = in.next();
  switch (it.kind) {
    case Kind::kNil: return nullptr;
    case Kind::kBool: return it.b;
    case Kind::kUint: return it.u;
    case Kind::kInt: return it.i;
    case Kind::kFloat: return it.f;
    case Kind::kStr: return std::string(it.ptr, it.n);
    case Kind::kBin: return nlohmann::json::binary(std::vector<uint8_t>(it.ptr, it.ptr + it.n));
    case Kind::kArray: {
      if (depth >= kMaxDepth) fail_wire(WireErrc::kTooLarge, "msgpack nested deeper than " + std::to_string(kMaxDepth));
      nlohmann::json a = nlohmann::json::array();
      for (uint32_t k = 0; k < it.n; ++k) a.push_back(to_json(in, depth + 1));
      return a;
    }
    case Kind::kMap: {
      if (depth >= kMaxDepth) fail_wire(WireErrc::kTooLarge, "msgpack nested deeper than " + std::to_string(kMaxDepth));
      nlohmann::json m = nlohmann::json::object();
      for (uint32_t k = 0; k < it.n; ++k) {
        const Item key = in.next();
        if (key.kind != Kind::kStr) fail_wire(WireErrc::kMalformed, "map key is not a string");
        m[std::string(key.ptr, key.n)] = to_json(in, depth + 1);
      }
      return m;
    }
  }
  return nullptr;
}

std::string num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string type_text(const Item& o) {
  switch (o.kind) {
    case Kind::kNil: return "nil";
    case Kind::kBool: return o.b ? "true" : "false";
    case Kind::kUint: return std::to_string(o.u);
    case Kind::kInt: return std::to_string(o.i);
    case Kind::kFloat: return num(o.f);
    case Kind::kStr: {
      std::string s(o.ptr, std::min<uint32_t>(o.n, 32));
      for (char& c : s)
        if (c < 0x20 || c >= 0x7f) c = '?';
      return "\"" + s + (o.n > 32 ? "...\"" : "\"");
    }
    case Kind::kBin: return "binary (" + std::to_string(o.n) + " bytes)";
    case Kind::kArray: return "an array";
    case Kind::kMap: return "a map";
  }
  return "?";
}

// A number of any msgpack encoding as a double; NaN for anything else.
double as_double(const Item& e) {
  if (e.kind == Kind::kFloat) return e.f;
  if (e.kind == Kind::kUint) return double(e.u);
  if (e.kind == Kind::kInt) return double(e.i);
  return NAN;
}

// An integer within int64_t, or false.
bool as_int64(const Item& e, int64_t& x) {
  if (e.kind == Kind::kUint && e.u <= uint64_t(kIntMax)) x = int64_t(e.u);
  else if (e.kind == Kind::kInt) x = e.i;
  else return false;
  return true;
}

}  // namespace

// ---- reader ---------------------------------------------------------------------------------

BodyReader::BodyReader(const std::string& bytes, const char* what) : what_(what), fields_(inline_) {
  if (bytes.empty()) return;
  In in(bytes.data(), bytes.data() + bytes.size(), what);
  const Item map = in.next();
  if (map.kind != Kind::kMap) fail_wire(WireErrc::kMalformed, std::string(what) + ": the body is not a map");
  if (map.n > kInlineFields) {
    more_.resize(map.n);
    fields_ = more_.data();
  }
  bool sorted = true;
  for (uint32_t k = 0; k < map.n; ++k) {
    Field& f = fields_[k];
    if (!in.short_str(f.key)) {
      const Item key = in.next();
      if (key.kind != Kind::kStr) fail_wire(WireErrc::kMalformed, std::string(what) + ": a body key is not a string");
      f.key = std::string_view(key.ptr, key.n);
    }
    f.value = in.pos();
    in.skip(1);
    f.end = in.pos();
    if (k > 0 && sorted) {
      const std::string_view prev = fields_[k - 1].key;
      const bool before = !prev.empty() && !f.key.empty() && prev[0] != f.key[0] ? uint8_t(prev[0]) < uint8_t(f.key[0]) : prev < f.key;
      if (!before) sorted = false;
    }
  }
  n_ = map.n;
  if (!in.done()) fail_wire(WireErrc::kMalformed, std::string(what) + " has trailing bytes");
  // Each key once: a body that says a field twice means two things to two readers. Writers put
  // their keys in order, so that is one comparison a key; any other order is sorted to check.
  if (!sorted) {
    std::vector<std::string_view> keys(n_);
    for (size_t k = 0; k < n_; ++k) keys[k] = fields_[k].key;
    std::sort(keys.begin(), keys.end());
    for (size_t k = 1; k < n_; ++k)
      if (keys[k] == keys[k - 1])
        fail_wire(WireErrc::kMalformed, std::string(what) + ": the key \"" + std::string(keys[k].substr(0, 64)) + "\" appears twice");
  }
}

BodyReader::~BodyReader() = default;

// Fields are asked for in the order writers write them, so the one after the last found is tried
// first. nil reads as absent.
namespace {
// Whether a body's key is the field name `key`: the lengths, then the bytes eight or four at a
// time (the last word overlapping the one before it).
template <class Word>
[[gnu::always_inline]] inline bool same_words(const char* a, const char* b, size_t n) {
  Word x, y;
  for (size_t i = 0; i + sizeof(Word) < n; i += sizeof(Word)) {
    std::memcpy(&x, a + i, sizeof(Word));
    std::memcpy(&y, b + i, sizeof(Word));
    if (x != y) return false;
  }
  std::memcpy(&x, a + n - sizeof(Word), sizeof(Word));
  std::memcpy(&y, b + n - sizeof(Word), sizeof(Word));
  return x == y;
}

[[gnu::always_inline]] inline bool key_is(std::string_view k, Key key) {
  if (k.size() != key.n) return false;
  if (key.n >= 8) return same_words<uint64_t>(k.data(), key.s, key.n);
  if (key.n >= 4) return same_words<uint32_t>(k.data(), key.s, key.n);
  for (size_t i = 0; i < key.n; ++i)
    if (k[i] != key.s[i]) return false;
  return true;
}
}  // namespace

inline const BodyReader::Field* BodyReader::present(size_t i) const {
  return uint8_t(*fields_[i].value) == 0xc0 ? nullptr : &fields_[i];
}

[[gnu::always_inline]] inline const BodyReader::Field* BodyReader::find(Key key) const {
  if (next_ < n_ && key_is(fields_[next_].key, key)) return present(next_++);
  return find_anywhere(key);
}

const BodyReader::Field* BodyReader::find_anywhere(Key key) const {
  for (size_t i = 0; i < n_; ++i)
    if (key_is(fields_[i].key, key)) {
      next_ = i + 1;
      return present(i);
    }
  return nullptr;
}

bool BodyReader::has(Key key) const {
  const Field* f = find(key);
  if (f) next_ = size_t(f - fields_);   // the read that follows finds it first
  return f != nullptr;
}

void BodyReader::fail(Key key, const std::string& what) const {
  throw WireError(WireErrc::kMalformed, std::string(what_) + "." + key.s + " " + what);
}

// The field's value, or return when it is absent and optional.
#define SWARM_FIND(key, need)                                      \
  const Field* f = find(key);                                      \
  if (!f) {                                                        \
    if ((need) == kOptional) return;                               \
    fail(key, "is missing");                                       \
  }                                                                \
  In in(f->value, f->end, what_);                                  \
  const Item o = in.next();

void BodyReader::field(Key key, bool& v, Need need) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kBool) fail(key, "must be true or false, got " + type_text(o));
  v = o.b;
}

void BodyReader::field(Key key, int64_t& v, Need need, int64_t lo, int64_t hi) {
  SWARM_FIND(key, need);
  int64_t x = 0;
  if (!as_int64(o, x) || x < lo || x > hi)
    fail(key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + type_text(o));
  v = x;
}

void BodyReader::field(Key key, int32_t& v, Need need, int64_t lo, int64_t hi) {
  int64_t x = v;
  field(key, x, need, std::max<int64_t>(lo, INT32_MIN), std::min<int64_t>(hi, INT32_MAX));
  v = int32_t(x);
}

void BodyReader::field(Key key, uint64_t& v, Need need, uint64_t hi) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kUint || o.u > hi)
    fail(key, "must be an unsigned integer up to " + std::to_string(hi) + ", got " + type_text(o));
  v = o.u;
}

void BodyReader::field(Key key, double& v, Need need, double lo, double hi) {
  SWARM_FIND(key, need);
  const double x = as_double(o);
  if (!std::isfinite(x) || x < lo || x > hi) fail(key, "must be a number in [" + num(lo) + ", " + num(hi) + "], got " + type_text(o));
  v = x;
}

void BodyReader::field(Key key, std::string& v, Need need, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kStr) fail(key, "must be a string, got " + type_text(o));
  if (o.n > max_bytes) fail(key, "is " + std::to_string(o.n) + " bytes, over the limit of " + std::to_string(max_bytes));
  v.assign(o.ptr, o.n);
}

void BodyReader::bytes(Key key, std::string& v, Need need, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kBin) fail(key, "must be binary (msgpack bin), got " + type_text(o));
  if (o.n > max_bytes) fail(key, "is " + std::to_string(o.n) + " bytes, over the limit of " + std::to_string(max_bytes));
  v.assign(o.ptr, o.n);
}

bool BodyReader::text_or_bytes(Key key, std::string& v, Need need, size_t max_bytes, bool fallback) {
  if (!has(key)) {
    if (need == kOptional) return fallback;
    fail(key, "is missing");
  }
  if (uint8_t(*fields_[next_].value) - 0xc4u <= 2u) {   // bin 8, 16 or 32
    bytes(key, v, need, max_bytes);
    return true;
  }
  field(key, v, need, max_bytes);
  return false;
}

void BodyReader::field(Key key, nlohmann::json& v, Need need) {
  const Field* f = find(key);
  if (!f) {
    if (need == kOptional) return;
    fail(key, "is missing");
  }
  In in(f->value, f->end, what_);
  v = to_json(in, 1);
}

void BodyReader::field(Key key, std::vector<double>& v, Need need, size_t max_n, double lo, double hi) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kArray || o.n > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " numbers, got " + type_text(o));
  std::vector<double> out;
  out.reserve(o.n);
  for (uint32_t i = 0; i < o.n; ++i) {
    const Item e = in.next();
    const double x = as_double(e);
    if (!std::isfinite(x) || x < lo || x > hi)
      fail(key, "entry " + std::to_string(i) + " must be a number in [" + num(lo) + ", " + num(hi) + "], got " + type_text(e));
    out.push_back(x);
  }
  v = std::move(out);
}

void BodyReader::field(Key key, std::vector<int64_t>& v, Need need, size_t max_n, int64_t lo, int64_t hi) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kArray || o.n > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " integers, got " + type_text(o));
  std::vector<int64_t> out;
  out.reserve(o.n);
  for (uint32_t i = 0; i < o.n; ++i) {
    const Item e = in.next();
    int64_t x = 0;
    if (!as_int64(e, x) || x < lo || x > hi)
      fail(key, "entry " + std::to_string(i) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + type_text(e));
    out.push_back(x);
  }
  v = std::move(out);
}

void BodyReader::field(Key key, std::vector<std::string>& v, Need need, size_t max_n, size_t max_bytes) {
  SWARM_FIND(key, need);
  if (o.kind != Kind::kArray || o.n > max_n)
    fail(key, "must be an array of at most " + std::to_string(max_n) + " strings, got " + type_text(o));
  std::vector<std::string> out;
  out.reserve(o.n);
  for (uint32_t i = 0; i < o.n; ++i) {
    const Item e = in.next();
    if (e.kind != Kind::kStr || e.n > max_bytes)
      fail(key, "entry " + std::to_string(i) + " must be a string of at most " + std::to_string(max_bytes) + " bytes, got " + type_text(e));
    out.emplace_back(e.ptr, e.n);
  }
  v = std::move(out);
}

#undef SWARM_FIND

int BodyReader::choice(Key key, const std::vector<const char*>& names, Need need, int fallback) {
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
// Straight into the string take() returns: each value in msgpack's smallest encoding for it, as
// msgpack-c packs it. Each put_* writes at `p` (room made before) and returns where it ended.

namespace {

char* put_be(char* p, uint8_t head, uint64_t v, int bytes) {
  *p++ = char(head);
  for (int k = bytes - 1; k >= 0; --k) *p++ = char(v >> (8 * k));
  return p;
}

char* put_uint(char* p, uint64_t v) {
  if (v < 0x80) {
    *p++ = char(v);
    return p;
  }
  if (v <= 0xff) return put_be(p, 0xcc, v, 1);
  if (v <= 0xffff) return put_be(p, 0xcd, v, 2);
  if (v <= 0xffffffffu) return put_be(p, 0xce, v, 4);
  return put_be(p, 0xcf, v, 8);
}

char* put_int(char* p, int64_t v) {
  if (v >= 0) return put_uint(p, uint64_t(v));
  if (v >= -32) {
    *p++ = char(int8_t(v));
    return p;
  }
  if (v >= INT8_MIN) return put_be(p, 0xd0, uint64_t(v), 1);
  if (v >= INT16_MIN) return put_be(p, 0xd1, uint64_t(v), 2);
  if (v >= INT32_MIN) return put_be(p, 0xd2, uint64_t(v), 4);
  return put_be(p, 0xd3, uint64_t(v), 8);
}

// A whole number goes as an integer, as msgpack-c packs it (readers of a number take either).
char* put_double(char* p, double v) {
  if (v >= 0 && v < 18446744073709551616.0 && v == double(uint64_t(v))) return put_uint(p, uint64_t(v));
  if (v < 0 && v >= -9223372036854775808.0 && v == double(int64_t(v))) return put_int(p, int64_t(v));
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  return put_be(p, 0xcb, bits, 8);
}

char* put_count(char* p, uint8_t fix, uint8_t b16, size_t n) {   // an array's or a map's header
  if (n < 16) {
    *p++ = char(fix | n);
    return p;
  }
  if (n <= 0xffff) return put_be(p, b16, n, 2);
  return put_be(p, uint8_t(b16 + 1), n, 4);
}

char* put_str(char* p, const char* s, size_t n) {
  if (n < 32) *p++ = char(0xa0 | n);
  else if (n <= 0xff) p = put_be(p, 0xd9, n, 1);
  else if (n <= 0xffff) p = put_be(p, 0xda, n, 2);
  else p = put_be(p, 0xdb, n, 4);
  std::memcpy(p, s, n);
  return p + n;
}

char* put_bin(char* p, const char* s, size_t n) {
  if (n <= 0xff) p = put_be(p, 0xc4, n, 1);
  else if (n <= 0xffff) p = put_be(p, 0xc5, n, 2);
  else p = put_be(p, 0xc6, n, 4);
  std::memcpy(p, s, n);
  return p + n;
}

constexpr size_t kHead = 9;   // the most a header or a number takes

}  // namespace

BodyWriter::BodyWriter() : buf_(128, '\0'), used_(1) {}

char* BodyWriter::room(size_t n) {
  if (buf_.size() - used_ < n) buf_.resize(std::max(2 * buf_.size(), used_ + n));
  return &buf_[used_];
}

void BodyWriter::done(const char* end) { used_ = size_t(end - buf_.data()); }

// The key, with room after it for `value` more bytes.
char* BodyWriter::key(Key k, size_t value) {
  count_++;
  return put_str(room(kHead + k.n + value), k.s, k.n);
}

void BodyWriter::field(Key k, bool v, Need) {
  char* p = key(k, 1);
  *p++ = char(v ? 0xc3 : 0xc2);
  done(p);
}
void BodyWriter::field(Key k, int32_t v, Need, int64_t, int64_t) { done(put_int(key(k, kHead), v)); }
void BodyWriter::field(Key k, int64_t v, Need, int64_t, int64_t) { done(put_int(key(k, kHead), v)); }
void BodyWriter::field(Key k, uint64_t v, Need, uint64_t) { done(put_uint(key(k, kHead), v)); }
void BodyWriter::field(Key k, double v, Need, double, double) { done(put_double(key(k, kHead), v)); }
void BodyWriter::field(Key k, const std::string& v, Need, size_t) {
  done(put_str(key(k, kHead + v.size()), v.data(), v.size()));
}
void BodyWriter::bytes(Key k, const std::string& v, Need, size_t) {
  done(put_bin(key(k, kHead + v.size()), v.data(), v.size()));
}
void BodyWriter::field(Key k, const nlohmann::json& v, Need) {
  const std::vector<uint8_t> b = nlohmann::json::to_msgpack(v);
  char* p = key(k, b.size());
  std::memcpy(p, b.data(), b.size());
  done(p + b.size());
}
void BodyWriter::field(Key k, const std::vector<double>& v, Need, size_t, double, double) {
  char* p = put_count(key(k, kHead * (1 + v.size())), 0x90, 0xdc, v.size());
  for (double x : v) p = put_double(p, x);
  done(p);
}
void BodyWriter::field(Key k, const std::vector<int64_t>& v, Need, size_t, int64_t, int64_t) {
  char* p = put_count(key(k, kHead * (1 + v.size())), 0x90, 0xdc, v.size());
  for (int64_t x : v) p = put_int(p, x);
  done(p);
}
void BodyWriter::field(Key k, const std::vector<std::string>& v, Need, size_t, size_t) {
  size_t bytes = kHead;
  for (const auto& s : v) bytes += kHead + s.size();
  char* p = put_count(key(k, bytes), 0x90, 0xdc, v.size());
  for (const auto& s : v) p = put_str(p, s.data(), s.size());
  done(p);
}
int BodyWriter::choice(Key k, const std::vector<const char*>& names, Need, int value) {
  SWARM_CHECK(value >= 0 && size_t(value) < names.size(), "enum value out of range");
  const char* name = names[size_t(value)];
  const size_t n = std::strlen(name);
  done(put_str(key(k, kHead + n), name, n));
  return value;
}

std::string BodyWriter::take() {
  // The map's header (fixmap, map 16 or map 32 by the count) in the byte kept for it, or, past 15
  // fields, in front of it.
  buf_.resize(used_);
  if (count_ < 16) {
    buf_[0] = char(0x80 | count_);
  } else {
    char head[kHead];
    buf_.replace(0, 1, head, size_t(put_count(head, 0x80, 0xde, count_) - head));
  }
  std::string out = std::move(buf_);
  buf_.assign(128, '\0');
  used_ = 1;
  count_ = 0;
  return out;
}

// ---- JSON -----------------------------------------------------------------------------------

std::string pack_json(const nlohmann::json& j) {
  const std::vector<uint8_t> b = nlohmann::json::to_msgpack(j);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

nlohmann::json unpack_json(const std::string& bytes, const char* what) {
  if (bytes.empty()) return nlohmann::json::object();
  In in(bytes.data(), bytes.data() + bytes.size(), what);
  nlohmann::json j = to_json(in, 0);
  if (!in.done()) fail_wire(WireErrc::kMalformed, std::string(what) + " has trailing bytes");
  return j;
}

}  // namespace swarm::wire
