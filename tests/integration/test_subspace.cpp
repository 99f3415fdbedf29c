// test_subspace.cpp: real swarms with the subspace codec on activations and their gradients.
//
// With fp32 coefficients the sync schedule trains exactly the constrained model of the
// single-process reference, every hop carries exactly k coefficients (and, forward, one token
// id) per token, and the exported state dict gives the swarm's validation loss in PyTorch. With
// two peers per stage, int8 coefficients and lossy DiLoCo rounds, the groups stay byte-equal and
// the constraint is still in the weights at the end.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>

#include "compression/subspace.h"
#include "runtime/checkpoint.h"
#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;

namespace {

constexpr int kK = 8, kC = 32, kT = 16;

json subspace_job(const std::string& data, int stages, int steps, const std::string& act, const std::string& grad) {
  json spec = tiny_job(data, stages, steps, "sync");
  spec["compression"] = {{"activations", act}, {"gradients", grad}, {"outer", "fp32"}};
  return spec;
}

// Largest change projecting the columns of W [C, cols] (at `off` in `flat`) into span(U) makes.
double column_residual(const std::vector<float>& U, const std::vector<float>& flat, size_t off, int64_t cols) {
  std::vector<float> w(flat.begin() + long(off), flat.begin() + long(off + size_t(kC * cols)));
  std::vector<float> p = w;
  compression::project_columns(U.data(), kC, kK, p.data(), cols);
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(p[i] - w[i])));
  return worst;
}

}  // namespace

TEST(SubspaceSwarm, SyncEqualsTheConstrainedReferenceOnExactBytesAndExportsToPyTorch) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json spec = subspace_job(data, 3, 10, "subspace:k=8", "subspace:k=8");
  spec["diloco"]["inner_steps"] = 100;  // no round: plain training, as the reference
  spec["checkpoint"] = {{"dir", dir + "/ckpt"}};
  const std::string path = dir + "/job.json";
  std::ofstream(path) << spec.dump();

  const json ref = run_reference(path);
  ASSERT_TRUE(ref.contains("losses"));

  json st;
  {
    LocalSwarm swarm(dir, kBuild);
    start_pipeline(swarm, 3);
    Client c(swarm.router_endpoint());
    FollowOptions fo;
    fo.quiet = true;
    fo.timeout_s = 180;
    st = follow_job(c, submit(c, spec), fo);
  }
  ASSERT_EQ(st["state"], "done") << st.dump();
  const std::vector<double> losses = train_losses(st);
  ASSERT_EQ(losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    const double r = ref["losses"][i].get<double>();
    EXPECT_NEAR(losses[i], r, 1e-4 * std::abs(r)) << "step " << i + 1;
  }
  // Per sample of T tokens: two activation frames (forward into stages 1 and 2; stage 1's
  // backward runs where its forward ran, which kept its input), each k fp32 coefficients and a
  // 1-byte token id per token; two gradient frames of k fp32 coefficients per token. fp32
  // would be 4 * d_model per token.
  if (st["microbatches"]["resent"] == 0) {
    EXPECT_EQ(st["wire_bytes_per_sample"]["activations"].get<double>(), 2.0 * kT * (kK * 4 + 1));
    EXPECT_EQ(st["wire_bytes_per_sample"]["gradients"].get<double>(), 2.0 * kT * kK * 4);
  }

  // The constraint lives in the weights: the exported nanoGPT state dict, run by plain PyTorch,
  // gives the loss the swarm measured through its codec.
  auto [rc, out] = run(kBuild + "/swarm export " + dir + "/ckpt --out " + dir + "/model.pt");
  ASSERT_EQ(rc, 0) << out;
  expect_export_gives_val_loss(dir, spec, st["val_loss"].get<double>());
}

TEST(SubspaceSwarm, LossyRoundsKeepGroupsEqualAndTheConstraintInTheWeights) {
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  json spec = subspace_job(data, 2, 20, "subspace:k=8,coef=int8", "subspace:k=8,coef=int8");
  spec["compression"]["outer"] = "int4:block=64";  // lossy: theta_g leaves the set until projected
  spec["diloco"] = {{"inner_steps", 5}, {"warm_start_steps", 0}};           // outer lr 0.7, momentum 0.9, Nesterov
  spec["checkpoint"] = {{"dir", dir + "/ckpt"}, {"every_steps", 10}, {"keep", 3}};
  json st;
  {
    LocalSwarm swarm(dir, kBuild);
    swarm.start_router();
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < 2; ++i) swarm.start_stage(s, "s" + std::to_string(s) + "-" + std::to_string(i), 1);
    Client c(swarm.router_endpoint());
    wait_for_peers(c, 4);
    FollowOptions fo;
    fo.quiet = true;
    fo.timeout_s = 180;
    st = follow_job(c, submit(c, spec), fo);
  }
  ASSERT_EQ(st["state"], "done") << st.dump();
  EXPECT_EQ(st["microbatches"]["lost"], 0);
  EXPECT_GE(st["rounds"].get<int>(), 3);
  const std::vector<double> losses = train_losses(st);
  EXPECT_LT(losses.back(), losses.front() - 1.0) << json(losses).dump();
  // Every peer of a group holds the same theta_g and momentum after the last round.
  for (const auto& stage : st["state_hashes"]) {
    std::set<uint64_t> distinct;
    for (const auto& [peer, h] : stage.items()) distinct.insert(h.get<uint64_t>());
    EXPECT_EQ(distinct.size(), 1u) << st["state_hashes"].dump();
  }
  // Stage 0's output projections (global and local weights) are in span(U), and its embeddings
  // moved only inside span(U) between the checkpoints of steps 10 and 20. Offsets follow
  // nanoGPT's order: wte [256, C], wpe [T, C], then block 0's ln_1 (w, b), c_attn (w [3C, C], b),
  // attn.c_proj (w [C, C], b), ln_2 (w, b), c_fc (w [4C, C], b), mlp.c_proj (w [C, 4C], b).
  const Checkpoint a = read_checkpoint(dir + "/ckpt/step-00000010");
  const Checkpoint b = read_checkpoint(dir + "/ckpt/step-00000020");
  const std::vector<float> U = compression::subspace_basis(kC, kK, 3);  // tiny_job's seed
  const size_t emb = size_t(256 + kT) * kC;
  const size_t attn_proj = emb + 2 * kC + 3 * kC * kC + 3 * kC;
  const size_t mlp_proj = attn_proj + kC * kC + kC + 2 * kC + 4 * kC * kC + 4 * kC;
  for (const Checkpoint* ck : {&a, &b}) {
    const StageState& s0 = ck->stages[0].stage == 0 ? ck->stages[0] : ck->stages[1];
    ASSERT_EQ(s0.theta_g.size(), mlp_proj + 4 * kC * kC + kC);
    for (const std::vector<float>* w : {&s0.theta_g, &s0.theta}) {
      EXPECT_LT(column_residual(U, *w, attn_proj, kC), 1e-6) << "attn.c_proj.weight at step " << ck->step;
      EXPECT_LT(column_residual(U, *w, attn_proj + kC * kC, 1), 1e-6) << "attn.c_proj.bias";
      EXPECT_LT(column_residual(U, *w, mlp_proj, 4 * kC), 1e-6) << "mlp.c_proj.weight at step " << ck->step;
      EXPECT_LT(column_residual(U, *w, mlp_proj + 4 * kC * kC, 1), 1e-6) << "mlp.c_proj.bias";
    }
  }
  const StageState& a0 = a.stages[0].stage == 0 ? a.stages[0] : a.stages[1];
  const StageState& b0 = b.stages[0].stage == 0 ? b.stages[0] : b.stages[1];
  std::vector<float> diff(emb), moved(emb);
  double norm = 0;
  for (size_t i = 0; i < emb; ++i) {
    diff[i] = b0.theta_g[i] - a0.theta_g[i];
    norm = std::max(norm, double(std::abs(diff[i])));
  }
  moved = diff;
  compression::project_rows(U.data(), kC, kK, moved.data(), 256 + kT, nullptr);
  double off_span = 0;
  for (size_t i = 0; i < emb; ++i) off_span = std::max(off_span, double(std::abs(moved[i] - diff[i])));
  EXPECT_GT(norm, 1e-3);  // the embeddings did train
  EXPECT_LT(off_span, 1e-5 + 1e-4 * norm);
}
