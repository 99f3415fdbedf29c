// test_p2p.cpp: peer-to-peer hops on real processes over loopback: the router carries no
// activation, a holder killed mid-run has its tensors made again, a peer others cannot reach
// is relayed, peer to peer trains exactly what the hub does, and stages that hold the data
// sample their own tokens and train the same.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <thread>

#include "runtime/client.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;


TEST(P2p, TheRouterCarriesNoActivationAndTrainsWhatTheHubTrains) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json spec = tiny_job(data, 3, 12, "sync");
  json hub = spec;
  hub["routing"] = {{"hops", "hub"}};
  json a, b;
  {
    LocalSwarm swarm(dir, kBuild);
    swarm.start_router();
    for (int s = 0; s < 3; ++s) swarm.start_stage(s, "s" + std::to_string(s), 1);
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 3);
    a = follow_to_end(c, submit(c, spec), 240, 50);
    b = follow_to_end(c, submit(c, hub), 240, 50);
  }
  ASSERT_EQ(a["state"], "done") << a.dump();
  ASSERT_EQ(b["state"], "done") << b.dump();
  EXPECT_EQ(a["hops"]["mode"], "p2p");
  EXPECT_EQ(a["hops"]["bytes_through_router"], 0) << a["hops"].dump();
  // Each hop's holder was told to push the tensor to the receiver as the hop went out.
  EXPECT_GT(a["hops"]["pushed"].get<uint64_t>(), 0u) << a["hops"].dump();
  EXPECT_EQ(b["hops"]["pushed"], 0) << b["hops"].dump();
  // The middle stage's inputs came pushed: forward inputs on the router's PUSH, the loss's
  // gradients as they were made (what it fetched is what came late, if anything did).
  const std::string log = slurp(dir + "/s1.log");
  const size_t at = log.find("peer to peer: ");
  ASSERT_NE(at, std::string::npos) << log;
  long fetched = -1, pushed_in = -1;
  ASSERT_EQ(std::sscanf(log.c_str() + at, "peer to peer: %ld fetched, %ld pushed here", &fetched, &pushed_in), 2) << log.substr(at, 200);
  EXPECT_GT(pushed_in, 0) << log.substr(at, 200);
  EXPECT_LT(fetched, pushed_in) << log.substr(at, 200);
  EXPECT_GT(b["hops"]["bytes_through_router"].get<uint64_t>(), 0u);
  // One peer per stage under sync: both transports compute the same thing, bit for bit.
  EXPECT_EQ(train_losses(a), train_losses(b));
  // Peer to peer a backward runs where its forward ran and fetches nothing for its input: fewer
  // activation bytes move than through the hub, the same gradient bytes.
  EXPECT_LT(a["wire_bytes"]["activations"].get<double>(), b["wire_bytes"]["activations"].get<double>());
  EXPECT_EQ(a["wire_bytes"]["gradients"], b["wire_bytes"]["gradients"]);
}

// The first and last stages read the job's data where the router does (LocalSwarm passes
// --data-root /) and sample their hops' tokens and targets themselves: the router sends none, and
// training is the same, bit for bit, as with every token sent.
TEST(P2p, StagesWithTheDataSampleTheirOwnTokensAndTrainTheSame) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  const json spec = tiny_job(data, 2, 12, "sync");
  auto run = [&](const std::string& name, const std::vector<std::string>& args) {
    LocalSwarm swarm(dir + "/" + name, kBuild);
    swarm.start_router();
    for (int s = 0; s < 2; ++s) swarm.start_stage(s, "s" + std::to_string(s), 1, args);
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 2);
    return follow_to_end(c, submit(c, spec), 240, 50);
  };
  const json own = run("own", {});
  const json sent = run("sent", {"--data-root", dir + "/nowhere"});
  ASSERT_EQ(own["state"], "done") << own.dump();
  ASSERT_EQ(sent["state"], "done") << sent.dump();
  EXPECT_GT(own["hops"]["own_tokens"].get<uint64_t>(), 0u) << own["hops"].dump();
  EXPECT_EQ(sent["hops"]["own_tokens"], 0) << sent["hops"].dump();
  EXPECT_EQ(own["hops"]["token_bytes"], 0) << own["hops"].dump();
  EXPECT_GT(sent["hops"]["token_bytes"].get<uint64_t>(), 0u) << sent["hops"].dump();
  EXPECT_EQ(train_losses(own), train_losses(sent));
  EXPECT_NE(slurp(dir + "/own/s0.log").find("samples its own tokens"), std::string::npos);
  EXPECT_NE(slurp(dir + "/sent/s1.log").find("is not under --data-root"), std::string::npos) << slurp(dir + "/sent/s1.log");
}

TEST(P2p, AHolderKilledMidRunHasItsTensorsMadeAgainAndNothingIsLost) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json st;
  bool killed = false;
  {
    LocalSwarm swarm(dir, kBuild);
    swarm.start_router();
    for (int s = 0; s < 3; ++s)
      for (int i = 0; i < 2; ++i) swarm.start_stage(s, "s" + std::to_string(s) + "-" + std::to_string(i), 1);
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 6);
    st = follow_to_end(c, submit(c, tiny_job(data, 3, 40, "async")), 240, 50, [&](const json& s) {
      if (!killed && s.value("step", 0) >= 8) {
        swarm.kill_stage(3, SIGKILL);  // s1-1: it holds activations and gradients in flight
        killed = true;
      }
    });
  }
  ASSERT_TRUE(killed);
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_EQ(st["microbatches"]["completed"], 40 * 4);
  EXPECT_EQ(st["hops"]["bytes_through_router"], 0) << st["hops"].dump();
  EXPECT_LT(st["val_loss"].get<double>(), st["unigram_loss"].get<double>());
}

TEST(P2p, APeerOthersCannotReachIsRelayedThroughTheRouter) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json st, peers;
  {
    LocalSwarm swarm(dir, kBuild);
    swarm.start_router();
    swarm.start_stage(0, "s0", 1);
    // It listens, but tells others an address where nobody does: every fetch from it and every
    // push to it fails. The peers keep their 30-s fetch timeout: the router's requests ask them
    // to give up on a fetch well before the request's deadline, so that it hears of the failure
    // and relays. Stage 2 takes no connections, so s1 cannot push what it makes there either
    // (to peers that listen it would, and need no relay).
    swarm.start_stage(1, "s1", 1, {"--listen", "tcp://127.0.0.1:*", "--advertise", "tcp://127.0.0.1:9"});
    swarm.start_stage(2, "s2", 1, {"--no-listen"});
    swarm.start_stage(2, "s2b", 1, {"--no-listen"});
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 4);
    st = follow_to_end(c, submit(c, tiny_job(data, 3, 10, "sync")), 240, 50);
    peers = c.peers()["peers"];
  }
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GT(st["hops"]["fetch_failures"].get<uint64_t>(), 0u) << st["hops"].dump();
  EXPECT_GT(st["hops"]["relayed_by_router"].get<uint64_t>(), 0u) << st["hops"].dump();
  EXPECT_GT(st["hops"]["bytes_through_router"].get<uint64_t>(), 0u) << st["hops"].dump();
  for (const auto& p : peers) {
    EXPECT_EQ(p["relayed"].get<bool>(), p["name"] != "s0") << p.dump();   // stage 2 by choice
    // Pushes to s1 never came: the router stopped pushing to it (or relays it). s0 is reachable.
    if (p["name"] == "s1") EXPECT_FALSE(p["pushed_to"].get<bool>()) << p.dump();
    if (p["name"] == "s0") EXPECT_TRUE(p["pushed_to"].get<bool>()) << p.dump();
    // The only peers of their stages served every hop there, and the router timed them.
    if (p["name"] == "s0" || p["name"] == "s1") {
      EXPECT_GT(p["turnaround_ms"].get<double>(), 0.0) << p.dump();
    }
  }
}
