// test_faults.cpp: injected faults on real processes.
//
// A real swarm-stage talks to a fake router (a ROUTER socket in this test) so that every
// message it sends can be inspected: CHAOS arms a fault or is refused with an ERROR; crash
// dies by SIGKILL; zombie heartbeats but never answers; drop, duplicate, delay and corrupt act on
// replies and heartbeats; freeze and partition silence it and it carries on afterwards. Then
// LocalSwarm's chaos runner stops, resumes, kills and restarts real peers from a plan. No model
// is loaded: a STEP before LOAD_STAGE is answered with an ERROR, which is reply enough. Every
// wait is bounded; every process is killed by its pid at the end.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/chaos_plan.h"
#include "runtime/messages.h"
#include "runtime/wire.h"
#include "swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;
using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A swarm-stage process, killed (SIGCONT, SIGKILL) by its pid when the test ends.
struct StageProcess {
  pid_t pid = -1;
  StageProcess(const std::string& endpoint, const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> argv = {kBuild + "/swarm-stage", "--router", endpoint, "--name", "faulty", "--threads", "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      FILE* f = std::freopen(log.c_str(), "w", stderr);
      (void)f;
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~StageProcess() {
    if (pid > 0) {
      kill(pid, SIGCONT);
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  // The signal that ended it within timeout_s, 0 if it exited normally, -1 if still running.
  int wait_death(double timeout_s) {
    const auto t0 = Clock::now();
    while (since(t0) < timeout_s) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
};

// The router side of one stage server, on loopback.
class FakeRouter {
 public:
  FakeRouter() : sock_(ctx_, zmq::socket_type::router) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::router_handover, 1);  // a reconnecting stage keeps its routing id
    sock_.bind("tcp://127.0.0.1:*");
    endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
  }
  const std::string& endpoint() const { return endpoint_; }

  // The next message's frames within timeout_s (nullopt when none). While waiting it sends the
  // stage a heartbeat every 100 ms when `keepalive`, as a router does.
  std::optional<std::vector<zmq::message_t>> next_frames(double timeout_s) {
    const auto t0 = Clock::now();
    while (since(t0) < timeout_s) {
      if (keepalive && !route_.empty() && since(last_beat_) > 0.1) {
        Message hb(MsgType::kHeartbeat);
        send(hb);
      }
      zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(20));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      auto r = wire::recv_frames(sock_, true, zmq::recv_flags::dontwait);
      if (!r) continue;
      route_ = r->route;
      return std::move(r->frames);
    }
    return std::nullopt;
  }

  // The next message that decodes and is not a heartbeat (heartbeats are counted).
  std::optional<Message> next(double timeout_s) {
    const auto t0 = Clock::now();
    while (since(t0) < timeout_s) {
      auto f = next_frames(timeout_s - since(t0));
      if (!f) return std::nullopt;
      Message m = wire::decode(*f);
      if (m.type == MsgType::kHeartbeat) {
        heartbeats++;
        continue;
      }
      return m;
    }
    return std::nullopt;
  }

  // Waits for HELLO (libtorch takes a while to load) and welcomes the stage.
  void welcome(int heartbeat_ms, int liveness) {
    auto m = next(30);
    ASSERT_TRUE(m) << "no HELLO from the stage server";
    ASSERT_EQ(m->type, MsgType::kHello);
    Message w = wire::json_message(MsgType::kWelcome, 0, 0, json{{"peer_id", wire::id_json("p-test")}, {"heartbeat_ms", heartbeat_ms}, {"liveness", liveness}});
    send(w);
  }

  void send(Message& m) {
    wire::send(sock_, m, &route_);
    last_beat_ = Clock::now();
  }
  // A request the stage answers with ERROR (no stage is loaded): enough to exercise replies.
  void step(uint64_t id) {
    Message m = wire::json_message(MsgType::kStep, id, 0, json{{"job_id", 1}, {"samples", 4}});
    send(m);
  }

  bool keepalive = true;
  int heartbeats = 0;

 private:
  zmq::context_t ctx_{1};
  zmq::socket_t sock_;
  std::string endpoint_, route_;
  Clock::time_point last_beat_ = Clock::now();
};

}  // namespace

TEST(StageFaults, ChaosArmsAFaultOrIsRefused) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {}, dir + "/stage.log");
  r.welcome(100, 100);

  Message bad = wire::json_message(MsgType::kChaos, 5, 0, json{{"fault", "crash,factr=1"}});
  r.send(bad);
  auto e = r.next(5);
  ASSERT_TRUE(e);
  ASSERT_EQ(e->type, MsgType::kError);
  EXPECT_EQ(e->id, 5u);
  EXPECT_NE(body_json(*e).value("message", "").find("unknown key \"factr\""), std::string::npos) << body_json(*e).dump();

  Message crash = wire::json_message(MsgType::kChaos, 6, 0, json{{"fault", {{"action", "crash"}, {"point", "heartbeat"}}}});
  r.send(crash);
  EXPECT_EQ(stage.wait_death(5), SIGKILL);
  const std::string log = slurp(dir + "/stage.log");
  EXPECT_NE(log.find("fault added by the router: crash,point=heartbeat"), std::string::npos) << log;
  EXPECT_NE(log.find("fault fired: crash,point=heartbeat"), std::string::npos) << log;
}

// A WELCOME, ERROR or BYE whose fields have the wrong types used to escape the stage server's
// I/O loop and end the process: each is now counted, dropped, and the server carries on.
TEST(StageFaults, MalformedSessionMessagesFromTheRouterAreDropped) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {}, dir + "/stage.log");
  r.welcome(100, 100);
  for (json body : {json{{"heartbeat_ms", "x"}}, json{{"liveness", 1e300}}}) {
    Message w = wire::json_message(MsgType::kWelcome, 0, 0, body);
    r.send(w);
  }
  Message e = wire::json_message(MsgType::kError, 0, 0, json{{"code", "x"}});
  r.send(e);
  Message bye = wire::json_message(MsgType::kBye, 0, 0, json{{"reason", 12}});
  r.send(bye);
  // Still alive and heartbeating, with the four counted in its errors.
  const auto t0 = Clock::now();
  uint64_t errors = 0;
  while (since(t0) < 10 && errors < 4) {
    auto f = r.next_frames(1);
    ASSERT_TRUE(f) << "the stage server stopped talking";
    Message m = wire::decode(*f);
    if (m.type == MsgType::kHeartbeat) errors = msg::read<msg::Heartbeat>(m).errors;
  }
  EXPECT_EQ(errors, 4u);
  EXPECT_EQ(stage.wait_death(0.2), -1) << "the stage server exited";
  const std::string log = slurp(dir + "/stage.log");
  EXPECT_NE(log.find("dropped a malformed WELCOME from the router: WELCOME.heartbeat_ms must be an integer"), std::string::npos) << log;
  EXPECT_NE(log.find("dropped a malformed ERROR from the router: ERROR.code must be an integer"), std::string::npos) << log;
}

TEST(StageFaults, ZombieHeartbeatsButNeverAnswers) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {"--fault", "zombie,after=2"}, dir + "/stage.log");
  r.welcome(100, 100);
  r.step(1);
  auto e = r.next(5);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->type, MsgType::kError);
  EXPECT_EQ(e->id, 1u);
  r.step(2);
  r.step(3);
  r.heartbeats = 0;
  EXPECT_FALSE(r.next(1.0)) << "a zombie answered";
  EXPECT_GE(r.heartbeats, 5) << "a zombie keeps heartbeating";
}

// The router counts any message as a sign of life, so a peer answering requests skips most of
// its heartbeats (timing::next_heartbeat_s): every fourth goes out, and no silence reaches the
// router's window. Idle again, it heartbeats every beat.
TEST(StageFaults, ABusyPeerSkipsMostHeartbeatsButNeverFallsSilent) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {}, dir + "/stage.log");
  r.welcome(100, 3);
  // Busy: a request every 50 ms for 3 s (each answered ERROR: no stage is loaded).
  int beats = 0, answers = 0;
  double last_heard = -1, longest_silence = 0;
  const auto t0 = Clock::now();
  uint64_t id = 1;
  auto heard = [&](std::vector<zmq::message_t>& f) {
    const double t = since(t0);
    if (last_heard >= 0) longest_silence = std::max(longest_silence, t - last_heard);
    last_heard = t;
    if (wire::decode(f).type == MsgType::kHeartbeat) beats++;
    else answers++;
  };
  while (since(t0) < 3.0) {
    r.step(id++);
    const auto t1 = Clock::now();
    while (since(t1) < 0.05)
      if (auto f = r.next_frames(0.05 - since(t1))) heard(*f);
  }
  EXPECT_GE(answers, 40) << "the stage server stopped answering";
  // 30 beats in 3 s; every fourth of them: about 8.
  EXPECT_GE(beats, 4) << "a busy peer still sends every fourth heartbeat";
  EXPECT_LE(beats, 12) << "a busy peer sent most of its heartbeats";
  EXPECT_LT(longest_silence, 0.3) << "a silence the router (liveness 3 x 100 ms) would take for death";
  // Idle: every beat again.
  beats = 0;
  const auto t2 = Clock::now();
  while (since(t2) < 2.0)
    if (auto f = r.next_frames(2.0 - since(t2))) heard(*f);
  EXPECT_GE(beats, 14) << "an idle peer heartbeats every 100 ms";
  EXPECT_EQ(stage.wait_death(0.1), -1) << "the stage server exited";
}

TEST(StageFaults, DropDuplicateDelayAndCorruptReplies) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(),
                     {"--fault", "drop,count=1", "--fault", "duplicate,after=2,count=1", "--fault",
                      "delay,after=3,count=1,delay_ms=400", "--fault", "corrupt,after=4,count=1"},
                     dir + "/stage.log");
  r.welcome(100, 100);

  r.step(1);
  EXPECT_FALSE(r.next(0.6)) << "the first reply should have been dropped";

  r.step(2);
  for (int copy = 0; copy < 2; ++copy) {
    auto e = r.next(5);
    ASSERT_TRUE(e) << "copy " << copy;
    EXPECT_EQ(e->id, 2u);
  }

  const auto t0 = Clock::now();
  r.step(3);
  auto e = r.next(5);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->id, 3u);
  EXPECT_GE(since(t0), 0.38);

  r.step(4);
  bool rejected = false;
  for (int i = 0; i < 100 && !rejected; ++i) {
    auto f = r.next_frames(5);
    ASSERT_TRUE(f);
    if (wire::peek_id(*f) == std::optional<uint64_t>(0)) continue;  // a heartbeat
    EXPECT_THROW(wire::decode(*f), WireError);
    rejected = true;
  }
  EXPECT_TRUE(rejected);
  r.step(5);  // every fault has used its count: a plain answer
  e = r.next(5);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->id, 5u);
}

TEST(StageFaults, CorruptHeartbeatIsCaughtByItsReceiver) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {"--fault", "corrupt,point=heartbeat,count=1"}, dir + "/stage.log");
  r.welcome(100, 100);
  int bad = 0, good = 0;
  const auto t0 = Clock::now();
  while (since(t0) < 10 && good < 3) {
    auto f = r.next_frames(5);
    ASSERT_TRUE(f);
    try {
      if (wire::decode(*f).type == MsgType::kHeartbeat) good++;
    } catch (const WireError&) {
      bad++;
    }
  }
  EXPECT_EQ(bad, 1);
  EXPECT_EQ(good, 3);
}

TEST(StageFaults, FreezeSilencesEverythingThenCarriesOn) {
  const std::string dir = temp_dir();
  FakeRouter r;
  StageProcess stage(r.endpoint(), {"--fault", "freeze,point=heartbeat,after_s=0.5,duration_s=1.5"}, dir + "/stage.log");
  r.welcome(100, 100);
  // Heartbeats 0.1 s apart, one gap of about 1.5 s, then heartbeats again.
  double longest = 0;
  auto last = Clock::now();
  int after_gap = 0;
  const auto t0 = Clock::now();
  while (since(t0) < 10 && after_gap < 3) {
    auto f = r.next_frames(5);
    ASSERT_TRUE(f) << "no heartbeat for 5 s";
    const double gap = since(last);
    last = Clock::now();
    if (longest > 1.0) after_gap++;
    longest = std::max(longest, gap);
  }
  EXPECT_GE(longest, 1.3);
  EXPECT_LT(longest, 3.0);
  EXPECT_EQ(after_gap, 3);
  r.step(1);
  auto e = r.next(5);
  ASSERT_TRUE(e) << "a thawed stage server answers again";
  EXPECT_EQ(e->id, 1u);
}

TEST(StageFaults, PartitionCutsTrafficThenTheStageRejoins) {
  const std::string dir = temp_dir();
  FakeRouter r;
  // Silence rule: 10 x 100 ms. The partition outlasts it, so the stage says HELLO afterwards.
  StageProcess stage(r.endpoint(), {"--fault", "partition,point=heartbeat,after_s=0.5,duration_s=2"}, dir + "/stage.log");
  r.welcome(100, 10);
  const auto t0 = Clock::now();
  auto last = Clock::now();
  double longest = 0;
  bool hello_again = false;
  while (since(t0) < 10 && !hello_again) {
    auto f = r.next_frames(5);
    ASSERT_TRUE(f) << "nothing from the stage for 5 s";
    longest = std::max(longest, since(last));
    last = Clock::now();
    hello_again = wire::decode(*f).type == MsgType::kHello;
  }
  EXPECT_TRUE(hello_again);
  EXPECT_GE(longest, 1.8);
  const std::string log = slurp(dir + "/stage.log");
  EXPECT_NE(log.find("partition over"), std::string::npos) << log;
}

TEST(LocalChaos, PlanStopsResumesKillsAndRestartsRealPeers) {
  const std::string dir = temp_dir();
  ChaosPlan plan = parse_chaos_plan(json::parse(R"({
    "seed": 3,
    "faults": {"b": ["slow,factor=2"]},
    "events": [
      {"at_s": 0.2, "action": "stop", "peer": "a", "duration_s": 0.5},
      {"at_s": 1.0, "action": "kill", "peer": "random", "restart_after_s": 0.5},
      {"every_s": 0.3, "start_s": 2.0, "count": 2, "action": "cont"}
    ]})"));
  LocalSwarm swarm(dir, kBuild);
  swarm.set_stage_faults(plan);
  swarm.start_router();
  swarm.start_stage(0, "a", 1);
  swarm.start_stage(0, "b", 1);
  const pid_t a0 = swarm.stages()[0].pid, b0 = swarm.stages()[1].pid;

  ChaosPlan wrong = plan;
  wrong.events[0].peer = "zz";
  try {
    swarm.run_chaos(wrong);
    FAIL() << "a plan naming an unknown peer ran";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("\"zz\", which this swarm does not have; its peers are: a, b"), std::string::npos) << e.what();
  }

  std::vector<ChaosRecord> seen;
  std::mutex mu;
  swarm.run_chaos(plan, [&](const ChaosRecord& r) {
    std::lock_guard<std::mutex> l(mu);
    seen.push_back(r);
  });
  for (int i = 0; i < 300 && swarm.chaos_log().size() < 6; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto log = swarm.chaos_log();
  ASSERT_EQ(log.size(), 6u);
  EXPECT_EQ(log[0].action, "stop");
  EXPECT_EQ(log[0].peer, "a");
  EXPECT_EQ(log[0].pid, a0);
  EXPECT_EQ(log[1].action, "cont");
  EXPECT_EQ(log[1].peer, "a");
  EXPECT_GE(log[1].t_s - log[0].t_s, 0.45);  // resumed duration_s later (a loaded machine may be late)
  EXPECT_LT(log[1].t_s - log[0].t_s, 2.0);
  EXPECT_EQ(log[2].action, "kill");
  const size_t victim = log[2].index;
  EXPECT_EQ(log[2].pid, victim == 0 ? a0 : b0);
  EXPECT_EQ(log[3].action, "restart");
  EXPECT_EQ(log[3].index, victim);
  EXPECT_NE(log[3].pid, log[2].pid);
  EXPECT_TRUE(alive(log[3].pid));
  EXPECT_GE(log[3].t_s - log[2].t_s, 0.45);
  EXPECT_LT(log[3].t_s - log[2].t_s, 2.0);
  EXPECT_GE(log[2].t_s, 0.95);
  // Nothing is stopped any more: the periodic cont finds no peer to resume.
  EXPECT_EQ(log[4].action, "cont");
  EXPECT_NE(log[4].note.find("skipped: no peer fits"), std::string::npos) << log[4].note;
  {
    std::lock_guard<std::mutex> l(mu);
    EXPECT_EQ(seen.size(), log.size());
  }

  // b started with the plan's fault (and gets it again when restarted). When b was the one
  // killed, its log is the restarted process's, which may only just have started: wait a little.
  std::string blog = slurp(dir + "/b.log");
  for (int i = 0; i < 100 && blog.find("slow,factor=2") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    blog = slurp(dir + "/b.log");
  }
  EXPECT_NE(blog.find("faults armed"), std::string::npos) << blog;
  EXPECT_NE(blog.find("slow,factor=2"), std::string::npos) << blog;
  EXPECT_EQ(slurp(dir + "/a.log").find("faults armed"), std::string::npos);

  // A stopped peer left behind is resumed and stopped with the rest.
  swarm.kill_stage(1, SIGSTOP);
  const pid_t b = swarm.stages()[1].pid, a = swarm.stages()[0].pid;
  swarm.stop_all();
  EXPECT_FALSE(alive(a));
  EXPECT_FALSE(alive(b));
}
