// holdings.cpp: implements stages/holdings.h.
#include "stages/holdings.h"

#include <vector>

namespace swarm {

void Holdings::put(uint64_t key, uint32_t part, wire::Tensor t, bool copy, double now) {
  const Key k{key, part};
  if (auto it = entries_.find(k); it != entries_.end()) erase(it);
  make_room(t.data.size());
  bytes_ += t.data.size();
  entries_[k] = Entry{std::move(t), copy, now};
}

std::optional<wire::Tensor> Holdings::get(uint64_t key, uint32_t part) {
  auto it = entries_.find(Key{key, part});
  if (it == entries_.end()) return std::nullopt;
  return wire::share(it->second.t);
}

void Holdings::release(uint64_t key) {
  for (auto it = entries_.lower_bound(Key{key, 0}); it != entries_.end() && it->first.first == key;) {
    auto next = std::next(it);
    erase(it);
    it = next;
  }
}

void Holdings::drop(uint64_t key, uint32_t part) {
  if (auto it = entries_.find(Key{key, part}); it != entries_.end()) erase(it);
}

void Holdings::clear() {
  entries_.clear();
  bytes_ = 0;
}

void Holdings::expire(double now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (now - it->second.at > (it->second.copy ? copy_ttl_s_ : held_ttl_s_)) erase(it);
    it = next;
  }
}

void Holdings::erase(std::map<Key, Entry>::iterator it) {
  bytes_ -= it->second.t.data.size();
  entries_.erase(it);
}

// Copies first, then what was held longest: entries are few (microbatches in flight), so a
// scan is cheaper than keeping an order.
void Holdings::make_room(size_t need) {
  while (!entries_.empty() && bytes_ + need > max_bytes_) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (victim == entries_.end() || (it->second.copy && !victim->second.copy) ||
          (it->second.copy == victim->second.copy && it->second.at < victim->second.at))
        victim = it;
    }
    erase(victim);
    evicted_++;
  }
}

}  // namespace swarm
