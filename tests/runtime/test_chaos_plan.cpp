// test_chaos_plan.cpp: the chaos plan parser (runtime/chaos_plan.h), its messages, the seeded
// timing and peer choice, the per-peer --fault arguments, and the bundled example plans.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "runtime/chaos_plan.h"
#include "runtime/errors.h"

using namespace swarm;
using nlohmann::json;

namespace {

std::string error_of(const std::string& text) {
  try {
    parse_chaos_plan(json::parse(text));
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ChaosPlan, ParsesEventsAndFaults) {
  ChaosPlan p = parse_chaos_plan(json::parse(R"({
    "seed": 11,
    "events": [
      {"at_s": 12, "action": "stop", "peer": "stage1-0", "duration_s": 5},
      {"every_s": 15, "action": "kill", "peer": "random", "restart_after_s": 5, "count": 3, "jitter_s": 2},
      {"at_s": 30, "action": "restart", "peer": "stage0-1"},
      {"at_s": 31, "action": "cont", "comment": "whatever is still stopped"}
    ],
    "faults": {"stage2-0": ["slow,factor=4", {"action": "corrupt", "p": 0.01}]}
  })"));
  EXPECT_EQ(p.seed, 11u);
  ASSERT_EQ(p.events.size(), 4u);
  EXPECT_EQ(p.events[0].action, ChaosAction::kStop);
  EXPECT_EQ(p.events[0].at_s, 12.0);
  EXPECT_EQ(p.events[0].duration_s, 5.0);
  EXPECT_FALSE(p.events[0].periodic());
  EXPECT_TRUE(p.events[1].periodic());
  EXPECT_EQ(p.events[1].restart_after_s, 5.0);
  EXPECT_EQ(p.events[1].count, 3u);
  EXPECT_EQ(p.events[2].action, ChaosAction::kRestart);
  EXPECT_EQ(p.events[3].peer, "random");
  ASSERT_EQ(p.faults.at("stage2-0").size(), 2u);
  EXPECT_EQ(p.faults.at("stage2-0")[1], parse_fault("corrupt,p=0.01"));

  auto args = p.stage_args("stage2-0");
  ASSERT_EQ(args.size(), 6u);
  EXPECT_EQ(args[0], "--fault");
  EXPECT_EQ(args[1], "slow,factor=4");
  EXPECT_EQ(args[3], "corrupt,p=0.01");
  EXPECT_EQ(args[4], "--fault-seed");
  EXPECT_TRUE(p.stage_args("stage0-0").empty());
}

TEST(ChaosPlan, BadPlansSayWhatToFix) {
  EXPECT_NE(error_of(R"({"events": [{"action": "kill"}]})").find("exactly one of \"at_s\" (once) or \"every_s\""), std::string::npos);
  EXPECT_NE(error_of(R"({"events": [{"at_s": 1, "every_s": 2, "action": "kill"}]})").find("exactly one"), std::string::npos);
  std::string e = error_of(R"({"events": [{"at_s": 1, "action": "explode"}]})");
  EXPECT_NE(e.find("events[0]: unknown action \"explode\"; the actions are: kill, stop, cont, restart"), std::string::npos) << e;
  e = error_of(R"({"events": [{"at_s": 1, "action": "kill", "duration_s": 5}]})");
  EXPECT_NE(e.find("does not apply to a kill event (a kill's down time is restart_after_s)"), std::string::npos) << e;
  e = error_of(R"({"events": [{"at_s": 1, "action": "stop", "count": 2}]})");
  EXPECT_NE(e.find("key \"count\" does not apply to a stop event; it takes: action, peer, comment, at_s, jitter_s, duration_s"), std::string::npos) << e;
  EXPECT_NE(error_of(R"({"events": [{"every_s": 0, "action": "kill"}]})").find("every_s must be > 0"), std::string::npos);
  EXPECT_NE(error_of(R"({"events": [{"at_s": -1, "action": "kill"}]})").find("at_s=-1: give a value >= 0"), std::string::npos);
  EXPECT_NE(error_of(R"({"events": [{"at_s": 1, "action": "kill", "peer": 3}]})").find("\"peer\" must be a peer name"), std::string::npos);
  e = error_of(R"({"faults": {"stage1-0": ["slow,factr=2"]}})");
  EXPECT_NE(e.find("faults.stage1-0"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key \"factr\""), std::string::npos) << e;
  EXPECT_NE(error_of(R"({"faults": {"stage1-0": "slow"}})").find("must be a list of faults"), std::string::npos);
  EXPECT_NE(error_of(R"({"evnts": []})").find("unknown key: did you mean \"events\"?; the keys are: seed, events, faults, comment"), std::string::npos);
  EXPECT_NE(error_of(R"({"schedule": []})").find("schedule: unknown key; the keys are:"), std::string::npos);  // no word is near
  e = error_of(R"({"events": [{"at_s": 1, "action": "kil"}]})");
  EXPECT_NE(e.find("unknown action \"kil\": did you mean \"kill\"?; the actions are"), std::string::npos) << e;
  e = error_of(R"({"events": [{"at_s": 1, "action": "kill", "peeer": "stage1-0"}]})");
  EXPECT_NE(e.find("key \"peeer\" does not apply to a kill event (did you mean \"peer\"?); it takes:"), std::string::npos) << e;
  EXPECT_NE(error_of("[]").find("give an object"), std::string::npos);
}

TEST(ChaosPlan, TimingAndChoicesComeFromTheSeed) {
  ChaosPlan p = parse_chaos_plan(json::parse(R"({"seed": 5, "events": [
      {"every_s": 10, "action": "kill"}, {"every_s": 10, "start_s": 3, "jitter_s": 4, "action": "stop"},
      {"at_s": 7.5, "action": "cont"}]})"));
  EXPECT_DOUBLE_EQ(chaos_fire_time(p, 0, 0), 10.0);
  EXPECT_DOUBLE_EQ(chaos_fire_time(p, 0, 3), 40.0);
  EXPECT_DOUBLE_EQ(chaos_fire_time(p, 2, 0), 7.5);
  std::set<double> jitters;
  for (uint64_t k = 0; k < 50; ++k) {
    const double t = chaos_fire_time(p, 1, k);
    EXPECT_GE(t, 3.0 + 10.0 * double(k));
    EXPECT_LT(t, 7.0 + 10.0 * double(k));
    EXPECT_EQ(t, chaos_fire_time(p, 1, k));
    jitters.insert(t - 10.0 * double(k));
  }
  EXPECT_GT(jitters.size(), 40u);

  std::vector<size_t> counts(4, 0), picks_a, picks_b;
  for (uint64_t k = 0; k < 4000; ++k) {
    const size_t i = chaos_pick(5, 0, k, 4);
    ASSERT_LT(i, 4u);
    counts[i]++;
    picks_a.push_back(i);
    picks_b.push_back(chaos_pick(6, 0, k, 4));
  }
  for (size_t c : counts) EXPECT_NEAR(double(c) / 4000, 0.25, 0.03);
  EXPECT_NE(picks_a, picks_b);
  for (uint64_t k = 0; k < 100; ++k) EXPECT_EQ(chaos_pick(5, 0, k, 4), picks_a[k]);
}

TEST(ChaosPlan, PeersDrawDifferentFaultSeeds) {
  ChaosPlan p = parse_chaos_plan(json::parse(R"({"seed": 5, "faults": {"a": ["drop,p=0.1"], "b": ["drop,p=0.1"]}})"));
  EXPECT_NE(p.stage_args("a").back(), p.stage_args("b").back());
  EXPECT_EQ(p.stage_args("a"), p.stage_args("a"));
}

TEST(ChaosPlan, TheExamplePlansParse) {
  const std::string dir = std::string(SWARM_SOURCE_DIR) + "/examples/chaos/";
  ChaosPlan k = load_chaos_plan(dir + "kill_every_15s.json");
  ASSERT_EQ(k.events.size(), 1u);
  EXPECT_EQ(k.events[0].every_s, 15.0);
  EXPECT_EQ(k.events[0].action, ChaosAction::kKill);
  EXPECT_EQ(k.events[0].restart_after_s, 5.0);
  ChaosPlan m = load_chaos_plan(dir + "mixed.json");
  EXPECT_FALSE(m.faults.empty());
  std::set<ChaosAction> actions;
  for (const auto& e : m.events) actions.insert(e.action);
  EXPECT_TRUE(actions.count(ChaosAction::kStop));
  EXPECT_TRUE(actions.count(ChaosAction::kKill));
}
