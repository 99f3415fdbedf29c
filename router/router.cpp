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
#include <fstream>
#include <map>
#include <set>

#include "compression/codec.h"
#include "router/dispatch.h"
#include "runtime/data.h"
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

enum class PeerState { kIdle, kLoading, kSyncing, kReady };
const char* state_name(PeerState s) {
  switch (s) {
    case PeerState::kIdle: return "idle";
    case PeerState::kLoading: return "loading";
    case PeerState::kSyncing: return "syncing";
    case PeerState::kReady: return "ready";
  }
  return "?";
}

struct Peer {
  std::string route;
  std::string name, device, profile;
  double emulate = 1;
  bool echo = false;
  int requested_stage = -1;
  int stage = -1;
  uint64_t job_id = 0;
  PeerState state = PeerState::kIdle;
  Clock::time_point joined, last_seen;
  double ms_per_unit = 0;        // EMA of compute ms per work unit, from its results
  double queued_units = 0;        // work sent to it and not answered yet
  Clock::time_point banned_until{};
  int bans = 0;
  uint64_t results = 0, failures = 0;
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
enum class Phase { kTrain, kStepping, kRound, kEval, kFinishing };

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
  std::vector<RoundStage> round;
  Clock::time_point round_deadline{};
  uint64_t hash_mismatches = 0;
  // Eval state.
  double eval_sum = 0;
  int eval_count = 0;
  uint64_t eval_next = 0;
  // Affinity statistics from RESULTs.
  uint64_t backward_cached = 0, backward_recomputed = 0;
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
    enum Kind { kHop, kLoad, kStep, kRoundBegin, kRoundApply, kStateRequest, kStateLoad } kind;
    uint64_t job = 0;
    uint64_t mb = 0;
    std::string peer;
    std::string target;  // kStateRequest: the peer waiting for the state
    double units = 0;
    Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);  // hops track theirs in Flight
  };
  std::map<uint64_t, Pending> pending;
  std::set<uint64_t> superseded;     // request ids re-sent elsewhere: a late reply is a duplicate
  std::set<std::string> unreachable;
  uint64_t bad_messages = 0;
  Clock::time_point last_beat = Clock::now();

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
    try {
      m = wire::decode(r.frames);
    } catch (const WireError& e) {
      bad_messages++;
      log_warn("router", "dropped a bad message: " + std::string(e.what()));
      reply_error(r.route, nullptr, e.code(), e.what());
      return;
    }
    auto pit = peers.find(r.route);
    if (pit != peers.end()) pit->second.last_seen = Clock::now();
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
    p.joined = p.last_seen = Clock::now();
    peers[route] = p;
    Message w(MsgType::kWelcome, m.id, 0, json{{"peer_id", route}, {"heartbeat_ms", opt.heartbeat_ms}, {"liveness", opt.liveness}});
    wire::send(sock, w, &route);
    log_info("router", "peer " + p.name + " (" + route + ") joined" +
                           (p.requested_stage >= 0 ? " asking for stage " + std::to_string(p.requested_stage) : "") +
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
    }
  }

  std::vector<Peer*> stage_peers(const Job& j, int stage, bool ready_only = true) {
    std::vector<Peer*> out;
    for (auto& [route, p] : peers)
      if (p.job_id == j.id && p.stage == stage && (!ready_only || p.state == PeerState::kReady)) out.push_back(&p);
    return out;
  }

  // A new peer for a running job: the stage it asked for, else the least-served stage.
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
      if (stage < 0) {
        size_t best = SIZE_MAX;
        for (int s = 0; s < j.S; ++s) {
          size_t n = stage_peers(j, s, false).size();
          if (n < best) { best = n; stage = s; }
        }
      }
      p.stage = stage;
    }
    p.job_id = j.id;
    p.state = PeerState::kLoading;
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kLoad, j.id, 0, p.route, "", 0};
    Message m(MsgType::kLoadStage, id, 0, json{{"job_id", j.id}, {"stage", p.stage}, {"spec", j.spec_json}});
    send_to(p.route, m);
  }

  // ---------------------------------------------------------------- clients

  void on_submit(const std::string& route, Message& m) {
    auto job = std::make_unique<Job>();
    const json& b = m.body;
    if (b.contains("bench_transport")) {
      const json& t = b["bench_transport"];
      job->transport_bench = true;
      job->bench_bytes = t.at("bytes").get<int64_t>();
      job->bench_count = t.at("count").get<int64_t>();
      job->spec.max_inflight = t.value("inflight", 8);
      if (job->bench_bytes <= 0 || job->bench_bytes > int64_t(limits::kMaxTensorBytes) || job->bench_count <= 0)
        return reply_error(route, &m, WireErrc::kMalformed, "bench_transport needs 0 < bytes <= the tensor limit and count > 0");
    } else {
      try {
        job->spec = parse_job_spec(b.at("spec"), /*check_files=*/true);
        compression::parse_codec(job->spec.compression.activations);
        compression::parse_codec(job->spec.compression.gradients);
        compression::parse_codec(job->spec.compression.outer);
        job->data = std::make_unique<TokenData>(TokenData::load(job->spec.data, job->spec.model.seq_len, job->spec.model.vocab_size));
      } catch (const InputError& e) {
        Message err(MsgType::kError, m.id, 0, json{{"code", int(WireErrc::kMalformed)}, {"name", "bad_job_spec"}, {"message", e.what()}});
        wire::send(sock, err, &route);
        return;
      }
      job->spec_json = to_json(job->spec);
      job->unigram = job->data->unigram_loss();
      job->S = job->spec.partition.stages;
      job->M = job->spec.microbatches_per_step();
      job->total_mbs = uint64_t(job->spec.steps) * uint64_t(job->M);
      job->stage_params.assign(size_t(job->S), 0);
    }
    job->id = next_job_id++;
    job->started = Clock::now();
    Message ok(MsgType::kSubmitted, m.id, 0, json{{"job_id", job->id}});
    wire::send(sock, ok, &route);
    log_info("router", "job " + std::to_string(job->id) + (job->transport_bench ? " (transport benchmark)" : " '" + job->spec.name + "'") + " submitted");
    jobs.push_back(std::move(job));
  }

  json job_status(const Job& j) {
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
           {"microbatches", {{"taken", j.taken}, {"completed", j.completed}, {"resent", j.resent},
                             {"duplicates", j.duplicates}, {"rejected", j.rejected},
                             {"lost", (j.state == JobState::kDone) ? j.taken - j.completed : 0}}},
           {"backward", {{"cached", j.backward_cached}, {"recomputed", j.backward_recomputed}}},
           {"wire_bytes", {{"activations", j.bytes_act}, {"gradients", j.bytes_grad}, {"outer", j.bytes_outer}}},
           {"wire_bytes_per_sample", {{"activations", j.completed ? double(j.bytes_act) / double(j.completed * uint64_t(j.spec.batch.microbatch_size)) : 0.0},
                                      {"gradients", j.completed ? double(j.bytes_grad) / double(j.completed * uint64_t(j.spec.batch.microbatch_size)) : 0.0}}},
           {"codec_ms", {{"activations", {{"encode", j.codec_us[0] / 1000}, {"decode", j.codec_us[1] / 1000}}},
                         {"gradients", {{"encode", j.codec_us[2] / 1000}, {"decode", j.codec_us[3] / 1000}}}}},
           {"hash_mismatches", j.hash_mismatches}};
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
      list.push_back({{"id", r}, {"name", p.name}, {"device", p.device}, {"stage", p.stage},
                      {"requested_stage", p.requested_stage}, {"state", state_name(p.state)}, {"job_id", p.job_id},
                      {"emulate", p.emulate}, {"profile", p.profile}, {"echo", p.echo},
                      {"ms_per_unit", p.ms_per_unit}, {"queued_units", p.queued_units},
                      {"results", p.results}, {"failures", p.failures},
                      {"banned_s", std::max(0.0, secs(p.banned_until - now))},
                      {"last_seen_s", secs(now - p.last_seen)}, {"heartbeat", p.heartbeat}});
    }
    Message rep(MsgType::kPeersReply, m.id, 0, json{{"peers", list}});
    wire::send(sock, rep, &route);
  }

  // ---------------------------------------------------------------- replies from peers

  void on_reply(Peer& p, Message& m) {
    auto it = pending.find(m.id);
    if (it == pending.end()) {
      Job* j = active_job();
      if (superseded.erase(m.id)) {
        if (j) j->duplicates++;
      } else if (m.type == MsgType::kError) {
        log_warn("router", "peer " + p.name + " reports: " + m.body.value("message", std::string("?")));
      }
      return;
    }
    if (it->second.peer != p.route) return;  // not from the peer we asked
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
        log_info("router", "peer " + p.name + " synced stage " + std::to_string(p.stage) + " from a donor");
        return;
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
        superseded.insert(id);
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
    if (j.transport_bench || j.rounds == 0) {
      p.state = PeerState::kReady;
      log_info("router", "peer " + p.name + " ready on stage " + std::to_string(p.stage));
      return;
    }
    start_sync(j, p);
  }

  // A peer that joins after a round copies theta_g and the momentum from a live donor.
  void start_sync(Job& j, Peer& p) {
    p.state = PeerState::kSyncing;
    auto donors = stage_peers(j, p.stage);
    if (donors.empty()) {
      // Nobody left who knows the stage's state: start from what this peer has.
      log_warn("router", "no donor for stage " + std::to_string(p.stage) + "; peer " + p.name + " starts from its initial weights");
      p.state = PeerState::kReady;
      return;
    }
    Peer* d = donors.front();
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kStateRequest, j.id, 0, d->route, p.route, 0};
    Message m(MsgType::kStateRequest, id, 0, json{{"job_id", j.id}});
    send_to(d->route, m);
  }

  void on_state_reply(Job& j, Peer& donor, const std::string& target, Message& m) {
    auto t = peers.find(target);
    if (t == peers.end() || t->second.state != PeerState::kSyncing) return;
    if (m.tensors.size() != 2) return start_sync(j, t->second);
    uint64_t id = next_req++;
    pending[id] = Pending{Pending::kStateLoad, j.id, 0, target, "", 0};
    Message load(MsgType::kStateLoad, id, 0, json{{"job_id", j.id}});
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
      if (pd.kind != Pending::kHop && now > pd.deadline) expired.push_back(id);
    for (uint64_t id : expired) {
      auto it = pending.find(id);
      if (it != pending.end()) log_warn("router", "request " + std::to_string(id) + " to " + peer_name(it->second.peer) + " passed its deadline; re-sending");
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
    if (Job* j = active_job()) advance(*j);
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
    }
    // Peers that asked for a stage first, then the rest on the least-served stage.
    for (int pass = 0; pass < 2; ++pass)
      for (auto& [route, p] : peers)
        if ((pass == 0) == (p.requested_stage >= 0)) assign_and_load(j, p);
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
          j.phase = Phase::kTrain;
          if (j.completed >= j.total_mbs) finish(j, JobState::kDone, "");
        }
        return;
      }
      case Phase::kFinishing:
        return;
    }
  }

  uint64_t next_barrier_mb(const Job& j) {
    const uint64_t M = uint64_t(j.M);
    if (j.spec.schedule == "sync") return std::min(j.total_mbs, (uint64_t(j.steps_done) + 1) * M);
    // async: the next round, evaluation or the end, whichever comes first.
    const int H = j.spec.diloco.inner_steps;
    uint64_t next = (uint64_t(j.last_round_step / H) + 1) * H;
    if (j.spec.eval.every_steps > 0) {
      const uint64_t done = uint64_t(std::max(j.last_eval_step, 0));
      const uint64_t e = (done / j.spec.eval.every_steps + 1) * j.spec.eval.every_steps;
      next = std::min(next, e);
    }
    return std::min(j.total_mbs, next * M);
  }

  // All microbatches up to a barrier completed.
  void on_barrier(Job& j) {
    j.steps_done = int(j.completed / uint64_t(j.M));
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

  // After a step (sync) or a barrier (async): a round, an evaluation, or more training.
  void after_step(Job& j) {
    j.phase = Phase::kTrain;
    const bool end = j.completed >= j.total_mbs;
    const bool round_due = (j.steps_done - j.last_round_step) >= j.spec.diloco.inner_steps ||
                           (end && j.steps_done > j.last_round_step);
    const bool eval_due = end || (j.spec.eval.every_steps > 0 && j.steps_done % j.spec.eval.every_steps == 0 &&
                                  j.last_eval_step != j.steps_done);
    if (round_due) return start_round(j);
    if (eval_due) return start_eval(j);
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
  }
  void take_eval(Job& j, uint64_t index) { new_mb(j, kEvalBit | index, index, true); }

  void dispatch_waiting(Job& j) {
    const auto now = Clock::now();
    for (auto& [key, mb] : j.inflight)
      if (mb.waiting && now >= mb.not_before) send_hop(j, key, mb);
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
      if (mb.stage > 0) j.bytes_act += m.tensors[0].desc.nbytes;
      if (mb.kind == HopKind::kBackward) j.bytes_grad += m.tensors.back().desc.nbytes;
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
    if (!bad.empty()) {
      log_warn("router", "peer " + p.name + " " + bad);
      p.failures++;
      return fail(m.id, pd, /*error=*/true, bad);
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

  void start_round(Job& j) {
    j.phase = Phase::kRound;
    j.round_applying = false;
    j.rounds++;
    j.round.assign(size_t(j.S), Job::RoundStage{});
    j.round_deadline = Clock::now() + std::chrono::milliseconds(int64_t(j.spec.diloco.deadline_s * 1000));
    for (int s = 0; s < j.S; ++s) {
      for (Peer* p : stage_peers(j, s)) {
        uint64_t id = next_req++;
        pending[id] = Pending{Pending::kRoundBegin, j.id, uint64_t(s), p->route, "", 0};
        Message m(MsgType::kRoundBegin, id, 0, json{{"job_id", j.id}, {"round", j.rounds}, {"stage", s}});
        if (send_to(p->route, m)) j.round[size_t(s)].waiting.insert(p->route);
      }
    }
  }

  void on_round_delta(Job& j, Peer& p, Message& m) {
    if (j.phase != Phase::kRound || j.round_applying || size_t(p.stage) >= j.round.size()) return;
    if (m.body.value("round", uint64_t(0)) != j.rounds) return;  // a reply to an earlier round
    auto& rs = j.round[size_t(p.stage)];
    if (!rs.waiting.erase(p.route)) return;
    if (m.tensors.size() != 1 || m.tensors[0].desc.dtype != wire::DType::kF32 || m.tensors[0].desc.shape.size() != 1) {
      log_warn("router", "peer " + p.name + " sent a malformed outer gradient; left out of the round");
      return;
    }
    const auto& t = m.tensors[0];
    const int64_t n = t.desc.numel();
    if (n != j.stage_params[size_t(p.stage)]) {
      log_warn("router", "peer " + p.name + " sent an outer gradient of the wrong size; left out of the round");
      return;
    }
    std::vector<float> d(static_cast<size_t>(n));
    try {
      compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), n, d.data());
    } catch (const InputError& e) {
      log_warn("router", "peer " + p.name + " sent an undecodable outer gradient: " + e.what());
      return;
    }
    for (float f : d)
      if (!std::isfinite(f)) {
        log_warn("router", "peer " + p.name + " sent a non-finite outer gradient; left out of the round");
        return;
      }
    j.bytes_outer += t.desc.nbytes;
    // Weighted by samples. A peer with no samples this round took no inner step since the
    // last round, so its outer gradient is zero and its weight is rightly zero.
    const double w = double(m.body.value("samples", int64_t(0)));
    if (w <= 0) return;
    if (rs.sum.empty()) rs.sum.assign(size_t(n), 0.f);
    rs.contributors++;
    for (int64_t i = 0; i < n; ++i) rs.sum[size_t(i)] += float(w) * d[size_t(i)];
    rs.weight += w;
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
        if (rs.contributors == 0 || rs.weight <= 0) {
          log_warn("router", "round " + std::to_string(j.rounds) + ": no outer gradient from stage " + std::to_string(s) + "; its global weights stay as they were");
          continue;
        }
        const float inv = float(1.0 / rs.weight);
        for (float& v : rs.sum) v *= inv;
        wire::Tensor mean = wire::make_tensor(wire::DType::kF32, {int64_t(rs.sum.size())}, compression::CodecSpec{}, rs.sum.size() * 4);
        std::memcpy(mean.data.data(), rs.sum.data(), rs.sum.size() * 4);
        wire::seal(mean);
        for (Peer* p : stage_peers(j, s)) {
          uint64_t id = next_req++;
          pending[id] = Pending{Pending::kRoundApply, j.id, uint64_t(s), p->route, "", 0};
          Message m(MsgType::kRoundApply, id, 0, json{{"job_id", j.id}, {"round", j.rounds}, {"stage", s}, {"contributors", rs.contributors}});
          m.tensors.push_back(wire::share(mean));
          if (send_to(p->route, m)) rs.waiting.insert(p->route);
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
    j.last_round_step = j.steps_done;
    j.phase = Phase::kTrain;
    const bool end = j.completed >= j.total_mbs;
    const bool eval_due = end || (j.spec.eval.every_steps > 0 && j.steps_done % j.spec.eval.every_steps == 0 && j.last_eval_step != j.steps_done);
    if (eval_due) start_eval(j);
    else if (end) finish(j, JobState::kDone, "");
  }

  void resync_from(Job& j, Peer& p, const std::map<std::string, uint64_t>& hashes, uint64_t major) {
    for (auto& [r, h] : hashes) {
      if (h != major) continue;
      auto d = peers.find(r);
      if (d == peers.end() || d->second.state != PeerState::kReady) continue;
      uint64_t id = next_req++;
      pending[id] = Pending{Pending::kStateRequest, j.id, 0, r, p.route, 0};
      Message m(MsgType::kStateRequest, id, 0, json{{"job_id", j.id}});
      send_to(r, m);
      return;
    }
    p.state = PeerState::kReady;
  }

  void on_round_done(Job& j, Peer& p, Message& m) {
    if (j.phase != Phase::kRound || size_t(p.stage) >= j.round.size()) return;
    if (m.body.value("round", uint64_t(0)) != j.rounds) return;  // a reply to an earlier round
    auto& rs = j.round[size_t(p.stage)];
    if (!rs.waiting.erase(p.route)) return;
    if (m.body.contains("hash") && m.body["hash"].is_number_unsigned()) rs.hashes[p.route] = m.body["hash"].get<uint64_t>();
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
        superseded.insert(it->first);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    j.inflight.clear();
    log_info("router", "job " + std::to_string(j.id) + " " + job_state_name(st) + (reason.empty() ? "" : ": " + reason));
  }
};

Router::Router(RouterOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
Router::~Router() = default;
std::string Router::endpoint() const { return impl_->endpoint; }
void Router::run(std::atomic<bool>& stop) { impl_->run(stop); }

}  // namespace swarm
