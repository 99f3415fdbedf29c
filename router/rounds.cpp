// rounds.cpp: implements router/rounds.h.
#include "router/rounds.h"

#include <algorithm>
#include <functional>

#include "runtime/diloco.h"
#include "runtime/timing.h"

namespace swarm::router {

namespace {

// A member's outer gradient on the wire: at most f32 per parameter.
uint64_t delta_bytes(int64_t params) { return 4 * uint64_t(params); }

}  // namespace

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

void SampleCounts::synced(const PeerId& peer, int fragment, int64_t sent) {
  auto it = counts_.find(peer);
  if (it == counts_.end()) return;
  auto sync = [&](int64_t& n) { n = sent < 0 ? 0 : std::max<int64_t>(0, n - sent); };
  if (fragment < 0) std::for_each(it->second.begin(), it->second.end(), sync);
  else if (size_t(fragment) < it->second.size()) sync(it->second[size_t(fragment)]);
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

int64_t Rounds::part_values(int stage, int shards, int j) const {
  const auto [lo, hi] = diloco::fragment_range(size_t(values(stage)), shards, j);
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
  r.shards = stages_.empty() ? 1 : stages_[size_t(s)].shards;
  return r;
}

void Rounds::count_bytes(Ctx& c, const wire::Message& m, const PeerId& receiver) {
  const Peer* to = c.peers.find(receiver);
  uint64_t received = 0;
  bool any = false;
  for (const auto& t : m.tensors) {
    received += t.desc.wire_bytes();
    any = true;
  }
  for (const auto& r : m.refs) {
    if (to && r.from == to->hello.listen) continue;  // its own: no link crossed
    received += r.desc.wire_bytes();
    any = true;
    if (!r.from.empty())
      c.peers.each_listening_at(r.from, [&](const Peer& p) { round_bytes_[p.hello.name].sent += r.desc.wire_bytes(); });
  }
  if (!any) return;
  bytes_outer += received;
  round_bytes_[to ? to->hello.name : receiver].received += received;
}

void Rounds::begin(Ctx& c, const RoundPlan& plan, int step) {
  open_ = true;
  what_ = plan.what;
  fragment_ = plan.fragment;
  count_++;
  last_step_ = step;
  apply_step_ = step + (plan.overlapped ? spec_.diloco.overlap_steps : 0);
  deadline_s_ = c.now + spec_.diloco.deadline_s;
  begun_s_ = c.now;
  // Summed-gradient rounds come every step: the timeline shows the DiLoCo rounds.
  if (what_ == msg::RoundWhat::kDelta)
    c.event(EventKind::kRound, LogLevel::kDebug,
            "round " + std::to_string(count_) + " begins at step " + std::to_string(step) +
                (spec_.diloco.fragments > 1 ? " (fragment " + std::to_string(fragment_) + ")" : ""),
            job_);
  if (what_ == msg::RoundWhat::kDelta) fragment_syncs_[size_t(fragment_)]++;
  round_bytes_.clear();
  stages_.clear();
  stages_.resize(params_.size());
  std::vector<std::vector<Peer*>> members_of(params_.size());
  uint64_t inline_bytes = 0;
  for (int s = 0; s < int(params_.size()); ++s) {
    Stage& st = stages_[size_t(s)];
    std::vector<Peer*>& members = members_of[size_t(s)];
    members = c.peers.stage_peers(job_, s, c.now);
    // Peer to peer when every member takes fetches: member j owns part j.
    bool all_hold = !members.empty();
    for (const Peer* p : members) all_hold &= p->can_hold();
    st.p2p = spec_.routing.hops == Hops::kP2p && all_hold;
    if (!st.p2p) inline_bytes += members.size() * delta_bytes(params_[size_t(s)]);
  }
  // Deltas sent inline all come to the router at once over its one link, and the parts and means
  // of the reduce and the apply leave it at once: the round, and each of its inline requests, is
  // allowed their transfer together (a delta that passed a deadline counting its own bytes alone
  // was left out of the round as it arrived on a slow link).
  inline_bytes_ = inline_bytes;
  deadline_s_ += timing::transfer_allowance_s(double(inline_bytes));
  for (int s = 0; s < int(params_.size()); ++s) {
    Stage& st = stages_[size_t(s)];
    const std::vector<Peer*>& members = members_of[size_t(s)];
    st.shards = st.p2p ? std::min<int>(int(members.size()), msg::kMaxShards) : 1;
    msg::RoundBegin b;
    static_cast<msg::RoundRef&>(b) = ref(s);
    if (plan.overlapped && plan.what == msg::RoundWhat::kDelta) b.step = uint64_t(step);
    for (Peer* p : members) {
      Pending pd;
      pd.kind = ReqKind::kRoundBegin;
      pd.job = job_;
      pd.stage = s;
      pd.peer = p->id;
      pd.reply_bytes = delta_bytes(params_[size_t(s)]);
      pd.deadline_s = phase_deadline(c, *p, st.p2p);
      pd.hold = st.p2p;
      wire::Message m = msg::make(b);
      m.hold = st.p2p;
      c.request(pd, std::move(m));
      st.index.emplace(p->id, st.members.size());
      st.members.push_back(p->id);
      st.waiting.insert(p->id);
    }
    st.deltas.resize(st.members.size());
    st.weights.assign(st.members.size(), 0.0);
  }
}

void Rounds::on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) {
  if (!open_ || pd.stage < 0 || size_t(pd.stage) >= stages_.size()) {
    if (!m.refs.empty()) c.release(p.id, pd.id);
    return;
  }
  Stage& st = stages_[size_t(pd.stage)];
  // Each of the reply's tensors, sent or held, an f32 [n_j] in the outer codec.
  auto flat_ok = [&](size_t count, const std::function<int64_t(size_t)>& n) {
    if (m.tensors.size() + m.refs.size() != count) return false;
    for (size_t j = 0; j < count; ++j) {
      const wire::TensorDesc& d = m.refs.empty() ? m.tensors[j].desc : m.refs[j].desc;
      if (d.dtype != wire::DType::kF32 || d.shape != wire::Shape{int64_t(n(j))} || !(d.codec == outer_)) return false;
    }
    return true;
  };
  auto take_all = [&](size_t count) {
    std::vector<Slot> out;
    for (size_t j = 0; j < count; ++j) out.push_back(Ctx::take_reply_tensor(p.id, pd.id, m, j));
    return out;
  };
  switch (pd.kind) {
    case ReqKind::kRoundBegin: {
      const msg::RoundDelta d = msg::read<msg::RoundDelta>(m);
      const bool expected = d.round == count_ && st.phase == Stage::Phase::kCollect && st.waiting.erase(p.id);
      if (!expected || !flat_ok(size_t(st.shards), [&](size_t j) { return part_values(pd.stage, st.shards, int(j)); })) {
        if (expected)
          c.warn("peer " + p.hello.name + " sent an outer gradient that is not " + std::to_string(st.shards) + " part(s) of f32 [" +
                 std::to_string(values(pd.stage)) + "] in " + outer_.name() + "; left out of round " + std::to_string(count_));
        if (!m.refs.empty()) c.release(p.id, pd.id);
        return;
      }
      // Weighed by the samples the router saw it train on since this fragment last synced. A
      // peer with none took no inner step since, so its outer gradient is zero and rightly left out.
      const int64_t counted = samples_.since_sync(p.id, what_ == msg::RoundWhat::kGrad ? 0 : fragment_);
      if (what_ == msg::RoundWhat::kDelta && counted <= 0) {
        if (!m.refs.empty()) c.release(p.id, pd.id);
        return;
      }
      const size_t i = st.index.at(p.id);
      st.weights[i] = double(counted);
      std::vector<Slot> parts = take_all(size_t(st.shards));
      for (const Slot& sl : parts)
        if (sl.tensor()) {
          bytes_outer += sl.wire_bytes();
          round_bytes_[p.hello.name].sent += sl.wire_bytes();
        }
      st.deltas[i] = std::move(parts);
      st.contributed++;
      return;
    }
    case ReqKind::kRoundReduce: {
      const msg::RoundReduced r = msg::read<msg::RoundReduced>(m);
      const int j = int(pd.key);
      const bool expected = r.round == count_ && st.phase == Stage::Phase::kReduce && j < st.shards && st.reducing.count(j) &&
                            p.id == st.owners[size_t(j)];
      if (!expected) {
        if (!m.refs.empty()) c.release(p.id, pd.id);
        return;
      }
      if (!flat_ok(1, [&](size_t) { return part_values(pd.stage, st.shards, j); })) {
        c.warn("peer " + p.hello.name + " reduced part " + std::to_string(j) + " of stage " + std::to_string(pd.stage) +
               "'s round into a tensor that is not f32 [" + std::to_string(part_values(pd.stage, st.shards, j)) + "] in " +
               outer_.name() + "; asking another peer");
        if (!m.refs.empty()) c.release(p.id, pd.id);
        st.owners_tried[size_t(j)].insert(p.id);
        return reduce_part(c, pd.stage, j);
      }
      // Contributions its reducer left out (diloco::outliers): reported, counted.
      for (int64_t k : r.outliers) {
        if (k < 0 || size_t(k) >= st.contributors[size_t(j)].size()) continue;
        const PeerId& who = st.contributors[size_t(j)][size_t(k)];
        const Peer* q = c.peers.find(who);
        const std::string nm = q ? q->hello.name : who;
        outliers_[nm]++;
        st.left_out.insert(who);
        const bool far = std::find(r.far.begin(), r.far.end(), k) != r.far.end();
        const std::string what = "its outer gradient for part " + std::to_string(j) + " of stage " + std::to_string(pd.stage) +
                                 " in round " + std::to_string(count_) + " was " +
                                 (far ? "over " + std::to_string(int(diloco::kBlameFactor)) + "x the group's norm or not finite"
                                      : "over " + std::to_string(int(diloco::kOutlierFactor)) + "x the group's norm");
        c.warn("peer " + nm + ": " + what + "; left out");
        if (far) blames_.emplace_back(who, what);   // past any honest spread: counted against it
      }
      Slot mean = Ctx::take_reply_tensor(p.id, pd.id, m, 0);
      if (mean.tensor()) {
        bytes_outer += mean.wire_bytes();
        round_bytes_[p.hello.name].sent += mean.wire_bytes();
      }
      st.means[size_t(j)] = std::move(mean);
      st.reducing.erase(j);
      if (st.reducing.empty()) st.phase = Stage::Phase::kReduced;
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
  const int j = int(pd.key);
  if (pd.kind == ReqKind::kRoundReduce && st.phase == Stage::Phase::kReduce && j < st.shards && st.reducing.count(j) &&
      pd.peer == st.owners[size_t(j)]) {
    st.owners_tried[size_t(j)].insert(pd.peer);
    reduce_part(c, pd.stage, j);
  } else {
    st.waiting.erase(pd.peer);
  }
}

void Rounds::on_fetch_failed(Ctx& c, const Pending& pd, int slot) {
  if (!open_ || pd.stage < 0 || size_t(pd.stage) >= stages_.size()) return on_failed(c, pd);
  Stage& st = stages_[size_t(pd.stage)];
  const int j = int(pd.key);
  if (pd.kind == ReqKind::kRoundReduce && st.phase == Stage::Phase::kReduce && j < st.shards && st.reducing.count(j) &&
      pd.peer == st.owners[size_t(j)] && slot >= 0 && size_t(slot) < st.contributors[size_t(j)].size()) {
    // A member's part is gone (its holder died or cannot be reached): this part's mean goes on without it.
    const PeerId gone = st.contributors[size_t(j)][size_t(slot)];
    const Peer* g = c.peers.find(gone);
    c.warn("round " + std::to_string(count_) + ": part " + std::to_string(j) + " of stage " + std::to_string(pd.stage) +
           " goes on without " + (g ? g->hello.name : gone) + "'s outer gradient (it could not be fetched)");
    if (auto it = st.index.find(gone); it != st.index.end() && !st.deltas[it->second].empty()) c.drop(st.deltas[it->second][size_t(j)]);
    return reduce_part(c, pd.stage, j);
  }
  if (pd.kind == ReqKind::kRoundApply && st.phase == Stage::Phase::kApply) {
    // It could not gather the group's means: it applies nothing now and is resynced after the vote.
    st.unsynced.insert(pd.peer);
    st.waiting.erase(pd.peer);
    return;
  }
  on_failed(c, pd);
}

void Rounds::reduce(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kReduce;
  if (st.contributed == 0) {
    c.warn("round " + std::to_string(count_) + ": no outer gradient from stage " + std::to_string(s) + "; its global weights stay as they were");
    st.phase = Stage::Phase::kDone;
    return;
  }
  st.owners.assign(size_t(st.shards), PeerId());
  st.owners_tried.assign(size_t(st.shards), {});
  st.contributors.assign(size_t(st.shards), {});
  st.means.clear();
  st.means.resize(size_t(st.shards));
  for (int j = 0; j < st.shards; ++j) st.reducing.insert(j);
  for (int j = 0; j < st.shards; ++j) reduce_part(c, s, j);
}

void Rounds::reduce_part(Ctx& c, int s, int j) {
  Stage& st = stages_[size_t(s)];
  if (st.phase != Stage::Phase::kReduce) return;
  // Its last owner first (it holds the error-feedback residual of this part's mean), then member
  // j, j + 1, ... in join order: the first of them that is ready and has not failed this part.
  auto eligible = [&](const PeerId& id) -> const Peer* {
    const Peer* p = c.peers.find(id);
    const bool ok = p && p->state == PeerState::kReady && p->job_id == job_ && p->stage == s && !st.owners_tried[size_t(j)].count(id) &&
                    (!st.p2p || p->can_hold());
    return ok ? p : nullptr;
  };
  const Peer* chosen = nullptr;
  const auto last = last_owner_.find({s, j});
  if (last != last_owner_.end() && last->second.first == st.shards && st.index.count(last->second.second))
    chosen = eligible(last->second.second);
  for (size_t k = 0; !chosen && k < st.members.size(); ++k) chosen = eligible(st.members[(size_t(j) + k) % st.members.size()]);
  bool any = false;
  for (const std::vector<Slot>& parts : st.deltas) any |= !parts.empty() && parts[size_t(j)].known();
  if (!chosen || !any) {
    c.warn("round " + std::to_string(count_) + ": part " + std::to_string(j) + " of stage " + std::to_string(s) +
           (any ? " found no peer to reduce it" : " lost every outer gradient") + "; the stage's global weights stay as they were");
    release(c, st);
    st.phase = Stage::Phase::kDone;
    return;
  }
  const Peer& owner = *chosen;
  st.owners[size_t(j)] = owner.id;
  msg::RoundReduce body;
  static_cast<msg::RoundRef&>(body) = ref(s);
  body.shard = j;
  wire::Message m = msg::make(body);
  m.tensors.reserve(st.members.size());
  m.refs.reserve(st.members.size());
  st.contributors[size_t(j)].clear();
  for (size_t i = 0; i < st.members.size(); ++i) {
    if (st.deltas[i].empty() || !st.deltas[i][size_t(j)].known()) continue;
    body.weights.push_back(st.weights[i]);   // "grad": for the reducer's outlier test only
    c.attach(m, st.deltas[i][size_t(j)], uint32_t(st.contributors[size_t(j)].size()));
    st.contributors[size_t(j)].push_back(st.members[i]);
  }
  m.body = msg::pack(body);
  m.hold = st.p2p;
  count_bytes(c, m, owner.id);
  Pending pd;
  pd.kind = ReqKind::kRoundReduce;
  pd.job = job_;
  pd.key = uint64_t(j);
  pd.stage = s;
  pd.peer = owner.id;
  pd.hold = st.p2p;
  pd.deadline_s = phase_deadline(c, owner, st.p2p);
  c.request(pd, std::move(m));
}

double Rounds::phase_deadline(const Ctx& c, const Peer& p, bool p2p) const {
  // Timed as any request (a member that hangs is left out within seconds), and, inline, allowed
  // the transfer of the whole round's inline bytes over the router's link, with which it shares
  // it (Ctx::request adds its own bytes' allowance on top).
  const double own = c.now + c.deadline_for(p, spec_.timeouts.backward_s);
  return p2p ? own : own + timing::transfer_allowance_s(double(inline_bytes_));
}

void Rounds::apply(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kApply;
  st.waiting.clear();
  for (int j = 0; j < st.shards; ++j) last_owner_[{s, j}] = {st.shards, st.owners[size_t(j)]};
  double samples = 0;
  for (size_t i = 0; i < st.members.size(); ++i)
    if (!st.deltas[i].empty() && !st.left_out.count(st.members[i])) samples += st.weights[i];
  msg::RoundApply body;
  static_cast<msg::RoundRef&>(body) = ref(s);
  body.contributors = int32_t(st.contributed);
  body.samples = int64_t(samples);
  for (Peer* p : c.peers.stage_peers(job_, s, c.now)) {
    wire::Message m = msg::make(body);
    m.tensors.reserve(size_t(st.shards));
    m.refs.reserve(size_t(st.shards));
    for (int j = 0; j < st.shards; ++j) c.attach(m, st.means[size_t(j)], uint32_t(j));
    count_bytes(c, m, p->id);
    Pending pd;
    pd.kind = ReqKind::kRoundApply;
    pd.job = job_;
    pd.stage = s;
    pd.peer = p->id;
    pd.deadline_s = phase_deadline(c, *p, st.p2p);
    c.request(pd, std::move(m));
    st.waiting.insert(p->id);
    if (what_ == msg::RoundWhat::kGrad) {
      samples_.synced(p->id, -1);
    } else {
      const auto i = st.index.find(p->id);
      const bool sent = i != st.index.end() && !st.deltas[i->second].empty();
      samples_.synced(p->id, fragment_, sent ? int64_t(st.weights[i->second]) : -1);
    }
  }
}

// What the members and owners hold for the round goes once the round is applied or given up.
void Rounds::release(Ctx& c, Stage& st) {
  for (std::vector<Slot>& parts : st.deltas) {
    for (Slot& sl : parts) c.drop(sl);
    parts.clear();
  }
  for (Slot& sl : st.means) c.drop(sl);
  st.contributed = 0;
  st.means.clear();
}

void Rounds::vote(Ctx& c, int s) {
  Stage& st = stages_[size_t(s)];
  st.phase = Stage::Phase::kDone;
  release(c, st);
  std::map<uint64_t, int> votes;
  for (const auto& [id, h] : st.hashes) votes[h]++;
  if (votes.size() <= 1 && st.unsynced.empty()) return;
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
  for (const PeerId& id : st.unsynced)
    if (!donor.empty() && c.peers.find(id)) {
      c.warn("peer " + c.peers.find(id)->hello.name + " could not gather stage " + std::to_string(s) + "'s round " +
             std::to_string(count_) + "; resyncing it from a donor");
      resyncs_.emplace_back(id, donor);
    }
  // A clear majority (two or more, more than any other hash): peers that gathered and applied the
  // same mean compute the same fp32 loop, so one that disagrees with it lied or broke.
  int second = 0;
  for (const auto& [h, n] : votes)
    if (h != major) second = std::max(second, n);
  const bool clear = best >= 2 && best > second;
  for (const auto& [id, h] : st.hashes) {
    if (h == major) continue;
    hash_mismatches_++;
    const Peer* p = c.peers.find(id);
    if (!p) continue;
    c.warn("peer " + p->hello.name + " disagrees on stage " + std::to_string(s) + "'s global weights after round " +
           std::to_string(count_) + "; resyncing it from a donor");
    if (!donor.empty()) resyncs_.emplace_back(id, donor);
    if (clear && !st.unsynced.count(id))
      blames_.emplace_back(id, "its state hash after round " + std::to_string(count_) + " of stage " + std::to_string(s) +
                                   " disagreed with " + std::to_string(best) + " peers");
  }
}

bool Rounds::overdue(const Ctx& c, const Stage& st) const {
  // A member still sending a large message (its delta, on a slow link) is waited for past the
  // deadline: what it sends the round comes after it.
  return c.now >= deadline_s_ && !c.peers.any_sending(st.waiting, c.now);
}

bool Rounds::advance(Ctx& c, bool may_apply) {
  if (!open_) return true;
  bool done = true;
  for (int s = 0; s < int(stages_.size()); ++s) {
    Stage& st = stages_[size_t(s)];
    if (st.phase == Stage::Phase::kCollect && (st.waiting.empty() || overdue(c, st))) reduce(c, s);
    if (st.phase == Stage::Phase::kReduced && may_apply) {
      apply(c, s);
      deadline_s_ = std::max(deadline_s_, c.now + spec_.diloco.deadline_s);
    }
    if (st.phase == Stage::Phase::kApply && (st.waiting.empty() || overdue(c, st))) vote(c, s);
    done &= st.phase == Stage::Phase::kDone;
  }
  if (done) {
    open_ = false;
    stages_.clear();
    const std::string what = msg::round_what_name(what_);
    auto h = durations_.find(what);
    if (h == durations_.end()) h = durations_.emplace(what, metrics::Histogram(metrics::duration_buckets())).first;
    h->second.observe(c.now - begun_s_);
    if (what_ == msg::RoundWhat::kDelta)
      c.event(EventKind::kRound, LogLevel::kDebug,
              "round " + std::to_string(count_) + " applied in " + std::to_string(int((c.now - begun_s_) * 1000)) + " ms", job_);
    last_round_bytes_ = std::map<std::string, PeerBytes>(round_bytes_.begin(), round_bytes_.end());
    round_bytes_.clear();
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
  nlohmann::json bytes = nlohmann::json::object();
  for (const auto& [name, b] : last_round_bytes_) bytes[name] = {{"sent", b.sent}, {"received", b.received}};
  return {{"rounds", count_}, {"fragment_syncs", fragment_syncs_}, {"hash_mismatches", hash_mismatches_}, {"state_hashes", hashes},
          {"outer_peer_bytes", bytes}, {"outliers", outliers_}};
}

}  // namespace swarm::router
