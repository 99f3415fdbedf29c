// requests.cpp: implements router/requests.h.
#include "router/requests.h"

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
  deadlines_.erase({p.deadline_s, id});
  pending_.erase(it);
  retired_[id] = p.peer;
  if (retired_.size() > kRetiredKept) retired_.erase(retired_.begin());
  return p;
}

std::optional<PeerId> Requests::retired_to(uint64_t id) const {
  auto it = retired_.find(id);
  if (it == retired_.end()) return std::nullopt;
  return it->second;
}

std::vector<uint64_t> Requests::expired(double now) const {
  std::vector<uint64_t> out;
  for (const auto& [t, id] : deadlines_) {
    if (t >= now) break;
    out.push_back(id);
  }
  return out;
}

std::vector<uint64_t> Requests::of_peer(const PeerId& peer) const {
  std::vector<uint64_t> out;
  for (const auto& [id, p] : pending_)
    if (p.peer == peer) out.push_back(id);
  return out;
}

std::vector<uint64_t> Requests::of_job(uint64_t job) const {
  std::vector<uint64_t> out;
  for (const auto& [id, p] : pending_)
    if (p.job == job) out.push_back(id);
  return out;
}

}  // namespace swarm::router
