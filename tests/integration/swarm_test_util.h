// swarm_test_util.h: what the multi-process tests share: temp dirs, a small text corpus, a
// tiny job spec, submitting and waiting, running a command, the one-process reference and the
// exported model checked in PyTorch.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "tools/local_swarm.h"

namespace swarm::testing {

using nlohmann::json;

const std::string kBuild = SWARM_BUILD_DIR;
const std::string kSource = SWARM_SOURCE_DIR;

// The folders temp_dir made, removed when the test program ends unless a test failed (then
// they stay for a look: failure messages name the ones that matter).
inline std::vector<std::string>& made_dirs() {
  static std::vector<std::string> dirs;
  return dirs;
}
inline void remove_made_dirs() {
  if (::testing::UnitTest::GetInstance()->failed_test_count() > 0) return;
  for (const std::string& d : made_dirs()) {
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
  }
}
// A file's whole text ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline std::string temp_dir() {
  // The list first, then the hook: at exit the hook runs before the list is destroyed.
  static const bool hooked = (made_dirs(), std::atexit(remove_made_dirs) == 0);
  (void)hooked;
  char tmpl[] = "/tmp/swarm-test-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("cannot make a folder under /tmp");
  made_dirs().push_back(tmpl);
  return tmpl;
}

// A few kilobytes of English-like text with enough structure for a tiny model to learn fast.
inline std::string write_text(const std::string& dir) {
  const char* lines[] = {"the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine. ",
                         "all that glitters is not gold. ", "the early bird catches the worm. ",
                         "where there is smoke there is fire. ", "actions speak louder than words. "};
  std::string text;
  uint64_t x = 7;
  for (int i = 0; i < 1500; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    text += lines[(x >> 33) % 6];
  }
  const std::string path = dir + "/text.txt";
  std::ofstream(path) << text;
  return path;
}

// The value of the sample `name` (with its labels) in a Prometheus page; -1 when absent.
inline double metric_sample(const std::string& page, const std::string& name) {
  std::istringstream in(page);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  return -1;
}

inline json tiny_job(const std::string& data, int stages, int steps, const std::string& schedule) {
  return json{{"name", "test"},
              {"seed", 3},
              {"steps", steps},
              {"schedule", schedule},
              {"model", {{"vocab_size", 256}, {"d_model", 32}, {"n_head", 2}, {"n_layer", stages * 1}, {"seq_len", 16}}},
              {"partition", {{"stages", stages}}},
              {"data", {{"format", "text"}, {"path", data}, {"val_fraction", 0.1}}},
              {"batch", {{"batch_size", 16}, {"microbatch_size", 4}}},
              {"optimizer", {{"lr", 0.01}, {"min_lr", 0.001}, {"warmup_steps", 2}}},
              // No warm start: the tests count rounds from the first step.
              {"diloco", {{"inner_steps", 5}, {"outer_lr", 1.0}, {"outer_momentum", 0.0}, {"nesterov", false}, {"warm_start_steps", 0}}},
              {"eval", {{"every_steps", 0}, {"batches", 4}}}};
}

inline uint64_t submit(Client& c, const json& spec, const std::string& resume = "") {
  json body{{"spec", spec}};
  if (!resume.empty()) body["resume"] = resume;
  return c.request_body(wire::MsgType::kSubmit, body).at("job_id").get<uint64_t>();
}

// Polls job `id` every `poll_ms` until it ends (done, failed or cancelled), calling `during` with
// each status; a job still running after `timeout_s` is a test failure. Returns the last status.
inline json follow_to_end(Client& c, uint64_t id, double timeout_s, int poll_ms = 100,
                          const std::function<void(const json&)>& during = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    json st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    if (during) during(st);
    const std::string state = st.value("state", std::string());
    if (state == "done" || state == "failed" || state == "cancelled") return st;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
      ADD_FAILURE() << "job did not finish in " << timeout_s << " s: " << st.dump();
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
}

// Waits until the router lists `n` peers.
inline void wait_for_peers(Client& c, size_t n) {
  for (int i = 0; i < 400; ++i) {
    if (c.request_body(wire::MsgType::kPeers, json::object())["peers"].size() >= n) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  FAIL() << "peers did not register";
}

// The router (with `router_args`) and one one-thread peer per stage, "s0", "s1", ..., all
// registered when it returns.
inline void start_pipeline(LocalSwarm& swarm, int stages, const std::vector<std::string>& router_args = {}) {
  swarm.start_router(router_args);
  for (int s = 0; s < stages; ++s) swarm.start_stage(s, "s" + std::to_string(s), 1);
  Client c(swarm.router_endpoint());
  wait_for_peers(c, size_t(stages));
}

inline bool alive(pid_t pid) { return pid > 0 && kill(pid, 0) == 0; }

// Runs a command; returns (exit code, stdout+stderr).
inline std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  while (p && fgets(buf.data(), buf.size(), p)) out += buf.data();
  int st = p ? pclose(p) : -1;
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// `swarm reference JOB_PATH --threads 1 --json`: its "done" event (with "losses", one a step),
// or a test failure and an empty object.
inline json run_reference(const std::string& job_path) {
  const auto [rc, out] = run(kBuild + "/swarm reference " + job_path + " --threads 1 --json");
  json done;
  for (size_t a = 0, b; (b = out.find('\n', a)) != std::string::npos; a = b + 1) {
    json j = json::parse(out.substr(a, b - a), nullptr, false);
    if (j.is_object() && j.value("event", "") == "done") done = j;
  }
  if (rc != 0 || !done.contains("losses")) ADD_FAILURE() << "swarm reference " << job_path << " exited " << rc << ": " << out;
  return done;
}

// Plain PyTorch (Debian's python3-torch, tests/python/check_export.py) runs the model that
// `swarm export` wrote to DIR/model.pt on the validation microbatches the router evaluated for
// `spec`: its loss is the swarm's `val_loss`, within 1e-3.
inline void expect_export_gives_val_loss(const std::string& dir, const json& spec, double val_loss) {
  const JobSpec js = parse_job_spec(spec);
  TokenData td = TokenData::load(js.data, js.model.seq_len, js.model.vocab_size);
  const int B = js.batch.microbatch_size, T = js.model.seq_len, n = js.eval.batches;
  {
    std::ofstream f(dir + "/val.bin", std::ios::binary);
    const int32_t header[3] = {n, B, T};
    f.write(reinterpret_cast<const char*>(header), sizeof(header));
    for (int i = 0; i < n; ++i) {
      Microbatch mb = sample_microbatch(td, Split::kVal, js.seed, uint64_t(i), B, T);
      f.write(reinterpret_cast<const char*>(mb.x.data()), std::streamsize(mb.x.size() * 4));
      f.write(reinterpret_cast<const char*>(mb.y.data()), std::streamsize(mb.y.size() * 4));
    }
  }
  const auto [rc, out] = run("/usr/bin/python3 " + kSource + "/tests/python/check_export.py " + dir + "/model.pt " + dir +
                             "/model.json " + dir + "/val.bin");
  ASSERT_EQ(rc, 0) << "Debian's python3-torch is needed (tools/install-deps.sh installs it): " << out;
  const json py = json::parse(out.substr(out.find('{')));
  EXPECT_NEAR(py["loss"].get<double>(), val_loss, 1e-3) << out;
}

// The training losses of a status's history, in step order.
inline std::vector<double> train_losses(const json& st) {
  std::vector<double> out;
  for (const auto& e : st["history"])
    if (e.contains("train_loss")) out.push_back(e["train_loss"].get<double>());
  return out;
}

}  // namespace swarm::testing
