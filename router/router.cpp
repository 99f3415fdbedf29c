// router.cpp: the router's event loop, registry, job runner, dispatcher and round coordinator.
//
// Everything runs on one thread that owns the ROUTER socket: a message handler per type and a
// tick (every few milliseconds) that expires peers and requests and moves jobs forward. A
// microbatch is a small state machine: FORWARD through stages 0..S-2, FORWARD_LOSS on stage
// S-1, BACKWARD through S-2..0. The router keeps each stage's input frame (shared, never
// decoded) until the microbatch's backward has passed that stage, so any live peer of the
// stage can serve the backward, and any hop can be re-sent elsewhere when a peer fails.
#include "router/router.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "compression/codec.h"
#include "compression/subspace.h"
#include "router/dispatch.h"
#include "router/placement.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/diloco.h"
#include "runtime/fault.h"
#include "runtime/job_spec.h"
#include "runtime/limits.h"
#include "runtime/log.h"
#include "runtime/wire.h"

namespace swarm {

using nlohmann::json;
using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

enum class PeerState { kIdle, kLoading, kSyncing, kReady, kQuarantined };
const char* state_name(PeerState s) {
  switch (s) {
    case PeerState::kIdle: return "idle";
    case PeerState::kLoading: return "loading";
    case PeerState::kSyncing: return "syncing";
    case PeerState::kReady: return "ready";
    case PeerState::kQuarantined: return "quarantined";
  }
  return "?";
}

struct Peer {
  std::string route;
  std::string name, device, profile;
  std::string device_name;                 // from HELLO: "cpu" or the device string (CUDA)
  json device_memory_bytes = nullptr;      // from HELLO: total memory, null when unknown
  double emulate = 1;
  bool echo = false;
  int requested_stage = -1;  // --stage: pinned, never moved
  int preferred_stage = -1;  // --prefer-stage: where it starts; the rebalancer may move it
  int stage = -1;
  uint64_t job_id = 0;
  PeerState state = PeerState::kIdle;
  Clock::time_point joined, last_seen;
  double ms_per_unit = 0;        // EMA of compute ms per work unit, from its results
  double queued_units = 0;        // work sent to it and not answered yet
  Clock::time_point banned_until{};
  int bans = 0;
  uint64_t results = 0, failures = 0;
  uint64_t integrity_failures = 0;  // corrupt frames, wrong shapes, non-finite outputs
  uint64_t timeouts = 0;
  int timeouts_in_row = 0;          // deadlines passed since its last answer
  Clock::time_point unresponsive_until{};
  double last_moved_s = kNever;     // when the rebalancer last moved it (router clock, s)
  int last_from = -1;
  json heartbeat = json::object();
};

enum class HopKind { kForward, kForwardLoss, kBackward, kEval };

// A microbatch in flight through the stages.
struct Flight {
  uint64_t index = 0;   // data index (train) or validation batch index (eval)
  bool eval = false;
  int stage = 0;        // the stage of the current hop
  HopKind kind = HopKind::kForward;
  std::vector<wire::Tensor> inputs;   // inputs[s]: the stage input of stage s, while needed
  std::vector<bool> have_input;
  wire::Tensor targets;
  wire::Tensor grad;                  // gradient w.r.t. the output of `stage` (backward)
  std::vector<std::string> fwd_peer;  // who ran the forward of each stage (affinity)
  // The request in flight for the current hop.
  uint64_t req_id = 0;
  std::string peer;
  uint32_t attempts = 0;
  std::set<std::string> tried;        // peers that failed this hop
  Clock::time_point deadline{}, not_before{};
  bool waiting = true;                // no request in flight: dispatch when a peer is free
};

enum class JobState { kQueued, kLoading, kRunning, kDone, kFailed, kCancelled };
const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::kQueued: return "queued";
    case JobState::kLoading: return "loading";
    case JobState::kRunning: return "running";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "?";
}

// What the job loop is doing between microbatches.
enum class Phase { kTrain, kStepping, kRound, kEval, kSnapshot, kFinishing };

struct Job {
  uint64_t id = 0;
  JobSpec spec;
  json spec_json;
  bool transport_bench = false;
  int64_t bench_bytes = 0, bench_count = 0, bench_done = 0;
  std::unique_ptr<TokenData> data;
  double unigram = 0;
  JobState state = JobState::kQueued;
  std::string reason;                 // why it failed, or what it is waiting for
  Phase phase = Phase::kTrain;
  int S = 1, M = 1;
  std::vector<int64_t> stage_params;   // parameters per stage, as the first peer to load it reported
  uint64_t total_mbs = 0;
  uint64_t barrier = 0;               // microbatch count at which the job loop stops to step/sync/evaluate
  uint64_t taken = 0, completed = 0, resent = 0, duplicates = 0, rejected = 0;
  uint64_t resumed_at = 0;            // microbatches a checkpoint had completed: the wire counters start after them
  uint64_t integrity_failures = 0, timeouts = 0;
  json quarantined = json::array();   // {peer, stage, reason}
  std::map<uint64_t, Flight> inflight;   // by microbatch index (train) or 1<<62 | i (eval)
  std::map<uint64_t, std::pair<double, int>> step_loss;  // step -> (sum, count)
  int steps_done = 0;                 // optimizer steps whose microbatches all completed
  double train_loss = NAN, val_loss = NAN;
  json history = json::array();       // {step, train_loss, val_loss?, tokens_per_s}
  Clock::time_point started{}, run_started{}, finished{};
  int64_t train_tokens = 0;
  uint64_t bytes_act = 0, bytes_grad = 0, bytes_outer = 0;
  double codec_us[4] = {0, 0, 0, 0};  // activations encode, decode; gradients encode, decode (all peers)
  // Rounds.
  uint64_t rounds = 0;
  int last_round_step = 0;
  int last_eval_step = -1;
  bool final_round_done = false;
  // Sync schedule: STEP acks awaited.
  std::set<std::string> step_waiting;
  // Round state.
  struct RoundStage {
    std::vector<float> sum;
    double weight = 0;
    int contributors = 0;
    std::set<std::string> waiting;
    std::map<std::string, uint64_t> hashes;
  };
  bool round_applying = false;
  bool round_open = false;            // a round's deltas are being collected or applied
  std::string round_what = "delta";   // "delta" (DiLoCo) or "grad" (sync every_step)
  int round_fragment = 0;
  int round_apply_step = 0;           // overlapped rounds apply at this step's barrier
  std::vector<uint64_t> fragment_syncs;  // rounds per fragment
  json state_hashes = json::array();     // per stage: {peer name: hash of theta_g and momentum}
  compression::ErrorFeedback outer_ef;   // the router's side of a lossy outer codec
  std::vector<RoundStage> round;
  Clock::time_point round_deadline{};
  uint64_t hash_mismatches = 0;
  // Eval state.
  double eval_sum = 0;
  int eval_count = 0;
  uint64_t eval_next = 0;
  // Affinity statistics from RESULTs.
  uint64_t backward_cached = 0, backward_recomputed = 0;
  // Durability: the newest consistent state of every stage (router memory), and checkpoints.
  struct Snapshot {
    bool valid = false;
    int step = 0;
    StageState state;
  };
  std::vector<Snapshot> snapshots;
  int last_snapshot_step = -1;
  uint64_t snapshot_rounds = 0;       // rounds done when the last snapshot was taken
  std::set<std::string> snapshot_waiting;
  Clock::time_point snapshot_deadline{};
  bool snapshot_checkpoint = false;   // this snapshot is written as a checkpoint
  std::string checkpoint_dir;         // "" -> no checkpoints
  std::string job_dir;                // <state dir>/jobs/<id>, when the router has a state dir
  int last_checkpoint_step = -1;
  std::string last_checkpoint;
  uint64_t checkpoints_written = 0;
  json restores = json::array();      // stages restarted from a snapshot: {stage, peer, snapshot_step, step, lost_steps}
  json resumed = nullptr;             // {checkpoint, step, skipped, microbatches_redone}
  Clock::time_point last_progress{};
  // Rebalancing (routing.rebalance): the previous check's proposal, the last move, the moves made.
  Proposal proposal;
  double last_move_s = kNever;
  Clock::time_point next_rebalance{};
  std::mt19937_64 rng{1};
  json moves = json::array();
  std::string rebalance_reason;
};

constexpr uint64_t kEvalBit = uint64_t(1) << 62;

}  // namespace

struct Router::Impl {
  RouterOptions opt;
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  std::string endpoint;
  std::map<std::string, Peer> peers;                  // by routing id
  std::map<std::string, Clock::time_point> clients;   // CLI sessions, by routing id
  std::vector<std::unique_ptr<Job>> jobs;
  uint64_t next_job_id = 1;
  uint64_t next_req = 1;
  // req id -> what it was for.
  struct Pending {
    enum Kind { kHop, kLoad, kStep, kRoundBegin, kRoundApply, kStateRequest, kStateLoad, kSnapshot } kind;
    uint64_t job = 0;
    uint64_t mb = 0;
    std::string peer;
    std::string target;  // kStateRequest: the peer waiting for the state
    double units = 0;
    Clock::time_point sent = Clock::now();  // hops track their deadline in Flight; see request_limit_s
  };
  std::map<uint64_t, Pending> pending;
  std::set<std::string> unreachable;
  uint64_t bad_messages = 0;
  Clock::time_point last_beat = Clock::now();
  const Clock::time_point started_at = Clock::now();

  explicit Impl(RouterOptions o) : opt(std::move(o)) {
    sock.set(zmq::sockopt::router_mandatory, 1);
    sock.set(zmq::sockopt::router_handover, 1);
    sock.set(zmq::sockopt::linger, 0);
    sock.set(zmq::sockopt::sndhwm, 100000);
    sock.set(zmq::sockopt::rcvhwm, 100000);
    sock.bind(opt.bind);
    endpoint = sock.get(zmq::sockopt::last_endpoint);
    if (endpoint.rfind("tcp://0.0.0.0:", 0) == 0) endpoint = "tcp://127.0.0.1:" + endpoint.substr(14);
    if (!opt.ready_file.empty()) {
      std::ofstream f(opt.ready_file + ".tmp");
      f << endpoint << "\n";
      f.close();
      std::rename((opt.ready_file + ".tmp").c_str(), opt.ready_file.c_str());
    }
    log_info("router", "listening on " + endpoint);
    load_state_dir();
  }

  Job* active_job() {
    for (auto& j : jobs)
      if (j->state == JobState::kLoading || j->state == JobState::kRunning) return j.get();
    return nullptr;
  }
  Job* find_job(uint64_t id) {
    for (auto& j : jobs)
      if (j->id == id) return j.get();
    return nullptr;
  }

  // ---------------------------------------------------------------- sending

  // A send that fails marks the peer unreachable; it is removed at the next tick, so callers
  // may send while iterating over the registry.
  bool send_to(const std::string& route, Message& m) {
    if (!wire::send(sock, m, &route)) {
      if (peers.count(route)) unreachable.insert(route);
      return false;
    }
    return true;
  }

  void reply_error(const std::string& route, const Message* req, WireErrc code, const std::string& text) {
    Message e = wire::error_reply(req, code, text);
    wire::send(sock, e, &route);
  }

  // ---------------------------------------------------------------- main loop

  void run(std::atomic<bool>& stop) {
    while (!stop) {
      zmq::pollitem_t items[] = {{sock.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 1, std::chrono::milliseconds(5));
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;  // a signal: the loop condition decides
        throw;
      }
      if (items[0].revents & ZMQ_POLLIN) {
        for (int i = 0; i < 256; ++i) {
          auto r = wire::recv_frames(sock, true, zmq::recv_flags::dontwait);
          if (!r) break;
          on_frames(*r);
        }
      }
      tick();
    }
    for (auto& [route, p] : peers) {
      Message bye(MsgType::kBye, 0, 0, json{{"reason", "router shutting down"}});
      wire::send(sock, bye, &route);
    }
  }

  void on_frames(wire::Received& r) {
    Message m;
    auto pit = peers.find(r.route);
    if (pit != peers.end()) pit->second.last_seen = Clock::now();
    try {
      m = wire::decode(r.frames);
    } catch (const WireError& e) {
      bad_messages++;
      log_warn("router", "dropped a bad message" + (pit != peers.end() ? " from peer " + pit->second.name : std::string()) + ": " + e.what());
      reply_error(r.route, nullptr, e.code(), e.what());
      // A reply whose envelope survived names its request: re-send that work now rather
      // than at its deadline, and hold the corruption against the peer.
      if (pit != peers.end()) {
        if (auto id = wire::peek_id(r.frames)) {
          auto it = pending.find(*id);
          if (it != pending.end() && it->second.peer == r.route) {
            Job* j = find_job(it->second.job);
            request_failed(*id, /*error=*/true, e.what());
            integrity_failure(j, r.route, std::string("sent a corrupt reply (") + e.what() + ")");
          }
        }
      }
      return;
    }
    auto cit = clients.find(r.route);
    if (cit != clients.end()) cit->second = Clock::now();
    try {
      if (m.type == MsgType::kHello) return on_hello(r.route, m);
      if (pit == peers.end() && cit == clients.end()) {
        bad_messages++;
        return reply_error(r.route, &m, WireErrc::kOutOfOrder, "say HELLO first (protocol v1)");
      }
      switch (m.type) {
        case MsgType::kHeartbeat:
          if (pit != peers.end()) on_heartbeat(pit->second, m);
          return;
        case MsgType::kBye:
          if (pit != peers.end()) peer_dead(r.route, "said goodbye");
          else clients.erase(r.route);
          return;
        case MsgType::kResult:
        case MsgType::kStageReady:
        case MsgType::kRoundDelta:
        case MsgType::kRoundDone:
        case MsgType::kStateReply:
        case MsgType::kError:
          if (pit == peers.end()) return reply_error(r.route, &m, WireErrc::kOutOfOrder, "only stage servers send results");
          return on_reply(pit->second, m);
        case MsgType::kSubmit: return on_submit(r.route, m);
        case MsgType::kStatus: return on_status(r.route, m);
        case MsgType::kCancel: return on_cancel(r.route, m);
        case MsgType::kPeers: return on_peers(r.route, m);
        case MsgType::kChaos: return on_chaos(r.route, m);
        default:
          bad_messages++;
          return reply_error(r.route, &m, WireErrc::kOutOfOrder, std::string("the router does not take ") + wire::msg_type_name(m.type));
      }
    } catch (const json::exception& e) {
      bad_messages++;
      reply_error(r.route, &m, WireErrc::kMalformed, std::string("bad field: ") + e.what());
    } catch (const WireError& e) {
      bad_messages++;
      reply_error(r.route, &m, e.code(), e.what());
    } catch (const std::exception& e) {
      // Whatever a message makes go wrong, it costs that message, not the router.
      bad_messages++;
      log_warn("router", std::string("a ") + wire::msg_type_name(m.type) + " message failed: " + e.what());
      reply_error(r.route, &m, WireErrc::kMalformed, e.what());
    }
  }

  // ---------------------------------------------------------------- registry

  void on_hello(const std::string& route, Message& m) {
    const json& b = m.body;
    if (b.value("version", 0) != wire::kVersion)
      return reply_error(route, &m, WireErrc::kBadVersion, "HELLO version must be " + std::to_string(wire::kVersion));
    const std::string role = b.value("role", std::string());
    if (role == "client") {
      clients[route] = Clock::now();
      Message w(MsgType::kWelcome, m.id, 0, json{{"role", "client"}, {"version", wire::kVersion}});
      wire::send(sock, w, &route);
      return;
    }
    if (role != "stage") return reply_error(route, &m, WireErrc::kMalformed, "HELLO role must be 'stage' or 'client'");
    if (peers.count(route)) peer_dead(route, "said HELLO again (restarted)");
    Peer p;
    p.route = route;
    p.name = b.value("name", route).substr(0, limits::kMaxPeerIdBytes);
    p.device = b.value("device", std::string("cpu"));
    p.profile = b.value("profile", std::string());
    p.emulate = b.value("emulate", 1.0);
    p.echo = b.value("echo", false);
    p.requested_stage = b.value("stage", -1);
    p.preferred_stage = b.value("prefer_stage", -1);
    p.device_name = b.value("device_name", p.device).substr(0, limits::kMaxPeerIdBytes);
    if (b.contains("device_memory_bytes") && b["device_memory_bytes"].is_number_unsigned()) p.device_memory_bytes = b["device_memory_bytes"];
    p.joined = p.last_seen = Clock::now();
    peers[route] = p;
    Message w(MsgType::kWelcome, m.id, 0, json{{"peer_id", route}, {"heartbeat_ms", opt.heartbeat_ms}, {"liveness", opt.liveness}});
    wire::send(sock, w, &route);
    log_info("router", "peer " + p.name + " (" + route + ") joined" +
                           (p.requested_stage >= 0 ? " asking for stage " + std::to_string(p.requested_stage) : "") +
                           (p.requested_stage < 0 && p.preferred_stage >= 0 ? " preferring stage " + std::to_string(p.preferred_stage) : "") +
                           (p.emulate > 1 ? " [emulated " + std::to_string(p.emulate) + "x slower]" : ""));
    if (Job* j = active_job()) assign_and_load(*j, peers[route]);
  }

  void on_heartbeat(Peer& p, Message& m) {
    p.heartbeat = m.body;
  }

  void peer_dead(const std::string& route, const std::string& why) {
    auto it = peers.find(route);
    if (it == peers.end()) return;
    log_warn("router", "peer " + it->second.name + " (" + route + ") is gone: " + why);
    const std::string name = it->second.name;
    peers.erase(it);
    // Every request it held is re-sent elsewhere.
    std::vector<uint64_t> ids;
    for (auto& [id, pd] : pending)
      if (pd.peer == route) ids.push_back(id);
    for (uint64_t id : ids) request_failed(id, /*error=*/false, "peer gone");
    for (auto& jp : jobs) {
      Job& j = *jp;
      j.step_waiting.erase(route);
      for (auto& rs : j.round) rs.waiting.erase(route);
      for (auto& h : j.state_hashes) h.erase(name);
    }
  }

  // The peers serving `stage` of `j`: with ready_only, those that can take work now (ready,
  // not unresponsive). If every ready peer is unresponsive they are all returned: a probe
  // beats a paused stage.
  std::vector<Peer*> stage_peers(const Job& j, int stage, bool ready_only = true) {
    std::vector<Peer*> out, unresponsive;
    const auto now = Clock::now();
    for (auto& [route, p] : peers) {
      if (p.job_id != j.id || p.stage != stage || (ready_only && p.state != PeerState::kReady)) continue;
      (ready_only && now < p.unresponsive_until ? unresponsive : out).push_back(&p);
    }
    return out.empty() ? unresponsive : out;
  }

  // How long a request other than a hop may take: an optimizer step, a round message or a state
  // copy is a few units of work behind whatever the peer has queued, so 4x that from its
  // measured speed + 1 s, at least 2 s, at most the job's backward limit; loading builds a model.
  double request_limit_s(const Pending& pd) const {
    if (pd.kind == Pending::kLoad) return 120;
    if (pd.kind == Pending::kHop) return 1e9;  // hops have their own deadline
    const Job* j = nullptr;
    for (auto& jp : jobs)
      if (jp->id == pd.job) j = jp.get();
    const double cap = j ? j->spec.timeouts.backward_s : 60.0;
    auto pit = peers.find(pd.peer);
    if (pit == peers.end() || pit->second.ms_per_unit <= 0) return std::min(cap, 10.0);
    const Peer& p = pit->second;
    const double expect_s = (p.queued_units + 3.0) * p.ms_per_unit / 1000.0;
    return std::min(cap, std::max(2.0, 4.0 * expect_s + 1.0));
  }

  // A peer for a running job: the stage it pinned (--stage), else the one it prefers
  // (--prefer-stage, movable later), else where the swarm's minimum stage throughput rises most.
  void assign_and_load(Job& j, Peer& p) {
    if (j.transport_bench) {
      if (!p.echo) return;
      p.stage = 0;
    } else {
      if (p.echo) return;
      int stage = p.requested_stage;
      if (stage >= j.S) {
        log_warn("router", "peer " + p.name + " asked for stage " + std::to_string(stage) + " but job " + std::to_string(j.id) + " has " + std::to_string(j.S) + " stages; placing it");
        stage = -1;
      }
      if (stage < 0 && p.preferred_stage >= 0 && p.preferred_stage < j.S) stage = p.preferred_stage;
      if (stage < 0) {
        std::string why;
        stage = place_peer(registry(j), 0.0, &why);
        log_info("router", "placing peer " + p.name + ": " + why);
      }
      p.stage = stage;
    }
    p.job_id = j.id;
    send_load(j, p);
  }

  // LOAD_STAGE for the peer's p.stage; it gets the stage's state before it serves (on_loaded).
  void send_load(Job& j, Peer& p) {
    p.state = PeerState::kLoading;
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kLoad, j.id, 0, p.route, "", 0};
    Message m(MsgType::kLoadStage, id, 0, json{{"job_id", j.id}, {"stage", p.stage}, {"spec", j.spec_json}});
    send_to(p.route, m);
  }

  // ---------------------------------------------------------------- placement and rebalancing

  double now_s() const { return secs(Clock::now() - started_at); }

  // The job's peers as router/placement.h sees them: a peer's speed is what it delivers
  // (its measured ms per work unit), scaled to a stage of cost 1.
  Registry registry(const Job& j) {
    Registry reg;
    reg.stages = j.S;
    reg.stage_cost = stage_costs_from_params(j.stage_params);
    reg.last_move_s = j.last_move_s;
    reg.proposal = j.proposal;
    std::vector<const Peer*> ps;
    for (auto& [route, p] : peers)
      if (p.job_id == j.id && p.stage >= 0 && p.stage < j.S && p.state != PeerState::kQuarantined) ps.push_back(&p);
    std::sort(ps.begin(), ps.end(), [](const Peer* a, const Peer* b) { return a->joined < b->joined; });
    const auto now = Clock::now();
    for (const Peer* p : ps) {
      PeerView v;
      v.id = p->route;
      v.stage = p->stage;
      const double ms = p->ms_per_unit > 0 ? p->ms_per_unit : p->heartbeat.value("ms_per_unit", 0.0);
      v.speed = ms > 0 ? peer_speed(ms, reg.stage_cost[size_t(p->stage)], j.spec.batch.microbatch_size / 3.0) : 0.0;
      v.pinned = p->requested_stage >= 0 && p->requested_stage < j.S;
      v.ready = p->state == PeerState::kReady;
      v.movable = v.ready && now >= p->banned_until;
      v.last_moved_s = p->last_moved_s;
      v.last_from = p->last_from;
      reg.peers.push_back(v);
    }
    return reg;
  }

  // Throughput as the router models it (samples/s): per stage, the bottleneck, and the best
  // assignment of these peers (the benchmarks' ideal).
  json routing_status(const Job& j) {
    json r{{"mode", j.spec.routing.mode}, {"moves", j.moves}, {"rebalance", j.rebalance_reason}};
    if (j.transport_bench) return r;
    const Registry reg = registry(j);
    const std::vector<double> tp = stage_throughputs(reg);
    std::vector<double> speeds;
    for (const auto& p : reg.peers)
      if (p.speed > 0) speeds.push_back(p.speed);
    r["stage_samples_per_s"] = tp;
    r["min_stage_samples_per_s"] = tp.empty() ? 0.0 : *std::min_element(tp.begin(), tp.end());
    r["ideal_samples_per_s"] = speeds.size() >= size_t(j.S) && speeds.size() == reg.peers.size() ? ideal_min_throughput(speeds, reg.stage_cost) : 0.0;
    return r;
  }

  RebalanceParams rebalance_params(const Job& j) const {
    RebalanceParams rp;
    rp.period_s = j.spec.routing.rebalance_period_s;
    rp.min_gain = j.spec.routing.min_gain;
    rp.cooldown_s = j.spec.routing.cooldown_s;
    return rp;
  }

  // On a randomised period: at most one move, decided by plan_rebalance from the registry, and
  // only between rounds (a round's membership is its stage's peers).
  void maybe_rebalance(Job& j) {
    if (!j.spec.routing.rebalance || j.spec.routing.mode != "swarm" || j.round_open || j.phase != Phase::kTrain) return;
    const auto now = Clock::now();
    const RebalanceParams rp = rebalance_params(j);
    auto schedule_next = [&] {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(j.rng);
      j.next_rebalance = now + std::chrono::milliseconds(int64_t(1000 * next_rebalance_delay_s(rp, u)));
    };
    if (j.next_rebalance == Clock::time_point{}) return schedule_next();
    if (now < j.next_rebalance) return;
    schedule_next();
    Rebalance r = plan_rebalance(registry(j), rp, now_s());
    j.proposal = r.proposal;
    if (r.reason != j.rebalance_reason) {
      log_info("router", "rebalance: " + r.reason);
      j.rebalance_reason = r.reason;
    }
    if (!r.move) return;
    const Move& mv = *r.move;
    auto it = peers.find(mv.peer);
    if (it == peers.end()) return;
    Peer& p = it->second;
    const auto cost = stage_costs_from_params(j.stage_params);
    log_info("router", "rebalance: moving peer " + p.name + " from stage " + std::to_string(mv.from) + " to stage " + std::to_string(mv.to) + ": " + mv.reason);
    j.moves.push_back({{"peer", p.name}, {"from", mv.from}, {"to", mv.to}, {"step", j.steps_done},
                       {"min_before", mv.min_before}, {"min_after", mv.min_after}, {"reason", mv.reason}});
    j.last_move_s = p.last_moved_s = now_s();
    p.last_from = mv.from;
    p.ms_per_unit *= cost[size_t(mv.to)] / cost[size_t(mv.from)];
    p.requested_stage = -1;
    p.stage = mv.to;
    // The peer answers what it was already sent for its old stage, then loads the new one and
    // gets its state from a donor (or the stage snapshot) before it serves.
    send_load(j, p);
  }

  // ---------------------------------------------------------------- clients

  void on_submit(const std::string& route, Message& m) {
    const json& b = m.body;
    std::unique_ptr<Job> job;
    if (b.contains("bench_transport")) {
      job = std::make_unique<Job>();
      const json& t = b["bench_transport"];
      job->transport_bench = true;
      job->bench_bytes = t.at("bytes").get<int64_t>();
      job->bench_count = t.at("count").get<int64_t>();
      job->spec.max_inflight = t.value("inflight", 8);
      if (job->bench_bytes <= 0 || job->bench_bytes > int64_t(limits::kMaxTensorBytes) || job->bench_count <= 0)
        return reply_error(route, &m, WireErrc::kMalformed, "bench_transport needs 0 < bytes <= the tensor limit and count > 0");
      job->id = next_job_id++;
    } else {
      try {
        job = make_job(b.at("spec"));
        job->id = next_job_id++;
        const std::string resume = b.value("resume", std::string());
        if (!resume.empty()) resume_job(*job, resume);
        place_job(*job);
      } catch (const InputError& e) {
        Message err(MsgType::kError, m.id, 0, json{{"code", int(WireErrc::kMalformed)}, {"name", "bad_job_spec"}, {"message", e.what()}});
        wire::send(sock, err, &route);
        return;
      }
    }
    job->started = Clock::now();
    Message ok(MsgType::kSubmitted, m.id, 0, json{{"job_id", job->id}});
    wire::send(sock, ok, &route);
    log_info("router", "job " + std::to_string(job->id) + (job->transport_bench ? " (transport benchmark)" : " '" + job->spec.name + "'") + " submitted");
    jobs.push_back(std::move(job));
  }

  // A training job from its spec: validated, data loaded. Throws InputError saying what to fix.
  std::unique_ptr<Job> make_job(const json& spec) {
    auto job = std::make_unique<Job>();
    job->spec = parse_job_spec(spec, /*check_files=*/true);
    compression::parse_codec(job->spec.compression.activations);
    compression::parse_codec(job->spec.compression.gradients);
    compression::parse_codec(job->spec.compression.outer);
    compression::subspace_job(job->spec.compression.activations, job->spec.compression.gradients, job->spec.compression.outer,
                              job->spec.model.d_model, job->spec.model.vocab_size);  // SUBSPACE: k, directions
    job->data = std::make_unique<TokenData>(TokenData::load(job->spec.data, job->spec.model.seq_len, job->spec.model.vocab_size));
    job->spec_json = to_json(job->spec);
    job->unigram = job->data->unigram_loss();
    job->S = job->spec.partition.stages;
    job->M = job->spec.microbatches_per_step();
    job->total_mbs = uint64_t(job->spec.steps) * uint64_t(job->M);
    job->stage_params.assign(size_t(job->S), 0);
    job->snapshots.resize(size_t(job->S));
    job->checkpoint_dir = job->spec.checkpoint.dir;
    job->rng.seed(job->spec.seed);
    return job;
  }

  // `swarm submit --resume DIR`: the newest valid checkpoint under DIR (or DIR itself).
  void resume_job(Job& j, const std::string& dir) {
    std::optional<LoadedCheckpoint> lc = resolve_checkpoint(dir);
    const json& old = lc->ckpt.spec;
    for (const char* key : {"model", "partition", "batch", "seed"}) {
      if (!old.contains(key) || old[key] != j.spec_json[key])
        throw InputError(std::string("--resume ") + dir + ": the job's \"" + key + "\" differs from the checkpoint's (" +
                         (old.contains(key) ? old[key].dump() : "missing") + "); resume with the spec the checkpoint was written with");
    }
    if (j.checkpoint_dir.empty()) j.checkpoint_dir = std::filesystem::path(lc->path).parent_path().string();
    apply_checkpoint(j, *lc);
  }

  // With a state dir, a job lives in <state dir>/jobs/<id>/ (job.json, checkpoints/) so a
  // restarted router picks it up again.
  void place_job(Job& j) {
    if (opt.state_dir.empty()) return;
    j.job_dir = opt.state_dir + "/jobs/" + std::to_string(j.id);
    if (j.checkpoint_dir.empty()) j.checkpoint_dir = j.job_dir + "/checkpoints";
    persist_job(j);
  }

  void persist_job(const Job& j) {
    if (j.job_dir.empty()) return;
    std::error_code ec;
    std::filesystem::create_directories(j.job_dir, ec);
    const std::string path = j.job_dir + "/job.json";
    {
      std::ofstream f(path + ".tmp");
      f << json{{"id", j.id}, {"state", job_state_name(j.state)}, {"reason", j.reason},
                {"checkpoint_dir", j.checkpoint_dir}, {"spec", j.spec_json}}.dump(2) << "\n";
      if (!f) {
        log_warn("router", "cannot write " + path + ".tmp; the job will not survive a router restart");
        return;
      }
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  }

  // At start: jobs of the state dir that had not finished continue from their newest
  // checkpoint (or from the start when they had none).
  void load_state_dir() {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (opt.state_dir.empty()) return;
    fs::create_directories(opt.state_dir + "/jobs", ec);
    std::vector<std::pair<uint64_t, json>> found;
    for (const auto& e : fs::directory_iterator(opt.state_dir + "/jobs", ec)) {
      std::ifstream f(e.path() / "job.json");
      if (!f) continue;
      try {
        json jj = json::parse(f);
        found.emplace_back(jj.at("id").get<uint64_t>(), jj);
      } catch (const std::exception& ex) {
        log_warn("router", "ignoring " + (e.path() / "job.json").string() + ": " + ex.what());
      }
    }
    std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first < b.first; });
    for (auto& [id, jj] : found) {
      next_job_id = std::max(next_job_id, id + 1);
      const std::string st = jj.value("state", std::string());
      if (st != "queued" && st != "loading" && st != "running") continue;
      try {
        auto job = make_job(jj.at("spec"));
        job->id = id;
        job->checkpoint_dir = jj.value("checkpoint_dir", std::string());
        job->job_dir = opt.state_dir + "/jobs/" + std::to_string(id);
        std::vector<std::string> skipped;
        if (auto lc = load_latest_checkpoint(job->checkpoint_dir, &skipped)) apply_checkpoint(*job, *lc);
        else for (const auto& sk : skipped) log_warn("router", "skipped checkpoint: " + sk);
        if (job->resumed.is_null()) log_warn("router", "job " + std::to_string(id) + " has no valid checkpoint in " + job->checkpoint_dir + "; it starts again from step 0");
        job->started = Clock::now();
        log_info("router", "job " + std::to_string(id) + " '" + job->spec.name + "' picked up from the state dir");
        jobs.push_back(std::move(job));
      } catch (const std::exception& ex) {
        log_error("router", "job " + std::to_string(id) + " in the state dir cannot continue: " + ex.what());
      }
    }
  }

  json job_status(const Job& j) {
    // Bytes counted since this router took the job, over the samples trained since then.
    const uint64_t trained = (j.completed - j.resumed_at) * uint64_t(j.spec.batch.microbatch_size);
    auto per_sample = [&](uint64_t bytes) { return trained ? double(bytes) / double(trained) : 0.0; };
    json peers_per_stage = json::array();
    for (int s = 0; s < j.S; ++s) peers_per_stage.push_back(stage_peers(j, s).size());
    const double elapsed = secs((j.state == JobState::kDone || j.state == JobState::kFailed || j.state == JobState::kCancelled ? j.finished : Clock::now()) - j.run_started);
    json s{{"job_id", j.id},
           {"name", j.spec.name},
           {"state", job_state_name(j.state)},
           {"reason", j.reason},
           {"step", j.steps_done},
           {"steps", j.spec.steps},
           {"stages", j.S},
           {"peers_per_stage", peers_per_stage},
           {"train_loss", std::isnan(j.train_loss) ? json(nullptr) : json(j.train_loss)},
           {"val_loss", std::isnan(j.val_loss) ? json(nullptr) : json(j.val_loss)},
           {"unigram_loss", j.unigram},
           {"tokens_per_s", elapsed > 0 ? double(j.train_tokens) / elapsed : 0.0},
           {"elapsed_s", elapsed},
           {"rounds", j.rounds},
           {"fragment_syncs", j.fragment_syncs},
           {"state_hashes", j.state_hashes},
           {"routing", routing_status(j)},
           {"sync_bytes_per_sample", per_sample(j.bytes_outer)},
           {"microbatches", {{"taken", j.taken}, {"completed", j.completed}, {"resent", j.resent},
                             {"duplicates", j.duplicates}, {"rejected", j.rejected},
                             {"lost", (j.state == JobState::kDone) ? j.taken - j.completed : 0}}},
           {"backward", {{"cached", j.backward_cached}, {"recomputed", j.backward_recomputed}}},
           {"wire_bytes", {{"activations", j.bytes_act}, {"gradients", j.bytes_grad}, {"outer", j.bytes_outer}}},
           {"wire_bytes_per_sample", {{"activations", per_sample(j.bytes_act)}, {"gradients", per_sample(j.bytes_grad)}}},
           {"codec_ms", {{"activations", {{"encode", j.codec_us[0] / 1000}, {"decode", j.codec_us[1] / 1000}}},
                         {"gradients", {{"encode", j.codec_us[2] / 1000}, {"decode", j.codec_us[3] / 1000}}}}},
           {"hash_mismatches", j.hash_mismatches},
           {"integrity_failures", j.integrity_failures},
           {"timeouts", j.timeouts},
           {"quarantined", j.quarantined},
           {"stage_restores", j.restores},
           {"resumed", j.resumed},
           {"checkpoints", {{"dir", j.checkpoint_dir}, {"written", j.checkpoints_written}, {"last", j.last_checkpoint}}}};
    // The most recent entries: a status reply stays within the wire's array limit.
    constexpr size_t kHistory = 4096;
    s["history"] = j.history.size() <= kHistory ? j.history : json(std::vector<json>(j.history.end() - kHistory, j.history.end()));
    if (j.transport_bench) {
      s["bench"] = {{"bytes", j.bench_bytes}, {"done", j.bench_done}, {"count", j.bench_count},
                    {"seconds", elapsed}, {"bytes_per_s", elapsed > 0 ? double(j.bench_done) * double(j.bench_bytes) / elapsed : 0.0}};
    }
    return s;
  }

  void on_status(const std::string& route, Message& m) {
    Job* j = nullptr;
    if (m.body.contains("job_id")) j = find_job(m.body["job_id"].get<uint64_t>());
    else if (!jobs.empty()) j = jobs.back().get();
    json body = j ? job_status(*j) : json{{"state", "none"}};
    body["router"] = {{"peers", peers.size()}, {"jobs", jobs.size()}, {"bad_messages", bad_messages}};
    Message rep(MsgType::kStatusReply, m.id, 0, body);
    wire::send(sock, rep, &route);
  }

  void on_cancel(const std::string& route, Message& m) {
    Job* j = find_job(m.body.at("job_id").get<uint64_t>());
    if (!j) return reply_error(route, &m, WireErrc::kMalformed, "no job " + m.body["job_id"].dump());
    if (j->state == JobState::kQueued || j->state == JobState::kLoading || j->state == JobState::kRunning) {
      finish(*j, JobState::kCancelled, "cancelled by a client");
    }
    Message rep(MsgType::kStatusReply, m.id, 0, job_status(*j));
    wire::send(sock, rep, &route);
  }

  void on_peers(const std::string& route, Message& m) {
    json list = json::array();
    const auto now = Clock::now();
    for (auto& [r, p] : peers) {
      list.push_back({{"id", r}, {"name", p.name}, {"device", p.device}, {"device_name", p.device_name},
                      {"device_memory_bytes", p.device_memory_bytes}, {"stage", p.stage},
                      {"requested_stage", p.requested_stage}, {"preferred_stage", p.preferred_stage},
                      {"state", state_name(p.state)}, {"job_id", p.job_id},
                      {"emulate", p.emulate}, {"profile", p.profile}, {"echo", p.echo},
                      {"ms_per_unit", p.ms_per_unit}, {"queued_units", p.queued_units},
                      {"results", p.results}, {"failures", p.failures},
                      {"integrity_failures", p.integrity_failures}, {"timeouts", p.timeouts},
                      {"banned_s", std::max(0.0, secs(p.banned_until - now))},
                      {"last_seen_s", secs(now - p.last_seen)}, {"heartbeat", p.heartbeat}});
    }
    Message rep(MsgType::kPeersReply, m.id, 0, json{{"peers", list}});
    wire::send(sock, rep, &route);
  }

  // `swarm chaos`: a fault for a live peer, named by id or name. The spec is checked here, so
  // a typo is an error for the user, not a log line on a remote host.
  void on_chaos(const std::string& route, Message& m) {
    const std::string who = m.body.at("peer").get<std::string>();
    FaultSpec spec;
    try {
      spec = parse_fault_json(m.body.at("fault"));
    } catch (const InputError& e) {
      return reply_error(route, &m, WireErrc::kMalformed, std::string("bad fault: ") + e.what());
    }
    Peer* target = nullptr;
    for (auto& [r, p] : peers)
      if (r == who || p.name == who) target = &p;
    if (!target) return reply_error(route, &m, WireErrc::kMalformed, "no peer \"" + who + "\"; `swarm peers` lists them");
    Message f(MsgType::kChaos, next_req++, 0, json{{"fault", to_json(spec)}});
    send_to(target->route, f);
    log_warn("router", "chaos: fault " + to_string(spec) + " sent to peer " + target->name);
    Message rep(MsgType::kChaosReply, m.id, 0, json{{"peer", target->route}, {"name", target->name}, {"fault", to_string(spec)}});
    wire::send(sock, rep, &route);
  }

  // ---------------------------------------------------------------- replies from peers

  void on_reply(Peer& p, Message& m) {
    auto it = pending.find(m.id);
    if (it == pending.end()) {
      // A reply to a request that is no longer pending: late (it was re-sent elsewhere or the
      // job moved on) or a duplicate. Results are counted; nothing else changes.
      Job* j = active_job();
      if (m.type == MsgType::kResult && m.id > 0 && m.id < next_req) {
        if (j) j->duplicates++;
      } else if (m.type == MsgType::kError) {
        log_warn("router", "peer " + p.name + " reports: " + m.body.value("message", std::string("?")));
      }
      return;
    }
    if (it->second.peer != p.route) return;  // not from the peer we asked
    p.timeouts_in_row = 0;
    p.unresponsive_until = Clock::time_point{};
    const Pending pd = it->second;
    pending.erase(it);
    release(pd);
    Job* j = find_job(pd.job);
    if (!j || (j->state != JobState::kRunning && j->state != JobState::kLoading)) return;
    if (m.type == MsgType::kError) {
      p.failures++;
      const std::string msg = m.body.value("message", std::string("?"));
      log_warn("router", "peer " + p.name + " failed a " + std::to_string(int(pd.kind)) + " request: " + msg);
      if (pd.kind == Pending::kLoad) {
        p.state = PeerState::kIdle;
        ban(p);
        return;
      }
      // A request that reached the peer damaged: re-sent at once, held against the peer's
      // integrity record rather than banning it.
      const int code = m.body.value("code", 0);
      if (code == int(WireErrc::kChecksum) || code == int(WireErrc::kTruncated)) {
        fail(m.id, pd, /*error=*/false, msg);
        return integrity_failure(j, p.route, "received a damaged request (" + msg + ")");
      }
      return fail(m.id, pd, /*error=*/true, msg);
    }
    p.results++;
    if (auto ct = m.body.find("codec_us"); ct != m.body.end() && ct->is_array() && ct->size() == 4)
      for (size_t k = 0; k < 4; ++k)
        if ((*ct)[k].is_number()) j->codec_us[k] += std::max(0.0, (*ct)[k].get<double>());
    if (m.body.contains("compute_ms") && pd.units > 0) {
      const double per = m.body["compute_ms"].get<double>() / pd.units;
      p.ms_per_unit = p.ms_per_unit == 0 ? per : 0.8 * p.ms_per_unit + 0.2 * per;
    }
    switch (pd.kind) {
      case Pending::kHop:
        if (j->transport_bench) {
          bench_result(*j, pd.mb);
          return;
        }
        return on_hop_result(*j, p, pd, m);
      case Pending::kLoad: return on_loaded(*j, p, m);
      case Pending::kStep:
        j->step_waiting.erase(p.route);
        return;
      case Pending::kRoundBegin: return on_round_delta(*j, p, m);
      case Pending::kRoundApply: return on_round_done(*j, p, m);
      case Pending::kStateRequest: return on_state_reply(*j, p, pd.target, m);
      case Pending::kStateLoad:
        p.state = PeerState::kReady;
        note_hash(*j, p, m);
        log_info("router", "peer " + p.name + " synced stage " + std::to_string(p.stage) + (pd.target.empty() ? " from a donor" : " from " + pd.target));
        return;
      case Pending::kSnapshot: return on_snapshot_reply(*j, p, int(pd.mb), m);
    }
  }

  void ban(Peer& p) {
    p.bans++;
    const double s = std::min(60.0, 1.0 * std::pow(2.0, p.bans - 1));
    p.banned_until = Clock::now() + std::chrono::milliseconds(int64_t(s * 1000));
  }

  // The peer no longer owes this request's work.
  void release(const Pending& pd) {
    auto pit = peers.find(pd.peer);
    if (pit != peers.end()) pit->second.queued_units = std::max(0.0, pit->second.queued_units - pd.units);
  }

  // A request still pending failed (dead peer, deadline): re-send its work.
  void request_failed(uint64_t id, bool error, const std::string& why) {
    auto it = pending.find(id);
    if (it == pending.end()) return;
    const Pending pd = it->second;
    pending.erase(it);
    release(pd);
    fail(id, pd, error, why);
  }

  // Request `id` (already out of `pending`) failed: an error bans its peer; its work is re-sent.
  void fail(uint64_t id, const Pending& pd, bool error, const std::string& why) {
    auto pit = peers.find(pd.peer);
    if (pit != peers.end() && error) ban(pit->second);
    Job* j = find_job(pd.job);
    if (!j) return;
    switch (pd.kind) {
      case Pending::kHop: {
        auto mit = j->inflight.find(pd.mb);
        if (mit == j->inflight.end()) return;
        Flight& mb = mit->second;
        if (mb.req_id != id) return;
        mb.tried.insert(pd.peer);
        mb.waiting = true;
        mb.req_id = 0;
        j->resent++;
        if (error) j->rejected++;
        // Backoff grows with the attempts on this hop: 50 ms, 100 ms, ... up to 2 s.
        mb.not_before = Clock::now() + std::chrono::milliseconds(std::min<int64_t>(2000, 50LL << std::min<uint32_t>(mb.attempts, 6)));
        if (int(mb.attempts) >= j->spec.timeouts.max_attempts && !mb.eval) {
          finish(*j, JobState::kFailed, "microbatch " + std::to_string(mb.index) + " failed " + std::to_string(mb.attempts) +
                                            " times at stage " + std::to_string(mb.stage) + " (last: " + why + ")");
        }
        return;
      }
      case Pending::kLoad:
        // Idle again, and offered the job again when the ban ends (tick).
        if (pit != peers.end() && pit->second.state == PeerState::kLoading) {
          pit->second.state = PeerState::kIdle;
          if (!error) ban(pit->second);
        }
        return;
      case Pending::kStep:
        j->step_waiting.erase(pd.peer);
        return;
      case Pending::kRoundBegin:
      case Pending::kRoundApply:
        for (auto& rs : j->round) rs.waiting.erase(pd.peer);
        return;
      case Pending::kStateRequest: {
        // Ask another donor for the waiting peer.
        auto t = peers.find(pd.target);
        if (t != peers.end()) start_sync(*j, t->second);
        return;
      }
      case Pending::kStateLoad:
        // The copy did not land: another donor, or the snapshot.
        if (pit != peers.end() && pit->second.state == PeerState::kSyncing) start_sync(*j, pit->second);
        return;
      case Pending::kSnapshot:
        j->snapshot_waiting.erase(pd.peer);
        return;
    }
  }

  // ---------------------------------------------------------------- loading and syncing

  void on_loaded(Job& j, Peer& p, Message& m) {
    if (!j.transport_bench) {
      const int64_t params = m.body.value("params", int64_t(0));
      int64_t& known = j.stage_params[size_t(p.stage)];
      if (params <= 0 || (known > 0 && params != known)) {
        log_warn("router", "peer " + p.name + " loaded stage " + std::to_string(p.stage) + " with " + std::to_string(params) +
                               " parameters, expected " + std::to_string(known) + "; not using it");
        p.state = PeerState::kIdle;
        ban(p);
        return;
      }
      known = params;
    }
    if (j.transport_bench) {
      p.state = PeerState::kReady;
      return;
    }
    start_sync(j, p);
  }

  // A loaded peer gets the stage's state before it serves: the snapshot when it is current (a
  // resumed job), else a live donor's theta_g and momentum, else the snapshot however old (the
  // whole stage had died: the status counts the steps it lost), else (nothing learned yet) its
  // initial weights, the same on every peer.
  void start_sync(Job& j, Peer& p) {
    p.state = PeerState::kSyncing;
    const auto& snap = j.snapshots[size_t(p.stage)];
    if (snap.valid && snap.step == j.steps_done) return restore_from_snapshot(j, p);
    Peer* donor = nullptr;
    for (Peer* d : stage_peers(j, p.stage))
      if (d != &p) { donor = d; break; }
    if (donor && j.rounds > 0) {
      uint64_t id = next_req++;
      pending[id] = Pending{Pending::kStateRequest, j.id, 0, donor->route, p.route, 0};
      // While the group steps together it is one optimizer: a joiner copies all of a donor's state.
      Message m(MsgType::kStateRequest, id, 0, json{{"job_id", j.id}, {"full", dense_step(j, j.steps_done + 1)}});
      send_to(donor->route, m);
      return;
    }
    if (!donor && snap.valid) return restore_from_snapshot(j, p);
    if (!donor && j.steps_done > 0)
      log_warn("router", "stage " + std::to_string(p.stage) + " has no live peer and no snapshot yet; peer " + p.name + " starts from the initial weights");
    p.state = PeerState::kReady;
    log_info("router", "peer " + p.name + " ready on stage " + std::to_string(p.stage));
  }

  void restore_from_snapshot(Job& j, Peer& p) {
    const auto& snap = j.snapshots[size_t(p.stage)];
    const int lost = j.steps_done - snap.step;
    bool others = false;
    for (Peer* d : stage_peers(j, p.stage)) others |= d != &p;
    if (j.state == JobState::kRunning && !others) {  // the stage had died mid-run (not a job resuming)
      j.restores.push_back({{"stage", p.stage}, {"peer", p.name}, {"snapshot_step", snap.step}, {"step", j.steps_done}, {"lost_steps", lost}});
      log_warn("router", "stage " + std::to_string(p.stage) + " restarts from its snapshot of step " + std::to_string(snap.step) +
                             " on peer " + p.name + " (" + std::to_string(lost) + " step(s) of that stage lost)");
    }
    const StageState& st = snap.state;
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kStateLoad, j.id, 0, p.route, "the stage snapshot of step " + std::to_string(snap.step), 0};
    Message m(MsgType::kStateLoad, id, 0, json{{"job_id", j.id}, {"adam_step", st.adam_step}});
    for (const auto* v : {&st.theta_g, &st.momentum, &st.theta, &st.adam_m, &st.adam_v}) m.tensors.push_back(flat_tensor(*v));
    send_to(p.route, m);
  }

  static wire::Tensor flat_tensor(const std::vector<float>& v) {
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {int64_t(v.size())}, compression::CodecSpec{}, v.size() * 4);
    std::memcpy(t.data.data(), v.data(), v.size() * 4);
    wire::seal(t);
    return t;
  }

  // A float tensor of `shape`, decoded into `out` and all finite; else what is wrong with it.
  static std::string decode_checked(const wire::Tensor& t, const std::vector<int64_t>& shape, std::vector<float>* out) {
    if (t.desc.dtype != wire::DType::kF32 || t.desc.shape != shape) return "a tensor of the wrong dtype or shape";
    const bool sub = t.desc.codec.codec == compression::Codec::kSubspace;  // SUBSPACE: coefficients only
    try {
      out->resize(size_t(sub ? compression::subspace_tokens(t.desc.codec, t.desc.numel()) * t.desc.codec.k : t.desc.numel()));
      if (sub) compression::decode_subspace(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), t.desc.numel(), out->data(), nullptr);
      else compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), t.desc.numel(), out->data());
    } catch (const InputError& e) {
      return std::string("an undecodable tensor: ") + e.what();
    }
    for (float f : *out)
      if (!std::isfinite(f)) return "non-finite values (NaN or Inf)";
    return "";
  }

  // A flat fp32 parameter tensor of n values, decoded and all finite.
  static bool flat_from(const wire::Tensor& t, int64_t n, std::vector<float>* out) {
    return t.desc.codec.codec != compression::Codec::kSubspace && decode_checked(t, {n}, out).empty();
  }

  void on_state_reply(Job& j, Peer& donor, const std::string& target, Message& m) {
    auto t = peers.find(target);
    if (t == peers.end() || t->second.state != PeerState::kSyncing) return;
    if (m.tensors.size() != 2 && m.tensors.size() != 5) return start_sync(j, t->second);
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kStateLoad, j.id, 0, target, "", 0};
    Message load(MsgType::kStateLoad, id, 0, json{{"job_id", j.id}});
    if (m.tensors.size() == 5) load.body["adam_step"] = m.body.value("adam_step", int64_t(0));
    load.tensors = std::move(m.tensors);
    send_to(target, load);
  }

  // ---------------------------------------------------------------- the job loop

  void tick() {
    const auto now = Clock::now();
    std::set<std::string> gone;
    gone.swap(unreachable);
    for (const auto& r : gone) peer_dead(r, "unreachable");
    // Heartbeats to peers, and liveness.
    if (secs(now - last_beat) * 1000 >= opt.heartbeat_ms) {
      last_beat = now;
      std::vector<std::string> dead;
      for (auto& [route, p] : peers) {
        if (secs(now - p.last_seen) * 1000 > double(opt.heartbeat_ms) * opt.liveness) dead.push_back(route);
      }
      for (auto& r : dead) peer_dead(r, "missed " + std::to_string(opt.liveness) + " heartbeats");
      for (auto& [route, p] : peers) {
        Message hb(MsgType::kHeartbeat);
        send_to(route, hb);
      }
      for (auto it = clients.begin(); it != clients.end();)
        it = secs(now - it->second) > 300 ? clients.erase(it) : std::next(it);
    }
    // Requests past their deadline are re-sent elsewhere (no ban: the peer may just be slow).
    std::vector<uint64_t> expired;
    for (auto& jp : jobs) {
      for (auto& [idx, mb] : jp->inflight)
        if (!mb.waiting && now > mb.deadline) expired.push_back(mb.req_id);
    }
    for (auto& [id, pd] : pending)
      if (pd.kind != Pending::kHop && secs(now - pd.sent) > request_limit_s(pd)) expired.push_back(id);
    for (uint64_t id : expired) {
      auto it = pending.find(id);
      if (it == pending.end()) continue;
      log_warn("router", "request " + std::to_string(id) + " to " + peer_name(it->second.peer) + " passed its deadline; re-sending");
      auto pit = peers.find(it->second.peer);
      if (pit != peers.end()) {
        // Not a ban (it may just be slow), but its expected speed halves with every timeout, so
        // it gets less work; three in a row with no answer between make it unresponsive: no
        // new work for a growing time, then a probe. Any answer restores it.
        Peer& p = pit->second;
        p.timeouts++;
        if (it->second.kind == Pending::kHop) p.ms_per_unit = p.ms_per_unit > 0 ? std::max(2.0 * p.ms_per_unit, 100.0) : 1000.0;
        if (++p.timeouts_in_row >= 3) {
          const double s = std::min(60.0, std::pow(2.0, double(p.timeouts_in_row - 2)));
          p.unresponsive_until = now + std::chrono::milliseconds(int64_t(s * 1000));
          log_warn("router", "peer " + p.name + " is unresponsive (" + std::to_string(p.timeouts_in_row) + " timeouts in a row); no new work for " + std::to_string(int(s)) + " s");
        }
        if (Job* j = find_job(it->second.job)) j->timeouts++;
      }
      request_failed(id, false, "deadline passed");
    }
    // Start the next queued job when none runs.
    if (!active_job()) {
      for (auto& jp : jobs) {
        if (jp->state == JobState::kQueued) {
          start_job(*jp);
          break;
        }
      }
    }
    if (Job* j = active_job()) {
      // A peer whose load failed is offered the job again once its ban is over.
      for (auto& [route, p] : peers)
        if (p.state == PeerState::kIdle && !p.echo && p.job_id == j->id && now >= p.banned_until) assign_and_load(*j, p);
      advance(*j);
      if (j->state == JobState::kRunning && !j->transport_bench) maybe_rebalance(*j);
    }
  }

  std::string peer_name(const std::string& route) {
    auto it = peers.find(route);
    return it == peers.end() ? route : it->second.name;
  }

  void start_job(Job& j) {
    j.state = JobState::kLoading;
    j.run_started = Clock::now();
    // Stage servers left on another job (finished) are free again.
    for (auto& [route, p] : peers) {
      p.job_id = 0;
      p.stage = -1;
      p.state = PeerState::kIdle;
      p.integrity_failures = 0;
    }
    // Peers that pinned a stage first, then those that prefer one, then the rest where
    // place_peer puts them (it sees the others already placed).
    auto pass_of = [](const Peer& p) { return p.requested_stage >= 0 ? 0 : p.preferred_stage >= 0 ? 1 : 2; };
    for (int pass = 0; pass < 3; ++pass)
      for (auto& [route, p] : peers)
        if (pass_of(p) == pass) assign_and_load(j, p);
    log_info("router", "job " + std::to_string(j.id) + " starting: " + std::to_string(j.S) + " stage(s), " +
                           std::to_string(peers.size()) + " peer(s)");
  }

  // Stages with no ready peer, as a sentence for the status.
  std::string empty_stages(Job& j) {
    std::string s;
    for (int st = 0; st < j.S; ++st)
      if (stage_peers(j, st).empty()) s += (s.empty() ? "" : ", ") + std::to_string(st);
    return s;
  }

  void advance(Job& j) {
    const std::string empty = empty_stages(j);
    if (j.state == JobState::kLoading) {
      if (!empty.empty()) {
        j.reason = "waiting for peers: stage(s) " + empty + " have no ready peer";
        return;
      }
      j.state = JobState::kRunning;
      j.reason.clear();
      j.run_started = Clock::now();
      persist_job(j);
      log_info("router", "job " + std::to_string(j.id) + " running");
    }
    j.reason = empty.empty() ? "" : "paused: stage(s) " + empty + " have no live peer; start a stage server for them";
    if (j.transport_bench) return advance_bench(j);

    switch (j.phase) {
      case Phase::kTrain: {
        // Take microbatches up to the next barrier (a step in `sync`; a round, an evaluation
        // or the end in `async`), fixed when the phase begins.
        if (j.barrier == 0) j.barrier = next_barrier_mb(j);
        while (j.inflight.size() < size_t(j.spec.max_inflight) && j.taken < j.barrier) take(j, j.taken);
        dispatch_waiting(j);
        if (j.completed == j.barrier && j.inflight.empty()) {
          j.barrier = 0;
          on_barrier(j);
        }
        return;
      }
      case Phase::kStepping:
        if (j.step_waiting.empty()) {
          after_step(j);
        }
        return;
      case Phase::kRound:
        return advance_round(j);
      case Phase::kEval: {
        while (j.inflight.size() < size_t(j.spec.max_inflight) && j.eval_next < uint64_t(j.spec.eval.batches)) take_eval(j, j.eval_next++);
        dispatch_waiting(j);
        if (j.inflight.empty() && j.eval_next >= uint64_t(j.spec.eval.batches)) {
          j.val_loss = j.eval_count ? j.eval_sum / j.eval_count : NAN;
          j.last_eval_step = j.steps_done;
          json h{{"step", j.steps_done}, {"val_loss", j.val_loss}};
          j.history.push_back(h);
          log_info("router", "job " + std::to_string(j.id) + " step " + std::to_string(j.steps_done) + ": val loss " + std::to_string(j.val_loss));
          after_step(j);
        }
        return;
      }
      case Phase::kSnapshot:
        if (j.snapshot_waiting.empty() || Clock::now() > j.snapshot_deadline) end_snapshot(j);
        return;
      case Phase::kFinishing:
        return;
    }
  }

  // The microbatch count at which the job loop next stops: every step in `sync`; in `async`
  // the next step with a round, an overlapped round's application, an evaluation, a
  // checkpoint or a snapshot, or the end.
  uint64_t next_barrier_mb(const Job& j) {
    const uint64_t M = uint64_t(j.M);
    if (j.spec.schedule == "sync") return std::min(j.total_mbs, (uint64_t(j.steps_done) + 1) * M);
    const int H = j.spec.diloco.inner_steps, F = j.spec.diloco.fragments;
    auto multiple = [](int s, int every) { return every > 0 && s % every == 0; };
    for (int s = j.steps_done + 1; s < j.spec.steps; ++s) {
      const bool round = F == 1 ? s - j.last_round_step >= H : diloco::fragment_due(s, H, F) >= 0;
      if (round || (j.round_open && s >= j.round_apply_step) || multiple(s, j.spec.eval.every_steps) ||
          multiple(s, j.spec.checkpoint.every_steps) || multiple(s, j.spec.checkpoint.snapshot_every_steps))
        return std::min(j.total_mbs, uint64_t(s) * M);
    }
    return j.total_mbs;
  }

  // All microbatches up to a barrier completed.
  void on_barrier(Job& j) {
    j.steps_done = int(j.completed / uint64_t(j.M));
    if (dense_step(j, j.steps_done)) return start_round(j, "grad", 0);  // the group sums gradients, then steps
    if (j.spec.schedule == "sync") {
      j.phase = Phase::kStepping;
      for (int s = 0; s < j.S; ++s)
        for (Peer* p : stage_peers(j, s)) {
          uint64_t id = next_req++;
          pending[id] = Pending{Pending::kStep, j.id, 0, p->route, "", 0};
          Message m(MsgType::kStep, id, 0, json{{"job_id", j.id}});
          if (send_to(p->route, m)) j.step_waiting.insert(p->route);
        }
      return;
    }
    after_step(j);
  }

  // After a step (sync) or a barrier (async), and again after each thing it starts: a round,
  // then an evaluation, then a snapshot (and checkpoint), then more training or the end. Each
  // is due at most once per step.
  void after_step(Job& j) {
    j.phase = Phase::kTrain;
    const bool end = j.completed >= j.total_mbs;
    // An overlapped round is applied at its step (or at the end).
    if (j.round_open && (j.steps_done >= j.round_apply_step || end)) {
      j.phase = Phase::kRound;
      return;
    }
    const int f = round_due(j);
    if (f >= 0) {
      start_round(j, "delta", f);
      if (j.phase == Phase::kRound) return;  // blocking round: advance_round comes back here
    }
    const int every = j.spec.eval.every_steps;
    const bool eval_due = j.last_eval_step != j.steps_done && (end || (every > 0 && j.steps_done % every == 0));
    if (eval_due) return start_eval(j);
    if (checkpoint_due(j) || snapshot_due(j)) return start_snapshot(j);
    write_progress(j);
    if (end) finish(j, JobState::kDone, "");
  }

  void start_eval(Job& j) {
    j.phase = Phase::kEval;
    j.eval_sum = 0;
    j.eval_count = 0;
    j.eval_next = 0;
  }

  // ---------------------------------------------------------------- microbatches

  wire::Tensor tokens_tensor(const std::vector<int32_t>& v, int B, int T) {
    wire::Tensor t = wire::make_tensor(wire::DType::kI32, {B, T}, compression::CodecSpec{}, v.size() * 4);
    std::memcpy(t.data.data(), v.data(), v.size() * 4);
    wire::seal(t);
    return t;
  }

  Flight& new_mb(Job& j, uint64_t key, uint64_t index, bool eval) {
    const int B = j.spec.batch.microbatch_size, T = j.spec.model.seq_len;
    Flight mb;
    mb.index = index;
    mb.eval = eval;
    mb.inputs.resize(size_t(j.S));
    mb.have_input.assign(size_t(j.S), false);
    mb.fwd_peer.resize(size_t(j.S));
    ::swarm::Microbatch d = sample_microbatch(*j.data, eval ? Split::kVal : Split::kTrain, j.spec.seed, index, B, T);
    mb.inputs[0] = tokens_tensor(d.x, B, T);
    mb.have_input[0] = true;
    mb.targets = tokens_tensor(d.y, B, T);
    mb.stage = 0;
    mb.kind = eval ? HopKind::kEval : (j.S == 1 ? HopKind::kForwardLoss : HopKind::kForward);
    auto [it, ok] = j.inflight.emplace(key, std::move(mb));
    SWARM_CHECK(ok, "microbatch taken twice");
    return it->second;
  }

  void take(Job& j, uint64_t index) {
    new_mb(j, index, index, false);
    j.taken++;
    write_progress(j);
  }
  void take_eval(Job& j, uint64_t index) { new_mb(j, kEvalBit | index, index, true); }

  void dispatch_waiting(Job& j) {
    const auto now = Clock::now();
    for (auto& [key, mb] : j.inflight)
      if (mb.waiting && now >= mb.not_before) send_hop(j, key, mb);
  }

  // Static routing (GPipe/DeepSpeed style, for comparison): pipeline i chains the i-th peer of
  // every stage in join order; microbatch k always runs on pipeline k mod P.
  std::vector<Peer*> static_peer(Job& j, const Flight& mb) {
    std::vector<std::vector<std::string>> by_stage(size_t(j.S));
    std::vector<Peer*> ready;
    for (auto& [route, p] : peers)
      if (p.job_id == j.id && p.state == PeerState::kReady) ready.push_back(&p);
    std::sort(ready.begin(), ready.end(), [](Peer* a, Peer* b) { return a->joined < b->joined; });
    for (Peer* p : ready) by_stage[size_t(p->stage)].push_back(p->route);
    const auto pipes = static_pipelines(by_stage);
    const int k = static_pipeline_for(mb.index, pipes.size());
    if (k < 0) return {};
    return {&peers.at(pipes[size_t(k)][size_t(mb.stage)])};
  }

  static double hop_units(HopKind k) {
    switch (k) {
      case HopKind::kForward: case HopKind::kEval: return kForwardUnits;
      case HopKind::kForwardLoss: return kForwardLossUnits;
      case HopKind::kBackward: return kBackwardRecomputeUnits;
    }
    return 1;
  }

  void send_hop(Job& j, uint64_t key, Flight& mb) {
    auto candidates_peers = stage_peers(j, mb.stage);
    if (j.spec.routing.mode == "static" && !j.transport_bench) candidates_peers = static_peer(j, mb);
    if (candidates_peers.empty()) return;  // paused until a peer of the stage is ready
    const auto now = Clock::now();
    size_t tried_live = 0;
    for (Peer* p : candidates_peers) tried_live += mb.tried.count(p->route);
    std::vector<Candidate> cands;
    for (Peer* p : candidates_peers) {
      Candidate c;
      c.id = p->route;
      c.queued_units = p->queued_units;
      c.ms_per_unit = p->ms_per_unit > 0 ? p->ms_per_unit : p->heartbeat.value("ms_per_unit", 0.0);
      c.affinity = mb.kind == HopKind::kBackward && mb.fwd_peer[size_t(mb.stage)] == p->route;
      // A peer that failed this hop is tried again only once every live peer has failed it.
      c.excluded = now < p->banned_until || (mb.tried.count(p->route) && tried_live < candidates_peers.size());
      cands.push_back(c);
    }
    const double units = hop_units(mb.kind);
    int pick = choose_peer(cands, units, kBackwardCachedUnits);
    if (pick < 0) {
      // Everyone is banned or already failed this hop: use the least recently banned.
      pick = 0;
      for (size_t i = 1; i < candidates_peers.size(); ++i)
        if (candidates_peers[i]->banned_until < candidates_peers[size_t(pick)]->banned_until) pick = int(i);
    }
    Peer& p = *candidates_peers[size_t(pick)];
    const double my_units = cands[size_t(pick)].affinity ? kBackwardCachedUnits : units;

    MsgType type = MsgType::kForward;
    switch (mb.kind) {
      case HopKind::kForward: type = MsgType::kForward; break;
      case HopKind::kForwardLoss: type = MsgType::kForwardLoss; break;
      case HopKind::kBackward: type = MsgType::kBackward; break;
      case HopKind::kEval: type = MsgType::kEval; break;
    }
    const uint64_t id = next_req++;
    Message m(type, id, mb.attempts, json{{"job_id", j.id}, {"mb", mb.index}, {"stage", mb.stage}, {"eval", mb.eval}});
    SWARM_CHECK(mb.have_input[size_t(mb.stage)], "stage input missing");
    m.tensors.push_back(wire::share(mb.inputs[size_t(mb.stage)]));
    const bool last = mb.stage == j.S - 1;
    if (mb.kind == HopKind::kForwardLoss || (mb.kind == HopKind::kEval && last)) m.tensors.push_back(wire::share(mb.targets));
    if (mb.kind == HopKind::kBackward) m.tensors.push_back(wire::share(mb.grad));
    if (!mb.eval) {
      for (auto& t : m.tensors) wire::compress(t);  // what the wire will carry (entropy=zstd)
      if (mb.stage > 0) j.bytes_act += m.tensors[0].desc.wire_bytes();
      if (mb.kind == HopKind::kBackward) j.bytes_grad += m.tensors.back().desc.wire_bytes();
    }
    if (!send_to(p.route, m)) return;  // peer gone: it is re-dispatched on the next tick
    mb.attempts++;
    mb.req_id = id;
    mb.peer = p.route;
    mb.waiting = false;
    // Deadline: generous multiple of what this peer should need, within the job's bounds.
    const double per = p.ms_per_unit > 0 ? p.ms_per_unit : 1000.0;
    const double expect_ms = (p.queued_units + my_units) * per;
    const double cap_s = mb.kind == HopKind::kBackward || mb.kind == HopKind::kForwardLoss ? j.spec.timeouts.backward_s : j.spec.timeouts.forward_s;
    const double dl_s = std::min(cap_s, std::max(2.0, 4.0 * expect_ms / 1000.0 + 1.0));
    mb.deadline = now + std::chrono::milliseconds(int64_t(dl_s * 1000));
    p.queued_units += my_units;
    pending[id] = Pending{Pending::kHop, j.id, key_of(mb), p.route, "", my_units};
  }

  static uint64_t key_of(const Flight& mb) { return mb.eval ? (kEvalBit | mb.index) : mb.index; }

  void on_hop_result(Job& j, Peer& p, const Pending& pd, Message& m) {
    const uint64_t key = pd.mb;
    auto it = j.inflight.find(key);
    if (it == j.inflight.end()) return;
    Flight& mb = it->second;
    if (mb.req_id != m.id) return;
    const size_t s = size_t(mb.stage);
    const bool last = mb.stage == j.S - 1;
    // What a good answer to this hop carries.
    size_t want_tensors = 0;
    bool want_loss = false;
    switch (mb.kind) {
      case HopKind::kEval: want_tensors = last ? 0 : 1; want_loss = last; break;
      case HopKind::kForward: want_tensors = 1; break;
      case HopKind::kForwardLoss: want_tensors = j.S == 1 ? 0 : 1; want_loss = true; break;
      case HopKind::kBackward: want_tensors = mb.stage == 0 ? 0 : 1; break;
    }
    std::string bad;
    if (m.tensors.size() != want_tensors)
      bad = "answered " + std::to_string(m.tensors.size()) + " tensor(s), expected " + std::to_string(want_tensors);
    else if (want_loss && !(m.body.contains("loss") && m.body["loss"].is_number() && std::isfinite(m.body["loss"].get<double>())))
      bad = "answered without a finite loss";
    else if (want_tensors == 1)
      bad = check_activation(j, m.tensors[0]);
    if (!bad.empty()) {
      log_warn("router", "peer " + p.name + " " + bad + "; re-sending microbatch " + std::to_string(mb.index));
      p.failures++;
      const std::string route = p.route;
      fail(m.id, pd, /*error=*/true, bad);
      return integrity_failure(&j, route, bad);
    }
    mb.req_id = 0;
    mb.waiting = true;
    mb.tried.clear();
    mb.attempts = 0;
    auto release_input = [&](size_t st) {
      mb.inputs[st] = wire::Tensor();
      mb.have_input[st] = false;
    };
    switch (mb.kind) {
      case HopKind::kEval:
        if (last) {
          j.eval_sum += m.body["loss"].get<double>();
          j.eval_count++;
          j.inflight.erase(it);
          return;
        }
        mb.inputs[s + 1] = std::move(m.tensors[0]);
        mb.have_input[s + 1] = true;
        release_input(s);
        mb.stage++;
        return;
      case HopKind::kForward:
        mb.fwd_peer[s] = p.route;
        mb.inputs[s + 1] = std::move(m.tensors[0]);
        mb.have_input[s + 1] = true;
        mb.stage++;
        mb.kind = mb.stage == j.S - 1 ? HopKind::kForwardLoss : HopKind::kForward;
        return;
      case HopKind::kForwardLoss:
        record_loss(j, mb.index, m.body["loss"].get<double>());
        release_input(s);
        if (j.S == 1) return complete(j, it);
        mb.grad = std::move(m.tensors[0]);
        mb.stage--;
        mb.kind = HopKind::kBackward;
        return;
      case HopKind::kBackward:
        if (m.body.value("cached", false)) j.backward_cached++;
        else j.backward_recomputed++;
        release_input(s);
        if (mb.stage == 0) return complete(j, it);
        mb.grad = std::move(m.tensors[0]);
        mb.stage--;
        return;
    }
  }

  // An activation or activation gradient must be [B, T, d_model] fp32 values, all finite. The
  // router decodes a copy to check (a few microseconds per hop) so that a lying peer's output
  // never reaches the next stage.
  std::vector<float> scratch;
  std::string check_activation(const Job& j, const wire::Tensor& t) {
    const std::string bad = decode_checked(t, {j.spec.batch.microbatch_size, j.spec.model.seq_len, j.spec.model.d_model}, &scratch);
    return bad.empty() ? bad : "answered " + bad;
  }

  // A peer sent something corrupt, misshapen or non-finite. After opt.quarantine_after of those
  // it is quarantined: no more work for the rest of the job, and reported in the status. The
  // last usable peer of a stage is kept (with a warning): a paused job helps nobody.
  void integrity_failure(Job* j, const std::string& route, const std::string& what) {
    auto pit = peers.find(route);
    if (pit == peers.end()) return;
    Peer& p = pit->second;
    p.integrity_failures++;
    if (j) j->integrity_failures++;
    if (!j || p.state == PeerState::kQuarantined || p.integrity_failures < uint64_t(opt.quarantine_after)) return;
    if (p.stage >= 0 && stage_peers(*j, p.stage).size() <= 1) {
      log_warn("router", "peer " + p.name + " keeps failing integrity checks but is the last peer of stage " + std::to_string(p.stage) + "; keeping it");
      return;
    }
    p.state = PeerState::kQuarantined;
    const std::string reason = std::to_string(p.integrity_failures) + " integrity failures, the last: " + what;
    j->quarantined.push_back({{"peer", p.name}, {"id", route}, {"stage", p.stage}, {"reason", reason}});
    log_warn("router", "peer " + p.name + " quarantined (" + reason + ")");
    std::vector<uint64_t> ids;
    for (auto& [id, pd] : pending)
      if (pd.peer == route) ids.push_back(id);
    for (uint64_t id : ids) request_failed(id, false, "peer quarantined");
  }

  void record_loss(Job& j, uint64_t index, double loss) {
    const uint64_t step = index / uint64_t(j.M);
    auto& [sum, n] = j.step_loss[step];
    sum += loss;
    n++;
    if (n == j.M) {
      j.train_loss = sum / n;
      const double elapsed = secs(Clock::now() - j.run_started);
      j.history.push_back({{"step", step + 1}, {"train_loss", j.train_loss},
                           {"tokens_per_s", elapsed > 0 ? double(j.train_tokens) / elapsed : 0.0}});
      j.step_loss.erase(step);
    }
  }

  void complete(Job& j, std::map<uint64_t, Flight>::iterator it) {
    j.completed++;
    j.train_tokens += int64_t(j.spec.batch.microbatch_size) * j.spec.model.seq_len;
    j.inflight.erase(it);
    j.steps_done = int(j.completed / uint64_t(j.M));
  }

  // ---------------------------------------------------------------- rounds

  // Whether the group sums gradients and takes one step together at job step `step` (1-based):
  // always under sync "every_step", and during a "rounds" job's warm start.
  static bool dense_step(const Job& j, int step) {
    return j.spec.diloco.sync == "every_step" || step <= j.spec.diloco.warm_start_steps;
  }

  // The fragment whose DiLoCo round is due now, or -1. Without streaming (one fragment) a
  // round comes every inner_steps steps and at the end; with F fragments, fragment f syncs
  // once every inner_steps steps, the F syncs spread evenly (diloco::fragment_due).
  int round_due(const Job& j) const {
    if (dense_step(j, j.steps_done) || j.round_open || j.last_round_step == j.steps_done) return -1;
    const int H = j.spec.diloco.inner_steps, F = j.spec.diloco.fragments;
    if (F == 1) return (j.steps_done - j.last_round_step >= H || (j.completed >= j.total_mbs && j.steps_done > j.last_round_step)) ? 0 : -1;
    return diloco::fragment_due(j.steps_done, H, F);
  }

  // Opens round j.rounds + 1 in every stage group: "delta" (DiLoCo, one fragment) or "grad"
  // (sync every_step). Blocking unless the job overlaps the exchange with inner steps; then
  // training goes on and the round is applied at the barrier overlap_steps later.
  void start_round(Job& j, const std::string& what, int fragment) {
    j.round_applying = false;
    j.round_open = true;
    j.round_what = what;
    j.round_fragment = fragment;
    j.rounds++;
    j.last_round_step = j.steps_done;
    const bool overlapped = what == "delta" && j.spec.diloco.overlap_steps > 0 && j.completed < j.total_mbs;
    j.round_apply_step = j.steps_done + (overlapped ? j.spec.diloco.overlap_steps : 0);
    if (!overlapped) j.phase = Phase::kRound;
    j.round.assign(size_t(j.S), Job::RoundStage{});
    j.round_deadline = Clock::now() + std::chrono::milliseconds(int64_t(j.spec.diloco.deadline_s * 1000));
    if (what == "delta") {
      if (j.fragment_syncs.empty()) j.fragment_syncs.assign(size_t(j.spec.diloco.fragments), 0);
      j.fragment_syncs[size_t(fragment)]++;
      j.history.push_back({{"step", j.steps_done}, {"round", j.rounds}, {"fragment", fragment}});
    }
    for (int s = 0; s < j.S; ++s) {
      for (Peer* p : stage_peers(j, s)) {
        uint64_t id = next_req++;
        pending[id] = Pending{Pending::kRoundBegin, j.id, uint64_t(s), p->route, "", 0};
        Message m(MsgType::kRoundBegin, id, 0, round_body(j, s));
        if (send_to(p->route, m)) j.round[size_t(s)].waiting.insert(p->route);
      }
    }
  }

  json round_body(const Job& j, int stage) const {
    return json{{"job_id", j.id}, {"round", j.rounds}, {"stage", stage}, {"what", j.round_what},
                {"fragment", j.round_fragment}, {"fragments", j.round_what == "grad" ? 1 : j.spec.diloco.fragments}};
  }

  // Values the current round carries for `stage`: the fragment's share of its parameters.
  int64_t round_values(const Job& j, int stage) const {
    const auto P = size_t(j.stage_params[size_t(stage)]);
    if (j.round_what == "grad") return int64_t(P);
    const auto [lo, hi] = diloco::fragment_range(P, j.spec.diloco.fragments, j.round_fragment);
    return int64_t(hi - lo);
  }

  void on_round_delta(Job& j, Peer& p, Message& m) {
    if (!j.round_open || j.round_applying || size_t(p.stage) >= j.round.size()) return;
    if (m.body.value("round", uint64_t(0)) != j.rounds) return;  // a reply to an earlier round
    auto& rs = j.round[size_t(p.stage)];
    if (!rs.waiting.erase(p.route)) return;
    const int64_t n = round_values(j, p.stage);
    std::vector<float> d;
    if (m.tensors.size() != 1 || !flat_from(m.tensors[0], n, &d)) {
      log_warn("router", "peer " + p.name + " sent a malformed, misshapen or non-finite outer gradient; left out of round " + std::to_string(j.rounds));
      return;
    }
    j.bytes_outer += m.tensors[0].desc.wire_bytes();
    const double samples = double(m.body.value("samples", int64_t(0)));
    if (j.round_what == "grad") {
      // Gradient sums add up; the step divides by the group's samples.
      diloco::accumulate(rs.sum, d.data(), d.size(), 1.f);
      rs.contributors++;
      rs.weight += std::max(0.0, samples);
      return;
    }
    // Weighted by samples. A peer with no samples this round took no inner step since the
    // fragment last synced, so its outer gradient is zero and its weight is rightly zero.
    if (samples <= 0) return;
    diloco::accumulate(rs.sum, d.data(), d.size(), float(samples));
    rs.contributors++;
    rs.weight += samples;
  }

  void advance_round(Job& j) {
    const auto now = Clock::now();
    if (!j.round_applying) {
      bool waiting = false;
      for (auto& rs : j.round) waiting |= !rs.waiting.empty();
      if (waiting && now < j.round_deadline) return;
      // Collect phase over: apply the mean outer gradient in every group that has one.
      j.round_applying = true;
      for (int s = 0; s < j.S; ++s) {
        auto& rs = j.round[size_t(s)];
        rs.waiting.clear();
        if (rs.contributors == 0 || (j.round_what == "delta" && rs.weight <= 0)) {
          log_warn("router", "round " + std::to_string(j.rounds) + ": no outer gradient from stage " + std::to_string(s) + "; its global weights stay as they were");
          continue;
        }
        if (j.round_what == "delta") {
          const float inv = float(1.0 / rs.weight);
          for (float& v : rs.sum) v *= inv;
        }
        wire::Tensor mean = outer_tensor(j, s, rs.sum);
        wire::compress(mean);  // once for all the group (entropy=zstd)
        for (Peer* p : stage_peers(j, s)) {
          uint64_t id = next_req++;
          pending[id] = Pending{Pending::kRoundApply, j.id, uint64_t(s), p->route, "", 0};
          json body = round_body(j, s);
          body["contributors"] = rs.contributors;
          body["samples"] = int64_t(rs.weight);
          Message m(MsgType::kRoundApply, id, 0, body);
          m.tensors.push_back(wire::share(mean));
          if (send_to(p->route, m)) {
            rs.waiting.insert(p->route);
            j.bytes_outer += mean.desc.wire_bytes();
          }
        }
        rs.sum.clear();
        rs.sum.shrink_to_fit();
      }
      j.round_deadline = now + std::chrono::milliseconds(int64_t(j.spec.diloco.deadline_s * 1000));
      return;
    }
    bool waiting = false;
    for (auto& rs : j.round) waiting |= !rs.waiting.empty();
    if (waiting && now < j.round_deadline) return;
    // Every peer of a group must now hold the same theta_g and momentum.
    for (int s = 0; s < j.S; ++s) {
      auto& rs = j.round[size_t(s)];
      std::map<uint64_t, int> votes;
      for (auto& [r, h] : rs.hashes) votes[h]++;
      if (votes.size() > 1) {
        uint64_t major = std::max_element(votes.begin(), votes.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
        for (auto& [r, h] : rs.hashes) {
          if (h == major) continue;
          j.hash_mismatches++;
          auto pit = peers.find(r);
          if (pit == peers.end()) continue;
          log_warn("router", "peer " + pit->second.name + " disagrees on stage " + std::to_string(s) + "'s global weights after round " + std::to_string(j.rounds) + "; resyncing it from a donor");
          // A donor must be one that holds the majority state.
          pit->second.state = PeerState::kSyncing;
        }
        for (auto& [r, h] : rs.hashes) {
          auto pit = peers.find(r);
          if (pit != peers.end() && h != major) resync_from(j, pit->second, rs.hashes, major);
        }
      }
    }
    j.round.clear();
    j.round_open = false;
    after_step(j);
  }

  // The mean the group applies, through the outer codec; a lossy codec's error is fed back into
  // the next round's mean of the same stage and fragment.
  wire::Tensor outer_tensor(Job& j, int stage, const std::vector<float>& v) {
    const auto n = int64_t(v.size());
    const compression::CodecSpec codec = compression::parse_codec(j.spec.compression.outer);
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {n}, codec, compression::encoded_bytes(codec, n));
    if (codec.lossless()) std::memcpy(t.data.data(), v.data(), size_t(n) * 4);
    else j.outer_ef.encode(j.round_what + ":" + std::to_string(stage) + ":" + std::to_string(j.round_fragment), codec, v.data(), n,
                           static_cast<uint8_t*>(t.data.data()));
    wire::seal(t);
    return t;
  }

  void resync_from(Job& j, Peer& p, const std::map<std::string, uint64_t>& hashes, uint64_t major) {
    for (auto& [r, h] : hashes) {
      if (h != major) continue;
      auto d = peers.find(r);
      if (d == peers.end() || d->second.state != PeerState::kReady) continue;
      uint64_t id = next_req++;
      pending[id] = Pending{Pending::kStateRequest, j.id, 0, r, p.route, 0};
      Message m(MsgType::kStateRequest, id, 0, json{{"job_id", j.id}, {"full", dense_step(j, j.steps_done + 1)}});
      send_to(r, m);
      return;
    }
    p.state = PeerState::kReady;
  }

  // The hash of theta_g and the momentum each peer last reported, per stage: the status shows
  // whether every group agrees.
  void note_hash(Job& j, const Peer& p, const Message& m) {
    if (!m.body.contains("hash") || !m.body["hash"].is_number_unsigned() || p.stage < 0) return;
    if (j.state_hashes.size() != size_t(j.S)) j.state_hashes = json::array();
    while (j.state_hashes.size() < size_t(j.S)) j.state_hashes.push_back(json::object());
    j.state_hashes[size_t(p.stage)][p.name] = m.body["hash"];
  }

  void on_round_done(Job& j, Peer& p, Message& m) {
    if (j.phase != Phase::kRound || size_t(p.stage) >= j.round.size()) return;
    if (m.body.value("round", uint64_t(0)) != j.rounds) return;  // a reply to an earlier round
    auto& rs = j.round[size_t(p.stage)];
    if (!rs.waiting.erase(p.route)) return;
    if (m.body.contains("hash") && m.body["hash"].is_number_unsigned()) rs.hashes[p.route] = m.body["hash"].get<uint64_t>();
    note_hash(j, p, m);
  }

  // ---------------------------------------------------------------- snapshots and checkpoints

  bool checkpoint_due(const Job& j) const {
    if (j.checkpoint_dir.empty() || j.last_checkpoint_step == j.steps_done) return false;
    const int every = j.spec.checkpoint.every_steps;
    return j.completed >= j.total_mbs || (every > 0 && j.steps_done % every == 0);
  }

  bool snapshot_due(const Job& j) const {
    if (j.last_snapshot_step == j.steps_done) return false;
    int every = j.spec.checkpoint.snapshot_every_steps;
    if (every == 0 && dense_step(j, j.steps_done)) every = j.spec.diloco.inner_steps;
    if (every > 0) return j.steps_done - std::max(j.last_snapshot_step, 0) >= every;
    return j.rounds > j.snapshot_rounds;  // after every round: theta_g has just moved
  }

  // Asks one ready peer of every stage for its full state (theta_g, momentum, its weights and
  // AdamW moments). Nothing is in flight at a barrier, so every stage answers as of this step.
  void start_snapshot(Job& j) {
    j.phase = Phase::kSnapshot;
    j.snapshot_checkpoint = checkpoint_due(j);
    j.snapshot_waiting.clear();
    j.snapshot_deadline = Clock::now() + std::chrono::milliseconds(int64_t(j.spec.diloco.deadline_s * 1000));
    for (int s = 0; s < j.S; ++s) {
      auto ps = stage_peers(j, s);
      if (ps.empty()) continue;
      // The peer that has served most: the least likely to be a newcomer mid-sync.
      Peer* d = *std::max_element(ps.begin(), ps.end(), [](Peer* a, Peer* b) { return a->results < b->results; });
      uint64_t id = next_req++;
      pending[id] = Pending{Pending::kSnapshot, j.id, uint64_t(s), d->route, "", 0};
      Message m(MsgType::kStateRequest, id, 0, json{{"job_id", j.id}, {"full", true}});
      if (send_to(d->route, m)) j.snapshot_waiting.insert(d->route);
    }
  }

  void on_snapshot_reply(Job& j, Peer& p, int stage, Message& m) {
    if (j.phase != Phase::kSnapshot || !j.snapshot_waiting.erase(p.route)) return;
    const int64_t n = j.stage_params[size_t(stage)];
    StageState st;
    st.stage = stage;
    st.adam_step = m.body.value("adam_step", int64_t(-1));
    bool ok = m.tensors.size() == 5 && st.adam_step >= 0;
    std::vector<float>* parts[] = {&st.theta_g, &st.momentum, &st.theta, &st.adam_m, &st.adam_v};
    for (size_t k = 0; ok && k < 5; ++k) ok = flat_from(m.tensors[k], n, parts[k]);
    if (!ok) {
      log_warn("router", "peer " + p.name + " sent an unusable state for stage " + std::to_string(stage) + "; keeping the previous snapshot");
      return;
    }
    auto& snap = j.snapshots[size_t(stage)];
    snap.valid = true;
    snap.step = j.steps_done;
    snap.state = std::move(st);
  }

  void end_snapshot(Job& j) {
    for (const auto& r : j.snapshot_waiting) log_warn("router", "no snapshot from peer " + peer_name(r) + " in time; its stage keeps its previous one");
    j.snapshot_waiting.clear();
    j.last_snapshot_step = j.steps_done;
    j.snapshot_rounds = j.rounds;
    if (j.snapshot_checkpoint) {
      j.last_checkpoint_step = j.steps_done;
      write_checkpoint_now(j);
    }
    after_step(j);
  }

  json router_state(const Job& j) const {
    return json{{"job_id", j.id}, {"history", j.history}, {"last_eval_step", j.last_eval_step},
                {"train_loss", std::isnan(j.train_loss) ? json(nullptr) : json(j.train_loss)},
                {"val_loss", std::isnan(j.val_loss) ? json(nullptr) : json(j.val_loss)},
                {"train_tokens", j.train_tokens}, {"elapsed_s", secs(Clock::now() - j.run_started)},
                {"microbatches", {{"resent", j.resent}, {"duplicates", j.duplicates}, {"rejected", j.rejected}}}};
  }

  // A checkpoint needs every stage as of this step; a stage that did not answer in time
  // leaves this one out (the previous checkpoint stays the newest).
  void write_checkpoint_now(Job& j) {
    Checkpoint ck;
    ck.step = j.steps_done;
    ck.next_microbatch = j.completed;
    ck.rounds = j.rounds;
    ck.spec = j.spec_json;
    ck.router = router_state(j);
    for (int s = 0; s < j.S; ++s) {
      const auto& snap = j.snapshots[size_t(s)];
      if (!snap.valid || snap.step != j.steps_done) {
        log_warn("router", "checkpoint at step " + std::to_string(j.steps_done) + " skipped: no current state for stage " + std::to_string(s));
        return;
      }
      ck.stages.push_back(snap.state);
    }
    try {
      j.last_checkpoint = write_checkpoint(j.checkpoint_dir, ck, j.spec.checkpoint.keep);
      j.checkpoints_written++;
      log_info("router", "job " + std::to_string(j.id) + ": checkpoint " + j.last_checkpoint);
    } catch (const std::exception& e) {
      log_warn("router", std::string("checkpoint failed: ") + e.what());
    }
  }

  // Where the job is (microbatches taken), beside its checkpoints: after a crash, the
  // microbatches taken after the newest checkpoint are the ones done again.
  // At most every 20 ms: the count may be a few microbatches behind.
  void write_progress(Job& j) {
    if (j.checkpoint_dir.empty()) return;
    const auto now = Clock::now();
    if (secs(now - j.last_progress) < 0.02) return;
    j.last_progress = now;
    std::error_code ec;
    std::filesystem::create_directories(j.checkpoint_dir, ec);
    const std::string path = j.checkpoint_dir + "/progress.json";
    {
      std::ofstream f(path + ".tmp");
      f << json{{"step", j.steps_done}, {"taken", j.taken}, {"completed", j.completed}}.dump() << "\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  }

  // Continues `j` from the checkpoint: step, data position, rounds, history, and every stage's
  // state as its snapshot (peers load it before serving).
  void apply_checkpoint(Job& j, const LoadedCheckpoint& lc) {
    const Checkpoint& ck = lc.ckpt;
    j.steps_done = ck.step;
    j.taken = j.completed = j.resumed_at = ck.next_microbatch;
    j.rounds = ck.rounds;
    j.last_round_step = ck.step;
    j.last_snapshot_step = j.last_checkpoint_step = ck.step;
    j.snapshot_rounds = ck.rounds;
    const json& r = ck.router;
    j.history = r.value("history", json::array());
    j.last_eval_step = r.value("last_eval_step", -1);
    if (r.contains("train_loss") && r["train_loss"].is_number()) j.train_loss = r["train_loss"].get<double>();
    if (r.contains("val_loss") && r["val_loss"].is_number()) j.val_loss = r["val_loss"].get<double>();
    if (r.contains("microbatches")) {
      const json& mb = r["microbatches"];
      j.resent = mb.value("resent", uint64_t(0));
      j.duplicates = mb.value("duplicates", uint64_t(0));
      j.rejected = mb.value("rejected", uint64_t(0));
    }
    for (const auto& st : ck.stages) {
      auto& snap = j.snapshots.at(size_t(st.stage));
      snap.valid = true;
      snap.step = ck.step;
      snap.state = st;
      j.stage_params[size_t(st.stage)] = int64_t(st.theta_g.size());
    }
    int64_t redone = 0;
    std::ifstream pf(std::filesystem::path(lc.path).parent_path() / "progress.json");
    if (pf) {
      try {
        json pj = json::parse(pf);
        redone = std::max<int64_t>(0, pj.value("taken", int64_t(0)) - int64_t(ck.next_microbatch));
      } catch (const json::exception&) {
      }
    }
    j.resumed = {{"checkpoint", lc.path}, {"step", ck.step}, {"skipped", lc.skipped}, {"microbatches_redone", redone}};
    log_info("router", "job " + std::to_string(j.id) + " resumes from " + lc.path + " at step " + std::to_string(ck.step) +
                           " (" + std::to_string(redone) + " microbatch(es) taken after it are done again)");
    for (const auto& sk : lc.skipped) log_warn("router", "skipped checkpoint: " + sk);
  }


  // ---------------------------------------------------------------- transport benchmark

  void advance_bench(Job& j) {
    if (j.bench_done >= j.bench_count) return finish(j, JobState::kDone, "");
    if (j.inflight.empty() && j.taken == 0) {
      j.run_started = Clock::now();
    }
    while (j.inflight.size() < size_t(j.spec.max_inflight) && int64_t(j.taken) < j.bench_count) {
      Flight mb;
      mb.index = j.taken;
      mb.inputs.resize(1);
      mb.have_input.assign(1, true);
      mb.fwd_peer.resize(1);
      mb.inputs[0] = bench_payload(j);
      mb.kind = HopKind::kForward;
      j.inflight.emplace(j.taken, std::move(mb));
      j.taken++;
    }
    dispatch_waiting(j);
  }

  wire::Tensor bench_template;
  wire::Tensor bench_payload(Job& j) {
    const int64_t n = j.bench_bytes / 4;
    if (bench_template.desc.numel() != n || bench_template.data.size() != size_t(n) * 4) {
      bench_template = wire::make_tensor(wire::DType::kF32, {n}, compression::CodecSpec{}, size_t(n) * 4);
      std::memset(bench_template.data.data(), 0x3c, size_t(n) * 4);
      wire::seal(bench_template);
    }
    return wire::share(bench_template);
  }

  // In a transport benchmark a FORWARD result completes the microbatch.
  void bench_result(Job& j, uint64_t key) {
    if (j.inflight.erase(key) == 0) return;
    j.completed++;
    j.bench_done++;
  }

  // ---------------------------------------------------------------- the end

  void finish(Job& j, JobState st, const std::string& reason) {
    j.state = st;
    j.reason = reason;
    j.finished = Clock::now();
    j.phase = Phase::kFinishing;
    // Requests still out for this job are dropped: their replies count as duplicates.
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->second.job == j.id) {
        release(it->second);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    j.inflight.clear();
    persist_job(j);
    log_info("router", "job " + std::to_string(j.id) + " " + job_state_name(st) + (reason.empty() ? "" : ": " + reason));
  }
};

Router::Router(RouterOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
Router::~Router() = default;
std::string Router::endpoint() const { return impl_->endpoint; }
void Router::run(std::atomic<bool>& stop) { impl_->run(stop); }

}  // namespace swarm
