// conformance.cpp: implements tools/conformance.h, the kit behind `swarm conformance`.
//
// One ROUTER socket on loopback, two child processes (the reference swarm-stage first, then
// the peer under test), and a script of requests. Every answer of the peer under test is
// compared with the reference's answer to the same bytes: integers, hashes and the round's
// fp32 arithmetic exactly (docs/model.md says which), activations, gradients, losses and
// weights within the tolerances below (Tol).
#include "tools/conformance.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include <zmq.hpp>

#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "runtime/memory_estimate.h"
#include "runtime/messages.h"
#include "runtime/random.h"
#include "runtime/parts.h"
#include "runtime/wire.h"
#include "tools/conformance_detail.h"

namespace swarm {
namespace {

using namespace conformance_detail;

using nlohmann::json;
using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

struct Child {
  pid_t pid = -1;
  bool exited = false;
  int status = 0;
};

class Kit {
 public:
  Kit(const ConformanceOptions& opt, const std::function<void(const ConformanceCheck&)>& report)
      : opt_(opt), report_(report), ctx_(1), sock_(ctx_, zmq::socket_type::router), spec_(test_spec()) {
    sock_.set(zmq::sockopt::router_mandatory, 1);
    sock_.set(zmq::sockopt::router_handover, 1);
    sock_.set(zmq::sockopt::linger, 0);
    sock_.bind("tcp://127.0.0.1:*");
    endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
    log_dir_ = opt.log_dir;
    if (log_dir_.empty()) {
      char tmpl[] = "/tmp/swarm-conformance-XXXXXX";
      if (!mkdtemp(tmpl)) throw InputError("cannot make a log folder under /tmp");
      log_dir_ = tmpl;
    }
    std::filesystem::create_directories(log_dir_);
    P_ = size_t(stage_parameter_counts(spec_)[size_t(opt.stage)]);
  }
  ~Kit() {
    for (Child* c : {&ref_proc_, &test_proc_}) stop(*c);
  }

  std::vector<ConformanceCheck> run();

 private:
  // ---- processes ----
  Child spawn(const std::string& command, const std::string& log_name) {
    std::string cmd = command;
    for (size_t at; (at = cmd.find("{router}")) != std::string::npos;) cmd.replace(at, 8, endpoint_);
    const std::string log = log_dir_ + "/" + log_name + ".log";
    Child c;
    c.pid = fork();
    if (c.pid < 0) throw InputError("fork failed");
    if (c.pid == 0) {
      setpgid(0, 0);
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    setpgid(c.pid, c.pid);
    return c;
  }
  bool alive(Child& c) {
    if (c.pid < 0 || c.exited) return false;
    if (waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.exited = true;
    return !c.exited;
  }
  void stop(Child& c) {
    if (!alive(c)) return;
    kill(-c.pid, SIGTERM);
    for (int i = 0; i < 30 && alive(c); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (alive(c)) {
      kill(-c.pid, SIGKILL);
      waitpid(c.pid, &c.status, 0);
      c.exited = true;
    }
  }

  // ---- messages ----
  struct Peer {
    std::string route;
    std::deque<Message> inbox;
    std::vector<double> heartbeat_at;    // seconds since the kit started
    std::vector<double> heard_at;        // every message from it, a heartbeat or not: a sign of life to a router
    std::optional<msg::Heartbeat> last_heartbeat;
    std::string heartbeat_error;         // the first heartbeat that did not check
    std::vector<std::string> undecodable;
    bool parts = false;                  // it takes PARTs (HELLO.parts): the kit sends a large message to it so
  };
  double now_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

  void send(const std::string& route, Message m) {
    try {
      const Peer* p = route == ref_.route ? &ref_ : route == test_.route ? &test_ : nullptr;
      if (p && p->parts) wire::send_parted(sock_, m, &route, part_bytes_);
      else wire::send(sock_, m, &route);
    } catch (const zmq::error_t&) {
      // The peer is gone (ROUTER_MANDATORY): its checks fail on their timeouts.
    }
  }
  void send_frames(const std::string& route, std::vector<zmq::message_t> frames) {
    try {
      wire::send_frames(sock_, frames, &route);
    } catch (const zmq::error_t&) {
    }
  }

  // Receives for up to `ms`, filing messages by sender; heartbeats the peers on the way.
  void pump(int ms) {
    const auto until = Clock::now() + std::chrono::milliseconds(ms);
    do {
      if (now_s() - last_beat_s_ >= kHeartbeatMs / 1000.0) {
        last_beat_s_ = now_s();
        for (Peer* p : {&ref_, &test_})
          if (!p->route.empty()) send(p->route, Message(MsgType::kHeartbeat));
      }
      zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(20));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::optional<wire::Received> r = wire::recv_frames(sock_, true, zmq::recv_flags::dontwait);
      if (!r) continue;
      Peer* p = r->route == ref_.route ? &ref_ : r->route == test_.route ? &test_ : nullptr;
      Message m;
      if (p) p->heard_at.push_back(now_s());
      try {
        std::optional<std::vector<zmq::message_t>> whole = parts_.take(r->route, std::move(r->frames), now_s());
        if (!whole) continue;   // a PART: the rest of its message is on the way
        m = wire::decode(*whole);
      } catch (const WireError& e) {
        if (p) p->undecodable.push_back(e.what());
        continue;
      }
      if (!p) {
        if (m.type == MsgType::kHello) strangers_.emplace_back(r->route, std::move(m));
        continue;
      }
      if (m.type == MsgType::kHeartbeat) {
        p->heartbeat_at.push_back(now_s());
        try {
          p->last_heartbeat = msg::read<msg::Heartbeat>(m);
        } catch (const WireError& e) {
          if (p->heartbeat_error.empty()) p->heartbeat_error = e.what();
        }
        continue;
      }
      p->inbox.push_back(std::move(m));
    } while (Clock::now() < until);
  }

  // The reply to request `id` from `p`, or nullopt after the timeout (`why` says so).
  std::optional<Message> await(Peer& p, uint64_t id, std::string& why, std::optional<uint64_t> alt = std::nullopt) {
    const auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < opt_.reply_timeout_s) {
      for (auto it = p.inbox.begin(); it != p.inbox.end(); ++it) {
        if (it->id != id && it->id != alt) continue;
        Message m = std::move(*it);
        p.inbox.erase(it);
        max_latency_s_ = std::max(max_latency_s_, std::chrono::duration<double>(Clock::now() - t0).count());
        return m;
      }
      if (!p.undecodable.empty()) {
        why = "sent a message that does not decode: " + p.undecodable.front();
        p.undecodable.erase(p.undecodable.begin());
        return std::nullopt;
      }
      if (&p == &test_ && !alive(test_proc_)) {
        why = "the peer under test exited (see " + log_dir_ + "/peer.log)";
        return std::nullopt;
      }
      pump(20);
    }
    why = "no answer to request " + std::to_string(id) + " within " + fmt(opt_.reply_timeout_s) + " s";
    return std::nullopt;
  }

  // Sends the message built by `make(id)` to both peers (the same bytes); their replies.
  using Maker = std::function<Message(uint64_t)>;
  std::pair<std::optional<Message>, std::optional<Message>> both(const Maker& make, std::string& why) {
    const uint64_t id = next_id_++;
    send(ref_.route, make(id));
    send(test_.route, make(id));
    std::string ref_why;
    std::optional<Message> r = await(ref_, id, ref_why);
    std::optional<Message> t = await(test_, id, why);
    if (!r) why = "the reference failed (" + ref_why + "; see " + log_dir_ + "/reference.log)";
    return {std::move(r), std::move(t)};
  }
  std::optional<Message> test_only(Message m, std::string& why) {
    m.id = next_id_++;
    const uint64_t id = m.id;
    send(test_.route, std::move(m));
    return await(test_, id, why);
  }

  void check(const std::string& name, bool ok, const std::string& detail) {
    ConformanceCheck c{name, ok, detail};
    checks_.push_back(c);
    if (report_) report_(c);
  }
  // A reply of the expected type whose body reads as `M`; else the check fails saying why.
  template <class M>
  std::optional<M> expect(const std::string& name, const std::optional<Message>& m, MsgType type, uint64_t id, const std::string& why) {
    if (!m) {
      check(name, false, why);
      return std::nullopt;
    }
    if (m->type != type) {
      std::string what = std::string("answered ") + wire::msg_type_name(m->type) + ", expected " + wire::msg_type_name(type);
      if (m->type == MsgType::kError) {
        try {
          what += ": " + msg::read<msg::Error>(*m).message;
        } catch (const WireError&) {
        }
      }
      check(name, false, what);
      return std::nullopt;
    }
    if (m->id != id) {
      check(name, false, "the reply's id is " + std::to_string(m->id) + ", the request's " + std::to_string(id));
      return std::nullopt;
    }
    try {
      return msg::read<M>(*m);
    } catch (const WireError& e) {
      check(name, false, std::string("the body does not check: ") + e.what());
      return std::nullopt;
    }
  }
  // An ERROR with `code` (and `tensor` when given) answering request `id`.
  void expect_error(const std::string& name, const std::optional<Message>& m, WireErrc code, std::optional<uint64_t> id,
                    std::optional<int> tensor, const std::string& why) {
    if (!m) return check(name, false, why);
    if (m->type != MsgType::kError) return check(name, false, std::string("answered ") + wire::msg_type_name(m->type) + ", expected ERROR " + wire_errc_name(code));
    msg::Error e;
    try {
      e = msg::read<msg::Error>(*m);
    } catch (const WireError& ex) {
      return check(name, false, std::string("the ERROR body does not check: ") + ex.what());
    }
    if (e.code != int(code)) return check(name, false, "ERROR " + e.name + " (" + std::to_string(e.code) + "), expected " + wire_errc_name(code) + " (" + std::to_string(int(code)) + "): " + e.message);
    if (id && m->id != *id) return check(name, false, "the ERROR's id is " + std::to_string(m->id) + ", expected " + std::to_string(*id));
    if (tensor && e.tensor != tensor) return check(name, false, "the ERROR names tensor " + (e.tensor ? std::to_string(*e.tensor) : std::string("none")) + ", expected " + std::to_string(*tensor));
    check(name, true, "ERROR " + e.name + ": " + e.message);
  }

  // ---- the script ----
  Message hop(MsgType type, uint64_t id, uint64_t mb, uint64_t job = 1) {
    msg::Hop h;
    h.job_id = job;
    h.mb = mb;
    h.stage = opt_.stage;
    h.eval = type == MsgType::kEval;
    return Message(type, id, 0, msg::pack(h));
  }
  bool last() const { return opt_.stage == 2; }
  // The stage input of microbatch `mb`: tokens at stage 0, activations elsewhere.
  wire::Tensor input(uint64_t mb) {
    if (opt_.stage == 0) {
      std::vector<int32_t> tok(size_t(kB * kT));
      for (size_t i = 0; i < tok.size(); ++i) tok[i] = int32_t(splitmix64(mb * 1000 + i) % uint64_t(kV));
      return i32(tok, {kB, kT});
    }
    return f32(values(mb * 7919 + 1, size_t(kB * kT * kC), 1.5f), {kB, kT, kC});
  }
  wire::Tensor targets(uint64_t mb) {
    std::vector<int32_t> y(size_t(kB * kT));
    for (size_t i = 0; i < y.size(); ++i) y[i] = int32_t(splitmix64(mb * 3571 + i + 17) % uint64_t(kV));
    return i32(y, {kB, kT});
  }
  wire::Tensor grad_output(uint64_t mb) { return f32(values(mb * 104729 + 5, size_t(kB * kT * kC), 0.05f), {kB, kT, kC}); }

  // Compares the hop replies' tensor `i` (n values) within tolerance; "" when they agree
  // (last_diff_ then says by how much they differ at most).
  std::string compare_tensor(const Message& r, const Message& t, size_t i, size_t n, const Tol& tol) {
    std::string why;
    auto want = floats_of(r, i, n, why);
    if (!want) return "the reference's reply: " + why;
    auto got = floats_of(t, i, n, why);
    if (!got) return why;
    last_diff_ = " (max |difference| " + fmt(max_diff(*want, *got)) + ")";
    return differ(*want, *got, tol);
  }

  void connect_peers();
  void hop_checks();
  void round_checks();
  void state_checks();
  void load_state_checks();
  void fault_checks();
  void eval_check(const std::string& name, uint64_t mb, const Tol& tol = kClose);

  const ConformanceOptions& opt_;
  std::function<void(const ConformanceCheck&)> report_;
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  JobSpec spec_;
  std::string endpoint_, log_dir_;
  size_t P_ = 0;
  Child ref_proc_, test_proc_;
  Peer ref_, test_;
  std::vector<std::pair<std::string, Message>> strangers_;
  uint64_t next_id_ = 1;
  wire::PartJoiner parts_;                        // replies that come in PARTs
  size_t part_bytes_ = limits::kMaxPartBytes;     // what the kit sends: in PARTs of at most this many bytes
  double last_beat_s_ = 0, max_latency_s_ = 0;
  Clock::time_point start_ = Clock::now();
  std::vector<ConformanceCheck> checks_;
  std::vector<float> ref_delta_, test_delta_, reduced_;
  std::string last_diff_;
};

// Waits for the HELLO of the next process to connect; the route of its session.
std::optional<std::string> take_hello(std::vector<std::pair<std::string, Message>>& strangers, std::optional<msg::Hello>& hello,
                                      std::string& why) {
  if (strangers.empty()) return std::nullopt;
  auto [route, m] = std::move(strangers.front());
  strangers.erase(strangers.begin());
  try {
    hello = msg::read<msg::Hello>(m);
  } catch (const WireError& e) {
    why = std::string("HELLO does not check: ") + e.what();
  }
  return route;
}

void Kit::connect_peers() {
  // The reference first: the first HELLO is its.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
  const std::string ref_cmd = opt_.reference_command.empty()
                                  ? self + "/swarm-stage --router {router} --name conformance-reference --threads 1 --precision fp32"
                                  : opt_.reference_command;
  ref_proc_ = spawn(ref_cmd, "reference");
  std::optional<msg::Hello> hello;
  std::string why;
  for (int i = 0; i < 600 && ref_.route.empty(); ++i) {
    pump(50);
    if (auto r = take_hello(strangers_, hello, why)) ref_.route = *r;
    if (!alive(ref_proc_)) break;
  }
  ref_.parts = hello && hello->parts;
  if (ref_.route.empty()) throw InputError("the reference peer did not say HELLO (" + ref_cmd + "; see " + log_dir_ + "/reference.log)");
  msg::Welcome w;
  w.peer_id = ref_.route;
  w.heartbeat_ms = kHeartbeatMs;
  w.liveness = kLiveness;
  w.parts = true;
  send(ref_.route, msg::make(w, 0));

  test_proc_ = spawn(opt_.peer_command, "peer");
  hello.reset();
  why.clear();
  const auto t0 = Clock::now();
  while (test_.route.empty() && std::chrono::duration<double>(Clock::now() - t0).count() < opt_.reply_timeout_s) {
    pump(50);
    if (auto r = take_hello(strangers_, hello, why)) test_.route = *r;
    if (!alive(test_proc_)) break;
  }
  if (test_.route.empty()) {
    check("hello", false, alive(test_proc_) ? "no HELLO within " + fmt(opt_.reply_timeout_s) + " s" : "the peer exited before its HELLO (see " + log_dir_ + "/peer.log)");
    return;
  }
  if (hello && hello->role != msg::Role::kStage) why = "HELLO.role is not \"stage\"";
  if (hello && hello->version != wire::kVersion) why = "HELLO.version is " + std::to_string(hello->version) + ", expected " + std::to_string(wire::kVersion);
  check("hello", why.empty(), why.empty() ? "role stage, version " + std::to_string(wire::kVersion) + ", routing id " + wire::printable_id(test_.route) : why);
  msg::Welcome tw;
  tw.peer_id = test_.route;
  tw.heartbeat_ms = kHeartbeatMs;
  tw.liveness = kLiveness;
  tw.parts = true;
  test_.parts = hello && hello->parts;
  send(test_.route, msg::make(tw, 0));
  const size_t before = test_.heartbeat_at.size();
  const double welcomed = now_s();
  pump(3 * kHeartbeatMs + 500);
  const size_t beats = test_.heartbeat_at.size() - before;
  check("heartbeat", beats >= 2 && test_.heartbeat_error.empty(),
        test_.heartbeat_error.empty() ? std::to_string(beats) + " heartbeat(s) in the " + fmt(now_s() - welcomed) + " s after WELCOME at " +
                                            std::to_string(kHeartbeatMs) + " ms (at least 2 expected)"
                                      : "a heartbeat does not check: " + test_.heartbeat_error);
  const msg::Heartbeat hb = test_.last_heartbeat.value_or(msg::Heartbeat{});
  check("heartbeat_before_load", test_.last_heartbeat && !hb.ready && hb.stage == -1 && hb.job_id == 0,
        "ready " + std::string(hb.ready ? "true" : "false") + ", stage " + std::to_string(hb.stage) + ", job_id " + std::to_string(hb.job_id) +
            " (expected false, -1, 0 before LOAD_STAGE)");
}

void Kit::eval_check(const std::string& name, uint64_t mb, const Tol& tol) {
  std::string why;
  auto [r, t] = both([&](uint64_t id) {
    Message m = hop(MsgType::kEval, id, mb);
    m.tensors.push_back(input(mb));
    if (last()) m.tensors.push_back(targets(mb));
    return m;
  }, why);
  if (!r || !t) return check(name, false, why);
  const uint64_t id = r->id;
  auto tr = expect<msg::Result>(name, t, MsgType::kResult, id, why);
  if (!tr) return;
  if (last()) {
    const msg::Result rr = msg::read<msg::Result>(*r);
    const double want = rr.loss.value_or(-1), got = tr->loss.value_or(-1);
    const bool ok = tr->loss && std::fabs(want - got) <= tol.abs + tol.rel * std::fabs(want);
    return check(name, ok, "loss " + (tr->loss ? fmt(got) : std::string("missing")) + ", the reference's " + fmt(want));
  }
  const std::string d = compare_tensor(*r, *t, 0, size_t(kB * kT * kC), tol);
  check(name, d.empty(), d.empty() ? "output [2, 8, 16] agrees with the reference's" + last_diff_ : "output: " + d);
}

void Kit::hop_checks() {
  std::string why;
  // Before LOAD_STAGE every work request is out of order.
  {
    Message m = hop(last() ? MsgType::kForwardLoss : MsgType::kForward, 0, 0);
    m.tensors.push_back(input(0));
    if (last()) m.tensors.push_back(targets(0));
    const uint64_t id = next_id_;
    auto rep = test_only(std::move(m), why);
    expect_error("work_before_load", rep, WireErrc::kOutOfOrder, id, std::nullopt, why);
  }
  // LOAD_STAGE.
  auto [r, t] = both([&](uint64_t id) {
    msg::LoadStage l;
    l.job_id = 1;
    l.stage = opt_.stage;
    l.spec = to_json(spec_);
    return msg::make(l, id);
  }, why);
  if (!r) return check("load_stage", false, why);
  auto ready = expect<msg::StageReady>("load_stage", t, MsgType::kStageReady, r->id, why);
  if (!ready) return;
  const msg::StageReady rr = msg::read<msg::StageReady>(*r);
  check("load_stage", ready->params == int64_t(P_) && ready->stage == opt_.stage && ready->job_id == 1,
        "params " + std::to_string(ready->params) + " (expected " + std::to_string(P_) + "), stage " + std::to_string(ready->stage) + ", job_id " +
            std::to_string(ready->job_id));
  check("initial_hash", ready->hash == rr.hash,
        "STAGE_READY.hash " + std::to_string(ready->hash) + ", the reference's " + std::to_string(rr.hash) + " (initial weights, docs/model.md#initialisation)");
  pump(2 * kHeartbeatMs + 100);
  const msg::Heartbeat hb = test_.last_heartbeat.value_or(msg::Heartbeat{});
  check("heartbeat_after_load", hb.ready && hb.stage == opt_.stage && hb.job_id == 1,
        "ready " + std::string(hb.ready ? "true" : "false") + ", stage " + std::to_string(hb.stage) + ", job_id " + std::to_string(hb.job_id));
  load_state_checks();

  const size_t act = size_t(kB * kT * kC);
  if (!last()) {
    auto [fr, ft] = both([&](uint64_t id) {
      Message m = hop(MsgType::kForward, id, 3);
      m.tensors.push_back(input(3));
      return m;
    }, why);
    if (!fr) {
      check("forward", false, why);
    } else if (auto res = expect<msg::Result>("forward", ft, MsgType::kResult, fr->id, why)) {
      std::string d = res->mb != 3 ? "RESULT.mb is " + std::to_string(res->mb) + ", expected 3" : compare_tensor(*fr, *ft, 0, act, kClose);
      check("forward", d.empty(), d.empty() ? "output [2, 8, 16] agrees with the reference's" + last_diff_ : d);
    }
    auto [br, bt] = both([&](uint64_t id) {
      Message m = hop(MsgType::kBackward, id, 3);
      m.tensors.push_back(input(3));
      m.tensors.push_back(grad_output(3));
      return m;
    }, why);
    if (!br) {
      check("backward", false, why);
    } else if (auto res = expect<msg::Result>("backward", bt, MsgType::kResult, br->id, why)) {
      std::string d = res->samples != kB ? "RESULT.samples is " + std::to_string(res->samples.value_or(-1)) + ", expected 2" : "";
      if (d.empty() && opt_.stage > 0) d = compare_tensor(*br, *bt, 0, act, kClose);
      if (d.empty() && opt_.stage == 0 && !bt->tensors.empty()) d = "stage 0 returns no gradient, got " + std::to_string(bt->tensors.size()) + " tensor(s)";
      check("backward", d.empty(), d.empty() ? (opt_.stage > 0 ? "grad_input agrees with the reference's" + last_diff_ : "acknowledged with 2 samples, no tensor") : d);
    }
  } else {
    auto [fr, ft] = both([&](uint64_t id) {
      Message m = hop(MsgType::kForwardLoss, id, 3);
      m.tensors.push_back(input(3));
      m.tensors.push_back(targets(3));
      return m;
    }, why);
    if (!fr) {
      check("forward_loss", false, why);
    } else if (auto res = expect<msg::Result>("forward_loss", ft, MsgType::kResult, fr->id, why)) {
      const msg::Result rr2 = msg::read<msg::Result>(*fr);
      const double want = rr2.loss.value_or(-1), got = res->loss.value_or(-1);
      std::string d = !res->loss || std::fabs(want - got) > kClose.abs + kClose.rel * std::fabs(want) ? "loss " + fmt(got) + ", the reference's " + fmt(want) : "";
      if (d.empty() && res->samples != kB) d = "RESULT.samples is " + std::to_string(res->samples.value_or(-1)) + ", expected 2";
      check("forward_loss", d.empty(), d.empty() ? "loss " + fmt(got) + " agrees with the reference's" : d);
      const std::string g = compare_tensor(*fr, *ft, 0, act, kClose);
      check("loss_gradient", g.empty(), g.empty() ? "grad_input = d(loss x B)/d(input) agrees with the reference's" + last_diff_ : g);
    }
  }
  eval_check("eval", 4);

  // STEP: one AdamW step over the accumulated gradients.
  auto [sr, st] = both([&](uint64_t id) {
    msg::Step s;
    s.job_id = 1;
    return msg::make(s, id);
  }, why);
  if (!sr) {
    check("step", false, why);
  } else if (auto res = expect<msg::Result>("step", st, MsgType::kResult, sr->id, why)) {
    const msg::Result rs = msg::read<msg::Result>(*sr);
    check("step", res->steps == rs.steps && !res->skipped.value_or(false),
          "steps " + std::to_string(res->steps.value_or(-1)) + " (the reference's " + std::to_string(rs.steps.value_or(-1)) + "), skipped " +
              (res->skipped.value_or(false) ? "true" : "false"));
  }
  eval_check("eval_after_step", 4, kOutputAfterStep);
}

void Kit::round_checks() {
  std::string why;
  auto round_ref = [&](auto& r, uint64_t round) {
    r.job_id = 1;
    r.round = round;
    r.stage = opt_.stage;
    r.what = msg::RoundWhat::kDelta;
    r.fragment = 0;
    r.fragments = 1;
  };
  auto [dr, dt] = both([&](uint64_t id) {
    msg::RoundBegin b;
    round_ref(b, 1);
    return msg::make(b, id);
  }, why);
  if (!dr) return check("round_delta", false, why);
  auto res = expect<msg::RoundDelta>("round_delta", dt, MsgType::kRoundDelta, dr->id, why);
  if (!res) return;
  std::string d = res->round != 1 ? "ROUND_DELTA.round is " + std::to_string(res->round) + ", expected 1" : compare_tensor(*dr, *dt, 0, P_, kAfterStep);
  check("round_delta", d.empty(), d.empty() ? "delta = theta_g - theta over " + std::to_string(P_) + " values agrees with the reference's" + last_diff_ : d);
  if (!d.empty()) return;
  ref_delta_ = *floats_of(*dr, 0, P_, why);
  test_delta_ = *floats_of(*dt, 0, P_, why);

  // The reducer's arithmetic, exact: both reduce the same two tensors with weights 3 and 1.
  auto [rr, rt] = both([&](uint64_t id) {
    msg::RoundReduce b;
    round_ref(b, 1);
    b.weights = {3, 1};
    Message m = msg::make(b, id);
    m.tensors.push_back(f32(ref_delta_, {int64_t(P_)}));
    m.tensors.push_back(f32(values(99, P_, 1e-3f), {int64_t(P_)}));
    return m;
  }, why);
  if (!rr) return check("round_reduce", false, why);
  if (!expect<msg::RoundReduced>("round_reduce", rt, MsgType::kRoundReduced, rr->id, why)) return;
  d = compare_tensor(*rr, *rt, 0, P_, kExact);
  check("round_reduce", d.empty(), d.empty() ? "(3 d1 + 1 d2) x float(1/4) in fp32, bit-identical" : d);
  reduced_ = *floats_of(*rr, 0, P_, why);

  auto [ar, at] = both([&](uint64_t id) {
    msg::RoundApply b;
    round_ref(b, 1);
    b.contributors = 2;
    b.samples = 4;
    Message m = msg::make(b, id);
    m.tensors.push_back(f32(reduced_, {int64_t(P_)}));
    return m;
  }, why);
  if (!ar) return check("round_apply_hash", false, why);
  auto done = expect<msg::RoundDone>("round_apply_hash", at, MsgType::kRoundDone, ar->id, why);
  if (!done) return;
  const msg::RoundDone rd = msg::read<msg::RoundDone>(*ar);
  check("round_apply_hash", done->hash == rd.hash,
        "ROUND_DONE.hash " + std::to_string(done->hash) + ", the reference's " + std::to_string(rd.hash) + " (outer Nesterov step in fp32, docs/model.md#rounds-fragments-and-hashes)");
  eval_check("eval_after_round", 5);
}

void Kit::state_checks() {
  std::string why;
  auto [sr, st] = both([&](uint64_t id) {
    msg::StateRequest s;
    s.job_id = 1;
    s.full = true;
    return msg::make(s, id);
  }, why);
  if (!sr) return check("state_reply", false, why);
  auto res = expect<msg::StateReply>("state_reply", st, MsgType::kStateReply, sr->id, why);
  if (!res) return;
  const msg::StateReply rs = msg::read<msg::StateReply>(*sr);
  std::string d;
  if (st->tensors.size() != 5) d = "STATE_REPLY {full} carries " + std::to_string(st->tensors.size()) + " tensors, expected 5";
  if (d.empty() && res->hash != rs.hash) d = "hash " + std::to_string(res->hash) + ", the reference's " + std::to_string(rs.hash);
  if (d.empty() && res->adam_step != rs.adam_step) d = "adam_step " + std::to_string(res->adam_step.value_or(-1)) + ", the reference's " + std::to_string(rs.adam_step.value_or(-1));
  const char* names[] = {"theta_g", "momentum", "theta", "adam_m", "adam_v"};
  for (size_t i = 0; i < 5 && d.empty(); ++i) {
    d = compare_tensor(*sr, *st, i, P_, i >= 2 ? kAfterStep : kExact);
    if (!d.empty()) d = std::string(names[i]) + ": " + d;
  }
  check("state_reply", d.empty(), d.empty() ? "theta_g and momentum bit-identical, theta and the AdamW moments within tolerance, adam_step " +
                                                 std::to_string(rs.adam_step.value_or(-1))
                                           : d);
}

void Kit::load_state_checks() {
  std::string why;
  // STATE_LOAD with a state neither peer had, whose weights are of unit scale: from here on
  // the GELUs and softmaxes work in their nonlinear range (at the initial weights, 0.02, they are
  // nearly linear and would hide a wrong formula).
  std::vector<float> tg = values(31, P_, 0.5f), mom = values(7, P_, 1e-3f);
  const uint64_t want = wire::checksum(tg.data(), P_ * 4) ^ (wire::checksum(mom.data(), P_ * 4) * 0x9E3779B97F4A7C15ull);
  auto [lr, lt] = both([&](uint64_t id) {
    msg::StateLoad l;
    l.job_id = 1;
    Message m = msg::make(l, id);
    m.tensors.push_back(f32(tg, {int64_t(P_)}));
    m.tensors.push_back(f32(mom, {int64_t(P_)}));
    return m;
  }, why);
  if (!lr) return check("state_load_hash", false, why);
  auto done = expect<msg::RoundDone>("state_load_hash", lt, MsgType::kRoundDone, lr->id, why);
  if (!done) return;
  check("state_load_hash", done->hash == want, "ROUND_DONE.hash " + std::to_string(done->hash) + ", expected " + std::to_string(want) + " (the hash of the state sent)");
  eval_check("eval_after_state_load", 6);
}

void Kit::fault_checks() {
  std::string why;
  const MsgType work = last() ? MsgType::kForwardLoss : MsgType::kForward;
  auto work_msg = [&](uint64_t mb) {
    Message m = hop(work, 0, mb);
    m.tensors.push_back(input(mb));
    if (last()) m.tensors.push_back(targets(mb));
    return m;
  };
  {  // A tensor frame damaged in transit: checksum, with the request's id.
    Message m = work_msg(8);
    m.id = next_id_++;
    const uint64_t id = m.id;
    std::vector<zmq::message_t> frames = wire::encode(m);
    static_cast<uint8_t*>(frames[2].data())[5] ^= 0x40;
    send_frames(test_.route, std::move(frames));
    expect_error("corrupt_frame", await(test_, id, why), WireErrc::kChecksum, id, std::nullopt, why);
  }
  {  // Bytes that are no envelope: bad_magic, id 0.
    std::vector<zmq::message_t> frames;
    frames.emplace_back("\xc1garbage", 8);
    frames.emplace_back("\x80", 1);
    send_frames(test_.route, std::move(frames));
    expect_error("garbage_envelope", await(test_, 0, why), WireErrc::kBadMagic, 0, std::nullopt, why);
  }
  {  // An envelope of protocol v1: bad_version.
    const uint64_t id = next_id_++;
    const auto env = json::to_msgpack(json::array({wire::kMagic, 1, int(work), id, 0}));
    std::vector<zmq::message_t> frames;
    frames.emplace_back(env.data(), env.size());
    frames.emplace_back("\x80", 1);
    send_frames(test_.route, std::move(frames));
    // The id may be echoed or 0: the envelope did not decode.
    expect_error("old_version", await(test_, id, why, 0), WireErrc::kBadVersion, std::nullopt, std::nullopt, why);
  }
  {  // A bad stage input: a token out of the vocabulary, or a NaN activation.
    Message m = work_msg(9);
    if (opt_.stage == 0) {
      std::vector<int32_t> tok(size_t(kB * kT), 1);
      tok[3] = int32_t(kV + 5);
      m.tensors[0] = i32(tok, {kB, kT});
    } else {
      std::vector<float> v = values(9, size_t(kB * kT * kC), 1.f);
      v[11] = std::nanf("");
      m.tensors[0] = f32(v, {kB, kT, kC});
    }
    const uint64_t id = next_id_;
    expect_error("bad_input", test_only(std::move(m), why), WireErrc::kBadTensor, id, 0, why);
  }
  {
    Message m = work_msg(10);
    msg::Hop h;
    h.job_id = 7;
    h.mb = 10;
    h.stage = opt_.stage;
    m.body = msg::pack(h);
    const uint64_t id = next_id_;
    expect_error("wrong_job", test_only(std::move(m), why), WireErrc::kOutOfOrder, id, std::nullopt, why);
  }
  {  // FORWARD to the last stage, FORWARD_LOSS to another.
    Message m = hop(last() ? MsgType::kForward : MsgType::kForwardLoss, 0, 11);
    m.tensors.push_back(input(11));
    if (!last()) m.tensors.push_back(targets(11));
    const uint64_t id = next_id_;
    expect_error("wrong_request_for_stage", test_only(std::move(m), why), WireErrc::kOutOfOrder, id, std::nullopt, why);
  }
  {
    Message m = hop(work, 0, 12);
    const uint64_t id = next_id_;
    expect_error("missing_tensor", test_only(std::move(m), why), WireErrc::kMalformed, id, std::nullopt, why);
  }
  eval_check("alive_after_faults", 13);
  // A request in PARTs (docs/protocol.md#parts), as the router sends any message over 64 KiB to
  // a peer that takes them: here in pieces of 256 bytes, so that a small EVAL comes in several.
  if (test_.parts && ref_.parts) {
    part_bytes_ = 256;
    eval_check("parts", 14);
    part_bytes_ = limits::kMaxPartBytes;
  } else {
    check("parts", true, "not offered (HELLO.parts false): a router sends this peer every message whole");
  }
  check("answers_within_deadline", max_latency_s_ < spec_.timeouts.forward_s,
        "slowest answer " + fmt(max_latency_s_) + " s (a hop's deadline is at most " + fmt(spec_.timeouts.forward_s) + " s)");
  // Signs of life all along (heartbeats, or any message: a busy peer may skip its heartbeats):
  // no silence the router would take for death.
  double gap = 0;
  for (size_t i = 1; i < test_.heard_at.size(); ++i) gap = std::max(gap, test_.heard_at[i] - test_.heard_at[i - 1]);
  const double dead_after_s = kLiveness * kHeartbeatMs / 1000.0;  // what WELCOME told it
  check("heartbeats_throughout", gap < dead_after_s && test_.heartbeat_at.size() > 2,
        std::to_string(test_.heartbeat_at.size()) + " heartbeats, " + std::to_string(test_.heard_at.size()) + " messages in all, longest silence " +
            fmt(gap) + " s (WELCOME said liveness " + std::to_string(kLiveness) + " x " + std::to_string(kHeartbeatMs) + " ms = " + fmt(dead_after_s) + " s)");
  // BYE from the router: the peer leaves.
  msg::Bye bye;
  bye.reason = "router shutting down";
  send(test_.route, msg::make(bye));
  const auto t0 = Clock::now();
  while (alive(test_proc_) && std::chrono::duration<double>(Clock::now() - t0).count() < 10) pump(50);
  check("bye", !alive(test_proc_), alive(test_proc_) ? "still running 10 s after the router's BYE" : "exited after the router's BYE");
}

std::vector<ConformanceCheck> Kit::run() {
  connect_peers();
  if (!test_.route.empty()) {
    hop_checks();
    round_checks();
    state_checks();
    fault_checks();
  }
  return checks_;
}

}  // namespace

std::vector<ConformanceCheck> run_conformance(const ConformanceOptions& opt, const std::function<void(const ConformanceCheck&)>& report) {
  if (opt.peer_command.find("{router}") == std::string::npos)
    throw InputError("--peer must contain {router}, where the kit's endpoint goes, e.g. 'build/swarm-stage --router {router}'");
  if (opt.stage < 0 || opt.stage > 2) throw InputError("--stage must be 0, 1 or 2 (the test job has 3 stages)");
  Kit kit(opt, report);
  return kit.run();
}

}  // namespace swarm
