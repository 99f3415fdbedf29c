// graph_cache.h: which forward graphs a stage server keeps for their backward (the affinity
// cache), as a rule on ages alone, so that the stage server (stages/worker.cpp) and the
// simulator's peers (sim/stage_replies.cpp) keep the same ones.
//
// A graph's backward comes back after the rest of the pipeline has run the microbatch forward
// and back: in a deep pipeline more forwards pass a peer meanwhile than it can keep. Graphs are
// used in about the order they were made, so evicting the oldest to keep the newest (LRU) throws
// away exactly the graphs whose backwards come next, and nearly every backward recomputes its
// forward. The rule keeps the oldest instead and skips the new graph, unless the oldest is
// overdue: older than twice the age at which graphs have been used (its backward went to
// another peer, or its microbatch was lost), or older than the time to live.
#pragma once

#include <cstddef>

namespace swarm {

// The stage server's cache (StageOptions), which the simulator's peers keep too.
constexpr size_t kGraphCacheEntries = 64;
constexpr double kGraphCacheTtlS = 120;

class GraphCacheRule {
 public:
  GraphCacheRule(size_t entries, double ttl_s) : entries_(entries), ttl_s_(ttl_s) {}

  // A graph kept this long is dropped whatever else happens.
  bool expired(double age_s) const { return age_s > ttl_s_; }

  enum class Admit { kKeep, kEvictOldest, kSkip };
  // Whether to keep a new graph, `kept` being held and the oldest `oldest_age_s` old (expired
  // ones dropped already). kEvictOldest: drop the oldest, then keep the new one.
  Admit admit(size_t kept, double oldest_age_s) const {
    if (entries_ == 0) return Admit::kSkip;
    if (kept < entries_) return Admit::kKeep;
    return use_age_s_ > 0 && oldest_age_s > 2 * use_age_s_ ? Admit::kEvictOldest : Admit::kSkip;
  }

  // A backward found its graph `age_s` after its forward.
  void used(double age_s) { use_age_s_ = use_age_s_ > 0 ? 0.95 * use_age_s_ + 0.05 * age_s : age_s; }

 private:
  size_t entries_;
  double ttl_s_;
  double use_age_s_ = 0;   // moving average of the age at which graphs are used; 0: none yet
};

}  // namespace swarm
