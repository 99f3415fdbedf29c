// messages.cpp: the parts of runtime/messages.h that are not field lists: the transport
// benchmark's checked parameters and ERROR replies.
#include "runtime/messages.h"

#include "runtime/text.h"

namespace swarm::msg {

BenchTransport Submit::bench() const {
  auto bad = [](const std::string& what) -> WireError {
    return WireError(WireErrc::kMalformed, "SUBMIT.bench_transport " + what);
  };
  if (!bench_transport || !bench_transport->is_object()) throw bad("must be a map {bytes, count, inflight?}");
  const nlohmann::json& b = *bench_transport;
  auto integer = [&](const char* key, int64_t lo, int64_t hi, std::optional<int64_t> fallback) -> int64_t {
    auto it = b.find(key);
    if (it == b.end()) {
      if (fallback) return *fallback;
      throw bad(std::string("needs '") + key + "'");
    }
    if (!it->is_number_integer() || it->get<int64_t>() < lo || it->get<int64_t>() > hi)
      throw bad(std::string("'") + key + "' must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + shown_json(*it));
    return it->get<int64_t>();
  };
  BenchTransport t;
  t.bytes = integer("bytes", 4, int64_t(limits::kMaxTensorBytes), std::nullopt);
  t.count = integer("count", 1, limits::kMaxBenchCount, std::nullopt);
  t.inflight = int32_t(integer("inflight", 1, limits::kMaxInflight, 8));
  return t;
}

namespace {
wire::Message error_message(uint64_t id, uint32_t attempt, WireErrc code, const std::string& text, std::optional<int32_t> type) {
  Error e;
  e.code = int32_t(code);
  e.name = wire_errc_name(code);
  e.message = text.size() > 8192 ? text.substr(0, 8192) : text;
  e.request_type = type;
  return make(e, id, attempt);
}
}  // namespace

wire::Message error_reply(uint64_t id, uint32_t attempt, WireErrc code, const std::string& text) {
  return error_message(id, attempt, code, text, std::nullopt);
}

wire::Message error_reply(const wire::Message* req, WireErrc code, const std::string& text) {
  if (!req) return error_message(0, 0, code, text, std::nullopt);
  return error_message(req->id, req->attempt, code, text, int32_t(req->type));
}

}  // namespace swarm::msg
