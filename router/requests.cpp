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
  pending_.emplace(id, std::move(p));
  return id;
}

const Pending* Requests::find(uint64_t id) const {
  auto it = pending_.find(id);
  return it == pending_.end() ? nullptr : &it->second;
}

std::optional<Pending> Requests::take(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return std::nullopt;
  Pending p = std::move(it->second);
  pending_.erase(it);
  if (retired_.empty()) retired_.resize(kRetiredKept);
  Retired& r = retired_[id % kRetiredKept];
  r.id = id;
  r.peer = p.peer;
  // Answered requests' deadlines stay in the heap until they come up; once they outnumber the
  // live ones, the heap is rebuilt from the table (amortised O(1) per request).
  if (deadlines_.size() > 2 * pending_.size() + 1024) {
    std::vector<Deadline> live;
    live.reserve(pending_.size());
    for (const auto& [rid, pd] : pending_) live.emplace_back(pd.deadline_s, rid);
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
    auto it = pending_.find(id);
    if (it != pending_.end() && it->second.deadline_s == t) out.push_back(id);
  }
  return out;
}

std::vector<uint64_t> Requests::of_peer(const PeerId& peer) const {
  std::vector<uint64_t> out;
  for (const auto& [id, p] : pending_)
    if (p.peer == peer) out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<uint64_t> Requests::of_job(uint64_t job) const {
  std::vector<uint64_t> out;
  for (const auto& [id, p] : pending_)
    if (p.job == job) out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace swarm::router
