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
  added.expiry_filed_s = now + window_s_;
  expiry_.emplace(added.expiry_filed_s, &added);
  by_id_.insert(&added);
  index(added);
  if (!added.hello.listen.empty()) by_listen_.emplace(added.hello.listen, &added);
  return added;
}

void Registry::remove(const PeerId& id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  expiry_.erase({it->second.expiry_filed_s, &it->second});
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
  ready_changes_++;
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

namespace {
auto by_seq = [](const Peer* a, uint64_t seq) { return a->seq < seq; };
}  // namespace

void Registry::list_ready(const std::pair<uint64_t, int>& key, StageIndex& b, Peer& p) {
  ready_changed(key, b.ready.size(), b.ready.size() + 1);
  b.ready.insert(std::lower_bound(b.ready.begin(), b.ready.end(), p.seq, by_seq), &p);
}

void Registry::unlist_ready(const std::pair<uint64_t, int>& key, StageIndex& b, const Peer& p) {
  const auto at = std::lower_bound(b.ready.begin(), b.ready.end(), p.seq, by_seq);
  SWARM_CHECK(at != b.ready.end() && *at == &p, "peer " + p.hello.name + " is missing from its stage's ready list");
  ready_changed(key, b.ready.size(), b.ready.size() - 1);
  b.ready.erase(at);
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
      SWARM_CHECK(p->state != PeerState::kReady || std::binary_search(b.ready.begin(), b.ready.end(), p, [](const Peer* x, const Peer* y) { return x->seq < y->seq; }),
                  "ready peer " + p->hello.name + " is not in its stage's ready list");
      n++;
    }
    SWARM_CHECK(ready == b.ready.size() && idle == b.idle, "a peer changed its state without Registry::set_state");
  }
  SWARM_CHECK(n == peers_.size(), "the stage index does not hold every peer");
  SWARM_CHECK(ready_stages == ready_stages_, "the count of stages with a ready peer is off");
  SWARM_CHECK(by_id_.size() == peers_.size(), "the index by id does not hold every peer");
  for (const auto& [id, p] : peers_) SWARM_CHECK(by_id_.find(id) == &p, "the index by id points at another record");
  size_t listening = 0;
  for (const auto& [id, p] : peers_) listening += !p.hello.listen.empty();
  SWARM_CHECK(listening == by_listen_.size(), "the index by listen address does not hold every listening peer");
  for (const auto& [listen, p] : by_listen_) SWARM_CHECK(p->hello.listen == listen, "peer " + p->hello.name + " changed its listen address");
}

Peer* Registry::find(const PeerId& id) { return by_id_.find(id); }

const Peer* Registry::find(const PeerId& id) const { return by_id_.find(id); }

// ---- PeerIndex ----

Peer* PeerIndex::find(const PeerId& id) const {
  if (last_ && last_->id == id) return last_;
  if (n_ == 0) return nullptr;
  const uint64_t h = std::hash<std::string>{}(id);
  for (size_t i = home(h);; i = (i + 1) & (slots_.size() - 1)) {
    const Slot& s = slots_[i];
    if (!s.peer) return nullptr;
    if (s.hash == h && s.peer->id == id) return last_ = s.peer;
  }
}

void PeerIndex::insert(Peer* p) {
  if (2 * (n_ + 1) > slots_.size()) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(16, 2 * old.size()), Slot{});
    n_ = 0;
    for (const Slot& s : old)
      if (s.peer) insert(s.peer);
  }
  const uint64_t h = std::hash<std::string>{}(p->id);
  size_t i = home(h);
  while (slots_[i].peer) i = (i + 1) & (slots_.size() - 1);
  slots_[i] = Slot{h, p};
  n_++;
}

void PeerIndex::erase(const PeerId& id) {
  last_ = nullptr;
  if (n_ == 0) return;
  const size_t mask = slots_.size() - 1;
  const uint64_t h = std::hash<std::string>{}(id);
  size_t i = home(h);
  for (;; i = (i + 1) & mask) {
    if (!slots_[i].peer) return;
    if (slots_[i].hash == h && slots_[i].peer->id == id) break;
  }
  // Backward shift: each later entry of the run moves into the hole unless its home lies
  // cyclically in (hole, its slot], so that every entry stays reachable from its home.
  for (size_t j = (i + 1) & mask; slots_[j].peer; j = (j + 1) & mask) {
    const size_t k = home(slots_[j].hash);
    const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (stays) continue;
    slots_[i] = slots_[j];
    i = j;
  }
  slots_[i] = Slot{};
  n_--;
}

std::vector<PeerId> Registry::expired(double now) {
  // Entries come due at the time they were filed; a peer heard from since is filed again at
  // its real expiry (once per liveness window at most, rather than a move on every message).
  std::vector<decltype(expiry_)::node_type> refile;
  for (auto it = expiry_.begin(); it != expiry_.end() && it->first < now;) {
    const auto next = std::next(it);
    if (it->second->last_seen_s + window_s_ != it->first) refile.push_back(expiry_.extract(it));
    it = next;
  }
  for (auto& node : refile) {
    Peer* p = node.value().second;
    node.value().first = p->expiry_filed_s = p->last_seen_s + window_s_;
    expiry_.insert(std::move(node));
  }
  std::vector<PeerId> out;
  for (const auto& [t, p] : expiry_) {
    if (t >= now) break;
    out.push_back(p->id);
  }
  return out;
}

void Registry::ban(Peer& p, double now) {
  p.bans++;
  bans_total_++;
  p.banned_until_s = now + timing::backoff_s(1.0, 60.0, p.bans);
}

void Registry::start(Peer& p, SpellKind k, double now) {
  const bool relaying = k == SpellKind::kRelay;
  const double base = relaying ? kRelayBaseS : kNoPushBaseS, cap = relaying ? kRelayCapS : kNoPushCapS;
  Spell& sp = spell(p, k);
  if (now - sp.ended_s > cap) sp.times = 0;
  sp.times++;
  sp.on = true;
  sp.until_s = now + timing::backoff_s(base, cap, sp.times);
  spells_.emplace_back(p.id, k);
}

std::vector<Registry::SpellEnded> Registry::spells_ended(double now) {
  std::vector<SpellEnded> out;
  if (spells_.empty()) return out;
  size_t keep = 0;
  for (size_t i = 0; i < spells_.size(); ++i) {
    Peer* p = find(spells_[i].first);
    if (!p) continue;   // gone (a peer that rejoins starts afresh)
    const SpellKind k = spells_[i].second;
    Spell& sp = spell(*p, k);
    if (!sp.on) continue;
    if (now < sp.until_s) {
      if (keep != i) spells_[keep] = std::move(spells_[i]);
      keep++;
      continue;
    }
    sp.on = false;
    sp.ended_s = now;
    if (k == SpellKind::kRelay) {
      p->unreachable_from.clear();
    } else {
      p->pushes_to = 0;
      p->pushes_late = 0;
    }
    out.push_back({p->id, k});
  }
  spells_.resize(keep);
  return out;
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

void Registry::fetched(Peer& p, double bytes, double fetch_ms, bool timed) {
  if (bytes < double(timing::kPaceMinBytes) || fetch_ms <= 0) return;
  const double sample = std::min(kMaxSPerMb, fetch_ms / 1000.0 / (bytes / 1e6));
  p.s_per_mb = timing::ema(p.s_per_mb, sample);
  if (timed) s_per_mb_ = timing::ema(s_per_mb_, sample);
}

std::vector<Peer*> Registry::stage_peers(uint64_t job, int stage, double now, bool ready_only) {
  std::vector<Peer*> out;
  auto b = by_stage_.find({job, stage});
  if (b == by_stage_.end()) return out;
  if (!ready_only) {
    out.reserve(b->second.peers.size());
    for (const auto& [seq, p] : b->second.peers) out.push_back(p);   // in join order
    return out;
  }
  const std::vector<Peer*>& ready = b->second.ready;   // in join order
  out.reserve(ready.size());
  for (Peer* p : ready)
    if (now >= p->unresponsive_until_s) out.push_back(p);
  if (out.empty()) out = ready;   // every ready peer is unresponsive: a probe beats a paused stage
  return out;
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
