// body.h: message bodies as typed structs, field by field, straight from and to msgpack.
//
// Defines swarm::wire::BodyReader and BodyWriter, the two visitors a message struct's
// `visit(V&)` (runtime/messages.h) is run with, and the bounded msgpack <-> JSON conversions for
// the few fields that carry free-form JSON (a job spec, a fault, a status). A reader reads the
// body where it lies (no object tree, no copy) and refuses a key said twice. It checks
// every field as it reads it: its msgpack type (an integer field takes no float, a string field
// no bin), its range, its length; a required field that is missing, or any field that fails,
// throws WireError(kMalformed) naming the message and the field ("RESULT.compute_ms must be a
// number in [0, 1e+07], got \"x\""). Unknown keys are ignored (a newer peer may add fields);
// nil reads as absent. Nothing here includes msgpack's headers, so message structs stay cheap
// to include.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm::wire {

enum class Need { kRequired, kOptional };
constexpr Need kRequired = Need::kRequired;
constexpr Need kOptional = Need::kOptional;

constexpr int64_t kIntMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kIntMax = std::numeric_limits<int64_t>::max();
constexpr uint64_t kUintMax = std::numeric_limits<uint64_t>::max();

// A field's name: a string literal, its length counted where it is written.
struct Key {
  template <size_t N>
  constexpr Key(const char (&k)[N]) : s(k), n(N - 1) {}   // NOLINT: implicit, from a literal
  const char* s;
  size_t n;
};

class BodyReader {
 public:
  // `bytes`: a msgpack map (empty string: the empty map); `what`: the message's name, for errors.
  // The reader reads `bytes` where they lie: they must outlive it.
  BodyReader(const std::string& bytes, const char* what);
  BodyReader(std::string&&, const char*) = delete;
  ~BodyReader();
  BodyReader(const BodyReader&) = delete;
  BodyReader& operator=(const BodyReader&) = delete;

  bool has(Key key) const;
  void field(Key key, bool& v, Need need = kRequired);
  void field(Key key, int32_t& v, Need need, int64_t lo, int64_t hi);
  void field(Key key, int64_t& v, Need need, int64_t lo = kIntMin, int64_t hi = kIntMax);
  void field(Key key, uint64_t& v, Need need, uint64_t hi = kUintMax);
  void field(Key key, double& v, Need need, double lo, double hi);   // finite, in [lo, hi]
  void field(Key key, std::string& v, Need need, size_t max_bytes);
  void bytes(Key key, std::string& v, Need need, size_t max_bytes);  // msgpack bin
  void bytes(Key key, std::optional<std::string>& v, Need, size_t max_bytes) {
    if (!has(key)) return;
    std::string t;
    bytes(key, t, kRequired, max_bytes);
    v = std::move(t);
  }
  // A msgpack str or bin (a name, or a routing id); returns whether it was bin.
  bool text_or_bytes(Key key, std::string& v, Need need, size_t max_bytes, bool fallback);
  // Any value (map, array, string, number...), converted with the decoder's limits.
  void field(Key key, nlohmann::json& v, Need need = kRequired);
  void field(Key key, std::vector<double>& v, Need need, size_t max_n, double lo, double hi);
  void field(Key key, std::vector<int64_t>& v, Need need, size_t max_n, int64_t lo, int64_t hi);
  void field(Key key, std::vector<std::string>& v, Need need, size_t max_n, size_t max_bytes);
  // An optional field with no default: set only when present (and then checked like the rest).
  template <class T, class... Args>
  void field(Key key, std::optional<T>& v, Need, Args... args) {
    if (!has(key)) return;
    T t{};
    field(key, t, kRequired, args...);
    v = std::move(t);
  }
  // A string field whose value must be one of `names` (an enum on the wire); returns its index.
  int choice(Key key, const std::vector<const char*>& names, Need need, int fallback);

  [[noreturn]] void fail(Key key, const std::string& what) const;

 private:
  // A key and where its value lies in the body's bytes (which the reader's owner keeps alive).
  struct Field {
    std::string_view key;
    const char* value;
    const char* end;
  };
  static constexpr size_t kInlineFields = 24;   // more than any message type has

  const Field* find(Key key) const;
  const Field* find_anywhere(Key key) const;
  const Field* present(size_t i) const;

  const char* what_;
  Field inline_[kInlineFields];
  std::vector<Field> more_;
  Field* fields_;
  size_t n_ = 0;
  mutable size_t next_ = 0;   // where the next field asked for is looked for first
};

class BodyWriter {
 public:
  BodyWriter();
  BodyWriter(const BodyWriter&) = delete;
  BodyWriter& operator=(const BodyWriter&) = delete;

  void field(Key key, bool v, Need = kRequired);
  void field(Key key, int32_t v, Need = kRequired, int64_t = 0, int64_t = 0);
  void field(Key key, int64_t v, Need = kRequired, int64_t = 0, int64_t = 0);
  void field(Key key, uint64_t v, Need = kRequired, uint64_t = 0);
  void field(Key key, double v, Need = kRequired, double = 0, double = 0);
  void field(Key key, const std::string& v, Need = kRequired, size_t = 0);
  void bytes(Key key, const std::string& v, Need = kRequired, size_t = 0);
  void bytes(Key key, const std::optional<std::string>& v, Need, size_t = 0) {
    if (v) bytes(key, *v);
  }
  bool text_or_bytes(Key key, const std::string& v, Need, size_t, bool as_bytes) {
    if (as_bytes) bytes(key, v);
    else field(key, v);
    return as_bytes;
  }
  void field(Key key, const nlohmann::json& v, Need = kRequired);
  void field(Key key, const std::vector<double>& v, Need = kRequired, size_t = 0, double = 0, double = 0);
  void field(Key key, const std::vector<int64_t>& v, Need = kRequired, size_t = 0, int64_t = 0, int64_t = 0);
  void field(Key key, const std::vector<std::string>& v, Need = kRequired, size_t = 0, size_t = 0);
  template <class T, class... Args>
  void field(Key key, const std::optional<T>& v, Need, Args... args) {
    if (v) field(key, *v, kRequired, args...);
  }
  int choice(Key key, const std::vector<const char*>& names, Need, int value);

  // The map: a header with the number of fields written, then the fields in write order.
  std::string take();

 private:
  char* room(size_t n);                 // where the next n bytes go
  void done(const char* end);           // they went up to `end`
  char* key(Key k, size_t value);

  std::string buf_;     // one byte kept for the map's header, then the fields; used_ bytes of it
  size_t used_;
  uint32_t count_ = 0;
};

// msgpack bytes of any JSON value, and back (with the decoder's limits: nesting depth 16,
// string, array, map and bin sizes of runtime/limits.h; throws WireError).
std::string pack_json(const nlohmann::json& j);
nlohmann::json unpack_json(const std::string& bytes, const char* what);

}  // namespace swarm::wire
