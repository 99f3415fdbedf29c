// training_job.cpp: the training job's loop (router/training_job.h): taking microbatches,
// barriers, steps, rounds, evaluations, snapshots and the end.
#include "router/training_job.h"

#include <cmath>
#include <cstdio>

#include "runtime/memory_estimate.h"

namespace swarm::router {

namespace {

constexpr size_t kMaxHistory = 65536;   // entries the job keeps; a status carries the newest 4096

FlightConfig flight_config(uint64_t id, const JobSpec& s, std::function<wire::Tensor(uint64_t, bool, bool)> tokens) {
  FlightConfig f;
  f.tokens = std::move(tokens);
  f.job = id;
  f.stages = s.partition.stages;
  f.B = s.batch.microbatch_size;
  f.T = s.model.seq_len;
  f.d_model = s.model.d_model;
  f.act_codec = compression::parse_codec(s.compression.activations);
  f.grad_codec = compression::parse_codec(s.compression.gradients);
  // The subspace codec travels bound to the model (dim, the ids' width), as the stages send it.
  if (const auto sub = compression::subspace_job(s.compression.activations, s.compression.gradients, s.compression.outer,
                                                 s.model.d_model, s.model.vocab_size)) {
    if (sub->activations) f.act_codec = *sub->activations;
    if (sub->gradients) f.grad_codec = *sub->gradients;
  }
  f.forward_cap_s = s.timeouts.forward_s;
  f.backward_cap_s = s.timeouts.backward_s;
  f.max_attempts = s.timeouts.max_attempts;
  f.mode = s.routing.mode;
  f.p2p = s.routing.hops == Hops::kP2p;
  // A fixed pipeline has no other peer to send a hop to: the bound would only delay it.
  f.max_queued_s = s.routing.mode == RoutingMode::kStatic ? 0 : s.routing.max_queued_s;
  if (s.schedule == Schedule::kAsync) f.closes_steps_of = s.microbatches_per_step();
  return f;
}

nlohmann::json number_or_null(double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); }

}  // namespace

TrainingJob::TrainingJob(uint64_t id, JobSpec spec)
    : Job(id, spec.name),
      spec_(std::move(spec)),
      spec_json_(to_json(spec_)),
      S_(spec_.partition.stages),
      M_(spec_.microbatches_per_step()),
      stage_params_(stage_parameter_counts(spec_)),
      stage_cost_(stage_costs_from_params(stage_params_)),
      stage_need_(stage_needs(spec_)),
      total_mbs_(uint64_t(spec_.steps) * uint64_t(M_)),
      flights_(flight_config(id, spec_, [this](uint64_t index, bool eval, bool targets) { return tokens(index, eval, targets); })),
      rounds_(id, spec_, stage_params_),
      dur_(id, spec_, stage_params_),
      rng_(spec_.seed) {}

void TrainingJob::loaded(Ctx& c, const JobLoaded& r) {
  data_ = r.data;
  unigram_ = data_->unigram_loss();
  started_s_ = c.now;
  for (const auto& sk : r.skipped) c.warn("skipped checkpoint: " + sk);
  if (!r.checkpoint) return;
  const Checkpoint& ck = r.checkpoint->ckpt;
  steps_done_ = ck.step;
  taken_ = completed_ = resumed_at_ = ck.next_microbatch;
  rounds_.restore(ck.rounds, ck.step);
  dur_.restore(ck);
  const nlohmann::json& st = ck.router;
  if (st.is_object()) {
    if (st.contains("history") && st["history"].is_array())
      for (const auto& h : st["history"]) history(h);
    if (st.contains("last_eval_step") && st["last_eval_step"].is_number_integer()) last_eval_step_ = st["last_eval_step"].get<int>();
    if (st.contains("train_loss") && st["train_loss"].is_number()) train_loss_ = st["train_loss"].get<double>();
    if (st.contains("val_loss") && st["val_loss"].is_number()) val_loss_ = st["val_loss"].get<double>();
    if (st.contains("microbatches") && st["microbatches"].is_object()) {
      const nlohmann::json& mb = st["microbatches"];
      auto count = [&](const char* k) { return mb.contains(k) && mb[k].is_number_unsigned() ? mb[k].get<uint64_t>() : uint64_t(0); };
      resent_before_ = count("resent");
      duplicates_before_ = count("duplicates");
      rejected_before_ = count("rejected");
    }
  }
  resumed_ = {{"checkpoint", r.checkpoint->path}, {"step", ck.step}, {"skipped", r.checkpoint->skipped}, {"microbatches_redone", r.redone}};
  c.info("job " + std::to_string(id_) + " resumes from " + r.checkpoint->path + " at step " + std::to_string(ck.step) + " (" +
         std::to_string(r.redone) + " microbatch(es) taken after it are done again)");
}

void TrainingJob::history(nlohmann::json entry) {
  history_.push_back(std::move(entry));
  if (history_.size() > kMaxHistory) history_.pop_front();
}

void TrainingJob::start(Ctx& c) {
  state_ = JobState::kLoading;
  run_started_s_ = c.now;
  // Stage servers left on another job (finished) are free again. Peers that pinned a stage
  // first, then those that prefer one, then the rest where place_peer puts them.
  for (auto& [id, p] : c.peers.all()) {
    c.peers.place(p, 0, -1);
    c.peers.set_state(p, PeerState::kIdle);
    p.integrity_failures = 0;
  }
  // The rest most memory first, then fastest (placement_order): the heaviest stages go to the
  // biggest devices.
  auto pass_of = [](const Peer& p) { return p.hello.stage >= 0 ? 0 : p.hello.prefer_stage >= 0 ? 1 : 2; };
  StartView sv;
  sv.reg = placement_view(c.peers, c.now, &sv.seq);
  for (int pass = 0; pass < 2; ++pass)
    for (auto& [id, p] : c.peers.all())
      if (pass_of(p) == pass && wants(p)) assign(c, p, &sv);
  std::vector<Peer*> rest;
  std::vector<PeerView> views;
  for (auto& [id, p] : c.peers.all())
    if (pass_of(p) == 2 && wants(p)) {
      rest.push_back(&p);
      views.push_back(view_of(p));
    }
  for (size_t i : placement_order(views)) assign(c, *rest[i], &sv);
  c.info("job " + std::to_string(id_) + " starting: " + std::to_string(S_) + " stage(s), " + std::to_string(c.peers.size()) + " peer(s)");
}

void TrainingJob::offer(Ctx& c, Peer& p) {
  // A quarantine outlives the session: a peer that says HELLO again is still held out (in a
  // CURVE swarm by its key, which its routing id derives from).
  if (p.state == PeerState::kIdle && quarantined_ids_.count(p.key.empty() ? p.id : p.key)) {
    c.peers.set_state(p, PeerState::kQuarantined);
    c.warn("peer " + p.hello.name + " came back but stays quarantined for job " + std::to_string(id_));
    return;
  }
  if (wants(p) && p.state == PeerState::kIdle && !c.peers.banned(p, c.now)) assign(c, p);
}

void TrainingJob::on_peer_gone(Ctx& c, const Peer& p) {
  step_waiting_.erase(p.id);
  flights_.on_peer_gone(p.id);
  rounds_.forget(p);
}

std::string TrainingJob::empty_stages(Ctx& c) const {
  std::string s;
  if (c.peers.ready_stages(id_) == size_t(S_)) return s;
  for (int st = 0; st < S_; ++st)
    if (!c.peers.any_ready(id_, st)) s += (s.empty() ? "" : ", ") + std::to_string(st);
  return s;
}

void TrainingJob::on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  switch (pd.kind) {
    case ReqKind::kHop: return hop_result(c, p, pd, m);
    case ReqKind::kLoad: return on_loaded(c, p, m);
    case ReqKind::kStep:
      (void)msg::read<msg::Result>(m);
      step_waiting_.erase(p.id);
      return;
    case ReqKind::kRoundBegin:
    case ReqKind::kRoundReduce:
    case ReqKind::kRoundApply: return rounds_.on_reply(c, p, pd, m);
    case ReqKind::kStateRequest: return on_state_reply(c, p, pd, m);
    case ReqKind::kStateLoad: {
      if (!pd.holder.empty()) c.release(pd.holder, pd.key);
      const msg::RoundDone r = msg::read<msg::RoundDone>(m);
      if (p.state != PeerState::kSyncing) return;
      if (!pd.donor.empty() && (rounds_.open() || rounds_.count() != pd.round)) {
        // A round began after the donor's state was taken: that state missed its apply.
        c.info("peer " + p.hello.name + " synced stage " + std::to_string(p.stage) + " from " + pd.target +
               " before round " + std::to_string(rounds_.count()) + " was applied; syncing it again");
        return start_sync(c, p);
      }
      c.peers.set_state(p, PeerState::kReady);
      rounds_.samples().forget(p.id);
      rounds_.note_hash(p, r.hash);
      c.event(EventKind::kPeer, LogLevel::kInfo,
              "peer " + p.hello.name + " synced stage " + std::to_string(p.stage) + (pd.target.empty() ? " from a donor" : " from " + pd.target), id_,
              &p, p.stage);
      return;
    }
    case ReqKind::kSnapshot: return dur_.on_reply(c, p, pd, m);
    case ReqKind::kFetch: {
      const HopOutcome o = flights_.on_uploaded(c, p, pd, m);
      if (!o.blame.empty()) integrity_failure(c, o.blame, o.why);
      return;
    }
  }
}

void TrainingJob::on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) {
  Peer* p = c.peers.find(pd.peer);
  switch (pd.kind) {
    case ReqKind::kHop: {
      const HopFailure f = flights_.on_failed(c, pd, error, bad_tensor, why);
      if (!f.blame.empty()) integrity_failure(c, f.blame, f.why);
      if (f.exhausted) finish(c, JobState::kFailed, f.why);
      return;
    }
    case ReqKind::kLoad:
      // Idle again, and offered the job again when the ban ends.
      if (p && p->state == PeerState::kLoading) {
        c.peers.set_state(*p, PeerState::kIdle);
        if (!error) c.peers.ban(*p, c.now);
      }
      return;
    case ReqKind::kStep: step_waiting_.erase(pd.peer); return;
    case ReqKind::kRoundBegin:
    case ReqKind::kRoundReduce:
    case ReqKind::kRoundApply: return rounds_.on_failed(c, pd);
    case ReqKind::kStateRequest:
      // Another donor for the waiting peer.
      if (Peer* t = c.peers.find(pd.target); t && t->state == PeerState::kSyncing) start_sync(c, *t);
      return;
    case ReqKind::kStateLoad:
      if (!pd.holder.empty()) c.release(pd.holder, pd.key);
      // The joiner found the donor's state bad (a size, a non-finite value, a negative second
      // moment): the donor is to blame, and another one is asked.
      if (error && bad_tensor >= 0 && !pd.donor.empty())
        if (Peer* d = c.peers.find(pd.donor)) {
          c.peers.ban(*d, c.now);
          integrity_failure(c, d->id, "served a stage state that failed a joiner's checks (tensor " + std::to_string(bad_tensor) + ")");
        }
      // The copy did not land: another donor, or the snapshot.
      if (p && p->state == PeerState::kSyncing) start_sync(c, *p);
      return;
    case ReqKind::kSnapshot: dur_.on_failed(pd); return;
    case ReqKind::kFetch: flights_.on_upload_failed(c, pd); return;
  }
}

void TrainingJob::on_fetch_failed(Ctx& c, const Pending& pd, int slot, FetchMiss miss, const std::string& why) {
  if (pd.kind == ReqKind::kRoundReduce || pd.kind == ReqKind::kRoundApply) return rounds_.on_fetch_failed(c, pd, slot);
  if (pd.kind != ReqKind::kHop) return on_failed(c, pd, false, -1, why);
  const HopFailure f = flights_.on_fetch_failed(c, pd, slot, miss, why);
  if (!f.blame.empty()) integrity_failure(c, f.blame, f.why);
  if (f.exhausted) finish(c, JobState::kFailed, f.why);
}

void TrainingJob::hop_result(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  const HopOutcome o = flights_.on_result(c, p, pd, m);
  if (!o.blame.empty()) integrity_failure(c, o.blame, o.why);
  if (o.what == HopOutcome::kRejected) {
    p.failures++;
    if (!o.exhausted.empty()) return finish(c, JobState::kFailed, o.exhausted);
    c.warn("peer " + p.hello.name + " " + o.why + "; re-sending microbatch " + std::to_string(o.index));
    return;
  }
  for (size_t k = 0; k < o.codec_us.size() && k < 4; ++k) codec_us_[k] += o.codec_us[k];
  step_overflow_ |= o.overflow;
  if (o.trained_stage >= 0) rounds_.samples().trained(p.id, spec_.diloco.fragments, spec_.batch.microbatch_size);
  if (o.what == HopOutcome::kEvalDone) {
    eval_sum_ += *o.loss;
    eval_count_++;
    return;
  }
  if (o.loss) record_loss(c, o.index, *o.loss);
  if (o.what == HopOutcome::kCompleted) {
    completed_++;
    train_tokens_ += int64_t(spec_.batch.microbatch_size) * spec_.model.seq_len;
    steps_done_ = int(completed_ / uint64_t(M_));
  }
}

void TrainingJob::record_loss(Ctx& c, uint64_t index, double loss) {
  const uint64_t step = index / uint64_t(M_);
  auto& [sum, n] = step_loss_[step];
  sum += loss;
  n++;
  if (n < M_) return;
  train_loss_ = sum / n;
  const double elapsed = c.now - run_started_s_;
  history({{"step", step + 1}, {"train_loss", train_loss_}, {"tokens_per_s", elapsed > 0 ? double(train_tokens_) / elapsed : 0.0}});
  step_loss_.erase(step);
}

wire::Tensor TrainingJob::tokens(uint64_t index, bool eval, bool targets) const {
  SWARM_CHECK(data_ != nullptr, "tokens asked of a job without its data");
  // u16: every token id fits (TokenData), half the bytes of i32 on the router's link; every
  // stage server takes either.
  return microbatch_tensor(*data_, spec_.seed, index, eval, targets, spec_.batch.microbatch_size, spec_.model.seq_len);
}

void TrainingJob::take(Ctx& c, uint64_t index, bool eval) {
  Flight f;
  f.index = index;
  f.eval = eval;
  f.kind = eval ? HopKind::kEval : (S_ == 1 ? HopKind::kForwardLoss : HopKind::kForward);
  flights_.add(eval ? (kEvalBit | index) : index, std::move(f));
  if (eval) return;
  taken_++;
  dur_.write_progress(c, steps_done_, taken_, completed_);
}

uint64_t TrainingJob::next_barrier_mb() const {
  const uint64_t M = uint64_t(M_);
  // A flush before every step under sync, and before every dense step (the warm start) under any
  // schedule: the group sums the gradients of exactly that step.
  if (spec_.schedule == Schedule::kSync || dense_step(spec_, steps_done_ + 1)) return std::min(total_mbs_, (uint64_t(steps_done_) + 1) * M);
  auto multiple = [](int s, int every) { return every > 0 && s % every == 0; };
  // A DiLoCo round that runs alongside training (roll_round) needs no barrier.
  const bool round_barriers = !rolling_rounds();
  for (int s = steps_done_ + 1; s < spec_.steps; ++s) {
    if ((round_barriers && (delta_round_due(spec_, s, rounds_.last_step(), false) >= 0 || (rounds_.open() && s >= rounds_.apply_step()))) ||
        multiple(s, spec_.eval.every_steps) || multiple(s, spec_.checkpoint.every_steps) ||
        multiple(s, spec_.checkpoint.snapshot_every_steps))
      return std::min(total_mbs_, uint64_t(s) * M);
  }
  return total_mbs_;
}

int TrainingJob::steps_complete() const {
  uint64_t first = taken_;
  if (!flights_.empty()) first = std::min(first, flights_.all().begin()->first);
  return int(first / uint64_t(M_));
}

// A DiLoCo round alongside training (diloco.rounds; never under sync) does not drain the
// pipeline: it opens once every microbatch of its step has completed, while later ones go on; each peer sends its outer
// gradient when the ROUND_BEGIN reaches it, between two hops, and applies the group's mean when
// the ROUND_APPLY does, keeping what it learned in between (as an overlapped round does). A
// microbatch whose forward ran before the apply takes its backward on the weights of its forward
// (weight versions), and its gradient lands on the new ones: one more stale gradient, which
// these schedules take at every step anyway. Rounds at a barrier (an evaluation, a checkpoint, the
// end) are applied there, as before.
void TrainingJob::roll_round(Ctx& c) {
  if (rounds_.open()) return;
  const int done = std::min(steps_complete(), spec_.steps - 1);   // the end's round is the end barrier's
  for (int t = std::max(rolled_to_, rounds_.last_step()) + 1; t <= done; ++t) {
    rolled_to_ = t;
    const int f = delta_round_due(spec_, t, rounds_.last_step(), false);
    if (f < 0) continue;
    RoundPlan plan;
    plan.action = RoundPlan::kOpen;
    plan.what = msg::RoundWhat::kDelta;
    plan.fragment = f;
    plan.overlapped = true;
    rounds_.begin(c, plan, t);
    history({{"step", t}, {"round", rounds_.count()}, {"fragment", f}});
    return;
  }
}

// A round alongside training may run late (slow links, a late peer), but training never gets
// a whole round ahead of it: while one is open, no microbatch past the next round's step is taken.
uint64_t TrainingJob::round_limit_mb() {
  if (!rolling_rounds() || !rounds_.open()) return total_mbs_;
  const int last = rounds_.last_step();
  if (limit_.first == last) return limit_.second;   // worked out once per round
  uint64_t limit = total_mbs_;
  for (int t = last + 1; t < spec_.steps; ++t)
    if (delta_round_due(spec_, t, last, false) >= 0) {
      limit = std::min(total_mbs_, uint64_t(t) * uint64_t(M_));
      break;
    }
  limit_ = {last, limit};
  return limit;
}

void TrainingJob::advance(Ctx& c) {
  if (!active()) return;
  const std::string empty = empty_stages(c);
  if (state_ == JobState::kLoading) {
    if (!empty.empty()) {
      // A stage no registered peer can hold says so: which stage, how much, the largest peer.
      // Worked out again only when the empty stages or the peers change (it looks at every peer).
      const std::string key = empty + "|" + std::to_string(c.peers.size());
      if (key != waiting_key_) {
        waiting_key_ = key;
        // The peers that could not be placed count too: they are why a stage has no peer when
        // none can hold it (memory_shortfalls reads their memory only; stage 0 keeps the view valid).
        swarm::Registry view = placement_view(c.peers, c.now);
        for (const auto& [pid, p] : c.peers.all())
          if (p.stage < 0 && p.state == PeerState::kIdle) {
            PeerView v = view_of(p);
            v.stage = 0;
            view.peers.push_back(std::move(v));
          }
        const std::vector<MemoryShortfall> short_of = memory_shortfalls(view);
        reason_ = short_of.empty() ? "waiting for peers: stage(s) " + empty + " have no ready peer" : "waiting for memory: " + short_of[0].reason;
      }
      return;
    }
    // routing.start_peers: the first step waits, at most start_wait_s, for that many ready peers
    // in every stage, so that the first microbatches are not all served by the fastest loader.
    if (startable_s_ < 0) startable_s_ = c.now;
    if (spec_.routing.start_peers > 1 && c.now < startable_s_ + spec_.routing.start_wait_s) {
      std::string short_of;
      for (int s = 0; s < S_ && short_of.empty(); ++s) {
        const size_t n = c.peers.stage_peers(id_, s, c.now).size();
        if (n < size_t(spec_.routing.start_peers))
          short_of = "stage " + std::to_string(s) + " has " + std::to_string(n) + " of " + std::to_string(spec_.routing.start_peers);
      }
      if (!short_of.empty()) {
        char until[32];
        std::snprintf(until, sizeof(until), "%.0f", startable_s_ + spec_.routing.start_wait_s - c.now);
        reason_ = "waiting for peers (routing.start_peers): " + short_of + " ready peers; starting anyway in " + until + " s";
        return;
      }
    }
    state_ = JobState::kRunning;
    run_started_s_ = c.now;
    persist(c);
    c.event(EventKind::kJob, LogLevel::kInfo, "job " + std::to_string(id_) + " running", id_);
  }
  reason_ = empty.empty() ? "" : "paused: stage(s) " + empty + " have no live peer; start a stage server for them";
  // An open round moves on in any phase (an overlapped one alongside training); it is applied in
  // kRound, at its barrier, or, a round alongside training (roll_round), once every microbatch of
  // its step (plus any overlap_steps) has completed.
  if (rounds_.open() && phase_ != Phase::kRound) {
    const bool over = rounds_.advance(c, rolling_rounds() && steps_complete() >= rounds_.apply_step());
    // θ_g has just moved: the snapshot after it, collected while training goes on.
    if (over && phase_ == Phase::kTrain && !dur_.collecting() && dur_.snapshot_due(rounds_.last_step(), rounds_.count(), false))
      dur_.begin(c, rounds_.last_step(), false, /*at_barrier=*/false);
  }
  if (phase_ == Phase::kTrain && dur_.collecting()) dur_.advance(c, nullptr, completed_, rounds_.count(), nullptr);
  for (const auto& [peer, donor] : rounds_.take_resyncs())
    if (Peer* p = c.peers.find(peer)) start_sync(c, *p, donor);
  if (!rounds_.open() && !sync_after_round_.empty()) {
    const std::map<PeerId, PeerId> waiting = std::move(sync_after_round_);
    sync_after_round_.clear();
    for (const auto& [peer, donor] : waiting)
      if (Peer* p = c.peers.find(peer); p && p->job_id == id_ && p->state == PeerState::kSyncing) start_sync(c, *p, donor);
  }
  for (const auto& [peer, what] : rounds_.take_blames()) integrity_failure(c, peer, what);

  switch (phase_) {
    case Phase::kTrain:
      if (rolling_rounds()) roll_round(c);
      if (barrier_ == 0) barrier_ = next_barrier_mb();
      for (const uint64_t limit = std::min(barrier_, round_limit_mb()); flights_.size() < size_t(spec_.max_inflight) && taken_ < limit;)
        take(c, taken_, false);
      flights_.dispatch(c);
      if (completed_ == barrier_ && flights_.empty()) {
        barrier_ = 0;
        on_barrier(c);
      }
      break;
    case Phase::kStepping:
      if (step_waiting_.empty()) after_step(c);
      break;
    case Phase::kRound:
      if (rounds_.advance(c, true)) after_step(c);
      break;
    case Phase::kEval:
      while (flights_.size() < size_t(spec_.max_inflight) && eval_next_ < uint64_t(spec_.eval.batches)) take(c, eval_next_++, true);
      flights_.dispatch(c);
      if (flights_.empty() && eval_next_ >= uint64_t(spec_.eval.batches)) {
        val_loss_ = eval_count_ ? eval_sum_ / eval_count_ : NAN;
        last_eval_step_ = steps_done_;
        history({{"step", steps_done_}, {"val_loss", number_or_null(val_loss_)}});
        c.event(EventKind::kEval, LogLevel::kInfo, "job " + std::to_string(id_) + " step " + std::to_string(steps_done_) + ": val loss " + std::to_string(val_loss_),
                id_);
        after_step(c);
      }
      break;
    case Phase::kSnapshot:
      if (dur_.advance(c, router_state(c.now), completed_, rounds_.count(), spec_json_)) after_step(c);
      break;
    case Phase::kFinishing:
      if (!dur_.writing()) finish(c, JobState::kDone, "");
      break;
  }
  if (state_ == JobState::kRunning && phase_ == Phase::kTrain) maybe_rebalance(c);
}

// All microbatches up to a barrier completed. Under `sync` and `async` every peer steps on what
// it holds (unless the group sums its gradients in a round, which replaces the step); under
// `async_local` peers step on their own.
void TrainingJob::on_barrier(Ctx& c) {
  steps_done_ = int(completed_ / uint64_t(M_));
  // Under async too: the peers apply the step they hold before a round, an evaluation or a
  // checkpoint reads their weights.
  if (spec_.schedule != Schedule::kAsyncLocal && !dense_step(spec_, steps_done_)) {
    phase_ = Phase::kStepping;
    // A backward of this step overflowed somewhere (fp16): every stage skips the step, so the
    // stages never step on different sets of gradients (docs/gpu.md).
    const bool skip = step_overflow_;
    step_overflow_ = false;
    if (skip) {
      skipped_steps_++;
      c.info("job " + std::to_string(id_) + ": step " + std::to_string(steps_done_) + " skipped on every stage: a backward's gradients overflowed");
    }
    for (int s = 0; s < S_; ++s)
      for (Peer* p : c.peers.stage_peers(id_, s, c.now)) {
        msg::Step body;
        body.job_id = id_;
        body.skip = skip;
        Pending pd;
        pd.kind = ReqKind::kStep;
        pd.job = id_;
        pd.stage = s;
        pd.peer = p->id;
        pd.deadline_s = c.now + c.deadline_for(*p, spec_.timeouts.backward_s);
        c.request(pd, msg::make(body));
        step_waiting_.insert(p->id);
      }
    return;
  }
  after_step(c);
}

// After a step (sync) or a barrier (async), and again after each thing it starts: a round,
// then an evaluation, then a snapshot (and checkpoint), then more training or the end. Each is
// due at most once per step.
void TrainingJob::after_step(Ctx& c) {
  phase_ = Phase::kTrain;
  const bool end = completed_ >= total_mbs_;
  const RoundPlan plan = plan_round(spec_, steps_done_, rounds_.last_step(), end, rounds_.open(), rounds_.apply_step());
  if (plan.action == RoundPlan::kApply) {
    phase_ = Phase::kRound;
    return;
  }
  if (plan.action == RoundPlan::kOpen) {
    rounds_.begin(c, plan, steps_done_);
    if (plan.what == msg::RoundWhat::kDelta)
      history({{"step", steps_done_}, {"round", rounds_.count()}, {"fragment", plan.fragment}});
    if (!plan.overlapped) {
      phase_ = Phase::kRound;
      return;
    }
  }
  const int every = spec_.eval.every_steps;
  if (last_eval_step_ != steps_done_ && (end || (every > 0 && steps_done_ % every == 0))) {
    phase_ = Phase::kEval;
    eval_sum_ = 0;
    eval_count_ = 0;
    eval_next_ = 0;
    return;
  }
  const bool ckpt = dur_.checkpoint_due(steps_done_, end);
  // At the end only a checkpoint is worth a snapshot: the job's state leaves the router's memory
  // as it finishes, and every stage's state into the router is the largest transfer it asks for.
  if (ckpt || (!end && dur_.snapshot_due(steps_done_, rounds_.count(), dense_step(spec_, steps_done_)))) {
    phase_ = Phase::kSnapshot;
    dur_.begin(c, steps_done_, ckpt);
    return;
  }
  dur_.write_progress(c, steps_done_, taken_, completed_);
  if (!end) return;
  if (dur_.writing()) phase_ = Phase::kFinishing;
  else finish(c, JobState::kDone, "");
}

nlohmann::json TrainingJob::router_state(double now) const {
  return {{"job_id", id_},
          {"history", nlohmann::json(std::vector<nlohmann::json>(history_.begin(), history_.end()))},
          {"last_eval_step", last_eval_step_},
          {"train_loss", number_or_null(train_loss_)},
          {"val_loss", number_or_null(val_loss_)},
          {"train_tokens", train_tokens_},
          {"elapsed_s", now - run_started_s_},
          {"microbatches", {{"resent", resent_before_ + flights_.resent}, {"duplicates", duplicates_before_ + duplicates_},
                            {"rejected", rejected_before_ + flights_.rejected}}}};
}

void TrainingJob::finish(Ctx& c, JobState st, const std::string& reason) {
  Job::finish(c, st, reason);
  flights_.clear(c);
  step_waiting_.clear();
  data_.reset();  // a finished job keeps its figures, not its data
  persist(c);
}

void TrainingJob::check(const Requests& r) const {
  flights_.check(r);
  SWARM_CHECK(!active() || flights_.size() <= size_t(spec_.max_inflight), "more microbatches in flight than max_inflight");
  SWARM_CHECK(taken_ >= completed_, "completed more microbatches than were taken");
  SWARM_CHECK(history_.size() <= kMaxHistory, "history over its bound");
}

}  // namespace swarm::router
