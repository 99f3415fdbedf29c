// durability.cpp: implements router/durability.h.
#include "router/durability.h"

#include <cmath>
#include <cstring>

#include "runtime/timing.h"

namespace swarm::router {

namespace {

// A stage's whole state on the wire: θ_g, momentum, θ and AdamW's two moments, fp32.
uint64_t state_bytes(int64_t params) { return 5 * 4 * uint64_t(params); }

// A flat fp32 parameter array of n values (the codec fp32: raw little-endian floats), all finite.
bool flat_values(const wire::Tensor& t, int64_t n, std::vector<float>* out) {
  if (t.desc.dtype != wire::DType::kF32 || t.desc.shape != wire::Shape{int64_t(n)} || t.desc.codec.codec != compression::Codec::kFp32)
    return false;
  out->resize(size_t(n));
  std::memcpy(out->data(), t.data.data(), size_t(n) * 4);
  for (float f : *out)
    if (!std::isfinite(f)) return false;
  return true;
}

}  // namespace

Durability::Durability(uint64_t job, const JobSpec& spec, std::vector<int64_t> stage_params)
    : checkpoint_dir(spec.checkpoint.dir), job_(job), spec_(spec), params_(std::move(stage_params)), snapshots_(params_.size()) {}

bool Durability::checkpoint_due(int steps_done, bool end) const {
  if (checkpoint_dir.empty() || last_checkpoint_step == steps_done) return false;
  const int every = spec_.checkpoint.every_steps;
  return end || (every > 0 && steps_done % every == 0);
}

bool Durability::snapshot_due(int steps_done, uint64_t rounds, bool dense) const {
  if (last_snapshot_step == steps_done) return false;
  int every = spec_.checkpoint.snapshot_every_steps;
  if (every == 0 && dense) every = spec_.diloco.inner_steps;
  if (every > 0) return steps_done - std::max(last_snapshot_step, 0) >= every;
  return rounds > snapshot_rounds;  // after every round: theta_g has just moved
}

void Durability::begin(Ctx& c, int step, bool checkpoint, bool at_barrier) {
  SWARM_CHECK(at_barrier || !checkpoint, "a checkpoint is taken at a barrier");
  collecting_ = true;
  checkpoint_ = checkpoint;
  at_barrier_ = at_barrier;
  step_ = step;
  waiting_.clear();
  // Every stage's state comes to the router at once, over its one link: the collection waits
  // diloco.deadline_s plus their transfer together, and so does each request in it. A request
  // given a hop's deadline passed it on a slow link while its state was still arriving, and the
  // state was thrown away on arrival (a 16 Mbit/s router link lost every snapshot: docs/hosts.md).
  uint64_t all_bytes = 0;
  for (int64_t n : params_) all_bytes += state_bytes(n);
  deadline_s_ = c.now + spec_.diloco.deadline_s + timing::transfer_allowance_s(double(all_bytes));
  for (int s = 0; s < int(params_.size()); ++s) {
    auto ps = c.peers.stage_peers(job_, s, c.now);
    if (ps.empty()) continue;
    // The peer that has served most: the least likely to be a newcomer mid-sync.
    Peer* d = *std::max_element(ps.begin(), ps.end(), [](Peer* a, Peer* b) { return a->results < b->results; });
    msg::StateRequest body;
    body.job_id = job_;
    body.full = true;
    Pending pd;
    pd.kind = ReqKind::kSnapshot;
    pd.job = job_;
    pd.stage = s;
    pd.peer = d->id;
    pd.reply_bytes = state_bytes(params_[size_t(s)]);   // its whole state
    // Ctx::request adds the allowance for this reply's own bytes.
    pd.deadline_s = deadline_s_ - timing::transfer_allowance_s(double(pd.reply_bytes));
    c.request(pd, msg::make(body));
    waiting_.insert(d->id);
  }
}

void Durability::on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  if (!collecting_ || !waiting_.erase(p.id)) return;
  const msg::StateReply r = msg::read<msg::StateReply>(m);
  const int64_t n = params_[size_t(pd.stage)];
  StageState st;
  st.stage = pd.stage;
  st.adam_step = r.adam_step.value_or(-1);
  st.loss_scale = r.loss_scale;
  st.loss_scale_good_steps = r.loss_scale_good_steps;
  bool ok = m.tensors.size() == 5 && st.adam_step >= 0;
  std::vector<float>* parts[] = {&st.theta_g, &st.momentum, &st.theta, &st.adam_m, &st.adam_v};
  for (size_t k = 0; ok && k < 5; ++k) ok = flat_values(m.tensors[k], n, parts[k]);
  for (size_t i = 0; ok && i < st.adam_v.size(); ++i) ok = st.adam_v[i] >= 0;  // second moments are never negative
  if (!ok) {
    c.warn("peer " + p.hello.name + " sent an unusable state for stage " + std::to_string(pd.stage) + "; keeping the previous snapshot");
    return;
  }
  Snapshot& snap = snapshots_[size_t(pd.stage)];
  snap.valid = true;
  snap.at_barrier = at_barrier_;
  snap.step = step_;
  snap.state = std::move(st);
}

bool Durability::advance(Ctx& c, const nlohmann::json& router_state, uint64_t next_microbatch, uint64_t rounds, const nlohmann::json& spec) {
  if (!collecting_) return true;
  // A peer still sending a large message (its state, on a slow link) is waited for past the deadline.
  if (!waiting_.empty() && (c.now < deadline_s_ || c.peers.any_sending(waiting_, c.now))) return false;
  for (const PeerId& id : waiting_) {
    const Peer* p = c.peers.find(id);
    c.warn("no snapshot from peer " + (p ? p->hello.name : id) + " in time; its stage keeps its previous one");
  }
  waiting_.clear();
  collecting_ = false;
  last_snapshot_step = step_;
  snapshot_rounds = rounds;
  if (!checkpoint_) return true;
  last_checkpoint_step = step_;
  // A checkpoint needs every stage as of this step; a stage that did not answer in time leaves
  // this one out (the previous checkpoint stays the newest).
  auto ck = std::make_shared<Checkpoint>();
  ck->step = step_;
  ck->next_microbatch = next_microbatch;
  ck->rounds = rounds;
  ck->spec = spec;
  ck->router = router_state;
  for (int s = 0; s < int(params_.size()); ++s) {
    const Snapshot& snap = snapshots_[size_t(s)];
    if (!snap.valid || snap.step != step_) {
      c.event(EventKind::kCheckpoint, LogLevel::kWarn,
              "checkpoint at step " + std::to_string(step_) + " skipped: no current state for stage " + std::to_string(s), job_, nullptr, s);
      return true;
    }
    ck->stages.push_back(snap.state);
  }
  writes_in_flight_++;
  c.out.push_back(WriteCheckpoint{job_, checkpoint_dir, std::move(ck), spec_.checkpoint.keep});
  return true;
}

void Durability::on_written(Ctx& c, const CheckpointWritten& r) {
  writes_in_flight_ = std::max(0, writes_in_flight_ - 1);
  if (!r.error.empty()) {
    failed_++;
    c.event(EventKind::kCheckpoint, LogLevel::kWarn, "checkpoint failed: " + r.error, job_);
    return;
  }
  written_++;
  write_seconds_.observe(r.write_s);
  last_ = r.path;
  c.event(EventKind::kCheckpoint, LogLevel::kInfo, "job " + std::to_string(job_) + ": checkpoint " + r.path, job_);
}

void Durability::restore(const Checkpoint& ck) {
  for (const auto& st : ck.stages) {
    Snapshot& snap = snapshots_.at(size_t(st.stage));
    snap.valid = true;
    snap.step = ck.step;
    snap.state = st;
  }
  last_snapshot_step = last_checkpoint_step = ck.step;
  snapshot_rounds = ck.rounds;
}

void Durability::write_progress(Ctx& c, int step, uint64_t taken, uint64_t completed) {
  if (checkpoint_dir.empty() || c.now - last_progress_s_ < 0.02) return;
  last_progress_s_ = c.now;
  c.out.push_back(WriteFile{checkpoint_dir + "/progress.json",
                            nlohmann::json{{"step", step}, {"taken", taken}, {"completed", completed}}.dump() + "\n"});
}

void Durability::write_record(Ctx& c, uint64_t id, JobState state, const std::string& reason, const nlohmann::json& spec) const {
  if (job_dir.empty()) return;
  c.out.push_back(WriteFile{job_dir + "/job.json", nlohmann::json{{"id", id}, {"state", job_state_name(state)}, {"reason", reason},
                                                                  {"checkpoint_dir", checkpoint_dir}, {"spec", spec}}
                                                       .dump(2) + "\n"});
}

nlohmann::json Durability::status() const { return {{"dir", checkpoint_dir}, {"written", written_}, {"last", last_}}; }

}  // namespace swarm::router
