// test_checkpoint.cpp: the checkpoint format (runtime/checkpoint.h): byte-exact round trip,
// keep-K pruning, damaged step dirs (truncated, flipped byte, missing manifest, bad JSON,
// wrong version) rejected with a message that names the file and array while
// load_latest_checkpoint falls back to the previous one, leftover temp dirs ignored (and
// removed once their writer is dead), replacing a step, and unwritable directories.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "runtime/checkpoint.h"
#include "runtime/errors.h"

namespace swarm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

Checkpoint make_checkpoint(int step, size_t n0 = 1000, size_t n1 = 777) {
  Checkpoint c;
  c.step = step;
  c.next_microbatch = 4ull * uint64_t(step) + (1ull << 40);
  c.rounds = uint64_t(step) / 10;
  c.spec = {{"name", "t"}, {"seed", 42}, {"steps", 100}};
  c.router = {{"history", json::array({{{"step", 1}, {"loss", 5.5}}})}, {"resent", 3}};
  for (int s = 0; s < 2; ++s) {
    StageState st;
    st.stage = s;
    const size_t n = s == 0 ? n0 : n1;
    const uint32_t k = uint32_t(step * 100 + s * 10);
    st.theta_g = random_floats(n, k + 1);
    st.momentum = random_floats(n, k + 2);
    st.theta = random_floats(n, k + 3);
    st.adam_m = random_floats(n, k + 4);
    st.adam_v = random_floats(n, k + 5);
    st.adam_step = step * 3 + s;
    st.loss_scale = s == 0 ? 32768.0 : 0.0;  // stage 1: no loss scaling
    st.loss_scale_good_steps = s == 0 ? 17 : 0;
    c.stages.push_back(std::move(st));
  }
  return c;
}

bool bytes_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.next_microbatch, b.next_microbatch);
  EXPECT_EQ(a.rounds, b.rounds);
  EXPECT_EQ(a.spec, b.spec);
  EXPECT_EQ(a.router, b.router);
  ASSERT_EQ(a.stages.size(), b.stages.size());
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const StageState &x = a.stages[i], &y = b.stages[i];
    EXPECT_EQ(x.stage, y.stage);
    EXPECT_EQ(x.adam_step, y.adam_step);
    EXPECT_EQ(x.loss_scale, y.loss_scale);
    EXPECT_EQ(x.loss_scale_good_steps, y.loss_scale_good_steps);
    EXPECT_TRUE(bytes_equal(x.theta_g, y.theta_g)) << "stage " << x.stage;
    EXPECT_TRUE(bytes_equal(x.momentum, y.momentum)) << "stage " << x.stage;
    EXPECT_TRUE(bytes_equal(x.theta, y.theta)) << "stage " << x.stage;
    EXPECT_TRUE(bytes_equal(x.adam_m, y.adam_m)) << "stage " << x.stage;
    EXPECT_TRUE(bytes_equal(x.adam_v, y.adam_v)) << "stage " << x.stage;
  }
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void spit(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// A fresh directory under /tmp, removed with everything in it when the test ends.
class CheckpointTest : public testing::Test {
 protected:
  CheckpointTest() {
    char tmpl[] = "/tmp/swarm-test-ckpt-XXXXXX";
    root_ = mkdtemp(tmpl);
    dir_ = root_ + "/ckpt";
  }
  ~CheckpointTest() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string root_, dir_;
};

TEST_F(CheckpointTest, RoundTripIsByteEqual) {
  Checkpoint c = make_checkpoint(123);
  // Values whose bits a text format or a careless copy would change.
  c.stages[0].theta_g[0] = std::numeric_limits<float>::quiet_NaN();
  c.stages[0].theta_g[1] = -0.0f;
  c.stages[0].theta_g[2] = std::numeric_limits<float>::denorm_min();
  c.stages[1].theta.clear();   // an array not saved: empty
  c.stages[1].adam_m.clear();
  c.stages[1].adam_v.clear();
  const std::string path = write_checkpoint(dir_, c, 3);
  EXPECT_EQ(path, dir_ + "/step-00000123");
  EXPECT_EQ(entries(dir_), std::vector<std::string>{"step-00000123"});
  EXPECT_EQ(entries(path), (std::vector<std::string>{"manifest.json", "stage-0.bin", "stage-1.bin"}));
  EXPECT_EQ(fs::file_size(path + "/stage-0.bin"), 5u * 1000 * 4);
  EXPECT_EQ(fs::file_size(path + "/stage-1.bin"), 2u * 777 * 4);

  const Checkpoint r = read_checkpoint(path);
  expect_same(c, r);

  const json m = json::parse(slurp(path + "/manifest.json"));
  EXPECT_EQ(m["format"], "swarm-checkpoint");
  EXPECT_EQ(m["version"], 2);
  EXPECT_EQ(m["stages"][0]["loss_scale"], 32768.0);
  EXPECT_EQ(m["stages"][0]["loss_scale_good_steps"], 17);
  EXPECT_EQ(m["rng"]["seed"], 42);
  const json& a = m["stages"][0]["arrays"]["momentum"];
  EXPECT_EQ(a["file"], "stage-0.bin");
  EXPECT_EQ(a["offset"], 4000);
  EXPECT_EQ(a["count"], 1000);
  EXPECT_EQ(a["dtype"], "f32le");
  EXPECT_EQ(a["xxh3"].get<std::string>().size(), 16u);

  // The stage file is the arrays back to back: the second float of momentum is at byte 4004.
  const std::string bin = slurp(path + "/stage-0.bin");
  float f;
  std::memcpy(&f, bin.data() + 4004, 4);
  EXPECT_EQ(f, c.stages[0].momentum[1]);
}

// Version 1 (before loss scales) still reads: the stages come back without a scale.
TEST_F(CheckpointTest, ReadsVersionOneWithoutLossScale) {
  const Checkpoint c = make_checkpoint(5);
  const std::string path = write_checkpoint(dir_, c, 3);
  json m = json::parse(slurp(path + "/manifest.json"));
  m["version"] = 1;
  for (json& st : m["stages"]) {
    st.erase("loss_scale");
    st.erase("loss_scale_good_steps");
  }
  spit(path + "/manifest.json", m.dump());
  const Checkpoint r = read_checkpoint(path);
  ASSERT_EQ(r.stages.size(), 2u);
  EXPECT_EQ(r.stages[0].loss_scale, 0.0);
  EXPECT_EQ(r.stages[0].loss_scale_good_steps, 0);
  EXPECT_TRUE(bytes_equal(r.stages[0].theta_g, c.stages[0].theta_g));
  EXPECT_EQ(r.stages[0].adam_step, c.stages[0].adam_step);

  m["stages"][0]["loss_scale"] = -1.0;
  m["version"] = 2;
  spit(path + "/manifest.json", m.dump());
  try {
    read_checkpoint(path);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "stage 0: loss_scale");
  }
}

TEST_F(CheckpointTest, KeepsOnlyTheNewestK) {
  for (int step = 1; step <= 5; ++step) write_checkpoint(dir_, make_checkpoint(step, 10, 10), 2);
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  for (int step = 6; step <= 7; ++step) write_checkpoint(dir_, make_checkpoint(step, 10, 10), 0);
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"step-00000004", "step-00000005", "step-00000006", "step-00000007"}));
  // keep 1: only the one just written, even when it is not the highest step.
  write_checkpoint(dir_, make_checkpoint(3, 10, 10), 1);
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"step-00000003", "step-00000007"}));
}

TEST_F(CheckpointTest, RewritingAStepReplacesIt) {
  write_checkpoint(dir_, make_checkpoint(8), 3);
  Checkpoint c = make_checkpoint(8);
  c.rounds = 99;
  c.stages[0].theta_g.assign(c.stages[0].theta_g.size(), 1.5f);
  write_checkpoint(dir_, c, 3);
  EXPECT_EQ(entries(dir_), std::vector<std::string>{"step-00000008"});
  expect_same(c, read_checkpoint(dir_ + "/step-00000008"));
}

TEST_F(CheckpointTest, TruncatedStageFileIsRejectedAndTheLatestFallsBack) {
  const Checkpoint c1 = make_checkpoint(1);
  write_checkpoint(dir_, c1, 5);
  const std::string p2 = write_checkpoint(dir_, make_checkpoint(2), 5);
  fs::resize_file(p2 + "/stage-1.bin", 100);

  try {
    read_checkpoint(p2);
    FAIL() << "a truncated stage file was accepted";
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), p2);
    EXPECT_HAS(e.what(), "stage-1.bin: truncated: 100 bytes on disk");
  }
  std::optional<LoadedCheckpoint> l = load_latest_checkpoint(dir_);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->path, dir_ + "/step-00000001");
  expect_same(c1, l->ckpt);
  ASSERT_EQ(l->skipped.size(), 1u);
  EXPECT_HAS(l->skipped[0], "step-00000002");
  EXPECT_HAS(l->skipped[0], "truncated");
}

TEST_F(CheckpointTest, FlippedByteIsAChecksumMismatchNamingTheArray) {
  write_checkpoint(dir_, make_checkpoint(1), 5);
  const std::string p2 = write_checkpoint(dir_, make_checkpoint(2), 5);
  // Byte 5 * 4 + 3 of adam_m (the fourth array of stage 0: offset 3 * 1000 * 4).
  std::string bin = slurp(p2 + "/stage-0.bin");
  bin[12000 + 23] ^= 0x10;
  spit(p2 + "/stage-0.bin", bin);
  try {
    read_checkpoint(p2);
    FAIL() << "a flipped byte was accepted";
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "stage-0.bin: array adam_m (offset 12000, 1000 floats): checksum mismatch");
  }
  std::optional<LoadedCheckpoint> l = load_latest_checkpoint(dir_);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->ckpt.step, 1);
  ASSERT_EQ(l->skipped.size(), 1u);
  EXPECT_HAS(l->skipped[0], "checksum mismatch");
}

TEST_F(CheckpointTest, MissingManifestBadJsonAndWrongVersion) {
  write_checkpoint(dir_, make_checkpoint(1), 5);
  const std::string p2 = write_checkpoint(dir_, make_checkpoint(2), 5);
  const std::string p3 = write_checkpoint(dir_, make_checkpoint(3), 5);
  const std::string p4 = write_checkpoint(dir_, make_checkpoint(4), 5);
  fs::remove(p4 + "/manifest.json");
  spit(p3 + "/manifest.json", "{\"format\": \"swarm-checkpoint\", ");
  json m = json::parse(slurp(p2 + "/manifest.json"));
  m["version"] = 7;
  spit(p2 + "/manifest.json", m.dump());

  try {
    read_checkpoint(p4);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "missing manifest.json");
  }
  try {
    read_checkpoint(p3);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "manifest.json: bad JSON");
  }
  try {
    read_checkpoint(p2);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "format version 7, this build reads versions 1 to 2");
  }
  std::optional<LoadedCheckpoint> l = load_latest_checkpoint(dir_);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->ckpt.step, 1);
  ASSERT_EQ(l->skipped.size(), 3u);
  EXPECT_HAS(l->skipped[0], "step-00000004");
  EXPECT_HAS(l->skipped[1], "step-00000003");
  EXPECT_HAS(l->skipped[2], "step-00000002");
}

TEST_F(CheckpointTest, ManifestThatLiesAboutAnArrayIsRejected) {
  const std::string p = write_checkpoint(dir_, make_checkpoint(1), 5);
  json m = json::parse(slurp(p + "/manifest.json"));
  m["stages"][1]["arrays"]["theta"]["count"] = 1000000;
  spit(p + "/manifest.json", m.dump());
  try {
    read_checkpoint(p);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "stage-1.bin: array theta: offset");
    EXPECT_HAS(e.what(), "runs past");
  }
  m["stages"][1]["arrays"]["theta"]["count"] = "many";
  spit(p + "/manifest.json", m.dump());
  EXPECT_THROW(read_checkpoint(p), InputError);
  m["stages"][1]["file"] = "../../etc/passwd";
  spit(p + "/manifest.json", m.dump());
  EXPECT_THROW(read_checkpoint(p), InputError);
}

TEST_F(CheckpointTest, LeftoverTempDirsAreIgnoredAndOrphansRemoved) {
  const std::string p1 = write_checkpoint(dir_, make_checkpoint(1, 10, 10), 5);
  // A writer that died mid-way through step 9: a complete-looking copy under a temp name.
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  waitpid(child, nullptr, 0);
  const std::string orphan = dir_ + "/.tmp-step-00000009-" + std::to_string(child) + "-0";
  fs::copy(p1, orphan);
  const std::string live = dir_ + "/.tmp-step-00000010-1-0";   // pid 1 is always alive
  fs::copy(p1, live);

  std::optional<LoadedCheckpoint> l = load_latest_checkpoint(dir_);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->path, p1);
  EXPECT_TRUE(l->skipped.empty());

  write_checkpoint(dir_, make_checkpoint(2, 10, 10), 5);
  EXPECT_FALSE(fs::exists(orphan)) << "a dead writer's temp dir stays";
  EXPECT_TRUE(fs::exists(live)) << "a live writer's temp dir was removed";
}

TEST_F(CheckpointTest, ResolveTakesACheckpointDirOrAStepDir) {
  write_checkpoint(dir_, make_checkpoint(1, 10, 10), 5);
  const std::string p2 = write_checkpoint(dir_, make_checkpoint(2, 10, 10), 5);
  EXPECT_EQ(resolve_checkpoint(dir_).path, p2);
  EXPECT_EQ(resolve_checkpoint(dir_ + "/step-00000001").ckpt.step, 1);
  EXPECT_EQ(resolve_checkpoint(dir_ + "/step-00000001/").ckpt.step, 1);

  try {
    resolve_checkpoint(root_ + "/nope");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "no such file or directory");
  }
  fs::create_directories(root_ + "/empty");
  EXPECT_THROW(resolve_checkpoint(root_ + "/empty"), InputError);
  EXPECT_FALSE(load_latest_checkpoint(root_ + "/empty"));
  EXPECT_FALSE(load_latest_checkpoint(root_ + "/nope"));

  // Every step dir damaged: resolve says why for each.
  fs::remove(p2 + "/manifest.json");
  fs::remove(dir_ + "/step-00000001/stage-0.bin");
  std::vector<std::string> skipped;
  EXPECT_FALSE(load_latest_checkpoint(dir_, &skipped));
  EXPECT_EQ(skipped.size(), 2u);
  try {
    resolve_checkpoint(dir_);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "missing manifest.json");
    EXPECT_HAS(e.what(), "stage-0.bin: missing");
  }
}

TEST_F(CheckpointTest, UnwritableDirectoryIsAClearError) {
  spit(root_ + "/file", "x");
  try {
    write_checkpoint(root_ + "/file/sub", make_checkpoint(1, 10, 10), 5);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "cannot write checkpoint");
    EXPECT_HAS(e.what(), root_ + "/file/sub");
  }
}

}  // namespace
}  // namespace swarm
