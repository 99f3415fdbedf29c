// test_stage_precision.cpp: a real swarm-stage process driven over a real socket by this test,
// which plays the router: the stage side of mixed precision and of the cross-stage overflow rule.
// - HELLO carries the device's total and free memory and the precision the peer would use;
// - with model.loss_scale "dynamic" in fp32 a peer's gradients and weights are bit-identical to
//   an unscaled peer's (the scale is a power of two);
// - an injected overflow (`--fault overflow`) is reported in the RESULT, the gradient sent is
//   zeros, the next STEP is skipped and the scale halves; STEP {skip: true} (another stage
//   overflowed) skips without touching the scale; the scale comes back in STATE_REPLY and is
//   restored by STATE_LOAD; heartbeats count overflows and skipped steps;
// - `--precision bf16` computes in bf16 on the CPU (where libtorch can) close to fp32;
// - `--precision fp16` on a CPU without fp16 kernels refuses to start, saying why.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>

#include "compression/codec.h"
#include "runtime/job_spec.h"
#include "runtime/wire.h"
#include "swarm_test_util.h"

namespace swarm::testing {
namespace {

using wire::Message;
using wire::MsgType;

constexpr int kB = 4, kT = 16, kC = 32;

// The router's end of one stage server's session, and the stage server process.
class FakeRouter {
 public:
  explicit FakeRouter(const std::vector<std::string>& stage_args) : sock_(ctx_, zmq::socket_type::router) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.bind("tcp://127.0.0.1:*");
    endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
    log_ = temp_dir() + "/stage.log";
    std::vector<std::string> argv = {kBuild + "/swarm-stage", "--router", endpoint_, "--threads", "1", "--name", "harness"};
    argv.insert(argv.end(), stage_args.begin(), stage_args.end());
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      FILE* f = std::freopen(log_.c_str(), "w", stdout);
      (void)f;
      dup2(1, 2);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~FakeRouter() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // The next message other than a heartbeat (those are kept in `last_heartbeat`); nullopt when
  // nothing came within `timeout_ms` or the process exited.
  std::optional<Message> next(int timeout_ms = 60000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      if (!(item.revents & ZMQ_POLLIN)) {
        if (exited()) return std::nullopt;
        continue;
      }
      auto r = wire::recv_frames(sock_, true, zmq::recv_flags::none);
      if (!r) continue;
      route_ = r->route;
      Message m = wire::decode(r->frames);
      if (m.type == MsgType::kHeartbeat) {
        last_heartbeat = wire::body_json(m);
        continue;
      }
      return m;
    }
    return std::nullopt;
  }
  Message expect(MsgType type) {
    auto m = next();
    if (!m) throw std::runtime_error("no message from the stage server; log:\n" + run("cat " + log_).second);
    if (m->type != type)
      throw std::runtime_error(std::string("expected ") + wire::msg_type_name(type) + ", got " + wire::msg_type_name(m->type) +
                               " " + wire::body_json(*m).dump());
    return std::move(*m);
  }
  void send(Message m) { wire::send(sock_, m, &route_); }
  Message request(Message m, MsgType reply) {
    m.id = ++id_;
    send(std::move(m));
    return expect(reply);
  }
  // HELLO, WELCOME (a long liveness: this test sends no heartbeats), LOAD_STAGE.
  nlohmann::json start(const nlohmann::json& spec, int stage) {
    Message hello = expect(MsgType::kHello);
    send(wire::json_message(MsgType::kWelcome, 0, 0, {{"peer_id", wire::id_json(route_)}, {"heartbeat_ms", 200}, {"liveness", 500}}));
    Message ready = request(wire::json_message(MsgType::kLoadStage, 0, 0, {{"job_id", 1}, {"stage", stage}, {"spec", spec}}),
                            MsgType::kStageReady);
    return {{"hello", wire::body_json(hello)}, {"ready", wire::body_json(ready)}};
  }
  bool exited() {
    if (pid_ <= 0) return true;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      pid_ = -1;
      return true;
    }
    return false;
  }
  int exit_code() const { return exit_code_; }
  std::string log() { return run("cat " + log_).second; }

  nlohmann::json last_heartbeat = nlohmann::json::object();

 private:
  zmq::context_t ctx_{1};
  zmq::socket_t sock_;
  std::string endpoint_, route_, log_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
  uint64_t id_ = 0;
};

json job(const std::string& loss_scale) {
  json j = tiny_job("unused.txt", 2, 10, "sync");
  j["model"]["loss_scale"] = loss_scale;
  return to_json(parse_job_spec(j, /*check_files=*/false));
}

wire::Tensor floats(std::vector<int64_t> shape, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng{static_cast<uint32_t>(seed)};
  std::normal_distribution<float> d(0.f, 1.f);
  wire::Tensor t = wire::make_tensor(wire::DType::kF32, std::move(shape), compression::CodecSpec{}, size_t(n) * 4);
  float* p = static_cast<float*>(t.data.data());
  for (int64_t i = 0; i < n; ++i) p[i] = d(rng);
  wire::seal(t);
  return t;
}

wire::Tensor tokens(uint64_t seed) {
  wire::Tensor t = wire::make_tensor(wire::DType::kI32, {kB, kT}, compression::CodecSpec{}, size_t(kB * kT) * 4);
  int32_t* p = static_cast<int32_t*>(t.data.data());
  for (int i = 0; i < kB * kT; ++i) p[i] = int32_t((seed * 131 + uint64_t(i) * 17) % 256);
  wire::seal(t);
  return t;
}

std::vector<float> values(const wire::Tensor& t) {
  std::vector<float> v(size_t(t.desc.numel()));
  compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), int64_t(v.size()), v.data());
  return v;
}

// FORWARD_LOSS of microbatch `mb` to the last stage: {loss, overflow?} and the input gradient.
std::pair<json, std::vector<float>> forward_loss(FakeRouter& r, uint64_t mb) {
  Message m = wire::json_message(MsgType::kForwardLoss, 0, 0, {{"job_id", 1}, {"mb", mb}, {"stage", 1}, {"eval", false}});
  m.tensors.push_back(floats({kB, kT, kC}, mb + 1));
  m.tensors.push_back(tokens(mb + 1));
  Message rep = r.request(std::move(m), MsgType::kResult);
  EXPECT_EQ(rep.tensors.size(), 1u) << wire::body_json(rep).dump();
  return {wire::body_json(rep), rep.tensors.empty() ? std::vector<float>{} : values(rep.tensors[0])};
}

json step(FakeRouter& r, bool skip = false) {
  json body{{"job_id", 1}};
  if (skip) body["skip"] = true;
  return wire::body_json(r.request(wire::json_message(MsgType::kStep, 0, 0, body), MsgType::kResult));
}

// STATE_REQUEST {full}: the body and the five arrays.
std::pair<json, std::vector<std::vector<float>>> state(FakeRouter& r) {
  Message rep = r.request(wire::json_message(MsgType::kStateRequest, 0, 0, {{"job_id", 1}, {"full", true}}), MsgType::kStateReply);
  std::vector<std::vector<float>> arrays;
  for (const auto& t : rep.tensors) arrays.push_back(values(t));
  return {wire::body_json(rep), arrays};
}

TEST(StagePrecision, HelloReportsMemoryAndPrecision) {
  FakeRouter r({"--stage", "1"});
  const json s = r.start(job("auto"), 1);
  const json& h = s["hello"];
  EXPECT_EQ(h["device_name"], "cpu");
  ASSERT_TRUE(h["device_memory_bytes"].is_number()) << h.dump();
  ASSERT_TRUE(h["device_memory_free_bytes"].is_number()) << h.dump();
  EXPECT_GT(h["device_memory_free_bytes"].get<double>(), 0);
  EXPECT_LE(h["device_memory_free_bytes"].get<double>(), h["device_memory_bytes"].get<double>());
  EXPECT_EQ(h["precision"], "fp32");
  EXPECT_EQ(s["ready"]["precision"], "fp32");
}

TEST(StagePrecision, ScaledPeerMatchesUnscaledBitForBit) {
  FakeRouter plain({"--stage", "1"}), scaled({"--stage", "1"});
  plain.start(job("none"), 1);
  scaled.start(job("dynamic"), 1);
  for (uint64_t mb = 0; mb < 3; ++mb) {
    auto [bp, gp] = forward_loss(plain, mb);
    auto [bs, gs] = forward_loss(scaled, mb);
    EXPECT_EQ(bp["loss"], bs["loss"]);
    EXPECT_FALSE(bp.contains("overflow"));
    EXPECT_EQ(bs["overflow"], false);
    ASSERT_EQ(gp.size(), gs.size());
    EXPECT_EQ(0, std::memcmp(gp.data(), gs.data(), gp.size() * 4)) << "microbatch " << mb;
    EXPECT_EQ(step(plain)["skipped"], false);
    const json st = step(scaled);
    EXPECT_EQ(st["skipped"], false);
    EXPECT_EQ(st["loss_scale"], 65536.0);
  }
  auto [sp, ap] = state(plain);
  auto [ss, as] = state(scaled);
  ASSERT_EQ(ap.size(), 5u);
  ASSERT_EQ(as.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(0, std::memcmp(ap[i].data(), as[i].data(), ap[i].size() * 4)) << "array " << i;
  EXPECT_EQ(sp["loss_scale"], 0.0);
  EXPECT_EQ(ss["loss_scale"], 65536.0);
  EXPECT_EQ(ss["loss_scale_good_steps"], 3);
}

TEST(StagePrecision, OverflowIsReportedSkippedAndLowersTheScale) {
  // Requests: 1 LOAD_STAGE, 2 FORWARD_LOSS, 3 STEP, 4 STATE_REQUEST, 5 FORWARD_LOSS (overflows), ...
  FakeRouter r({"--stage", "1", "--fault", "overflow,on=forward_loss,after=5"});
  r.start(job("dynamic"), 1);
  forward_loss(r, 0);
  EXPECT_EQ(step(r)["skipped"], false);
  auto [before, theta_before] = state(r);

  auto [b1, g1] = forward_loss(r, 1);
  EXPECT_EQ(b1["overflow"], true);
  ASSERT_FALSE(g1.empty());
  for (float f : g1) ASSERT_EQ(f, 0.f);  // zeros, never NaN/Inf, leave the stage
  const json s1 = step(r);
  EXPECT_EQ(s1["skipped"], true);
  EXPECT_EQ(s1["loss_scale"], 32768.0);
  auto [after, theta_after] = state(r);
  EXPECT_EQ(after["loss_scale"], 32768.0);
  EXPECT_EQ(after["adam_step"], before["adam_step"]);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(theta_before[i], theta_after[i]) << "array " << i << " changed in a skipped step";

  // The router's skip: another stage overflowed. This one did not: its scale stays.
  auto [b2, g2] = forward_loss(r, 2);
  EXPECT_EQ(b2["overflow"], false);
  const json s2 = step(r, /*skip=*/true);
  EXPECT_EQ(s2["skipped"], true);
  EXPECT_EQ(s2["loss_scale"], 32768.0);
  EXPECT_EQ(state(r).second[2], theta_before[2]);

  // A donor's state with its scale.
  Message load = wire::json_message(MsgType::kStateLoad, 0, 0, {{"job_id", 1}, {"adam_step", 1}, {"loss_scale", 1024.0}, {"loss_scale_good_steps", 3}});
  for (const auto& a : theta_after) {
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {int64_t(a.size())}, compression::CodecSpec{}, a.size() * 4);
    std::memcpy(t.data.data(), a.data(), a.size() * 4);
    wire::seal(t);
    load.tensors.push_back(std::move(t));
  }
  r.request(std::move(load), MsgType::kRoundDone);
  EXPECT_EQ(state(r).first["loss_scale"], 1024.0);
  // Heartbeats count what happened (one every 200 ms).
  for (int i = 0; i < 50 && r.last_heartbeat.value("skipped_steps", 0) < 2; ++i) r.next(100);
  EXPECT_EQ(r.last_heartbeat["overflows"], 1);
  EXPECT_EQ(r.last_heartbeat["skipped_steps"], 2);
  EXPECT_EQ(r.last_heartbeat["loss_scale"], 1024.0);
}

TEST(StagePrecision, Bf16PeerOnTheCpu) {
  FakeRouter f32({"--stage", "1"}), b16({"--stage", "1", "--precision", "bf16"});
  f32.start(job("auto"), 1);
  auto hello = b16.next();
  if (!hello) {
    // This libtorch has no bf16 kernels on the CPU: the peer must have said so and exited 2.
    EXPECT_EQ(b16.exit_code(), 2);
    EXPECT_NE(b16.log().find("cannot compute in bf16"), std::string::npos) << b16.log();
    GTEST_SKIP() << "no bf16 on this CPU's libtorch";
  }
  ASSERT_EQ(hello->type, MsgType::kHello);
  EXPECT_EQ(wire::body_json(*hello)["precision"], "bf16");
  b16.send(wire::json_message(MsgType::kWelcome, 0, 0, {{"peer_id", wire::id_json("x")}, {"heartbeat_ms", 200}, {"liveness", 500}}));
  const Message ready = b16.request(wire::json_message(MsgType::kLoadStage, 0, 0, {{"job_id", 1}, {"stage", 1}, {"spec", job("auto")}}),
                                    MsgType::kStageReady);
  EXPECT_EQ(wire::body_json(ready)["precision"], "bf16");
  auto [a, ga] = forward_loss(f32, 0);
  auto [b, gb] = forward_loss(b16, 0);
  EXPECT_NEAR(b["loss"].get<double>(), a["loss"].get<double>(), 0.01 * a["loss"].get<double>());
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < ga.size(); ++i) dot += double(ga[i]) * gb[i], na += double(ga[i]) * ga[i], nb += double(gb[i]) * gb[i];
  EXPECT_GT(dot / std::sqrt(na * nb), 0.98);  // the input gradients point the same way
}

TEST(StagePrecision, Fp16WithoutKernelsRefusesToStart) {
  FakeRouter r({"--stage", "1", "--precision", "fp16"});
  auto hello = r.next();
  if (hello) {
    EXPECT_EQ(wire::body_json(*hello)["precision"], "fp16");  // this libtorch has fp16 on the CPU
    return;
  }
  EXPECT_EQ(r.exit_code(), 2);
  EXPECT_NE(r.log().find("--precision asks for fp16"), std::string::npos) << r.log();
}

}  // namespace
}  // namespace swarm::testing
