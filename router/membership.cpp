// membership.cpp: the peers of a training job (router/training_job.h): which stage each one
// serves, loading it, giving it the stage's state before it serves (from a live donor, else the
// stage snapshot), quarantining a peer that keeps failing integrity checks, and the
// rebalancer's moves (router/placement.h decides them).
#include "router/training_job.h"

#include <algorithm>
#include <cstring>

namespace swarm::router {

// A peer for a running job: the stage it pinned (--stage), else the one it prefers
// (--prefer-stage, movable later), else where the swarm's minimum stage throughput rises most.
// A stage is never put on a peer whose device cannot hold it (router/placement.h, memory).
void TrainingJob::assign(Ctx& c, Peer& p, StartView* start) {
  swarm::Registry own;
  if (!start) own = placement_view(c.peers, c.now);
  const swarm::Registry& reg = start ? start->reg : own;
  const PeerView me = view_of(p);
  int stage = p.hello.stage;
  if (stage >= S_) {
    c.warn("peer " + p.hello.name + " asked for stage " + std::to_string(stage) + " but job " + std::to_string(id_) + " has " +
           std::to_string(S_) + " stages; placing it");
    stage = -1;
  }
  if (stage >= 0 && !peer_fits(reg, me, stage)) {
    c.warn("peer " + p.hello.name + " pinned stage " + std::to_string(stage) + " but its device cannot hold it; it stays idle");
    return;
  }
  if (stage < 0 && p.hello.prefer_stage >= 0 && p.hello.prefer_stage < S_ && peer_fits(reg, me, p.hello.prefer_stage))
    stage = p.hello.prefer_stage;
  if (stage < 0) {
    std::string why;
    stage = place_peer(reg, me, &why);
    c.info("placing peer " + p.hello.name + ": " + why);
    if (stage < 0) return;  // it can hold no stage of this job: idle
  }
  c.peers.place(p, id_, stage);
  send_load(c, p);
  if (start) {
    // The peer joins the start's view as placement_view would now show it.
    const auto at = std::lower_bound(start->seq.begin(), start->seq.end(), p.seq);
    start->reg.peers.insert(start->reg.peers.begin() + (at - start->seq.begin()), placed_view(p, c.peers, c.now));
    start->seq.insert(at, p.seq);
  }
}

// LOAD_STAGE for the peer's stage; it gets the stage's state before it serves (on_loaded).
void TrainingJob::send_load(Ctx& c, Peer& p) {
  c.peers.set_state(p, PeerState::kLoading);
  rounds_.samples().forget(p.id);
  p.samples_tokens = false;
  msg::LoadStage body;
  body.job_id = id_;
  body.stage = p.stage;
  body.spec = spec_json_;
  if (data_ && (p.stage == 0 || p.stage == S_ - 1)) body.data_hash = data_->hash();
  Pending pd;
  pd.kind = ReqKind::kLoad;
  pd.job = id_;
  pd.stage = p.stage;
  pd.peer = p.id;
  pd.deadline_s = c.now + 120;  // building a stage's modules and timing one step
  c.request(pd, msg::make(body));
}

void TrainingJob::on_loaded(Ctx& c, Peer& p, wire::Message& m) {
  const msg::StageReady r = msg::read<msg::StageReady>(m);
  if (p.state != PeerState::kLoading) return;
  // The stage's size is the job spec's (runtime/job_spec.h), whatever the peer says.
  const int64_t want = stage_params_[size_t(p.stage)];
  if (r.params != want) {
    c.warn("peer " + p.hello.name + " loaded stage " + std::to_string(p.stage) + " with " + std::to_string(r.params) +
           " parameters, but the job's model has " + std::to_string(want) + " there; not using it");
    c.peers.set_state(p, PeerState::kIdle);
    c.peers.ban(p, c.now);
    return;
  }
  p.samples_tokens = r.data.value_or(false) && data_ && (p.stage == 0 || p.stage == S_ - 1);
  start_sync(c, p);
}

// A loaded peer gets the stage's state before it serves: the snapshot when it is current (taken
// at a barrier of this step: a resumed job), else a live donor's (`donor` when the caller chose
// one), else the snapshot however old (the whole stage had died: the status counts the steps it lost), else (nothing
// learned yet) its initial weights, the same on every peer.
void TrainingJob::start_sync(Ctx& c, Peer& p, const PeerId& donor_id) {
  c.peers.set_state(p, PeerState::kSyncing);
  // A round is open: a donor's state now predates its apply, and the joiner, not a member, would
  // come out one round behind the group (and win the next vote's tie as the older peer). It syncs
  // once the round is applied (advance).
  if (rounds_.open()) {
    sync_after_round_[p.id] = donor_id;
    return;
  }
  const auto& snap = dur_.snapshot(p.stage);
  if (snap.valid && snap.at_barrier && snap.step == steps_done_) return restore_from_snapshot(c, p);
  Peer* donor = nullptr;
  if (Peer* d = c.peers.find(donor_id); d && d->state == PeerState::kReady && d->job_id == id_ && d->stage == p.stage) donor = d;
  for (Peer* d : c.peers.stage_peers(id_, p.stage, c.now))
    if (!donor && d != &p && !c.peers.banned(*d, c.now)) donor = d;   // a donor whose state failed a check waits out its ban
  if (donor && rounds_.count() > 0) {
    // While the group steps together it is one optimizer: a joiner copies all of a donor's state.
    msg::StateRequest body;
    body.job_id = id_;
    body.full = dense_step(spec_, steps_done_ + 1);
    Pending pd;
    pd.kind = ReqKind::kStateRequest;
    pd.job = id_;
    pd.stage = p.stage;
    pd.peer = donor->id;
    pd.target = p.id;
    pd.round = rounds_.count();
    pd.deadline_s = c.now + c.deadline_for(*donor, spec_.timeouts.backward_s);
    pd.reply_bytes = uint64_t(body.full ? 5 : 2) * 4 * uint64_t(stage_params_[size_t(p.stage)]);
    // Peer to peer the donor keeps its state and the joiner fetches it.
    wire::Message m = msg::make(body);
    m.hold = pd.hold = spec_.routing.hops == Hops::kP2p && donor->can_hold();
    c.request(pd, std::move(m));
    return;
  }
  if (!donor && snap.valid) return restore_from_snapshot(c, p);
  if (!donor && steps_done_ > 0)
    c.warn("stage " + std::to_string(p.stage) + " has no live peer and no snapshot yet; peer " + p.hello.name + " starts from the initial weights");
  c.peers.set_state(p, PeerState::kReady);
  rounds_.samples().forget(p.id);
  c.event(EventKind::kPeer, LogLevel::kInfo, "peer " + p.hello.name + " ready on stage " + std::to_string(p.stage), id_, &p, p.stage);
}

void TrainingJob::restore_from_snapshot(Ctx& c, Peer& p) {
  const auto& snap = dur_.snapshot(p.stage);
  const int lost = steps_done_ - snap.step;
  bool others = false;
  for (Peer* d : c.peers.stage_peers(id_, p.stage, c.now)) others |= d != &p;
  if (state_ == JobState::kRunning && !others) {  // the stage had died mid-run (not a job resuming)
    restores_.push_back({{"stage", p.stage}, {"peer", p.hello.name}, {"snapshot_step", snap.step}, {"step", steps_done_}, {"lost_steps", lost}});
    c.event(EventKind::kFault, LogLevel::kWarn,
            "stage " + std::to_string(p.stage) + " restarts from its snapshot of step " + std::to_string(snap.step) + " on peer " + p.hello.name +
                " (" + std::to_string(lost) + " step(s) of that stage lost)",
            id_, &p, p.stage);
  }
  const StageState& st = snap.state;
  msg::StateLoad body;
  body.job_id = id_;
  body.adam_step = st.adam_step;
  body.loss_scale = st.loss_scale;
  body.loss_scale_good_steps = st.loss_scale_good_steps;
  wire::Message m = msg::make(body);
  for (const auto* v : {&st.theta_g, &st.momentum, &st.theta, &st.adam_m, &st.adam_v}) {
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {int64_t(v->size())}, compression::CodecSpec{}, v->size() * 4);
    std::memcpy(t.data.data(), v->data(), v->size() * 4);
    wire::seal(t);
    m.tensors.push_back(std::move(t));
  }
  Pending pd;
  pd.kind = ReqKind::kStateLoad;
  pd.job = id_;
  pd.stage = p.stage;
  pd.peer = p.id;
  pd.target = "the stage snapshot of step " + std::to_string(snap.step);
  pd.deadline_s = c.now + c.deadline_for(p, spec_.timeouts.backward_s);
  c.request(pd, std::move(m));
}

// A donor's state, forwarded as it came (its tensors are checked by the peer that loads them).
void TrainingJob::on_state_reply(Ctx& c, Peer& donor, const Pending& pd, wire::Message& m) {
  const msg::StateReply r = msg::read<msg::StateReply>(m);
  Peer* t = c.peers.find(pd.target);
  const size_t n = m.tensors.size() + m.refs.size();
  if (!t || t->state != PeerState::kSyncing || (n != 2 && n != 5) || (!m.refs.empty() && !pd.hold)) {
    if (!m.refs.empty()) c.release(donor.id, pd.id);
    if (t && t->state == PeerState::kSyncing) start_sync(c, *t);
    return;
  }
  msg::StateLoad body;
  body.job_id = id_;
  if (n == 5) {
    body.adam_step = r.adam_step.value_or(0);
    body.loss_scale = r.loss_scale;
    body.loss_scale_good_steps = r.loss_scale_good_steps;
  }
  wire::Message load = msg::make(body);
  for (size_t i = 0; i < n; ++i) {
    Slot sl = Ctx::take_reply_tensor(donor.id, pd.id, m, i);
    c.attach(load, sl, uint32_t(i));
  }
  Pending lp;
  lp.kind = ReqKind::kStateLoad;
  lp.job = id_;
  lp.stage = t->stage;
  lp.peer = t->id;
  lp.target = donor.hello.name;
  lp.donor = donor.id;
  lp.round = pd.round;
  if (!m.refs.empty()) {
    lp.holder = donor.id;  // released once the joiner has loaded it, or failed to
    lp.key = pd.id;
  }
  lp.deadline_s = c.now + c.deadline_for(*t, spec_.timeouts.backward_s);
  c.request(lp, std::move(load));
}

void TrainingJob::integrity_failure(Ctx& c, const PeerId& id, const std::string& what) {
  Peer* p = c.peers.find(id);
  if (!p) return;
  p->integrity_failures++;
  integrity_failures_++;
  if (p->state == PeerState::kQuarantined || p->integrity_failures < uint64_t(c.opt.quarantine_after)) return;
  if (p->stage >= 0 && c.peers.stage_peers(id_, p->stage, c.now).size() <= 1) {
    c.warn("peer " + p->hello.name + " keeps failing integrity checks but is the last peer of stage " + std::to_string(p->stage) + "; keeping it");
    return;
  }
  c.peers.set_state(*p, PeerState::kQuarantined);
  quarantined_ids_.insert(p->key.empty() ? p->id : p->key);
  const std::string reason = std::to_string(p->integrity_failures) + " integrity failures, the last: " + what;
  quarantined_.push_back({{"peer", p->hello.name}, {"id", wire::printable_id(id)}, {"stage", p->stage}, {"reason", reason}});
  c.event(EventKind::kFault, LogLevel::kWarn, "peer " + p->hello.name + " quarantined (" + reason + ")", id_, p, p->stage);
  for (uint64_t rid : c.requests.of_peer(id))
    if (auto pd = c.take(rid)) on_failed(c, *pd, false, -1, "peer quarantined");
}

// ---- rebalancing ----------------------------------------------------------------------------

// The job's peers as router/placement.h sees them: a peer's speed is what it delivers (its
// measured ms per work unit), scaled to a stage of cost 1; a stage's cost is its share of the
// model's compute times the work its backwards take (Flights::work_factor).
swarm::Registry TrainingJob::placement_view(const Registry& peers, double now, std::vector<uint64_t>* seq) const {
  swarm::Registry reg;
  reg.stages = S_;
  reg.stage_cost = stage_cost_;
  for (int s = 0; s < S_; ++s) reg.stage_cost[size_t(s)] *= flights_.work_factor(s);   // recomputed forwards
  reg.last_move_s = last_move_s_;
  reg.proposal = proposal_;
  std::vector<const Peer*> ps;
  for (const auto& [id, p] : peers.all())
    if (p.job_id == id_ && p.stage >= 0 && p.stage < S_ && p.state != PeerState::kQuarantined) ps.push_back(&p);
  std::sort(ps.begin(), ps.end(), [](const Peer* a, const Peer* b) { return a->seq < b->seq; });
  reg.stage_need = stage_need_;
  reg.peers.reserve(ps.size());
  for (const Peer* p : ps) {
    reg.peers.push_back(placed_view(*p, peers, now));
    if (seq) seq->push_back(p->seq);
  }
  return reg;
}

PeerView TrainingJob::placed_view(const Peer& p, const Registry& peers, double now) const {
  PeerView v = view_of(p);
  v.stage = p.stage;
  v.ready = p.state == PeerState::kReady;
  v.movable = v.ready && !peers.banned(p, now);
  return v;
}

PeerView TrainingJob::view_of(const Peer& p) const {
  PeerView v;
  v.id = p.id;
  v.name = p.hello.name;
  const double ms = p.speed_ms();
  const std::vector<double>& cost = stage_cost_;
  v.speed = ms > 0 && p.stage >= 0 && p.stage < S_ ? peer_speed(ms, cost[size_t(p.stage)], spec_.batch.microbatch_size / 3.0) : 0.0;
  v.pinned = p.hello.stage >= 0 && p.hello.stage < S_;
  v.last_moved_s = p.last_moved_s;
  v.last_from = p.last_from;
  v.memory_bytes = p.hello.device_memory_free_bytes.value_or(-1);
  v.cuda = p.hello.device.rfind("cuda", 0) == 0;
  v.precision = spec_.model.precision_pin();
  if (v.precision == Precision::kAuto) {
    try {
      v.precision = parse_precision(p.hello.precision);
    } catch (const InputError&) {
      v.precision = Precision::kAuto;  // not said: the most any precision needs
    }
  }
  return v;
}

// On a randomised period, and only between rounds (a round's membership is its stage's peers):
// the move plan_rebalance decides and, once a move is confirmed in a large swarm, more at once:
// one move per kPeersPerMove ready peers at most, each planned again on the placement the
// earlier ones left. A bad start of a thousand peers needs over a hundred moves; one per
// confirmed check took most of an hour (docs/scale.md).
constexpr size_t kPeersPerMove = 50;

void TrainingJob::maybe_rebalance(Ctx& c) {
  if (!spec_.routing.rebalance || spec_.routing.mode != RoutingMode::kSwarm) return;
  RebalanceParams rp;
  rp.period_s = spec_.routing.rebalance_period_s;
  rp.min_gain = spec_.routing.min_gain;
  rp.cooldown_s = spec_.routing.cooldown_s;
  auto schedule_next = [&] {
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
    next_rebalance_s_ = c.now + next_rebalance_delay_s(rp, u);
  };
  if (next_rebalance_s_ < 0) return schedule_next();
  if (c.now < next_rebalance_s_) return;
  if (rounds_.open()) {
    if (rebalance_reason_ != "a round is open; moves wait until it is applied") {
      rebalance_reason_ = "a round is open; moves wait until it is applied";
      c.info("rebalance: " + rebalance_reason_);
    }
    return;
  }
  schedule_next();
  swarm::Registry view = placement_view(c.peers, c.now);
  const Rebalance r = plan_rebalance(view, rp, c.now);
  proposal_ = r.proposal;
  if (r.reason != rebalance_reason_) {
    c.info("rebalance: " + r.reason);
    rebalance_reason_ = r.reason;
  }
  if (!r.move) return;
  if (!make_move(c, *r.move) || r.move->target_empty) return;
  // More moves after a confirmed one: no cooldown or second check within them; each is planned
  // again and still needs its own gain over the placement before it (plan_rebalance's margins
  // and settling rules). Not bounded by the confirmed plan's length: with many peers per stage
  // the margin is small and so are the plans, while a bad start needs a hundred moves.
  size_t ready = 0;
  for (const PeerView& pv : view.peers) ready += pv.ready;
  const int more = int(ready / kPeersPerMove) - 1;
  RebalanceParams follow = rp;
  follow.cooldown_s = 0;
  follow.checks_to_move = 1;
  for (int k = 0; k < more; ++k) {
    view = placement_view(c.peers, c.now);
    const Rebalance next = plan_rebalance(view, follow, c.now);
    if (!next.move || !make_move(c, *next.move)) break;
  }
  proposal_ = {};
}

bool TrainingJob::make_move(Ctx& c, const Move& mv) {
  Peer* p = c.peers.find(mv.peer);
  if (!p) return false;
  const std::vector<double>& cost = stage_cost_;
  c.event(EventKind::kMove, LogLevel::kInfo,
          "rebalance: moving peer " + p->hello.name + " from stage " + std::to_string(mv.from) + " to stage " + std::to_string(mv.to) + ": " + mv.reason,
          id_, p, mv.to);
  moves_.push_back({{"peer", p->hello.name}, {"from", mv.from}, {"to", mv.to}, {"step", steps_done_},
                    {"min_before", mv.min_before}, {"min_after", mv.min_after}, {"reason", mv.reason}});
  move_counts_[{mv.from, mv.to, mv.target_empty ? "empty_stage" : "bottleneck"}]++;
  last_move_s_ = p->last_moved_s = c.now;
  p->last_from = mv.from;
  p->ms_per_unit *= cost[size_t(mv.to)] / cost[size_t(mv.from)];
  p->turnaround_ms *= cost[size_t(mv.to)] / cost[size_t(mv.from)];
  p->hello.stage = -1;
  c.peers.place(*p, id_, mv.to);
  // The peer answers what it was already sent for its old stage, then loads the new one and
  // gets its state from a donor (or the stage snapshot) before it serves.
  send_load(c, *p);
  return true;
}

}  // namespace swarm::router
