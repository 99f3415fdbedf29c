// client.h: a CLI's session with a router (HELLO, then request/reply).
//
// Defines swarm::Client. Used by `swarm submit/status/peers/cancel` and the benchmarks. A
// router that does not answer within the timeout gives a RouterUnreachable error that says
// what to check, instead of a hang.
#pragma once

#include <memory>
#include <string>

#include "runtime/errors.h"
#include "runtime/parts.h"
#include "runtime/wire.h"

namespace swarm {

class RouterUnreachable : public InputError {
 public:
  using InputError::InputError;
};

// The router answered with an ERROR message; what() is its text.
class RouterError : public InputError {
 public:
  RouterError(const std::string& name, const std::string& what) : InputError(what), name_(name) {}
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

class Client {
 public:
  // Connects and says HELLO; throws RouterUnreachable after timeout_ms without a WELCOME. With
  // SWARM_KEY and SWARM_ROUTER_KEY set (a keypair file; the router's public key or .pub file),
  // the connection uses CURVE.
  explicit Client(const std::string& router, int timeout_ms = 5000);
  ~Client();
  // Sends `req` and waits for the reply with the same id; throws RouterUnreachable on timeout
  // and RouterError when the router answers ERROR.
  wire::Message request(wire::Message req, int timeout_ms = 10000);
  nlohmann::json request_body(wire::MsgType type, nlohmann::json body, int timeout_ms = 10000);
  // Every registered peer, PEERS page by page ({peers, total}).
  nlohmann::json peers(int timeout_ms = 10000);

 private:
  std::string router_;
  zmq::context_t ctx_{1};
  zmq::socket_t sock_;
  wire::PartJoiner parts_;   // a large reply, as its PARTs come
  bool router_parts_ = false;   // the router takes PARTs (WELCOME.parts)
  uint64_t next_id_ = 1;
  bool keyed_ = false;   // CURVE on (SWARM_KEY)
};

}  // namespace swarm
