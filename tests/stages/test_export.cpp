// test_export.cpp: `swarm export` (stages/export.h). A checkpoint built from real StageModels
// with perturbed weights is exported; Python's torch.load (weights_only) reads the state dict,
// tests/python/check_export.py runs the config's forward in plain PyTorch, and its loss must
// match the C++ stages chained on the same batches. Also: the global weights theta_g are what
// is exported (not a peer's theta), and damaged or mismatched checkpoints are InputErrors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "runtime/checkpoint.h"
#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "stages/export.h"
#include "stages/model.h"

namespace swarm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

constexpr const char* kPython = "/usr/bin/python3";

bool python_has_torch() {
  return std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
}

// Runs a command, returns its exit status and everything it printed.
int run(const std::string& cmd, std::string* output) {
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen((cmd + " 2>&1").c_str(), "r"), ::pclose);
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p.get())) > 0) output->append(buf, n);
  return ::pclose(p.release());
}

JobSpec make_spec(bool bias, const std::vector<int>& layers) {
  json j = {{"name", "export-test"},
            {"seed", 7},
            {"steps", 10},
            {"model",
             {{"vocab_size", 256}, {"d_model", 32}, {"n_head", 4},
              {"n_layer", std::accumulate(layers.begin(), layers.end(), 0)},
              {"seq_len", 16}, {"max_seq_len", 24}, {"bias", bias}}},
            {"partition", {{"stages", int(layers.size())}, {"layers_per_stage", layers}}},
            {"data", {{"path", "/nonexistent/export-test.txt"}}}};
  return parse_job_spec(j, /*check_files=*/false);
}

std::vector<std::unique_ptr<StageModel>> make_models(const JobSpec& spec) {
  std::vector<std::unique_ptr<StageModel>> out;
  for (int s = 0; s < spec.partition.stages; ++s)
    out.push_back(std::make_unique<StageModel>(spec.model, s, spec.partition.stages, spec.first_layer(s),
                                               spec.partition.layers_per_stage[s], spec.seed));
  return out;
}

std::vector<float> flatten(const StageModel& m) {
  std::vector<float> flat;
  for (const auto& [name, p] : m.named_parameters()) {
    torch::Tensor c = p.detach().contiguous();
    flat.insert(flat.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return flat;
}

struct Batch {
  torch::Tensor x, y;   // int64 [B, T]
};

// A fresh directory under /tmp, removed with everything in it when the test ends.
class ExportTest : public testing::Test {
 protected:
  ExportTest() {
    char tmpl[] = "/tmp/swarm-test-export-XXXXXX";
    root_ = mkdtemp(tmpl);
  }
  ~ExportTest() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // Builds the spec's StageModels, moves every weight off its init, writes a checkpoint whose
  // theta_g are those weights (and whose donor theta is something else), exports it, and
  // compares the Python loss on random batches with the chained C++ stages.
  void check_roundtrip(bool bias, const std::vector<int>& layers) {
    if (!python_has_torch()) GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
    const JobSpec spec = make_spec(bias, layers);
    auto models = make_models(spec);
    torch::manual_seed(1234);
    Checkpoint c;
    c.step = 42;
    c.next_microbatch = 168;
    c.spec = to_json(spec);
    {
      torch::NoGradGuard ng;
      for (int s = int(models.size()) - 1; s >= 0; --s) {   // any order in the checkpoint
        for (const auto& [name, p] : models[size_t(s)]->named_parameters()) p.add_(torch::randn(p.sizes()) * 0.1);
        StageState st;
        st.stage = s;
        st.theta_g = flatten(*models[size_t(s)]);
        st.momentum.assign(st.theta_g.size(), 0.25f);
        st.theta = st.theta_g;
        for (float& f : st.theta) f *= -3.f;   // a peer's local weights: must not be exported
        st.adam_m.assign(st.theta_g.size(), 0.f);
        st.adam_v.assign(st.theta_g.size(), 1e-6f);
        st.adam_step = 42;
        c.stages.push_back(std::move(st));
      }
    }
    const std::string ckpt_dir = root_ + "/ckpt";
    write_checkpoint(ckpt_dir, c, 2);

    const std::string pt = root_ + "/out/model.pt";
    fs::create_directories(root_ + "/out");
    std::string cfg_path;
    const ExportSummary sum = export_checkpoint(ckpt_dir, pt, &cfg_path);
    EXPECT_EQ(cfg_path, root_ + "/out/model.json");
    EXPECT_EQ(sum.config_path, cfg_path);
    EXPECT_EQ(sum.step, 42);
    EXPECT_EQ(sum.checkpoint, ckpt_dir + "/step-00000042");
    int64_t params = 0;
    for (const auto& m : models) params += m->num_parameters();
    EXPECT_EQ(sum.parameters, params);

    std::ifstream cf(cfg_path);
    const json cfg = json::parse(cf);
    EXPECT_EQ(cfg["n_layer"], spec.model.n_layer);
    EXPECT_EQ(cfg["block_size"], 24);
    EXPECT_EQ(cfg["bias"], bias);
    EXPECT_EQ(cfg["tied_embeddings"], false);
    EXPECT_EQ(cfg["state_dict_keys"].size(), size_t(sum.tensors));

    // Batches: [n, B, T] then x and y per batch, int32 little-endian.
    const int n = 3, B = 2, T = 16;
    const std::string batches_path = root_ + "/batches.bin";
    std::vector<Batch> batches;
    {
      std::ofstream bf(batches_path, std::ios::binary);
      const int32_t header[3] = {n, B, T};
      bf.write(reinterpret_cast<const char*>(header), sizeof header);
      for (int i = 0; i < n; ++i) {
        Batch b{torch::randint(0, 256, {B, T}, torch::kInt32), torch::randint(0, 256, {B, T}, torch::kInt32)};
        bf.write(reinterpret_cast<const char*>(b.x.data_ptr<int32_t>()), B * T * 4);
        bf.write(reinterpret_cast<const char*>(b.y.data_ptr<int32_t>()), B * T * 4);
        batches.push_back({b.x.to(torch::kLong), b.y.to(torch::kLong)});
      }
    }
    double cpp_loss = 0;
    {
      torch::NoGradGuard ng;
      for (const Batch& b : batches) {
        torch::Tensor h = b.x;
        for (auto& m : models) h = m->forward(h);
        cpp_loss += StageModel::loss(h, b.y).item<double>() / n;
      }
    }

    std::string out;
    const std::string cmd = std::string(kPython) + " " + SWARM_SOURCE_DIR + "/tests/python/check_export.py '" + pt +
                            "' '" + cfg_path + "' '" + batches_path + "'";
    ASSERT_EQ(run(cmd, &out), 0) << cmd << "\n" << out;
    const json r = json::parse(out.substr(out.rfind('{')));
    EXPECT_EQ(r["tensors"], sum.tensors);
    EXPECT_EQ(r["parameters"], params);
    EXPECT_EQ(r["tokens"], n * B * T);
    EXPECT_NEAR(r["loss"].get<double>(), cpp_loss, 1e-4) << out;
    EXPECT_GT(std::abs(cpp_loss - std::log(256.0)), 0.01) << "the weights look like an untrained model";
  }

  std::string root_;
};

TEST_F(ExportTest, PythonLossMatchesTheStagesTwoStagesWithBias) { check_roundtrip(true, {2, 1}); }

TEST_F(ExportTest, PythonLossMatchesTheStagesThreeStagesNoBias) { check_roundtrip(false, {1, 1, 1}); }

TEST_F(ExportTest, DamagedOrMismatchedCheckpointIsAnInputError) {
  const JobSpec spec = make_spec(true, {1, 1});
  auto models = make_models(spec);
  Checkpoint c;
  c.step = 3;
  c.spec = to_json(spec);
  for (int s = 0; s < 2; ++s) {
    StageState st;
    st.stage = s;
    st.theta_g = flatten(*models[size_t(s)]);
    c.stages.push_back(std::move(st));
  }
  const std::string p = write_checkpoint(root_ + "/ok", c, 2);
  EXPECT_NO_THROW(export_checkpoint(p, root_ + "/ok.pt"));

  // A stage missing.
  Checkpoint one = c;
  one.stages.pop_back();
  write_checkpoint(root_ + "/missing", one, 2);
  try {
    export_checkpoint(root_ + "/missing", root_ + "/m.pt");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "no state for stage 1 of the job's 2");
  }
  // theta_g of another model.
  Checkpoint wrong = c;
  wrong.stages[1].theta_g.resize(10);
  write_checkpoint(root_ + "/wrong", wrong, 2);
  try {
    export_checkpoint(root_ + "/wrong", root_ + "/w.pt");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "stage 1: theta_g holds 10 floats");
  }
  // A flipped byte.
  const std::string bin = p + "/stage-1.bin";
  std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(17);
  f.put('\x7f');
  f.close();
  try {
    export_checkpoint(p, root_ + "/x.pt");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "checksum mismatch");
  }
  EXPECT_FALSE(fs::exists(root_ + "/x.pt"));
}

}  // namespace
}  // namespace swarm
