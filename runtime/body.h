// body.h: message bodies as typed structs, field by field, straight from and to msgpack.
//
// Defines swarm::wire::BodyReader and BodyWriter, the two visitors a message struct's
// `visit(V&)` (runtime/messages.h) is run with, and the bounded msgpack <-> JSON conversions for
// the few fields that carry free-form JSON (a job spec, a fault, a status). A reader checks
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
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm::wire {

enum class Need { kRequired, kOptional };
constexpr Need kRequired = Need::kRequired;
constexpr Need kOptional = Need::kOptional;

constexpr int64_t kIntMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kIntMax = std::numeric_limits<int64_t>::max();
constexpr uint64_t kUintMax = std::numeric_limits<uint64_t>::max();

class BodyReader {
 public:
  // `bytes`: a msgpack map (empty string: the empty map); `what`: the message's name, for errors.
  BodyReader(const std::string& bytes, const char* what);
  ~BodyReader();
  BodyReader(const BodyReader&) = delete;
  BodyReader& operator=(const BodyReader&) = delete;

  bool has(const char* key) const;
  void field(const char* key, bool& v, Need need = kRequired);
  void field(const char* key, int32_t& v, Need need, int64_t lo, int64_t hi);
  void field(const char* key, int64_t& v, Need need, int64_t lo = kIntMin, int64_t hi = kIntMax);
  void field(const char* key, uint64_t& v, Need need, uint64_t hi = kUintMax);
  void field(const char* key, double& v, Need need, double lo, double hi);   // finite, in [lo, hi]
  void field(const char* key, std::string& v, Need need, size_t max_bytes);
  void bytes(const char* key, std::string& v, Need need, size_t max_bytes);  // msgpack bin
  void bytes(const char* key, std::optional<std::string>& v, Need, size_t max_bytes) {
    if (!has(key)) return;
    std::string t;
    bytes(key, t, kRequired, max_bytes);
    v = std::move(t);
  }
  // A msgpack str or bin (a name, or a routing id); returns whether it was bin.
  bool text_or_bytes(const char* key, std::string& v, Need need, size_t max_bytes, bool fallback);
  // Any value (map, array, string, number...), converted with the decoder's limits.
  void field(const char* key, nlohmann::json& v, Need need = kRequired);
  void field(const char* key, std::vector<double>& v, Need need, size_t max_n, double lo, double hi);
  void field(const char* key, std::vector<int64_t>& v, Need need, size_t max_n, int64_t lo, int64_t hi);
  void field(const char* key, std::vector<std::string>& v, Need need, size_t max_n, size_t max_bytes);
  // An optional field with no default: set only when present (and then checked like the rest).
  template <class T, class... Args>
  void field(const char* key, std::optional<T>& v, Need, Args... args) {
    if (!has(key)) return;
    T t{};
    field(key, t, kRequired, args...);
    v = std::move(t);
  }
  // A string field whose value must be one of `names` (an enum on the wire); returns its index.
  int choice(const char* key, const std::vector<const char*>& names, Need need, int fallback);

  [[noreturn]] void fail(const char* key, const std::string& what) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class BodyWriter {
 public:
  BodyWriter();
  ~BodyWriter();
  BodyWriter(const BodyWriter&) = delete;
  BodyWriter& operator=(const BodyWriter&) = delete;

  void field(const char* key, bool v, Need = kRequired);
  void field(const char* key, int32_t v, Need = kRequired, int64_t = 0, int64_t = 0);
  void field(const char* key, int64_t v, Need = kRequired, int64_t = 0, int64_t = 0);
  void field(const char* key, uint64_t v, Need = kRequired, uint64_t = 0);
  void field(const char* key, double v, Need = kRequired, double = 0, double = 0);
  void field(const char* key, const std::string& v, Need = kRequired, size_t = 0);
  void bytes(const char* key, const std::string& v, Need = kRequired, size_t = 0);
  void bytes(const char* key, const std::optional<std::string>& v, Need, size_t = 0) {
    if (v) bytes(key, *v);
  }
  bool text_or_bytes(const char* key, const std::string& v, Need, size_t, bool as_bytes) {
    if (as_bytes) bytes(key, v);
    else field(key, v);
    return as_bytes;
  }
  void field(const char* key, const nlohmann::json& v, Need = kRequired);
  void field(const char* key, const std::vector<double>& v, Need = kRequired, size_t = 0, double = 0, double = 0);
  void field(const char* key, const std::vector<int64_t>& v, Need = kRequired, size_t = 0, int64_t = 0, int64_t = 0);
  void field(const char* key, const std::vector<std::string>& v, Need = kRequired, size_t = 0, size_t = 0);
  template <class T, class... Args>
  void field(const char* key, const std::optional<T>& v, Need, Args... args) {
    if (v) field(key, *v, kRequired, args...);
  }
  int choice(const char* key, const std::vector<const char*>& names, Need, int value);

  // The map: a header with the number of fields written, then the fields in write order.
  std::string take();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// msgpack bytes of any JSON value, and back (with the decoder's limits: nesting depth 16,
// string, array, map and bin sizes of runtime/limits.h; throws WireError).
std::string pack_json(const nlohmann::json& j);
nlohmann::json unpack_json(const std::string& bytes, const char* what);

}  // namespace swarm::wire
