// client.cpp: the CLI's router session (see client.h).
#include "runtime/client.h"

#include <chrono>
#include <cstdlib>

#include "runtime/keys.h"
#include "runtime/messages.h"

namespace swarm {

using wire::Message;
using wire::MsgType;

Client::Client(const std::string& router, int timeout_ms) : router_(router), sock_(ctx_, zmq::socket_type::dealer) {
  sock_.set(zmq::sockopt::linger, 0);
  sock_.set(zmq::sockopt::sndtimeo, 1000);   // no connection up (a refused handshake): fail, do not hang
  // CURVE when the user has keys: SWARM_KEY (their keypair file) and SWARM_ROUTER_KEY (the
  // router's public key or .pub file); `swarm --key/--router-key` set them.
  const char* key = std::getenv("SWARM_KEY");
  const char* router_key = std::getenv("SWARM_ROUTER_KEY");
  if ((key && *key) != (router_key && *router_key))
    throw InputError("give both --key and --router-key (SWARM_KEY and SWARM_ROUTER_KEY), or neither");
  if (key && *key) {
    curve_client(sock_, read_keypair(key), read_public_key(router_key));
    keyed_ = true;
  }
  try {
    sock_.connect(router);
  } catch (const zmq::error_t& e) {
    throw RouterUnreachable("cannot use router address '" + router + "': " + e.what() +
                            " (expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555)");
  }
  msg::Hello hello;
  hello.role = msg::Role::kClient;
  hello.version = wire::kVersion;
  hello.parts = true;
  router_parts_ = msg::read<msg::Welcome>(request(msg::make(hello, next_id_++), timeout_ms)).parts;
}

Client::~Client() {
  try {
    Message bye(MsgType::kBye);
    wire::send(sock_, bye);
  } catch (...) {
  }
}

Message Client::request(Message req, int timeout_ms) {
  if (req.id == 0) req.id = next_id_++;
  const uint64_t id = req.id;
  if (router_parts_) wire::send_parted(sock_, req);
  else wire::send(sock_, req);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    zmq::pollitem_t items[] = {{sock_.handle(), 0, ZMQ_POLLIN, 0}};
    zmq::poll(items, 1, left);
    if (!(items[0].revents & ZMQ_POLLIN)) continue;
    auto r = wire::recv_frames(sock_, false, zmq::recv_flags::dontwait);
    if (!r) continue;
    std::optional<std::vector<zmq::message_t>> whole = parts_.take("", std::move(r->frames), 0);
    if (!whole) continue;   // a PART of a large reply; the rest is on its way
    Message m = wire::decode(*whole);
    if (m.type == MsgType::kHeartbeat) continue;
    // An ERROR with id 0 answers a message the router could not even parse: ours.
    if (m.id != id && !(m.type == MsgType::kError && m.id == 0)) continue;
    if (m.type == MsgType::kError) {
      const msg::Error e = msg::read<msg::Error>(m);
      throw RouterError(e.name.empty() ? "error" : e.name, e.message.empty() ? "the router refused the request" : e.message);
    }
    return m;
  }
  throw RouterUnreachable("no answer from a router at " + router_ + " within " + std::to_string(timeout_ms / 1000.0) +
                          " s: is swarm-router running there (swarm-router --bind tcp://0.0.0.0:PORT) and reachable?" +
                          (keyed_ ? " Is your public key in its authorized file, and --router-key the router's?"
                                  : " If it uses keys, pass --key and --router-key."));
}

nlohmann::json Client::request_body(MsgType type, nlohmann::json body, int timeout_ms) {
  return wire::body_json(request(wire::json_message(type, 0, 0, body), timeout_ms));
}

nlohmann::json Client::peers(int timeout_ms) {
  nlohmann::json all = nlohmann::json::array();
  uint64_t total = 0;
  do {
    nlohmann::json page = request_body(MsgType::kPeers, {{"offset", all.size()}}, timeout_ms);
    total = page.value("total", uint64_t(0));
    if (!page.contains("peers") || page["peers"].empty()) break;
    for (auto& p : page["peers"]) all.push_back(std::move(p));
  } while (all.size() < total);
  return {{"peers", all}, {"total", total}};
}

}  // namespace swarm
