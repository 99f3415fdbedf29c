// test_survival.cpp: whole swarms that keep training through crashed, hung, slow and lying
// peers. Every test runs the same job (seeded) on 2 stages x 2 real peers with one fault, and
// checks what the router guarantees: every step done, every microbatch taken completed
// (lost == 0), and a final validation loss within 5% of the same job without faults. The job
// averages gradients every step (diloco.sync every_step), so its result does not depend on
// which peer served what and runs are comparable.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "runtime/client.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSteps = 240;

// Long enough (several seconds) that a fault lands mid-run and a frozen peer can come back.
json survival_job(const std::string& data, int steps) {
  json j = tiny_job(data, 2, steps, "sync");
  j["model"]["d_model"] = 64;
  j["model"]["seq_len"] = 32;
  j["optimizer"] = {{"lr", 0.003}, {"min_lr", 0.0003}, {"warmup_steps", 10}};
  j["eval"] = {{"every_steps", 0}, {"batches", 8}};
  // The group sums its gradients every step: training does not depend on which peer served
  // which microbatch, so a run with faults can be compared with one without.
  j["diloco"]["sync"] = "every_step";
  j["diloco"]["inner_steps"] = 20;
  return j;
}

struct SwarmRun {
  json status;
  std::vector<pid_t> pids;
  double seconds = 0;
};

// Runs the job on s0-0, s0-1, s1-0, s1-1 (extra arguments per peer name); `during` is called
// with the swarm and each status while the job runs.
SwarmRun run_swarm(const std::string& data, int steps, const std::map<std::string, std::vector<std::string>>& args,
              const std::function<void(LocalSwarm&, Client&, const json&)>& during = nullptr) {
  const std::string dir = temp_dir();
  SwarmRun out;
  LocalSwarm swarm(dir, kBuild);
  swarm.start_router();
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 2; ++i) {
      const std::string name = "s" + std::to_string(s) + "-" + std::to_string(i);
      auto it = args.find(name);
      swarm.start_stage(s, name, 1, it == args.end() ? std::vector<std::string>{} : it->second);
    }
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 4);
  const uint64_t id = submit(c, survival_job(data, steps));
  const auto t0 = Clock::now();
  out.status = follow_to_end(c, id, 150, 100, [&](const json& st) {
    if (during) during(swarm, c, st);
  });
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (auto& s : swarm.stages()) out.pids.push_back(s.pid);
  return out;
}

const std::string& data_file() {
  static const std::string path = write_text(temp_dir());
  return path;
}

// The same job without faults, once per test binary and job length.
const SwarmRun& baseline(int steps = kSteps) {
  static std::map<int, SwarmRun> runs;
  auto it = runs.find(steps);
  if (it == runs.end()) it = runs.emplace(steps, run_swarm(data_file(), steps, {})).first;
  return it->second;
}

void expect_survived(const SwarmRun& r, int steps = kSteps) {
  const json& st = r.status;
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["step"], steps);
  const json& mb = st["microbatches"];
  EXPECT_EQ(mb["lost"], 0) << mb.dump();
  EXPECT_EQ(mb["taken"], mb["completed"]) << mb.dump();
  EXPECT_EQ(mb["taken"], steps * 4) << mb.dump();
  const json& base = baseline(steps).status;
  ASSERT_EQ(base["state"], "done") << base.dump();
  const double v = st["val_loss"].get<double>(), b = base["val_loss"].get<double>();
  EXPECT_LT(std::abs(v / b - 1.0), 0.05) << "val loss " << v << " vs " << b << " without faults";
  if (getenv("SWARM_TEST_DEBUG")) {
    auto a = train_losses(st), c = train_losses(base);
    for (size_t i = 0; i < a.size() && i < c.size(); i += 20) std::fprintf(stderr, "step %zu: %.4f vs %.4f\n", i + 1, a[i], c[i]);
  }
  for (pid_t p : r.pids) EXPECT_FALSE(alive(p)) << "process " << p << " left behind";
}

// The step the job is at, from a status.
int step(const json& st) { return st.value("step", 0); }

}  // namespace

TEST(Survival, OneOfTwoPeersOfAStageKilled) {
  bool killed = false;
  SwarmRun r = run_swarm(data_file(), kSteps, {}, [&](LocalSwarm& sw, Client&, const json& st) {
    if (!killed && step(st) >= kSteps / 4) {
      sw.kill_stage(3, SIGKILL);  // s1-1
      killed = true;
    }
  });
  ASSERT_TRUE(killed);
  expect_survived(r);
  EXPECT_EQ(r.status["peers_per_stage"][1], 1);
}

TEST(Survival, PeerFrozenForTenSecondsThenResumed) {
  // Frozen for 10 s after its 100th request; the router declares it dead within about 1.5 s,
  // the job goes on with the other peer, and when it thaws it reconnects, copies the group's
  // state and serves again. The job is long enough to see it back.
  constexpr int kLong = 600;
  bool saw_gone = false, saw_back = false;
  SwarmRun r = run_swarm(data_file(), kLong, {{"s1-1", {"--fault", "freeze,after=100,duration_s=10"}}},
                         [&](LocalSwarm&, Client&, const json& st) {
                           if (!st.contains("peers_per_stage")) return;
                           if (st["peers_per_stage"][1] == 1) saw_gone = true;
                           if (saw_gone && st["peers_per_stage"][1] == 2) saw_back = true;
                         });
  expect_survived(r, kLong);
  EXPECT_TRUE(saw_gone) << "the frozen peer was never declared gone";
  EXPECT_TRUE(saw_back) << "the thawed peer did not serve again (job took " << r.seconds << " s)";
}

TEST(Survival, ZombiePeerThatHeartbeatsButNeverAnswers) {
  // It goes silent on a hop (stage 1 of 2 gets FORWARD_LOSS), so that hop must be re-sent. On
  // a STEP or a round message instead, no hop would be left waiting on it.
  SwarmRun r = run_swarm(data_file(), kSteps, {{"s1-1", {"--fault", "zombie,after=100,on=forward_loss"}}});
  expect_survived(r);
  EXPECT_GT(r.status["timeouts"].get<int>(), 0);
  EXPECT_GT(r.status["microbatches"]["resent"].get<int>(), 0);
}

TEST(Survival, PeerSlowedTenTimesDoesNotSetThePace) {
  SwarmRun r = run_swarm(data_file(), kSteps, {{"s1-1", {"--fault", "slow,factor=10,count=0"}}});
  expect_survived(r);
  // Had the slow peer taken its even share, the job would run at its pace: several times
  // slower. The dispatcher sends it little work, so the job stays close to the baseline.
  EXPECT_LT(r.seconds, 2.5 * baseline().seconds) << r.seconds << " s vs " << baseline().seconds << " s without faults";
}

TEST(Survival, PeerCorruptingFivePercentOfItsMessages) {
  SwarmRun r = run_swarm(data_file(), kSteps, {{"s1-1", {"--fault", "corrupt,p=0.05"}}});
  expect_survived(r);
  EXPECT_GT(r.status["integrity_failures"].get<int>(), 0);
}

TEST(Survival, PeerReturningNaNOnceInAWhile) {
  // Stage 0's outputs are stage 1's inputs: the router must stop them in between.
  SwarmRun r = run_swarm(data_file(), kSteps, {{"s0-1", {"--fault", "nan,p=0.03"}}});
  expect_survived(r);
  EXPECT_GT(r.status["integrity_failures"].get<int>(), 0);
  EXPECT_GT(r.status["microbatches"]["rejected"].get<int>(), 0);
}

TEST(Survival, WholeStageKilledThenAFreshPeerResumesFromItsSnapshot) {
  int phase = 0;
  SwarmRun r = run_swarm(data_file(), kSteps, {}, [&](LocalSwarm& sw, Client&, const json& st) {
    if (phase == 0 && step(st) >= kSteps / 3) {
      sw.kill_stage(2, SIGKILL);
      sw.kill_stage(3, SIGKILL);
      phase = 1;
    } else if (phase == 1 && st["peers_per_stage"][1] == 0) {
      sw.start_stage(1, "s1-new", 1);
      phase = 2;
    }
  });
  ASSERT_EQ(phase, 2);
  expect_survived(r);
  const json& restores = r.status["stage_restores"];
  ASSERT_EQ(restores.size(), 1u) << r.status.dump();
  EXPECT_EQ(restores[0]["stage"], 1);
  EXPECT_GE(restores[0]["snapshot_step"].get<int>(), 20);  // a snapshot, not the initial weights
}

TEST(Survival, RogueClientFeedingGarbageToTheRouter) {
  std::atomic<bool> stop{false};
  std::thread rogue;
  std::mutex mu;
  SwarmRun r = run_swarm(data_file(), kSteps, {}, [&](LocalSwarm& sw, Client&, const json& st) {
    if (rogue.joinable() || step(st) < 10) return;
    const std::string ep = sw.router_endpoint();
    rogue = std::thread([ep, &stop] {
      zmq::context_t ctx(1);
      zmq::socket_t s(ctx, zmq::socket_type::dealer);
      s.set(zmq::sockopt::linger, 0);
      s.connect(ep);
      uint64_t x = 12345;
      while (!stop) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int frames = 1 + int((x >> 40) % 4);
        for (int f = 0; f < frames; ++f) {
          std::string b(size_t((x >> (8 * f)) % 300), char(x >> 13));
          for (size_t k = 0; k < b.size(); ++k) b[k] = char((x >> (k % 56)) ^ k);
          if (f == 0 && x % 3 == 0) {  // a sound envelope, then truncated or random frames
            auto env = json::to_msgpack(json::array({"SWRM", wire::kVersion, 24, x % 1000, 0}));
            b.assign(env.begin(), env.end());
          }
          // Never blocks: when the router falls behind, the rogue waits rather than hanging.
          if (!s.send(zmq::buffer(b), (f + 1 < frames ? zmq::send_flags::sndmore : zmq::send_flags::none) | zmq::send_flags::dontwait)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            break;
          }
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  });
  stop = true;
  if (rogue.joinable()) rogue.join();
  expect_survived(r);
}
