// weight_versions.cpp: see weight_versions.h.
#include "stages/weight_versions.h"

namespace swarm {

namespace {

std::vector<torch::Tensor> copy_of(const StageModel& m) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> out;
  for (const auto& [name, p] : m.named_parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

void WeightVersions::reset() {
  version_ = 0;
  snapshots_.clear();
  before_.clear();
  velocity_.clear();
  staleness_ = 0;
}

const std::vector<torch::Tensor>& WeightVersions::current(const StageModel& m) {
  auto it = snapshots_.find(version_);
  if (it != snapshots_.end()) return it->second;
  std::vector<torch::Tensor> snap = copy_of(m);
  if (staleness_ > 0 && velocity_.size() == snap.size()) {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < snap.size(); ++i) snap[i].add_(velocity_[i], staleness_);
  }
  return snapshots_.emplace(version_, std::move(snap)).first->second;
}

const std::vector<torch::Tensor>* WeightVersions::kept(uint64_t v) const {
  auto it = snapshots_.find(v);
  return it == snapshots_.end() ? nullptr : &it->second;
}

void WeightVersions::before_change(const StageModel& m, bool predict, double staleness) {
  version_++;
  velocity_.clear();
  before_.clear();
  if (predict) {
    staleness_ = staleness;
    before_ = copy_of(m);
  }
}

void WeightVersions::after_step(const StageModel& m) {
  if (before_.empty()) return;
  torch::NoGradGuard ng;
  size_t i = 0;
  for (const auto& [name, p] : m.named_parameters()) velocity_.push_back(p.detach() - before_[i++]);
  before_.clear();
}

void WeightVersions::drop_unused(const std::function<bool(uint64_t)>& used) {
  for (auto it = snapshots_.begin(); it != snapshots_.end();)
    it = it->first == version_ || used(it->first) ? std::next(it) : snapshots_.erase(it);
}

void SetAside::swap_in(const std::vector<torch::Tensor>& snapshot) {
  put_back();
  held_ = snapshot;
  model_.swap_weights(held_);
}

void SetAside::put_back() {
  if (!held_.empty()) model_.swap_weights(held_);
  held_.clear();
}

}  // namespace swarm
