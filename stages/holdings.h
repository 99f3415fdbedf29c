// holdings.h: the tensors a stage server keeps for other peers (peer-to-peer hops).
//
// Defines swarm::Holdings. Peer to peer (docs/protocol.md, "Peer to peer"), a stage server
// keeps what it made when the router asked it to hold (`hold` on a request): its reply carries
// references, and the peers that need the tensors fetch them (FETCH {key, part}) until the
// router RELEASEs them. It also keeps copies of what it fetched, so that a BACKWARD that comes
// back to the peer that ran the forward needs no second fetch. Bounded: copies go first, then
// the oldest held tensors, when `max_bytes` would be passed, and anything older than its time to
// live goes at `expire`; a FETCH of something gone is answered not_held, and the router makes it
// again. The I/O thread owns it (no locks); torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include "runtime/wire.h"

namespace swarm {

class Holdings {
 public:
  // max_bytes: the payload bytes kept at most; held_ttl_s / copy_ttl_s: how long an entry lives.
  Holdings(size_t max_bytes, double held_ttl_s, double copy_ttl_s)
      : max_bytes_(max_bytes), held_ttl_s_(held_ttl_s), copy_ttl_s_(copy_ttl_s) {}

  // Part `part` of the reply to request `key`: made here (`copy` false) or fetched (true).
  // Replaces an entry of the same key and part. `now` [s] on any monotonic clock.
  void put(uint64_t key, uint32_t part, wire::Tensor t, bool copy, double now);
  // A zero-copy share of an entry (its buffer is reference counted), or nullopt.
  std::optional<wire::Tensor> get(uint64_t key, uint32_t part);
  // Every part of `key`.
  void release(uint64_t key);
  // One part of `key`.
  void drop(uint64_t key, uint32_t part);
  void clear();
  // Drops entries past their time to live.
  void expire(double now);

  size_t bytes() const { return bytes_; }
  size_t size() const { return entries_.size(); }
  uint64_t evicted() const { return evicted_; }

 private:
  struct Entry {
    wire::Tensor t;
    bool copy = false;
    double at = 0;
  };
  using Key = std::pair<uint64_t, uint32_t>;
  void erase(std::map<Key, Entry>::iterator it);
  void make_room(size_t need);

  size_t max_bytes_;
  double held_ttl_s_, copy_ttl_s_;
  std::map<Key, Entry> entries_;
  size_t bytes_ = 0;
  uint64_t evicted_ = 0;
};

}  // namespace swarm
