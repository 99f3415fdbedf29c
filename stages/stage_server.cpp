// stage_server.cpp: the stage server (see stage_server.h).
//
// Two threads. The I/O thread owns the DEALER socket to the router: it sends HELLO and
// heartbeats, decodes and validates every incoming message, answers session messages itself
// and queues work for the compute thread; it reconnects when the router goes silent. It also
// owns the peer-to-peer side (stages/peer_link.h): the listen socket other peers fetch tensors
// from, the fetches of the tensors a request references (the request reaches the compute
// thread whole), and the tensors this peer holds for others (stages/holdings.h): a reply to a
// request that asked it to hold keeps its tensors here and carries references instead. A message
// it cannot read is counted and dropped: nothing from the network ends the process. The
// compute thread owns the model (stages/worker.h) and sends its replies back through an inproc
// pipe so that only the I/O thread touches the network socket. Injected faults
// (stages/stage_faults.h, inert unless configured) see every message the I/O thread passes and
// every request the compute thread handles. With --http, threads of its own serve /metrics from
// figures the I/O thread gathers when a scrape asks for them (stages/stage_metrics.h).
#include "stages/stage_server.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cmath>
#include <deque>
#include <optional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "runtime/http.h"
#include "runtime/log.h"
#include "runtime/messages.h"
#include "runtime/parts.h"
#include "runtime/timing.h"
#include "stages/compute_threads.h"
#include "stages/device_info.h"
#include "stages/holdings.h"
#include "stages/peer_link.h"
#include "stages/precision.h"
#include "stages/stage_faults.h"
#include "stages/stage_metrics.h"
#include "stages/worker.h"

namespace swarm {

using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

namespace {

// Work queue from the I/O thread to the compute thread.
class Inbox {
 public:
  struct Work {
    Message msg;
    uint64_t seq = 0;  // the request's number since the process started (fault triggers)
  };
  void push(Message m, uint64_t seq) {
    { std::lock_guard<std::mutex> l(mu_); q_.push_back(Work{std::move(m), seq}); }
    cv_.notify_one();
  }
  bool pop(Work* out, std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> l(mu_);
    while (q_.empty()) {
      if (stop) return false;
      cv_.wait_for(l, std::chrono::milliseconds(100));
    }
    *out = std::move(q_.front());
    q_.pop_front();
    return true;
  }
  void clear() { std::lock_guard<std::mutex> l(mu_); q_.clear(); }
  size_t size() { std::lock_guard<std::mutex> l(mu_); return q_.size(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> q_;
};

std::string default_name() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + ":" + std::to_string(getpid());
}

std::string random_id() {
  static const char* hex = "0123456789abcdef";
  std::random_device rd;
  std::string s = "p-";
  for (int i = 0; i < 12; ++i) s += hex[rd() % 16];
  return s;
}

}  // namespace

int run_stage_server(const StageOptions& opt, std::atomic<bool>& stop) {
  set_compute_threads(opt.threads);
  if (opt.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available()) {
    log_error("stage", "--device " + opt.device + " asked for, but this libtorch has no CUDA device available; use --device cpu");
    return 2;
  }
  // What the device computes in, and what --precision makes of it when a job does not pin one.
  const DeviceCaps caps = device_caps(torch::Device(opt.device == "cuda" ? std::string("cuda:0") : opt.device), query_device(opt.device));
  PrecisionChoice own;
  try {
    own = resolve_precision(Precision::kAuto, opt.precision, caps);
  } catch (const InputError& e) {
    log_error("stage", e.what());
    return 2;
  }
  const std::string name = opt.name.empty() ? default_name() : opt.name;
  set_log_peer(name);
  log_info("stage", "precision " + own.reason + " (unless a job pins model.precision)");
  std::optional<KeyPair> keys;
  std::string router_key;
  try {
    if (opt.key_file.empty() != opt.router_key.empty())
      throw InputError("give --key and --router-key together (this server's keypair and the router's public key), or neither");
    if (!opt.key_file.empty()) {
      keys = read_keypair(opt.key_file);
      router_key = read_public_key(opt.router_key);
    }
  } catch (const InputError& e) {
    log_error("stage", e.what());
    return 2;
  }
  const std::string routing_id = keys ? routing_id_of(keys->public_key) : random_id();

  zmq::context_t ctx(1);
  const auto t0 = Clock::now();
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  Holdings holdings(opt.hold_bytes, /*held_ttl_s=*/600, opt.cache_ttl_s);
  std::unique_ptr<PeerLink> link;
  try {
    link = std::make_unique<PeerLink>(ctx, opt.listen, opt.advertise, holdings, opt.fetch_timeout_s, keys);
  } catch (const InputError& e) {
    log_error("stage", e.what());
    return 2;
  }
  if (!link->address().empty()) log_info("stage", "peers fetch tensors from " + link->address());
  // --http: /metrics from threads of their own; the router learns the address from HELLO.
  http::Publisher pages;
  std::unique_ptr<http::Server> http_server;
  std::string metrics_url;
  uint64_t relayed = 0;   // held tensors the router fetched to relay
  if (!opt.http.empty()) {
    try {
      http_server = std::make_unique<http::Server>(opt.http, pages);
    } catch (const InputError& e) {
      log_error("stage", std::string("--http: ") + e.what());
      return 2;
    }
    std::string host = http_server->host();
    if (host == "0.0.0.0") host = default_name().substr(0, default_name().rfind(':'));   // what others dial: this host's name
    metrics_url = "http://" + host + ":" + std::to_string(http_server->port()) + "/metrics";
    log_info("stage", "metrics at " + metrics_url);
  }
  zmq::socket_t to_io(ctx, zmq::socket_type::pair), from_worker(ctx, zmq::socket_type::pair);
  from_worker.bind("inproc://replies");
  to_io.connect("inproc://replies");

  SharedStats stats;
  Inbox inbox;
  std::atomic<bool> worker_stop{false};
  StageFaults faults(opt.faults, opt.fault_seed, stats.steps, stop);
  std::thread compute([&] {
    Worker w(opt, stats, faults, caps);
    Inbox::Work work;
    while (inbox.pop(&work, worker_stop)) {
      faults.wait_while_frozen();
      Message rep = w.handle(work.msg, work.seq);
      faults.wait_while_frozen();  // a freeze holds the reply too
      wire::send(to_io, rep);
      w.after_reply();
    }
  });

  auto make_socket = [&]() {
    auto s = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    s->set(zmq::sockopt::routing_id, routing_id);
    if (keys) curve_client(*s, *keys, router_key);
    // Never block the I/O loop: with no connection up (the router gone, or a handshake it
    // refused) a DEALER's send would wait forever; the message is dropped instead, and the
    // silence is noticed and reconnected as always.
    s->set(zmq::sockopt::sndtimeo, 0);
    s->set(zmq::sockopt::linger, 0);
    s->set(zmq::sockopt::sndhwm, 100000);
    s->set(zmq::sockopt::rcvhwm, 100000);
    s->connect(opt.router);
    return s;
  };
  std::unique_ptr<zmq::socket_t> sock = make_socket();
  double last_sent_s = 0;   // anything to the router: a sign of life there (timing::next_heartbeat_s)
  wire::PartJoiner parts;     // a large message from the router, as its PARTs come
  bool router_parts = false;  // the router takes PARTs (WELCOME.parts)
  auto send_frames = [&](Frames& frames) {
    // A large message goes in PARTs: the router hears from this server while it crosses the link.
    if (frames.empty()) return;
    if (router_parts ? wire::send_parted(*sock, std::move(frames)) : wire::send_frames(*sock, frames)) last_sent_s = now_s();
  };
  // Replies and error answers: the injected faults decide what actually leaves.
  auto answer = [&](Message& m) {
    for (auto& f : faults.outgoing(wire::encode(m))) send_frames(f);
  };
  auto hello = [&](zmq::socket_t& s) {
    if (faults.partitioned()) return;  // cut off: nothing goes out
    const DeviceInfo device = query_device(opt.device);  // free memory as of now
    auto bytes = [](int64_t b) { return b >= 0 ? std::optional<int64_t>(b) : std::nullopt; };
    msg::Hello h;
    h.role = msg::Role::kStage;
    h.version = wire::kVersion;
    h.name = name.substr(0, limits::kMaxPeerIdBytes);
    h.device = opt.device;
    h.device_name = device.name;
    h.device_memory_bytes = bytes(device.total_bytes);
    h.device_memory_free_bytes = bytes(usable_bytes(device, opt.memory_limit_bytes));
    h.precision = precision_name(own.precision);
    h.stage = opt.stage;
    h.prefer_stage = opt.prefer_stage;
    h.emulate = opt.emulate;
    h.profile = opt.profile;
    h.threads = opt.threads;
    h.pid = int64_t(getpid());
    h.echo = opt.echo;
    h.parts = true;
    h.listen = link->address();
    h.metrics = metrics_url;
    Message m = msg::make(h);
    wire::send(s, m);
  };

  hello(*sock);
  log_info("stage", name + " (" + routing_id + ") connecting to " + opt.router +
                        (opt.emulate > 1 ? " [emulated " + (opt.profile.empty() ? std::to_string(opt.emulate) + "x slower" : opt.profile) + "]" : ""));
  // Requests whose reply keeps its tensors here (hold), and the bytes fetched for each request.
  std::set<uint64_t> hold_ids;
  std::map<uint64_t, msg::Push> push_ahead;   // held outputs to push as soon as they are made (Hop.push_to)
  struct Fetched {
    std::vector<int64_t> bytes;   // per request tensor
    int64_t push_late = 0;        // pushes that did not come in time (PeerLink::Resolved)
    double fetch_s = 0;           // until the last of them came
  };
  std::map<uint64_t, Fetched> fetched_by_id;
  // A reply from the compute thread, before it leaves: tensors kept and referenced, fetched
  // bytes reported. Anything else passes untouched.
  auto finish_reply = [&](Frames frames) -> Frames {
    const std::optional<uint64_t> id = wire::peek_id(frames);
    if (!id) return frames;
    const bool hold = hold_ids.erase(*id) > 0;
    auto fetched = fetched_by_id.find(*id);
    if (!hold && fetched == fetched_by_id.end()) return frames;
    Message m;
    try {
      m = wire::decode(frames, /*verify_checksums=*/false);
    } catch (const WireError& e) {
      SWARM_CHECK(false, std::string("the compute thread's reply does not decode: ") + e.what());
    }
    if (m.type == MsgType::kResult && fetched != fetched_by_id.end()) {
      msg::Result r = msg::read<msg::Result>(m);
      bool any = false;
      for (int64_t b : fetched->second.bytes) any |= b > 0;
      if (any) r.fetched = fetched->second.bytes;
      if (fetched->second.fetch_s > 0) r.fetch_ms = fetched->second.fetch_s * 1000.0;
      if (fetched->second.push_late > 0) r.push_late = fetched->second.push_late;
      m.body = msg::make(r).body;
    }
    if (fetched != fetched_by_id.end()) fetched_by_id.erase(fetched);
    if (hold && m.type != MsgType::kError) {
      for (size_t i = 0; i < m.tensors.size(); ++i) {
        wire::TensorRef ref;
        ref.slot = uint32_t(i);
        ref.key = m.id;
        ref.part = uint32_t(i);
        wire::compress(m.tensors[i]);  // kept as it travels (entropy=zstd packs once)
        ref.desc = m.tensors[i].desc;
        holdings.put(m.id, uint32_t(i), std::move(m.tensors[i]), false, now_s());
        m.refs.push_back(std::move(ref));
      }
      m.tensors.clear();
    }
    if (auto pa = push_ahead.find(m.id); pa != push_ahead.end()) {
      if (hold && !m.refs.empty() && m.type != MsgType::kError) link->push(pa->second, now_s());
      push_ahead.erase(pa);
    }
    return wire::encode(m);
  };
  // A hop the router sent without its tokens or targets (Hop.own_tokens): they are made here, from
  // the data the compute thread loaded with the stage, and put where the router would have put
  // them, before the hop's references are resolved. False, and the router told why, when this
  // server holds no data for the hop's job.
  auto own_tokens = [&](Message& m, const msg::Hop& h) {
    std::shared_ptr<const OwnTokens> own;
    {
      std::lock_guard<std::mutex> l(stats.own_mu);
      own = stats.own;
    }
    if (!own || own->job != h.job_id) {
      stats.errors++;
      Message err = msg::error_reply(&m, WireErrc::kOutOfOrder, "a hop without its tokens, but this peer holds no copy of job " +
                                                                    std::to_string(h.job_id) + "'s data (its STAGE_READY did not say data)");
      answer(err);
      return false;
    }
    auto make = [&](bool targets) { return microbatch_tensor(*own->data, own->seed, h.mb, h.eval, targets, own->samples, own->seq_len); };
    std::optional<wire::Tensor> tokens, targets;
    if (msg::Hop::takes_tokens(own->stage)) tokens = make(false);
    if (msg::Hop::takes_targets(m.type, own->stage, own->stages)) targets = make(true);
    msg::Hop::put_own(m, std::move(tokens), std::move(targets));
    return true;
  };
  // A request for the compute thread: whole, or once what it references has been fetched.
  auto queue_work = [&](Message m, uint64_t seq) {
    if (m.type == MsgType::kForward || m.type == MsgType::kForwardLoss || m.type == MsgType::kBackward || m.type == MsgType::kEval) {
      try {
        const msg::Hop h = msg::read<msg::Hop>(m);
        if (h.own_tokens.value_or(false) && !own_tokens(m, h)) return;
        if (m.hold && h.push_to && (m.type == MsgType::kBackward || m.type == MsgType::kForwardLoss)) {
          msg::Push pu;
          pu.key = m.id;
          pu.to = *h.push_to;
          pu.to_key = h.push_to_key.value_or("");
          push_ahead[m.id] = std::move(pu);
        }
      } catch (const InputError&) {
        // Malformed: the compute thread answers it so.
      }
    }
    if (m.hold) hold_ids.insert(m.id);
    if (m.refs.empty()) return inbox.push(std::move(m), seq);
    link->resolve(std::move(m), seq, now_s());
  };

  auto last_heard = Clock::now();
  auto last_tick = Clock::now();
  double last_beat_s = 0;
  bool welcomed = false;
  double backoff_s = 0.5;
  int reconnects = 0;
  int heartbeat_ms = opt.heartbeat_ms;
  int liveness = opt.liveness;
  double silent_s = opt.liveness * opt.heartbeat_ms / 1000.0;

  auto reconnect = [&](const std::string& why) {
    // The router is gone or cut off: reconnect with doubling backoff and say HELLO again.
    log_warn("stage", why + "; reconnecting");
    inbox.clear();
    parts.forget("");
    router_parts = false;   // until the new session's WELCOME says
    sock = make_socket();
    hello(*sock);
    welcomed = false;
    last_heard = Clock::now();
    backoff_s = timing::backoff_s(0.5, 8.0, ++reconnects);
  };

  // CHAOS from the router: a fault to add to this process's injector.
  auto add_fault = [&](Message& m) {
    try {
      faults.add_live(msg::read<msg::Chaos>(m).fault);
    } catch (const InputError& e) {
      stats.errors++;
      log_error("fault", std::string("refused a CHAOS fault from the router: ") + e.what());
      Message err = msg::error_reply(&m, WireErrc::kMalformed, e.what());
      answer(err);
    }
  };

  auto handle_incoming = [&](StageFaults::Delivery& d) {
    Message m;
    try {
      m = wire::decode(d.frames);
    } catch (const WireError& e) {
      stats.errors++;
      log_warn("stage", std::string("dropped a bad message from the router: ") + e.what());
      // The request's id when its envelope survived: the router re-sends it at once.
      Message err = msg::error_reply(wire::peek_id(d.frames).value_or(0), 0, e.code(), e.what());
      if (e.code() == WireErrc::kBadVersion) err.version = wire::kVersionForRefusals;  // readable by any version
      answer(err);
      return;
    }
    try {
      switch (m.type) {
        case MsgType::kWelcome: {
          // The router's liveness rule is the one that counts: heartbeat at its pace.
          const msg::Welcome w = msg::read<msg::Welcome>(m);
          heartbeat_ms = std::max(10, w.heartbeat_ms.value_or(heartbeat_ms));
          liveness = std::max(1, w.liveness.value_or(opt.liveness));
          silent_s = liveness * heartbeat_ms / 1000.0;
          router_parts = w.parts;
          welcomed = true;
          holdings.clear();  // a new session: the router knows nothing of what we held
          backoff_s = 0.5;
          reconnects = 0;
          log_info("stage", "registered with the router as " + w.peer_id.value_or(routing_id));
          break;
        }
        case MsgType::kHeartbeat: break;
        case MsgType::kError: {
          const msg::Error e = msg::read<msg::Error>(m);
          log_warn("stage", "router says: " + e.message);
          // The router does not know us (it restarted): introduce ourselves again.
          if (e.code == int(WireErrc::kOutOfOrder) && e.request_type == int(MsgType::kHeartbeat)) hello(*sock);
          break;
        }
        case MsgType::kBye:
          log_info("stage", "router said goodbye: " + msg::read<msg::Bye>(m).reason);
          stop = true;
          break;
        case MsgType::kChaos: add_fault(m); break;
        case MsgType::kPeerKeys: link->peer_keys(msg::read<msg::PeerKeys>(m)); break;
        case MsgType::kRelease:
          for (int64_t key : msg::read<msg::Release>(m).keys) holdings.release(uint64_t(key));
          break;
        case MsgType::kPush: link->push(msg::read<msg::Push>(m), now_s()); break;
        case MsgType::kFetch: {
          // The router relays a tensor this peer holds to a peer that could not reach it.
          Message rep = link->serve(m);
          relayed += rep.type == MsgType::kFetched;
          answer(rep);
          break;
        }
        case MsgType::kLoadStage:
          holdings.clear();  // another job or stage: nothing held is needed any more
          queue_work(std::move(m), d.seq);
          break;
        case MsgType::kForward:
          if (opt.echo) {
            // The transport benchmark's peer: the very bytes that came in go back at once, with
            // no trip through the compute thread.
            msg::Result r;
            r.mb = msg::read<msg::Hop>(m).mb;
            Message rep = msg::make(r, m.id, m.attempt);
            rep.tensors = std::move(m.tensors);
            answer(rep);
            break;
          }
          queue_work(std::move(m), d.seq);
          break;
        default:
          queue_work(std::move(m), d.seq);
      }
    } catch (const InputError& e) {
      // A session message we cannot read: counted and dropped; the process carries on.
      stats.errors++;
      log_warn("stage", std::string("dropped a malformed ") + wire::msg_type_name(m.type) + " from the router: " + e.what());
    }
  };

  // --http: the figures of /metrics, gathered on this thread when a scrape asks for them.
  auto publish_metrics = [&] {
    StageFigures f = gather_stage_figures(stats, holdings, *link);
    f.name = name;
    f.device = opt.device;
    f.precision = precision_name(own.precision);
    f.emulated = opt.emulate > 1 ? (opt.profile.empty() ? std::to_string(opt.emulate) + "x" : opt.profile) : "";
    f.queued = inbox.size();
    f.relayed = relayed;
    const DeviceInfo d = query_device(opt.device);
    f.device_memory_bytes = d.total_bytes;
    f.device_memory_free_bytes = d.free_bytes;
    http::Pages p;
    p.metrics = stage_exposition(f);
    pages.publish(std::move(p));
  };

  while (!stop) {
    if (faults.wait_while_frozen()) log_warn("fault", "freeze over: carrying on as before");
    std::vector<zmq::pollitem_t> items = {{sock->handle(), 0, ZMQ_POLLIN, 0}, {from_worker.handle(), 0, ZMQ_POLLIN, 0}};
    link->add_poll_items(items);
    const int poll_ms = link->waiting() ? 10 : std::max(10, heartbeat_ms / 4);  // fetch timeouts are checked each loop
    try {
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(faults.poll_ms(poll_ms)));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;  // SIGTERM: the loop condition decides
      throw;
    }
    if (items[1].revents & ZMQ_POLLIN) {
      // Replies from the compute thread: forwarded frame by frame, untouched unless a fault fires.
      while (auto r = wire::recv_frames(from_worker, false, zmq::recv_flags::dontwait)) {
        for (auto& f : faults.outgoing(finish_reply(std::move(r->frames)))) send_frames(f);
      }
    }
    link->set_cut(faults.partitioned());
    link->ready(items, 2, now_s());
    for (auto& r : link->take(now_s())) {
      if (r.error) {
        hold_ids.erase(r.error->id);
        push_ahead.erase(r.error->id);
        answer(*r.error);
        continue;
      }
      bool any = r.push_late > 0;
      for (int64_t b : r.fetched) any |= b > 0;
      if (any) fetched_by_id[r.msg.id] = Fetched{std::move(r.fetched), r.push_late, r.fetch_s};
      inbox.push(std::move(r.msg), r.seq);
    }
    if (items[0].revents & ZMQ_POLLIN) {
      std::vector<StageFaults::Delivery> deliveries;
      while (!faults.frozen()) {
        auto r = wire::recv_frames(*sock, false, zmq::recv_flags::dontwait);
        if (!r) break;
        if (faults.partitioned()) {   // cut off: nothing arrives, a message half-way across included
          parts.forget("");
          continue;
        }
        std::optional<Frames> whole;
        try {
          whole = parts.take("", std::move(r->frames), now_s());
        } catch (const WireError& e) {
          stats.errors++;
          log_error("stage", std::string("dropped a message from the router that came in parts: ") + e.what());
          continue;
        }
        if (!whole) {   // a PART: the router is there, the rest of its message on the way
          last_heard = Clock::now();
          continue;
        }
        if (faults.incoming(std::move(*whole), deliveries)) last_heard = Clock::now();
        for (auto& d : deliveries) handle_incoming(d);
        deliveries.clear();
      }
    }
    for (auto& d : faults.due_incoming()) handle_incoming(d);
    for (auto& f : faults.due_outgoing()) send_frames(f);
    const auto now = Clock::now();
    if (std::chrono::duration<double, std::milli>(now - last_tick).count() >= heartbeat_ms) {
      last_tick = now;
      holdings.expire(now_s());
    }
    // A peer with faults injected heartbeats every beat: the `heartbeat` fault point keeps its pace
    // (docs/faults.md, "Points").
    const double beat_s = heartbeat_ms / 1000.0;
    // So does one receiving a large message in PARTs: each beat tells the router its replies wait
    // behind it. One whose parts stopped coming (the router's send failed half-way) is dropped.
    parts.expire(now_s(), silent_s);
    const bool receiving = parts.unfinished() > 0;
    const double beat_due_s = faults.armed() || receiving ? last_beat_s + beat_s : timing::next_heartbeat_s(last_beat_s, last_sent_s, beat_s, liveness);
    if (now_s() >= beat_due_s) {
      last_beat_s = now_s();
      msg::Heartbeat b;
      b.stage = stats.stage.load();
      b.job_id = stats.job_id.load();
      b.ready = stats.ready.load();
      b.receiving = receiving;
      b.queue = inbox.size();
      b.ms_per_unit = stats.ms_per_unit.load();
      b.forwards = stats.forwards.load();
      b.backwards = stats.backwards.load();
      b.cache_hits = stats.cache_hits.load();
      b.recomputes = stats.recomputes.load();
      if (const int64_t e = stats.cache_entries.load(); e >= 0) b.cache_entries = e;
      b.steps = stats.steps.load();
      b.errors = stats.errors.load();
      b.overflows = stats.overflows.load();
      b.skipped_steps = stats.skipped_steps.load();
      b.loss_scale = stats.loss_scale.load();
      Message hb = msg::make(b);
      for (auto& f : faults.heartbeat(wire::encode(hb))) send_frames(f);
    }
    if (http_server && pages.wanted()) publish_metrics();
    const double silence_s = std::chrono::duration<double>(now - last_heard).count();
    if (const auto cut_s = faults.partition_healed()) {
      // The router has declared us dead if the partition outlasted its window: rejoin at once.
      if (*cut_s > silent_s) reconnect("the partition outlasted the router's " + std::to_string(silent_s) + " s window");
    } else if (!faults.partitioned() && silence_s > silent_s + (welcomed ? 0 : backoff_s)) {
      reconnect(std::string("router silent for ") + std::to_string(silent_s) + " s" +
                (keys && !welcomed ? " (is this server's public key in the router's authorized file with role stage, and --router-key the router's?)" : ""));
    }
  }
  if (!link->address().empty())
    log_info("stage", "peer to peer: " + std::to_string(link->fetches) + " fetched, " + std::to_string(link->pushed_in) + " pushed here (" +
                          std::to_string(link->push_late) + " late), " + std::to_string(link->pushes) + " pushed out, " +
                          std::to_string(link->served) + " served");
  if (!faults.partitioned()) {
    msg::Bye b;
    b.reason = "shutting down";
    Message bye = msg::make(b);
    wire::send(*sock, bye);
  }
  worker_stop = true;
  compute.join();
  pages.stop();
  return 0;
}

}  // namespace swarm
