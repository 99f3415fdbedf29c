// durability.h: what a job keeps so that nothing it learned is lost: stage snapshots in the
// router's memory, checkpoints on disk, and its records in the state dir (docs/faults.md,
// docs/checkpoints.md).
//
// Defines swarm::router::Durability. A snapshot is one ready peer's full state per stage
// (theta_g, momentum, its weights and AdamW moments), asked for with STATE_REQUEST {full} at a
// barrier after every round (or every checkpoint.snapshot_every_steps steps; right after a
// round that ran alongside training, without a barrier) and whenever a checkpoint is due; a
// stage whose peers all die restarts from it. A checkpoint is every
// stage's snapshot of one step, written by the server (WriteCheckpoint) off the router's
// thread; the job does not end before its last checkpoint is on disk. The state dir holds
// <state dir>/jobs/<id>/job.json (the spec and the job's state, so a restarted router picks
// the job up again) and the checkpoint dir's progress.json (microbatches taken: those after the
// newest checkpoint are done again on resume). Every file goes through WriteFile (atomic, fsynced).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "router/job.h"
#include "runtime/checkpoint.h"

namespace swarm::router {

class Durability {
 public:
  Durability(uint64_t job, const JobSpec& spec, std::vector<int64_t> stage_params);

  struct Snapshot {
    bool valid = false;
    bool at_barrier = true;   // taken with nothing in flight: the stage's state as of `step` exactly
    int step = 0;
    StageState state;
  };
  const Snapshot& snapshot(int stage) const { return snapshots_[size_t(stage)]; }

  // Where checkpoints go ("" none) and where the job's records live ("" none).
  std::string checkpoint_dir, job_dir;

  bool checkpoint_due(int steps_done, bool end) const;
  bool snapshot_due(int steps_done, uint64_t rounds, bool dense) const;

  // Asks one ready peer of every stage for its full state as of `step` (nothing is in flight at
  // a barrier). `checkpoint`: write the snapshots as a checkpoint once collected. `at_barrier`
  // false: a snapshot after a round that ran alongside training (θ_g and the momentum as of the
  // round's step, the peer's own weights a little later); never a checkpoint.
  void begin(Ctx& c, int step, bool checkpoint, bool at_barrier = true);
  bool collecting() const { return collecting_; }
  void on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m);
  void on_failed(const Pending& pd) { waiting_.erase(pd.peer); }
  // Ends a collection when every stage answered or the deadline passed; `router_state` goes into
  // the checkpoint. Returns true when the collection is over.
  bool advance(Ctx& c, const nlohmann::json& router_state, uint64_t next_microbatch, uint64_t rounds, const nlohmann::json& spec);
  void on_written(Ctx& c, const CheckpointWritten& r);
  bool writing() const { return writes_in_flight_ > 0; }

  // A resumed job: every stage's state from the checkpoint becomes its snapshot.
  void restore(const Checkpoint& ck);
  // progress.json beside the checkpoints, at most every 20 ms.
  void write_progress(Ctx& c, int step, uint64_t taken, uint64_t completed);
  // job.json in the state dir.
  void write_record(Ctx& c, uint64_t id, JobState state, const std::string& reason, const nlohmann::json& spec) const;

  nlohmann::json status() const;   // {dir, written, last}
  uint64_t written() const { return written_; }
  uint64_t failed() const { return failed_; }
  const metrics::Histogram& write_seconds() const { return write_seconds_; }   // per checkpoint written [s]
  int last_snapshot_step = -1, last_checkpoint_step = -1;
  uint64_t snapshot_rounds = 0;    // rounds done when the last snapshot was taken

 private:
  uint64_t job_;
  const JobSpec& spec_;
  std::vector<int64_t> params_;
  std::vector<Snapshot> snapshots_;
  bool collecting_ = false, checkpoint_ = false, at_barrier_ = true;
  int step_ = 0;
  std::set<PeerId> waiting_;
  double deadline_s_ = 0;
  double last_progress_s_ = -1;
  int writes_in_flight_ = 0;
  uint64_t written_ = 0, failed_ = 0;
  metrics::Histogram write_seconds_{metrics::duration_buckets()};
  std::string last_;
};

}  // namespace swarm::router
