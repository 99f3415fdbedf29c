// events.h: what happened to the swarm, as typed events: the dashboard's timeline, the status's
// `events`, and /api/events (server-sent events).
//
// Defines swarm::router::EventKind, Event and Events, a bounded ring the core keeps (the newest
// kKeep events; each has a sequence number from one counter, so a reader that kept the last
// number it saw asks for what came after it). Events are recorded by the core through
// Ctx::event, which also logs them; the core's clock is the time (`t_s`, seconds on the
// router's monotonic clock, as `router.uptime_s` in the status).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm::router {

enum class EventKind {
  kPeer,        // joined, ready on a stage, synced
  kFault,       // gone, unresponsive, banned, quarantined, a failed request, an injected fault
  kResend,      // a hop sent again after a failure or a deadline
  kRound,       // a DiLoCo round began or ended
  kMove,        // the rebalancer moved a peer
  kCheckpoint,  // written or failed
  kEval,        // a validation loss
  kJob,         // running, done, failed, cancelled
};
const char* event_kind_name(EventKind k);

struct Event {
  uint64_t seq = 0;
  double t_s = 0;
  EventKind kind = EventKind::kJob;
  uint64_t job = 0;        // 0: not about one job
  int stage = -1;          // -1: not about one stage
  std::string peer;        // the peer's name, "" for none
  std::string text;        // the log line
};
// {"seq", "t_s", "kind", "job", "stage", "peer", "text"} (job, stage, peer null when none).
nlohmann::json to_json(const Event& e);

class Events {
 public:
  static constexpr size_t kKeep = 1024;
  // Stamps the event with the next sequence number and keeps it (dropping the oldest past kKeep).
  void add(Event e);
  // The kept events after `seq`, oldest first, at most `max` of the newest.
  std::vector<Event> since(uint64_t seq, size_t max = kKeep) const;
  uint64_t last_seq() const { return next_ - 1; }
  size_t size() const { return kept_.size(); }

 private:
  std::deque<Event> kept_;
  uint64_t next_ = 1;
};

}  // namespace swarm::router
