// weight_versions.h: the async schedule's weight versions and weight prediction
// (docs/schedules.md, "Weight versions and prediction").
//
// Defines swarm::WeightVersions. Every training forward of version v runs on snapshot v: a copy
// of the weights, swapped into the parameters for the forward and again for its backward
// (StageModel::swap_weights: no copy, no autograd version bump). An optimizer step writing into
// the live weights in place then never reaches a graph the affinity cache holds, and a backward
// needs no recompute however many steps late it is (PipeDream-2BW's weight versions, without
// its recompute). With prediction (SpecTrain), snapshot v is the weights extrapolated along the
// last inner step's update by the staleness that step measured: a forward runs on about the
// weights its gradient will be applied to. A snapshot lives while a cached graph ran on it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include <torch/torch.h>

#include "stages/model.h"

namespace swarm {

class WeightVersions {
 public:
  // Back to version 0 with nothing kept (a stage loaded).
  void reset();
  // Counts the in-place changes of the weights: graphs remember the version they ran on.
  uint64_t version() const { return version_; }
  // The current version's snapshot, made from `m`'s weights when its first forward asks.
  const std::vector<torch::Tensor>& current(const StageModel& m);
  // The snapshot of version v if it is kept, else null.
  const std::vector<torch::Tensor>* kept(uint64_t v) const;
  // Before the weights change in place: a new version. An inner step the forwards should
  // predict along passes `staleness` (its samples' mean steps late) and calls after_step once
  // the step is taken; any other change (a round, a state load) forgets the last update.
  void before_change(const StageModel& m, bool predict = false, double staleness = 0);
  void after_step(const StageModel& m);
  // Drops the snapshots of versions no cached graph ran on (`used`), keeping the current one.
  void drop_unused(const std::function<bool(uint64_t)>& used);

 private:
  uint64_t version_ = 0;
  std::map<uint64_t, std::vector<torch::Tensor>> snapshots_;
  std::vector<torch::Tensor> before_;    // the weights before the step in progress
  std::vector<torch::Tensor> velocity_;  // the last inner step's update (empty after any other change)
  double staleness_ = 0;
};

// The peer's own weights set aside while a snapshot is swapped in; put back whatever happens.
class SetAside {
 public:
  explicit SetAside(StageModel& m) : model_(m) {}
  ~SetAside() { put_back(); }
  SetAside(const SetAside&) = delete;
  SetAside& operator=(const SetAside&) = delete;
  void swap_in(const std::vector<torch::Tensor>& snapshot);
  void put_back();

 private:
  StageModel& model_;
  std::vector<torch::Tensor> held_;
};

}  // namespace swarm
