// events.cpp: the core's event ring (events.h), and Ctx::event, which records and logs one.
#include "router/events.h"

#include <algorithm>

#include "router/job.h"

namespace swarm::router {

const char* event_kind_name(EventKind k) {
  switch (k) {
    case EventKind::kPeer: return "peer";
    case EventKind::kFault: return "fault";
    case EventKind::kResend: return "resend";
    case EventKind::kRound: return "round";
    case EventKind::kMove: return "move";
    case EventKind::kCheckpoint: return "checkpoint";
    case EventKind::kEval: return "eval";
    case EventKind::kJob: return "job";
  }
  return "?";
}

nlohmann::json to_json(const Event& e) {
  return {{"seq", e.seq},
          {"t_s", e.t_s},
          {"kind", event_kind_name(e.kind)},
          {"job", e.job ? nlohmann::json(e.job) : nlohmann::json(nullptr)},
          {"stage", e.stage >= 0 ? nlohmann::json(e.stage) : nlohmann::json(nullptr)},
          {"peer", e.peer.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.peer)},
          {"text", e.text}};
}

void Events::add(Event e) {
  e.seq = next_++;
  kept_.push_back(std::move(e));
  if (kept_.size() > kKeep) kept_.pop_front();
}

std::vector<Event> Events::since(uint64_t seq, size_t max) const {
  // Sequence numbers are consecutive: the first one after `seq` is found by arithmetic.
  if (kept_.empty() || seq >= kept_.back().seq) return {};
  size_t from = seq < kept_.front().seq ? 0 : size_t(seq - kept_.front().seq + 1);
  from = std::max(from, kept_.size() > max ? kept_.size() - max : size_t(0));
  return std::vector<Event>(kept_.begin() + long(from), kept_.end());
}

void Ctx::event(EventKind kind, LogLevel level, std::string text, uint64_t job, const Peer* peer, int stage) {
  Event e;
  e.t_s = now;
  e.kind = kind;
  e.job = job;
  e.stage = stage;
  if (peer) e.peer = peer->hello.name;
  if (level != LogLevel::kDebug) out.push_back(Log{level, text, job, e.peer});
  e.text = std::move(text);
  events.add(std::move(e));
}

}  // namespace swarm::router
