// world.h: the simulator's state, shared by the files that implement sim/simulator.h: world.cpp
// (the event loop, the router's side: its core, link, disk and client), peers.cpp (the stage
// servers: receiving, fetching, computing, heartbeats, crashes, the scenario's faults) and
// report.cpp (trace samples, the ideal bound, the summary, expectations). Private to sim/.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
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

// The world runs as two sides, each with its own clock and queue: the router's (its core, its
// link and disk, the client; kRouter) and the peers' (the stage servers and their links, faults,
// samples and every trace line; kPeers). Whatever one side does to the other crosses a link, so
// it lands there at least that link's latency later (the router's own latency for what it sends,
// the least of the peers' for what they send): that is the lookahead that lets the two run on
// two threads, each taking the next event only once the other can no longer send it anything
// earlier. Interleaved on one thread, they take the same events in the same order.
enum class SideId : uint8_t { kRouter = 0, kPeers = 1 };

enum class Ev : uint8_t {
  // The router's side.
  kTick,          // the router's poll loop
  kToRouter,      // a message arrives at the router (slot; a cross-event when it is small)
  kToRouterBulk,  // a large message starts down the router's downlink (slot: up_end, dur)
  kUnreachable,   // a send to a peer's routing id found no process there (slot: id)
  kRouterDown,    // a restart_router fault (slot: its index in faults.events)
  kRouterUp,      // a restarted router is back
  kDisk,          // a LoadJob or WriteCheckpoint finished (slot: the disk result)
  kSubmit,        // the client submits the job
  kRouterSample,  // the router's half of a trace sample
  kPauseCheck,    // while paused: has the stage come back?
  // The peers' side.
  kToPeer,        // a message arrives at a peer (slot, with the routing id it was sent to)
  kFromRouterBulk,// a large message from the router starts down a peer's downlink (slot: up_end, dur)
  kWhole,         // a request's references have all been fetched, or one failed (slot)
  kComputed,      // a peer's compute thread finished a request (slot)
  kHeartbeat,     // a peer's heartbeat timer
  kJoin,          // a peer process starts and says HELLO
  kCrash,         // a peer's next crash from the crash rate
  kFault,         // a scenario fault event (slot: its index in faults.events)
  kFaultEnd,      // a stall or slow-down ends (peer)
  kSample,        // the peers' half of a trace sample
  kRouterHalf,    // the router's half of a sample arrives (slot: json)
  kLine,          // a trace line the router's side made (slot: json)
  kStop,          // the job ended at the router: nothing more happens
};

// Events in time; ties by a Lamport sequence (a side's counter, past every event it has taken),
// then by the side that scheduled it. The order is the same whether the sides interleave on one
// thread or run on two.
struct Event {
  double t = 0;
  uint64_t seq = 0;
  SideId from = SideId::kRouter;
  Ev kind = Ev::kTick;
  int peer = -1;
  uint32_t session = 0;  // peers' side: the peer's session when scheduled (a crashed process's events are dropped);
                         // router's side: the router's session (a restarted router's old events are dropped)
  uint32_t slot = 0;
  bool operator>(const Event& o) const {
    if (t != o.t) return t > o.t;
    if (seq != o.seq) return seq > o.seq;
    return from > o.from;
  }
};
static_assert(sizeof(Event) == 32, "two events a cache line");

// A side's events, earliest first: a 4-ary heap, half as deep as a binary one, whose four
// children of a node share a cache line (the peers' side holds tens of thousands of events, and
// each one taken walks the heap from its root). (t, seq, from) orders every event apart, so any
// correct heap takes them in the same order.
class EventQueue {
 public:
  bool empty() const { return heap_.empty(); }
  const Event& top() const { return heap_.front(); }
  void push(const Event& e);
  void pop();

 private:
  std::vector<Event> heap_;
};

// A message on its way, or a request a peer has taken and not answered yet (what its fetches
// brought, and the ERROR to answer instead when one failed); what a cross-event carries.
struct Slot {
  wire::Message m;
  std::vector<int64_t> fetched;          // bytes fetched per request slot
  std::unique_ptr<wire::Message> failure;   // rare: boxed, so a slot moves cheaply
  uint64_t mb = 0;                       // a hop's microbatch, its body read once as it arrives
  std::optional<std::string> push_to;    // a hop's push_to
  double compute_s = 0;                  // what its work took
  std::string id;                        // the routing id it comes from or goes to
  double depart_s = 0;                   // when it left its sender
  uint64_t bytes = 0;                    // on the wire
  double up_end = 0, dur = 0;            // a large message: when the sender's uplink is done with it, and its time alone
  bool corrupt = false;                  // a reply whose tensor fails its checksum on arrival
  std::unique_ptr<nlohmann::json> j;     // a trace line, or the router's half of a sample
};

class SlotPool {
 public:
  uint32_t put(Slot s);
  Slot take(uint32_t i);
  Slot& operator[](uint32_t i) { return slots_[i]; }

 private:
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
};

// One side's events and the cross-events on their way to it from the other side's thread.
struct Side {
  SideId id = SideId::kRouter;
  double now = 0;
  uint64_t clock = 0;                    // Lamport: past every event scheduled or taken here
  EventQueue queue;
  SlotPool slots;
  uint64_t events = 0;
  double wait_s = 0;                     // threads: wall time spent waiting for the other side
  bool done = false;                     // it takes nothing more
  double lookahead_in = 0;               // the least delay of anything the other side sends here [s]
  std::vector<std::pair<Event, Slot>> outbox, received;   // threads: sent and not handed over; taken from inbox
  // Threads: cross-events land in `inbox` under `mu`; `bound` is a time this side takes no event
  // before (published after its sends, read by the other side before it drains its inbox). Each
  // on cache lines of its own: the other thread reads `bound` while it waits, and it would
  // otherwise take the line from this thread at every event it schedules.
  alignas(64) std::mutex mu;
  std::vector<std::pair<Event, Slot>> inbox;
  std::atomic<bool> arrived{false};      // inbox is not empty
  alignas(64) std::atomic<double> bound{0};
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
  uint32_t session = 0;                  // bumped on a crash: its pending events are dropped
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
  double t0 = 0, t1 = 0;                 // from, to
  int alive = 0;                         // live peers at its end
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
  Side& other(Side& s);
  Event stamp(Side& from, double t, Ev kind, int peer);   // the next event `from` schedules (its Lamport sequence)
  void at(Side& s, double t, Ev kind, int peer = -1, uint32_t slot = 0);   // an event of s's own (a slot in s.slots)
  // A cross-event from `from` to the other side, carrying `slot`: it lands at `t`, at least the
  // other side's lookahead_in after from.now.
  void cross(Side& from, double t, Ev kind, int peer, Slot slot);
  void deliver(Side& to, Event e, Slot slot);              // a cross-event into its side's queue
  void publish(Side& s, double bound);                     // threads: hands over s's outbox, then publishes its bound
  void drain(Side& s);                                     // threads: what arrived in s's inbox, into its queue
  void step(Side& s);                                      // takes s's next event
  void run_interleaved();
  void run_side(Side& s);                                  // one side's thread
  void run_threads();
  void router_event(const Event& e);
  void peers_event(const Event& e);
  // The router's side.
  template <class F>
  void call(const char* what, F&& f);    // one event into the core, timed under `what`; its actions carried out
  void take(router::Actions a);          // carries out the core's actions
  void send_to_peer(int p, router::PeerId to, wire::Message m);
  void core_message(int peer, const std::string& id, wire::Message m);
  void router_line(nlohmann::json j);    // a trace line, written by the peers' side
  void router_down(double down_s);
  void router_up();
  nlohmann::json router_half();          // the router's part of a sample: the job's status, its link
  // The peers' side.
  // A transfer of `bytes` from a's uplink to b's downlink starting no earlier than `now`: when it
  // has arrived (latencies included). Both hosts are peers.
  double transfer(Host& a, Host& b, uint64_t bytes, double now);
  void to_router(int peer, wire::Message m, double depart_s, bool corrupt = false);

  // ---- peers.cpp ----
  void join(int p);
  void peer_receives(int p, wire::Message m);
  // The router's PUSH reached holder p: the tensor's arrival at its receiver noted there.
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

  // ---- report.cpp ----
  void peers_half();                     // the peers' part of a sample, at its time
  void sample(const nlohmann::json& router);   // the oldest peers' half with the router's: the trace line
  void finish_samples();                 // at the end: halves the router did not answer, and the last window
  void open_window();                    // a new sample interval from now
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
  double end_s = 0;
  Side router_side, peers_side;
  double& now = peers_side.now;          // the peers' clock (peers.cpp, report.cpp)
  double& rnow = router_side.now;        // the router's clock
  bool threaded = false;
  std::atomic<bool> failed{false};       // a side threw: both stop
  std::mutex error_mu;
  std::exception_ptr error;              // what it threw
  Payloads payloads;

  // The router's side (its thread).
  std::unique_ptr<router::RouterCore> core;
  router::CoreOptions core_opt;
  uint32_t router_session = 1;           // bumped when it restarts: its old timers and disk results are dropped
  double router_up_s = 0;                // when the running router started: what was sent before is lost
  bool router_alive = true;
  Host router_host;
  struct PeerLink {
    double down_bps = 0, latency_s = 0;
  };
  std::vector<PeerLink> peer_links;      // each peer's downlink rate and latency, which never change: the router's copy
  std::unordered_map<std::string, int> peer_by_id;   // routing ids the router has heard from -> peer
  std::map<std::string, std::string> files;                            // WriteFile, by path
  std::map<std::string, std::vector<std::shared_ptr<const Checkpoint>>> checkpoints;  // by dir, oldest first
  std::vector<std::optional<router::JobLoaded>> disk_loads;             // by slot (kDisk)
  std::vector<std::optional<router::CheckpointWritten>> disk_writes;
  std::shared_ptr<const TokenData> data;
  const router::PeerId client_id = "c-sim";
  uint64_t job_id = 0;
  std::string submit_error;
  bool job_ended = false, job_running = false;
  double job_end_s = -1;
  bool pause_check = false;              // a peer left its stage: see whether the job paused
  double paused_since = -1, paused_total_s = 0;
  uint64_t pauses = 0;
  std::string last_state, last_reason;
  uint64_t completed0 = 0;               // microbatches completed at the last sample
  uint64_t moves = 0, quarantined = 0, router_restarts = 0;
  uint64_t msgs_to_router = 0, msgs_from_router = 0, heartbeats_in = 0, heartbeats_out = 0;
  std::map<std::string, uint64_t> log_counts;        // by level
  uint64_t core_events = 0;
  double core_cpu_s = 0;
  struct CoreCost {
    uint64_t events = 0;
    double s = 0;
  };
  std::unordered_map<const char*, CoreCost> core_by_event;   // by message type name, "tick", ... (static strings)

  // The peers' side (the calling thread).
  std::vector<SimPeer> peers;
  std::unordered_map<std::string, int> by_listen;    // listen address -> peer
  bool stopped = false;                              // the router's job ended
  uint64_t crashes = 0, rejoins = 0;
  uint64_t corrupt_sent = 0, fetches = 0, fetch_failures = 0, pushes = 0, pushes_used = 0;
  uint64_t peak_held_bytes = 0;                      // the most one peer held for others [bytes]
  double ideal_flops = 0;                            // sum of the effective FLOP/s of live peers
  double ideal_mark_s = 0;
  std::vector<int> group_alive;                      // live peers per group
  Window win;
  std::deque<Window> halves;                         // the peers' halves of samples whose router half is on its way
  std::vector<nlohmann::json> samples;               // kept for the summary's last-hour figures
  std::vector<Window> sampled;                       // each sample's counters, in the same order
};

}  // namespace swarm::sim
