// test_memory_placement.cpp: memory-aware placement (router/placement.h) on constructed registries:
// a stage never goes to a peer that cannot hold it, heavier stages go to bigger devices when
// throughputs tie (and at a job start, in placement_order), the rebalancer never moves a peer
// into a stage it cannot hold, and memory_shortfalls names the stage, the bytes and the largest
// peer while a job must wait. Registries without memory information behave as before.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "router/placement.h"
#include "runtime/memory_estimate.h"
#include "runtime/errors.h"

using namespace swarm;

namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

constexpr int64_t kGiB = int64_t(1) << 30;

// Stages with these needs (the same on CUDA and CPU peers), no peers yet.
Registry with_needs(const std::vector<int64_t>& gib) {
  Registry r;
  r.stages = int(gib.size());
  for (int64_t g : gib) {
    StageNeed n;
    n.cuda.fill(g * kGiB);
    n.cpu.fill(g * kGiB);
    r.stage_need.push_back(n);
  }
  return r;
}

PeerView gpu(const std::string& id, int64_t free_gib, double speed = 1.0, int stage = -1) {
  PeerView p;
  p.id = id;
  p.speed = speed;
  p.cuda = true;
  p.memory_bytes = free_gib * kGiB;
  p.stage = stage;
  return p;
}

// Places `peer` and records it in the registry; returns its stage.
int join(Registry& r, PeerView peer) {
  peer.stage = place_peer(r, peer);
  if (peer.stage >= 0) r.peers.push_back(peer);
  return peer.stage;
}

TEST(MemoryPlacement, NeverOnAPeerThatCannotHoldIt) {
  Registry r = with_needs({10, 2});
  EXPECT_EQ(join(r, gpu("small", 4)), 1);  // stage 0 is empty and first, but needs 10 GiB
  std::string why;
  EXPECT_EQ(place_peer(r, gpu("tiny", 1), &why), -1);
  EXPECT_HAS(why, "no stage fits: the lightest, stage 1, needs 2.00 GiB and the peer has 1.00 GiB free");
  EXPECT_FALSE(peer_fits(r, gpu("small2", 4), 0));
  EXPECT_TRUE(peer_fits(r, gpu("big", 16), 0));
  PeerView unknown = gpu("unknown", 0);
  unknown.memory_bytes = -1;
  EXPECT_TRUE(peer_fits(r, unknown, 0));  // unknown memory fits anything
}

TEST(MemoryPlacement, CudaAndCpuPeersNeedTheirOwnShare) {
  Registry r;
  r.stages = 1;
  StageNeed n;
  n.cuda.fill(6 * kGiB);
  n.cpu.fill(9 * kGiB);  // a CPU peer also holds θ_g and the momentum
  r.stage_need = {n};
  PeerView cpu = gpu("cpu", 8);
  cpu.cuda = false;
  EXPECT_FALSE(peer_fits(r, cpu, 0));
  EXPECT_TRUE(peer_fits(r, gpu("gpu", 8), 0));
}

TEST(MemoryPlacement, APeersPrecisionDecidesItsNeed) {
  Registry r;
  r.stages = 1;
  StageNeed n;
  n.cuda = {20 * kGiB, 12 * kGiB, 12 * kGiB};  // fp32, bf16, fp16
  n.cpu = n.cuda;
  r.stage_need = {n};
  PeerView t4 = gpu("t4", 15);
  t4.precision = Precision::kFp16;  // what its HELLO says, the job not pinning one
  EXPECT_TRUE(peer_fits(r, t4, 0));
  t4.precision = Precision::kFp32;  // a job pinning fp32
  EXPECT_FALSE(peer_fits(r, t4, 0));
  t4.precision = Precision::kAuto;  // not known: the most any precision needs
  EXPECT_FALSE(peer_fits(r, t4, 0));
}

TEST(MemoryPlacement, EmptyStagesHeaviestFirstForAKnownPeer) {
  Registry r = with_needs({3, 12, 6});
  EXPECT_EQ(join(r, gpu("big", 16)), 1);
  EXPECT_EQ(join(r, gpu("mid", 8)), 2);
  EXPECT_EQ(join(r, gpu("small", 4)), 0);
  // Without memory information: the lowest empty stage, as always.
  Registry plain;
  plain.stages = 3;
  EXPECT_EQ(place_peer(plain, 1.0), 0);
}

TEST(MemoryPlacement, TiesGoToTheHeavierStage) {
  Registry r = with_needs({2, 8});
  r.peers = {gpu("a", 4, 1.0, 0), gpu("b", 16, 1.0, 1)};
  // Adding speed 1 to either stage gives the same sorted throughputs: the heavier stage wins
  // for a peer that can hold it, even though stage 0 has the lower index.
  EXPECT_EQ(place_peer(r, gpu("c", 16)), 1);
  EXPECT_EQ(place_peer(r, gpu("d", 4)), 0);  // cannot hold stage 1
  PeerView unknown = gpu("e", 0);
  unknown.memory_bytes = -1;
  EXPECT_EQ(place_peer(r, unknown), 0);      // nothing known: fewest peers, lowest index
  // Throughput still comes first: stage 0 is the bottleneck.
  r.peers.push_back(gpu("f", 16, 1.0, 1));
  EXPECT_EQ(place_peer(r, gpu("g", 16)), 0);
}

TEST(MemoryPlacement, JobStartOrderSendsHeavyStagesToBigDevices) {
  const std::vector<PeerView> peers = {gpu("small", 12, 2.0), gpu("unknown", 0), gpu("big", 24, 1.0), gpu("big-fast", 24, 3.0)};
  std::vector<PeerView> ps = peers;
  ps[1].memory_bytes = -1;
  const std::vector<size_t> order = placement_order(ps);
  EXPECT_EQ(order, (std::vector<size_t>{3, 2, 0, 1}));  // memory, then speed; unknown last

  // Join order: the small device takes the heavy stage it can just hold, the big one is left
  // the light one. In placement_order: the other way round.
  Registry joined = with_needs({10, 3});
  EXPECT_EQ(join(joined, gpu("small", 12)), 0);
  EXPECT_EQ(join(joined, gpu("big", 24)), 1);
  Registry ordered = with_needs({10, 3});
  const std::vector<PeerView> two = {gpu("small", 12), gpu("big", 24)};
  for (size_t i : placement_order(two)) join(ordered, two[i]);
  EXPECT_EQ(ordered.peers[0].id, "big");
  EXPECT_EQ(ordered.peers[0].stage, 0);
  EXPECT_EQ(ordered.peers[1].stage, 1);
}

TEST(MemoryPlacement, RebalancerNeverMovesAPeerIntoAStageItCannotHold) {
  Registry r = with_needs({2, 2, 20});
  r.peers = {gpu("a", 4, 10, 0), gpu("b", 4, 10, 0), gpu("c", 4, 10, 1), gpu("d", 24, 1, 2)};
  RebalanceParams params;
  params.cooldown_s = 0;
  params.checks_to_move = 1;
  const Rebalance d = plan_rebalance(r, params, 1000);
  EXPECT_FALSE(d.move) << d.reason;  // stage 2 is the bottleneck; nobody spare can hold it
  EXPECT_HAS(d.reason, "without the memory for it");
  // With a big spare peer on stage 0 the same bottleneck is lifted by it.
  r.peers[1] = gpu("b", 24, 10, 0);
  const Rebalance e = plan_rebalance(r, params, 1000);
  ASSERT_TRUE(e.move) << e.reason;
  EXPECT_EQ(e.move->peer, "b");
  EXPECT_EQ(e.move->to, 2);
}

TEST(MemoryPlacement, ShortfallNamesTheStageTheBytesAndTheLargestPeer) {
  Registry r = with_needs({10, 30});
  r.peers = {gpu("t4-a", 16, 1, 0), gpu("a10-b", 24, 1, 0)};
  const std::vector<MemoryShortfall> s = memory_shortfalls(r);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].stage, 1);
  EXPECT_EQ(s[0].need, 30 * kGiB);
  EXPECT_EQ(s[0].largest_peer, "a10-b");
  EXPECT_HAS(s[0].reason, "stage 1 needs 30.00 GiB, but the largest peer, a10-b, has 24.00 GiB free");
  r.peers[0].memory_bytes = -1;  // a peer of unknown memory might hold it
  EXPECT_TRUE(memory_shortfalls(r).empty());
  r.stage_need.clear();
  EXPECT_TRUE(memory_shortfalls(r).empty());
}

TEST(MemoryPlacement, NeedsOfAJob) {
  const JobSpec spec = parse_job_spec(
      nlohmann::json{{"name", "n"},
                     {"model", {{"vocab_size", 50304}, {"d_model", 768}, {"n_head", 12}, {"n_layer", 12}, {"seq_len", 1024}}},
                     {"partition", {{"stages", 4}}},
                     {"data", {{"format", "bin"}, {"path", "x.bin"}}},
                     {"batch", {{"batch_size", 64}, {"microbatch_size", 8}}}},
      false);
  const std::vector<StageNeed> n = stage_needs(spec);
  ASSERT_EQ(n.size(), 4u);
  for (const StageNeed& s : n) {
    EXPECT_GT(s.of(true, Precision::kBf16), kGiB);
    EXPECT_GT(s.of(false, Precision::kFp32), s.of(true, Precision::kFp32) - kGiB);  // no CUDA share, but θ_g and momentum
    EXPECT_EQ(s.of(true, Precision::kAuto), std::max({s.cuda[0], s.cuda[1], s.cuda[2]}));
  }
  EXPECT_GT(n[0].of(true, Precision::kFp32), n[1].of(true, Precision::kFp32));  // the embeddings
  // The last stage keeps one graph (it runs each backward at once) but its logits over 50304
  // tokens weigh: 4 bytes x 8 x 1024 x 50304 = 1.5 GiB each copy.
  EXPECT_GT(n[3].of(true, Precision::kFp32), int64_t(6) * kGiB);
  // A peer computing in bf16 needs less than one in fp32 (flash attention, halved activations).
  EXPECT_LT(n[1].of(true, Precision::kBf16), n[1].of(true, Precision::kFp32));
  // A job that pins its precision needs the same whatever a peer would have picked.
  JobSpec pinned = spec;
  pinned.model.precision = "bf16";
  const StageNeed p = stage_needs(pinned)[1];
  EXPECT_EQ(p.of(true, Precision::kFp32), n[1].of(true, Precision::kBf16));
  EXPECT_EQ(p.of(true, Precision::kAuto), n[1].of(true, Precision::kBf16));
  // Placement asks for the least a peer must hold, the stage with no graph cached (its backwards
  // recompute their forwards); a peer with more memory caches more.
  EXPECT_EQ(n[1].of(true, Precision::kFp32), estimate_stage_memory(spec, 1, Precision::kFp32, true, true, 0).need_bytes(true));
  EXPECT_LT(n[1].of(true, Precision::kFp32), estimate_stage_memory(spec, 1, Precision::kFp32, true, true).need_bytes(true));
  EXPECT_EQ(n[1].of(false, Precision::kFp32), estimate_stage_memory(spec, 1, Precision::kFp32, false, false, 0).need_bytes(false));
}

}  // namespace
