// placement.cpp: the throughput model, place_peer, plan_rebalance, ideal_min_throughput and the
// static pipelines (see placement.h and docs/heterogeneous.md).
#include "router/placement.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "runtime/errors.h"
#include "runtime/memory_estimate.h"

namespace swarm {
namespace {

constexpr double kRelTol = 1e-9;  // throughputs this close (relative) are equal

bool close(double a, double b) {
  return std::fabs(a - b) <= kRelTol * std::max({1.0, std::fabs(a), std::fabs(b)});
}

// -1, 0, 1: sorted a is lexicographically smaller, equal, larger than sorted b.
int compare_presorted(const std::vector<double>& a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (a[i] != b[i] && !close(a[i], b[i])) return a[i] < b[i] ? -1 : 1;
  return 0;
}

// The same, comparing sorted copies.
int compare_sorted(std::vector<double> a, std::vector<double> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return compare_presorted(a, b);
}

// `sorted` (ascending) with its elements at ia and ib (ia != ib) replaced by new_a and new_b,
// into `out`, still ascending: the sorted throughputs after a move, in O(stages).
void replace_two_sorted(const std::vector<double>& sorted, size_t ia, size_t ib, double new_a, double new_b, std::vector<double>& out) {
  if (new_b < new_a) std::swap(new_a, new_b);
  out.clear();
  bool a_in = false, b_in = false;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i == ia || i == ib) continue;
    const double v = sorted[i];
    if (!a_in && new_a <= v) out.push_back(new_a), a_in = true;
    if (a_in && !b_in && new_b <= v) out.push_back(new_b), b_in = true;
    out.push_back(v);
  }
  if (!a_in) out.push_back(new_a);
  if (!b_in) out.push_back(new_b);
}

std::string num(double v) {
  if (!std::isfinite(v)) return v > 0 ? "inf" : "-inf";
  char buf[48];
  const double a = std::fabs(v);
  std::snprintf(buf, sizeof buf, a >= 100 ? "%.0f" : a >= 10 ? "%.1f" : "%.2f", v);
  return buf;
}

std::string pct(double gain) {
  if (!std::isfinite(gain)) return "+inf%";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.0f%%", gain * 100);
  return buf;
}

const std::string kUnit = " samples/s";

void validate(const Registry& reg) {
  SWARM_CHECK(reg.stages >= 0, "negative stage count");
  SWARM_CHECK(reg.stage_cost.empty() || int(reg.stage_cost.size()) == reg.stages,
              "stage_cost has " + std::to_string(reg.stage_cost.size()) + " entries for " + std::to_string(reg.stages) + " stages");
  for (double c : reg.stage_cost) SWARM_CHECK(std::isfinite(c) && c > 0, "stage cost must be positive");
  for (const auto& p : reg.peers)
    SWARM_CHECK(p.stage >= 0 && p.stage < reg.stages, "peer " + p.id + " on stage " + std::to_string(p.stage));
  SWARM_CHECK(reg.stage_need.empty() || int(reg.stage_need.size()) == reg.stages, "stage_need has one entry per stage");
}

// Bytes `peer` needs for stage s; 0 when the registry has no needs.
int64_t need_of(const Registry& reg, const PeerView& peer, int s) {
  return reg.stage_need.empty() ? 0 : reg.stage_need[size_t(s)].of(peer.cuda, peer.precision);
}

bool fits(const Registry& reg, const PeerView& peer, int s) {
  return peer.memory_bytes < 0 || need_of(reg, peer, s) <= peer.memory_bytes;
}

double cost(const Registry& reg, int s) { return reg.stage_cost.empty() ? 1.0 : reg.stage_cost[size_t(s)]; }

// The median measured speed, 1 when nothing is measured: what an unmeasured peer counts as.
double median_speed(const Registry& reg) {
  std::vector<double> v;
  for (const auto& p : reg.peers)
    if (p.speed > 0 && std::isfinite(p.speed)) v.push_back(p.speed);
  if (v.empty()) return 1.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<double> effective_speeds(const Registry& reg) {
  const double med = median_speed(reg);
  std::vector<double> out;
  out.reserve(reg.peers.size());
  for (const auto& p : reg.peers) out.push_back(p.speed > 0 && std::isfinite(p.speed) ? p.speed : med);
  return out;
}

std::vector<double> throughputs(const Registry& reg, const std::vector<double>& eff) {
  std::vector<double> t(size_t(reg.stages), 0.0);
  for (size_t i = 0; i < reg.peers.size(); ++i) t[size_t(reg.peers[i].stage)] += eff[i] / cost(reg, reg.peers[i].stage);
  return t;
}

double min_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }

// One candidate move and the stage throughputs after it.
struct Option {
  size_t peer = 0;
  int from = -1, to = -1;
  std::vector<double> after;
  bool restricted = false;  // needs reverse_gain: the peer, or this pair of stages, has not settled
};

// Why candidates were left out, for the "no move" reason.
struct Skips {
  int pinned = 0, unmovable = 0, unmeasured = 0, last = 0, small = 0;
  // ", 2 without the memory for it", when any.
  std::string memory() const { return small ? ", " + std::to_string(small) + " without the memory for it" : ""; }
};

// The state a plan of moves works on.
struct PlanState {
  std::vector<double> t;      // [stages] throughputs
  std::vector<int> ready;     // [stages] ready peers
  std::vector<int> stage;     // [peers] where each peer is
  std::vector<bool> moved;    // [peers] already moved by this plan
};

class Planner {
 public:
  Planner(const Registry& reg, const RebalanceParams& params, double now)
      : reg_(reg), params_(params), now_(now), eff_(effective_speeds(reg)) {
    start_.t = throughputs(reg, eff_);
    start_.ready.assign(size_t(reg.stages), 0);
    for (const auto& p : reg.peers) {
      start_.stage.push_back(p.stage);
      if (p.ready) start_.ready[size_t(p.stage)]++;
    }
    start_.moved.assign(reg.peers.size(), false);
    // For restricted(): per (from, to), the slowest peer that moved from `to` to `from` within
    // settle_s (a peer at least half as fast as any of them going back is restricted).
    const size_t S = size_t(std::max(reg.stages, 0));
    back_min_.assign(S * S, std::numeric_limits<double>::infinity());
    for (size_t k = 0; k < reg.peers.size(); ++k) {
      const PeerView& q = reg.peers[k];
      if (q.last_from < 0 || q.last_from >= reg.stages || !(now_ - q.last_moved_s < params_.settle_s)) continue;
      double& m = back_min_[size_t(q.stage) * S + size_t(q.last_from)];
      m = std::min(m, eff_[k]);
    }
  }

  const std::vector<double>& start() const { return start_.t; }

  // The best move into stage b from `st`, or none. `urgent` (b has no peer) waives the progress
  // test and settling; `allow_restricted` admits moves that need reverse_gain.
  // Each candidate costs O(stages): its sorted throughputs are the current sorted ones with two
  // values replaced, and its Option is built only when it is the best so far.
  std::optional<Option> best_into(const PlanState& st, int b, bool urgent, bool allow_restricted, Skips* skips) const {
    std::optional<Option> best;
    // The throughputs in ascending order, and each stage's place in that order.
    std::vector<size_t> order(st.t.size()), place(st.t.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return st.t[x] < st.t[y] || (st.t[x] == st.t[y] && x < y); });
    std::vector<double> sorted(st.t.size()), cand_sorted, best_sorted;
    for (size_t k = 0; k < order.size(); ++k) {
      sorted[k] = st.t[order[k]];
      place[order[k]] = k;
    }
    for (size_t i = 0; i < reg_.peers.size(); ++i) {
      const PeerView& p = reg_.peers[i];
      const int s = st.stage[i];
      if (s == b || st.moved[i]) continue;
      if (p.pinned) { if (skips) skips->pinned++; continue; }
      if (!p.movable) { if (skips) skips->unmovable++; continue; }
      if (!(p.speed > 0)) { if (skips) skips->unmeasured++; continue; }
      if (st.ready[size_t(s)] - (p.ready ? 1 : 0) < 1) { if (skips) skips->last++; continue; }  // never empties a stage
      if (!fits(reg_, p, b)) { if (skips) skips->small++; continue; }
      const double from_after = st.t[size_t(s)] - eff_[i] / cost(reg_, s);
      const double to_after = st.t[size_t(b)] + eff_[i] / cost(reg_, b);
      // Progress: both stages the move touches end above the target's throughput now.
      const double pair = std::min(from_after, to_after);
      if (!urgent && (pair <= st.t[size_t(b)] || close(pair, st.t[size_t(b)]))) continue;
      const bool restr = !urgent && restricted(i, s, b);
      if (restr && !allow_restricted) continue;
      replace_two_sorted(sorted, place[size_t(s)], place[size_t(b)], from_after, to_after, cand_sorted);
      if (best && !better(cand_sorted, s, i, best_sorted, *best, st)) continue;
      Option o;
      o.peer = i;
      o.from = s;
      o.to = b;
      o.after = st.t;
      o.after[size_t(s)] = from_after;
      o.after[size_t(b)] = to_after;
      o.restricted = restr;
      best = std::move(o);
      best_sorted.swap(cand_sorted);
    }
    return best;
  }

  // Greedy moves into the bottleneck, from the registry's state, until the minimum has risen by
  // `gain` (success: the moves) or no move helps (empty). At most max(1, ceil(gain x its ready
  // peers)) moves into each stage, what raising a stage of equal peers by `gain` takes: one in a
  // small swarm, so a plan has several moves only when several stages sit near the bottleneck;
  // several into a stage of fifty peers, where one peer alone never lifts it by 10%.
  // `reached`: the throughputs the moves reached, whether or not they reached the goal;
  // `restricted`: whether any of those moves needed reverse_gain.
  std::vector<Option> plan(double gain, bool allow_restricted, Skips* skips, std::vector<double>* reached, bool* restricted = nullptr) const {
    PlanState st = start_;
    const double goal = min_of(st.t) * (1 + gain);
    std::vector<Option> moves;
    std::vector<int> lifts(size_t(reg_.stages), 0);
    for (int k = 0;; ++k) {
      const int b = int(std::min_element(st.t.begin(), st.t.end()) - st.t.begin());
      if (lifts[size_t(b)] >= std::max(1, int(std::ceil(gain * double(start_.ready[size_t(b)]) - 1e-9)))) break;
      lifts[size_t(b)]++;
      auto o = best_into(st, b, false, allow_restricted, k == 0 ? skips : nullptr);
      if (!o) break;
      st.t = o->after;
      st.ready[size_t(o->from)] -= reg_.peers[o->peer].ready ? 1 : 0;
      st.ready[size_t(o->to)] += reg_.peers[o->peer].ready ? 1 : 0;
      st.stage[o->peer] = o->to;
      st.moved[o->peer] = true;
      if (restricted) *restricted = *restricted || o->restricted;
      moves.push_back(std::move(*o));
      if (reached) *reached = st.t;
      if (min_of(st.t) >= goal && !close(min_of(st.t), min_of(start_.t))) return moves;
    }
    return {};
  }

  PlanState start_state() const { return start_; }

 private:
  // Peer i has not settled when it moved within settle_s, or when it would go back along the path
  // of a recent move by a peer at most twice as fast (undoing much of that move; a slow peer
  // going back where a fast one left only refines it).
  bool restricted(size_t i, int from, int to) const {
    if (now_ - reg_.peers[i].last_moved_s < params_.settle_s) return true;
    return eff_[i] >= 0.5 * back_min_[size_t(from) * size_t(reg_.stages) + size_t(to)];
  }

  // Whether moving peer a_peer from a_from (sorted throughputs after: a_sorted) beats `b`: larger
  // sorted throughputs after the move; then the source with the most spare; then the id.
  bool better(const std::vector<double>& a_sorted, int a_from, size_t a_peer, const std::vector<double>& b_sorted, const Option& b,
              const PlanState& st) const {
    const int c = compare_presorted(a_sorted, b_sorted);
    if (c != 0) return c > 0;
    if (!close(st.t[size_t(a_from)], st.t[size_t(b.from)])) return st.t[size_t(a_from)] > st.t[size_t(b.from)];
    return reg_.peers[a_peer].id < reg_.peers[b.peer].id;
  }

  const Registry& reg_;
  const RebalanceParams& params_;
  const double now_;
  const std::vector<double> eff_;
  PlanState start_;
  std::vector<double> back_min_;   // [from * stages + to] see the constructor
};

// Exact best minimum by a dynamic programme over subsets: g_k(mask) is the best minimum of the
// first k stages served by exactly the peers in mask, each stage non-empty.
double ideal_exact(const std::vector<double>& speeds, const std::vector<double>& stage_cost) {
  const size_t n = speeds.size(), S = stage_cost.size();
  const uint32_t full = (uint32_t(1) << n) - 1;
  std::vector<double> sum(size_t(full) + 1, 0.0);
  for (uint32_t m = 1; m <= full; ++m) {
    const int low = __builtin_ctz(m);
    sum[m] = sum[m & (m - 1)] + speeds[size_t(low)];
  }
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> prev(size_t(full) + 1, -inf), cur(size_t(full) + 1, -inf);
  prev[0] = inf;  // no stage yet: the minimum of nothing
  for (size_t k = 0; k < S; ++k) {
    std::fill(cur.begin(), cur.end(), -inf);
    for (uint32_t m = 1; m <= full; ++m) {
      if (size_t(__builtin_popcount(m)) < k + 1) continue;
      double best = -inf;
      for (uint32_t sub = m; sub; sub = (sub - 1) & m) {
        const double rest = prev[m ^ sub];
        if (rest == -inf) continue;
        best = std::max(best, std::min(rest, sum[sub] / stage_cost[k]));
      }
      cur[m] = best;
    }
    std::swap(prev, cur);
  }
  return prev[full] == -inf ? 0.0 : prev[full];
}

// Beyond the exact limit: greedy placement, fastest first, then zero-margin moves until none.
double ideal_greedy(const std::vector<double>& speeds, const std::vector<double>& stage_cost) {
  std::vector<size_t> order(speeds.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return speeds[a] > speeds[b]; });
  Registry reg;
  reg.stages = int(stage_cost.size());
  reg.stage_cost = stage_cost;
  for (size_t i : order) {
    PeerView p;
    p.id = std::to_string(i);
    p.speed = speeds[i];
    p.stage = place_peer(reg, speeds[i]);
    reg.peers.push_back(p);
  }
  RebalanceParams zero;
  zero.min_gain = kRelTol;
  zero.reverse_gain = kRelTol;
  zero.cooldown_s = 0;
  zero.checks_to_move = 1;
  // Every accepted move raises the sorted throughputs lexicographically, so this ends; the cap
  // only bounds the time.
  for (size_t it = 0; it < 64 * speeds.size(); ++it) {
    const Rebalance r = plan_rebalance(reg, zero, 0.0);
    if (!r.move) break;
    for (auto& p : reg.peers)
      if (p.id == r.move->peer) p.stage = r.move->to;
  }
  return min_of(stage_throughputs(reg));
}

}  // namespace

std::vector<double> stage_throughputs(const Registry& reg) {
  validate(reg);
  return throughputs(reg, effective_speeds(reg));
}

int place_peer(const Registry& reg, double speed, std::string* reason) {
  PeerView peer;
  peer.speed = speed;
  return place_peer(reg, peer, reason);
}

int place_peer(const Registry& reg, const PeerView& peer, std::string* reason) {
  validate(reg);
  if (reg.stages <= 0) {
    if (reason) *reason = "no stages";
    return -1;
  }
  const std::vector<double> t = throughputs(reg, effective_speeds(reg));
  const double v = peer.speed > 0 && std::isfinite(peer.speed) ? peer.speed : median_speed(reg);
  std::vector<int> count(size_t(reg.stages), 0);
  for (const auto& p : reg.peers) count[size_t(p.stage)]++;
  // Heavier stages to bigger devices: with its memory known, a peer prefers, among equals, the
  // heaviest stage it can hold (what a smaller device could not take).
  const bool by_weight = peer.memory_bytes >= 0 && !reg.stage_need.empty();
  auto heavier = [&](int a, int b) { return by_weight && need_of(reg, peer, a) > need_of(reg, peer, b); };
  int lightest = -1;
  for (int s = 0; s < reg.stages; ++s)
    if (lightest < 0 || need_of(reg, peer, s) < need_of(reg, peer, lightest)) lightest = s;
  if (!fits(reg, peer, lightest)) {
    if (reason)
      *reason = "no stage fits: the lightest, stage " + std::to_string(lightest) + ", needs " +
                human_bytes(need_of(reg, peer, lightest)) + " and the peer has " + human_bytes(peer.memory_bytes) + " free";
    return -1;
  }
  int empty = -1;
  for (int s = 0; s < reg.stages; ++s)
    if (count[size_t(s)] == 0 && fits(reg, peer, s) && (empty < 0 || heavier(s, empty))) empty = s;
  if (empty >= 0) {
    if (reason) *reason = "stage " + std::to_string(empty) + " has no peer";
    return empty;
  }
  int best = -1;
  std::vector<double> best_after;
  for (int s = 0; s < reg.stages; ++s) {
    if (!fits(reg, peer, s)) continue;
    std::vector<double> after = t;
    after[size_t(s)] += v / cost(reg, s);
    if (best >= 0) {
      const int c = compare_sorted(after, best_after);
      if (c < 0) continue;
      if (c == 0 && !heavier(s, best) && (heavier(best, s) || count[size_t(s)] >= count[size_t(best)])) continue;
    }
    best = s;
    best_after = std::move(after);
  }
  if (reason) {
    const double before = min_of(t), after = min_of(best_after);
    const bool bottleneck = close(t[size_t(best)], before);
    *reason = "stage " + std::to_string(best) + " (" + (bottleneck ? "bottleneck, " : "") + num(t[size_t(best)]) + kUnit + ", " +
              std::to_string(count[size_t(best)]) + " peer(s)): stage " + std::to_string(best) + " -> " + num(best_after[size_t(best)]) +
              ", min stage throughput " + num(before) + " -> " + num(after) + kUnit;
  }
  return best;
}

Rebalance plan_rebalance(const Registry& reg, const RebalanceParams& params, double now_s) {
  validate(reg);
  Rebalance out;
  auto say = [&](const std::string& s) {
    out.reason = s;
    return out;
  };
  if (reg.stages < 2) return say("one stage: nothing to rebalance");
  const Planner planner(reg, params, now_s);
  const std::vector<double>& t = planner.start();
  const double min_before = min_of(t);
  auto to_move = [&](const std::vector<Option>& plan, bool empty) {
    const Option& o = plan.front();
    Move m;
    m.peer = reg.peers[o.peer].id;
    m.from = o.from;
    m.to = o.to;
    m.min_before = min_before;
    m.min_after = min_of(o.after);
    m.plan_moves = int(plan.size());
    m.plan_min_after = min_of(plan.back().after);
    m.target_empty = empty;
    const std::string from = "stage " + std::to_string(o.from), to = "stage " + std::to_string(o.to);
    m.reason = "move peer " + m.peer + " from " + from + " (spare " + num(t[size_t(o.from)] - min_before) + kUnit + ") to " + to +
               (empty ? " (no peer: restore its state from the snapshot)" : " (bottleneck, " + num(t[size_t(o.to)]) + kUnit + ")") + ": " +
               to + " " + num(t[size_t(o.to)]) + " -> " + num(o.after[size_t(o.to)]) + ", " + from + " " + num(t[size_t(o.from)]) + " -> " +
               num(o.after[size_t(o.from)]) + "; min throughput " + num(m.min_before) + " -> " + num(m.min_after) + kUnit;
    if (plan.size() > 1)
      m.reason += " (" + std::to_string(plan.size() - 1) + " more move(s) planned, to reach " + num(m.plan_min_after) + kUnit + ")";
    return m;
  };

  // A stage with no peer stops the job: fill it now, whatever the cooldowns, margins and checks.
  for (int b = 0; b < reg.stages; ++b) {
    if (t[size_t(b)] > 0) continue;  // speeds are positive: only a stage with no peer serves 0
    Skips sk;
    auto o = planner.best_into(planner.start_state(), b, /*urgent=*/true, true, &sk);
    if (!o) return say("stage " + std::to_string(b) + " has no peer and no peer can move there (" + std::to_string(sk.pinned) + " pinned, " +
                       std::to_string(sk.unmovable) + " not movable now, " + std::to_string(sk.unmeasured) + " not measured, " +
                       std::to_string(sk.last) + " the last ready peer of their stage" + sk.memory() + ")");
    out.move = to_move({*o}, true);
    out.reason = out.move->reason;
    return out;
  }

  double last = reg.last_move_s;
  for (const auto& p : reg.peers) last = std::max(last, p.last_moved_s);
  if (now_s - last < params.cooldown_s)
    return say("cooldown: the last move was " + num(now_s - last) + " s ago (cooldown " + num(params.cooldown_s) + " s)");

  // The margin shrinks as the bottleneck's peers grow in number (RebalanceParams::margin_peers).
  const int b0 = int(std::min_element(t.begin(), t.end()) - t.begin());
  const int n0 = planner.start_state().ready[size_t(b0)];
  const double margin = params.min_gain * std::min(1.0, std::sqrt(double(std::max(params.margin_peers, 1)) / double(std::max(n0, 1))));
  Skips sk;
  std::vector<double> reached = t, reached_r = t;
  bool used_restricted = false;
  auto plan = planner.plan(margin, /*allow_restricted=*/false, &sk, &reached);
  if (plan.empty()) plan = planner.plan(std::max(margin, params.reverse_gain), /*allow_restricted=*/true, nullptr, &reached_r, &used_restricted);
  if (!plan.empty()) {
    Move m = to_move(plan, false);
    // Measurements are noisy: move only when enough consecutive checks agree where a peer is
    // needed: this check's move goes where the previous check's plan moved a peer. (Where many
    // stages are the bottleneck within noise, the first move of each plan picks a different one
    // of them, and "the same move" in two checks running came 4 times in 55 checks at 1,000
    // simulated peers.)
    std::vector<int> targets;
    for (const Option& o : plan) targets.push_back(o.to);
    const auto& prev = reg.proposal.targets;
    const bool same = (reg.proposal.from == m.from && reg.proposal.to == m.to) || std::find(prev.begin(), prev.end(), m.to) != prev.end();
    const int checks = (same ? std::max(0, reg.proposal.checks) : 0) + 1;
    if (checks >= params.checks_to_move) {
      out.reason = m.reason;
      out.move = std::move(m);
      return out;
    }
    out.proposal = Proposal{m.from, m.to, checks, std::move(targets)};
    return say("proposed (" + std::to_string(checks) + " of " + std::to_string(params.checks_to_move) + " checks): " + m.reason);
  }
  const double free_min = min_of(reached), any_min = min_of(reached_r);
  if (used_restricted && any_min >= min_before * (1 + margin) && any_min > free_min)
    return say("no move: the best plan raises the min throughput " + num(min_before) + " -> " + num(any_min) + kUnit + " (" +
               pct(any_min / min_before - 1) + ") but moves a peer that has not settled (it moved, or a peer as fast moved the other " +
               "way, in the last " + num(params.settle_s) + " s), which needs " + pct(params.reverse_gain).substr(1));
  const double best = std::max(free_min, any_min);
  if (best > min_before)
    return say("no move: the best plan raises the min throughput only " + num(min_before) + " -> " + num(best) + kUnit + " (" +
               pct(best / min_before - 1) + "), under the " + pct(margin).substr(1) + " margin" +
               (margin < params.min_gain ? " (" + pct(params.min_gain).substr(1) + " for the " + std::to_string(n0) + " peers at the bottleneck)" : ""));
  return say("no move: no peer can lift the bottleneck (" + num(min_before) + kUnit + "; candidates left out: " + std::to_string(sk.pinned) +
             " pinned, " + std::to_string(sk.unmovable) + " not movable now, " + std::to_string(sk.unmeasured) + " not measured, " +
             std::to_string(sk.last) + " the last ready peer of their stage" + sk.memory() + ")");
}

int64_t StageNeed::of(bool cuda_peer, Precision p) const {
  const std::array<int64_t, 3>& n = cuda_peer ? cuda : cpu;
  switch (p) {
    case Precision::kFp32: return n[0];
    case Precision::kBf16: return n[1];
    case Precision::kFp16: return n[2];
    case Precision::kAuto: break;
  }
  return std::max({n[0], n[1], n[2]});
}

bool peer_fits(const Registry& reg, const PeerView& peer, int stage) {
  validate(reg);
  SWARM_CHECK(stage >= 0 && stage < reg.stages, "stage " + std::to_string(stage) + " out of range");
  return fits(reg, peer, stage);
}

std::vector<size_t> placement_order(const std::vector<PeerView>& peers) {
  std::vector<size_t> order(peers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const PeerView &x = peers[a], &y = peers[b];
    if (x.memory_bytes != y.memory_bytes) return x.memory_bytes > y.memory_bytes;  // unknown (-1) last
    if (!close(x.speed, y.speed)) return x.speed > y.speed;
    return x.id < y.id;
  });
  return order;
}

std::vector<MemoryShortfall> memory_shortfalls(const Registry& reg) {
  validate(reg);
  std::vector<MemoryShortfall> out;
  if (reg.stage_need.empty() || reg.peers.empty()) return out;
  const PeerView* largest = nullptr;
  for (const PeerView& p : reg.peers) {
    if (p.memory_bytes < 0) return out;  // a peer of unknown memory may hold anything
    if (!largest || p.memory_bytes > largest->memory_bytes || (p.memory_bytes == largest->memory_bytes && p.id < largest->id)) largest = &p;
  }
  for (int s = 0; s < reg.stages; ++s) {
    bool any = false;
    for (const PeerView& p : reg.peers) any = any || fits(reg, p, s);
    if (any) continue;
    MemoryShortfall m;
    m.stage = s;
    m.need = need_of(reg, *largest, s);
    m.largest_peer = largest->name.empty() ? largest->id : largest->name;
    m.largest_bytes = largest->memory_bytes;
    m.reason = "stage " + std::to_string(s) + " needs " + human_bytes(m.need) + ", but the largest peer, " + m.largest_peer + ", has " +
               human_bytes(m.largest_bytes) + " free: waiting for a peer with more memory (or lower batch.microbatch_size "
               "or model.precision; docs/gpu.md)";
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<StageNeed> stage_needs(const JobSpec& spec) {
  const Precision pinned = spec.model.precision_pin();
  const Precision order[3] = {Precision::kFp32, Precision::kBf16, Precision::kFp16};
  std::vector<StageNeed> out;
  for (int s = 0; s < spec.partition.stages; ++s) {
    StageNeed n;
    for (size_t i = 0; i < 3; ++i) {
      const Precision p = pinned == Precision::kAuto ? order[i] : pinned;
      // CUDA peers run the documented CUDA build (libtorch 2.x): scaled-dot-product attention.
      // The least a peer must hold: no graph cached (its backwards recompute); a peer with more
      // memory caches more (the stage server sizes its affinity cache to what it has).
      n.cuda[i] = estimate_stage_memory(spec, s, p, /*flash_attention=*/true, /*cuda=*/true, /*cache_entries=*/0).need_bytes(true);
      n.cpu[i] = estimate_stage_memory(spec, s, p, /*flash_attention=*/false, /*cuda=*/false, /*cache_entries=*/0).need_bytes(false);
    }
    out.push_back(n);
  }
  return out;
}

double next_rebalance_delay_s(const RebalanceParams& params, double u) {
  u = std::min(1.0, std::max(0.0, u));
  const double j = std::min(1.0, std::max(0.0, params.period_jitter));
  return std::max(0.0, params.period_s * (1.0 + j * (2.0 * u - 1.0)));
}

double ideal_min_throughput(const std::vector<double>& speeds, const std::vector<double>& stage_cost) {
  for (double c : stage_cost) SWARM_CHECK(std::isfinite(c) && c > 0, "stage cost must be positive");
  for (double v : speeds) SWARM_CHECK(std::isfinite(v) && v >= 0, "speed must be finite and non-negative");
  if (stage_cost.empty() || speeds.size() < stage_cost.size()) return 0.0;
  return speeds.size() <= kIdealExactMaxPeers ? ideal_exact(speeds, stage_cost) : ideal_greedy(speeds, stage_cost);
}

std::vector<std::vector<std::string>> static_pipelines(const std::vector<std::vector<std::string>>& stage_peers) {
  if (stage_peers.empty()) return {};
  size_t n = stage_peers[0].size();
  for (const auto& s : stage_peers) n = std::min(n, s.size());
  std::vector<std::vector<std::string>> out(n);
  for (size_t i = 0; i < n; ++i)
    for (const auto& s : stage_peers) out[i].push_back(s[i]);
  return out;
}

int static_pipeline_for(uint64_t microbatch, size_t pipelines) {
  return pipelines == 0 ? -1 : int(microbatch % pipelines);
}

double static_min_throughput(const Registry& reg) {
  validate(reg);
  if (reg.stages <= 0) return 0.0;
  const std::vector<double> eff = effective_speeds(reg);
  std::vector<std::vector<size_t>> by_stage(size_t(reg.stages));
  for (size_t i = 0; i < reg.peers.size(); ++i) by_stage[size_t(reg.peers[i].stage)].push_back(i);
  size_t n = SIZE_MAX;
  for (const auto& s : by_stage) n = std::min(n, s.size());
  if (n == 0) return 0.0;
  double slowest = std::numeric_limits<double>::infinity();
  for (size_t k = 0; k < n; ++k)
    for (int s = 0; s < reg.stages; ++s) slowest = std::min(slowest, eff[by_stage[size_t(s)][k]] / cost(reg, s));
  return double(n) * slowest;
}

double peer_speed(double ms_per_unit, double stage_cost, double samples_per_unit) {
  if (!(ms_per_unit > 0) || !(stage_cost > 0) || !(samples_per_unit > 0)) return 0.0;
  return 1000.0 * samples_per_unit * stage_cost / ms_per_unit;
}

std::vector<double> stage_costs_from_params(const std::vector<int64_t>& params) {
  double sum = 0;
  int known = 0;
  for (int64_t p : params)
    if (p > 0) sum += double(p), known++;
  std::vector<double> out(params.size(), 1.0);
  if (known == 0) return out;
  const double mean = sum / known;
  for (size_t s = 0; s < params.size(); ++s)
    if (params[s] > 0) out[s] = double(params[s]) / mean;
  return out;
}

}  // namespace swarm
