// test_swarm.cpp: whole swarms of real processes on loopback.
//
// Each test starts swarm-router and swarm-stage processes from the build directory, submits a
// job over the wire, and checks what a user relies on: the loss falls, a killed peer costs no
// microbatch, the sync schedule equals the single-process reference, bad input is refused
// with a clear message. Every test is bounded in time and leaves no process behind.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "runtime/client.h"
#include "tools/local_swarm.h"
#include "tests/integration/swarm_test_util.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;


TEST(Swarm, TrainsThroughAKilledPeerAndLosesNothing) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  std::vector<pid_t> pids;
  {
    LocalSwarm swarm(dir, kBuild);
    swarm.start_router();
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < 2; ++i) swarm.start_stage(s, "s" + std::to_string(s) + "-" + std::to_string(i), 1);
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 4);
    const uint64_t id = submit(c, tiny_job(data, 2, 40, "async"));
    // Kill one peer of stage 1 once the job is well under way.
    bool killed = false;
    json st;
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
      if (!killed && st["step"].get<int>() >= 10) {
        swarm.kill_stage(2, SIGKILL);
        killed = true;
      }
      const std::string state = st["state"];
      if (state == "done" || state == "failed") break;
      ASSERT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 240) << st.dump();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(killed);
    ASSERT_EQ(st["state"], "done") << st.dump();
    EXPECT_EQ(st["step"], 40);
    const auto& mb = st["microbatches"];
    EXPECT_EQ(mb["lost"], 0);
    EXPECT_EQ(mb["taken"], mb["completed"]);
    EXPECT_EQ(mb["taken"], 40 * 4);
    // The loss fell: last step well under the first, and the model beats the unigram baseline.
    const auto& h = st["history"];
    double first = 0, last = 0;
    for (const auto& e : h)
      if (e.contains("train_loss")) {
        if (first == 0) first = e["train_loss"];
        last = e["train_loss"];
      }
    EXPECT_LT(last, first - 1.0) << h.dump();
    EXPECT_LT(st["val_loss"].get<double>(), st["unigram_loss"].get<double>());
    for (auto& s : swarm.stages()) pids.push_back(s.pid);
    // The killed peer's stage kept one live peer.
    EXPECT_EQ(st["peers_per_stage"][1], 1);
  }
  for (pid_t p : pids) EXPECT_FALSE(alive(p)) << "process " << p << " left behind";
}

TEST(Swarm, SyncScheduleMatchesSingleProcess) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json spec = tiny_job(data, 2, 10, "sync");
  spec["diloco"]["inner_steps"] = 100;
  const std::string path = dir + "/job.json";
  std::ofstream(path) << spec.dump();

  const json ref = run_reference(path);
  ASSERT_TRUE(ref.contains("losses"));

  LocalSwarm swarm(dir, kBuild);
  start_pipeline(swarm, 2);
  Client c(swarm.router_endpoint());
  const uint64_t id = submit(c, spec);
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 180;
  json st = follow_job(c, id, fo);
  ASSERT_EQ(st["state"], "done") << st.dump();
  std::vector<double> losses;
  for (const auto& e : st["history"])
    if (e.contains("train_loss")) losses.push_back(e["train_loss"]);
  ASSERT_EQ(losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    const double r = ref["losses"][i].get<double>();
    EXPECT_NEAR(losses[i], r, 1e-4 * std::abs(r)) << "step " << i + 1;
  }
}

// Compressed hops end to end, with and without zstd packing: packing is lossless (same losses)
// and the activations and gradients cost fewer bytes on the wire than their int8 codes.
TEST(Swarm, Int8HopsPackedWithZstdTrainTheSameOnFewerBytes) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  LocalSwarm swarm(dir, kBuild);
  start_pipeline(swarm, 2);
  Client c(swarm.router_endpoint());
  auto train = [&](const std::string& codec) {
    json spec = tiny_job(data, 2, 20, "sync");
    spec["compression"] = {{"activations", codec}, {"gradients", codec}};
    FollowOptions fo;
    fo.quiet = true;
    fo.timeout_s = 120;
    return follow_job(c, submit(c, spec), fo);
  };
  const json plain = train("int8:block=256");
  const json packed = train("int8:block=256,entropy=zstd");
  ASSERT_EQ(plain["state"], "done") << plain.dump();
  ASSERT_EQ(packed["state"], "done") << packed.dump();
  EXPECT_NEAR(packed["val_loss"].get<double>(), plain["val_loss"].get<double>(), 1e-4 * plain["val_loss"].get<double>());
  EXPECT_LT(packed["val_loss"].get<double>(), packed["unigram_loss"].get<double>());
  for (const char* dir_name : {"activations", "gradients"}) {
    const double a = plain["wire_bytes_per_sample"][dir_name].get<double>(), b = packed["wire_bytes_per_sample"][dir_name].get<double>();
    EXPECT_GT(a, 0) << dir_name;
    EXPECT_LT(b, a) << dir_name << ": zstd should pack int8 codes";
  }
}

TEST(Swarm, BadJobSpecIsRefusedWithAClearMessage) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json spec = tiny_job(data, 4, 5, "async");
  spec["model"]["n_layer"] = 7;
  const std::string path = dir + "/bad.json";
  std::ofstream(path) << spec.dump();
  auto [rc, out] = run(kBuild + "/swarm local " + path);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("layers_per_stage"), std::string::npos) << out;

  spec = tiny_job(data, 2, 5, "async");
  spec["data"]["path"] = dir + "/missing.txt";
  std::ofstream(path) << spec.dump();
  std::tie(rc, out) = run(kBuild + "/swarm local " + path);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("missing.txt"), std::string::npos) << out;

  // A router that is not there: a message naming the address, not a hang.
  std::tie(rc, out) = run(kBuild + "/swarm status --router tcp://127.0.0.1:9");
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("tcp://127.0.0.1:9"), std::string::npos) << out;
}

// `swarm sim` on a scenario of the corpus: the run meets its expectations (exit 0), and both
// outputs say where the peers' capacity went, per sample and per peer group.
TEST(Swarm, SimCommandSaysWhereThePeersCapacityWent) {
  const std::string scenario = kSource + "/examples/sim/tiny_local.json";
  auto [rc, out] = run(kBuild + "/swarm sim " + scenario);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("FLOPs to hops"), std::string::npos) << out;
  const size_t by_group = out.find("time computing, by group:");
  ASSERT_NE(by_group, std::string::npos) << out;
  const std::string groups = out.substr(by_group, out.find('\n', by_group) - by_group);
  for (const char* g : {" s0 0.", " s1 0.", " s2 0.", " s3 0."}) EXPECT_NE(groups.find(g), std::string::npos) << groups;

  std::tie(rc, out) = run(kBuild + "/swarm sim " + scenario + " --json");
  EXPECT_EQ(rc, 0) << out;
  json summary;
  std::istringstream lines(out);
  for (std::string l; std::getline(lines, l);) {
    const json j = json::parse(l, nullptr, false);
    if (j.is_object() && j.contains("last_hour")) summary = j;
  }
  ASSERT_TRUE(summary.is_object()) << out;
  EXPECT_EQ(summary["last_hour"]["busy"].size(), 4u) << summary["last_hour"].dump();
  for (const auto& [g, share] : summary["last_hour"]["busy"].items()) {
    EXPECT_GT(share.get<double>(), 0.0) << g;
    EXPECT_LE(share.get<double>(), 1.0) << g;
  }
}

TEST(Swarm, RouterSurvivesGarbageFromARogueClient) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  LocalSwarm swarm(dir, kBuild);
  // No keys: the rogue is a connected client sending garbage (under CURVE a stranger gets no
  // connection at all: Security.KeysThatAreNotListedGetNothingAndRolesLimitTheRest).
  swarm.set_secure(false);
  swarm.start_router();
  swarm.start_stage(-1, "solo", 1);
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 1);
  const uint64_t id = submit(c, tiny_job(data, 1, 12, "async"));

  zmq::context_t ctx(1);
  zmq::socket_t rogue(ctx, zmq::socket_type::dealer);
  rogue.set(zmq::sockopt::linger, 0);
  rogue.connect(swarm.router_endpoint());
  uint64_t x = 99;
  for (int i = 0; i < 2000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int frames = 1 + int((x >> 40) % 4);
    for (int f = 0; f < frames; ++f) {
      std::string b(size_t((x >> (8 * f)) % 200), char(x >> 13));
      for (size_t k = 0; k < b.size(); ++k) b[k] = char((x >> (k % 56)) ^ k);
      if (i % 3 == 0 && f == 0) {
        auto env = json::to_msgpack(json::array({"SWRM", wire::kVersion, 24, i, 0}));  // a RESULT nobody asked for
        b.assign(env.begin(), env.end());
      }
      rogue.send(zmq::buffer(b), f + 1 < frames ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 180;
  json st = follow_job(c, id, fo);
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  json status = c.request_body(wire::MsgType::kStatus, json::object());
  EXPECT_GT(status["router"]["bad_messages"].get<int>(), 100);
}
