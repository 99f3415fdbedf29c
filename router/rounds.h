// rounds.h: the within-stage round (DiLoCo's outer step), decided and coordinated by the router,
// computed by the peers (docs/diloco.md).
//
// Defines the pure decision `plan_round` (what a barrier does about rounds, and why), the one
// rule for when a DiLoCo round is due (`delta_round_due`), the router-side sample counts that
// weigh each peer's outer gradient (SampleCounts: what the router saw each peer train on, never
// what the peer claims), and Rounds, one open round at a time. The round's values are cut into
// K contiguous parts: K = 1 through the router (routing.hops "hub", or a group with a member
// others cannot reach), K = the group's size peer to peer, where member j owns part j:
//
//   collect  ROUND_BEGIN {shards: K} to every ready peer of each stage; each answers
//            ROUND_DELTA with its outer gradient in K parts (peer to peer: held by it, the
//            reply carries references; the router decodes none of it)
//   reduce   when all answered or diloco.deadline_s passed: per part j, ROUND_REDUCE with every
//            member's part j and its weight to part j's owner, which answers ROUND_REDUCED with
//            the mean (or the sum, for "grad") of its part through the outer codec; owners
//            fetch the parts from the members, so no peer carries much more than its share
//            (a reduce-scatter)
//   apply    (an overlapped round waits for its barrier) ROUND_APPLY with the K means to every
//            ready peer of the stage (an all-gather: each fetches them from the owners); each
//            applies the same outer step and answers ROUND_DONE with its state hash
//   vote     when all answered or the deadline passed: peers whose hash is not the most common
//            one, and peers that could not fetch the means, are re-synced from a peer that holds
//            the majority state
//
// Part j's owner is its previous owner when it is still a member and K is unchanged (the
// error-feedback residual of a lossy outer codec for its mean lives there), else member j in join
// order; if it fails, the next member. When the owner changes, the residual it held is lost: at
// most half a quantisation step per value of one round's mean. A member's own residual spans all
// its values, whatever the cut. A member whose part cannot be fetched is left out of that part's
// mean (the others' weights renormalised); every member still applies the same means.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "router/job.h"
#include "runtime/job_spec.h"

namespace swarm::router {

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
  // Its fragment (-1: all) took the round's outer step. `sent`: the samples its outer gradient
  // was weighed by; what it trained on since it sent it (a round alongside training) stays
  // counted, as the peer keeps that progress. -1: it sent none, and keeps nothing.
  void synced(const PeerId& peer, int fragment, int64_t sent = -1);
  void forget(const PeerId& peer);                 // it loaded another stage or a donor's state
 private:
  std::unordered_map<PeerId, std::vector<int64_t>> counts_;   // looked up on every trained hop
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
  // Peers the last replies showed lying (an outer gradient far past any honest spread, a vote
  // against a clear majority), each with what it did: the job counts them as integrity failures.
  std::vector<std::pair<PeerId, std::string>> take_blames() { return std::move(blames_); }

  // A request of the round could not fetch tensor `slot` from the peer holding it.
  void on_fetch_failed(Ctx& c, const Pending& pd, int slot);

  nlohmann::json status() const;   // rounds, fragment_syncs, hash_mismatches, state_hashes, outer_peer_bytes, outliers
  void note_hash(const Peer& p, uint64_t hash);
  void forget(const Peer& p);      // it left: its counts and its last hash go
  // Outer-gradient bytes that crossed a link (deltas, parts, means), through the router or peer
  // to peer; and of the last round, what each peer sent and received (by name).
  uint64_t bytes_outer = 0;
  struct PeerBytes {
    uint64_t sent = 0, received = 0;
  };
  const std::map<std::string, PeerBytes>& last_round_bytes() const { return last_round_bytes_; }
  // Seconds from each round's start to its end, by what it exchanged ("delta", "grad").
  const std::map<std::string, metrics::Histogram>& durations() const { return durations_; }

 private:
  struct Stage {
    enum class Phase { kCollect, kReduce, kReduced, kApply, kDone } phase = Phase::kCollect;
    int shards = 1;                             // K: parts of the round's values
    bool p2p = false;                           // parts held by the members, fetched by whoever needs them
    std::vector<PeerId> members;                // ROUND_BEGIN went to them, in join order
    std::unordered_map<PeerId, size_t> index;   // member -> its place in `members`
    std::set<PeerId> waiting;                   // collect: deltas due; apply: dones due
    // [members] each member's K parts, as received (empty: none), and the router-counted samples
    // they are weighed by: read per member for each of the K parts, so by place, not by id.
    std::vector<std::vector<Slot>> deltas;
    std::vector<double> weights;
    size_t contributed = 0;                     // members with parts in `deltas`
    std::vector<PeerId> owners;                 // [K] who reduces each part
    std::vector<std::set<PeerId>> owners_tried; // [K]
    std::vector<std::vector<PeerId>> contributors;  // [K] whose parts the part's ROUND_REDUCE carries, in order
    std::vector<Slot> means;                    // [K] the reduced parts
    std::set<int> reducing;                     // parts not reduced yet
    std::set<PeerId> unsynced;                  // could not fetch the means: resynced after the vote
    std::set<PeerId> left_out;                  // outliers in some part: their samples are not in the apply's count
    std::map<PeerId, uint64_t> hashes;
  };
  int64_t values(int stage) const;              // the fragment's parameter count
  int64_t part_values(int stage, int shards, int j) const;
  void reduce(Ctx& c, int s);
  void reduce_part(Ctx& c, int s, int j);
  // The phase's deadline passed, and no member it waits for is still sending a large message.
  bool overdue(const Ctx& c, const Stage& st) const;
  // A round request's deadline: a request's usual one, plus, when its tensors go inline (through
  // the router's link, with every other stage's), the allowance for the round's inline bytes.
  double phase_deadline(const Ctx& c, const Peer& p, bool p2p) const;
  void apply(Ctx& c, int s);
  void vote(Ctx& c, int s);
  void release(Ctx& c, Stage& st);
  void count_bytes(Ctx& c, const wire::Message& m, const PeerId& receiver);   // per-peer figures of a request's tensors
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
  uint64_t inline_bytes_ = 0;   // the open round's outer gradients sent inline, all members of all stages [bytes]
  double begun_s_ = 0;
  std::map<std::string, metrics::Histogram> durations_;
  std::vector<Stage> stages_;
  std::map<std::pair<int, int>, std::pair<int, PeerId>> last_owner_;   // (stage, part) -> (K, owner)
  // By peer name: counted per reference while a round is open (hashed), kept sorted once it ends.
  std::unordered_map<std::string, PeerBytes> round_bytes_;
  std::map<std::string, PeerBytes> last_round_bytes_;
  std::map<std::string, uint64_t> outliers_;   // contributions left out of a mean, by peer name
  std::vector<uint64_t> fragment_syncs_;
  uint64_t hash_mismatches_ = 0;
  std::vector<std::map<std::string, uint64_t>> state_hashes_;   // per stage: peer name -> last hash
  std::vector<std::pair<PeerId, PeerId>> resyncs_;
  std::vector<std::pair<PeerId, std::string>> blames_;
};

}  // namespace swarm::router
