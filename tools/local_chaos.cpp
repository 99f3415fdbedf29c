// local_chaos.cpp: LocalSwarm's chaos runner: a ChaosPlan (runtime/chaos_plan.h) played
// against the swarm's real stage server processes on a background thread (see local_swarm.h).
//
// The runner keeps a timeline of what is due: each event's next firing (times from
// chaos_fire_time, so jitter comes from the seed) and the follow-ups a firing schedules (SIGCONT
// after a timed stop, a restart after a kill). "random" picks among the peers the action fits
// (kill and stop: running peers; cont: stopped ones; restart: any) with chaos_pick, so the same
// plan against the same swarm makes the same choices.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <queue>

#include "runtime/errors.h"
#include "runtime/log.h"
#include "tools/local_swarm.h"

namespace swarm {

namespace {

// Something due on the timeline: firing k of event `event`, or a follow-up on one peer.
struct Due {
  enum Kind { kFire, kResume, kRestart } kind = kFire;
  double t = 0;        // seconds after the start
  uint64_t order = 0;  // ties keep the order they were scheduled in
  size_t event = 0;
  uint64_t k = 0;
  size_t peer = 0;     // follow-ups: the peer
  pid_t pid = -1;      // follow-ups: the process the first action hit (skip if it changed)
  bool operator>(const Due& o) const { return t != o.t ? t > o.t : order > o.order; }
};

std::string fmt_s(double t) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", t);
  return b;
}

}  // namespace

nlohmann::json to_json(const ChaosRecord& r) {
  return nlohmann::json{{"event", "chaos"}, {"t_s", r.t_s},  {"action", r.action},
                        {"peer", r.peer},   {"pid", int(r.pid)}, {"note", r.note}};
}

void LocalSwarm::set_stage_faults(const ChaosPlan& plan) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  stage_faults_ = plan;
}

bool LocalSwarm::running_locked(size_t i) {
  StageProc& p = stages_.at(i);
  if (p.pid <= 0) return false;
  if (waitpid(p.pid, nullptr, WNOHANG) == p.pid) {  // it died on its own (an injected crash)
    p.pid = -1;
    p.stopped = false;
    return false;
  }
  return !p.stopped;
}

void LocalSwarm::run_chaos(const ChaosPlan& plan, std::function<void(const ChaosRecord&)> on_event) {
  std::vector<std::string> names;
  {
    std::lock_guard<std::recursive_mutex> l(mu_);
    for (const auto& s : stages_) names.push_back(s.name);
  }
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  auto check = [&](const std::string& name, const std::string& where) {
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw InputError("chaos plan: " + where + " names peer \"" + name + "\", which this swarm does not have; its peers are: " + known);
  };
  for (size_t i = 0; i < plan.events.size(); ++i)
    if (plan.events[i].peer != "random") check(plan.events[i].peer, "events[" + std::to_string(i) + "]");
  for (const auto& f : plan.faults) check(f.first, "faults");
  stop_chaos();
  {
    std::lock_guard<std::mutex> l(chaos_mu_);
    chaos_stop_ = false;
    chaos_log_.clear();
  }
  chaos_ = std::thread(&LocalSwarm::chaos_loop, this, plan, std::move(on_event));
}

void LocalSwarm::stop_chaos() {
  {
    std::lock_guard<std::mutex> l(chaos_mu_);
    chaos_stop_ = true;
  }
  chaos_cv_.notify_all();
  if (chaos_.joinable()) chaos_.join();
}

std::vector<ChaosRecord> LocalSwarm::chaos_log() const {
  std::lock_guard<std::mutex> l(chaos_mu_);
  return chaos_log_;
}

void LocalSwarm::chaos_fire(const ChaosPlan& plan, size_t event, uint64_t k, ChaosRecord& rec) {
  const ChaosEvent& e = plan.events[event];
  rec.action = chaos_action_name(e.action);
  rec.note = "event " + std::to_string(event) + " #" + std::to_string(k);
  std::lock_guard<std::recursive_mutex> l(mu_);
  std::vector<size_t> fits;  // the peers this action fits, among those the event names
  for (size_t i = 0; i < stages_.size(); ++i) {
    const bool running = running_locked(i);
    const bool fit = e.action == ChaosAction::kKill || e.action == ChaosAction::kStop ? running
                     : e.action == ChaosAction::kCont ? stages_[i].pid > 0 && stages_[i].stopped
                                                      : true;
    if (fit && (e.peer == "random" || stages_[i].name == e.peer)) fits.push_back(i);
  }
  if (fits.empty()) {
    rec.peer = e.peer == "random" ? "" : e.peer;
    rec.note += e.peer == "random" ? "; skipped: no peer fits" : "; skipped: " + e.peer + " is not in a state to " + rec.action;
    return;
  }
  rec.index = e.peer == "random" ? fits[chaos_pick(plan.seed, event, k, fits.size())] : fits[0];
  rec.peer = stages_[rec.index].name;
  rec.pid = stages_[rec.index].pid;
  switch (e.action) {
    case ChaosAction::kKill: kill_stage(rec.index, SIGKILL); break;
    case ChaosAction::kStop: kill_stage(rec.index, SIGSTOP); break;
    case ChaosAction::kCont: kill_stage(rec.index, SIGCONT); break;
    case ChaosAction::kRestart:
      restart_stage(rec.index);
      rec.pid = stages_[rec.index].pid;
      break;
  }
}

void LocalSwarm::chaos_follow_up(bool resume, size_t peer, pid_t pid, ChaosRecord& rec) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  StageProc& p = stages_.at(peer);
  rec.index = peer;
  rec.peer = p.name;
  rec.action = resume ? "cont" : "restart";
  if (resume && p.pid == pid && p.stopped) {
    kill_stage(peer, SIGCONT);
    rec.pid = p.pid;
  } else if (!resume && p.pid <= 0) {
    restart_stage(peer);
    rec.pid = p.pid;
  } else {
    rec.note += "; skipped: the peer changed meanwhile";
  }
}

void LocalSwarm::chaos_loop(ChaosPlan plan, std::function<void(const ChaosRecord&)> on_event) {
  const auto t0 = std::chrono::steady_clock::now();
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due;
  uint64_t order = 0;
  auto schedule = [&](Due d) {
    d.order = order++;
    due.push(d);
  };
  for (size_t i = 0; i < plan.events.size(); ++i) schedule(Due{Due::kFire, chaos_fire_time(plan, i, 0), 0, i, 0});

  for (;;) {
    {
      std::unique_lock<std::mutex> l(chaos_mu_);
      if (due.empty()) {
        chaos_cv_.wait(l, [&] { return chaos_stop_; });
        return;
      }
      const auto when = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(due.top().t));
      if (chaos_cv_.wait_until(l, when, [&] { return chaos_stop_; })) return;
    }
    const Due d = due.top();
    due.pop();
    ChaosRecord rec;
    rec.at = std::chrono::steady_clock::now();
    rec.t_s = std::chrono::duration<double>(rec.at - t0).count();
    if (d.kind == Due::kFire) {
      const ChaosEvent& e = plan.events[d.event];
      if (e.periodic() && (e.count == 0 || d.k + 1 < e.count))
        schedule(Due{Due::kFire, chaos_fire_time(plan, d.event, d.k + 1), 0, d.event, d.k + 1});
      chaos_fire(plan, d.event, d.k, rec);
      if (rec.pid > 0 && e.action == ChaosAction::kStop && e.duration_s > 0)
        schedule(Due{Due::kResume, rec.t_s + e.duration_s, 0, d.event, d.k, rec.index, rec.pid});
      if (rec.pid > 0 && e.action == ChaosAction::kKill && e.restart_after_s > 0)
        schedule(Due{Due::kRestart, rec.t_s + e.restart_after_s, 0, d.event, d.k, rec.index, rec.pid});
    } else {
      rec.note = std::string(d.kind == Due::kResume ? "resume after stop" : "restart after kill") + " at event " +
                 std::to_string(d.event) + " #" + std::to_string(d.k);
      chaos_follow_up(d.kind == Due::kResume, d.peer, d.pid, rec);
    }
    log_info("chaos", "t=" + fmt_s(rec.t_s) + " s: " + rec.action + " " + (rec.peer.empty() ? "-" : rec.peer) +
                          (rec.pid > 0 ? " (pid " + std::to_string(rec.pid) + ")" : "") + " [" + rec.note + "]");
    {
      std::lock_guard<std::mutex> l(chaos_mu_);
      chaos_log_.push_back(rec);
    }
    if (on_event) on_event(rec);
  }
}

}  // namespace swarm
