// test_boxed.cpp: Boxed<T>, the heap optional a flight's slots are made of, and its pool of
// freed blocks.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "router/job.h"

using namespace swarm;
using namespace swarm::router;

namespace {

Held held(uint64_t key) {
  Held h;
  h.holder = "a-holder-whose-id-is-longer-than-sso-" + std::to_string(key);
  h.key = key;
  h.part = uint32_t(key % 3);
  h.desc.shape = {8, int64_t(key), 16};
  return h;
}

}  // namespace

// Copies are independent, moves leave the source empty, assignment reuses the box.
TEST(Boxed, BehavesAsAnOptional) {
  Boxed<Held> a;
  EXPECT_FALSE(a.has_value());
  a = held(1);
  ASSERT_TRUE(a);
  const Held* at = &*a;
  a = held(2);
  EXPECT_EQ(&*a, at);   // a full box takes a new value in place
  EXPECT_EQ(a->key, 2u);
  Boxed<Held> b = a;
  ASSERT_TRUE(b);
  EXPECT_NE(&*b, &*a);
  b->key = 3;
  EXPECT_EQ(a->key, 2u);
  EXPECT_EQ(a->holder, held(2).holder);
  Boxed<Held> c = std::move(a);
  EXPECT_FALSE(a.has_value());
  EXPECT_EQ(c->key, 2u);
  EXPECT_EQ(c->desc.shape, (std::vector<int64_t>{8, 2, 16}));
  c = b;
  EXPECT_EQ(c->key, 3u);
  c = Boxed<Held>();
  EXPECT_FALSE(c);
  b.reset();
  EXPECT_FALSE(b);
}

// Emptied boxes give their blocks to the pool, and new boxes of that type take them back
// before asking the heap; the pool keeps at most kKeep, and each thread has its own.
TEST(Boxed, FreedBlocksAreReusedByTheNextBoxes) {
  const size_t before = BoxPool<Held>::kept();
  std::vector<Boxed<Held>> boxes(100);
  for (size_t i = 0; i < boxes.size(); ++i) boxes[i] = held(i);
  std::set<const Held*> first;
  for (auto& b : boxes) first.insert(&*b);
  const size_t taken = std::min<size_t>(before, boxes.size());
  for (auto& b : boxes) b.reset();
  EXPECT_EQ(BoxPool<Held>::kept(), std::min(before - taken + boxes.size(), BoxPool<Held>::kKeep));
  for (size_t i = 0; i < boxes.size(); ++i) boxes[i] = held(1000 + i);
  for (size_t i = 0; i < boxes.size(); ++i) {
    EXPECT_EQ(first.count(&*boxes[i]), 1u) << "box " << i << " did not reuse a freed block";
    EXPECT_EQ(boxes[i]->key, 1000 + i);
  }
  std::thread other([] {
    EXPECT_EQ(BoxPool<Held>::kept(), 0u);
    Boxed<Held> b;
    b = held(7);
    b.reset();
    EXPECT_EQ(BoxPool<Held>::kept(), 1u);
  });
  other.join();
  std::vector<Boxed<Held>> many(BoxPool<Held>::kKeep + 10);
  for (auto& b : many) b = held(1);
  many.clear();
  EXPECT_EQ(BoxPool<Held>::kept(), BoxPool<Held>::kKeep);
}
