// core.cpp: implements router/core.h: sessions (HELLO, heartbeats, liveness, BYE), replies to
// the router's requests, deadlines, the job queue, and the public entry points. Client
// requests are in clients.cpp; what a job does with its events in training_job.cpp and
// echo_job.cpp.
#include "router/core.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include "router/core_impl.h"
#include "router/echo_job.h"
#include "router/training_job.h"
#include "runtime/timing.h"

namespace swarm::router {

using wire::MsgType;

// ---- Ctx (router/job.h) -----------------------------------------------------------------------

uint64_t Ctx::request(Pending p, wire::Message m) {
  p.sent_s = now;
  // The deadline was set for the work; the transfers it waits for come on top.
  uint64_t bytes = p.reply_bytes;
  for (const wire::Tensor& t : m.tensors) bytes += t.desc.wire_bytes();
  for (const wire::TensorRef& r : m.refs) bytes += r.desc.wire_bytes();
  Peer* peer = peers.find(p.peer);
  p.deadline_s += timing::transfer_allowance_s(double(bytes), peer ? peers.pace(*peer) : 0);
  // A reference the receiver cannot fetch is reported well before the deadline, so that the
  // router relays it on the next attempt instead of waiting out the receiver's own timeout.
  if (!m.refs.empty()) m.fetch_within_ms = timing::fetch_within_ms(p.deadline_s - now);
  if (peer) {
    p.queued = peer->queued_units;
    peer->queued_units += p.units;
    peer->last_request_s = now;
  }
  const PeerId to = p.peer;
  const uint64_t id = requests.add(std::move(p));
  m.id = id;
  send(to, std::move(m));
  return id;
}

std::optional<Pending> Ctx::take(uint64_t id) {
  std::optional<Pending> pd = requests.take(id);
  if (pd)
    if (Peer* p = peers.find(pd->peer)) p->queued_units = std::max(0.0, p->queued_units - pd->units);
  return pd;
}

void Ctx::attach(wire::Message& m, Slot& s, uint32_t index) const {
  SWARM_CHECK(s.known(), "a request's tensor is missing");
  if (wire::Tensor* t = s.tensor()) {
    m.tensors.push_back(wire::share(*t));
    return;
  }
  const Held& h = *s.held();
  const Peer* holder = peers.find(h.holder);
  wire::TensorRef r;
  r.slot = index;
  r.from = holder ? holder->hello.listen : std::string();
  r.from_key = holder ? holder->key : std::string();
  r.key = h.key;
  r.part = h.part;
  r.desc = h.desc;
  m.refs.push_back(std::move(r));
}

void Ctx::drop(Slot& s) {
  if (const Held* h = s.held())
    if (Peer* p = peers.find(h->holder)) release(*p, h->key);
  s.clear();
}

Slot Ctx::take_reply_tensor(const PeerId& from, uint64_t pd_id, wire::Message& m, size_t index) {
  Slot out;
  if (m.refs.empty()) {
    SWARM_CHECK(index < m.tensors.size(), "reply tensor out of range");
    wire::Tensor t = std::move(m.tensors[index]);
    wire::compress(t);  // once, before it is shared with every send (entropy=zstd)
    out.set(std::move(t));
    return out;
  }
  for (const wire::TensorRef& r : m.refs) {
    if (r.slot != index) continue;
    if (!r.from.empty() || r.key != pd_id || r.part != index)
      throw WireError(WireErrc::kMalformed, "a reply's reference must name the replier's own tensor " + std::to_string(index) +
                                                " of request " + std::to_string(pd_id));
    out.set(Held{from, pd_id, uint32_t(index), r.desc});
    return out;
  }
  throw WireError(WireErrc::kMalformed, "a reply mixes held and sent tensors");
}

double Ctx::deadline_for(const Peer& p, double cap_s) const {
  if (p.ms_per_unit <= 0) return std::min(cap_s, 10.0);
  return timing::deadline_s((p.queued_units + 3.0) * p.deadline_ms_per_unit() / 1000.0, cap_s);
}

namespace {

// The reply each kind of request expects.
MsgType reply_type(ReqKind k) {
  switch (k) {
    case ReqKind::kHop: case ReqKind::kStep: return MsgType::kResult;
    case ReqKind::kLoad: return MsgType::kStageReady;
    case ReqKind::kRoundBegin: return MsgType::kRoundDelta;
    case ReqKind::kRoundReduce: return MsgType::kRoundReduced;
    case ReqKind::kRoundApply: case ReqKind::kStateLoad: return MsgType::kRoundDone;
    case ReqKind::kStateRequest: case ReqKind::kSnapshot: return MsgType::kStateReply;
    case ReqKind::kFetch: return MsgType::kFetched;
  }
  return MsgType::kResult;
}

}  // namespace

void RouterCore::Impl::peer_dead(Ctx& c, const PeerId& id, const std::string& why) {
  Peer* p = peers.find(id);
  if (!p) return;
  c.event(EventKind::kFault, LogLevel::kWarn, "peer " + p->hello.name + " (" + wire::printable_id(id) + ") is gone: " + why, p->job_id, p, p->stage);
  const Peer gone = *p;
  peers.remove(id);
  withdraw_key(c, gone);
  // Every request it held is re-sent elsewhere.
  for (uint64_t rid : requests.of_peer(id)) {
    std::optional<Pending> pd = c.take(rid);
    if (Job* j = pd ? find_job(pd->job) : nullptr) j->on_failed(c, *pd, false, -1, "peer gone");
  }
  for (auto& j : jobs)
    if (j->active()) j->on_peer_gone(c, gone);
}

void RouterCore::Impl::on_hello(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who) {
  const msg::Hello h = msg::read<msg::Hello>(m);
  if (h.version != wire::kVersion)
    return reply_error(c, from, &m, WireErrc::kBadVersion, "HELLO version must be " + std::to_string(wire::kVersion) +
                                                               "; this router speaks protocol v" + std::to_string(wire::kVersion));
  const std::string as = who.authenticated ? "key " + who.name + " (role " + role_name(who.role) + ")" : std::string();
  if (h.role == msg::Role::kClient) {
    if (who.authenticated && who.role == Role::kStage)
      return bad(c, from, &m, WireErrc::kForbidden, as + " may only serve as a stage server; a client needs the role client or admin");
    if (!clients.count(from) && clients.size() >= limits::kMaxClients)
      return reply_error(c, from, &m, WireErrc::kTooLarge, "the router has " + std::to_string(clients.size()) + " client sessions, its limit; try again later");
    clients[from] = Session{c.now, who, h.parts};
    msg::Welcome w;
    w.role = "client";
    w.version = wire::kVersion;
    w.parts = true;
    return c.send(from, msg::make(w, m.id));
  }
  if (who.authenticated) {
    // A stage server's routing id is its key's (runtime/keys.h): nobody registers as, or takes
    // over, another peer without that peer's secret key.
    if (who.role == Role::kClient)
      return bad(c, from, &m, WireErrc::kForbidden, as + " may not serve; a stage server needs the role stage or admin");
    if (from != routing_id_of(who.key))
      return bad(c, from, &m, WireErrc::kForbidden, "a stage server's routing id must be " + routing_id_of(who.key) + ", its key's");
  }
  if (peers.find(from)) peer_dead(c, from, "said HELLO again (restarted)");
  // Two peers at one listen address would each take the other's tensors for its own (a
  // reference names its holder by that address). A restarted server with a new routing id gets
  // in once its old session's liveness runs out; it says HELLO again until then.
  const Peer* same = nullptr;
  if (!h.listen.empty()) peers.each_listening_at(h.listen, [&](const Peer& q) { same = &q; });
  if (same)
    return reply_error(c, from, &m, WireErrc::kOutOfOrder,
                       "listen address " + h.listen + " is already advertised by peer " + same->hello.name +
                           "; give each stage server its own --listen port (or --advertise address); a restarted one is let in once the router stops hearing from its old session");
  if (peers.size() >= opt.max_peers)
    return reply_error(c, from, &m, WireErrc::kTooLarge, "the router has " + std::to_string(peers.size()) + " stage servers, its limit (" +
                                                            std::to_string(opt.max_peers) + "); start another swarm");
  Peer& p = peers.add(from, h, c.now);
  p.key = who.key;
  msg::Welcome w;
  w.peer_id = from;
  w.heartbeat_ms = opt.heartbeat_ms;
  w.liveness = opt.liveness;
  w.parts = true;
  c.send(from, msg::make(w, m.id));
  c.event(EventKind::kPeer, LogLevel::kInfo,
          "peer " + p.hello.name + " (" + wire::printable_id(from) + ") joined" + (h.stage >= 0 ? " asking for stage " + std::to_string(h.stage) : "") +
              (h.stage < 0 && h.prefer_stage >= 0 ? " preferring stage " + std::to_string(h.prefer_stage) : "") +
              (h.emulate > 1 ? " [emulated " + std::to_string(h.emulate) + "x slower]" : "") + (who.authenticated ? " with " + as : ""),
          0, &p);
  share_keys(c, p);
  if (Job* j = active_job()) j->offer(c, p);
}

void RouterCore::Impl::share_keys(Ctx& c, const Peer& joined) {
  if (joined.key.empty()) return;
  msg::PeerKeys mine;
  auto flush = [&] {
    if (mine.add.empty()) return;
    c.send(joined.id, msg::make(mine));
    mine.add.clear();
  };
  msg::PeerKeys theirs;
  theirs.add.push_back(joined.key);
  for (const auto& [id, q] : peers.all()) {
    if (id == joined.id || q.key.empty()) continue;
    c.send(id, msg::make(theirs));
    mine.add.push_back(q.key);
    if (mine.add.size() == msg::PeerKeys::kMaxKeys) flush();
  }
  flush();
}

void RouterCore::Impl::withdraw_key(Ctx& c, const Peer& gone) {
  if (gone.key.empty()) return;
  msg::PeerKeys k;
  k.remove.push_back(gone.key);
  for (const auto& [id, q] : peers.all())
    if (!q.key.empty()) c.send(id, msg::make(k));
}

bool RouterCore::Impl::permitted(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who, bool client_ok) {
  if (!who.authenticated || who.role == Role::kAdmin || (client_ok && who.role == Role::kClient)) return true;
  bad(c, from, &m, WireErrc::kForbidden,
      std::string(wire::msg_type_name(m.type)) + " needs the role " + (client_ok ? "client or admin" : "admin") + "; key " + who.name +
          " has the role " + role_name(who.role));
  return false;
}

bool RouterCore::Impl::owns(const Identity& who, uint64_t id) const {
  if (!who.authenticated || who.role == Role::kAdmin) return true;
  auto it = owners.find(id);
  return it != owners.end() && it->second == who.key;
}

void RouterCore::Impl::on_reply(Ctx& c, Peer& p, wire::Message& m) {
  const Pending* found = requests.find(m.id);
  if (!found) {
    // Late (re-sent elsewhere, or the job moved on) or a duplicate: counted, nothing changes
    // (what the peer holds for it is released).
    if (!m.refs.empty()) c.release(p.id, m.id);
    const std::optional<PeerId> sent_to = requests.retired_to(m.id);
    if (m.type == MsgType::kResult && sent_to == p.id) {
      if (Job* j = active_job()) j->duplicate(m.id);
    } else if (m.type != MsgType::kError && sent_to != p.id) {
      // A reply to a request it was never sent (or one too old to tell): not a duplicate.
      bad_messages++;
      c.warn("peer " + p.hello.name + " answered request " + std::to_string(m.id) + ", which was not sent to it; ignored");
    } else if (m.type == MsgType::kError) {
      const msg::Error e = msg::read<msg::Error>(m);
      c.warn("peer " + p.hello.name + " reports: " + e.message);
    }
    return;
  }
  if (found->peer != p.id) {  // not from the peer it was sent to
    bad_messages++;
    return c.warn("peer " + p.hello.name + " answered request " + std::to_string(m.id) + ", which was sent to another peer; ignored");
  }
  const Pending pd = *c.take(m.id);
  Registry::answered(p);
  Job* j = find_job(pd.job);
  if (!j || !j->active()) return;
  if (m.type == MsgType::kError) return on_error_reply(c, p, pd, *j, m);
  try {
    if (m.type != reply_type(pd.kind))
      throw WireError(WireErrc::kOutOfOrder, std::string(wire::msg_type_name(m.type)) + " does not answer a " + req_kind_name(pd.kind) +
                                                 " request (expected " + wire::msg_type_name(reply_type(pd.kind)) + ")");
    p.results++;
    j->on_reply(c, p, pd, m);
  } catch (const InputError& e) {
    // A reply that does not parse: its request failed, and it counts against the peer.
    bad_messages++;
    p.failures++;
    c.warn("peer " + p.hello.name + " sent a malformed " + wire::msg_type_name(m.type) + ": " + e.what());
    reply_error(c, p.id, &m, WireErrc::kMalformed, e.what());
    j->on_failed(c, pd, true, -1, e.what());
    j->integrity_failure(c, p.id, std::string("sent a malformed reply (") + e.what() + ")");
  }
}

void RouterCore::Impl::on_error_reply(Ctx& c, Peer& p, const Pending& pd, Job& j, const wire::Message& m) {
  msg::Error e;
  try {
    e = msg::read<msg::Error>(m);
  } catch (const InputError& ex) {
    bad_messages++;
    e.code = int32_t(WireErrc::kMalformed);
    e.message = std::string("an unreadable ERROR (") + ex.what() + ")";
  }
  p.failures++;
  c.event(EventKind::kFault, LogLevel::kWarn, "peer " + p.hello.name + " failed a " + req_kind_name(pd.kind) + " request: " + e.message, pd.job,
          &p, pd.stage);
  // A request that reached the peer damaged: re-sent at once, held against the peer's
  // integrity record rather than banning it.
  if (e.code == int(WireErrc::kChecksum) || e.code == int(WireErrc::kTruncated)) {
    j.on_failed(c, pd, false, -1, e.message);
    return j.integrity_failure(c, p.id, "received a damaged request (" + e.message + ")");
  }
  // A tensor of the request that the peer found bad: its maker may be to blame, not the peer.
  if (e.code == int(WireErrc::kBadTensor) && e.tensor) return j.on_failed(c, pd, true, *e.tensor, e.message);
  // The relay's FETCH of something the holder no longer has: nobody is at fault.
  if (pd.kind == ReqKind::kFetch) return j.on_failed(c, pd, false, -1, e.message);
  // A tensor the peer could not fetch from its holder: the holder, or the link, is the problem.
  if ((e.code == int(WireErrc::kUnreachable) || e.code == int(WireErrc::kNotHeld)) && e.tensor)
    return j.on_fetch_failed(c, pd, *e.tensor,
                             e.code == int(WireErrc::kNotHeld) ? FetchMiss::kNotHeld : e.reached ? FetchMiss::kBusyLink : FetchMiss::kUnreachable,
                             e.message);
  peers.ban(p, c.now);
  j.on_failed(c, pd, true, -1, e.message);
}

void RouterCore::Impl::end_job(Ctx& c, Job& j, JobState st, const std::string& why) {
  j.finish(c, st, why);
  drop_requests(c, j);
}

// Requests still out for a finished job are dropped: their replies count as duplicates.
void RouterCore::Impl::drop_requests(Ctx& c, const Job& j) {
  for (uint64_t rid : requests.of_job(j.id())) c.take(rid);
}

void RouterCore::Impl::advance_jobs(Ctx& c, bool offer_idle) {
  // A job that ended while it handled an event (a hop out of attempts) leaves no request behind.
  if (Job* last = running ? find_job(running) : nullptr; last && !last->active()) drop_requests(c, *last);
  running = 0;
  Job* j = active_job();
  if (!j) {
    for (auto& q : jobs) {
      if (q->state() != JobState::kQueued) continue;
      if (!loading.count(q->id())) {
        j = q.get();
        j->start(c);
      }
      break;  // in submission order: a job still loading holds the ones after it
    }
  }
  if (!j) return;
  // A peer left idle (its load failed) is offered the job again once its ban is over: checked on
  // the tick only, a scan of every peer being too dear for every message, and only when the
  // registry counts an idle peer on the job.
  if (offer_idle && peers.any_idle(j->id()))
    for (auto& [id, p] : peers.all())
      if (p.state == PeerState::kIdle && p.job_id == j->id() && !peers.banned(p, c.now)) j->offer(c, p);
  j->advance(c);
  if (!j->active()) drop_requests(c, *j);
  else running = j->id();
}
RouterCore::RouterCore(CoreOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
RouterCore::~RouterCore() = default;

Actions RouterCore::restore(std::vector<StoredJob> stored, double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  std::sort(stored.begin(), stored.end(), [](const StoredJob& a, const StoredJob& b) { return a.id < b.id; });
  for (auto& sj : stored) {
    impl_->next_job_id = std::max(impl_->next_job_id, sj.id + 1);
    if (sj.state != "queued" && sj.state != "loading" && sj.state != "running") continue;
    try {
      JobSpec spec = parse_job_spec(sj.spec, /*check_files=*/false);
      impl_->queue_load(c, sj.id, std::move(spec), Impl::Submitter{}, sj.checkpoint_dir);
    } catch (const InputError& e) {
      c.log(LogLevel::kError, "job " + std::to_string(sj.id) + " in the state dir cannot continue: " + e.what());
    }
  }
  return out;
}

Actions RouterCore::on_message(const PeerId& from, wire::Message m, double now, const Identity& who) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  Impl& I = *impl_;
  Peer* p = I.peers.find(from);
  auto cl = I.clients.find(from);
  // A session belongs to the key that opened it: another key on the same routing id (a
  // connection that took the id over) is refused and changes nothing.
  if ((p && p->key != who.key) || (cl != I.clients.end() && cl->second.who.key != who.key)) {
    I.bad(c, from, &m, WireErrc::kForbidden, "this routing id belongs to another key's session");
    return out;
  }
  if (p) I.peers.touch(*p, now);
  if (cl != I.clients.end()) cl->second.last_s = now;
  // A piece of a larger message on its way (wire::PartJoiner): a sign of life, and what holds
  // the peer's deadlines while it lasts (Registry::sending).
  if (m.type == MsgType::kPart && (p || cl != I.clients.end())) {
    if (p) p->parts_s = now;
    return out;
  }
  try {
    if (m.type == MsgType::kHello) {
      I.on_hello(c, from, m, who);
    } else if (!p && cl == I.clients.end()) {
      I.bad(c, from, &m, WireErrc::kOutOfOrder, "say HELLO first (protocol v" + std::to_string(wire::kVersion) + ")");
    } else {
      switch (m.type) {
        case MsgType::kHeartbeat:
          if (p) {
            p->heartbeat = msg::read<msg::Heartbeat>(m);
            // A large message from the router is still reaching it: as good as one coming from it.
            if (p->heartbeat.receiving) p->parts_s = now;
          }
          break;
        case MsgType::kBye:
          if (p) I.peer_dead(c, from, "said goodbye");
          else I.clients.erase(from);
          break;
        case MsgType::kResult: case MsgType::kStageReady: case MsgType::kRoundDelta: case MsgType::kRoundReduced:
        case MsgType::kRoundDone: case MsgType::kStateReply: case MsgType::kFetched: case MsgType::kError:
          if (!p) I.bad(c, from, &m, WireErrc::kOutOfOrder, "only stage servers send results");
          else I.on_reply(c, *p, m);
          break;
        case MsgType::kSubmit: if (I.permitted(c, from, m, who, true)) I.on_submit(c, from, m, who); break;
        case MsgType::kStatus: if (I.permitted(c, from, m, who, true)) I.on_status(c, from, m, who); break;
        case MsgType::kCancel: if (I.permitted(c, from, m, who, true)) I.on_cancel(c, from, m, who); break;
        case MsgType::kPeers: {
          if (!I.permitted(c, from, m, who, true)) break;
          const msg::Peers q = msg::read<msg::Peers>(m);
          c.send(from, wire::json_message(MsgType::kPeersReply, m.id, m.attempt, peers_json(q.offset, q.limit, now)));
          break;
        }
        case MsgType::kChaos: if (I.permitted(c, from, m, who, false)) I.on_chaos(c, from, m); break;
        default:
          I.bad(c, from, &m, WireErrc::kOutOfOrder, std::string("the router does not take ") + wire::msg_type_name(m.type));
      }
    }
  } catch (const WireError& e) {
    I.bad(c, from, &m, e.code(), e.what());
  } catch (const InputError& e) {
    // Whatever a message makes go wrong, it costs that message, not the router.
    I.bad(c, from, &m, WireErrc::kMalformed, e.what());
  } catch (const nlohmann::json::exception& e) {
    I.bad(c, from, &m, WireErrc::kMalformed, e.what());
  }
  I.advance_jobs(c);
  return out;
}

Actions RouterCore::on_undecodable(const PeerId& from, const WireError& e, std::optional<uint64_t> id, double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  Impl& I = *impl_;
  I.bad_messages++;
  Peer* p = I.peers.find(from);
  if (p) I.peers.touch(*p, now);
  c.warn("dropped a bad message" + (p ? " from peer " + p->hello.name : std::string()) + ": " + e.what());
  wire::Message reply = msg::error_reply(nullptr, e.code(), e.what());
  // A peer of another protocol version reads the refusal in the envelope every version reads.
  if (e.code() == WireErrc::kBadVersion) reply.version = wire::kVersionForRefusals;
  c.send(from, std::move(reply));
  // A reply whose envelope survived names its request: re-send that work now rather than at its
  // deadline, and hold the corruption against the peer.
  if (p && id) {
    const Pending* pd = I.requests.find(*id);
    if (pd && pd->peer == from) {
      const Pending taken = *c.take(*id);
      if (Job* j = I.find_job(taken.job); j && j->active()) {
        j->on_failed(c, taken, true, -1, e.what());
        j->integrity_failure(c, from, std::string("sent a corrupt reply (") + e.what() + ")");
      }
    }
  }
  I.advance_jobs(c);
  return out;
}

Actions RouterCore::on_unreachable(const PeerId& peer, double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  impl_->peer_dead(c, peer, "unreachable");
  impl_->advance_jobs(c);
  return out;
}

Actions RouterCore::on_job_loaded(JobLoaded r, double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  impl_->on_loaded(c, std::move(r));
  impl_->advance_jobs(c);
  return out;
}

Actions RouterCore::on_checkpoint_written(CheckpointWritten r, double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  if (Job* j = impl_->find_job(r.job)) j->on_checkpoint_written(c, r);
  impl_->advance_jobs(c);
  return out;
}

// How often the keys holders may drop go out: a quarter of a second keeps at most that much
// more held on a peer, against a message per key.
constexpr double kReleaseEveryS = 0.25;

// RELEASE to each holder what it may drop (in holder order: the same every run).
void RouterCore::Impl::send_releases(Ctx& c) {
  // A holder that left since lost its keys with its record (a new session holds none of them).
  std::sort(releasing.begin(), releasing.end());
  for (const PeerId& holder : releasing) {
    Peer* p = peers.find(holder);
    if (!p) continue;
    const std::vector<int64_t>& keys = p->to_release;
    for (size_t at = 0; at < keys.size(); at += msg::Release::kMaxKeys) {
      msg::Release r;
      r.keys.assign(keys.begin() + long(at), keys.begin() + long(std::min(keys.size(), at + msg::Release::kMaxKeys)));
      c.send(holder, msg::make(r));
    }
    p->to_release.clear();
  }
  releasing.clear();
}

Actions RouterCore::tick(double now) {
  Actions out;
  Ctx c = impl_->ctx(now, out);
  Impl& I = *impl_;
  for (const PeerId& id : I.peers.expired(now)) I.peer_dead(c, id, "missed " + std::to_string(I.opt.liveness) + " heartbeats");
  if (now - I.last_beat_s >= I.opt.heartbeat_ms / 1000.0) {
    // A stage server counts any message from the router as a sign of life, so a peer sent a
    // request since the last round needs no heartbeat: in steady training that is nearly every
    // peer. The longest silence a peer then sees is under two rounds, inside its window of
    // `liveness` rounds when that is 3 or more; with a shorter window every peer gets every one.
    const bool skip_busy = I.opt.liveness >= 3;
    out.reserve(out.size() + I.peers.size());
    for (const auto& [id, p] : I.peers.all())
      if (!skip_busy || p.last_request_s <= I.last_beat_s) c.send(id, wire::Message(MsgType::kHeartbeat));
    I.last_beat_s = now;
    for (auto it = I.clients.begin(); it != I.clients.end();) it = now - it->second.last_s > I.opt.client_idle_s ? I.clients.erase(it) : std::next(it);
  }
  for (const auto& [id, kind] : I.peers.spells_ended(now))
    if (const Peer* p = I.peers.find(id))
      c.event(EventKind::kFault, LogLevel::kInfo,
              kind == SpellKind::kRelay
                  ? "peer " + p->hello.name + " is fetched from directly again (relayed " + std::to_string(p->relay.times) + " time(s) in a row)"
                  : "peer " + p->hello.name + " is pushed to again (paused " + std::to_string(p->no_push.times) + " time(s) in a row)",
              p->job_id, p, p->stage);
  // What holders may drop, batched per holder every kReleaseEveryS: in steady training each
  // holder sees a release every few ticks, so a batch per tick was a message per key.
  if (now - I.last_release_s >= kReleaseEveryS) {
    I.last_release_s = now;
    I.send_releases(c);
  }
  // Requests past their deadline fail (no ban: the peer may just be slow); a hop is re-sent elsewhere.
  for (uint64_t rid : I.requests.expired(now)) {
    const Pending* pd = I.requests.find(rid);
    if (!pd) continue;
    // A peer sending a large message is not late: the reply comes after it, on its connection.
    if (const Peer* p = I.peers.find(pd->peer); p && I.peers.sending(*p, now)) {
      I.requests.postpone(rid, now + I.peers.window_s());
      continue;
    }
    // A hop goes to another peer; anything else is its job's to decide (a snapshot or a round
    // goes on without this peer's part, a joiner's state is asked of another donor).
    c.warn("request " + std::to_string(rid) + " (" + req_kind_name(pd->kind) + ") to " + I.name_of(pd->peer) + " passed its deadline (" +
           std::to_string(pd->deadline_s - pd->sent_s) + " s after it was sent)" + (pd->kind == ReqKind::kHop ? "; re-sending" : ""));
    if (Peer* p = I.peers.find(pd->peer)) {
      if (const double s = I.peers.timed_out(*p, pd->kind == ReqKind::kHop, now); s > 0)
        c.event(EventKind::kFault, LogLevel::kWarn,
                "peer " + p->hello.name + " is unresponsive (" + std::to_string(p->timeouts_in_row) + " timeouts in a row); no new work for " +
                    std::to_string(int(s)) + " s",
                pd->job, p, p->stage);
    }
    const Pending taken = *c.take(rid);
    if (Job* j = I.find_job(taken.job); j && j->active()) {
      j->timed_out();
      j->on_failed(c, taken, false, -1, "deadline passed");
    }
  }
  I.advance_jobs(c, /*offer_idle=*/true);
  return out;
}

Actions RouterCore::shutdown(double now) {
  Actions out;
  msg::Bye bye;
  bye.reason = "router shutting down";
  for (const auto& [id, p] : impl_->peers.all()) out.push_back(Send{id, msg::make(bye)});
  return out;
}

bool RouterCore::accepts(const PeerId& from, wire::MsgType type) const {
  return type == MsgType::kHello || impl_->peers.find(from) || impl_->clients.count(from);
}

bool RouterCore::takes_parts(const PeerId& to) const {
  if (const Peer* p = impl_->peers.find(to)) return p->hello.parts;
  auto it = impl_->clients.find(to);
  return it != impl_->clients.end() && it->second.parts;
}

const Registry& RouterCore::registry() const { return impl_->peers; }
uint64_t RouterCore::bad_messages() const { return impl_->bad_messages; }

void RouterCore::check_invariants() const {
  const Impl& I = *impl_;
  SWARM_CHECK(I.peers.size() <= I.opt.max_peers, "more peers than max_peers");
  SWARM_CHECK(I.clients.size() <= limits::kMaxClients, "more clients than the limit");
  SWARM_CHECK(I.jobs.size() <= limits::kMaxJobs, "more jobs than the limit");
  int active = 0;
  for (const auto& j : I.jobs) {
    active += j->active();
    j->check(I.requests);
  }
  SWARM_CHECK(active <= 1, "more than one job runs");
  I.peers.check_index();
  I.requests.for_each([&](uint64_t id, const Pending& pd) {
    SWARM_CHECK(I.peers.find(pd.peer) != nullptr, "request " + std::to_string(id) + " is held by a peer that is gone");
    const Job* owner = nullptr;
    for (const auto& j : I.jobs)
      if (j->id() == pd.job) owner = j.get();
    SWARM_CHECK(owner && owner->active(), "request " + std::to_string(id) + " belongs to no running job");
  });
}

}  // namespace swarm::router
