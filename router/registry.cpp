// registry.cpp: implements router/registry.h.
#include "router/registry.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/errors.h"
#include "runtime/timing.h"

namespace swarm::router {

const char* peer_state_name(PeerState s) {
  switch (s) {
    case PeerState::kIdle: return "idle";
    case PeerState::kLoading: return "loading";
    case PeerState::kSyncing: return "syncing";
    case PeerState::kReady: return "ready";
    case PeerState::kQuarantined: return "quarantined";
  }
  return "?";
}

Peer& Registry::add(const PeerId& id, const msg::Hello& hello, double now) {
  remove(id);
  Peer p;
  p.id = id;
  p.seq = next_seq_++;
  p.hello = hello;
  if (p.hello.name.empty()) p.hello.name = wire::printable_id(id);  // a name is text; an id may be any bytes
  if (p.hello.name.size() > limits::kMaxPeerIdBytes) p.hello.name.resize(limits::kMaxPeerIdBytes);
  if (p.hello.device_name.empty()) p.hello.device_name = p.hello.device;
  p.joined_s = p.last_seen_s = now;
  auto [it, ok] = peers_.emplace(id, std::move(p));
  Peer& added = it->second;
  expiry_.emplace(now + window_s_, &added.id);
  by_id_[id] = &added;
  index(added);
  if (!added.hello.listen.empty()) by_listen_.emplace(added.hello.listen, &added);
  return added;
}

void Registry::remove(const PeerId& id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  expiry_.erase({it->second.last_seen_s + window_s_, &it->second.id});
  unindex(it->second);
  for (auto [l, end] = by_listen_.equal_range(it->second.hello.listen); l != end; ++l)
    if (l->second == &it->second) {
      by_listen_.erase(l);
      break;
    }
  by_id_.erase(id);
  peers_.erase(it);
}

void Registry::ready_changed(const std::pair<uint64_t, int>& key, size_t before, size_t after) {
  if (key.second < 0 || (before > 0) == (after > 0)) return;
  if (after > 0) {
    ready_stages_[key.first]++;
  } else if (--ready_stages_[key.first] == 0) {
    ready_stages_.erase(key.first);
  }
}

void Registry::unindex(const Peer& p) {
  auto b = by_stage_.find({p.job_id, p.stage});
  SWARM_CHECK(b != by_stage_.end() && b->second.peers.erase(p.seq) == 1, "peer " + p.hello.name + " is missing from the stage index");
  if (p.state == PeerState::kReady) unlist_ready(b->first, b->second, p);
  b->second.idle -= p.state == PeerState::kIdle;
  if (b->second.peers.empty()) by_stage_.erase(b);
}

void Registry::index(Peer& p) {
  StageIndex& b = by_stage_[{p.job_id, p.stage}];
  b.peers[p.seq] = &p;
  b.idle += p.state == PeerState::kIdle;
  if (p.state == PeerState::kReady) list_ready({p.job_id, p.stage}, b, p);
}

void Registry::list_ready(const std::pair<uint64_t, int>& key, StageIndex& b, Peer& p) {
  ready_changed(key, b.ready.size(), b.ready.size() + 1);
  p.ready_pos = b.ready.size();
  b.ready.push_back(&p);
}

void Registry::unlist_ready(const std::pair<uint64_t, int>& key, StageIndex& b, const Peer& p) {
  SWARM_CHECK(p.ready_pos < b.ready.size() && b.ready[p.ready_pos] == &p, "peer " + p.hello.name + " is missing from its stage's ready list");
  ready_changed(key, b.ready.size(), b.ready.size() - 1);
  Peer* last = b.ready.back();
  b.ready[p.ready_pos] = last;
  last->ready_pos = p.ready_pos;
  b.ready.pop_back();
}

void Registry::place(Peer& p, uint64_t job, int stage) {
  if (p.job_id == job && p.stage == stage) return;
  unindex(p);
  p.job_id = job;
  p.stage = stage;
  index(p);
}

void Registry::set_state(Peer& p, PeerState s) {
  if (p.state == s) return;
  StageIndex& b = by_stage_.at({p.job_id, p.stage});
  b.idle = b.idle - (p.state == PeerState::kIdle) + (s == PeerState::kIdle);
  if (p.state == PeerState::kReady) unlist_ready({p.job_id, p.stage}, b, p);
  if (s == PeerState::kReady) list_ready({p.job_id, p.stage}, b, p);
  p.state = s;
}

void Registry::check_index() const {
  size_t n = 0;
  std::unordered_map<uint64_t, size_t> ready_stages;
  for (const auto& [key, b] : by_stage_) {
    if (key.second >= 0 && !b.ready.empty()) ready_stages[key.first]++;
    SWARM_CHECK(!b.peers.empty(), "an empty stage index entry");
    size_t ready = 0, idle = 0;
    for (const auto& [seq, p] : b.peers) {
      SWARM_CHECK(p->job_id == key.first && p->stage == key.second && p->seq == seq,
                  "peer " + p->hello.name + " changed its job or stage without Registry::place");
      ready += p->state == PeerState::kReady;
      idle += p->state == PeerState::kIdle;
      SWARM_CHECK(p->state != PeerState::kReady || (p->ready_pos < b.ready.size() && b.ready[p->ready_pos] == p),
                  "ready peer " + p->hello.name + " is not in its stage's ready list where it says");
      n++;
    }
    SWARM_CHECK(ready == b.ready.size() && idle == b.idle, "a peer changed its state without Registry::set_state");
  }
  SWARM_CHECK(n == peers_.size(), "the stage index does not hold every peer");
  SWARM_CHECK(ready_stages == ready_stages_, "the count of stages with a ready peer is off");
  SWARM_CHECK(by_id_.size() == peers_.size(), "the index by id does not hold every peer");
  for (const auto& [id, p] : peers_) {
    const auto f = by_id_.find(id);
    SWARM_CHECK(f != by_id_.end() && f->second == &p, "the index by id points at another record");
  }
  size_t listening = 0;
  for (const auto& [id, p] : peers_) listening += !p.hello.listen.empty();
  SWARM_CHECK(listening == by_listen_.size(), "the index by listen address does not hold every listening peer");
  for (const auto& [listen, p] : by_listen_) SWARM_CHECK(p->hello.listen == listen, "peer " + p->hello.name + " changed its listen address");
}

Peer* Registry::find(const PeerId& id) {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

const Peer* Registry::find(const PeerId& id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void Registry::touch(const PeerId& id, double now) {
  Peer* p = find(id);
  if (!p || now <= p->last_seen_s) return;
  // The same entry moved to its new time: no allocation.
  auto node = expiry_.extract({p->last_seen_s + window_s_, &p->id});
  p->last_seen_s = now;
  if (node.empty()) {
    expiry_.emplace(now + window_s_, &p->id);
  } else {
    node.value().first = now + window_s_;
    expiry_.insert(std::move(node));
  }
}

std::vector<PeerId> Registry::expired(double now) const {
  std::vector<PeerId> out;
  for (const auto& [t, id] : expiry_) {
    if (t >= now) break;
    out.push_back(*id);
  }
  return out;
}

void Registry::ban(Peer& p, double now) {
  p.bans++;
  bans_total_++;
  p.banned_until_s = now + timing::backoff_s(1.0, 60.0, p.bans);
}

double Registry::timed_out(Peer& p, bool hop, double now) {
  p.timeouts++;
  // Not a ban (it may just be slow), but its expected speed halves, so it gets less work.
  if (hop) {
    p.ms_per_unit = p.ms_per_unit > 0 ? std::max(2.0 * p.ms_per_unit, 100.0) : 1000.0;
    p.turnaround_ms *= 2;
  }
  if (++p.timeouts_in_row < 3) return 0;
  const double s = timing::backoff_s(1.0, 60.0, p.timeouts_in_row - 2);
  p.unresponsive_until_s = now + s;
  return s;
}

void Registry::answered(Peer& p) {
  p.timeouts_in_row = 0;
  p.unresponsive_until_s = 0;
}

void Registry::measured(Peer& p, double compute_ms, double units, double latency_s, double queued_units) {
  if (!(units > 0)) return;
  // The reply came latency_s after the request, behind queued_units of earlier work, so the
  // peer took about latency / (queued + units) per unit, transfers included. Its own claim is
  // believed down to a quarter of that: a peer cannot buy every hop with a tiny compute_ms.
  const double observed = latency_s * 1000.0 / (std::max(0.0, queued_units) + units);
  const double per = std::clamp(std::max(compute_ms / units, observed / 4.0), kMinMsPerUnit, 1e9);
  p.ms_per_unit = timing::ema(p.ms_per_unit, per);
  p.turnaround_ms = timing::ema(p.turnaround_ms, std::clamp(observed, kMinMsPerUnit, 1e9));
}

std::vector<Peer*> Registry::stage_peers(uint64_t job, int stage, double now, bool ready_only) {
  std::vector<Peer*> out, unresponsive;
  auto b = by_stage_.find({job, stage});
  if (b == by_stage_.end() || (ready_only && b->second.ready.empty())) return out;
  for (const auto& [seq, p] : b->second.peers) {   // in join order
    if (ready_only && p->state != PeerState::kReady) continue;
    (ready_only && now < p->unresponsive_until_s ? unresponsive : out).push_back(p);
  }
  return out.empty() ? unresponsive : out;
}

bool Registry::any_ready(uint64_t job, int stage) const {
  auto b = by_stage_.find({job, stage});
  return b != by_stage_.end() && !b->second.ready.empty();
}

size_t Registry::ready_count(uint64_t job, int stage) const {
  auto b = by_stage_.find({job, stage});
  return b == by_stage_.end() ? 0 : b->second.ready.size();
}

bool Registry::any_idle(uint64_t job) const {
  for (auto b = by_stage_.lower_bound({job, std::numeric_limits<int>::min()}); b != by_stage_.end() && b->first.first == job; ++b)
    if (b->second.idle > 0) return true;
  return false;
}

std::vector<const Peer*> Registry::stage_peers(uint64_t job, int stage, double now, bool ready_only) const {
  std::vector<const Peer*> out;
  for (Peer* p : const_cast<Registry*>(this)->stage_peers(job, stage, now, ready_only)) out.push_back(p);
  return out;
}

}  // namespace swarm::router
