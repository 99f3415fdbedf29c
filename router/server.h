// server.h: swarm-router's thin shell around its core: the only part of the router that
// touches a socket, a clock or a file.
//
// Defines swarm::router::ServerOptions and Server. The server binds one ZeroMQ ROUTER socket
// that stage servers and CLI clients connect to; its loop receives frames, parses the envelope,
// decodes the rest only for senders the core accepts, hands the message to RouterCore
// (router/core.h) with the time, and carries out the actions it returns: sends, logs, and (on a
// disk thread, so that routing never waits for a disk) job data loads, state records and
// checkpoints, whose results go back to the core as events. With `http` set it also serves
// /metrics, the status API and the dashboard (runtime/http.h) from threads of their own, from
// pages the loop publishes when a request asks for fresh ones (docs/observability.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "router/core.h"

namespace swarm::router {

struct ServerOptions {
  std::string bind = "tcp://0.0.0.0:5555";   // "tcp://127.0.0.1:*" picks a free port
  std::string ready_file;                     // written with the bound endpoint once listening (and the HTTP URL, second line)
  std::string http;                           // HOST:PORT for /metrics, /api/* and the dashboard; "" serves none
  uint64_t max_data_bytes = TokenData::kDefaultMaxDataBytes;  // a job's data files together
  // CURVE (docs/security.md): the router's keypair file and the authorized keys file; both
  // empty: no keys, which only a loopback bind or `insecure` allows.
  std::string key_file, authorized_file;
  bool insecure = false;
  // Where jobs may read data and --resume checkpoints from. Empty: jobs submitted from another
  // host may read nothing, local ones anything the router can. Checkpoint dirs of confined jobs
  // must be under the state dir.
  std::vector<std::string> data_roots;
  CoreOptions core;
};

// Whether a job's file may be used: "" if so, else what to fix. `path` must exist; it is
// taken with symlinks resolved; `roots` empty allows nothing.
std::string outside_roots(const std::string& path, const std::vector<std::string>& roots, const std::string& what);
// Whether `bind` listens only on this host (127.x, localhost, [::1], ipc://, inproc://).
bool loopback_bind(const std::string& bind);

class Server {
 public:
  explicit Server(ServerOptions opt);
  ~Server();
  // The endpoint actually bound (with the real port when the bind asked for '*').
  std::string endpoint() const;
  // http://HOST:PORT of the dashboard and /metrics ("" without --http).
  std::string http_url() const;
  // Runs the event loop until `stop` becomes true.
  void run(std::atomic<bool>& stop);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace swarm::router
