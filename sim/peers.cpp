// peers.cpp: the simulated stage servers (sim/world.h): HELLO and heartbeats, receiving the
// router's messages, fetching referenced tensors from their holders over the links, one compute
// thread each (requests in the order they become whole), answering through sim/stage_replies.h,
// crashes and restarts, and the scenario's fault events.
#include <algorithm>

#include "runtime/precision.h"
#include "runtime/timing.h"
#include "sim/world.h"

namespace swarm::sim {

namespace {

constexpr double kFetchTimeoutS = 30;      // swarm-stage --fetch-timeout-s default
constexpr double kHelloRetryS = 2;         // a HELLO without WELCOME is said again
constexpr uint64_t kSmallMessage = 128;    // a FETCH request on the wire [bytes]

}  // namespace

void World::hello(int i) {
  SimPeer& p = peers[size_t(i)];
  const PeerGroup& g = sc.groups[size_t(p.group)];
  msg::Hello h;
  h.role = msg::Role::kStage;
  h.version = wire::kVersion;
  h.name = p.name;
  h.stage = g.stage;
  if (g.prefer_lo >= 0) h.prefer_stage = g.prefer_lo + p.within % (g.prefer_hi - g.prefer_lo + 1);
  h.listen = p.listen;
  h.device = p.dev.cuda ? "cuda:0" : "cpu";
  h.device_name = p.dev.name;
  if (p.dev.memory_bytes >= 0 && g.says_memory) h.device_memory_bytes = h.device_memory_free_bytes = p.dev.memory_bytes;
  h.precision = p.dev.precision;
  h.profile = p.dev.name;
  h.threads = 1;
  p.last_hello_s = now;
  to_router(i, msg::make(h), now);
}

void World::join(int i) {
  SimPeer& p = peers[size_t(i)];
  if (p.alive) return;
  p.generation++;
  p.id = "p-" + p.name + (p.generation > 1 ? "." + std::to_string(p.generation) : "");
  p.alive = true;
  p.welcomed = false;
  p.book = StageBook{};
  // Its affinity cache is sized, at each LOAD_STAGE, to the memory its HELLO says it has.
  p.book.memory_bytes = sc.groups[size_t(p.group)].says_memory ? p.dev.memory_bytes : -1;
  p.book.has_data = sc.groups[size_t(p.group)].has_data;
  p.book.cuda = p.dev.cuda;
  p.book.listen = p.listen;
  p.book.precision = parse_precision(p.dev.precision);
  p.quirks = Quirks{};
  p.slow = 1;
  p.corrupt_p = 0;
  p.stall_until = 0;
  p.ms_per_unit = 0;
  p.last_beat_s = p.last_sent_s = now;   // a new process: its first heartbeat a beat from now
  p.busy_until = now;
  p.host.up.free_s = p.host.down.free_s = now;
  p.host.up.ends.clear();
  p.host.down.ends.clear();
  if (p.generation > 1) {
    rejoins++;
    line({{"event", "rejoin"}, {"t_s", now}, {"peer", p.name}, {"id", p.id}});
  }
  ideal_changed();
  ideal_flops += p.dev.flops;
  group_alive[size_t(p.group)]++;
  hello(i);
  // Heartbeats at the router's pace, from a phase of its own.
  at(peers_side, now + rng.uniform(0.5, 1.0) * sc.heartbeat_ms / 1000.0, Ev::kHeartbeat, i);
  schedule_crash(i);
}

void World::schedule_crash(int i) {
  if (!(sc.faults.crash_per_hour > 0)) return;
  at(peers_side, now + rng.exponential(3600.0 / sc.faults.crash_per_hour), Ev::kCrash, i);
}

void World::crash(int i, const std::string& why, double rejoin_after_s) {
  SimPeer& p = peers[size_t(i)];
  if (!p.alive) return;
  crashes++;
  ideal_changed();
  ideal_flops -= p.dev.flops;
  group_alive[size_t(p.group)]--;
  line({{"event", "crash"}, {"t_s", now}, {"peer", p.name}, {"id", p.id}, {"stage", p.book.stage}, {"why", why}});
  p.alive = false;
  p.session++;            // its queued work, its timers and what it was sending die with it
  p.book = StageBook{};   // so does what it held for others
  if (rejoin_after_s >= 0) at(peers_side, now + rejoin_after_s, Ev::kJoin, i);
}

void World::heartbeat(int i) {
  SimPeer& p = peers[size_t(i)];
  if (!p.alive) return;
  const double beat_s = sc.heartbeat_ms / 1000.0;
  if (now < p.stall_until || !p.welcomed) {   // stopped: no heartbeat; not welcomed: HELLO again
    at(peers_side, now + beat_s, Ev::kHeartbeat, i);
    if (now >= p.stall_until && now - p.last_hello_s >= kHelloRetryS) hello(i);
    return;
  }
  // Not while it sent the router something within the last beat, as a stage server.
  if (const double due = timing::next_heartbeat_s(p.last_beat_s, p.last_sent_s, beat_s, sc.liveness); now < due) {
    at(peers_side, due, Ev::kHeartbeat, i);
    return;
  }
  p.last_beat_s = now;
  at(peers_side, now + beat_s, Ev::kHeartbeat, i);
  msg::Heartbeat hb;
  hb.stage = p.book.stage;
  hb.job_id = p.book.job;
  hb.ready = p.book.loaded;
  if (p.book.loaded) hb.cache_entries = int64_t(p.book.cache_entries);
  hb.ms_per_unit = p.ms_per_unit;
  to_router(i, msg::make(hb), now);
}

void World::peer_receives(int i, wire::Message m) {
  using wire::MsgType;
  SimPeer& p = peers[size_t(i)];
  switch (m.type) {
    case MsgType::kWelcome:
      p.welcomed = true;
      p.book.held.clear();   // a new session: the router knows nothing of what it held
      p.book.held_bytes = 0;
      return;
    case MsgType::kError: {
      const msg::Error e = msg::read<msg::Error>(m);
      // The router does not know it (it restarted, or declared it dead): it introduces itself again.
      if (e.code == int(WireErrc::kOutOfOrder) && e.request_type == int(MsgType::kHeartbeat)) {
        p.welcomed = false;
        hello(i);
      }
      return;
    }
    case MsgType::kBye: crash(i, "the router said goodbye", -1); return;
    case MsgType::kHeartbeat: case MsgType::kChaos: return;
    case MsgType::kRelease: {
      std::vector<int64_t> none;
      reply(p.book, m, none, 0, now, p.quirks, payloads);
      return;
    }
    case MsgType::kFetch:
      // The router relaying a tensor this peer holds (its I/O thread answers at once).
      to_router(i, answer_fetch(p.book, m), now + p.dev.overhead_ms / 1000.0);
      return;
    default: break;
  }
  // A request: its references are fetched from their holders first (its I/O thread does that
  // while the compute thread works), then it queues for the compute thread.
  Slot req;
  req.m = std::move(m);
  const uint32_t slot = peers_side.slots.put(std::move(req));
  Slot& s = peers_side.slots[slot];
  if (std::find(std::begin(msg::Hop::kTypes), std::end(msg::Hop::kTypes), s.m.type) != std::end(msg::Hop::kTypes)) {
    msg::Hop h = msg::read<msg::Hop>(s.m);
    s.mb = h.mb;
    s.push_to = std::move(h.push_to);
    if (std::optional<wire::Message> e = own_tokens(p.book, s.m, h, payloads)) {
      peers_side.slots.take(slot);
      to_router(i, std::move(*e), now + p.dev.overhead_ms / 1000.0);
      return;
    }
  }
  s.fetched.assign(s.m.tensors.size() + s.m.refs.size(), 0);
  double whole = now, failed_at = 1e300;
  // As PeerLink waits: --fetch-timeout-s, or less where the request asks.
  const double window = timing::fetch_window_s(kFetchTimeoutS, s.m.fetch_within_ms);
  const bool copies = msg::Hop::keeps_copies(s.m.type);
  for (const wire::TensorRef* ref : to_fetch(p.book, s.m)) {
    auto it = by_listen.find(ref->from);
    SimPeer* h = it == by_listen.end() ? nullptr : &peers[size_t(it->second)];
    double done = 0;
    std::optional<FetchFailure> why;
    if (const double* in = p.book.incoming.find(ref->key)) {
      // Pushed here: it arrives (or has) without being asked for.
      pushes_used++;
      s.fetched[ref->slot] = int64_t(ref->desc.wire_bytes());
      if (copies) keep_copy(p.book, ref->key, ref->desc.nbytes);
      whole = std::max(whole, *in);
      p.book.incoming.erase(ref->key);
      continue;
    }
    // A push that is not coming is waited for a while (PeerLink's push_wait_s), then fetched.
    fetches++;
    const double from = ref->pushed ? now + timing::push_wait_s(ref->desc.wire_bytes(), window) : now;
    if (!h || !h->alive) {
      why = FetchFailure::kUnreachable;   // nothing answers at that address: the fetch times out
      done = now + window;
    } else {
      const double asked = transfer(p.host, h->host, kSmallMessage, from);
      const double answers = std::max(asked, h->stall_until);   // a stopped holder answers when it runs again
      if (answers - now > window) {
        why = FetchFailure::kUnreachable;
        done = now + window;
      } else if (!h->book.held.count(ref->key)) {
        why = FetchFailure::kNotHeld;
        done = transfer(h->host, p.host, kSmallMessage, answers);
      } else {
        done = transfer(h->host, p.host, ref->desc.nbytes, answers);
        s.fetched[ref->slot] = int64_t(ref->desc.wire_bytes());
        if (copies) keep_copy(p.book, ref->key, ref->desc.nbytes);
      }
    }
    if (why) {
      fetch_failures++;
      if (done < failed_at) {
        failed_at = done;
        s.failure = std::make_unique<wire::Message>(fetch_error(s.m, ref->slot, *why, ref->from));
      }
    } else {
      whole = std::max(whole, done);
    }
  }
  at(peers_side, s.failure ? failed_at : whole, Ev::kWhole, i, slot);
}

void World::push(int i, const wire::Message& m) {
  SimPeer& h = peers[size_t(i)];
  const msg::Push pu = msg::read<msg::Push>(m);
  push_from(h, pu.key, size_t(pu.part), pu.to, now);   // a stopped holder reads the PUSH when it runs again (kToPeer)
}

void World::push_from(SimPeer& h, uint64_t key, size_t part, const std::string& to_addr, double at) {
  const std::vector<wire::Tensor>* held = h.book.held.find(key);
  auto to = by_listen.find(to_addr);
  if (!held || part >= held->size() || to == by_listen.end()) return;   // the receiver fetches, and hears not_held
  SimPeer& r = peers[size_t(to->second)];
  if (!r.alive) return;
  pushes++;
  StageBook& b = r.book;
  if (b.incoming.emplace(key, transfer(h.host, r.host, (*held)[part].desc.nbytes, at)).second) {
    b.incoming_order.push_back(key);
    if (b.incoming_order.size() > 4 * b.cache_entries) {
      b.incoming.erase(b.incoming_order.front());
      b.incoming_order.erase(b.incoming_order.begin());
    }
  }
}

void World::request_whole(int i, uint32_t slot) {
  SimPeer& p = peers[size_t(i)];
  Slot& s = peers_side.slots[slot];
  if (s.failure) {
    to_router(i, std::move(*peers_side.slots.take(slot).failure), now + p.dev.overhead_ms / 1000.0);
    return;
  }
  // What the work costs on this device, jittered and slowed.
  using wire::MsgType;
  const wire::Message& m = s.m;
  int stage = p.book.stage;
  int64_t values = 0;
  int members = 1;
  if (m.type == MsgType::kLoadStage) {
    stage = int(msg::read<msg::LoadStage>(m).stage);
  } else if (m.type == MsgType::kRoundBegin || m.type == MsgType::kRoundReduce) {
    const msg::RoundRef r = msg::read<msg::RoundBegin>(m);
    const int64_t P = stage >= 0 ? costs.params[size_t(stage)] : 0;
    values = r.what == msg::RoundWhat::kGrad ? P : P / std::max(1, r.fragments);
    members = std::max(1, r.shards);
    if (m.type == MsgType::kRoundReduce) values /= members;
  } else if (m.type == MsgType::kRoundApply || m.type == MsgType::kStateLoad || m.type == MsgType::kStateRequest) {
    values = stage >= 0 ? costs.params[size_t(stage)] : 0;
    if (m.type != MsgType::kRoundApply) values *= int64_t(std::max<size_t>(1, m.tensors.size() + m.refs.size()));
  }
  const bool cached = has_graph(p.book, m.type, s.mb);
  s.compute_s = request_seconds(p.dev, costs, m.type, stage, cached, values, members) * rng.jitter(p.dev.jitter) * p.slow;
  const double start = std::max(now, p.busy_until);
  p.busy_until = start + s.compute_s;
  at(peers_side, p.busy_until, Ev::kComputed, i, slot);
}

void World::computed(int i, uint32_t slot) {
  SimPeer& p = peers[size_t(i)];
  if (now < p.stall_until) {   // stopped mid-work: it finishes when it runs again
    at(peers_side, p.stall_until, Ev::kComputed, i, slot);
    return;
  }
  Slot s = peers_side.slots.take(slot);
  win.group_busy_s[size_t(p.group)] += s.compute_s;
  const bool cached = has_graph(p.book, s.m.type, s.mb);
  const double units = work_units(s.m.type, cached);
  if (units > 0 && p.book.stage >= 0 && p.book.stage < costs.stages) {
    const double fwd = costs.fwd_flops[size_t(p.book.stage)];
    win.hop_flops += units * fwd;
    if (s.m.type == wire::MsgType::kBackward && !cached) win.recompute_flops += fwd;
  }
  std::optional<wire::Message> rep = reply(p.book, s.m, s.fetched, s.compute_s * 1000.0, now, p.quirks, payloads);
  if (rep && !rep->refs.empty() && (s.m.type == wire::MsgType::kBackward || s.m.type == wire::MsgType::kForwardLoss)) {
    // Made and held: pushed at once to the peer the router expects to take the next hop.
    if (s.push_to) push_from(p, s.m.id, 0, *s.push_to, now);
  }
  if (units > 0) p.ms_per_unit = timing::ema(p.ms_per_unit, s.compute_s * 1000.0 / units);
  peak_held_bytes = std::max(peak_held_bytes, p.book.held_bytes);
  if (!rep) return;
  if (p.corrupt_p > 0 && !rep->tensors.empty() && rng.chance(p.corrupt_p)) {
    corrupt_sent++;
    to_router(i, std::move(*rep), now, true);
    return;
  }
  to_router(i, std::move(*rep), now);
}

void World::fault(size_t index) {
  const FaultEvent& f = sc.faults.events[index];
  using K = FaultEvent::Kind;
  nlohmann::json names = nlohmann::json::array();
  auto report = [&](const char* kind) {
    line({{"event", "fault"}, {"t_s", now}, {"kind", kind}, {"peers", names}});
  };
  // The peers it hits: every live peer of the stage for kill_stage, else `peers` of the live
  // ones (of its group and stage, when given), drawn by the seed.
  std::vector<int> cands;
  for (const SimPeer& p : peers) {
    if (!p.alive || (!f.group.empty() && sc.groups[size_t(p.group)].name != f.group)) continue;
    if (f.stage >= 0 && p.book.stage != f.stage) continue;
    cands.push_back(p.index);
  }
  if (f.kind != K::kKillStage) {
    const size_t n = std::min(cands.size(), size_t(f.peers));
    for (size_t k = 0; k < n; ++k) std::swap(cands[k], cands[k + size_t(rng.below(cands.size() - k))]);
    cands.resize(n);
    std::sort(cands.begin(), cands.end());
  }
  for (int i : cands) {
    SimPeer& p = peers[size_t(i)];
    names.push_back(p.name);
    switch (f.kind) {
      case K::kKillStage: case K::kCrash: crash(i, "fault event", f.rejoin_after_s); continue;
      case K::kStall: p.stall_until = std::max(p.stall_until, now + f.for_s); continue;
      case K::kSlow: p.slow = f.factor; break;
      case K::kCorrupt: p.corrupt_p = f.probability; break;
      case K::kLie:
        if (f.how == "wrong_shape") p.quirks.wrong_shape = {costs.B, costs.T, costs.d_model + 1};
        else if (f.how == "bad_inputs") p.quirks.bad_input_reports = 1 << 30;
        else p.quirks.claim_factor = 100;
        break;
      case K::kRestartRouter: break;
    }
    at(peers_side, now + f.for_s, Ev::kFaultEnd, i);
  }
  static const char* kinds[] = {"stall", "slow", "corrupt", "lie", "kill_stage", "crash", "restart_router"};
  report(kinds[int(f.kind)]);
}

void World::fault_end(int i) {
  SimPeer& p = peers[size_t(i)];
  p.slow = 1;
  p.corrupt_p = 0;
  const uint64_t hash = p.quirks.hash;
  p.quirks = Quirks{};
  p.quirks.hash = hash;
}

}  // namespace swarm::sim
