// stage_faults.cpp: the stage server's side of the fault injector (see stage_faults.h).
#include "stages/stage_faults.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <thread>

#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/wire.h"

namespace swarm {

using wire::MsgType;

namespace {

// Requests are what the router asks of us; session messages keep the connection alive.
bool is_request(int t) {
  switch (MsgType(t)) {
    case MsgType::kHello:
    case MsgType::kWelcome:
    case MsgType::kHeartbeat:
    case MsgType::kBye:
    case MsgType::kError:
    case MsgType::kChaos:
    case MsgType::kChaosReply:
    case MsgType::kRelease:
    case MsgType::kPush: return false;  // a notice, not a request: it expects no reply
    default: return true;
  }
}

Frames shared_copy(Frames& f) {
  Frames c(f.size());
  for (size_t i = 0; i < f.size(); ++i) c[i].copy(f[i]);  // shares the payload buffers
  return c;
}

[[noreturn]] void crash(const std::string& spec) {
  log_error("fault", "crashing: " + spec + " raises SIGKILL on this process");
  std::raise(SIGKILL);
  std::abort();  // not reached
}

}  // namespace

StageFaults::StageFaults(const std::vector<FaultSpec>& faults, uint64_t seed, const std::atomic<uint64_t>& steps,
                         const std::atomic<bool>& stop)
    : inj_(seed), steps_(steps), stop_(stop) {
  std::string list;
  for (const FaultSpec& f : faults) {
    inj_.add(f);
    list += (list.empty() ? "" : "; ") + to_string(f);
  }
  if (!faults.empty()) log_warn("fault", "faults armed (seed " + std::to_string(seed) + "): " + list);
}

FaultContext StageFaults::context(uint64_t requests, int msg_type, bool has_output) const {
  FaultContext c;
  c.requests = requests;
  c.step = steps_.load();
  c.msg_type = msg_type;
  c.has_output = has_output;
  return c;
}

std::optional<double> StageFaults::partition_healed() {
  if (partitioned()) {
    if (!was_partitioned_) partition_began_ = Clock::now();
    was_partitioned_ = true;
    return std::nullopt;
  }
  if (!was_partitioned_) return std::nullopt;
  was_partitioned_ = false;
  const double s = std::chrono::duration<double>(Clock::now() - partition_began_).count();
  log_warn("fault", "partition over after " + std::to_string(s) + " s: traffic flows again");
  return s;
}

bool StageFaults::wait_while_frozen() {
  if (!frozen()) return false;
  const auto t0 = Clock::now();
  while (!stop_ && frozen()) {
    const double left_s = inj_.frozen_until() - inj_.now();
    std::this_thread::sleep_for(std::chrono::duration<double>(std::clamp(left_s, 0.001, 0.05)));
  }
  log_debug("fault", "thawed after " + std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) + " s");
  return true;
}

std::vector<Frames> StageFaults::apply(const std::vector<FaultHit>& hits, Frames frames, uint64_t seq,
                                       std::deque<Delayed>& later) {
  bool drop = false, duplicate = false;
  double delay_ms = 0;
  for (const FaultHit& h : hits) {
    switch (h.action) {
      case FaultAction::kCrash: crash(h.spec);
      case FaultAction::kDrop: drop = true; break;
      case FaultAction::kCorrupt: corrupt_frames(frames, h.random); break;
      case FaultAction::kDuplicate: duplicate = true; break;
      case FaultAction::kDelay: delay_ms = std::max(delay_ms, h.delay_ms); break;
      default: break;  // freeze, zombie, partition: states the injector keeps
    }
  }
  std::vector<Frames> copies;
  if (drop) return copies;
  if (duplicate) copies.push_back(shared_copy(frames));
  copies.push_back(std::move(frames));
  if (delay_ms <= 0) return copies;
  const auto due = Clock::now() + std::chrono::microseconds(int64_t(delay_ms * 1000));
  for (auto& c : copies) later.push_back(Delayed{due, Delivery{std::move(c), seq}});
  return {};
}

bool StageFaults::incoming(Frames frames, std::vector<Delivery>& out) {
  if (partitioned()) return false;
  const std::optional<int> type = peek_type(frames);
  const bool request = type && is_request(*type);
  const uint64_t seq = request ? ++requests_ : 0;
  if (!request || !armed()) {
    out.push_back(Delivery{std::move(frames), seq});
    return true;
  }
  const auto hits = inj_.check(FaultPoint::kAfterRecv, context(seq, *type));
  if (partitioned()) return false;  // it started a partition: lost with the rest
  if (inj_.zombie()) return true;   // received, never answered
  for (auto& f : apply(hits, std::move(frames), seq, later_in_)) out.push_back(Delivery{std::move(f), seq});
  return true;
}

std::vector<Frames> StageFaults::outgoing(Frames frames) {
  std::vector<Frames> out;
  if (!armed()) {
    out.push_back(std::move(frames));
    return out;
  }
  if (partitioned() || inj_.zombie()) return out;
  const auto hits = inj_.check(FaultPoint::kBeforeSend, context(requests_, peek_type(frames).value_or(0)));
  if (partitioned() || inj_.zombie()) return out;
  return apply(hits, std::move(frames), 0, later_out_);
}

std::vector<Frames> StageFaults::heartbeat(Frames frames) {
  std::vector<Frames> out;
  if (!armed()) {
    out.push_back(std::move(frames));
    return out;
  }
  if (partitioned()) return out;
  const auto hits = inj_.check(FaultPoint::kHeartbeat, context(requests_, int(MsgType::kHeartbeat)));
  if (partitioned()) return out;
  return apply(hits, std::move(frames), 0, later_out_);
}

std::vector<StageFaults::Delivery> StageFaults::due_incoming() {
  std::vector<Delivery> out;
  const auto now = Clock::now();
  for (auto it = later_in_.begin(); it != later_in_.end();) {
    if (it->due > now) {
      ++it;
      continue;
    }
    if (!partitioned() && !inj_.zombie()) out.push_back(std::move(it->d));
    it = later_in_.erase(it);
  }
  return out;
}

std::vector<Frames> StageFaults::due_outgoing() {
  std::vector<Frames> out;
  const auto now = Clock::now();
  for (auto it = later_out_.begin(); it != later_out_.end();) {
    if (it->due > now) {
      ++it;
      continue;
    }
    if (!partitioned()) out.push_back(std::move(it->d.frames));
    it = later_out_.erase(it);
  }
  return out;
}

int StageFaults::poll_ms(int ms) const {
  const auto now = Clock::now();
  for (const auto* q : {&later_in_, &later_out_}) {
    for (const Delayed& d : *q) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d.due - now).count();
      ms = std::min<int>(ms, int(std::max<int64_t>(1, left)));
    }
  }
  return ms;
}

void StageFaults::add_live(const nlohmann::json& fault) {
  const FaultSpec s = parse_fault_json(fault);
  inj_.add(s, requests_);
  log_warn("fault", "fault added by the router: " + to_string(s));
}

StageFaults::Compute StageFaults::compute_effects(const std::vector<FaultHit>& hits) {
  Compute c;
  for (const FaultHit& h : hits) {
    if (h.action == FaultAction::kCrash) crash(h.spec);
    if (h.action == FaultAction::kSlow) c.slow *= h.factor;
    if (h.action == FaultAction::kNan) c.nan = true;
    if (h.action == FaultAction::kOverflow) c.overflow = true;
    if (h.action == FaultAction::kLie) c.lie = true;
  }
  return c;
}

StageFaults::Compute StageFaults::before_compute(int msg_type, uint64_t seq, bool has_output) {
  if (!armed()) return Compute{};
  const Compute c = compute_effects(inj_.check(FaultPoint::kBeforeCompute, context(seq, msg_type, has_output)));
  wait_while_frozen();
  return c;
}

StageFaults::Compute StageFaults::after_compute(int msg_type, uint64_t seq, bool has_output) {
  if (!armed()) return Compute{};
  const Compute c = compute_effects(inj_.check(FaultPoint::kAfterCompute, context(seq, msg_type, has_output)));
  wait_while_frozen();
  return c;
}

}  // namespace swarm
