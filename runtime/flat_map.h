// flat_map.h: a hash map from uint64_t keys, kept in one array (open addressing).
//
// Defines swarm::FlatMap<V>. The router's hot tables (requests by id, flights by microbatch)
// and the simulator's peers' books are looked up on every message; std::unordered_map puts each
// entry in its own node behind a bucket array, so a lookup is two or three cache misses and
// every insert a malloc. Here a lookup lands on the entry's home slot and reads on from there
// (linear probing, at most half full), and erasing shifts the entries after it back (no
// tombstones), so a table that churns stays as short to probe as a fresh one.
//
// Keys are any uint64_t but kEmpty. Pointers and references to values are invalidated by any
// insert or erase (entries move); iteration order is the table's, deterministic for a given
// sequence of calls, and changes when the table grows or entries are erased.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace swarm {

template <class V>
class FlatMap {
 public:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Entry {
    uint64_t key = kEmpty;
    V value{};
  };

  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  void clear() {
    slots_.clear();
    n_ = 0;
  }
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    if (cap > slots_.size()) rehash(cap);
  }

  V* find(uint64_t key) {
    if (slots_.empty()) return nullptr;
    for (size_t i = home(key);; i = (i + 1) & mask()) {
      Entry& e = slots_[i];
      if (e.key == key) return &e.value;
      if (e.key == kEmpty) return nullptr;
    }
  }
  const V* find(uint64_t key) const { return const_cast<FlatMap*>(this)->find(key); }
  size_t count(uint64_t key) const { return find(key) != nullptr; }

  // Inserts `value` under `key` unless the key is there; returns the value kept and whether it
  // was inserted.
  std::pair<V*, bool> emplace(uint64_t key, V value) {
    if (2 * (n_ + 1) > slots_.size()) rehash(slots_.empty() ? 16 : 2 * slots_.size());
    for (size_t i = home(key);; i = (i + 1) & mask()) {
      Entry& e = slots_[i];
      if (e.key == key) return {&e.value, false};
      if (e.key == kEmpty) {
        e.key = key;
        e.value = std::move(value);
        n_++;
        return {&e.value, true};
      }
    }
  }
  V& operator[](uint64_t key) { return *emplace(key, V{}).first; }

  // Removes the key; returns whether it was there.
  bool erase(uint64_t key) {
    if (slots_.empty()) return false;
    size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == kEmpty) return false;
      i = (i + 1) & mask();
    }
    // Backward shift: an entry after the hole moves into it unless its home lies cyclically in
    // (hole, entry], where a lookup from its home would not pass the hole.
    for (size_t j = (i + 1) & mask(); slots_[j].key != kEmpty; j = (j + 1) & mask()) {
      const size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = std::move(slots_[j]);
      i = j;
    }
    slots_[i].key = kEmpty;
    slots_[i].value = V{};
    n_--;
    return true;
  }

  // Every entry, in table order: f(key, value).
  template <class F>
  void for_each(F&& f) const {
    for (const Entry& e : slots_)
      if (e.key != kEmpty) f(e.key, e.value);
  }
  template <class F>
  void for_each(F&& f) {
    for (Entry& e : slots_)
      if (e.key != kEmpty) f(e.key, e.value);
  }

 private:
  size_t mask() const { return slots_.size() - 1; }
  // Fibonacci hashing: consecutive keys (request ids, data indices) spread over the table.
  size_t home(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void rehash(size_t cap) {
    std::vector<Entry> old = std::move(slots_);
    slots_ = std::vector<Entry>(cap);
    shift_ = 64;
    for (size_t c = cap; c > 1; c >>= 1) shift_--;
    n_ = 0;
    for (Entry& e : old)
      if (e.key != kEmpty) emplace(e.key, std::move(e.value));
  }
  std::vector<Entry> slots_;   // a power of two in size, or empty
  size_t n_ = 0;
  int shift_ = 64;
};

}  // namespace swarm
