// requests.cpp: implements router/requests.h.
#include "router/requests.h"

#include <algorithm>

namespace swarm::router {

const char* req_kind_name(ReqKind k) {
  switch (k) {
    case ReqKind::kHop: return "hop";
    case ReqKind::kLoad: return "load";
    case ReqKind::kStep: return "step";
    case ReqKind::kRoundBegin: return "round begin";
    case ReqKind::kRoundReduce: return "round reduce";
    case ReqKind::kRoundApply: return "round apply";
    case ReqKind::kStateRequest: return "state request";
    case ReqKind::kStateLoad: return "state load";
    case ReqKind::kSnapshot: return "snapshot";
    case ReqKind::kFetch: return "fetch";
  }
  return "?";
}

uint64_t Requests::add(Pending p) {
  const uint64_t id = next_++;
  p.id = id;
  deadlines_.emplace(p.deadline_s, id);
  uint32_t at;
  if (free_.empty()) {
    at = uint32_t(slab_.size());
    slab_.push_back(std::move(p));
  } else {
    at = free_.back();
    free_.pop_back();
    slab_[at] = std::move(p);
  }
  by_id_.emplace(id, at);
  return id;
}

const Pending* Requests::find(uint64_t id) const {
  const uint32_t* at = by_id_.find(id);
  return at ? &slab_[*at] : nullptr;
}

std::optional<Pending> Requests::take(uint64_t id) {
  const uint32_t* found = by_id_.find(id);
  if (!found) return std::nullopt;
  const uint32_t at = *found;
  by_id_.erase(id);
  Pending p = std::move(slab_[at]);
  free_.push_back(at);
  if (retired_.empty()) retired_.resize(kRetiredKept);
  Retired& r = retired_[id % kRetiredKept];
  r.id = id;
  r.peer = p.peer;
  // Answered requests' deadlines stay in the heap until they come up; once they outnumber the
  // live ones, the heap is rebuilt from the table (amortised O(1) per request).
  if (deadlines_.size() > 2 * by_id_.size() + 1024) {
    std::vector<Deadline> live;
    live.reserve(by_id_.size());
    for_each([&](uint64_t rid, const Pending& pd) { live.emplace_back(pd.deadline_s, rid); });
    deadlines_ = decltype(deadlines_)(std::greater<Deadline>(), std::move(live));
  }
  return p;
}

std::optional<PeerId> Requests::retired_to(uint64_t id) const {
  if (retired_.empty()) return std::nullopt;
  const Retired& r = retired_[id % kRetiredKept];
  if (r.id != id) return std::nullopt;
  return r.peer;
}

std::vector<uint64_t> Requests::expired(double now) {
  std::vector<uint64_t> out;
  while (!deadlines_.empty() && deadlines_.top().first < now) {
    const auto [t, id] = deadlines_.top();
    deadlines_.pop();
    const Pending* pd = find(id);
    if (pd && pd->deadline_s == t) out.push_back(id);
  }
  return out;
}

void Requests::postpone(uint64_t id, double deadline_s) {
  const uint32_t* at = by_id_.find(id);
  if (!at) return;
  slab_[*at].deadline_s = deadline_s;
  deadlines_.emplace(deadline_s, id);
}

std::vector<uint64_t> Requests::of_peer(const PeerId& peer) const {
  std::vector<uint64_t> out;
  for_each([&](uint64_t id, const Pending& p) {
    if (p.peer == peer) out.push_back(id);
  });
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<uint64_t> Requests::of_job(uint64_t job) const {
  std::vector<uint64_t> out;
  for_each([&](uint64_t id, const Pending& p) {
    if (p.job == job) out.push_back(id);
  });
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace swarm::router
