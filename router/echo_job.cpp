// echo_job.cpp: implements router/echo_job.h.
#include "router/echo_job.h"

#include <cstring>

namespace swarm::router {

namespace {

FlightConfig echo_config(uint64_t id) {
  FlightConfig f;
  f.job = id;
  f.stages = 1;
  f.echo = true;
  return f;
}

}  // namespace

EchoJob::EchoJob(uint64_t id, const msg::BenchTransport& t) : Job(id, "transport benchmark"), bench_(t), flights_(echo_config(id)) {
  const int64_t n = t.bytes / 4;
  payload_ = wire::make_tensor(wire::DType::kF32, {n}, compression::CodecSpec{}, size_t(n) * 4);
  std::memset(payload_.data.data(), 0x3c, size_t(n) * 4);
  wire::seal(payload_);
}

void EchoJob::load(Ctx& c, Peer& p) {
  c.peers.place(p, id_, 0);
  c.peers.set_state(p, PeerState::kLoading);
  msg::LoadStage body;
  body.job_id = id_;
  body.stage = 0;
  body.spec = nlohmann::json::object();
  Pending pd;
  pd.kind = ReqKind::kLoad;
  pd.job = id_;
  pd.stage = 0;
  pd.peer = p.id;
  pd.deadline_s = c.now + 120;
  c.request(pd, msg::make(body));
}

void EchoJob::start(Ctx& c) {
  state_ = JobState::kLoading;
  run_started_s_ = c.now;
  for (auto& [id, p] : c.peers.all()) {
    c.peers.place(p, 0, -1);
    c.peers.set_state(p, PeerState::kIdle);
    if (wants(p)) load(c, p);
  }
}

void EchoJob::offer(Ctx& c, Peer& p) {
  if (wants(p) && p.state == PeerState::kIdle && !c.peers.banned(p, c.now)) load(c, p);
}

void EchoJob::on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  if (pd.kind == ReqKind::kLoad) {
    (void)msg::read<msg::StageReady>(m);
    if (p.state == PeerState::kLoading) c.peers.set_state(p, PeerState::kReady);
    return;
  }
  if (pd.kind != ReqKind::kHop) return;
  const HopOutcome o = flights_.on_result(c, p, pd, m);
  if (o.what == HopOutcome::kCompleted) done_++;
  if (!o.exhausted.empty()) finish(c, JobState::kFailed, o.exhausted);
}

void EchoJob::on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) {
  if (pd.kind == ReqKind::kLoad) {
    if (Peer* p = c.peers.find(pd.peer); p && p->state == PeerState::kLoading) c.peers.set_state(*p, PeerState::kIdle);
    return;
  }
  if (pd.kind == ReqKind::kHop && flights_.on_failed(c, pd, error, -1, why).exhausted)
    finish(c, JobState::kFailed, "a benchmark payload failed " + std::to_string(flights_.config().max_attempts) + " times (last: " + why + ")");
}

void EchoJob::advance(Ctx& c) {
  if (!active()) return;
  bool ready = false;
  for (const Peer* p : c.peers.stage_peers(id_, 0, c.now)) ready |= p != nullptr;
  if (state_ == JobState::kLoading) {
    if (!ready) {
      reason_ = "waiting for an echo peer (swarm-stage --echo)";
      return;
    }
    state_ = JobState::kRunning;
    reason_.clear();
  }
  if (done_ >= bench_.count) return finish(c, JobState::kDone, "");
  if (taken_ == 0) run_started_s_ = c.now;
  while (flights_.size() < size_t(bench_.inflight) && taken_ < bench_.count) {
    Flight f;
    f.index = uint64_t(taken_);
    Flight& in = flights_.add(uint64_t(taken_), std::move(f));
    in.at[0].input.set(wire::share(payload_));
    taken_++;
  }
  flights_.dispatch(c);
}

void EchoJob::finish(Ctx& c, JobState st, const std::string& reason) {
  Job::finish(c, st, reason);
  flights_.clear(c);
}

nlohmann::json EchoJob::status(const Registry& peers, double now) const {
  const double elapsed = (job_finished(state_) ? finished_s_ : now) - run_started_s_;
  return {{"job_id", id_},
          {"name", name_},
          {"state", job_state_name(state_)},
          {"reason", reason_},
          {"microbatches", {{"taken", taken_}, {"completed", done_}, {"resent", flights_.resent}, {"lost", state_ == JobState::kDone ? taken_ - done_ : 0}}},
          {"bench", {{"bytes", bench_.bytes}, {"done", done_}, {"count", bench_.count}, {"seconds", elapsed},
                     {"bytes_per_s", elapsed > 0 ? double(done_) * double(bench_.bytes) / elapsed : 0.0}}}};
}

void EchoJob::metrics(JobMetrics& m, const Registry& peers, double now) const {
  Job::metrics(m, peers, now);
  m.kind = "transport";
  m.taken = uint64_t(taken_);
  m.completed = uint64_t(done_);
  m.resent = flights_.resent;
  m.rejected = flights_.rejected;
  m.lost = state_ == JobState::kDone ? uint64_t(taken_ - done_) : 0;
  m.hops = flights_.hop_metrics;
}

void EchoJob::check(const Requests& r) const {
  flights_.check(r);
  SWARM_CHECK(!active() || flights_.size() <= size_t(bench_.inflight), "more payloads in flight than the benchmark's inflight");
}

}  // namespace swarm::router
