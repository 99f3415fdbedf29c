// flights.cpp: implements router/flights.h.
#include "router/flights.h"

#include <algorithm>

#include "router/dispatch.h"
#include "router/placement.h"
#include "runtime/random.h"
#include "runtime/timing.h"

namespace swarm::router {

namespace {

wire::MsgType msg_type(HopKind k) {
  switch (k) {
    case HopKind::kForward: return wire::MsgType::kForward;
    case HopKind::kForwardLoss: return wire::MsgType::kForwardLoss;
    case HopKind::kBackward: return wire::MsgType::kBackward;
    case HopKind::kEval: return wire::MsgType::kEval;
  }
  return wire::MsgType::kForward;
}

double hop_units(HopKind k) {
  switch (k) {
    case HopKind::kForward: case HopKind::kEval: return kForwardUnits;
    case HopKind::kForwardLoss: return kForwardLossUnits;
    case HopKind::kBackward: return kBackwardRecomputeUnits;
  }
  return 1;
}

}  // namespace

const char* hop_kind_name(HopKind k) {
  switch (k) {
    case HopKind::kForward: return "forward";
    case HopKind::kForwardLoss: return "forward_loss";
    case HopKind::kBackward: return "backward";
    case HopKind::kEval: return "eval";
  }
  return "?";
}

void Flights::resent_hop(Ctx& c, const Flight& f, const Pending& pd, bool error, const std::string& why) {
  resent++;
  if (error) rejected++;
  hop_metrics.failed(f.stage, kind_label(f), error);
  const Peer* p = c.peers.find(pd.peer);
  c.event(EventKind::kResend, LogLevel::kDebug,
          std::string(f.eval ? "eval batch " : "microbatch ") + std::to_string(f.index) + ": " + kind_label(f) + " at stage " +
              std::to_string(f.stage) + " sent again (" + why + ")",
          cfg_.job, p, f.stage);
}

Flight& Flights::add(uint64_t key, Flight f) {
  const size_t S = size_t(cfg_.stages);
  f.at.resize(S);
  auto [it, ok] = flights_.emplace(key, std::move(f));
  SWARM_CHECK(ok, "microbatch " + std::to_string(key) + " taken twice");
  where_.emplace(key, it);
  track(key, it->second);
  return it->second;
}

void Flights::clear(Ctx& c) {
  for (auto& [key, f] : flights_) release_all(c, f);
  flights_.clear();
  for (StageQueue& q : waiting_) q = StageQueue();
  where_.clear();
  backwards_sent_.clear();
}

// Counts a training backward's first send at its stage; true when the step's other backwards
// at this stage went out before it. A peer answers its requests in order, so the one this goes
// to has then added every backward of the step it was sent. A backward sent again (its output
// was lost downstream) counts twice and closes the step a little early: the peer then steps
// early, and a later backward of the step adds to the next step, as any late backward does.
bool Flights::count_backward(const Flight& f) {
  if (cfg_.closes_steps_of <= 0 || f.eval || (f.kind != HopKind::kBackward && f.kind != HopKind::kForwardLoss)) return false;
  const int M = cfg_.closes_steps_of;
  const uint64_t step = f.index / uint64_t(M);
  auto& sent = backwards_sent_[step];
  if (sent.empty()) sent.assign(size_t(cfg_.stages), 0);
  int& n = sent[size_t(f.stage)];
  if (f.attempts == 0) n++;
  const bool closes = n >= M;
  // Stage 0 sends a step's backwards last: then this step, and any before it, are done with.
  if (closes && f.stage == 0) backwards_sent_.erase(backwards_sent_.begin(), backwards_sent_.upper_bound(step));
  return closes;
}

void Flights::dispatch(Ctx& c) {
  for (int s = 0; s < cfg_.stages; ++s) {
    StageQueue& q = waiting_[size_t(s)];
    if (q.flights.empty()) continue;
    if (q.full && q.full_since == c.peers.ready_changes()) continue;   // no room until a hop there ends
    q.full = false;
    const bool ready = c.peers.any_ready(cfg_.job, s);   // else paused until a peer of the stage is ready
    for (auto it = q.flights.begin(); it != q.flights.end();) {
      const uint64_t key = it->first;
      Flight& f = *it->second;
      if (c.now < f.not_before_s) {
        ++it;
        continue;
      }
      // A tensor lost with its holder is made again first (at most once per stage).
      for (int k = 0; k <= 2 * cfg_.stages && !repair(f); ++k) {}
      if (f.stage != s) {
        // Sent back to another stage: queued there (and sent in this pass if that stage is later).
        it = q.flights.erase(it);
        f.queued_at = -1;
        track(key, f);
        continue;
      }
      if (ready && !send_hop(c, key, f)) {
        q.full = true;
        q.full_since = c.peers.ready_changes();
        break;
      }
      if (f.req_id != 0) {
        it = q.flights.erase(it);
        f.queued_at = -1;
      } else {
        ++it;
      }
    }
  }
}

Slot* Flights::slot_of(Flight& f, int slot) {
  const size_t s = size_t(f.stage);
  if (slot == 0) return &f.at[s].input;
  if (slot == 1 && f.kind == HopKind::kBackward) return &f.at[s].grad;
  return nullptr;  // the targets: the router's own
}

void Flights::release_all(Ctx& c, Flight& f) {
  for (FlightStage& st : f.at) c.drop(st.input);
  for (FlightStage& st : f.at) c.drop(st.grad);
}

// A stage's input is fetched (or pushed) by the peer of its forward, and again by the peer of its
// backward when that is another; the gradient of its output by the peer of its backward, and
// pushed ahead to the peer of its forward (ahead_target) even when the backward goes elsewhere.
// Each keeps a copy (msg::Hop::keeps_copies) until a RELEASE names it or its time to live passes
// (the stage server's cache_ttl_s). Once the stage's backward is done, nothing needs them: a
// tensor made again later is fetched from its holder, which keeps it until the microbatch
// completes.
void Flights::release_copies(Ctx& c, const Flight& f, Peer& p) {
  release_stage_copies(c, f, p);
  const PeerId& fwd = f.at[size_t(f.stage)].fwd_peer;
  if (!fwd.empty() && fwd != p.id)
    if (Peer* q = c.peers.find(fwd)) release_stage_copies(c, f, *q);
}

void Flights::release_stage_copies(Ctx& c, const Flight& f, Peer& at) {
  const FlightStage& st = f.at[size_t(f.stage)];
  for (const Slot* s : {&st.input, &st.grad})
    if (const Held* h = s->held(); h && at.id != h->holder) c.release(at, h->key);
}

// A hop sent again goes to another peer (the one that failed it is tried last), and a tensor it
// needs is fetched from its holder, which keeps it until the microbatch completes: what the
// failed peer kept would otherwise wait there for cache_ttl_s. Should the hop come back to it,
// it fetches again.
void Flights::release_failed_copies(Ctx& c, const Flight& f, const Pending& pd) {
  if (!cfg_.p2p || f.eval) return;   // only training hops keep copies (msg::Hop::keeps_copies)
  if (Peer* p = c.peers.find(pd.peer)) release_stage_copies(c, f, *p);
  if (f.ahead_key == pd.id) c.release(f.ahead_to, pd.id);
}

bool Flights::repair(Flight& f) {
  const size_t s = size_t(f.stage);
  if (!f.at[s].input.known() && !(s == 0 && cfg_.tokens)) {
    SWARM_CHECK(s > 0, "a microbatch lost its tokens");
    // The stage input is made again by the previous stage's forward; a backward resumes after it.
    if (f.kind == HopKind::kBackward) f.resume_stage = f.stage;
    f.stage--;
    f.kind = f.eval ? HopKind::kEval : HopKind::kForward;
  } else if (f.kind == HopKind::kBackward && !f.at[s].grad.known()) {
    // The output gradient is made again by the next stage's backward (or loss).
    f.stage++;
    f.kind = f.stage == cfg_.stages - 1 ? HopKind::kForwardLoss : HopKind::kBackward;
  } else {
    return true;
  }
  remade++;
  f.attempts = 0;
  f.busy_link = false;
  f.tried.clear();
  f.suspect_tensor = -1;
  f.suspect_reporter.clear();
  return false;
}

void Flights::on_peer_gone(const PeerId& peer) {
  auto forget = [&](Slot& s) {
    if (const Held* h = s.held(); h && h->holder == peer) s.clear();
  };
  for (auto& [key, f] : flights_)
    for (FlightStage& st : f.at) {
      forget(st.input);
      forget(st.grad);
    }
}

// Every ready peer of the stage, or in a large stage a seeded sample of them (the draws are a
// function of the job, the microbatch, the stage, the hop's kind and its attempt, so a run
// replays) with the forward's peer added for a backward. Static routing (GPipe/DeepSpeed style,
// for comparison): pipeline i chains the i-th ready peer of every stage in join order;
// microbatch k always runs on pipeline k mod P.
std::vector<Peer*> Flights::candidates(Ctx& c, const Flight& f) {
  if (cfg_.mode != RoutingMode::kStatic || cfg_.echo) {
    if (c.peers.ready_count(cfg_.job, f.stage) <= kSampleAbove) return c.peers.stage_peers(cfg_.job, f.stage, c.now);
    const uint64_t stream = (uint64_t(f.stage) << 32) | (uint64_t(f.kind) << 24) | uint64_t(f.attempts);
    std::vector<Peer*> out = c.peers.sample_ready(cfg_.job, f.stage, c.now, kSampled, [&](uint64_t i) { return counter_draw(cfg_.job, f.index, i, stream); });
    if (f.kind == HopKind::kBackward && !f.at[size_t(f.stage)].fwd_peer.empty()) {
      Peer* holder = c.peers.find(f.at[size_t(f.stage)].fwd_peer);
      if (holder && holder->job_id == cfg_.job && holder->stage == f.stage && holder->state == PeerState::kReady &&
          c.now >= holder->unresponsive_until_s && std::find(out.begin(), out.end(), holder) == out.end())
        out.push_back(holder);
    }
    return out.empty() ? c.peers.stage_peers(cfg_.job, f.stage, c.now) : out;
  }
  std::vector<std::vector<std::string>> by_stage(size_t(cfg_.stages));
  for (int s = 0; s < cfg_.stages; ++s)
    for (const Peer* p : c.peers.stage_peers(cfg_.job, s, c.now)) by_stage[size_t(s)].push_back(p->id);
  const auto pipes = static_pipelines(by_stage);
  const int k = static_pipeline_for(f.index, pipes.size());
  if (k < 0) return {};
  return {c.peers.find(pipes[size_t(k)][size_t(f.stage)])};
}

bool Flights::send_hop(Ctx& c, uint64_t key, Flight& f) {
  std::vector<Peer*> peers = candidates(c, f);
  if (peers.empty()) return true;  // paused until a peer of the stage is ready
  std::vector<Candidate>& cands = cands_;
  bool open = false;   // an eligible peer with room in its queue
  bool room = false;   // a peer with room, eligible or not (it may have failed this hop)
  // The peer keeping this microbatch's forward graph, compared by record: the candidates' ids
  // stay unread.
  const Peer* affine = f.kind == HopKind::kBackward && !f.at[size_t(f.stage)].fwd_peer.empty() ? c.peers.find(f.at[size_t(f.stage)].fwd_peer) : nullptr;
  auto describe = [&] {
    size_t tried_live = 0;
    if (!f.tried.empty())
      for (const Peer* p : peers) tried_live += f.tried.count(p->id);
    cands.clear();
    cands.reserve(peers.size());
    open = false;
    room = false;
    bool eligible = false;
    for (const Peer* p : peers) {
      Candidate cd;
      cd.queued_units = p->queued_units;
      // The router's own measurement only: a peer it has not timed yet enters at the fastest
      // measured speed (choose_peer), whatever its heartbeat says, so that a pessimistic first
      // figure (a cold start, a load timed while its host was busy) cannot keep it from ever
      // being tried, and measured.
      cd.ms_per_unit = p->ms_per_unit;
      cd.affinity = p == affine;
      // A peer that failed this hop is tried again only once every live peer has failed it.
      const bool banned = c.peers.banned(*p, c.now);
      cd.excluded = banned || (tried_live > 0 && f.tried.count(p->id) && tried_live < peers.size());
      cd.full = p->queued_units >= queue_bound_units(p->ms_per_unit > 0 ? p->deadline_ms_per_unit() : 0, cfg_.max_queued_s);
      eligible |= !cd.excluded;
      open |= !cd.excluded && !cd.full;
      room |= !banned && !cd.full;
      cands.push_back(cd);
    }
    return eligible;
  };
  bool eligible = describe();
  // A large stage's sample all full: the whole stage may still have room.
  if (eligible && !open && peers.size() < c.peers.ready_count(cfg_.job, f.stage)) {
    peers = c.peers.stage_peers(cfg_.job, f.stage, c.now);
    eligible = describe();
  }
  // It waits at the router for a peer with room; the rest of its stage too, unless the peer with
  // room is one only this flight may not use (it failed this hop there).
  if (eligible && !open) return room;
  const double units = cfg_.echo ? kForwardUnits : hop_units(f.kind);
  int pick = choose_peer(cands, units, kBackwardCachedUnits);
  if (pick < 0) {
    // Everyone is banned or already failed this hop: the ban that ends first.
    pick = 0;
    for (size_t i = 1; i < peers.size(); ++i)
      if (peers[i]->banned_until_s < peers[size_t(pick)]->banned_until_s) pick = int(i);
  }
  Peer& p = *peers[size_t(pick)];
  const double my_units = cands[size_t(pick)].affinity ? kBackwardCachedUnits : units;
  const size_t s = size_t(f.stage);

  msg::Hop body;
  body.eval = f.eval;
  body.job_id = cfg_.job;
  body.mb = f.index;
  body.stage = f.stage;
  if (count_backward(f)) body.closes_step = true;
  Peer* ahead = cfg_.p2p && p.can_hold() ? ahead_target(c, f, p) : nullptr;
  if (ahead) {
    body.push_to = ahead->hello.listen;
    if (!ahead->key.empty()) body.push_to_key = ahead->key;
  }
  const bool with_tokens = cfg_.tokens && msg::Hop::takes_tokens(f.stage);
  const bool with_targets = cfg_.tokens && msg::Hop::takes_targets(msg_type(f.kind), f.stage, cfg_.stages);
  const bool own_tokens = p.samples_tokens && (with_tokens || with_targets);
  // The peer's own tokens are slot 0 of a stage-0 hop, ahead of what the message carries: the
  // message numbers its references without them, and what the peer reports counts them
  // (msg::Hop::put_own).
  const uint32_t lead = own_tokens && with_tokens ? 1 : 0;
  if (own_tokens) {
    body.own_tokens = true;
    this->own_tokens++;
  }
  wire::Message m = msg::make(msg_type(f.kind), body, 0, f.attempts);
  m.hold = cfg_.p2p && p.can_hold();
  auto tokens = [&](bool targets) {
    m.tensors.push_back(cfg_.tokens(f.index, f.eval, targets));
    bytes_tokens += m.tensors.back().desc.wire_bytes();
  };
  if (with_tokens) {
    if (!own_tokens) tokens(false);
  } else {
    c.attach(m, f.at[s].input, 0);
    // A backward on the peer of the forward finds its input there (it fetched it, or it was pushed).
    if (!(f.kind == HopKind::kBackward && f.at[s].fwd_peer == p.id)) push(c, f, f.at[s].input, p, m);
  }
  if (with_targets && !own_tokens) tokens(true);
  if (f.kind == HopKind::kBackward) {
    c.attach(m, f.at[s].grad, 1 - lead);
    push(c, f, f.at[s].grad, p, m);
  }
  if (!f.eval && !cfg_.echo) {
    // Bytes through the router count here; bytes fetched peer to peer when the receiver reports them.
    if (f.stage > 0 && f.at[s].input.tensor()) {
      bytes_act += f.at[s].input.wire_bytes();
      bytes_relayed += f.at[s].input.wire_bytes();
    }
    if (f.kind == HopKind::kBackward && f.at[s].grad.tensor()) {
      bytes_grad += f.at[s].grad.wire_bytes();
      bytes_relayed += f.at[s].grad.wire_bytes();
    }
  }
  // Deadline: a generous multiple of what this peer should need, within the job's bounds.
  const double per = p.ms_per_unit > 0 ? p.deadline_ms_per_unit() : 1000.0;
  const bool long_hop = f.kind == HopKind::kBackward || f.kind == HopKind::kForwardLoss;
  Pending pd;
  pd.kind = ReqKind::kHop;
  pd.job = cfg_.job;
  pd.key = key;
  pd.stage = f.stage;
  pd.peer = p.id;
  pd.units = my_units;
  pd.deadline_s = c.now + timing::deadline_s((p.queued_units + my_units) * per / 1000.0, long_hop ? cfg_.backward_cap_s : cfg_.forward_cap_s);
  pd.hold = m.hold;
  for (const wire::TensorRef& r : m.refs)
    if (r.pushed) pd.pushed |= uint8_t(1u << (r.slot + lead));
  const char* label = kind_label(f);
  f.req_id = c.request(pd, std::move(m));
  f.attempts++;
  f.ahead_key = ahead ? f.req_id : 0;
  f.ahead_to = ahead ? ahead->id : PeerId();
  if (ahead) {
    ahead->pushes_to++;
    pushes++;
  }
  hop_metrics.sent(f.req_id, f.stage, label);
  return true;
}

Peer* Flights::ahead_target(Ctx& c, const Flight& f, const Peer& to) {
  if (f.eval || f.stage == 0 || (f.kind != HopKind::kBackward && f.kind != HopKind::kForwardLoss)) return nullptr;
  Peer* q = c.peers.find(f.at[size_t(f.stage - 1)].fwd_peer);
  if (!q || q == &to || q->job_id != cfg_.job || q->stage != f.stage - 1 || q->state != PeerState::kReady || !q->can_hold() || q->no_push.on)
    return nullptr;
  return q;
}

void Flights::push(Ctx& c, const Flight& f, const Slot& s, Peer& to, wire::Message& m) {
  const Held* h = s.held();
  if (!h || !cfg_.p2p || !to.can_hold() || to.no_push.on || h->holder == to.id) return;
  if (h->key == f.ahead_key && to.id == f.ahead_to) {
    m.refs.back().pushed = true;   // on its way since it was made
    return;
  }
  const Peer* holder = c.peers.find(h->holder);
  if (!holder) return;
  // The receiver would otherwise learn of the tensor only now and ask its holder for it: a
  // crossing of both links more before the bytes start. A push the receiver does not see in
  // time is fetched as before (docs/protocol.md, "Pushes").
  msg::Push body;
  body.key = h->key;
  body.part = int32_t(h->part);
  body.to = to.hello.listen;
  body.to_key = to.key;
  c.send(holder->id, msg::make(body));
  m.refs.back().pushed = true;
  to.pushes_to++;
  pushes++;
}

void Flights::late_pushes(Ctx& c, Peer& to, uint64_t n) {
  to.pushes_late += n;
  // Most pushes to it do not arrive in time: its address does not reach it from the holders (a
  // NAT, a wrong --advertise), or its link is congested. For a while it fetches instead, without
  // first waiting for pushes (Registry::pause_pushes).
  if (!to.no_push.on && to.pushes_late >= 3 && 2 * to.pushes_late >= to.pushes_to) {
    c.peers.pause_pushes(to, c.now);
    c.warn("peer " + to.hello.name + " is not pushed to for " + std::to_string(int(to.no_push.until_s - c.now)) + " s: " +
           std::to_string(to.pushes_late) + " of " + std::to_string(to.pushes_to) + " tensors pushed to " + to.hello.listen +
           " did not arrive in time; it fetches them instead");
  }
}

HopOutcome Flights::on_result(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  HopOutcome out;
  room_at(pd.stage);
  auto it = locate(pd.key);
  if (it == flights_.end() || it->second.req_id != pd.id) {
    if (!m.refs.empty()) c.release(p.id, pd.id);  // late: the hop moved on, and nobody needs what it holds
    return out;
  }
  Flight& f = it->second;
  const msg::Result r = msg::read<msg::Result>(m);
  const size_t s = size_t(f.stage);
  const bool last = f.stage == cfg_.stages - 1;
  out.key = pd.key;
  out.index = f.index;
  // A backward sent for its cached graph that found it gone (evicted by newer forwards: a deep
  // pipeline's early stages wait long for their backwards) did 3 units of work, not 2.
  const bool lost_graph = pd.units == kBackwardCachedUnits && r.cached && !*r.cached;
  if (r.compute_ms) Registry::measured(p, *r.compute_ms, lost_graph ? kBackwardRecomputeUnits : pd.units, c.now - pd.sent_s, pd.queued);

  // What a good answer carries: a tensor of the right description (its values are checked by
  // the stage that receives it), a loss where one is due.
  size_t want_tensors = 1;
  bool want_loss = false;
  const compression::CodecSpec* codec = &cfg_.act_codec;
  switch (f.kind) {
    case HopKind::kEval: want_tensors = last ? 0 : 1; want_loss = last; break;
    case HopKind::kForward: break;
    case HopKind::kForwardLoss: want_tensors = cfg_.stages == 1 ? 0 : 1; want_loss = true; codec = &cfg_.grad_codec; break;
    case HopKind::kBackward: want_tensors = f.stage == 0 ? 0 : 1; codec = &cfg_.grad_codec; break;
  }
  // A peer asked to hold its output answers with a reference to it (its own, to this request).
  const size_t answered = m.tensors.size() + m.refs.size();
  std::string bad;
  if (!m.refs.empty() && !pd.hold) {
    bad = "answered with a tensor it holds, but was asked to send it";
  } else if (!m.refs.empty() && (m.refs.size() != 1 || !m.refs[0].from.empty() || m.refs[0].key != pd.id || m.refs[0].part != 0)) {
    bad = "answered with a reference that is not its own output of this request";
  } else if (cfg_.echo) {
    if (answered != 1) bad = "answered " + std::to_string(answered) + " tensor(s), expected its input back";
  } else if (answered != want_tensors) {
    bad = "answered " + std::to_string(answered) + " tensor(s), expected " + std::to_string(want_tensors);
  } else if (want_loss && !r.loss) {
    bad = "answered without a loss";
  } else if (want_tensors == 1) {
    const wire::TensorDesc& d = m.tensors.empty() ? m.refs[0].desc : m.tensors[0].desc;
    const bool shaped = d.shape.size() == 3 && d.shape[0] == cfg_.B && d.shape[1] == cfg_.T && d.shape[2] == cfg_.d_model;
    if (d.dtype != wire::DType::kF32 || !shaped || !(d.codec == *codec))
      bad = "answered a tensor that is not f32 [" + std::to_string(cfg_.B) + ", " + std::to_string(cfg_.T) + ", " +
            std::to_string(cfg_.d_model) + "] in codec " + codec->name();
  }
  if (!bad.empty()) {
    if (!m.refs.empty()) c.release(p.id, pd.id);
    const HopFailure fl = on_failed(c, pd, /*error=*/true, -1, bad);
    out.what = HopOutcome::kRejected;
    out.blame = p.id;
    out.why = bad;
    if (fl.exhausted) out.exhausted = fl.why;
    return out;
  }
  if (f.suspect_tensor >= 0) {
    // Another peer took the input the first receiver called bad: the first one was wrong.
    out.blame = f.suspect_reporter;
    out.why = "reported a good input as bad";
    f.suspect_tensor = -1;
    f.suspect_reporter.clear();
  }
  hop_metrics.completed(f.stage, kind_label(f), c.now - pd.sent_s);
  f.req_id = 0;
  track(pd.key, f);
  f.tried.clear();
  f.attempts = 0;
  f.busy_link = false;
  f.not_before_s = 0;
  if (r.codec_us && r.codec_us->size() == 4) out.codec_us = *r.codec_us;
  if (r.push_late && *r.push_late > 0) late_pushes(c, p, uint64_t(*r.push_late));
  out.overflow = r.overflow.value_or(false);
  if (r.fetched && !f.eval && !cfg_.echo) {
    // What the receiver fetched peer to peer, at most the tensor's size (its word is only a figure).
    const std::vector<int64_t>& got = *r.fetched;
    uint64_t came = 0;
    if (got.size() > 0 && f.stage > 0 && f.at[s].input.held()) {
      came = std::min<uint64_t>(uint64_t(got[0]), f.at[s].input.wire_bytes());
      bytes_act += came;
    }
    if (got.size() > 1 && f.kind == HopKind::kBackward && f.at[s].grad.held()) {
      const uint64_t b = std::min<uint64_t>(uint64_t(got[1]), f.at[s].grad.wire_bytes());
      bytes_grad += b;
      came += b;
    }
    // How long they took to come: the pace its later requests' deadlines allow for.
    if (r.fetch_ms) c.peers.fetched(p, double(came), *r.fetch_ms);
  }
  // The hop's output: its bytes (kept here), or a reference to the peer that holds it.
  auto take = [&]() { return Ctx::take_reply_tensor(p.id, pd.id, m, 0); };
  auto put = [&](Slot& dst, Slot v) {
    c.drop(dst);
    dst = std::move(v);
  };
  out.what = HopOutcome::kAdvanced;
  auto complete = [&](HopOutcome::What what) {
    out.what = what;
    release_all(c, f);
    if (f.queued_at >= 0) waiting_[size_t(f.queued_at)].flights.erase(pd.key);
    where_.erase(pd.key);
    flights_.erase(it);
    return out;
  };
  if (cfg_.echo) return complete(HopOutcome::kCompleted);
  switch (f.kind) {
    case HopKind::kEval:
      if (last) {
        out.loss = *r.loss;
        return complete(HopOutcome::kEvalDone);
      }
      put(f.at[s + 1].input, take());
      f.stage++;
      break;
    case HopKind::kForward:
      f.at[s].fwd_peer = p.id;
      put(f.at[s + 1].input, take());
      f.stage++;
      if (f.resume_stage == f.stage) {
        // The stage input a backward lost is made again: the backward carries on.
        f.kind = HopKind::kBackward;
        f.resume_stage = -1;
      } else {
        f.kind = f.stage == cfg_.stages - 1 ? HopKind::kForwardLoss : HopKind::kForward;
      }
      break;
    case HopKind::kForwardLoss:
      if (!f.loss_recorded) out.loss = *r.loss;
      f.loss_recorded = true;
      out.trained_stage = f.stage;
      release_copies(c, f, p);
      if (cfg_.stages == 1) return complete(HopOutcome::kCompleted);
      put(f.at[s - 1].grad, take());
      f.at[s - 1].grad_peer = p.id;
      f.stage--;
      f.kind = HopKind::kBackward;
      break;
    case HopKind::kBackward: {
      if (r.cached.value_or(false)) cached++;
      else recomputed++;
      const double done = r.cached ? (*r.cached ? kBackwardCachedUnits : kBackwardRecomputeUnits) : pd.units;
      backward_units_[s] = 0.95 * backward_units_[s] + 0.05 * done;
      out.trained_stage = f.stage;
      release_copies(c, f, p);
      if (f.stage == 0) return complete(HopOutcome::kCompleted);
      put(f.at[s - 1].grad, take());
      f.at[s - 1].grad_peer = p.id;
      f.stage--;
      break;
    }
  }
  track(pd.key, f);   // queued at its next stage
  return out;
}

HopFailure Flights::on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) {
  HopFailure out;
  room_at(pd.stage);
  auto it = locate(pd.key);
  if (it == flights_.end() || it->second.req_id != pd.id) return out;
  Flight& f = it->second;
  release_failed_copies(c, f, pd);
  f.req_id = 0;
  track(pd.key, f);
  f.tried.insert(pd.peer);
  resent_hop(c, f, pd, error, why);
  // Who made the tensor the receiver rejected: the previous stage's forward for a stage input,
  // the next stage's backward for an output gradient. Tokens and targets come from the router.
  PeerId producer;
  if (bad_tensor == 0 && f.stage > 0 && f.kind != HopKind::kBackward) producer = f.at[size_t(f.stage - 1)].fwd_peer;
  if (bad_tensor == 1 && f.kind == HopKind::kBackward) producer = f.at[size_t(f.stage)].grad_peer;
  if (!producer.empty()) {
    const bool second_opinion = f.suspect_tensor == bad_tensor && f.suspect_reporter != pd.peer;
    bool others = false;
    for (const Peer* p : c.peers.stage_peers(cfg_.job, f.stage, c.now))
      others |= !f.tried.count(p->id) && p->id != producer;
    if (second_opinion || !others) {
      if (second_opinion) {
        out.blame = producer;
        out.why = "made a " + std::string(bad_tensor == 0 ? "stage input" : "gradient") + " that two peers of stage " +
                  std::to_string(f.stage) + " rejected (" + why + ")";
      }
      go_back(c, f, bad_tensor);
      f.tried = {producer};
      track(pd.key, f);
      return out;
    }
    f.suspect_tensor = bad_tensor;
    f.suspect_reporter = pd.peer;
  }
  f.not_before_s = c.now + timing::backoff_s(0.05, 2.0, int(f.attempts));
  if (int(f.attempts) >= cfg_.max_attempts && !f.eval) {
    out.exhausted = true;
    out.why = "microbatch " + std::to_string(f.index) + " failed " + std::to_string(f.attempts) + " times at stage " +
              std::to_string(f.stage) + " (last: " + why + ")";
  }
  return out;
}

HopFailure Flights::on_fetch_failed(Ctx& c, const Pending& pd, int slot, FetchMiss miss, const std::string& why) {
  room_at(pd.stage);
  auto it = locate(pd.key);
  if (it == flights_.end() || it->second.req_id != pd.id) return {};
  Flight& f = it->second;
  Slot* sl = slot_of(f, slot);
  // Only a tensor that was held elsewhere can fail to arrive; any other claim is the peer's error.
  const Held* held = sl ? sl->held() : nullptr;
  if (!held) return on_failed(c, pd, true, -1, why);
  release_failed_copies(c, f, pd);
  f.req_id = 0;
  resent_hop(c, f, pd, false, why);
  fetch_failures++;
  if (Peer* to = c.peers.find(pd.peer)) {
    // A busy link: the tensor did not come within the window it was given, so the receiver's
    // links are at least that slow. Its next deadlines allow for twice that pace, until its
    // results time its transfers (RESULT.fetch_ms).
    if (miss == FetchMiss::kBusyLink) c.peers.fetched(*to, double(sl->wire_bytes()), 2000.0 * timing::fetch_window_of(pd.deadline_s - pd.sent_s), false);
    // A pushed tensor it had to fetch did not come by push either.
    if (slot < 8 && (pd.pushed >> slot) & 1u) late_pushes(c, *to, 1);
  }
  HopFailure out;
  Peer* holder = c.peers.find(held->holder);
  if (!holder || miss == FetchMiss::kNotHeld) {
    // Gone with its holder: made again one stage back when the hop is next dispatched.
    c.drop(*sl);
  } else if (miss == FetchMiss::kBusyLink && !f.busy_link) {
    // The holder sent the receiver tensors lately, so its link is busy, not cut: the hop goes
    // again as it was, once, and a receiver chosen again takes the answer still on its way.
    f.busy_link = true;
  } else {
    // The holder lives but the receiver could not reach it (or, twice for this hop, not in
    // time): the router relays the tensor, and a holder two receivers could not reach at all
    // is relayed for a while (Registry::relay).
    if (miss == FetchMiss::kUnreachable) holder->unreachable_from.insert(pd.peer);
    if (!holder->relay.on && holder->unreachable_from.size() >= 2) {
      c.peers.relay(*holder, c.now);
      c.warn("peer " + holder->hello.name + " is relayed for " + std::to_string(int(holder->relay.until_s - c.now)) + " s: " +
             std::to_string(holder->unreachable_from.size()) + " peers could not fetch from " + holder->hello.listen + " (last: " + why + ")");
    }
    msg::Fetch body;
    body.key = held->key;
    body.part = int32_t(held->part);
    Pending up;
    up.kind = ReqKind::kFetch;
    up.job = cfg_.job;
    up.key = pd.key;
    up.stage = slot;
    up.peer = holder->id;
    up.deadline_s = c.now + c.deadline_for(*holder, cfg_.forward_cap_s);
    up.reply_bytes = held->desc.wire_bytes();   // the tensor it uploads
    f.upload_req = c.request(up, msg::make(wire::MsgType::kFetch, body));
    uploads++;
  }
  track(pd.key, f);
  f.not_before_s = c.now;
  if (int(f.attempts) >= cfg_.max_attempts && !f.eval) {
    out.exhausted = true;
    out.why = "microbatch " + std::to_string(f.index) + " failed " + std::to_string(f.attempts) + " times at stage " +
              std::to_string(f.stage) + " (last: " + why + ")";
  }
  return out;
}

HopOutcome Flights::on_uploaded(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  HopOutcome out;
  auto it = locate(pd.key);
  if (it == flights_.end() || it->second.upload_req != pd.id) return out;
  Flight& f = it->second;
  f.upload_req = 0;
  track(pd.key, f);
  Slot* sl = slot_of(f, pd.stage);
  if (!sl || !sl->held() || sl->held()->holder != p.id) return out;  // the hop moved on
  if (m.tensors.size() != 1 || !wire::same_tensor(m.tensors[0].desc, sl->held()->desc)) {
    // Not the tensor it said it made: made again, and held against the holder.
    out.blame = p.id;
    out.why = "relayed a tensor that is not the one it reported making";
    c.drop(*sl);
    return out;
  }
  wire::Tensor t = std::move(m.tensors[0]);
  wire::compress(t);
  c.drop(*sl);  // the holder's copy is no longer needed
  sl->set(std::move(t));
  return out;
}

void Flights::on_upload_failed(Ctx& c, const Pending& pd) {
  auto it = locate(pd.key);
  if (it == flights_.end() || it->second.upload_req != pd.id) return;
  Flight& f = it->second;
  f.upload_req = 0;
  track(pd.key, f);
  if (Slot* sl = slot_of(f, pd.stage); sl && sl->held()) c.drop(*sl);  // made again one stage back
}

void Flights::go_back(Ctx& c, Flight& f, int bad) {
  const size_t s = size_t(f.stage);
  if (bad == 0) {
    c.drop(f.at[s].input);
    f.stage--;
    f.kind = f.eval ? HopKind::kEval : HopKind::kForward;
  } else {
    c.drop(f.at[s].grad);
    f.stage++;
    f.kind = f.stage == cfg_.stages - 1 ? HopKind::kForwardLoss : HopKind::kBackward;
  }
  f.attempts = 0;
  f.busy_link = false;
  f.not_before_s = 0;
  f.suspect_tensor = -1;
  f.suspect_reporter.clear();
}

void Flights::check(const Requests& r) const {
  size_t waiting = 0;
  for (const auto& [key, f] : flights_) {
    const bool waits = f.req_id == 0 && f.upload_req == 0;
    waiting += waits;
    SWARM_CHECK(f.queued_at == (waits ? f.stage : -1), "microbatch " + std::to_string(key) + " is queued to be sent at stage " + std::to_string(f.queued_at) + ", but " + (waits ? "waits at stage " + std::to_string(f.stage) : "is in flight"));
    if (waits) {
      const auto& q = waiting_[size_t(f.stage)].flights;
      const auto w = q.find(key);
      SWARM_CHECK(w != q.end() && w->second == &f, "microbatch " + std::to_string(key) + " waits but is not in its stage's queue");
    }
    SWARM_CHECK(f.stage >= 0 && f.stage < cfg_.stages, "flight at a stage outside the job");
    SWARM_CHECK(cfg_.tokens || f.at[0].input.tensor() != nullptr, "flight without its tokens");
    SWARM_CHECK(f.req_id == 0 || f.upload_req == 0, "a flight both sent and relaying a tensor");
    if (f.upload_req != 0) {
      const Pending* pd = r.find(f.upload_req);
      SWARM_CHECK(pd && pd->kind == ReqKind::kFetch && pd->key == key && pd->job == cfg_.job, "a flight's relay has no pending FETCH");
    }
    if (f.req_id == 0) continue;
    const Pending* pd = r.find(f.req_id);
    SWARM_CHECK(pd != nullptr, "microbatch " + std::to_string(key) + " is marked sent but has no pending request");
    SWARM_CHECK(pd->kind == ReqKind::kHop && pd->key == key && pd->job == cfg_.job, "a flight's request is not its hop");
  }
  SWARM_CHECK(waiting == this->waiting(), "the queue of flights to send holds a flight that is gone");
  SWARM_CHECK(where_.size() == flights_.size(), "the index of flights by key does not hold every flight");
}

}  // namespace swarm::router
