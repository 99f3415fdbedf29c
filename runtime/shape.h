// shape.h: a tensor's shape, kept inline.
//
// Defines swarm::wire::Shape: up to limits::kMaxTensorRank dimensions in a fixed array, so that a
// TensorDesc copies without touching the heap. The router copies descriptions on every hop (into
// the slot that remembers who holds a tensor, into each reference it sends), and a heap-allocated
// shape was a malloc and a free each time. It reads like the std::vector<int64_t> it replaces,
// converts from one (and from a brace list), and compares with one.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "runtime/errors.h"
#include "runtime/limits.h"

namespace swarm::wire {

class Shape {
 public:
  static constexpr size_t kCapacity = limits::kMaxTensorRank;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) { assign(dims.begin(), dims.end()); }
  Shape(const std::vector<int64_t>& dims) { assign(dims.begin(), dims.end()); }  // NOLINT: implicit, as the vector it replaces
  template <class It>
  Shape(It first, It last) { assign(first, last); }

  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t operator[](size_t i) const { return d_[i]; }
  int64_t& operator[](size_t i) { return d_[i]; }
  int64_t back() const { return d_[n_ - 1]; }
  const int64_t* data() const { return d_.data(); }
  int64_t* data() { return d_.data(); }
  const int64_t* begin() const { return d_.data(); }
  const int64_t* end() const { return d_.data() + n_; }
  void push_back(int64_t v) {
    SWARM_CHECK(n_ < kCapacity, "a tensor shape has at most " + std::to_string(kCapacity) + " dimensions");
    d_[n_++] = v;
  }
  void clear() { n_ = 0; }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }

  friend bool operator==(const Shape& a, const Shape& b) { return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin()); }
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

 private:
  template <class It>
  void assign(It first, It last) {
    for (; first != last; ++first) push_back(int64_t(*first));
  }
  std::array<int64_t, kCapacity> d_{};
  uint8_t n_ = 0;
};

}  // namespace swarm::wire
