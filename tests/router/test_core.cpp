// test_core.cpp: the router's core driven with a fake clock and no processes (fake_swarm.h):
// peers dying mid-forward, mid-backward, mid-round and mid-checkpoint, a stage losing its last
// peer, the rebalancer during a round, a restart from a state dir, lying peers, and the bugs
// that one malformed message used to trigger. Each asserts what the core sent and why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "router/flights.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "tests/support/fake_swarm.h"

namespace swarm::router {
namespace {

using nlohmann::json;
using testing::FakeSwarm;
using wire::MsgType;

// Peers of a two-stage job, two per stage, pinned.
std::vector<PeerId> two_by_two(FakeSwarm& f) {
  return {f.join("a0", 0), f.join("a1", 0), f.join("b0", 1), f.join("b1", 1)};
}

bool done(FakeSwarm& f, uint64_t job) { return f.status(job)["state"] == "done"; }

// The last message of `type` the router sent to a peer.
const wire::Message& last_of(FakeSwarm& f, const PeerId& id, MsgType type) {
  auto& v = f.peers.at(id).received;
  for (auto it = v.rbegin(); it != v.rend(); ++it)
    if (it->type == type) return *it;
  throw std::runtime_error("no such message");
}

size_t received(const FakeSwarm& f, const PeerId& id, MsgType type) {
  size_t n = 0;
  for (const auto& m : f.peers.at(id).received) n += m.type == type;
  return n;
}

TEST(Core, TrainsAJobToTheEndWithNothingLost) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  ASSERT_GT(job, 0u);
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["step"], 4);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["microbatches"]["completed"], 8);
  EXPECT_EQ(st["rounds"], 2);  // inner_steps 2 over 4 steps
  EXPECT_TRUE(st["val_loss"].is_number());
  // Every round was reduced by a peer of the group, never by the router.
  EXPECT_GT(received(f, "p-a0", MsgType::kRoundReduce) + received(f, "p-a1", MsgType::kRoundReduce), 0u);
}

// A large message comes in PARTs (docs/protocol.md#parts): each is a sign of life from its sender,
// so a peer whose message takes longer than the liveness window to arrive is not declared dead,
// while one that falls silent is. The router sends in parts only to those that said they take them.
TEST(Core, EachPartOfALargeMessageKeepsItsSenderAliveAndPartsGoOnlyToThoseThatTakeThem) {
  CoreOptions opt;   // 500 ms x 3: 1.5 s of silence
  RouterCore core(opt);
  auto hello = [&](const PeerId& id, bool parts, msg::Role role = msg::Role::kStage) {
    msg::Hello h;
    h.role = role;
    h.version = wire::kVersion;
    h.name = id;
    h.parts = parts;
    const Actions out = core.on_message(id, msg::make(h, 1), 0);
    for (const Action& a : out)
      if (const auto* s = std::get_if<Send>(&a); s && s->msg.type == MsgType::kWelcome) return msg::read<msg::Welcome>(s->msg).parts;
    ADD_FAILURE() << "no WELCOME for " << id;
    return false;
  };
  EXPECT_TRUE(hello("p-sender", true));
  EXPECT_TRUE(hello("p-whole", false));
  EXPECT_TRUE(hello("c-client", true, msg::Role::kClient));
  EXPECT_TRUE(core.takes_parts("p-sender"));
  EXPECT_FALSE(core.takes_parts("p-whole"));
  EXPECT_TRUE(core.takes_parts("c-client"));
  EXPECT_FALSE(core.takes_parts("p-stranger"));
  auto dead = [&](const Actions& out) {
    std::set<std::string> ids;
    for (const Action& a : out)
      if (const auto* l = std::get_if<Log>(&a); l && l->text.find("is gone") != std::string::npos) ids.insert(l->text);
    return ids;
  };
  // Ten seconds of parts from p-sender, one every 0.5 s; p-whole heartbeats.
  for (double t = 0.5; t <= 10.0; t += 0.5) {
    EXPECT_TRUE(core.on_message("p-sender", wire::Message(MsgType::kPart, 0), t).empty());   // no answer to a part
    core.on_message("p-whole", wire::Message(MsgType::kHeartbeat), t);
    EXPECT_TRUE(dead(core.tick(t + 0.25)).empty()) << t;
  }
  EXPECT_EQ(core.registry().size(), 2u);
  // Then nothing: dead after the window.
  core.on_message("p-whole", wire::Message(MsgType::kHeartbeat), 11.0);
  const auto gone = dead(core.tick(11.6));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_NE(gone.begin()->find("p-sender"), std::string::npos) << *gone.begin();
  // A stranger's part is refused like anything else but HELLO.
  bool refused = false;
  for (const Action& a : core.on_message("p-stranger", wire::Message(MsgType::kPart, 0), 12.0))
    if (const auto* s = std::get_if<Send>(&a); s && s->msg.type == MsgType::kError) refused = msg::read<msg::Error>(s->msg).code == int(WireErrc::kOutOfOrder);
  EXPECT_TRUE(refused);
}

// A stage server counts any message from the router as a sign of life (docs/protocol.md), so
// the router heartbeats only the peers it sent no request since its last round: peers busy
// training get few heartbeats, and none goes two rounds without hearing from the router. With a
// liveness under 3 (a window under three rounds) every peer gets every heartbeat.
TEST(Core, BusyPeersAreNotHeartbeatedButNoneGoesTwoRoundsWithoutWord) {
  for (const int liveness : {3, 1}) {
    CoreOptions opt;
    opt.liveness = liveness;
    FakeSwarm f(opt);
    const std::vector<PeerId> ids = two_by_two(f);
    const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 400));
    ASSERT_GT(job, 0u);
    std::map<PeerId, size_t> seen;
    std::map<PeerId, double> last, longest;
    for (const PeerId& id : ids) last[id] = f.now;
    const double start = f.now;
    while (!done(f, job) && f.now - start < 60) {
      f.run(0.02);
      for (const PeerId& id : ids) {
        if (f.peers.at(id).received.size() == seen[id]) continue;
        seen[id] = f.peers.at(id).received.size();
        longest[id] = std::max(longest[id], f.now - last[id]);
        last[id] = f.now;
      }
    }
    ASSERT_TRUE(done(f, job)) << liveness;
    const double rounds = (f.now - start) / 0.5;
    ASSERT_GT(rounds, 10) << "the job should run for a while";
    for (const PeerId& id : ids) {
      EXPECT_LE(longest[id], 2 * 0.5 + 0.03) << id << " liveness " << liveness;
      const size_t beats = received(f, id, MsgType::kHeartbeat);
      if (liveness >= 3) EXPECT_LT(double(beats), rounds / 2) << id;
      else EXPECT_GE(double(beats), rounds - 1) << id;
    }
  }
}

// async: the backward that is a job step's last at its stage says so, so that its peer steps at
// once; the others, and every backward under sync, do not.
TEST(Core, UnderAsyncAStepsLastBackwardAtEachStageClosesTheStep) {
  for (const std::string schedule : {"async", "sync"}) {
    FakeSwarm f;
    two_by_two(f);
    json spec = FakeSwarm::tiny_spec(2, 4);
    spec["schedule"] = schedule;
    const uint64_t job = f.submit(f.client(), spec);
    ASSERT_TRUE(f.run(30, [&] { return done(f, job); })) << schedule;
    ASSERT_EQ(f.status(job)["microbatches"]["resent"], 0) << schedule;
    // (stage, job step) -> (request id, closes_step) of each training backward sent there.
    std::map<std::pair<int, uint64_t>, std::vector<std::pair<uint64_t, bool>>> sent;
    for (auto& [id, p] : f.peers)
      for (const wire::Message& m : p.received)
        if (m.type == MsgType::kBackward || m.type == MsgType::kForwardLoss) {
          const msg::Hop h = msg::read<msg::Hop>(m);
          sent[{h.stage, h.mb / 2}].emplace_back(m.id, h.closes_step.value_or(false));  // 2 microbatches per step
        }
    ASSERT_EQ(sent.size(), 2u * 4u) << schedule;  // 2 stages x 4 steps
    for (auto& [at, v] : sent) {
      ASSERT_EQ(v.size(), 2u);
      std::sort(v.begin(), v.end());
      EXPECT_FALSE(v[0].second) << schedule << " stage " << at.first << " step " << at.second;
      EXPECT_EQ(v[1].second, schedule == "async") << "stage " << at.first << " step " << at.second;
    }
  }
}

// The router keeps no tokens per microbatch in flight: it samples them each time a hop carries
// them, and every hop of a microbatch carries the same ones: its stage-0 forward and backward the
// microbatch's tokens, its last stage's forward the targets, an evaluation hop the validation split's.
TEST(Core, EveryHopCarriesTheTokensItsMicrobatchSamples) {
  FakeSwarm f;
  two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["eval"]["every_steps"] = 2;
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  spec["data"]["path"] = f.data_path();
  const JobSpec js = parse_job_spec(spec, false);
  const TokenData data = TokenData::load(js.data, js.model.seq_len, js.model.vocab_size);
  // u16 on the wire: every token id of a vocabulary of at most 65,536 fits, in half the bytes.
  auto ints = [](const wire::Tensor& t) {
    EXPECT_EQ(t.desc.dtype, wire::DType::kU16);
    EXPECT_EQ(t.data.size(), size_t(t.desc.numel()) * 2);
    const auto* p = static_cast<const uint16_t*>(t.data.data());
    return std::vector<int32_t>(p, p + t.desc.numel());
  };
  size_t checked[3] = {0, 0, 0};   // stage-0 hops, targets, evaluation hops
  for (auto& [id, p] : f.peers)
    for (const wire::Message& m : p.received) {
      if (m.type != MsgType::kForward && m.type != MsgType::kBackward && m.type != MsgType::kForwardLoss && m.type != MsgType::kEval) continue;
      const msg::Hop h = msg::read<msg::Hop>(m);
      const Microbatch mb = sample_microbatch(data, h.eval ? Split::kVal : Split::kTrain, js.seed, h.mb, js.batch.microbatch_size, js.model.seq_len);
      if (h.stage == 0) {
        ASSERT_FALSE(m.tensors.empty());
        EXPECT_EQ(ints(m.tensors[0]), mb.x) << "microbatch " << h.mb << " at stage 0, message type " << int(m.type);
        checked[h.eval ? 2 : 0]++;
      }
      if (h.stage == 1) {
        ASSERT_EQ(m.tensors.size() + m.refs.size(), 2u) << "the stage input and the targets";
        EXPECT_EQ(ints(m.tensors.back()), mb.y) << "microbatch " << h.mb << "'s targets";
        checked[1]++;
      }
    }
  EXPECT_EQ(checked[0], 2u * 8u);   // a forward and a backward for each of 8 microbatches
  EXPECT_EQ(checked[1], 8u + checked[2]);
  EXPECT_GT(checked[2], 0u);
}

// Under async with more than a job step in flight a DiLoCo round runs alongside training (the
// default diloco.rounds "auto"): hops are sent between a round's ROUND_BEGIN and its
// ROUND_APPLYs, and each round opens once every microbatch of its step has completed. Under sync,
// and under async with "at_barrier", the pipeline is flushed for it: no hop is sent while a
// round is open.
TEST(Core, UnderAsyncARoundDoesNotDrainThePipeline) {
  for (const std::string schedule : {"async", "async at_barrier", "sync"}) {
    FakeSwarm f;
    two_by_two(f);
    json spec = FakeSwarm::tiny_spec(2, 12);
    spec["schedule"] = schedule == "sync" ? "sync" : "async";
    if (schedule == "async at_barrier") spec["diloco"]["rounds"] = "at_barrier";
    spec["max_inflight"] = 8;   // 4 job steps of 2 microbatches
    const uint64_t job = f.submit(f.client(), spec);
    ASSERT_TRUE(f.run(60, [&] { return done(f, job); })) << schedule;
    const json st = f.status(job);
    EXPECT_EQ(st["microbatches"]["lost"], 0) << schedule;
    EXPECT_EQ(st["rounds"], 6) << schedule;   // inner_steps 2 over 12 steps
    std::vector<int> round_steps;
    for (const auto& h : st["history"])
      if (h.contains("round")) round_steps.push_back(h["step"].get<int>());
    EXPECT_EQ(round_steps, (std::vector<int>{2, 4, 6, 8, 10, 12})) << schedule;
    // Request ids grow with every request the router sends: what was sent while each round was
    // open, and which training microbatches were answered before it opened.
    std::map<uint64_t, std::pair<uint64_t, uint64_t>> open;   // round -> (first BEGIN id, last APPLY id)
    std::vector<std::pair<uint64_t, uint64_t>> hops;           // (request id, microbatch) of each training hop
    for (auto& [id, p] : f.peers)
      for (const wire::Message& m : p.received) {
        if (m.type == MsgType::kRoundBegin || m.type == MsgType::kRoundApply) {
          const uint64_t round = m.type == MsgType::kRoundBegin ? msg::read<msg::RoundBegin>(m).round : msg::read<msg::RoundApply>(m).round;
          auto it = open.emplace(round, std::make_pair(m.id, m.id)).first;
          if (m.type == MsgType::kRoundBegin) it->second.first = std::min(it->second.first, m.id);
          else it->second.second = std::max(it->second.second, m.id);
        }
        if (m.type == MsgType::kForward || m.type == MsgType::kForwardLoss || m.type == MsgType::kBackward)
          hops.emplace_back(m.id, msg::read<msg::Hop>(m).mb);
      }
    ASSERT_EQ(open.size(), 6u) << schedule;
    size_t during = 0;
    for (const auto& [round, ids] : open) {
      for (const auto& [id, mb] : hops) during += id > ids.first && id < ids.second;
      // Every microbatch of the round's step and before it was sent its last hop before the round began.
      const uint64_t step = uint64_t(round_steps[size_t(round - 1)]);
      for (const auto& [id, mb] : hops)
        if (mb < step * 2) EXPECT_LT(id, ids.first) << schedule << " round " << round << " microbatch " << mb;
    }
    if (schedule == "async") EXPECT_GT(during, 0u) << "no hop was sent while a round was open";
    else EXPECT_EQ(during, 0u) << schedule << " sent hops while a round was open";
  }
}

// A stage of more than Flights::kSampleAbove ready peers dispatches each hop among a seeded
// sample of them plus the forward's peer: the work still spreads over the whole stage, a
// backward still goes where its forward's graph is cached, and the same run sends the same hops.
TEST(Core, InAStageOfManyPeersHopsGoToASampleAndBackwardsFindTheirForwardsPeer) {
  auto run = [](std::vector<std::tuple<PeerId, int, uint64_t>>& order) {
    FakeSwarm f;
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < 70; ++i) f.join("s" + std::to_string(s) + "-" + std::to_string(i), s);
    json spec = FakeSwarm::tiny_spec(2, 6);
    spec["schedule"] = "async";
    spec["batch"] = {{"batch_size", 64}, {"microbatch_size", 2}};   // 32 microbatches per step, 32 in flight
    spec["diloco"]["inner_steps"] = 100;                             // no round in the run
    const uint64_t job = f.submit(f.client(), spec);
    ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
    EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
    std::map<uint64_t, PeerId> forward_of;   // stage 0's forward of each microbatch
    std::set<PeerId> busy;
    size_t backwards = 0, at_forwards_peer = 0;
    for (auto& [id, p] : f.peers)
      for (const wire::Message& m : p.received) {
        if (m.type != MsgType::kForward && m.type != MsgType::kBackward) continue;
        const msg::Hop h = msg::read<msg::Hop>(m);
        if (h.stage != 0 || h.eval) continue;
        order.emplace_back(id, int(m.type), m.id);
        if (m.type == MsgType::kForward) forward_of[h.mb] = id, busy.insert(id);
      }
    for (auto& [id, p] : f.peers)
      for (const wire::Message& m : p.received)
        if (m.type == MsgType::kBackward) {
          const msg::Hop h = msg::read<msg::Hop>(m);
          backwards++;
          at_forwards_peer += forward_of.at(h.mb) == id;
        }
    EXPECT_EQ(backwards, 6u * 32u);
    EXPECT_EQ(at_forwards_peer, backwards);
    EXPECT_GT(busy.size(), 3 * router::Flights::kSampled) << "forwards went to " << busy.size() << " of 70 peers";
  };
  std::vector<std::tuple<PeerId, int, uint64_t>> first, second;
  run(first);
  run(second);
  std::sort(first.begin(), first.end());
  std::sort(second.begin(), second.end());
  EXPECT_EQ(first, second);
}

// A peer whose own figure says it is slow (its load was timed cold, or while its host was busy)
// is still tried once the router has a measured peer on the stage, and then timed as it is.
TEST(Core, APeerThatClaimsToBeSlowIsTriedAndMeasuredAnyway) {
  FakeSwarm f;
  const std::vector<PeerId> ids = two_by_two(f);
  // Every peer really takes 1 ms per unit; a0 says so, a1 claims 1000.
  f.peers.at(ids[0]).claims_ms_per_unit = 1;
  f.peers.at(ids[1]).claims_ms_per_unit = 1000;
  f.run(1);                                        // the router has heard the claims
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  EXPECT_GT(received(f, ids[1], MsgType::kForward), 0u) << "a1 was never sent a forward";
  const json peers = f.core.peers_json(0, 100, f.now);   // kept: a loop over a temporary's member would dangle
  for (const json& p : peers["peers"])
    if (p["name"] == "a1") {
      EXPECT_LT(p["ms_per_unit"].get<double>(), 100.0) << p.dump();
    }
}

// The dispatcher queues at most routing.max_queued_s of a peer's work at it (at least 4 units
// before it is measured): a peer that takes forwards and answers none holds 4 of the 16
// microbatches in flight, and its stage mate takes the rest as it makes room. Without the
// bound the silent peer, counted at its mate's speed, takes one in every few until deadlines.
TEST(Core, APeerHoldsAtMostItsQueuesWorthAndTheRestWaitForRoom) {
  for (const double max_queued_s : {1.0, 0.0}) {
    FakeSwarm f;
    const std::vector<PeerId> ids = two_by_two(f);
    json spec = FakeSwarm::tiny_spec(2, 4);
    spec["batch"]["batch_size"] = 32;   // 16 microbatches in flight
    spec["routing"]["max_queued_s"] = max_queued_s;
    const uint64_t job = f.submit(f.client(), spec);
    f.peers.at(ids[0]).silent_from = MsgType::kForward;
    f.run(1);   // less than a hop's deadline
    const size_t held = received(f, ids[0], MsgType::kForward);
    if (max_queued_s > 0) {
      EXPECT_EQ(held, 4u) << "a0 was sent " << held << " forwards it never answered";
      EXPECT_EQ(f.status(job)["microbatches"]["completed"], 12);   // all but a0's
    } else {
      EXPECT_GT(held, 4u);
    }
    f.kill(ids[0]);
    ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
    EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
  }
}

// With every peer of stage 0 at its bound the other microbatches wait at the router, the status
// says how many, and they go out once the peers answer again.
TEST(Core, WithEveryPeerFullTheRestWaitAtTheRouterUntilOneHasRoom) {
  FakeSwarm f;
  const std::vector<PeerId> ids = two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["batch"]["batch_size"] = 32;   // 16 microbatches in flight
  const uint64_t job = f.submit(f.client(), spec);
  f.peers.at(ids[0]).silent_from = MsgType::kForward;
  f.peers.at(ids[1]).silent_from = MsgType::kForward;
  f.run(1);
  EXPECT_EQ(received(f, ids[0], MsgType::kForward), 4u);
  EXPECT_EQ(received(f, ids[1], MsgType::kForward), 4u);
  EXPECT_EQ(f.status(job)["microbatches"]["in_flight"], 16);
  EXPECT_EQ(f.status(job)["microbatches"]["max_inflight"], 16);   // one job step, derived
  EXPECT_EQ(f.status(job)["microbatches"]["waiting"], 8);
  for (const PeerId& id : {ids[0], ids[1]}) {
    f.peers.at(id).silent_from.reset();
    f.peers.at(id).silent = false;   // what they were sent is lost: those hops pass their deadlines
  }
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
  EXPECT_EQ(f.status(job)["microbatches"]["waiting"], 0);
}

// A hop that one peer rejected waits for its stage mate's second opinion while the mate is full,
// and the peer that rejected it goes on taking the stage's other hops meanwhile.
TEST(Core, AHopWaitingForAFullPeerDoesNotHoldUpItsStage) {
  FakeSwarm f;
  f.join("a0", 0);
  const PeerId b0 = f.join("b0", 1), b1 = f.join("b1", 1);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["batch"]["batch_size"] = 32;   // 16 microbatches a step...
  spec["max_inflight"] = 4;           // ...4 in flight: the rest reach stage 1 after the rejection
  const uint64_t job = f.submit(f.client(), spec);
  f.peers.at(b1).silent_from = MsgType::kForwardLoss;   // fills its queue (3 units a hop) and answers none
  f.peers.at(b0).quirks.bad_input_reports = 1;          // calls its first input bad: a second opinion is due
  f.run(1);   // less than a hop's deadline
  EXPECT_EQ(received(f, b1, MsgType::kForwardLoss), 2u);
  // All but b1's two and the one waiting for b1's opinion.
  EXPECT_EQ(f.status(job)["microbatches"]["completed"], 13) << f.status(job)["microbatches"].dump();
  EXPECT_EQ(f.status(job)["microbatches"]["waiting"], 1);
}

// Static routing keeps every microbatch on its pipeline whatever the queues: the queue bound,
// which only moves work between peers of a stage, does not apply there.
TEST(Core, StaticRoutingKeepsEachMicrobatchOnItsPipelineThoughItsPeerIsBusy) {
  FakeSwarm f;
  const std::vector<PeerId> ids = two_by_two(f);   // pipeline 0: a0, b0; pipeline 1: a1, b1
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["batch"]["batch_size"] = 32;   // 16 microbatches in flight
  spec["routing"]["mode"] = "static";
  spec["routing"]["start_peers"] = 2;   // both pipelines from the first hop
  const uint64_t job = f.submit(f.client(), spec);
  f.peers.at(ids[0]).silent_from = MsgType::kForward;
  f.run(1);
  EXPECT_EQ(received(f, ids[0], MsgType::kForward), 8u);   // every even microbatch, unanswered
  for (const wire::Message& m : f.peers.at(ids[1]).received)
    if (m.type == MsgType::kForward) EXPECT_EQ(msg::read<msg::Hop>(m).mb % 2, 1u);
  EXPECT_EQ(f.status(job)["microbatches"]["completed"], 8);
}

TEST(Core, APeerDyingMidForwardHasItsHopResentElsewhere) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  f.peers.at("p-a0").silent_from = MsgType::kForward;  // takes a FORWARD and never answers...
  ASSERT_TRUE(f.run(5, [&] { return received(f, "p-a0", MsgType::kForward) > 0; }));
  f.kill("p-a0");                                      // ...then dies
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  EXPECT_TRUE(f.logged("peer a0 (p-a0) is gone"));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GE(st["microbatches"]["resent"], 1);
  EXPECT_EQ(st["peers_per_stage"], json::array({1, 2}));
}

TEST(Core, APeerDyingMidBackwardHasItsHopResentElsewhere) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  f.peers.at("p-a1").silent_from = MsgType::kBackward;
  ASSERT_TRUE(f.run(5, [&] { return received(f, "p-a1", MsgType::kBackward) > 0; }));
  f.kill("p-a1");
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GE(st["microbatches"]["resent"], 1);
}

TEST(Core, APeerDyingMidRoundLeavesTheRoundToTheOthers) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  // b1 takes its ROUND_BEGIN and dies before answering; the group's round goes on without it.
  ASSERT_TRUE(f.run(20, [&] { return received(f, "p-b1", MsgType::kRoundBegin) > 0; }));
  f.peers.at("p-b1").alive = false;
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["rounds"], 2);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(received(f, "p-b0", MsgType::kRoundApply), 2u);
}

TEST(Core, AReducerDyingHandsTheReductionToAnotherPeer) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  // a0 joined first, so it reduces stage 0's round: it goes silent, then dies.
  f.peers.at("p-a0").auto_answer = true;
  ASSERT_TRUE(f.run(20, [&] { return received(f, "p-a0", MsgType::kRoundBegin) > 0; }));
  f.peers.at("p-a0").silent = true;
  ASSERT_TRUE(f.run(20, [&] { return received(f, "p-a0", MsgType::kRoundReduce) > 0; }));
  f.kill("p-a0");
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  EXPECT_EQ(received(f, "p-a1", MsgType::kRoundReduce), 1u);
  EXPECT_EQ(f.status(job)["rounds"], 1);
}

TEST(Core, APeerDyingMidCheckpointSkipsThatCheckpointAndKeepsTheLast) {
  FakeSwarm f;
  two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["checkpoint"] = {{"dir", "/ck"}, {"every_steps", 2}};
  spec["routing"] = {{"rebalance", false}};
  const uint64_t job = f.submit(f.client(), spec);
  // The snapshot for the step-2 checkpoint goes to one peer per stage; stage 1's dies holding it.
  ASSERT_TRUE(f.run(20, [&] {
    for (const char* id : {"p-b0", "p-b1"})
      for (const auto& m : f.peers.at(id).received)
        if (m.type == MsgType::kStateRequest && msg::read<msg::StateRequest>(m).full) return true;
    return false;
  }));
  const PeerId asked = received(f, "p-b0", MsgType::kStateRequest) ? "p-b0" : "p-b1";
  f.kill(asked);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  EXPECT_TRUE(f.logged("checkpoint at step 2 skipped: no current state for stage 1"));
  ASSERT_EQ(f.checkpoints["/ck"].size(), 1u);
  EXPECT_EQ(f.checkpoints["/ck"][0].step, 4);  // the final one, from the survivor
  EXPECT_EQ(f.status(job)["checkpoints"]["written"], 1);
}

TEST(Core, AStateThatTakesSecondsToArriveStillMakesTheCheckpoint) {
  // Every stage's state comes to the router at once over its link; on a slow one (a 16 Mbit/s
  // router link, docs/hosts.md) each arrives seconds after it was asked for, past a hop's
  // deadline (2 s here) but inside the collection's (diloco.deadline_s).
  FakeSwarm f;
  two_by_two(f);
  for (auto& [id, p] : f.peers) p.reply_after_s[MsgType::kStateRequest] = 4.0;
  json spec = FakeSwarm::tiny_spec(2, 4);
  ASSERT_EQ(spec["diloco"]["deadline_s"], 5);
  spec["checkpoint"] = {{"dir", "/ck"}, {"every_steps", 2}};
  spec["routing"] = {{"rebalance", false}};
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(120, [&] { return done(f, job); }));
  EXPECT_FALSE(f.logged("skipped: no current state"));
  EXPECT_FALSE(f.logged("(snapshot)"));
  ASSERT_EQ(f.checkpoints["/ck"].size(), 2u);
  for (const Checkpoint& ck : f.checkpoints["/ck"]) EXPECT_EQ(ck.stages.size(), 2u);
  EXPECT_EQ(f.checkpoints["/ck"][0].step, 2);
  EXPECT_EQ(f.checkpoints["/ck"][1].step, 4);
}

TEST(Core, OuterGradientsThatTakeSecondsToArriveStillCountInTheirRound) {
  // Through the router (peers that take no fetches), every member's outer gradient comes to it
  // at once (4 x 6.3 MB here), and the parts to reduce and the means leave it at once; on a slow
  // link each answer comes later than a deadline counting its own bytes alone allows (2 s plus
  // 4 x its bytes at 100 Mbit/s), but within one that counts the round's.
  FakeSwarm f;
  two_by_two(f);
  for (auto& [id, p] : f.peers) {
    p.reply_after_s[MsgType::kRoundBegin] = 7.0;
    p.reply_after_s[MsgType::kRoundReduce] = 7.0;
    p.reply_after_s[MsgType::kRoundApply] = 3.0;
  }
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["model"] = {{"d_model", 256}, {"n_head", 2}, {"n_layer", 4}, {"seq_len", 8}};
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(200, [&] { return done(f, job); }));
  EXPECT_FALSE(f.logged("no outer gradient"));
  EXPECT_FALSE(f.logged("found no peer to reduce"));
  EXPECT_FALSE(f.logged("passed its deadline"));
  EXPECT_EQ(f.status(job)["rounds"], 2);
}

TEST(Core, AReplyStillComingInPartsIsWaitedForPastEveryDeadline) {
  // On a link slower than the deadlines allow for (they assume 100 Mbit/s), each outer gradient
  // and each stage's state takes 40 s to reach the router: past the requests' deadlines, the
  // round's (diloco.deadline_s, 5 s here) and the snapshot's. Sent in PARTs, each part says the
  // reply is on its way, and every deadline waits for it; so it does when the heartbeats say a
  // large message from the router is still reaching the peer (`receiving`: the reply waits
  // behind it). Sent whole, the round goes on without them.
  for (const char* mode : {"parts", "receiving", "whole"}) {
    SCOPED_TRACE(mode);
    const bool parts = std::string(mode) != "whole";
    FakeSwarm f;
    two_by_two(f);
    for (auto& [id, p] : f.peers) {
      p.reply_after_s[MsgType::kRoundBegin] = 40.0;
      p.reply_after_s[MsgType::kStateRequest] = 40.0;
      p.parts = std::string(mode) == "parts";
      p.receiving = std::string(mode) == "receiving";
    }
    json spec = FakeSwarm::tiny_spec(2, 4);
    spec["checkpoint"] = {{"dir", "/ck"}, {"every_steps", 2}};
    spec["routing"] = {{"rebalance", false}};
    const uint64_t job = f.submit(f.client(), spec);
    ASSERT_TRUE(f.run(400, [&] { return done(f, job); }));
    EXPECT_EQ(f.logged("no outer gradient"), !parts);
    EXPECT_EQ(f.logged("passed its deadline"), !parts);
    EXPECT_EQ(f.logged("(snapshot)"), !parts);   // a snapshot request that passed its deadline
    EXPECT_EQ(f.status(job)["rounds"], 2);
    if (parts) {
      ASSERT_EQ(f.checkpoints["/ck"].size(), 2u);
      for (const Checkpoint& ck : f.checkpoints["/ck"]) EXPECT_EQ(ck.stages.size(), 2u);
    }
    // No peer was declared dead: they heartbeat throughout, parts or not.
    EXPECT_FALSE(f.logged("is gone"));
  }
}

TEST(Core, AJobWithoutCheckpointsAsksForNoSnapshotAtItsEnd) {
  // Rounds at steps 2 and 4 (the end). The snapshot after the first keeps the stages' state for a
  // peer that must be restored; one after the last would move every stage's state to the router
  // as the job finishes, to be dropped with it.
  FakeSwarm f;
  two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["routing"] = {{"rebalance", false}};
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  ASSERT_EQ(f.status(job)["rounds"], 2);
  size_t snapshots = 0;
  for (const auto& [id, p] : f.peers)
    for (const auto& m : p.received)
      if (m.type == MsgType::kStateRequest && msg::read<msg::StateRequest>(m).full) snapshots++;
  EXPECT_EQ(snapshots, 2u);   // one peer of each stage, once
}

TEST(Core, AStageLosingItsLastPeerPausesAndResumesWhenOneJoins) {
  FakeSwarm f;
  const PeerId a = f.join("a", 0);
  const PeerId b = f.join("b", 1);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 6));
  ASSERT_TRUE(f.run(20, [&] { return f.status(job)["rounds"] >= 1 && f.status(job)["step"] >= 3; }));
  f.kill(b);
  ASSERT_TRUE(f.run(5, [&] { return f.status(job)["reason"].get<std::string>().find("paused") != std::string::npos; }));
  EXPECT_EQ(f.status(job)["reason"], "paused: stage(s) 1 have no live peer; start a stage server for them");
  const int paused_at = f.status(job)["step"];
  f.run(2);
  EXPECT_EQ(f.status(job)["step"], paused_at);  // nothing moves while the stage is empty
  f.join("c", 1);
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  ASSERT_EQ(st["stage_restores"].size(), 1u);  // the newcomer took the stage's snapshot
  EXPECT_EQ(st["stage_restores"][0]["stage"], 1);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GT(received(f, "p-c", MsgType::kStateLoad), 0u);
  (void)a;
}

TEST(Core, AJobNoPeerCanHoldSaysWhichStageNeedsMoreMemoryUntilOneJoinsThatCan) {
  FakeSwarm f;
  f.peers_memory_bytes = 1000;   // no stage of even the tiny job fits
  f.join("pinned", 0);
  f.join("free");
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  f.run(1);
  // Neither peer was placed; the reason is their memory, not a lack of peers.
  const std::string reason = f.status(job)["reason"];
  EXPECT_NE(reason.find("waiting for memory: stage 0 needs"), std::string::npos) << f.status(job).dump();
  EXPECT_NE(reason.find("the largest peer, free, has 1000 bytes free"), std::string::npos) << reason;   // by name
  EXPECT_TRUE(f.logged("peer pinned pinned stage 0 but its device cannot hold it; it stays idle"));
  f.peers_memory_bytes = int64_t(1) << 30;
  f.join("big-0");
  f.join("big-1");
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); })) << f.status(job).dump();
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
}

TEST(Core, TheFirstStepWaitsForStartPeersThenStartsWithWhatItHas) {
  FakeSwarm f;
  f.join("a0", 0);
  f.join("b0", 1);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["routing"]["start_peers"] = 2;
  spec["routing"]["start_wait_s"] = 3;
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(1, [&] { return f.status(job)["reason"].get<std::string>().find("start_peers") != std::string::npos; }));
  EXPECT_EQ(f.status(job)["state"], "loading");
  EXPECT_NE(f.status(job)["reason"].get<std::string>().find("stage 0 has 1 of 2 ready peers"), std::string::npos)
      << f.status(job)["reason"];
  f.join("a1", 0);
  ASSERT_TRUE(f.run(1, [&] { return f.status(job)["reason"].get<std::string>().find("stage 1 has 1 of 2") != std::string::npos; }));
  f.run(1);
  EXPECT_EQ(f.status(job)["state"], "loading");   // still waiting for stage 1's second peer
  // The wait ends: it starts with the peers it has, and finishes.
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
}

TEST(Core, TheFirstStepStartsAsSoonAsEveryStageHasStartPeers) {
  FakeSwarm f;
  two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 4);
  spec["routing"]["start_peers"] = 2;
  spec["routing"]["start_wait_s"] = 1000;
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));   // far sooner than the wait
}

// A peer that loads its stage while a round is open syncs once the round is applied: a donor's
// state taken before the apply would leave it one round behind the group, and as the older peer
// it would win the next vote's tie and spread the stale state (a real swarm's failure under load).
TEST(Core, APeerLoadedDuringARoundSyncsOnceTheRoundIsApplied) {
  FakeSwarm f;
  two_by_two(f);
  // a1 goes silent at its first ROUND_BEGIN (alive, heartbeating): round 1 stays open until a1's
  // delta is given up on.
  f.peers.at("p-a1").silent_from = MsgType::kRoundBegin;
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 8));
  ASSERT_TRUE(f.run(20, [&] { return received(f, "p-a1", MsgType::kRoundBegin) > 0; }));
  const PeerId joiner = f.join("a2", 0);
  ASSERT_TRUE(f.run(1, [&] { return received(f, joiner, MsgType::kLoadStage) > 0; }));
  f.run(0.3);   // loaded, and waiting for the round
  ASSERT_EQ(received(f, "p-a0", MsgType::kRoundApply), 0u);   // round 1 is still open
  EXPECT_EQ(received(f, joiner, MsgType::kStateLoad), 0u);
  f.peers.at("p-a1").silent = false;
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  // Synced once, after the round: a state taken during it would have been synced again.
  EXPECT_EQ(received(f, joiner, MsgType::kStateLoad), 1u);
  EXPECT_TRUE(f.logged("peer a2 synced stage 0"));
  EXPECT_FALSE(f.logged("syncing it again"));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["rounds"], 4);
}

TEST(Core, TheRebalancerWaitsForAnOpenRoundThenMoves) {
  FakeSwarm f;
  // Stage 0 has three peers, stage 1 one emulated slow one: the bottleneck.
  f.join("a0", -1, 0);
  f.join("a1", -1, 0);
  f.join("a2", -1, 0);
  f.join("b0", -1, 1);
  json spec = FakeSwarm::tiny_spec(2, 400);
  spec["schedule"] = "async";
  spec["diloco"] = {{"inner_steps", 4}, {"deadline_s", 5}, {"warm_start_steps", 0}, {"streaming", {{"fragments", 1}, {"overlap_steps", 2}}}};
  spec["routing"] = {{"rebalance", true}, {"rebalance_period_s", 1}, {"cooldown_s", 0}, {"min_gain", 0.1}};
  const uint64_t job = f.submit(f.client(), spec);
  // Overlapped rounds keep a round open much of the time; a move must never happen while one is.
  bool waited = false;
  ASSERT_TRUE(f.run(120, [&] {
    waited |= f.logged("rebalance: a round is open; moves wait until it is applied");
    return !f.status(job)["routing"]["moves"].empty();
  }));
  EXPECT_TRUE(waited);
  const json mv = f.status(job)["routing"]["moves"][0];
  EXPECT_EQ(mv["from"], 0);
  EXPECT_EQ(mv["to"], 1);
  EXPECT_FALSE(mv["reason"].get<std::string>().empty());
}

TEST(Core, ARestartedRouterResumesItsJobsFromTheStateDir) {
  CoreOptions opt;
  opt.state_dir = "/state";
  FakeSwarm f(opt);
  two_by_two(f);
  json spec = FakeSwarm::tiny_spec(2, 6);
  spec["checkpoint"] = {{"every_steps", 2}};
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(30, [&] { return f.status(job)["checkpoints"]["written"] >= 1; }));
  const std::string record = f.files.at("/state/jobs/" + std::to_string(job) + "/job.json");
  EXPECT_EQ(json::parse(record)["state"], "running");

  // A new core, as a restarted router: it reads the record and continues from the checkpoint.
  FakeSwarm g(opt);
  g.checkpoints = f.checkpoints;
  const json rec = json::parse(record);
  StoredJob sj{rec["id"].get<uint64_t>(), rec["state"], rec["spec"], rec["checkpoint_dir"]};
  EXPECT_EQ(sj.checkpoint_dir, "/state/jobs/" + std::to_string(job) + "/checkpoints");
  Actions a = g.core.restore({sj}, g.now);
  ASSERT_EQ(a.size(), 1u);
  const LoadJob& l = std::get<LoadJob>(a[0]);
  EXPECT_EQ(l.checkpoint_dir, sj.checkpoint_dir);
  JobLoaded r;
  r.job = l.job;
  r.data = std::make_shared<TokenData>(TokenData::load(l.spec->data, l.spec->model.seq_len, l.spec->model.vocab_size));
  LoadedCheckpoint lc;
  lc.ckpt = f.checkpoints.at(sj.checkpoint_dir).back();
  lc.path = sj.checkpoint_dir + "/step-2";
  r.checkpoint = lc;
  Actions b = g.core.on_job_loaded(r, g.now);
  two_by_two(g);
  ASSERT_TRUE(g.run(30, [&] { return done(g, job); }));
  const json st = g.status(job);
  EXPECT_EQ(st["resumed"]["step"], lc.ckpt.step);
  EXPECT_EQ(st["step"], 6);
  // Every stage started from the checkpoint's state.
  EXPECT_GT(received(g, "p-a0", MsgType::kStateLoad) + received(g, "p-a1", MsgType::kStateLoad), 0u);
}

TEST(Core, ALyingPeerIsQuarantinedAndItsHopsAreRedone) {
  FakeSwarm f;
  two_by_two(f);
  f.peers.at("p-a1").quirks.wrong_shape = {2, 8, 15};  // activations of the wrong width
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 6));
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  ASSERT_EQ(st["quarantined"].size(), 1u);
  EXPECT_EQ(st["quarantined"][0]["peer"], "a1");
  EXPECT_NE(st["quarantined"][0]["reason"].get<std::string>().find("not f32 [2, 8, 16]"), std::string::npos);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GE(st["integrity_failures"], 3);
}

TEST(Core, ABadInputReportNeedsASecondOpinionBeforeItsMakerIsBlamed) {
  FakeSwarm f;
  two_by_two(f);
  // b0 claims the stage inputs it gets are bad. b1 takes them: b0 was wrong, and is blamed.
  f.peers.at("p-b0").quirks.bad_input_reports = 1000;
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  ASSERT_EQ(st["quarantined"].size(), 1u);
  EXPECT_EQ(st["quarantined"][0]["peer"], "b0");
  EXPECT_NE(st["quarantined"][0]["reason"].get<std::string>().find("reported a good input as bad"), std::string::npos);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
}

TEST(Core, AnInputTwoPeersRejectIsBlamedOnItsMaker) {
  FakeSwarm f;
  two_by_two(f);
  f.peers.at("p-b0").quirks.bad_input_reports = 1;
  f.peers.at("p-b1").quirks.bad_input_reports = 1;
  json spec = FakeSwarm::tiny_spec(2, 2);
  spec["max_inflight"] = 1;  // one microbatch: both reports are about the same input
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["integrity_failures"], 1);  // the stage-0 peer that made the input
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_TRUE(st["quarantined"].empty());
}

// ---- one message from anyone used to break the router; now it costs that message ----

TEST(CoreBugs, AHeartbeatWithATextSpeedIsRefusedAndCounted) {
  FakeSwarm f;
  const PeerId p = f.join("x");
  const uint64_t before = f.core.bad_messages();
  f.deliver(p, wire::json_message(MsgType::kHeartbeat, 0, 0, {{"ms_per_unit", "x"}}));
  EXPECT_EQ(f.core.bad_messages(), before + 1);
  const auto& got = f.peers.at(p).received.back();
  ASSERT_EQ(got.type, MsgType::kError);
  EXPECT_NE(msg::read<msg::Error>(got).message.find("HEARTBEAT.ms_per_unit must be a number"), std::string::npos);
  f.run(1);  // ticks use the peer's speed: nothing throws
}

TEST(CoreBugs, AResultWithATextComputeTimeFailsItsHopWhichIsResent) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  f.peers.at("p-a0").auto_answer = false;  // answers by hand below
  ASSERT_TRUE(f.run(5, [&] { return received(f, "p-a0", MsgType::kForward) > 0; }));
  const wire::Message& fwd = last_of(f, "p-a0", MsgType::kForward);
  f.deliver("p-a0", wire::json_message(MsgType::kResult, fwd.id, fwd.attempt, {{"compute_ms", "x"}}));
  EXPECT_TRUE(f.logged("peer a0 sent a malformed RESULT: RESULT.compute_ms must be a number"));
  f.peers.at("p-a0").auto_answer = true;
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));  // the microbatch did not stay "sent" forever
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
}

TEST(CoreBugs, ATransportBenchmarkBeyondTheLimitsIsRefused) {
  FakeSwarm f;
  const PeerId c = f.client();
  f.deliver(c, wire::json_message(MsgType::kSubmit, 5, 0, {{"bench_transport", {{"bytes", 4096}, {"count", 9e18}, {"inflight", -1}}}}));
  const wire::Message rep = f.last_reply(c);
  ASSERT_EQ(rep.type, MsgType::kError);
  EXPECT_NE(msg::read<msg::Error>(rep).message.find("'count' must be an integer in [1, 10000000]"), std::string::npos);
  json spec = FakeSwarm::tiny_spec();
  spec["max_inflight"] = 2147483647;
  EXPECT_EQ(f.submit(c, spec), 0u);
  const msg::Error e = msg::read<msg::Error>(f.last_reply(c));
  EXPECT_EQ(e.name, "bad_job_spec");
  EXPECT_NE(e.message.find("max_inflight: 2147483647 is over the limit of 4096"), std::string::npos);
}

TEST(CoreBugs, PeersBeyondTheLimitAreRefusedAndPeersRepliesArePaged) {
  CoreOptions opt;
  opt.max_peers = 3;
  FakeSwarm f(opt);
  for (const char* n : {"a", "b", "c"}) f.join(n);
  f.join("d");
  EXPECT_EQ(f.core.registry().size(), 3u);
  EXPECT_EQ(f.peers.at("p-d").received.back().type, MsgType::kError);
  const json page = f.core.peers_json(1, 1, f.now);
  EXPECT_EQ(page["total"], 3);
  ASSERT_EQ(page["peers"].size(), 1u);
  EXPECT_EQ(page["peers"][0]["name"], "b");
}

TEST(CoreBugs, FloatsWhereIntegersBelongAndTinyComputeTimesCannotBreakRouting) {
  FakeSwarm f;
  two_by_two(f);
  const PeerId c = f.client();
  f.deliver(c, wire::json_message(MsgType::kStatus, 9, 0, {{"job_id", 1e300}}));
  EXPECT_NE(msg::read<msg::Error>(f.last_reply(c)).message.find("STATUS.job_id must be an unsigned integer"), std::string::npos);
  const uint64_t job = f.submit(c, FakeSwarm::tiny_spec(2, 2));
  // A peer that claims 1e-300 ms per hop is believed no further than 4x what the router sees.
  f.peers.at("p-a0").auto_answer = false;
  ASSERT_TRUE(f.run(5, [&] { return received(f, "p-a0", MsgType::kForward) > 0; }));
  f.run(0.2);
  wire::Message& fwd = const_cast<wire::Message&>(last_of(f, "p-a0", MsgType::kForward));
  msg::Result r;
  r.compute_ms = 1e-300;
  wire::Message rep = msg::make(r, fwd.id, fwd.attempt);
  wire::Tensor out = wire::make_tensor(wire::DType::kF32, {2, 8, 16}, compression::CodecSpec{}, 2 * 8 * 16 * 4);
  std::memset(out.data.data(), 0, 2 * 8 * 16 * 4);
  wire::seal(out);
  rep.tensors.push_back(std::move(out));
  f.deliver("p-a0", std::move(rep));
  const Peer* p = f.core.registry().find("p-a0");
  ASSERT_NE(p, nullptr);
  EXPECT_GE(p->ms_per_unit, 0.2 * 1000 / 4 / 2);  // observed ~200 ms for at most 2 units queued
  EXPECT_NO_THROW(f.status(job));
  f.peers.at("p-a0").auto_answer = true;
  EXPECT_TRUE(f.run(30, [&] { return done(f, job); }));
}

TEST(CoreBugs, AStrangerGetsNothingButHello) {
  FakeSwarm f;
  const uint64_t before = f.core.bad_messages();
  EXPECT_FALSE(f.core.accepts("stranger", MsgType::kSubmit));
  EXPECT_TRUE(f.core.accepts("stranger", MsgType::kHello));
  f.deliver("stranger", wire::Message(MsgType::kResult, 3));
  EXPECT_EQ(f.core.bad_messages(), before + 1);
}

// The error table holds: a negative or fractional job id is malformed, not "no job" or state none.
TEST(CoreBugs, NegativeAndFractionalJobIdsAreMalformed) {
  FakeSwarm f;
  const PeerId c = f.client();
  for (const json& id : {json(-1), json(1.0)}) {
    f.deliver(c, wire::json_message(MsgType::kStatus, 5, 0, {{"job_id", id}}));
    const wire::Message& r = f.last_reply(c);
    ASSERT_EQ(r.type, MsgType::kError) << id;
    EXPECT_EQ(msg::read<msg::Error>(r).code, int(WireErrc::kMalformed)) << id;
  }
}

// A RESULT from a peer for a request that went to another peer is foreign: not a duplicate.
TEST(CoreBugs, AForeignReplyIsNotCountedAsADuplicate) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json before = f.status(job);
  const uint64_t bad = f.core.bad_messages();
  // b1 answers the FORWARD that went to a0.
  const wire::Message& fwd = last_of(f, "p-a0", MsgType::kForward);
  msg::Result r;
  r.mb = 0;
  f.deliver("p-b1", msg::make(r, fwd.id, fwd.attempt));
  EXPECT_EQ(f.status(job)["microbatches"]["duplicates"], before["microbatches"]["duplicates"]);
  EXPECT_EQ(f.core.bad_messages(), bad + 1);
  EXPECT_TRUE(f.logged("which was not sent to it"));
}

// Two stage servers advertising one listen address would each take the other's tensors for its
// own (a reference names its holder by address): the second is refused, with what to fix, until
// the first is gone (a restarted server with a new routing id gets in then).
TEST(CoreBugs, ASecondPeerAtAListenAddressInUseIsRefusedUntilTheFirstIsGone) {
  FakeSwarm f;
  auto hello = [&](const PeerId& id, const std::string& name) {
    msg::Hello h;
    h.role = msg::Role::kStage;
    h.version = wire::kVersion;
    h.name = name;
    h.listen = "tcp://10.0.0.7:5555";
    // The reply's type, and an ERROR's message.
    for (const auto& x : f.core.on_message(id, msg::make(h, 0), f.now))
      if (const Send* s = std::get_if<Send>(&x))
        return std::make_pair(s->msg.type, s->msg.type == MsgType::kError ? msg::read<msg::Error>(s->msg).message : std::string());
    return std::make_pair(MsgType::kBye, std::string("no reply"));
  };
  EXPECT_EQ(hello("id-a", "a").first, MsgType::kWelcome);
  const auto [type, text] = hello("id-b", "b");
  ASSERT_EQ(type, MsgType::kError);
  EXPECT_NE(text.find("tcp://10.0.0.7:5555 is already advertised by peer a"), std::string::npos) << text;
  EXPECT_NE(text.find("--listen"), std::string::npos) << text;
  EXPECT_EQ(f.core.peers_json(0, 10, f.now)["peers"].size(), 1u);
  // The same server saying HELLO again (same routing id) is its restart, not a second peer.
  EXPECT_EQ(hello("id-a", "a").first, MsgType::kWelcome);
  f.core.on_message("id-a", msg::make(msg::Bye{}), f.now);
  EXPECT_EQ(hello("id-b", "b").first, MsgType::kWelcome);
  EXPECT_EQ(f.core.peers_json(0, 10, f.now)["peers"][0]["name"], "b");
}

// Protocol v2: a routing id is any bytes and goes back as msgpack bin (WELCOME, PEERS_REPLY);
// names and logs show it as text; a peer of v1 is told why in an envelope it can read.
TEST(CoreBugs, BinaryRoutingIdsTravelAsBinAndOldPeersAreToldWhy) {
  FakeSwarm f;
  const PeerId odd("\x00\xff\x80z", 4);
  msg::Hello h;
  h.role = msg::Role::kStage;
  h.version = wire::kVersion;
  auto first_send = [](const Actions& a) -> const Send* {
    for (const auto& x : a)
      if (const Send* s = std::get_if<Send>(&x)) return s;
    return nullptr;
  };
  Actions out = f.core.on_message(odd, msg::make(h, 0), f.now);
  const Send* welcome = first_send(out);
  ASSERT_NE(welcome, nullptr);
  ASSERT_EQ(welcome->msg.type, MsgType::kWelcome);
  EXPECT_TRUE(wire::body_json(welcome->msg)["peer_id"].is_binary());
  EXPECT_EQ(msg::read<msg::Welcome>(welcome->msg).peer_id, odd);
  const json page = f.core.peers_json(0, 10, f.now);
  ASSERT_EQ(page["peers"].size(), 1u);
  EXPECT_EQ(wire::id_from_json(page["peers"][0]["id"]), odd);
  EXPECT_EQ(page["peers"][0]["name"], "0x00ff807a");  // no name given: its id, printable
  EXPECT_NO_THROW(wire::pack_json(page));
  // A v1 HELLO does not decode; the refusal goes out in a v1 envelope.
  std::vector<zmq::message_t> frames;
  const auto env = json::to_msgpack(json::array({"SWRM", 1, 1, 5, 0}));
  frames.emplace_back(env.data(), env.size());
  frames.emplace_back("\x80", 1);
  try {
    wire::decode(frames);
    FAIL() << "a v1 envelope decoded";
  } catch (const WireError& e) {
    Actions r = f.core.on_undecodable("old", e, wire::peek_id(frames), f.now);
    const Send* refusal = first_send(r);
    ASSERT_NE(refusal, nullptr);
    EXPECT_EQ(refusal->msg.version, 1);
    wire::Message copy(MsgType::kError, refusal->msg.id, 0, refusal->msg.body);
    copy.version = refusal->msg.version;
    auto sent = wire::encode(copy);
    EXPECT_EQ(wire::peek_version(sent), 1);
    const msg::Error err = msg::read<msg::Error>(wire::decode(sent));
    EXPECT_EQ(err.name, "bad_version");
    EXPECT_NE(err.message.find("this side speaks v2"), std::string::npos);
  }
}

}  // namespace
}  // namespace swarm::router

namespace swarm::router {
namespace {

// Found by fuzz_router_core: a job that failed while it handled an event (a hop out of
// attempts at a deadline) left its other requests pending, held for no running job.
TEST(Core, AFailedJobLeavesNoRequestBehindAndTheNextJobRuns) {
  FakeSwarm f;
  f.join("a", 0);
  f.join("b", 1);
  f.peers.at("p-a").quirks.wrong_shape = {2, 8, 3};  // the only peer of stage 0 always lies
  const PeerId c = f.client();
  json spec = FakeSwarm::tiny_spec(2, 2);
  spec["timeouts"] = {{"max_attempts", 3}};
  const uint64_t first = f.submit(c, spec);
  ASSERT_TRUE(f.run(60, [&] { return f.status(first)["state"] == "failed"; })) << f.status(first).dump();
  EXPECT_NE(f.status(first)["reason"].get<std::string>().find("failed 3 times at stage 0"), std::string::npos);
  f.core.check_invariants();  // no request of the failed job is left
  f.peers.at("p-a").quirks.wrong_shape.clear();
  const uint64_t second = f.submit(c, spec);
  EXPECT_TRUE(f.run(60, [&] { return f.status(second)["state"] == "done"; }));
}

// ---- Peer to peer (routing.hops "p2p") ----------------------------------------------------

// Three stages, two peers each, all taking fetches.
std::vector<PeerId> three_by_two_p2p(FakeSwarm& f) {
  f.peers_listen = true;
  return {f.join("a0", 0), f.join("a1", 0), f.join("b0", 1), f.join("b1", 1), f.join("c0", 2), f.join("c1", 2)};
}

// Peer to peer, 3 stages: a0 makes stage 1's inputs, and b0 and b1 both fetch from it; `a0_cut`:
// it answers the router, but no peer can dial it.
void one_two_one_p2p(FakeSwarm& f, bool a0_cut) {
  f.peers_listen = true;
  f.join("a0", 0);
  f.join("b0", 1);
  f.join("b1", 1);
  f.join("c0", 2);
  f.peers.at("p-a0").unreachable = a0_cut;
}

size_t held_total(const FakeSwarm& f) {
  size_t n = 0;
  for (const auto& [id, p] : f.peers) n += p.book.held.size();
  return n;
}

size_t copies_total(const FakeSwarm& f) {
  size_t n = 0;
  for (const auto& [id, p] : f.peers) n += p.book.copies.size();
  return n;
}

TEST(CoreP2p, ActivationsAndGradientsGoPeerToPeerAndEveryHeldTensorIsReleased) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  f.run(0.3);  // the last RELEASEs go out within a quarter of a second
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["hops"]["mode"], "p2p");
  // The router sent tokens and targets only: no activation or gradient went through it...
  EXPECT_EQ(st["hops"]["bytes_through_router"], 0);
  for (const auto& [id, p] : f.peers)
    for (const auto& m : p.received)
      if (m.type == MsgType::kForward || m.type == MsgType::kBackward || m.type == MsgType::kForwardLoss)
        for (const auto& t : m.tensors) EXPECT_NE(t.desc.dtype, wire::DType::kF32) << wire::msg_type_name(m.type) << " to " << id;
  // ...yet every hop's tensors were moved and counted, as the receivers fetched them.
  EXPECT_GT(st["wire_bytes"]["activations"].get<uint64_t>(), 0u);
  EXPECT_GT(st["wire_bytes"]["gradients"].get<uint64_t>(), 0u);
  // Nothing is left held anywhere once the job is done, nor any copy a receiver kept of what it
  // fetched (the stage server would otherwise keep those for cache_ttl_s).
  EXPECT_EQ(held_total(f), 0u);
  EXPECT_EQ(copies_total(f), 0u);
  uint64_t released = 0;
  for (const auto& [id, p] : f.peers) released += p.book.released;
  EXPECT_GT(released, 0u);
}

// A backward's gradient is pushed ahead to the peer of the forward before it (Hop.push_to), and
// the backward there may still go to another peer: the copy pushed ahead is released where it
// went all the same, once that backward is done, not left for the stage server's cache_ttl_s.
TEST(CoreP2p, AGradientPushedAheadIsReleasedWhereItWentEvenWhenTheBackwardRanElsewhere) {
  FakeSwarm f;
  const std::vector<PeerId> ids = three_by_two_p2p(f);
  // b0 takes forwards, then goes silent at its first backward, which is sent again to b1.
  f.peers.at(ids[2]).silent_from = MsgType::kBackward;
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 8));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  f.run(0.3);  // the last RELEASEs go out within a quarter of a second
  std::map<std::string, PeerId> by_listen;
  std::map<std::pair<uint64_t, int64_t>, PeerId> backward_at;   // (mb, stage) -> the peer of its backward
  std::map<PeerId, std::set<int64_t>> released;
  std::set<int64_t> used;   // replies a backward took (an unanswered request made nothing to push)
  for (const auto& [id, p] : f.peers) {
    by_listen[p.listen] = id;
    for (const auto& m : p.received) {
      if (m.type == MsgType::kBackward) {
        const msg::Hop h = msg::read<msg::Hop>(m);
        backward_at[{h.mb, h.stage}] = id;
        for (const auto& r : m.refs) used.insert(int64_t(r.key));
      }
      if (m.type == MsgType::kRelease)
        for (int64_t k : msg::read<msg::Release>(m).keys) released[id].insert(k);
    }
  }
  size_t ahead = 0, elsewhere = 0;
  for (const auto& [id, p] : f.peers)
    for (const auto& m : p.received) {
      if (m.type != MsgType::kBackward && m.type != MsgType::kForwardLoss) continue;
      const msg::Hop h = msg::read<msg::Hop>(m);
      if (!h.push_to || !used.count(int64_t(m.id))) continue;
      ASSERT_TRUE(by_listen.count(*h.push_to)) << *h.push_to;
      const PeerId to = by_listen[*h.push_to];
      ahead++;
      // The request's reply is the gradient pushed, under the request's id.
      EXPECT_TRUE(released[to].count(int64_t(m.id))) << "mb " << h.mb << " stage " << h.stage << " pushed to " << to;
      auto b = backward_at.find({h.mb, h.stage - 1});
      if (b != backward_at.end() && b->second != to) elsewhere++;
    }
  EXPECT_GT(ahead, 0u);
  EXPECT_GT(elsewhere, 0u) << "no backward ran away from the peer its gradient was pushed to: the case is not covered";
}

// Stage servers that hold the job's data (swarm-stage --data-root) sample their hops' tokens and
// targets: the router sends the first stage's hops no tokens and the last stage's FORWARD_LOSSes
// and EVALs no targets (a stage-0 BACKWARD's gradient then comes as slot 0 of the message, and
// the peer puts its tokens ahead of it), and peers that do not hold the data get every token.
TEST(CoreP2p, PeersWithTheDataSampleTheirOwnTokensAndTheRouterSendsNone) {
  auto run = [](bool have_data) {
    FakeSwarm f;
    f.peers_have_data = have_data;
    three_by_two_p2p(f);
    const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
    EXPECT_TRUE(f.run(30, [&] { return done(f, job); }));
    size_t bare = 0, with_tokens = 0;
    for (const auto& [id, p] : f.peers)
      for (const auto& m : p.received) {
        if (m.type != MsgType::kForward && m.type != MsgType::kForwardLoss && m.type != MsgType::kBackward && m.type != MsgType::kEval) continue;
        const msg::Hop h = msg::read<msg::Hop>(m);
        const bool first = h.stage == 0, last = h.stage == 2;
        if (!first && !last) {
          EXPECT_FALSE(h.own_tokens.has_value());
          continue;
        }
        const bool carries = !m.tensors.empty();   // tokens or targets: activations and gradients are references
        if (h.own_tokens.value_or(false)) {
          EXPECT_TRUE(have_data);
          EXPECT_FALSE(carries) << wire::msg_type_name(m.type) << " stage " << h.stage;
          bare++;
          if (first && m.type == MsgType::kBackward) {
            EXPECT_EQ(m.refs.size(), 1u);
            for (const auto& r : m.refs) EXPECT_EQ(r.slot, 0u) << "the gradient, numbered without the tokens";
          }
        } else {
          EXPECT_FALSE(have_data) << wire::msg_type_name(m.type) << " stage " << h.stage;
          EXPECT_TRUE(carries) << wire::msg_type_name(m.type) << " stage " << h.stage;
          with_tokens++;
        }
      }
    const json st = f.status(job);
    EXPECT_EQ(st["microbatches"]["lost"], 0);
    EXPECT_EQ(st["hops"]["own_tokens"].get<size_t>(), bare);
    return std::make_pair(st["hops"]["token_bytes"].get<uint64_t>(), with_tokens);
  };
  const auto [routed_bytes, routed_hops] = run(false);
  const auto [own_bytes, own_hops] = run(true);
  EXPECT_GT(routed_bytes, 0u);
  EXPECT_GT(routed_hops, 0u);
  EXPECT_EQ(own_bytes, 0u);
  EXPECT_EQ(own_hops, 0u);
}

// A hop whose peer fetched its tensors and then failed it (a misshapen result, a false report of
// a bad input) goes out again to another peer: the copies the first one kept are released there,
// not left for the stage server's cache_ttl_s.
TEST(CoreP2p, WhatAFailedHopsPeerFetchedIsReleasedWhenTheHopGoesElsewhere) {
  for (const bool misshapen : {true, false}) {
    SCOPED_TRACE(misshapen ? "misshapen results" : "false bad-input reports");
    FakeSwarm f;
    const std::vector<PeerId> ids = three_by_two_p2p(f);
    testing::FakePeer& liar = f.peers.at(ids[2]);   // b0: stage 1
    if (misshapen) liar.quirks.wrong_shape = {2, 8, 3};
    else liar.quirks.bad_input_reports = 6;
    const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 6));
    ASSERT_TRUE(f.run(60, [&] { return done(f, job); })) << f.status(job).dump();
    f.run(0.3);  // the last RELEASEs go out within a quarter of a second
    const json st = f.status(job);
    EXPECT_EQ(st["microbatches"]["lost"], 0);
    EXPECT_GT(st["microbatches"]["resent"].get<int>(), 0) << "no hop failed: the case is not covered";
    EXPECT_GT(liar.fetched_bytes, 0u) << "the failing peer fetched nothing: the case is not covered";
    EXPECT_EQ(liar.book.copies.size(), 0u);
    EXPECT_EQ(copies_total(f), 0u);
    EXPECT_EQ(held_total(f), 0u);
  }
}

// A hop's holder is told to push the tensor to the receiver (PUSH) as the hop goes out, and the
// reference says so; except the input of a backward on the peer of its forward, which has it.
// A backward's gradient is pushed as soon as it is made, to the peer of the forward before it
// (Hop.push_to), which then takes the next hop with it already there or on its way.
TEST(CoreP2p, EachHeldTensorIsPushedToItsReceiverAsTheHopGoesOut) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  // Every hop request by id, and the pushes asked for as outputs were made.
  std::map<uint64_t, msg::Hop> hops;
  size_t ahead = 0;
  for (const auto& [id, p] : f.peers)
    for (const auto& m : p.received)
      if (m.type == MsgType::kForward || m.type == MsgType::kForwardLoss || m.type == MsgType::kBackward || m.type == MsgType::kEval) {
        hops[m.id] = msg::read<msg::Hop>(m);
        ahead += hops[m.id].push_to.has_value();
      }
  size_t pushed = 0, kept = 0, made_ahead = 0;
  for (const auto& [id, p] : f.peers) {
    std::set<std::pair<uint64_t, int64_t>> forwards;   // (mb, stage) it ran forward
    for (const auto& m : p.received) {
      if (m.type != MsgType::kForward && m.type != MsgType::kForwardLoss && m.type != MsgType::kBackward && m.type != MsgType::kEval) continue;
      const msg::Hop h = msg::read<msg::Hop>(m);
      if (m.type != MsgType::kBackward) forwards.insert({h.mb, h.stage});
      for (const auto& r : m.refs) {
        if (m.type == MsgType::kBackward && r.slot == 0 && forwards.count({h.mb, h.stage})) {
          EXPECT_FALSE(r.pushed) << "mb " << h.mb << " stage " << h.stage;
          kept++;
          continue;
        }
        EXPECT_TRUE(r.pushed) << wire::msg_type_name(m.type) << " mb " << h.mb << " stage " << h.stage << " slot " << r.slot;
        const testing::FakePeer* holder = nullptr;
        for (const auto& [hid, q] : f.peers)
          if (q.listen == r.from) holder = &q;
        ASSERT_NE(holder, nullptr) << r.from;
        bool told = false;
        for (const auto& q : holder->received)
          if (q.type == MsgType::kPush) {
            const msg::Push pu = msg::read<msg::Push>(q);
            told |= pu.key == r.key && uint32_t(pu.part) == r.part && pu.to == p.listen;
          }
        const bool as_made = hops.count(r.key) && hops[r.key].push_to == p.listen;
        EXPECT_NE(told, as_made) << "tensor " << r.key << " to " << p.listen << ": pushed by PUSH " << told << ", as made " << as_made;
        made_ahead += as_made;
        pushed += told;
      }
    }
  }
  EXPECT_GT(pushed, 0u);
  EXPECT_GT(kept, 0u);
  EXPECT_GT(made_ahead, 0u);
  EXPECT_LE(made_ahead, ahead);   // a push as made may go to a peer the next hop did not go to
  EXPECT_EQ(f.status(job)["hops"]["pushed"].get<uint64_t>(), pushed + ahead);
}

TEST(CoreP2p, PeersWithoutAListenAddressAreRelayedThroughTheRouter) {
  FakeSwarm f;
  f.peers_listen = true;
  f.join("a0", 0);
  f.join("b0", 1);
  f.peers_listen = false;
  f.join("c0", 2);  // takes no connections: what it makes goes through the router
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 2));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  // c0's gradients (the last stage's) came inline and went to b0 through the router.
  EXPECT_GT(st["hops"]["bytes_through_router"].get<uint64_t>(), 0u);
  EXPECT_TRUE(f.peers.at("p-c0").book.held.empty());
  const json peers = f.core.peers_json(0, 100, f.now)["peers"];
  for (const auto& p : peers) EXPECT_EQ(p["relayed"].get<bool>(), p["name"] == "c0") << p.dump();
}

TEST(CoreP2p, AHolderDyingMidBackwardHasItsTensorsMadeAgainAndNothingIsLost) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  // a0 takes a BACKWARD and never answers; the stage-1 peer holding that backward's gradient
  // dies too, so when the hop goes to a1 the gradient must be made again.
  f.peers.at("p-a0").silent_from = MsgType::kBackward;
  ASSERT_TRUE(f.run(10, [&] { return received(f, "p-a0", MsgType::kBackward) > 0; }));
  const wire::Message& bw = last_of(f, "p-a0", MsgType::kBackward);
  ASSERT_EQ(bw.refs.size(), 1u);  // the tokens travel inline, the gradient is held
  PeerId victim;
  for (const auto& [id, p] : f.peers)
    if (p.listen == bw.refs[0].from) victim = id;
  ASSERT_TRUE(victim == "p-b0" || victim == "p-b1") << bw.refs[0].from;
  f.kill(victim);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["microbatches"]["completed"], 8);
  EXPECT_GT(st["hops"]["remade"].get<uint64_t>(), 0u) << st["hops"].dump();
}

TEST(CoreP2p, AHolderOthersCannotReachIsRelayedByTheRouter) {
  FakeSwarm f;
  one_two_one_p2p(f, /*a0_cut=*/true);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GT(st["hops"]["fetch_failures"].get<uint64_t>(), 0u);
  EXPECT_GT(st["hops"]["relayed_by_router"].get<uint64_t>(), 0u);
  // Two receivers (b0, b1) could not reach it: it is relayed for a while, and says so.
  EXPECT_TRUE(f.logged("peer a0 is relayed for 30 s"));
  EXPECT_GT(received(f, "p-a0", MsgType::kFetch), 0u);
  f.run(0.3);   // the last RELEASEs
  EXPECT_EQ(f.peers.at("p-a0").book.held.size(), 0u);
}

TEST(CoreP2p, ARelayedHolderIsFetchedFromAgainOnceItsRelayEndsAndRelayedLongerIfStillUnreachable) {
  // Two fetches that did not make it within their window (a link busy for a minute) relayed a
  // holder for the rest of its session; now for 30 s, then twice as long each time in a row.
  FakeSwarm f;
  one_two_one_p2p(f, /*a0_cut=*/true);
  const uint64_t first = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, first); }));
  ASSERT_TRUE(f.logged("peer a0 is relayed for 30 s"));
  // Its link is fine again; once the relay ends, receivers fetch from it.
  f.peers.at("p-a0").unreachable = false;
  ASSERT_TRUE(f.run(40, [&] { return f.logged("peer a0 is fetched from directly again"); }));
  const uint64_t fetched_before = f.peers.at("p-b0").fetched_bytes + f.peers.at("p-b1").fetched_bytes;
  const uint64_t relayed_before = received(f, "p-a0", MsgType::kFetch);
  const uint64_t second = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, second); }));
  const json st = f.status(second);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["hops"]["fetch_failures"], 0) << st["hops"].dump();
  EXPECT_EQ(received(f, "p-a0", MsgType::kFetch), relayed_before);   // nothing relayed
  EXPECT_GT(f.peers.at("p-b0").fetched_bytes + f.peers.at("p-b1").fetched_bytes, fetched_before);
  // Unreachable again: relayed again, for twice as long.
  f.peers.at("p-a0").unreachable = true;
  const uint64_t third = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, third); }));
  EXPECT_EQ(f.status(third)["microbatches"]["lost"], 0);
  EXPECT_TRUE(f.logged("peer a0 is relayed for 60 s"));
}

// Tensors pushed to the peer listening at `listen` since the start: PUSHes to the holders naming
// it, and hops asking for their output to be pushed there as it is made.
uint64_t pushes_towards(const FakeSwarm& f, const std::string& listen) {
  uint64_t n = 0;
  for (const auto& [id, p] : f.peers)
    for (const auto& m : p.received)
      if (m.type == MsgType::kPush)
        n += msg::read<msg::Push>(m).to == listen;
      else if (m.type == MsgType::kForward || m.type == MsgType::kForwardLoss || m.type == MsgType::kBackward)
        n += msg::read<msg::Hop>(m).push_to == listen;
  return n;
}

bool pushed_to(FakeSwarm& f, const std::string& name) {
  const json peers = f.core.peers_json(0, 100, f.now);
  for (const json& p : peers["peers"])
    if (p["name"] == name) return p["pushed_to"].get<bool>();
  ADD_FAILURE() << name << " is not among the peers";
  return false;
}

// A receiver most of whose pushes come late (a link congested for a while, or an address the
// holders cannot reach) fetches instead for a while: 60 s, doubling while it recurs. Then it is
// pushed to again, its counts started afresh. Before, it was never pushed to again in its session.
TEST(CoreP2p, AReceiverWhosePushesComeLateIsNotPushedToForAWhileThenPushedToAgain) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const std::string b0 = f.peers.at("p-b0").listen;
  f.peers.at("p-b0").pushes_late = true;
  const uint64_t first = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return f.logged("peer b0 is not pushed to for 60 s"); }));
  EXPECT_FALSE(pushed_to(f, "b0"));
  EXPECT_TRUE(pushed_to(f, "b1"));
  ASSERT_TRUE(f.run(60, [&] { return done(f, first); }));
  // Paused: its hops go on, and what it needs it fetches without waiting for pushes.
  const uint64_t paused_at = pushes_towards(f, b0), fetched = f.peers.at("p-b0").fetched_bytes;
  const uint64_t second = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(40, [&] { return done(f, second); }));
  EXPECT_EQ(f.status(second)["microbatches"]["lost"], 0);
  EXPECT_EQ(pushes_towards(f, b0), paused_at);
  EXPECT_GT(f.peers.at("p-b0").fetched_bytes, fetched);
  // Its link is fine again: once the pause ends, tensors are pushed to it, and it stays so.
  f.peers.at("p-b0").pushes_late = false;
  ASSERT_TRUE(f.run(60, [&] { return f.logged("peer b0 is pushed to again (paused 1 time(s) in a row)"); }));
  EXPECT_TRUE(pushed_to(f, "b0"));
  const uint64_t third = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, third); }));
  EXPECT_GT(pushes_towards(f, b0), paused_at);
  EXPECT_TRUE(pushed_to(f, "b0"));
  // Late again: paused again, for twice as long.
  f.peers.at("p-b0").pushes_late = true;
  const uint64_t fourth = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, fourth); }));
  EXPECT_EQ(f.status(fourth)["microbatches"]["lost"], 0);
  EXPECT_TRUE(f.logged("peer b0 is not pushed to for 120 s"));
  EXPECT_FALSE(pushed_to(f, "b0"));
}

// The router learns each peer's pace from its RESULTs (fetch_ms over the bytes fetched) and
// gives a request's bytes four times that long where it is slower than 100 Mbit/s; a peer not
// timed yet gets the swarm's. Before, every request allowed 100 Mbit/s: on a 2 Mbit/s link a
// 512 KB tensor came after its fetch window, and a stage-0 peer, whose forwards fetch nothing,
// met its first gradient with a window for 100 Mbit/s.
TEST(CoreP2p, RequestsAllowTheirBytesAtThePaceThePeersLinksHaveShown) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const double pace = 8;   // 1 Mbit/s
  for (auto& [id, p] : f.peers) p.fetch_s_per_mb = pace;
  json spec = FakeSwarm::tiny_spec(3, 4);
  spec["model"]["d_model"] = 256;
  spec["model"]["seq_len"] = 64;   // 128 KB of activations a microbatch in bf16
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
  // Of the hops with references each peer was sent, those whose fetch window allows their
  // references at that pace, and all of them.
  auto paced = [&](const PeerId& id) {
    std::pair<size_t, size_t> n{0, 0};
    for (const wire::Message& m : f.peers.at(id).received) {
      if (m.refs.empty() || !m.fetch_within_ms) continue;
      double bytes = 0;
      for (const auto& r : m.refs) bytes += double(r.desc.wire_bytes());
      n.second++;
      n.first += m.fetch_within_ms / 1000.0 >= 0.75 * 4 * bytes / 1e6 * pace * 0.99;
    }
    return n;
  };
  for (const char* name : {"p-b0", "p-b1", "p-c0", "p-c1"}) {
    const auto [at_pace, all] = paced(name);
    EXPECT_GT(all, 4u) << name;
    EXPECT_GE(at_pace + 2, all) << name << ": only its first requests, before any result, allow 100 Mbit/s";
  }
  // `swarm peers` shows each timed peer's pace.
  const json peers = f.core.peers_json(0, 100, f.now);
  for (const json& p : peers["peers"]) {
    ASSERT_TRUE(p["s_per_mb"].is_number()) << p.dump();
    EXPECT_NEAR(p["s_per_mb"].get<double>(), pace, 0.01) << p.dump();
  }
  // Stage 0's forwards fetch nothing: its first backwards are given the swarm's pace.
  for (const char* name : {"p-a0", "p-a1"}) {
    const auto [at_pace, all] = paced(name);
    EXPECT_GT(all, 2u) << name;
    EXPECT_EQ(at_pace, all) << name;
  }
}

TEST(CoreP2p, AHolderOnABusyLinkIsNotRelayedAndEachLateTensorGoesAgainDirectlyBeforeTheRouterRelaysIt) {
  // Receivers that heard from a0 lately cannot get its tensors in their windows: a full link,
  // not a cut one. Before, two such misses relayed a0 for a while, and every tensor it made
  // (and its stage's round) went through the router.
  FakeSwarm f;
  one_two_one_p2p(f, /*a0_cut=*/false);
  f.peers.at("p-a0").busy_link = true;
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_FALSE(f.logged("peer a0 is relayed for"));
  // Each stage-1 hop asked for a0's tensor twice, directly, before the router relayed it: two
  // fetch failures for each relay.
  const uint64_t failures = st["hops"]["fetch_failures"], relayed = st["hops"]["relayed_by_router"];
  EXPECT_GT(relayed, 0u);
  EXPECT_EQ(failures, 2 * relayed) << st["hops"].dump();
  EXPECT_EQ(received(f, "p-a0", MsgType::kFetch), relayed);
}

TEST(CoreP2p, AReferenceAnsweredForAnotherRequestIsRejectedAsALie) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 2));
  // a0's answer to its first FORWARD is still on its way when a0 sends a reference to
  // something else instead.
  ASSERT_TRUE(f.run(5, [&] { return received(f, "p-a0", MsgType::kForward) > 0; }));
  const wire::Message& fw = last_of(f, "p-a0", MsgType::kForward);
  ASSERT_TRUE(fw.hold);
  msg::Result r;
  r.mb = msg::read<msg::Hop>(fw).mb;
  r.stage = 0;
  wire::Message lie = msg::make(r, fw.id, fw.attempt);
  wire::TensorRef ref;
  ref.key = fw.id + 1000;  // not this request's
  ref.desc.dtype = wire::DType::kF32;
  ref.desc.shape = {2, 8, 16};
  ref.desc.nbytes = 2 * 8 * 16 * 4;
  lie.refs.push_back(ref);
  f.deliver("p-a0", std::move(lie));
  EXPECT_TRUE(f.logged("answered with a reference that is not its own output of this request"));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
}

TEST(CoreP2p, EachMemberReducesItsPartOfTheRoundAndNoPeerCarriesMuchMoreThanItsShare) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  f.run(0.3);   // the last RELEASEs
  const json st = f.status(job);
  EXPECT_EQ(st["rounds"], 2);
  // Two members per stage: the values are cut in two, one owner per part, each round.
  for (const char* id : {"p-a0", "p-a1", "p-b0", "p-b1", "p-c0", "p-c1"}) {
    EXPECT_EQ(received(f, id, MsgType::kRoundReduce), 2u) << id;
    const wire::Message& apply = last_of(f, id, MsgType::kRoundApply);
    EXPECT_TRUE(apply.tensors.empty());
    EXPECT_EQ(apply.refs.size(), 2u);
    EXPECT_EQ(msg::read<msg::RoundApply>(apply).shards, 2);
  }
  // Every peer sent and received about the same: a reduce-scatter and an all-gather.
  const json bytes = st["outer_peer_bytes"];
  ASSERT_EQ(bytes.size(), 6u) << bytes.dump();
  double most = 0, total = 0;
  for (const auto& [name, b] : bytes.items()) {
    const double moved = b["sent"].get<double>() + b["received"].get<double>();
    EXPECT_GT(b["sent"].get<double>(), 0) << name;
    EXPECT_GT(b["received"].get<double>(), 0) << name;
    most = std::max(most, moved);
    total += moved;
  }
  EXPECT_LE(most / (total / 6), 1.2) << bytes.dump();
  EXPECT_EQ(held_total(f), 0u);
}

TEST(CoreP2p, AnOwnerDyingMidReduceHandsItsPartToAnotherMember) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 4));
  f.peers.at("p-b1").silent_from = MsgType::kRoundReduce;  // takes its part and dies
  ASSERT_TRUE(f.run(20, [&] { return received(f, "p-b1", MsgType::kRoundReduce) > 0; }));
  f.kill("p-b1");
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["rounds"], 2);
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  // b0 reduced both parts of the first round after b1 died, and the second round alone.
  EXPECT_GE(received(f, "p-b0", MsgType::kRoundReduce), 3u);
  EXPECT_EQ(st["hash_mismatches"], 0);
}

TEST(CoreP2p, AJoinerFetchesTheGroupsStateFromADonor) {
  FakeSwarm f;
  three_by_two_p2p(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(3, 8));
  ASSERT_TRUE(f.run(20, [&] { return f.status(job)["rounds"].get<int>() >= 1; }));
  const PeerId joiner = f.join("b2", 1);
  ASSERT_TRUE(f.run(60, [&] { return done(f, job); }));
  f.run(0.3);   // the last RELEASEs
  const wire::Message& load = last_of(f, joiner, MsgType::kStateLoad);
  EXPECT_TRUE(load.tensors.empty());
  ASSERT_EQ(load.refs.size(), 2u);
  EXPECT_TRUE(load.refs[0].from == "tcp://b0:6000" || load.refs[0].from == "tcp://b1:6000") << load.refs[0].from;
  EXPECT_EQ(f.status(job)["microbatches"]["lost"], 0);
  EXPECT_EQ(held_total(f), 0u);  // the donor let go of its copy once the joiner had it
}

TEST(CoreP2p, HubModeSendsEveryTensorThroughTheRouterEvenToPeersThatListen) {
  FakeSwarm f;
  three_by_two_p2p(f);
  json spec = FakeSwarm::tiny_spec(3, 2);
  spec["routing"]["hops"] = "hub";
  const uint64_t job = f.submit(f.client(), spec);
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  EXPECT_EQ(st["hops"]["mode"], "hub");
  EXPECT_EQ(held_total(f), 0u);
  EXPECT_EQ(st["hops"]["bytes_through_router"], st["wire_bytes"]["activations"].get<uint64_t>() + st["wire_bytes"]["gradients"].get<uint64_t>());
}

}  // namespace
}  // namespace swarm::router
