// test_graph_cache.cpp: which forward graphs a stage server keeps for their backwards
// (runtime/graph_cache.h), on the access pattern of a deep pipeline.
#include <gtest/gtest.h>

#include <deque>
#include <utility>

#include "runtime/graph_cache.h"

using namespace swarm;

namespace {

// A cache of `entries` graphs under the rule, or under LRU (evict the oldest to keep the newest,
// the stage server's rule before), fed one forward a second whose backward comes `delay_s` later
// (every backward comes back, in order). Returns the share of backwards that found their graph.
double hit_rate(size_t entries, int delay_s, bool lru, int forwards = 2000) {
  GraphCacheRule rule(entries, 1e9);
  std::deque<std::pair<int, double>> kept;   // (microbatch, made at), oldest first
  int hits = 0, backwards = 0;
  for (int t = 0; t < forwards + delay_s; ++t) {
    const int back = t - delay_s;
    if (back >= 0) {
      backwards++;
      for (auto it = kept.begin(); it != kept.end(); ++it)
        if (it->first == back) {
          rule.used(t - it->second);
          kept.erase(it);
          hits++;
          break;
        }
    }
    if (t >= forwards) continue;
    if (lru) {
      if (kept.size() >= entries) kept.pop_front();
    } else {
      switch (rule.admit(kept.size(), kept.empty() ? 0.0 : t - kept.front().second)) {
        case GraphCacheRule::Admit::kSkip: continue;
        case GraphCacheRule::Admit::kEvictOldest: kept.pop_front(); break;
        case GraphCacheRule::Admit::kKeep: break;
      }
    }
    kept.emplace_back(t, double(t));
  }
  return double(hits) / backwards;
}

}  // namespace

TEST(GraphCache, ADeepPipelineKeepsWhatFitsInsteadOfNothing) {
  // 200 forwards pass before each backward and 64 graphs fit: LRU evicts every graph just
  // before its backward comes (the last 64, with no forward after them, are all it keeps: 3%);
  // the rule keeps a third of them.
  EXPECT_LT(hit_rate(64, 200, /*lru=*/true), 0.035);
  const double kept = hit_rate(64, 200, /*lru=*/false);
  EXPECT_GT(kept, 0.28);
  EXPECT_LT(kept, 0.36);
  // A shallow one (backwards within the cache's reach) hits every time under both.
  EXPECT_EQ(hit_rate(64, 40, true), 1.0);
  EXPECT_EQ(hit_rate(64, 40, false), 1.0);
}

TEST(GraphCache, AGraphWhoseBackwardWentElsewhereIsEvictedOnceOverdue) {
  GraphCacheRule rule(2, 100);
  EXPECT_EQ(rule.admit(0, 0), GraphCacheRule::Admit::kKeep);
  EXPECT_EQ(rule.admit(1, 1), GraphCacheRule::Admit::kKeep);
  // Full, and no graph used yet: nothing is known to be overdue, the new one is skipped.
  EXPECT_EQ(rule.admit(2, 50), GraphCacheRule::Admit::kSkip);
  rule.used(5);   // backwards come 5 s after their forwards
  EXPECT_EQ(rule.admit(2, 9), GraphCacheRule::Admit::kSkip);
  EXPECT_EQ(rule.admit(2, 11), GraphCacheRule::Admit::kEvictOldest);   // over twice 5 s
  EXPECT_FALSE(rule.expired(100));
  EXPECT_TRUE(rule.expired(101));
  // No cache at all.
  EXPECT_EQ(GraphCacheRule(0, 100).admit(0, 0), GraphCacheRule::Admit::kSkip);
}
