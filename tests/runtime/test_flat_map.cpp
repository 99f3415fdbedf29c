// The router's and the simulator's hash map (runtime/flat_map.h) against std::map.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

#include "runtime/flat_map.h"

namespace swarm {
namespace {

// Every key of the reference is found with its value, and nothing else is there.
void expect_same(const FlatMap<std::string>& m, const std::map<uint64_t, std::string>& ref, const std::vector<uint64_t>& absent) {
  ASSERT_EQ(m.size(), ref.size());
  for (const auto& [k, v] : ref) {
    const std::string* got = m.find(k);
    ASSERT_NE(got, nullptr) << "key " << k;
    EXPECT_EQ(*got, v);
  }
  for (uint64_t k : absent)
    if (!ref.count(k)) EXPECT_EQ(m.find(k), nullptr) << "key " << k;
  size_t seen = 0;
  m.for_each([&](uint64_t k, const std::string& v) {
    seen++;
    auto it = ref.find(k);
    ASSERT_NE(it, ref.end());
    EXPECT_EQ(v, it->second);
  });
  EXPECT_EQ(seen, ref.size());
}

TEST(FlatMap, AgreesWithAnOrderedMapThroughInsertsAndErasesOfEveryKind) {
  // Keys as the router makes them: consecutive ids that retire in a window (each erase shifts
  // the entries after it back), a few long-lived ones, and keys with high bits set (eval keys).
  std::mt19937_64 rng(5);
  FlatMap<std::string> m;
  std::map<uint64_t, std::string> ref;
  std::vector<uint64_t> probes;
  uint64_t next = 0;
  for (int round = 0; round < 20000; ++round) {
    const int op = int(rng() % 10);
    if (op < 5) {
      const uint64_t k = rng() % 7 == 0 ? (uint64_t(1) << 62) | (rng() % 1000) : next++;
      const std::string v = "v" + std::to_string(k) + "-" + std::to_string(round);
      auto [kept, inserted] = m.emplace(k, v);
      EXPECT_EQ(inserted, ref.emplace(k, v).second);
      EXPECT_EQ(*kept, ref.at(k));
    } else if (op < 9 && !ref.empty()) {
      // Mostly the oldest, sometimes any.
      auto it = ref.begin();
      if (rng() % 3 == 0) std::advance(it, long(rng() % ref.size()));
      EXPECT_TRUE(m.erase(it->first));
      ref.erase(it);
    } else {
      const uint64_t k = rng() % (next + 1);
      EXPECT_EQ(m.erase(k), ref.erase(k) == 1);
    }
    if (round % 997 == 0) {
      probes.clear();
      for (int i = 0; i < 200; ++i) probes.push_back(rng() % (next + 10));
      expect_same(m, ref, probes);
    }
  }
  expect_same(m, ref, probes);
  while (!ref.empty()) {
    EXPECT_TRUE(m.erase(ref.begin()->first));
    ref.erase(ref.begin());
  }
  EXPECT_TRUE(m.empty());
  EXPECT_FALSE(m.erase(3));
}

TEST(FlatMap, ErasingInsideAWrappedRunKeepsEveryKeyReachable) {
  // Keys that share a home slot near the table's end run over into its start; erasing the first
  // must pull the others back across the wrap, or their lookups stop at the hole.
  FlatMap<std::string> m;
  m.reserve(4);   // 16 slots
  std::vector<uint64_t> same_home;
  const auto home_of = [](uint64_t k) { return (k * 0x9E3779B97F4A7C15ull) >> 60; };
  for (uint64_t k = 0; same_home.size() < 5; ++k)
    if (home_of(k) == 15) same_home.push_back(k);
  for (uint64_t k : same_home) m.emplace(k, std::to_string(k));
  ASSERT_TRUE(m.erase(same_home[0]));
  for (size_t i = 1; i < same_home.size(); ++i) {
    ASSERT_NE(m.find(same_home[i]), nullptr) << i;
    EXPECT_EQ(*m.find(same_home[i]), std::to_string(same_home[i]));
  }
  EXPECT_EQ(m.find(same_home[0]), nullptr);
  m[same_home[0]] = "back";
  EXPECT_EQ(*m.find(same_home[0]), "back");
  EXPECT_EQ(m.size(), same_home.size());
}

}  // namespace
}  // namespace swarm
