// registry.h: the router's peers: who is registered, who is alive, who may get work.
//
// Defines swarm::router::Peer (one stage server as the router sees it) and Registry: peers by
// routing id, liveness kept in expiry order (any message from a peer pushes its expiry to
// now + heartbeat_ms * liveness, O(1); `expired(now)` refiles entries that came due for peers
// heard from since and lists the dead in order, O(log n) per entry it touches),
// bans after errors (timing::backoff_s: 1 s doubling to 60 s), unresponsiveness after deadlines
// passed in a row (no new work for a growing time, then a probe), integrity failures towards
// quarantine, and the stage membership queries the jobs route by (an index by job and stage, so
// a hop looks at its stage's peers, not at every peer: `place` is the one way to change a peer's
// job or stage). No clock, no I/O: the time comes in as `now` [s].
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/messages.h"

namespace swarm::router {

using PeerId = std::string;   // a ZeroMQ routing id (opaque bytes)

enum class PeerState { kIdle, kLoading, kSyncing, kReady, kQuarantined };
const char* peer_state_name(PeerState s);

// A measure the router takes against a peer for a while (Registry::relay, pause_pushes): a base
// time, doubling with each one in a row up to a cap; one that ended over the cap ago does not count.
struct Spell {
  bool on = false;
  int times = 0;              // spells in a row (each twice as long as the one before)
  double until_s = 0;         // when this one ends
  double ended_s = -1e300;    // when the last one ended
};
enum class SpellKind : uint8_t { kRelay, kNoPush };

// Aligned to a cache line, so the fields dispatch reads for every candidate of every hop
// (Flights::send_hop, Registry::stage_peers: at 1,000 peers a few dozen peers a hop) share one
// line and a candidate costs one cache miss, not two (docs/scale.md).
struct alignas(64) Peer {
  double queued_units = 0;        // work sent to it and not answered yet
  double ms_per_unit = 0;         // timing::ema of compute ms per work unit, from its results; 0: not measured
  double turnaround_ms = 0;       // timing::ema of reply latency per unit (its queue and transfers included)
  double banned_until_s = 0;
  double unresponsive_until_s = 0;
  PeerId id;
  double last_request_s = -1e300;  // when the router last sent it a request (it has heard from the router)
  uint64_t seq = 0;               // join order, assigned by the router (ties and donors use it, never the id)
  msg::Hello hello;               // what it said about itself (name cut to 64 bytes)
  std::string key;                // its public key (Z85) in a CURVE swarm, else ""
  int stage = -1;                 // the stage it serves for job_id (change both with Registry::place)
  uint64_t job_id = 0;
  PeerState state = PeerState::kIdle;   // change with Registry::set_state
  double joined_s = 0, last_seen_s = 0;
  double parts_s = -1e300;        // its last PART, or heartbeat saying `receiving`: a large message on its connection (Registry::sending)
  double expiry_filed_s = 0;      // the Registry's: the time its liveness entry is filed under
  int bans = 0;
  uint64_t results = 0, failures = 0, integrity_failures = 0, timeouts = 0;
  int timeouts_in_row = 0;        // deadlines passed since its last answer
  double last_moved_s = -1e300;   // when the rebalancer last moved it
  int last_from = -1;             // the stage it was last moved from
  msg::Heartbeat heartbeat;       // its last heartbeat
  // Peer to peer: whether others fetch what it makes from its listen address. A peer without
  // one is relayed: its tensors go through the router. One that receivers could not reach is
  // relayed for a while (Registry::relay), then fetched from directly again.
  std::set<PeerId> unreachable_from;   // receivers that could not fetch from it (since its last relay ended)
  Spell relay;
  // Pushes to it (PUSH to the holders of its hops' inputs, Hop.push_to), and those it reported
  // late (fetched instead), since its last pause ended: a peer most of whose pushes do not arrive
  // (its listen address does not reach the holders, or its link is congested) is not pushed to
  // for a while (Registry::pause_pushes) and fetches what it needs, then is pushed to again.
  uint64_t pushes_to = 0, pushes_late = 0;
  Spell no_push;
  // timing::ema of the seconds per MB its requests' references took to reach it (RESULT.fetch_ms
  // over the bytes it fetched or was pushed, of at least timing::kPaceMinBytes); 0: not measured. Its
  // requests' deadlines allow for their bytes at that pace (Registry::pace).
  double s_per_mb = 0;
  // It samples its hops' tokens and targets from its own copy of the job's data (StageReady.data,
  // for the stage it last loaded): the router sends it none (Hop.own_tokens).
  bool samples_tokens = false;
  std::vector<int64_t> to_release;   // keys of what it holds that nobody needs, for its next RELEASE (Ctx::release)
  bool can_hold() const { return !hello.listen.empty() && !relay.on; }
  bool pinned() const { return hello.stage >= 0; }
  // Its measured ms per unit, else what its heartbeat says, else 0.
  double speed_ms() const { return ms_per_unit > 0 ? ms_per_unit : heartbeat.ms_per_unit; }
  // What a deadline allows per unit: the slower of its compute and what its replies have taken,
  // so work that waits on transfers (a fetch over a busy link) is not failed for the wait.
  double deadline_ms_per_unit() const { return std::max(ms_per_unit, turnaround_ms); }
};

// Peers by routing id, for Registry::find: open addressing over (hash, peer) slots in one array,
// linear probing, at most half full. A std::unordered_map put each entry in a node of its own:
// the router looks a peer up about six times a message, and with the table cold between messages
// (a simulated swarm of 1,000 peers) those lookups caused two fifths of the core's D1 read misses.
class PeerIndex {
 public:
  Peer* find(const PeerId& id) const;
  void insert(Peer* p);            // p->id is not in the index
  void erase(const PeerId& id);    // no-op when absent
  size_t size() const { return n_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    Peer* peer = nullptr;          // null: empty
  };
  std::vector<Slot> slots_;        // a power of two in size, or empty
  size_t n_ = 0;
  // The last peer found: a message's sender is looked up again as it is handled, and a hop's
  // holder as its references are attached and pushed. Null after any erase. A lookup writes it,
  // so find() is not for concurrent readers: the router calls its core from one thread.
  mutable Peer* last_ = nullptr;
  size_t home(uint64_t h) const { return size_t(h) & (slots_.size() - 1); }
};

class Registry {
 public:
  Registry(int heartbeat_ms, int liveness) : window_s_(heartbeat_ms * liveness / 1000.0) {}
  Registry(const Registry&) = delete;   // the index points into peers_
  Registry& operator=(const Registry&) = delete;

  // A stage server that said HELLO (replacing an earlier session of the same id: the caller
  // has removed it first). Returns the new record.
  Peer& add(const PeerId& id, const msg::Hello& hello, double now);
  void remove(const PeerId& id);
  Peer* find(const PeerId& id);
  const Peer* find(const PeerId& id) const;
  size_t size() const { return peers_.size(); }
  const std::map<PeerId, Peer>& all() const { return peers_; }
  std::map<PeerId, Peer>& all() { return peers_; }

  // Any message from a peer: it is alive until now + the liveness window. O(1): the expiry
  // order is brought up to date when an entry comes due (expired), not on every message.
  void touch(Peer& p, double now) {
    if (now > p.last_seen_s) p.last_seen_s = now;
  }
  // Peers whose window passed, most overdue first. They stay registered until removed.
  std::vector<PeerId> expired(double now);
  // Whether a large message is on its way over its connection: a PART from it, or a heartbeat
  // saying it is still receiving one from the router, came within the liveness window. Whatever
  // it sends next, a reply the router waits for included, comes after it, so a deadline that
  // passes meanwhile is the link's, not the peer's.
  bool sending(const Peer& p, double now) const { return now - p.parts_s <= window_s_; }
  template <class Ids>
  bool any_sending(const Ids& ids, double now) const {
    for (const PeerId& id : ids)
      if (const Peer* p = find(id); p && sending(*p, now)) return true;
    return false;
  }
  double window_s() const { return window_s_; }

  // An error from the peer: no new work until the ban ends (1 s, doubling per ban, up to 60 s).
  void ban(Peer& p, double now);
  // Receivers could not fetch from it: its tensors go through the router for kRelayBaseS,
  // doubling with each relay in a row up to kRelayCapS (a relay that ended over kRelayCapS ago
  // does not count), then receivers fetch from it again. A link too busy for a fetch's window
  // for a minute is relayed for a while, not for good; a holder behind a NAT costs two failed
  // fetches per relay, ever rarer.
  static constexpr double kRelayBaseS = 30, kRelayCapS = 600;
  void relay(Peer& p, double now) { start(p, SpellKind::kRelay, now); }
  // Most tensors pushed to it came late (its listen address does not reach the holders, or a
  // congested link): it is not pushed to for kNoPushBaseS, doubling with each pause in a row up
  // to kNoPushCapS, then pushed to again with its counts started afresh. A link congested for a
  // minute costs its pushes for a while, not for the rest of its session.
  static constexpr double kNoPushBaseS = 60, kNoPushCapS = 600;
  void pause_pushes(Peer& p, double now) { start(p, SpellKind::kNoPush, now); }
  // The spells that ended by `now`, the peer's state reset: receivers fetch from a relayed
  // peer again (its unreachable_from cleared); a paused one is pushed to again (its counts zero).
  struct SpellEnded {
    PeerId id;
    SpellKind kind;
  };
  std::vector<SpellEnded> spells_ended(double now);
  bool banned(const Peer& p, double now) const { return now < p.banned_until_s; }
  uint64_t bans_total() const { return bans_total_; }   // bans of every peer since the router started
  // A deadline passed without an answer: counted; a hop's timeout also halves its expected
  // speed; three in a row make it unresponsive for a growing time. Returns the seconds of
  // unresponsiveness when it just became so (for the log), else 0.
  double timed_out(Peer& p, bool hop, double now);
  // Any answer: responsive again.
  static void answered(Peer& p);
  // A result's measured compute time for `units` of work; `latency_s` is what the router saw
  // from send to reply and `queued_units` what the peer had ahead of it then: a peer cannot
  // claim to be more than 4x faster than it answers. Clamped to [kMinMsPerUnit, 1e9].
  static void measured(Peer& p, double compute_ms, double units, double latency_s, double queued_units);
  static constexpr double kMinMsPerUnit = 0.01;
  // A result's references, `bytes` of them fetched or pushed, came in `fetch_ms`: the pace of the
  // peer's links, learned where there were enough bytes to time (at most kMaxSPerMb: a peer
  // cannot buy itself deadlines past what 100 kbit/s needs), and the swarm's. `timed`: false
  // for a guess (a busy link's failure), which sets the peer's pace alone.
  void fetched(Peer& p, double bytes, double fetch_ms, bool timed = true);
  static constexpr double kMaxSPerMb = 80;
  // The pace a request to `p` allows its bytes (timing::transfer_allowance_s): its own, or until
  // it has one, the swarm's (the same EMA over every peer's timed samples): a swarm on slow links gives
  // a peer's first transfers the time they will take, not 100 Mbit/s's.
  double pace(const Peer& p) const { return p.s_per_mb > 0 ? p.s_per_mb : s_per_mb_; }

  // Puts the peer on `stage` of `job` (0, -1: on none), and sets its state, keeping the index by
  // stage and its count of ready peers.
  void place(Peer& p, uint64_t job, int stage);
  void set_state(Peer& p, PeerState s);

  // The peers of `stage` serving `job`, in join order. ready_only: those that can take work now
  // (ready and not unresponsive; if every ready peer is unresponsive they are all returned: a
  // probe beats a paused stage). O(peers of that stage).
  std::vector<Peer*> stage_peers(uint64_t job, int stage, double now, bool ready_only = true);
  std::vector<const Peer*> stage_peers(uint64_t job, int stage, double now, bool ready_only = true) const;
  // Whether a peer of `stage` of `job` is ready (stage_peers(...) is not empty), without a list:
  // O(log stages).
  bool any_ready(uint64_t job, int stage) const;
  // How many peers of `stage` of `job` are ready: O(log stages).
  size_t ready_count(uint64_t job, int stage) const;
  // Up to `k` ready, responsive peers of `stage` of `job`, drawn at random without repeats
  // (`draw(i)` gives draw number i, uniform over uint64): O(k^2), whatever the stage's size.
  template <class Draw>
  std::vector<Peer*> sample_ready(uint64_t job, int stage, double now, size_t k, Draw&& draw) {
    std::vector<Peer*> out;
    auto b = by_stage_.find({job, stage});
    if (b == by_stage_.end() || b->second.ready.empty()) return out;
    const std::vector<Peer*>& list = b->second.ready;
    k = std::min(k, list.size());
    for (uint64_t i = 0; out.size() < k && i < 4 * k; ++i) {
      Peer* p = list[size_t(draw(i) % list.size())];
      if (now >= p->unresponsive_until_s && std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
    }
    return out;
  }
  // How many stages (>= 0) of `job` have a ready peer: one hash lookup (every event asks whether
  // a stage is empty).
  // Counts every peer that became ready or stopped being ready, in any stage: a waiter compares it.
  uint64_t ready_changes() const { return ready_changes_; }
  size_t ready_stages(uint64_t job) const {
    auto it = ready_stages_.find(job);
    return it == ready_stages_.end() ? 0 : it->second;
  }
  // Calls f(const Peer&) for each peer whose HELLO gave `listen` as the address others fetch
  // from, in no particular order: one hash lookup.
  template <class F>
  void each_listening_at(const std::string& listen, F&& f) const {
    for (auto [l, end] = by_listen_.equal_range(listen); l != end; ++l) f(*l->second);
  }
  // Whether a peer placed on `job` (any stage) is idle: O(stages of the job).
  bool any_idle(uint64_t job) const;
  // Every peer's job and stage agree with the index (SWARM_CHECK; RouterCore::check_invariants).
  void check_index() const;

 private:
  double window_s_;
  uint64_t next_seq_ = 1;
  uint64_t bans_total_ = 0;
  uint64_t ready_changes_ = 0;
  double s_per_mb_ = 0;   // the swarm's pace (fetched)
  std::map<PeerId, Peer> peers_;
  std::vector<std::pair<PeerId, SpellKind>> spells_;   // spells started, until spells_ended() ends them
  void start(Peer& p, SpellKind k, double now);
  static Spell& spell(Peer& p, SpellKind k) { return k == SpellKind::kRelay ? p.relay : p.no_push; }
  PeerIndex by_id_;   // find() without walking peers_ (kept in add and remove)
  // (expiry time as filed, peer) of every peer, ordered by time then id (pointers into peers_,
  // stable until erased). An entry is filed at a time its peer's last_seen_s has since passed
  // when messages came after it: expired() files such entries again as they come due.
  struct ByExpiry {
    bool operator()(const std::pair<double, Peer*>& a, const std::pair<double, Peer*>& b) const {
      return a.first != b.first ? a.first < b.first : a.second->id < b.second->id;
    }
  };
  std::set<std::pair<double, Peer*>, ByExpiry> expiry_;
  // (job, stage) -> its peers by join order (seq); every peer is in exactly one entry, (0, -1)
  // while it serves no job. Pointers into peers_ (a std::map: stable until erased).
  struct StageIndex {
    std::map<uint64_t, Peer*> peers;   // by seq
    // Of them those in PeerState::kReady, by seq: a hop reads them from one array (a peer
    // becoming ready or not, rare next to hops, moves the rest along).
    std::vector<Peer*> ready;
    size_t idle = 0;                   // of them in PeerState::kIdle
  };
  std::map<std::pair<uint64_t, int>, StageIndex> by_stage_;
  std::unordered_map<uint64_t, size_t> ready_stages_;   // job -> its stages (>= 0) with ready > 0
  void ready_changed(const std::pair<uint64_t, int>& key, size_t before, size_t after);
  std::unordered_multimap<std::string, Peer*> by_listen_;   // hello.listen -> the peers that gave it (not "")
  void unindex(const Peer& p);
  void index(Peer& p);
  void list_ready(const std::pair<uint64_t, int>& key, StageIndex& b, Peer& p);
  void unlist_ready(const std::pair<uint64_t, int>& key, StageIndex& b, const Peer& p);
};

}  // namespace swarm::router
