// requests.h: every request the router has sent and not yet had answered, with its deadline.
//
// Defines swarm::router::ReqKind, Pending and Requests: request ids from one counter, the
// pending table by id (hashed), and the deadlines in a min-heap, so a tick finds what expired
// without scanning everything; an answered request's entry is left in the heap and skipped
// when it comes up (the heap is rebuilt from the table once stale entries outnumber it). A request leaves the table exactly once: answered (take), failed (take,
// then the job re-sends its work), or abandoned with its job (drop_job).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <queue>
#include <string>
#include <vector>

#include "router/registry.h"
#include "runtime/flat_map.h"

namespace swarm::router {

enum class ReqKind {
  kHop,           // FORWARD, FORWARD_LOSS, BACKWARD, EVAL
  kLoad,          // LOAD_STAGE
  kStep,          // STEP (sync schedule)
  kRoundBegin,    // ROUND_BEGIN -> ROUND_DELTA
  kRoundReduce,   // ROUND_REDUCE -> ROUND_REDUCED (the round's reducer)
  kRoundApply,    // ROUND_APPLY -> ROUND_DONE
  kStateRequest,  // STATE_REQUEST to a donor, for `target`
  kStateLoad,     // STATE_LOAD to a syncing peer
  kSnapshot,      // STATE_REQUEST {full} for the stage snapshot
  kFetch,         // FETCH of a held tensor through the router (the relay): key = microbatch, stage = request slot
};
const char* req_kind_name(ReqKind k);

struct Pending {
  // What every reply reads, first (two cache lines); the state transfer's fields after them.
  uint64_t id = 0;         // set by Requests::add
  ReqKind kind = ReqKind::kHop;
  bool hold = false;       // the reply's tensors stay at the peer (peer to peer)
  uint8_t pushed = 0;      // hops: the request tensors (bit per slot) whose holder was told to push them
  int stage = -1;          // the stage the request is about
  uint64_t job = 0;
  uint64_t key = 0;        // the microbatch (hops), else 0
  double units = 0;        // work units it adds to the peer's queue
  double queued = 0;       // the peer's queue when it was sent
  double sent_s = 0, deadline_s = 0;   // Ctx::request extends the deadline for the bytes to move
  PeerId peer;             // who it was sent to
  uint64_t reply_bytes = 0;   // the most its reply may carry (a stage's state, a round's delta)
  uint64_t round = 0;      // kStateRequest, kStateLoad from a donor: the job's round count when its state was asked for
  PeerId target;           // kStateRequest: the peer waiting for the state
  PeerId holder;           // kStateLoad: the donor holding the state it references (its request: `key`)
  PeerId donor;            // kStateLoad: the peer whose state it carries ("": a snapshot)
};

class Requests {
 public:
  uint64_t next_id() const { return next_; }
  // An id from the same counter for a message that expects no reply (CHAOS to a peer).
  uint64_t reserve_id() { return next_++; }
  // Registers a request; returns its id.
  uint64_t add(Pending p);
  const Pending* find(uint64_t id) const;
  // Removes and returns a pending request.
  std::optional<Pending> take(uint64_t id);
  // Ids whose deadline is before now, earliest first (ties by id). They leave the deadline
  // order: the caller takes each of them.
  std::vector<uint64_t> expired(double now);
  // A later deadline for a pending request (it is still on its way: Registry::sending).
  void postpone(uint64_t id, double deadline_s);
  // Ids of the requests held by a peer, or for a job, in id order.
  std::vector<uint64_t> of_peer(const PeerId& peer) const;
  std::vector<uint64_t> of_job(uint64_t job) const;
  size_t size() const { return by_id_.size(); }
  // Every pending request, in no order: f(id, pending).
  template <class F>
  void for_each(F&& f) const {
    by_id_.for_each([&](uint64_t id, uint32_t at) { f(id, slab_[at]); });
  }
  // Who a request that has left the table was sent to, for the newest kRetiredKept ids: a late
  // reply from that peer is a duplicate, one from another peer a foreign reply.
  std::optional<PeerId> retired_to(uint64_t id) const;
  static constexpr size_t kRetiredKept = 1 << 16;

 private:
  uint64_t next_ = 1;
  // Pending requests in a slab (freed places reused first, so the live ones stay in few cache
  // lines), found by id through a flat index: one miss or two per lookup, no allocation per request.
  std::vector<Pending> slab_;
  std::vector<uint32_t> free_;
  FlatMap<uint32_t> by_id_;   // id -> place in slab_
  using Deadline = std::pair<double, uint64_t>;   // (deadline, id)
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<Deadline>> deadlines_;
  // Who each of the newest retired requests went to, at id % kRetiredKept (a ring, no allocation).
  struct Retired {
    uint64_t id = 0;
    PeerId peer;
  };
  std::vector<Retired> retired_;
};

}  // namespace swarm::router
