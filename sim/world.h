// world.h: the simulator's state, shared by the files that implement sim/simulator.h: world.cpp
// (the event loop, the router's side: its core, link, disk and client), peers.cpp (the stage
// servers: receiving, fetching, computing, heartbeats, crashes, the scenario's faults) and
// report.cpp (trace samples, the ideal bound, the summary, expectations). Private to sim/.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "router/core.h"
#include "sim/costs.h"
#include "sim/rng.h"
#include "sim/scenario.h"
#include "sim/simulator.h"
#include "sim/stage_replies.h"

namespace swarm::sim {

// One direction of a host's connection. Transfers share it as TCP flows do (each gets a fair
// share while the others last), approximated without rescheduling anything: a new transfer ends
// at the sooner of (n + 1) x its own time, with n transfers in progress, and the end of
// everything queued before it plus its own time; the link's total work is conserved.
struct Pipe {
  double bps = 1e9;            // bits per second
  double free_s = 0;           // when everything it carries now would end, one after another
  std::vector<double> ends;    // when each transfer in progress ends
  uint64_t bytes = 0;          // carried so far
  double busy_s = 0;           // time spent carrying them
  // A transfer of `dur` seconds (at the rate it gets alone) starting at `t`: when it ends here.
  double carry(double t, double dur);
};
// Messages up to this size [bytes] are control traffic: they do not queue behind bulk transfers.
constexpr uint64_t kControlBytes = 16 << 10;
struct Host {
  Pipe up, down;
  double latency_s = 0;  // one way, to the network's core
};

enum class Ev : uint8_t {
  kTick,          // the router's poll loop
  kToRouter,      // a message arrives at the router (slot)
  kCorrupt,       // a reply arrives with a tensor failing its checksum (slot: its envelope survives)
  kToPeer,        // a message arrives at a peer (slot)
  kWhole,         // a request's references have all been fetched, or one failed (slot)
  kComputed,      // a peer's compute thread finished a request (slot)
  kHeartbeat,     // a peer's heartbeat timer
  kJoin,          // a peer process starts and says HELLO
  kCrash,         // a peer's next crash from the crash rate
  kFault,         // a scenario fault event (peer: its index in faults.events)
  kFaultEnd,      // a stall or slow-down ends (peer)
  kRouterUp,      // a restarted router is back
  kDisk,          // a LoadJob or WriteCheckpoint finished (slot: the disk result)
  kSubmit,        // the client submits the job
  kSample,        // a trace sample
  kPauseCheck,    // while paused: has the stage come back?
};

struct Event {
  double t = 0;
  uint64_t seq = 0;      // ties in time go in scheduling order
  Ev kind = Ev::kTick;
  int peer = -1;
  uint64_t session = 0;  // the peer's session when scheduled: events of a crashed process are dropped
  uint64_t epoch = 0;    // the router's session when scheduled: messages to a router that restarted are lost
  uint32_t slot = 0;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

// A message on its way, or a request a peer has taken and not answered yet (what its fetches
// brought, and the ERROR to answer instead when one failed).
struct Slot {
  wire::Message m;
  std::vector<int64_t> fetched;          // bytes fetched per request slot
  std::optional<wire::Message> failure;
  double compute_s = 0;                  // what its work took
};

struct SimPeer {
  int index = 0, group = 0, within = 0;   // within: its place in its group
  std::string name;
  router::PeerId id;                     // its routing id; a restarted process gets a new one
  int generation = 0;
  Profile dev;
  Host host;
  std::string listen;                    // where others fetch from it ("": relayed)
  bool alive = false;                    // its process runs
  bool welcomed = false;
  uint64_t session = 0;                  // bumped on a crash: its pending events are dropped
  double stall_until = 0;                // SIGSTOP-like: nothing runs, nothing is answered
  double slow = 1;                       // compute takes this many times longer
  double corrupt_p = 0;                  // fraction of its replies that arrive corrupt
  Quirks quirks;
  StageBook book;
  double busy_until = 0;                 // its compute thread
  double ms_per_unit = 0;                // its own EMA of compute ms per unit, as its heartbeat says
  double last_hello_s = -1e300;
  double last_beat_s = 0, last_sent_s = 0;   // its last heartbeat, its last message of any kind to the router
};

struct Window {                          // one sample interval's counters
  double t0 = 0;
  uint64_t completed0 = 0;
  double ideal_integral = 0;             // the ideal bound integrated over the interval [tokens]
  // Where the swarm's capacity went (report.cpp): FLOPs of the hops computed in the interval, and
  // the part of them that was a backward recomputing its forward (its graph was not cached).
  double hop_flops = 0, recompute_flops = 0;
  // Per peer group: its live peers' seconds, and the seconds they spent computing (hops, loads,
  // rounds; counted when the work ends).
  std::vector<double> group_alive_s, group_busy_s;
};

class World {
 public:
  World(const Scenario& s, const SimOptions& o);
  SimResult run();

  // ---- world.cpp ----
  void schedule(double t, Ev kind, int peer = -1, uint32_t slot = 0);
  uint32_t stash(wire::Message m);
  Slot release_slot(uint32_t slot);
  template <class F>
  void call(const char* what, F&& f);    // one event into the core, timed under `what`; its actions carried out
  // A transfer of `bytes` from a's uplink to b's downlink starting no earlier than `now`: when it
  // has arrived (latencies included).
  double transfer(Host& a, Host& b, uint64_t bytes, double now);
  void take(router::Actions a);          // carries out the core's actions
  void to_router(int peer, wire::Message m, double depart_s);
  void core_message(int peer, wire::Message m);
  void router_down(double down_s);
  void router_up();

  // ---- peers.cpp ----
  void join(int p);
  void peer_receives(int p, wire::Message m);
  // The router's PUSH to a holder: when the tensor reaches its receiver, noted there (the holder's
  // I/O thread sends it as the PUSH arrives; no event of its own).
  void push(int holder, const wire::Message& m);
  // Holder h sends part `part` of its reply to request `key` to the peer listening at `to`,
  // starting at `at`: its arrival noted at the receiver.
  void push_from(SimPeer& h, uint64_t key, size_t part, const std::string& to, double at);
  void request_whole(int p, uint32_t slot);
  void computed(int p, uint32_t slot);
  void heartbeat(int p);
  void hello(int p);
  void crash(int p, const std::string& why, double rejoin_after_s);
  void schedule_crash(int p);
  void fault(size_t index);
  void fault_end(int p);
  int peer_of(const std::string& routing_id) const;

  // ---- report.cpp ----
  void sample();
  void open_window(uint64_t completed);  // a new sample interval from now
  nlohmann::json busy_by_group(const std::vector<double>& alive_s, const std::vector<double>& busy_s) const;
  void note_log(const router::Log& l);
  void check_pause();                    // whether a stage of the job has no ready peer now
  double ideal_tokens_per_s() const;     // the bound for the peers alive now
  void ideal_changed();                  // integrate the bound up to now before the swarm changes
  nlohmann::json summary() const;
  std::vector<std::string> check_expectations(const nlohmann::json& summary) const;
  void line(nlohmann::json j);

  const Scenario& sc;
  SimOptions opt;
  Rng rng;
  JobCosts costs;
  double now = 0, end_s = 0;
  uint64_t seq = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> queue;
  std::vector<Slot> slots;
  std::vector<uint32_t> free_slots;
  Payloads payloads;

  // The router.
  std::unique_ptr<router::RouterCore> core;
  router::CoreOptions core_opt;
  uint64_t router_session = 1;           // bumped when it restarts: messages to the old one are lost
  bool router_alive = true;
  Host router_host;
  std::map<std::string, std::string> files;                            // WriteFile, by path
  std::map<std::string, std::vector<std::shared_ptr<const Checkpoint>>> checkpoints;  // by dir, oldest first
  std::vector<std::optional<router::JobLoaded>> disk_loads;             // by slot (kDisk)
  std::vector<std::optional<router::CheckpointWritten>> disk_writes;
  std::shared_ptr<const TokenData> data;
  const router::PeerId client_id = "c-sim";
  uint64_t job_id = 0;
  std::string submit_error;

  // The peers.
  std::vector<SimPeer> peers;
  std::unordered_map<std::string, int> by_id;        // routing id -> peer (lookups only)
  std::unordered_map<std::string, int> by_listen;    // listen address -> peer

  // What happened (report.cpp writes it out).
  bool job_ended = false, job_running = false;
  bool pause_check = false;              // a peer left its stage: see whether the job paused
  double paused_since = -1, paused_total_s = 0;
  uint64_t pauses = 0;
  std::string last_state, last_reason;
  uint64_t moves = 0, quarantined = 0, crashes = 0, rejoins = 0, router_restarts = 0;
  uint64_t corrupt_sent = 0, fetches = 0, fetch_failures = 0, relays = 0, pushes = 0, pushes_used = 0;
  uint64_t msgs_to_router = 0, msgs_from_router = 0, heartbeats_in = 0, heartbeats_out = 0;
  std::map<std::string, uint64_t> log_counts;        // by level
  uint64_t peak_held_bytes = 0;                      // the most one peer held for others [bytes]
  double ideal_flops = 0;                            // sum of the effective FLOP/s of live peers
  double ideal_mark_s = 0;
  std::vector<int> group_alive;                      // live peers per group
  Window win;
  std::vector<nlohmann::json> samples;               // kept for the summary's last-hour figures
  std::vector<Window> sampled;                       // each sample's counters, in the same order
  // Perf (not in the trace).
  uint64_t core_events = 0, sim_events = 0;
  double core_cpu_s = 0;
  struct CoreCost {
    uint64_t events = 0;
    double s = 0;
  };
  std::unordered_map<const char*, CoreCost> core_by_event;   // by message type name, "tick", ... (static strings)
};

}  // namespace swarm::sim
