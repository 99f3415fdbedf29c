// rounds.h: the within-stage round (DiLoCo's outer step), decided and coordinated by the router,
// computed by the peers (docs/diloco.md).
//
// Defines the pure decision `plan_round` (what a barrier does about rounds, and why), the one
// rule for when a DiLoCo round is due (`delta_round_due`), the router-side sample counts that
// weigh each peer's outer gradient (SampleCounts: what the router saw each peer train on, never
// what the peer claims), and Rounds, one open round at a time:
//
//   collect  ROUND_BEGIN to every ready peer of each stage; each answers ROUND_DELTA with its
//            outer gradient (kept as the bytes it sent; the router decodes none of it)
//   reduce   when all answered or diloco.deadline_s passed: ROUND_REDUCE with every delta and
//            its weight to one peer of the group, the reducer, which answers ROUND_REDUCED with
//            the mean (or the sum, for "grad") through the outer codec
//   apply    (an overlapped round waits for its barrier) ROUND_APPLY with the mean to every
//            ready peer of the stage; each applies the same outer step and answers ROUND_DONE
//            with its state hash
//   vote     when all answered or the deadline passed: peers whose hash is not the most common
//            one are re-synced from a peer that holds it
//
// The reducer is the previous round's reducer of that stage when it is still a member (its
// error-feedback residual for a lossy outer codec lives there), else the member that joined
// first; if it fails, the next member by join order. When the reducer changes, the residual
// it held is lost: at most half a quantisation step per value of one round's mean.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "router/job.h"
#include "runtime/job_spec.h"

namespace swarm::router {

// Whether the group sums gradients and takes one step together at job step `step` (1-based):
// always under diloco.sync "every_step", and during a "rounds" job's warm start.
bool dense_step(const JobSpec& spec, int step);

// The fragment whose DiLoCo round is due once `step` steps are done, or -1: every inner_steps
// steps after the last round (and at the end, `end`) without streaming; with F fragments,
// fragment f once every inner_steps steps at its offset (diloco::fragment_due).
int delta_round_due(const JobSpec& spec, int step, int last_round_step, bool end);

struct RoundPlan {
  enum Action { kNone, kOpen, kApply } action = kNone;
  msg::RoundWhat what = msg::RoundWhat::kDelta;
  int fragment = 0;
  bool overlapped = false;   // training goes on during the exchange; applied overlap_steps later
  std::string reason;
};

// What the job does about rounds at the barrier after `steps_done` steps (`end`: the job's last
// microbatch is done): apply an overlapped round whose step has come, open a gradient round
// (dense steps) or a DiLoCo round, or nothing, with the reason.
RoundPlan plan_round(const JobSpec& spec, int steps_done, int last_round_step, bool end, bool round_open, int apply_step);

// Samples the router counted each peer training on (its accepted BACKWARD and FORWARD_LOSS
// hops), since each fragment last synced and since the last dense step: a round's weights.
class SampleCounts {
 public:
  void trained(const PeerId& peer, int fragments, int64_t samples);
  int64_t since_sync(const PeerId& peer, int fragment) const;
  void synced(const PeerId& peer, int fragment);   // its fragment took the round's outer step
  void forget(const PeerId& peer);                 // it loaded another stage or a donor's state
 private:
  std::map<PeerId, std::vector<int64_t>> counts_;
};

class Rounds {
 public:
  // stage_params: parameters per stage; outer: the job's outer codec.
  Rounds(uint64_t job, const JobSpec& spec, std::vector<int64_t> stage_params);

  bool open() const { return open_; }
  uint64_t count() const { return count_; }
  int last_step() const { return last_step_; }
  int apply_step() const { return apply_step_; }
  SampleCounts& samples() { return samples_; }
  void restore(uint64_t count, int last_step) { count_ = count; last_step_ = last_step; }

  // Opens round count()+1 in every stage group at step `step`.
  void begin(Ctx& c, const RoundPlan& plan, int step);
  void on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m);
  void on_failed(Ctx& c, const Pending& pd);
  // Moves the open round on; `may_apply`: the barrier an overlapped round waits for has come.
  // Returns true when the round is over (every stage applied and voted, or gave up).
  bool advance(Ctx& c, bool may_apply);
  // Peers that disagreed in the last vote, each with a donor that holds the majority state.
  std::vector<std::pair<PeerId, PeerId>> take_resyncs() { return std::move(resyncs_); }

  nlohmann::json status() const;   // rounds, fragment_syncs, hash_mismatches, state_hashes
  void note_hash(const Peer& p, uint64_t hash);
  void forget(const Peer& p);      // it left: its counts and its last hash go
  uint64_t bytes_outer = 0;        // outer-gradient bytes through the router: deltas, reduce, mean, apply

 private:
  struct Stage {
    enum class Phase { kCollect, kReduce, kReduced, kApply, kDone } phase = Phase::kCollect;
    std::vector<PeerId> members;                // ROUND_BEGIN went to them, in join order
    std::set<PeerId> waiting;                   // collect: deltas due; apply: dones due
    std::map<PeerId, wire::Tensor> deltas;      // as received
    std::map<PeerId, double> weights;           // router-counted samples
    PeerId reducer;
    std::set<PeerId> reducers_tried;
    std::optional<wire::Tensor> mean;
    std::map<PeerId, uint64_t> hashes;
  };
  int64_t values(int stage) const;              // the fragment's parameter count
  void reduce(Ctx& c, int s);
  void apply(Ctx& c, int s);
  void vote(Ctx& c, int s);
  msg::RoundRef ref(int s) const;

  uint64_t job_;
  const JobSpec& spec_;
  std::vector<int64_t> params_;
  compression::CodecSpec outer_;
  SampleCounts samples_;
  bool open_ = false;
  uint64_t count_ = 0;
  int last_step_ = 0, apply_step_ = 0;
  msg::RoundWhat what_ = msg::RoundWhat::kDelta;
  int fragment_ = 0;
  double deadline_s_ = 0;
  std::vector<Stage> stages_;
  std::map<int, PeerId> last_reducer_;          // per stage
  std::vector<uint64_t> fragment_syncs_;
  uint64_t hash_mismatches_ = 0;
  std::vector<std::map<std::string, uint64_t>> state_hashes_;   // per stage: peer name -> last hash
  std::vector<std::pair<PeerId, PeerId>> resyncs_;
};

}  // namespace swarm::router
