// stage_server.h: swarm-stage, the process that serves one stage of the model.
//
// Defines swarm::StageOptions and `run_stage_server`. The server connects to a router
// (DEALER), says HELLO, heartbeats from an I/O thread, and answers LOAD_STAGE, FORWARD,
// FORWARD_LOSS, BACKWARD, EVAL, STEP and the within-stage round messages from a compute
// thread. It reconnects with doubling backoff when the router goes silent. Protocol:
// docs/protocol.md. Faults can be injected into it (`faults`, or CHAOS from the router):
// docs/faults.md, "Injecting faults".
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "runtime/fault.h"
#include "runtime/graph_cache.h"
#include "runtime/precision.h"

namespace swarm {

struct StageOptions {
  std::string router = "tcp://127.0.0.1:5555";
  int stage = -1;              // stage asked for (pinned: never moved); -1 lets the router choose
  int prefer_stage = -1;       // stage to start on when `stage` is -1; the rebalancer may move it
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N" (CUDA-enabled libtorch only)
  Precision precision = Precision::kAuto;  // compute type unless the job pins model.precision (docs/gpu.md)
  int threads = 0;             // torch intra-op threads; 0 keeps libtorch's default
  double emulate = 1.0;        // pad compute time to act as a device this many times slower
  std::string profile;         // the named profile the factor came from ("t4", ...), for labels
  std::string name;            // shown in `swarm peers`; default host:pid
  bool echo = false;           // transport benchmark: answer FORWARD with the input untouched
  // Peer to peer (docs/protocol.md, "Peer to peer"): where other peers fetch the tensors this
  // one makes ("": nowhere; its tensors are relayed through the router), and the address they
  // should dial when it differs from the bound one (NAT, several interfaces).
  std::string listen, advertise;
  // CURVE (docs/security.md): this server's keypair file and the router's public key (or a file
  // holding it). With them the routing id derives from the key and every connection, to the
  // router and to other stage servers, is encrypted and authenticated.
  std::string key_file, router_key;
  double fetch_timeout_s = 30;         // a tensor that does not arrive from its holder in this long fails the hop
  size_t hold_bytes = size_t(4) << 30; // tensors kept for other peers at most [bytes]
  std::string http;            // HOST:PORT for this server's /metrics ("" none); a wildcard host is advertised by host name
  int heartbeat_ms = 500;
  int liveness = 3;            // router silent for liveness * heartbeat_ms -> reconnect
  size_t cache_entries = kGraphCacheEntries;   // affinity cache: forward graphs kept for a later BACKWARD, at most
                                               // (fewer where the stage leaves too little memory for them)
  int64_t memory_limit_bytes = -1;             // use at most this much of the device (--memory-mb): what HELLO
                                               // says is free, and what the affinity cache is sized to; -1: all
  double cache_ttl_s = kGraphCacheTtlS;
  // The first and last stages may read a job's data files under this directory (--data-root):
  // when they hold the tokens the router has, they sample their hops' tokens and targets
  // themselves and the router sends none ("": never; the router sends them all).
  std::string data_root;
  std::vector<FaultSpec> faults;  // injected faults, armed at start (none: the injector is inert)
  uint64_t fault_seed = 1;        // every fault's random draws derive from it
};

// Runs until `stop` becomes true (SIGTERM/SIGINT in swarm-stage). Returns the exit code.
int run_stage_server(const StageOptions& opt, std::atomic<bool>& stop);

}  // namespace swarm
