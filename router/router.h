// router.h: swarm-router, the one process per swarm that registers peers and drives jobs.
//
// Defines swarm::RouterOptions and swarm::Router. The router binds one ROUTER socket that
// stage servers and CLI clients connect to. Its single event loop keeps the registry (HELLO,
// heartbeats, death after missed heartbeats), validates and queues submitted jobs, assigns
// stages, drives microbatches through the stages (dispatcher), runs the within-stage rounds
// and evaluations, and answers STATUS/PEERS/CANCEL at any time. It forwards activations and
// gradients as the compressed bytes it received, sharing the buffers (no copies, no decoding).
#pragma once

#include <atomic>
#include <memory>
#include <string>

namespace swarm {

struct RouterOptions {
  std::string bind = "tcp://0.0.0.0:5555";  // "tcp://127.0.0.1:*" picks a free port
  int heartbeat_ms = 500;                   // peers heartbeat this often
  int liveness = 3;                         // heartbeats missed before a peer is dead (1.5 s)
  std::string ready_file;                   // written with the bound endpoint once listening
  std::string state_dir;                    // jobs and their checkpoints; unfinished jobs resume from it
  int quarantine_after = 3;                 // integrity failures (corrupt, misshapen, non-finite) before a peer is quarantined
};

class Router {
 public:
  explicit Router(RouterOptions opt);
  ~Router();
  // The endpoint actually bound (with the real port when the bind asked for '*').
  std::string endpoint() const;
  // Runs the event loop until `stop` becomes true.
  void run(std::atomic<bool>& stop);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace swarm
