// keys.h: who a party is: CURVE keypairs, the router's list of authorized keys and their roles,
// and how a connection uses them (docs/security.md).
//
// Defines KeyPair, Role, Authorized, Identity and the ZeroMQ socket set-up of both ends. Keys
// are ZeroMQ's CURVE keys (Curve25519, printed as 40 characters of Z85). A keypair lives in two
// files: NAME.key (both keys, mode 0600) and NAME.pub (the public key). The router's authorized
// file has one line per allowed key: `KEY ROLE NAME` (ROLE: stage, client or admin; NAME: a
// label for logs and `swarm peers`), `#` comments and blank lines ignored, as SSH's
// authorized_keys. A stage server's ZeroMQ routing id is derived from its public key
// (`routing_id_of`), so no one can register under another peer's id without its secret key.
// Throws InputError saying what to fix for a bad file.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

namespace swarm {

struct KeyPair {
  std::string public_key, secret_key;   // Z85, 40 characters each
};

KeyPair generate_keypair();
// Writes `base`.key (mode 0600) and `base`.pub; refuses to overwrite either.
void write_keypair(const std::string& base, const KeyPair& k);
// A keypair from a .key file (or `base` + ".key").
KeyPair read_keypair(const std::string& path);
// A public key: 40 characters of Z85 given as is, or read from a .pub (or .key) file.
std::string read_public_key(const std::string& text_or_path);
bool valid_z85_key(const std::string& k);

enum class Role { kStage, kClient, kAdmin };
const char* role_name(Role r);

struct Authorized {
  std::string key;   // Z85 public key
  Role role = Role::kClient;
  std::string name;
};
std::vector<Authorized> read_authorized(const std::string& path);

// Who sent a message, as the router's transport established it. Without keys (an insecure
// router) every party is an unauthenticated admin, as a router on loopback always was.
struct Identity {
  bool authenticated = false;
  std::string key;                 // Z85 public key when authenticated
  std::string name;                // from the authorized file
  Role role = Role::kAdmin;
  bool remote = false;             // connected from a non-loopback address (confined to --data-root)
  static Identity anyone() { return Identity{}; }
};

// "k-" followed by 24 hex digits of the key's hash: a stage server's routing id under CURVE.
std::string routing_id_of(const std::string& public_key);

// A socket that authenticates its peers with `own` (the router's ROUTER, a stage's listen
// socket): CURVE server, with ZAP domain `domain`.
void curve_server(zmq::socket_t& s, const KeyPair& own, const std::string& domain);
// A socket that connects to a CURVE server whose public key is `server_key`.
void curve_client(zmq::socket_t& s, const KeyPair& own, const std::string& server_key);

// The ZAP handler of a ZeroMQ context: answers every CURVE handshake on sockets of that context
// by looking the client's key up with `allow` (returns the identity, or nullopt to refuse:
// the client gets nothing). Runs a thread until destroyed; counts refusals.
class ZapHandler {
 public:
  using Allow = std::function<std::optional<Identity>(const std::string& key, const std::string& address)>;
  ZapHandler(zmq::context_t& ctx, Allow allow);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;
  uint64_t refused() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The key a message's frame was authenticated with (ZeroMQ's "User-Id" property, which the ZAP
// handler sets to the Z85 key), or "" on a socket without CURVE.
std::string authenticated_key(const zmq::message_t& frame);
// Whether the frame came over a connection from another host (its "Peer-Address" is not a
// loopback address; ipc and inproc connections are local).
bool from_remote_host(const zmq::message_t& frame);

}  // namespace swarm
