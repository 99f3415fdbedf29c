// test_fault.cpp: the fault injector (runtime/fault.h): spec parsing and its messages, the
// canonical round trips, every trigger on an injected clock, the probability's rate and its
// replay from the seed, and the frame helpers whose corruption every receiver must catch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/errors.h"
#include "runtime/fault.h"
#include "runtime/wire.h"

using namespace swarm;
using nlohmann::json;

namespace {

// Every firing logs a warning; these tests fire thousands. SWARM_LOG set by the caller wins.
const bool kQuiet = setenv("SWARM_LOG", "error", /*overwrite=*/0) == 0;

// The InputError message of parsing `text` ("" if it parsed).
std::string error_of(const std::string& text) {
  try {
    parse_fault(text);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

std::string json_error_of(const json& j) {
  try {
    parse_fault_json(j);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// An injector on a clock the test moves by hand.
struct Rig {
  double t = 100.0;
  FaultInjector inj;
  explicit Rig(uint64_t seed = 1) : inj(seed, [this] { return t; }) {}
  std::vector<FaultHit> at(FaultPoint p, uint64_t requests, uint64_t step = 0, int type = 0) {
    FaultContext c;
    c.requests = requests;
    c.step = step;
    c.msg_type = type;
    return inj.check(p, c);
  }
};

// Opportunity numbers (1-based) at which spec `text` fires over n opportunities at its point.
std::vector<uint64_t> firings(uint64_t seed, const std::string& text, uint64_t n) {
  Rig r(seed);
  const FaultSpec s = parse_fault(text);
  r.inj.add(s);
  std::vector<uint64_t> out;
  for (uint64_t i = 1; i <= n; ++i)
    if (!r.at(s.point, i).empty()) out.push_back(i);
  return out;
}

}  // namespace

TEST(FaultSpec, ParsesTheDocumentedExamples) {
  FaultSpec s = parse_fault("crash,after=20");
  EXPECT_EQ(s.action, FaultAction::kCrash);
  EXPECT_EQ(s.point, FaultPoint::kBeforeCompute);
  EXPECT_EQ(s.after, 20u);
  EXPECT_EQ(s.count, 1u);

  s = parse_fault("freeze,after_s=5,duration_s=10");
  EXPECT_EQ(s.point, FaultPoint::kAfterRecv);
  EXPECT_EQ(s.after_s, 5.0);
  EXPECT_EQ(s.duration_s, 10.0);

  s = parse_fault("slow,factor=10");
  EXPECT_EQ(s.point, FaultPoint::kAfterCompute);
  EXPECT_EQ(s.factor, 10.0);
  EXPECT_EQ(s.count, 0u);

  s = parse_fault("corrupt,p=0.05");
  EXPECT_EQ(s.point, FaultPoint::kBeforeSend);
  EXPECT_EQ(s.p, 0.05);
  EXPECT_EQ(s.count, 0u);

  s = parse_fault("nan,p=0.02");
  EXPECT_EQ(s.action, FaultAction::kNan);
  EXPECT_EQ(s.point, FaultPoint::kAfterCompute);

  s = parse_fault("partition,after_s=3,duration_s=5");
  EXPECT_EQ(s.action, FaultAction::kPartition);
  EXPECT_EQ(s.count, 1u);

  s = parse_fault("zombie,after=10");
  EXPECT_EQ(s.action, FaultAction::kZombie);
  EXPECT_EQ(s.duration_s, 0.0);

  s = parse_fault(" drop , p = 0.1 , point = after_recv ");
  EXPECT_EQ(s.action, FaultAction::kDrop);
  EXPECT_EQ(s.point, FaultPoint::kAfterRecv);
  EXPECT_EQ(s.p, 0.1);

  s = parse_fault("delay,delay_ms=50,count=3,step=2");
  EXPECT_EQ(s.delay_ms, 50.0);
  EXPECT_EQ(s.count, 3u);
  EXPECT_EQ(s.step, 2u);
}

TEST(FaultSpec, TextAndJsonRoundTrip) {
  for (const char* text : {"crash,after=20", "freeze,after_s=5,duration_s=10", "slow,factor=10", "corrupt,p=0.05",
                           "nan,p=0.02", "partition,after_s=3,duration_s=5", "zombie,after=10",
                           "drop,point=after_recv,p=0.1", "delay,point=heartbeat,count=2,delay_ms=300",
                           "duplicate", "crash,point=heartbeat,step=7,count=0"}) {
    const FaultSpec s = parse_fault(text);
    EXPECT_EQ(to_string(s), text);
    EXPECT_EQ(parse_fault(to_string(s)), s) << text;
    EXPECT_EQ(parse_fault_json(to_json(s)), s) << to_json(s).dump();
  }
  EXPECT_EQ(to_string(parse_fault("slow")), "slow,factor=4");
  EXPECT_EQ(to_string(parse_fault("delay")), "delay,delay_ms=200");
  EXPECT_EQ(parse_fault_json(json{{"action", "slow"}, {"factor", 10}}), parse_fault("slow,factor=10"));
  EXPECT_EQ(parse_fault_json(json("corrupt,p=0.5")), parse_fault("corrupt,p=0.5"));
}

TEST(FaultSpec, BadTextSaysWhatIsAllowed) {
  EXPECT_NE(error_of("").find("no action"), std::string::npos);
  std::string e = error_of("crsh,after=3");
  EXPECT_NE(e.find("unknown action \"crsh\": did you mean \"crash\"?"), std::string::npos) << e;
  EXPECT_NE(e.find("crash, freeze, zombie, slow, drop, delay, duplicate, corrupt, partition, nan"), std::string::npos) << e;

  e = error_of("crash,factor=3");
  EXPECT_NE(e.find("fault \"crash,factor=3\""), std::string::npos) << e;
  EXPECT_NE(e.find("\"factor\" does not apply to crash"), std::string::npos) << e;
  EXPECT_NE(e.find("crash takes: point, on, after, step, after_s, p, count"), std::string::npos) << e;

  e = error_of("slow,factr=3");
  EXPECT_NE(e.find("unknown key \"factr\": did you mean \"factor\"?"), std::string::npos) << e;

  EXPECT_NE(error_of("corrupt,p=1.5").find("between 0 and 1"), std::string::npos);
  EXPECT_NE(error_of("crash,after=2.5").find("after=2.5: give a whole number >= 0"), std::string::npos);
  EXPECT_NE(error_of("crash,after=-1").find("whole number"), std::string::npos);
  EXPECT_NE(error_of("slow,factor=0.5").find("between 1 and 1000"), std::string::npos);
  EXPECT_NE(error_of("delay,delay_ms=abc").find("delay_ms=abc: not a number"), std::string::npos);
  EXPECT_NE(error_of("drop,p").find("\"p\" is not key=value"), std::string::npos);
  EXPECT_NE(error_of("drop,p=0.1,p=0.2").find("given twice"), std::string::npos);
  EXPECT_NE(error_of("freeze,duration_s=-2").find("duration_s=-2: give a value >= 0"), std::string::npos);

  e = error_of("drop,point=before_compute");
  EXPECT_NE(e.find("point=before_compute is not a point for drop"), std::string::npos) << e;
  EXPECT_NE(e.find("before_send, after_recv, heartbeat"), std::string::npos) << e;
  EXPECT_NE(error_of("slow,point=sometime").find("before_compute, after_compute"), std::string::npos);
}

TEST(FaultSpec, BadJsonSaysWhatIsAllowed) {
  EXPECT_NE(json_error_of(json{{"factor", 3}}).find("\"action\" (a string) is missing"), std::string::npos);
  EXPECT_NE(json_error_of(json{{"action", "slow"}, {"factor", "x"}}).find("factor must be a number"), std::string::npos);
  EXPECT_NE(json_error_of(json{{"action", "crash"}, {"delay_ms", 3}}).find("does not apply to crash"), std::string::npos);
  EXPECT_NE(json_error_of(json::array()).find("give an object"), std::string::npos);
}

TEST(FaultPlan, ParsesObjectsAndStrings) {
  FaultPlan p = parse_fault_plan(json::parse(R"({"seed": 7, "faults": [{"action": "slow", "factor": 2}, "crash,after=3"]})"));
  EXPECT_EQ(p.seed, 7u);
  ASSERT_EQ(p.faults.size(), 2u);
  EXPECT_EQ(p.faults[0], parse_fault("slow,factor=2"));
  EXPECT_EQ(p.faults[1], parse_fault("crash,after=3"));

  auto err = [](const std::string& text) {
    try {
      parse_fault_plan(json::parse(text));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err(R"({"sed": 7})").find("unknown key \"sed\": did you mean \"seed\"?; the keys are: seed, faults"), std::string::npos);
  EXPECT_NE(err(R"({"seed": -1})").find("seed must be a whole number"), std::string::npos);
  EXPECT_NE(err(R"({"faults": ["crash,x=1"]})").find("unknown key \"x\""), std::string::npos);

  try {
    load_fault_plan("/nonexistent/plan.json");
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read the file"), std::string::npos);
  }
  const std::string path = "/tmp/swarm-test-fault-plan-" + std::to_string(getpid()) + ".json";
  std::ofstream(path) << R"({"seed": 3, "faults": ["nan,p=0.5"]})";
  EXPECT_EQ(load_fault_plan(path).faults.at(0), parse_fault("nan,p=0.5"));
  std::ofstream(path) << "{not json";
  try {
    load_fault_plan(path);
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos);
  }
  unlink(path.c_str());
}

TEST(FaultInjector, InertUntilAFaultIsAdded) {
  Rig r;
  EXPECT_FALSE(r.inj.armed());
  EXPECT_TRUE(r.at(FaultPoint::kBeforeCompute, 1).empty());
  EXPECT_FALSE(r.inj.frozen());
  EXPECT_FALSE(r.inj.partitioned());
  EXPECT_FALSE(r.inj.zombie());
}

TEST(FaultInjector, AfterCountsRequestsSinceArmed) {
  Rig r;
  r.inj.add(parse_fault("crash,after=3"));
  EXPECT_TRUE(r.at(FaultPoint::kBeforeCompute, 1).empty());
  EXPECT_TRUE(r.at(FaultPoint::kBeforeCompute, 2).empty());
  EXPECT_TRUE(r.at(FaultPoint::kAfterCompute, 3).empty());  // not its point
  auto h = r.at(FaultPoint::kBeforeCompute, 3);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].action, FaultAction::kCrash);
  EXPECT_EQ(h[0].spec, "crash,after=3");
  EXPECT_TRUE(r.at(FaultPoint::kBeforeCompute, 4).empty());  // count 1
  EXPECT_EQ(r.inj.fired(0), 1u);

  Rig live;
  live.inj.add(parse_fault("zombie,after=2"), /*requests_now=*/10);
  EXPECT_TRUE(live.at(FaultPoint::kAfterRecv, 11).empty());
  EXPECT_EQ(live.at(FaultPoint::kAfterRecv, 12).size(), 1u);
  EXPECT_TRUE(live.inj.zombie());
}

TEST(FaultInjector, StepWaitsForTheOptimizerStep) {
  Rig r;
  r.inj.add(parse_fault("nan,step=5,count=2"));
  EXPECT_TRUE(r.at(FaultPoint::kAfterCompute, 50, 4).empty());
  EXPECT_EQ(r.at(FaultPoint::kAfterCompute, 51, 5).size(), 1u);
  EXPECT_EQ(r.at(FaultPoint::kAfterCompute, 52, 9).size(), 1u);
  EXPECT_TRUE(r.at(FaultPoint::kAfterCompute, 53, 9).empty());
}

TEST(FaultInjector, AfterSecondsAndTheStatesItStarts) {
  Rig r;
  r.inj.add(parse_fault("freeze,after_s=5,duration_s=2"));
  r.inj.add(parse_fault("partition,after_s=1,duration_s=3,point=heartbeat"));
  r.inj.add(parse_fault("zombie,point=before_send"));
  r.t += 4.9;
  EXPECT_TRUE(r.at(FaultPoint::kAfterRecv, 1).empty());
  EXPECT_FALSE(r.inj.frozen());
  r.t += 0.1;
  auto h = r.at(FaultPoint::kAfterRecv, 2);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].duration_s, 2.0);
  EXPECT_TRUE(r.inj.frozen());
  EXPECT_DOUBLE_EQ(r.inj.frozen_until(), r.t + 2);
  r.t += 1.99;
  EXPECT_TRUE(r.inj.frozen());
  r.t += 0.02;
  EXPECT_FALSE(r.inj.frozen());

  EXPECT_FALSE(r.inj.partitioned());
  EXPECT_EQ(r.at(FaultPoint::kHeartbeat, 2, 0, int(wire::MsgType::kHeartbeat)).size(), 1u);
  EXPECT_TRUE(r.inj.partitioned());
  r.t += 3.01;
  EXPECT_FALSE(r.inj.partitioned());

  EXPECT_EQ(r.at(FaultPoint::kBeforeSend, 2, 0, int(wire::MsgType::kResult)).size(), 1u);
  r.t += 1e6;
  EXPECT_TRUE(r.inj.zombie());  // duration_s 0: forever
}

TEST(FaultInjector, OpportunitiesThatDoNotApply) {
  Rig r;
  r.inj.add(parse_fault("drop"));       // before_send, every reply
  r.inj.add(parse_fault("slow,factor=3"));
  r.inj.add(parse_fault("nan,count=1"));
  // A heartbeat is not a reply: only point=heartbeat faults see it.
  EXPECT_TRUE(r.at(FaultPoint::kBeforeSend, 1, 0, int(wire::MsgType::kHeartbeat)).empty());
  EXPECT_EQ(r.at(FaultPoint::kBeforeSend, 1, 0, int(wire::MsgType::kResult)).size(), 1u);
  // slow and nan only act on hops; nan only where the reply carries an output.
  EXPECT_TRUE(r.at(FaultPoint::kAfterCompute, 2, 0, int(wire::MsgType::kStep)).empty());
  FaultContext c;
  c.requests = 3;
  c.msg_type = int(wire::MsgType::kBackward);
  c.has_output = false;
  auto h = r.inj.check(FaultPoint::kAfterCompute, c);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].action, FaultAction::kSlow);
  EXPECT_EQ(h[0].factor, 3.0);
  c.has_output = true;
  EXPECT_EQ(r.inj.check(FaultPoint::kAfterCompute, c).size(), 2u);
  EXPECT_EQ(r.inj.check(FaultPoint::kAfterCompute, c).size(), 1u);  // nan's count was 1
}

TEST(FaultInjector, CountCapsTheFirings) {
  EXPECT_EQ(firings(1, "drop,count=3", 10), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(firings(1, "drop,count=3,after=5", 10), (std::vector<uint64_t>{5, 6, 7}));
  EXPECT_EQ(firings(1, "drop", 10).size(), 10u);
  EXPECT_TRUE(firings(1, "drop,p=0", 1000).empty());
}

TEST(FaultInjector, ProbabilityHasItsRateAndReplaysFromTheSeed) {
  const auto a = firings(7, "corrupt,p=0.1", 20000);
  EXPECT_NEAR(double(a.size()) / 20000, 0.1, 0.01);
  EXPECT_EQ(firings(7, "corrupt,p=0.1", 20000), a);  // same seed, same firings
  const auto b = firings(8, "corrupt,p=0.1", 20000);
  EXPECT_NE(a, b);
  EXPECT_NEAR(double(b.size()) / 20000, 0.1, 0.01);
  // The count cap keeps the first firings of the uncapped sequence.
  const auto capped = firings(7, "corrupt,p=0.1,count=5", 20000);
  EXPECT_EQ(capped, std::vector<uint64_t>(a.begin(), a.begin() + 5));
}

TEST(FaultInjector, DrawsDependOnTheSpecIndexAndReachTheHit) {
  Rig r(3);
  r.inj.add(parse_fault("drop,p=0.5"));
  r.inj.add(parse_fault("duplicate,p=0.5"));
  size_t both = 0, drops = 0;
  std::vector<uint64_t> randoms;
  for (uint64_t i = 1; i <= 4000; ++i) {
    auto h = r.at(FaultPoint::kBeforeSend, i, 0, int(wire::MsgType::kResult));
    if (h.size() == 2) both++;
    for (auto& x : h) {
      if (x.action == FaultAction::kDrop) drops++;
      randoms.push_back(x.random);
    }
  }
  EXPECT_NEAR(double(both) / 4000, 0.25, 0.03);  // independent draws per spec
  EXPECT_NEAR(double(drops) / 4000, 0.5, 0.03);
  std::sort(randoms.begin(), randoms.end());
  EXPECT_EQ(std::unique(randoms.begin(), randoms.end()), randoms.end());
}

TEST(FaultFrames, PeekTypeReadsTheEnvelope) {
  wire::Message m = wire::json_message(wire::MsgType::kResult, 5, 1, json{{"mb", 3}});
  auto frames = wire::encode(m);
  EXPECT_EQ(peek_type(frames), int(wire::MsgType::kResult));
  std::vector<zmq::message_t> junk;
  junk.emplace_back("xyz", 3);
  EXPECT_EQ(peek_type(junk), std::nullopt);
  EXPECT_EQ(peek_type({}), std::nullopt);
}

TEST(FaultFrames, CorruptionIsAlwaysCaughtByTheReceiver) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    wire::Message m = wire::json_message(wire::MsgType::kResult, 9, 0, json{{"mb", 3}, {"loss", 1.5}});
    std::vector<float> v(100, 0.25f);
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {100}, compression::CodecSpec{}, v.size() * 4);
    std::memcpy(t.data.data(), v.data(), v.size() * 4);
    wire::seal(t);
    m.tensors.push_back(std::move(t));
    auto frames = wire::encode(m);
    std::vector<zmq::message_t> shared;
    for (auto& f : frames) shared.emplace_back().copy(f);  // shares the payloads
    corrupt_frames(frames, seed * 0x9E3779B97F4A7C15ull);
    try {
      wire::decode(frames);
      FAIL() << "corrupted tensor message decoded, seed " << seed;
    } catch (const WireError& e) {
      EXPECT_EQ(e.code(), WireErrc::kChecksum);
    }
    EXPECT_NO_THROW(wire::decode(shared)) << "the shared payload was modified";
  }
  for (uint64_t seed = 0; seed < 20; ++seed) {
    for (json body : {json::object(), json{{"round", 3}, {"hash", 12345}}}) {
      wire::Message m = wire::json_message(wire::MsgType::kRoundDone, 9, 0, body);
      auto frames = wire::encode(m);
      corrupt_frames(frames, seed);
      EXPECT_THROW(wire::decode(frames), WireError) << body.dump();
    }
  }
}

TEST(FaultSpec, OnlyAtOneMessageType) {
  const FaultSpec s = parse_fault("crash,on=round_begin,after=5");
  EXPECT_EQ(s.on, int(wire::MsgType::kRoundBegin));
  EXPECT_EQ(parse_fault(to_string(s)), s);
  EXPECT_EQ(parse_fault_json(to_json(s)), s);
  FaultInjector inj(3);
  inj.add(s);
  FaultContext ctx;
  ctx.requests = 10;
  ctx.msg_type = int(wire::MsgType::kForward);
  EXPECT_TRUE(inj.check(FaultPoint::kBeforeCompute, ctx).empty());
  ctx.msg_type = int(wire::MsgType::kRoundBegin);
  EXPECT_EQ(inj.check(FaultPoint::kBeforeCompute, ctx).size(), 1u);
}
