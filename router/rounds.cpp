// rounds.cpp: implements router/rounds.h.
#include "router/rounds.h"

#include <algorithm>

#include "runtime/diloco.h"

namespace swarm::router {

bool dense_step(const JobSpec& spec, int step) {
  return spec.diloco.sync == DilocoSync::kEveryStep || step <= spec.diloco.warm_start_steps;
}

int delta_round_due(const JobSpec& spec, int step, int last_round_step, bool end) {
  if (dense_step(spec, step) || step == last_round_step) return -1;
  const int H = spec.diloco.inner_steps, F = spec.diloco.fragments;
  if (F == 1) return (step - last_round_step >= H || (end && step > last_round_step)) ? 0 : -1;
  return diloco::fragment_due(step, H, F);
}

RoundPlan plan_round(const JobSpec& spec, int steps_done, int last_round_step, bool end, bool round_open, int apply_step) {
  RoundPlan p;
  if (round_open) {
    if (steps_done >= apply_step || end) {
      p.action = RoundPlan::kApply;
      p.reason = "the open round's exchange overlapped training until step " + std::to_string(apply_step) + "; apply it now";
    } else {
      p.reason = "a round is open until step " + std::to_string(apply_step);
    }
    return p;
  }
  if (steps_done == last_round_step) {
    p.reason = "a round already ran at step " + std::to_string(steps_done);
    return p;
  }
  if (dense_step(spec, steps_done)) {
    p.action = RoundPlan::kOpen;
    p.what = msg::RoundWhat::kGrad;
    p.reason = spec.diloco.sync == DilocoSync::kEveryStep ? "diloco.sync every_step: the group sums its gradients at every step"
                                                          : "warm start: step " + std::to_string(steps_done) + " of " +
                                                                std::to_string(spec.diloco.warm_start_steps) + " syncs every step";
    return p;
  }
  const int f = delta_round_due(spec, steps_done, last_round_step, end);
  if (f < 0) {
    p.reason = "next round after " + std::to_string(spec.diloco.inner_steps) + " steps since step " + std::to_string(last_round_step);
    return p;
  }
  p.action = RoundPlan::kOpen;
  p.fragment = f;
  p.overlapped = spec.diloco.overlap_steps > 0 && !end;
  p.reason = spec.diloco.fragments > 1 ? "fragment " + std::to_string(f) + " of " + std::to_string(spec.diloco.fragments) + " is due at step " + std::to_string(steps_done)
                                       : std::to_string(steps_done - last_round_step) + " steps since the last round" + (end ? " (the end)" : "");
  return p;
}

// ---- sample counts ----

void SampleCounts::trained(const PeerId& peer, int fragments, int64_t samples) {
  auto& v = counts_[peer];
  if (v.size() < size_t(fragments)) v.resize(size_t(fragments), 0);
  for (auto& n : v) n += samples;
}

int64_t SampleCounts::since_sync(const PeerId& peer, int fragment) const {
  auto it = counts_.find(peer);
  return it == counts_.end() || size_t(fragment) >= it->second.size() ? 0 : it->second[size_t(fragment)];
}

void SampleCounts::synced(const PeerId& peer, int fragment) {
  auto it = counts_.find(peer);
  if (it == counts_.end()) return;
  if (fragment < 0) std::fill(it->second.begin(), it->second.end(), 0);
  else if (size_t(fragment) < it->second.size()) it->second[size_t(fragment)] = 0;
}

void SampleCounts::forget(const PeerId& peer) { counts_.erase(peer); }

// ---- the round ----

Rounds::Rounds(uint64_t job, const JobSpec& spec, std::vector<int64_t> stage_params)
    : job_(job), spec_(spec), params_(std::move(stage_params)), outer_(compression::parse_codec(spec.compression.outer)),
      fragment_syncs_(size_t(spec.diloco.fragments), 0), state_hashes_(params_.size()) {}

int64_t Rounds::values(int stage) const {
  const auto P = size_t(params_[size_t(stage)]);
  if (what_ == msg::RoundWhat::kGrad) return int64_t(P);
  const auto [lo, hi] = diloco::fragment_range(P, spec_.diloco.fragments, fragment_);
  return int64_t(hi - lo);
}

msg::RoundRef Rounds::ref(int s) const {
  msg::RoundRef r;
  r.job_id = job_;
  r.round = count_;
  r.stage = s;
  r.what = what_;
  r.fragment = fragment_;
  r.fragments = what_ == msg::RoundWhat::kGrad ? 1 : spec_.diloco.fragments;
  return r;
}

void Rounds::begin(Ctx& c, const RoundPlan& plan, int step) {
  open_ = true;
  what_ = plan.what;
  fragment_ = plan.fragment;
  count_++;
  last_step_ = step;
  apply_step_ = step + (plan.overlapped ? spec_.diloco.overlap_steps : 0);
  deadline_s_ = c.now + spec_.diloco.deadline_s;
  if (what_ == msg::RoundWhat::kDelta) fragment_syncs_[size_t(fragment_)]++;
  stages_.clear();
  stages_.resize(params_.size());
  for (int s = 0; s < int(params_.size()); ++s) {
    Stage& st = stages_[size_t(s)];
    msg::RoundBegin b;
    static_cast<msg::RoundRef&>(b) = ref(s);
    for (Peer* p : c.peers.stage_peers(job_, s, c.now)) {
      Pending pd;
      pd.kind = ReqKind::kRoundBegin;
      pd.job = job_;
      pd.stage = s;
      pd.peer = p->id;
      pd.deadline_s = c.now + c.deadline_for(*p, spec_.timeouts.backward_s);
      c.request(pd, msg::make(b));
      st.members.push_back(p->id);
      st.waiting.insert(p->id);
    }
  }
}

void Rounds::on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  if (!open_ || pd.stage < 0 || size_t(pd.stage) >= stages_.size()) return;
  Stage& st = stages_[size_t(pd.stage)];
  const int64_t n = values(pd.stage);
  auto flat_ok = [&](const wire::Message& r) {
    return r.tensors.size() == 1 && r.tensors[0].desc.dtype == wire::DType::kF32 &&
           r.tensors[0].desc.shape == std::vector<int64_t>{n} && r.tensors[0].desc.codec == outer_;
  };
  switch (pd.kind) {
    case ReqKind::kRoundBegin: {
      const msg::RoundDelta d = msg::read<msg::RoundDelta>(m);
      if (d.round != count_ || st.phase != Stage::Phase::kCollect || !st.waiting.erase(p.id)) return;
      if (!flat_ok(m)) {
        c.warn("peer " + p.hello.name + " sent an outer gradient that is not f32 [" + std::to_string(n) + "] in " + outer_.name() +
               "; left out of round " + std::to_string(count_));
        return;
      }
      // Weighed by the samples the router saw it train on since this fragment last synced. A
      // peer with none took no inner step since, so its outer gradient is zero and rightly left out.
      const int64_t counted = samples_.since_sync(p.id, what_ == msg::RoundWhat::kGrad ? 0 : fragment_);
      if (what_ == msg::RoundWhat::kDelta && counted <= 0) return;
      bytes_outer += m.tensors[0].desc.wire_bytes();
      st.weights[p.id] = double(counted);
      st.deltas[p.id] = std::move(m.tensors[0]);
      return;
    }
    case ReqKind::kRoundReduce: {
      const msg::RoundReduced r = msg::read<msg::RoundReduced>(m);
      if (r.round != count_ || st.phase != Stage::Phase::kReduce || p.id != st.reducer) return;
      if (!flat_ok(m)) {
        c.warn("peer " + p.hello.name + " reduced stage " + std::to_string(pd.stage) + "'s round into a tensor that is not f32 [" +
               std::to_string(n) + "] in " + outer_.name() + "; asking another peer");
        st.reducers_tried.insert(p.id);
        return reduce(c, pd.stage);
      }
      bytes_outer += m.tensors[0].desc.wire_bytes();
      wire::Tensor t = std::move(m.tensors[0]);
      wire::compress(t);  // once for all the group (entropy=zstd)
      st.mean = std::move(t);
      st.phase = Stage::Phase::kReduced;
      return;
    }
    case ReqKind::kRoundApply: {
      const msg::RoundDone r = msg::read<msg::RoundDone>(m);
      if (r.round != count_ || st.phase != Stage::Phase::kApply || !st.waiting.erase(p.id)) return;
      st.hashes[p.id] = r.hash;
      note_hash(p, r.hash);
      return;
    }
    default: return;
  }
}

void Rounds::on_failed(Ctx& c, const Pending& pd) {
  if (!open_ || pd.stage < 0 || size_t(pd.stage) >= stages_.size()) return;
  Stage& st = stages_[size_t(pd.stage)];
  if (pd.kind == ReqKind::kRoundReduce && st.phase == Stage::Phase::kReduce && pd.peer == st.reducer) {
    st.reducers_tried.insert(pd.peer);
    reduce(c, pd.stage);
  } else {
    st.waiting.erase(pd.peer);
  }
}

void Rounds::reduce(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kReduce;
  if (st.deltas.empty()) {
    c.warn("round " + std::to_string(count_) + ": no outer gradient from stage " + std::to_string(s) + "; its global weights stay as they were");
    st.phase = Stage::Phase::kDone;
    return;
  }
  // The last reducer of the stage first (it holds the error-feedback residual), then by join order.
  std::vector<const Peer*> cands;
  for (const PeerId& id : st.members) {
    const Peer* p = c.peers.find(id);
    if (p && p->state == PeerState::kReady && p->job_id == job_ && p->stage == s && !st.reducers_tried.count(id)) cands.push_back(p);
  }
  auto last = last_reducer_.find(s);
  std::stable_sort(cands.begin(), cands.end(), [&](const Peer* a, const Peer* b) {
    const bool la = last != last_reducer_.end() && a->id == last->second, lb = last != last_reducer_.end() && b->id == last->second;
    return la != lb ? la : a->seq < b->seq;
  });
  if (cands.empty()) {
    c.warn("round " + std::to_string(count_) + ": no peer of stage " + std::to_string(s) + " could reduce it; its global weights stay as they were");
    st.phase = Stage::Phase::kDone;
    return;
  }
  const Peer& r = *cands.front();
  st.reducer = r.id;
  msg::RoundReduce body;
  static_cast<msg::RoundRef&>(body) = ref(s);
  wire::Message m = msg::make(body);
  for (const PeerId& id : st.members) {
    auto it = st.deltas.find(id);
    if (it == st.deltas.end()) continue;
    body.weights.push_back(what_ == msg::RoundWhat::kGrad ? 1.0 : st.weights[id]);
    m.tensors.push_back(wire::share(it->second));
    bytes_outer += it->second.desc.wire_bytes();
  }
  m.body = msg::pack(body);
  Pending pd;
  pd.kind = ReqKind::kRoundReduce;
  pd.job = job_;
  pd.stage = s;
  pd.peer = r.id;
  pd.deadline_s = c.now + c.deadline_for(r, spec_.timeouts.backward_s);
  c.request(pd, std::move(m));
}

void Rounds::apply(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kApply;
  st.waiting.clear();
  last_reducer_[s] = st.reducer;
  double samples = 0;
  for (const auto& [id, w] : st.weights) samples += w;
  msg::RoundApply body;
  static_cast<msg::RoundRef&>(body) = ref(s);
  body.contributors = int32_t(st.deltas.size());
  body.samples = int64_t(samples);
  for (Peer* p : c.peers.stage_peers(job_, s, c.now)) {
    wire::Message m = msg::make(body);
    m.tensors.push_back(wire::share(*st.mean));
    bytes_outer += st.mean->desc.wire_bytes();
    Pending pd;
    pd.kind = ReqKind::kRoundApply;
    pd.job = job_;
    pd.stage = s;
    pd.peer = p->id;
    pd.deadline_s = c.now + c.deadline_for(*p, spec_.timeouts.backward_s);
    c.request(pd, std::move(m));
    st.waiting.insert(p->id);
    samples_.synced(p->id, what_ == msg::RoundWhat::kGrad ? -1 : fragment_);
  }
  st.mean.reset();
  st.deltas.clear();
}

void Rounds::vote(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kDone;
  std::map<uint64_t, int> votes;
  for (const auto& [id, h] : st.hashes) votes[h]++;
  if (votes.size() <= 1) return;
  // The most common hash; a tie goes to the hash of the peer that joined first (the router's
  // order, which no peer can choose).
  auto seq = [&](const PeerId& id) { const Peer* p = c.peers.find(id); return p ? p->seq : UINT64_MAX; };
  int best = 0;
  for (const auto& [h, n] : votes) best = std::max(best, n);
  uint64_t major = 0, major_seq = UINT64_MAX;
  for (const auto& [id, h] : st.hashes)
    if (votes[h] == best && seq(id) < major_seq) {
      major = h;
      major_seq = seq(id);
    }
  PeerId donor;
  uint64_t donor_seq = UINT64_MAX;
  for (const auto& [id, h] : st.hashes) {
    const Peer* p = c.peers.find(id);
    if (h == major && p && p->state == PeerState::kReady && p->seq < donor_seq) {
      donor = id;
      donor_seq = p->seq;
    }
  }
  for (const auto& [id, h] : st.hashes) {
    if (h == major) continue;
    hash_mismatches_++;
    const Peer* p = c.peers.find(id);
    if (!p) continue;
    c.warn("peer " + p->hello.name + " disagrees on stage " + std::to_string(s) + "'s global weights after round " +
           std::to_string(count_) + "; resyncing it from a donor");
    if (!donor.empty()) resyncs_.emplace_back(id, donor);
  }
}

bool Rounds::advance(Ctx& c, bool may_apply) {
  if (!open_) return true;
  bool done = true;
  for (int s = 0; s < int(stages_.size()); ++s) {
    Stage& st = stages_[size_t(s)];
    if (st.phase == Stage::Phase::kCollect && (st.waiting.empty() || c.now >= deadline_s_)) reduce(c, s);
    if (st.phase == Stage::Phase::kReduced && may_apply) {
      apply(c, s);
      deadline_s_ = std::max(deadline_s_, c.now + spec_.diloco.deadline_s);
    }
    if (st.phase == Stage::Phase::kApply && (st.waiting.empty() || c.now >= deadline_s_)) vote(c, s);
    done &= st.phase == Stage::Phase::kDone;
  }
  if (done) {
    open_ = false;
    stages_.clear();
  }
  return done;
}

void Rounds::note_hash(const Peer& p, uint64_t hash) {
  if (p.stage >= 0 && size_t(p.stage) < state_hashes_.size()) state_hashes_[size_t(p.stage)][p.hello.name] = hash;
}

void Rounds::forget(const Peer& p) {
  samples_.forget(p.id);
  for (auto& m : state_hashes_) m.erase(p.hello.name);
}

nlohmann::json Rounds::status() const {
  nlohmann::json hashes = nlohmann::json::array();
  for (const auto& m : state_hashes_) hashes.push_back(m);
  return {{"rounds", count_}, {"fragment_syncs", fragment_syncs_}, {"hash_mismatches", hash_mismatches_}, {"state_hashes", hashes}};
}

}  // namespace swarm::router
