// training_job.h: a training job: its microbatches, its steps, rounds, evaluations, snapshots
// and checkpoints, and the peers that serve it.
//
// Defines swarm::router::TrainingJob. Between microbatches the job is in one phase:
//   kTrain     microbatches up to the next barrier (every step under `sync`; under `async` the
//              next step with a round, an evaluation, a checkpoint or a snapshot, or the end;
//              not a round that runs alongside training, diloco.rounds: roll_round)
//   kStepping  sync: STEP to every ready peer, waiting for them
//   kRound     a blocking round (router/rounds.h)
//   kEval      EVAL microbatches through every stage
//   kSnapshot  collecting stage snapshots, maybe for a checkpoint (router/durability.h)
//   kFinishing the last checkpoint is being written
// after_step() runs, in order, what is due after a barrier: an overlapped round's application,
// a round, an evaluation, a snapshot; then more training, or the end. Peers are assigned and
// loaded, synced from a donor or a snapshot, quarantined and moved by the rebalancer in
// membership.cpp; the status in status.cpp.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "router/durability.h"
#include "router/flights.h"
#include "router/placement.h"
#include "router/rounds.h"

namespace swarm::router {

class TrainingJob : public Job {
 public:
  TrainingJob(uint64_t id, JobSpec spec);
  TrainingJob(const TrainingJob&) = delete;  // its flights sample tokens through `this`
  TrainingJob& operator=(const TrainingJob&) = delete;

  // The data (and checkpoint) arrived: the job may run.
  void loaded(Ctx& c, const JobLoaded& r);
  const JobSpec& spec() const { return spec_; }
  const nlohmann::json& spec_json() const { return spec_json_; }
  Durability& durability() { return dur_; }

  bool wants(const Peer& p) const override { return !p.hello.echo; }
  void start(Ctx& c) override;
  void offer(Ctx& c, Peer& p) override;
  void on_peer_gone(Ctx& c, const Peer& p) override;
  void on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) override;
  void on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) override;
  void on_fetch_failed(Ctx& c, const Pending& pd, int slot, FetchMiss miss, const std::string& why) override;
  void advance(Ctx& c) override;
  void on_checkpoint_written(Ctx& c, const CheckpointWritten& r) override { dur_.on_written(c, r); }
  void duplicate(uint64_t request) override {
    duplicates_++;
    flights_.duplicate(request);
  }
  void timed_out() override { timeouts_++; }
  nlohmann::json status(const Registry& peers, double now) const override;
  void metrics(JobMetrics& m, const Registry& peers, double now) const override;
  void finish(Ctx& c, JobState st, const std::string& reason) override;
  void persist(Ctx& c) override { dur_.write_record(c, id_, state_, reason_, spec_json_); }
  void check(const Requests& r) const override;
  void integrity_failure(Ctx& c, const PeerId& peer, const std::string& what) override;

 private:
  enum class Phase { kTrain, kStepping, kRound, kEval, kSnapshot, kFinishing };

  // training_job.cpp: the loop.
  uint64_t next_barrier_mb() const;
  // Job steps whose every microbatch has completed (the lowest one still in flight, or the next
  // to take, over the microbatches per step).
  int steps_complete() const;
  // Whether DiLoCo rounds run alongside training (diloco.rounds) rather than at a barrier.
  bool rolling_rounds() const { return rounds_alongside(spec_); }
  void roll_round(Ctx& c);
  uint64_t round_limit_mb();   // microbatches that may be taken while a round is open
  void on_barrier(Ctx& c);
  void after_step(Ctx& c);
  void take(Ctx& c, uint64_t index, bool eval);
  // Microbatch `index`'s tokens, or its targets, as a hop carries them (FlightConfig::tokens).
  wire::Tensor tokens(uint64_t index, bool eval, bool targets) const;
  void record_loss(Ctx& c, uint64_t index, double loss);
  void hop_result(Ctx& c, Peer& p, const Pending& pd, wire::Message& m);
  std::string empty_stages(Ctx& c) const;
  nlohmann::json router_state(double now) const;
  // The figures the status and /metrics share.
  double elapsed_s(double now) const { return (job_finished(state_) ? finished_s_ : now) - run_started_s_; }
  double tokens_per_s(double now) const { return elapsed_s(now) > 0 ? double(train_tokens_) / elapsed_s(now) : 0.0; }
  uint64_t resent() const { return resent_before_ + flights_.resent; }
  uint64_t duplicates() const { return duplicates_before_ + duplicates_; }
  uint64_t rejected() const { return rejected_before_ + flights_.rejected; }
  uint64_t lost() const { return state_ == JobState::kDone ? taken_ - completed_ : 0; }
  void history(nlohmann::json entry);

  // membership.cpp: peers.
  // The placement view a job start keeps while it assigns every peer: placement_view once, then
  // each peer placed added where placement_view would put it (join order), so that a start
  // makes the same choices without rebuilding the view of every peer for each peer.
  struct StartView {
    swarm::Registry reg;
    std::vector<uint64_t> seq;   // Peer::seq of reg.peers, ascending
  };
  void assign(Ctx& c, Peer& p, StartView* start = nullptr);
  void send_load(Ctx& c, Peer& p);
  void on_loaded(Ctx& c, Peer& p, wire::Message& m);
  void start_sync(Ctx& c, Peer& p, const PeerId& donor = {});
  void restore_from_snapshot(Ctx& c, Peer& p);
  void on_state_reply(Ctx& c, Peer& donor, const Pending& pd, wire::Message& m);
  swarm::Registry placement_view(const Registry& peers, double now, std::vector<uint64_t>* seq = nullptr) const;
  PeerView placed_view(const Peer& p, const Registry& peers, double now) const;   // one peer of placement_view
  PeerView view_of(const Peer& p) const;     // a peer's speed, memory and precision for placement
  void maybe_rebalance(Ctx& c);
  bool make_move(Ctx& c, const swarm::Move& mv);   // false when the peer is gone

  JobSpec spec_;
  nlohmann::json spec_json_;
  std::shared_ptr<const TokenData> data_;
  double unigram_ = 0;
  int S_ = 1, M_ = 1;
  std::vector<int64_t> stage_params_;
  std::vector<double> stage_cost_;      // stage_costs_from_params(stage_params_), computed once
  std::string waiting_key_;             // the empty stages and peer count the waiting reason was made for
  double startable_s_ = -1;             // when every stage first had a ready peer (routing.start_peers)
  std::vector<StageNeed> stage_need_;   // what each stage takes in memory (router/placement.h)
  uint64_t total_mbs_ = 0;
  Phase phase_ = Phase::kTrain;
  uint64_t barrier_ = 0;          // microbatch count at which the loop stops to step/sync/evaluate
  uint64_t taken_ = 0, completed_ = 0, duplicates_ = 0;
  uint64_t resumed_at_ = 0;       // microbatches a checkpoint had completed: the wire counters start after them
  uint64_t integrity_failures_ = 0, timeouts_ = 0, resent_before_ = 0, duplicates_before_ = 0, rejected_before_ = 0;
  Flights flights_;
  Rounds rounds_;
  Durability dur_;
  std::map<uint64_t, std::pair<double, int>> step_loss_;   // step -> (sum, count)
  int steps_done_ = 0;
  int rolled_to_ = 0;             // roll_round looked at the steps up to this one
  std::pair<int, uint64_t> limit_{-1, 0};   // round_limit_mb of the round opened at this step
  double train_loss_ = NAN, val_loss_ = NAN;
  std::deque<nlohmann::json> history_;   // {step, train_loss, tokens_per_s}, {step, val_loss}, {step, round, fragment}
  int64_t train_tokens_ = 0;
  double codec_us_[4] = {0, 0, 0, 0};  // activations encode, decode; gradients encode, decode (all peers)
  int last_eval_step_ = -1;
  double eval_sum_ = 0;
  int eval_count_ = 0;
  uint64_t eval_next_ = 0;
  std::set<PeerId> step_waiting_;
  // Loaded peers whose sync waits for the open round to be applied (a donor's state taken before
  // the apply would miss it), with the donor asked for (or ""), synced in id order.
  std::map<PeerId, PeerId> sync_after_round_;
  bool step_overflow_ = false;    // a backward of the current step overflowed: every stage skips it
  uint64_t skipped_steps_ = 0;
  nlohmann::json quarantined_ = nlohmann::json::array();
  std::set<std::string> quarantined_ids_;   // keys (ids without keys) of the quarantined, kept across HELLOs
  nlohmann::json restores_ = nlohmann::json::array();
  nlohmann::json resumed_ = nullptr;
  // Rebalancing (routing.rebalance).
  Proposal proposal_;
  double last_move_s_ = kNever;
  double next_rebalance_s_ = -1;
  std::mt19937_64 rng_;
  nlohmann::json moves_ = nlohmann::json::array();
  std::map<std::tuple<int, int, std::string>, uint64_t> move_counts_;   // (from, to, reason) -> moves, for /metrics
  std::string rebalance_reason_;
};

}  // namespace swarm::router
