// bench_router.cpp: `swarm bench router` (see bench.h): the real router process, its ZeroMQ
// socket, framing, checksums and core, under a hundred and a thousand peers on this machine.
//
// A swarm of that size cannot run as processes on two cores, and the simulator runs the core
// alone, so this bench connects the peers as sockets of its own process: each is a DEALER
// socket that says HELLO, heartbeats at the router's pace (skipping beats while busy, as a stage
// server does), and answers every request with what the simulator's stage servers answer
// (sim/stage_replies.h: results of the right size, computed by nobody) after the compute time a
// peer of `ms_per_unit` would take. The job is the bundled example's text on a tiny model, every
// tensor through the router ("hops": "hub"), so the router carries every hop's bytes and the
// peers need not reach each other. The router runs without CURVE (its cost is per byte:
// docs/benchmarks.md, `curve_4m_vs_plain`).
//
// For each swarm size: the peers join; the router's process CPU (/proc) and its message counters
// (/metrics: swarm_router_messages_total, swarm_router_core_seconds_total) are read over a window
// of idle heartbeats, then over a window of steady training. Figures: the router's CPU time per
// message handled (in + out), the core's share of it, messages per second, and the idle load.
#include <sys/epoll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>

#include <zmq.hpp>

#include "runtime/client.h"
#include "runtime/http.h"
#include "runtime/messages.h"
#include "runtime/timing.h"
#include "runtime/wire.h"
#include "sim/stage_replies.h"
#include "tools/bench.h"
#include "tools/bench_common.h"
#include "tools/local_swarm.h"

namespace swarm {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// One peer of the swarm: a socket and what a stage server would know.
struct Peer {
  std::unique_ptr<zmq::socket_t> sock;
  std::string name;
  sim::StageBook book;
  sim::Quirks quirks;
  bool welcomed = false;
  double hello_s = -1e9, last_beat_s = 0, last_sent_s = 0, busy_until = 0;
  struct Work {
    double done_s = 0, compute_ms = 0;   // when its compute ends, and what it took
    wire::Message request;
  };
  std::deque<Work> work;   // in the order its one compute thread takes them
};

// N peers in one thread: they join, heartbeat and answer until stop() (their sockets close).
class Swarm {
 public:
  Swarm(const std::string& router, int n, double ms_per_unit) : ms_per_unit_(ms_per_unit) {
    for (int i = 0; i < n; ++i) {
      Peer p;
      p.name = "bench-" + std::to_string(i);
      p.sock = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::dealer);
      p.sock->set(zmq::sockopt::routing_id, p.name);
      p.sock->set(zmq::sockopt::sndtimeo, 0);
      p.sock->set(zmq::sockopt::linger, 0);
      p.sock->set(zmq::sockopt::sndhwm, 100000);
      p.sock->set(zmq::sockopt::rcvhwm, 100000);
      p.sock->connect(router);
      peers_.push_back(std::move(p));
    }
    sent_.assign(peers_.size(), 0);
    thread_ = std::thread([this] { loop(); });
  }
  ~Swarm() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  double now() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  void send(Peer& p, wire::Message m) {
    wire::send(*p.sock, m);
    p.last_sent_s = now();
    sent_[size_t(&p - peers_.data())] = 1;
  }

  void hello(Peer& p) {
    msg::Hello h;
    h.role = msg::Role::kStage;
    h.version = wire::kVersion;
    h.name = p.name;
    h.threads = 1;
    h.pid = int64_t(getpid());
    p.hello_s = now();
    send(p, msg::make(h));
  }

  void receive(Peer& p, wire::Message m) {
    using wire::MsgType;
    switch (m.type) {
      case MsgType::kWelcome: {
        const msg::Welcome w = msg::read<msg::Welcome>(m);
        if (w.heartbeat_ms) beat_s_ = *w.heartbeat_ms / 1000.0;
        if (w.liveness) liveness_ = *w.liveness;
        p.welcomed = true;
        return;
      }
      case MsgType::kError: {
        const msg::Error e = msg::read<msg::Error>(m);
        if (e.code == int(WireErrc::kOutOfOrder) && e.request_type == int(MsgType::kHeartbeat)) p.welcomed = false;
        return;
      }
      case MsgType::kHeartbeat: case MsgType::kChaos: case MsgType::kBye: return;
      case MsgType::kRelease: {
        sim::reply(p.book, m, {}, 0, now(), p.quirks, payloads_);
        return;
      }
      default: break;
    }
    // A request: it waits for the peer's one compute thread, then takes its work's time.
    const double ms = sim::work_units(m.type, sim::has_graph(p.book, m)) * ms_per_unit_;
    p.busy_until = std::max(p.busy_until, now()) + ms / 1000.0;
    p.work.push_back({p.busy_until, ms, std::move(m)});
  }

  // Everything that arrived for peer i.
  void drain(size_t i) {
    while (auto r = wire::recv_frames(*peers_[i].sock, false, zmq::recv_flags::dontwait)) {
      try {
        receive(peers_[i], wire::decode(r->frames));
      } catch (const std::exception& e) {
        std::cerr << "swarm bench router: " << peers_[i].name << ": " << e.what() << "\n";
      }
    }
  }

  void loop() {
    // zmq_poll over a thousand sockets costs this process more than the router spends on their
    // messages (a getpid and a poll entry per socket per call): epoll on the sockets' ZMQ_FDs,
    // which signal that a socket's events may have changed, says which ones to drain.
    const int ep = epoll_create1(0);
    std::vector<epoll_event> ready(peers_.size());
    for (size_t i = 0; i < peers_.size(); ++i) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = i;
      epoll_ctl(ep, EPOLL_CTL_ADD, peers_[i].sock->get(zmq::sockopt::fd), &ev);
    }
    // One turn every 2 ms: a peer answers up to 2 ms late.
    auto turn = Clock::now();
    while (!stop_) {
      turn += std::chrono::milliseconds(2);
      std::this_thread::sleep_until(turn);
      const int n = epoll_wait(ep, ready.data(), int(ready.size()), 0);
      for (int k = 0; k < n; ++k) drain(size_t(ready[size_t(k)].data.u64));
      // A send may consume the signal of a message that arrived meanwhile: those are drained too.
      for (size_t i = 0; i < peers_.size(); ++i)
        if (sent_[i]) {
          sent_[i] = 0;
          drain(i);
        }
      const double t = now();
      for (Peer& p : peers_) {
        if (!p.welcomed) {
          if (t - p.hello_s >= 1.0) hello(p);
          continue;
        }
        while (!p.work.empty() && p.work.front().done_s <= t) {
          Peer::Work w = std::move(p.work.front());
          p.work.pop_front();
          if (std::optional<wire::Message> rep = sim::reply(p.book, w.request, {}, w.compute_ms, t, p.quirks, payloads_)) send(p, std::move(*rep));
        }
        if (t >= timing::next_heartbeat_s(p.last_beat_s, p.last_sent_s, beat_s_, liveness_)) {
          p.last_beat_s = t;
          msg::Heartbeat hb;
          hb.stage = p.book.stage;
          hb.job_id = p.book.job;
          hb.ready = p.book.loaded;
          if (p.book.loaded) hb.cache_entries = int64_t(p.book.cache_entries);
          hb.ms_per_unit = ms_per_unit_;
          send(p, msg::make(hb));
        }
      }
    }
    close(ep);
  }

  zmq::context_t ctx_{1};
  std::vector<Peer> peers_;
  std::vector<char> sent_;   // peers that sent since their socket was last drained
  sim::Payloads payloads_;
  double ms_per_unit_;
  double beat_s_ = 0.5;
  int liveness_ = 3;
  std::atomic<bool> stop_{false};
  const Clock::time_point t0_ = Clock::now();
  std::thread thread_;
};

// The router's counters at one moment.
struct Sample {
  double t = 0, cpu_s = 0, loop_s = 0, io_s = 0, core_s = 0, in = 0, out = 0, completed = 0;
};

double metric(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  return at == std::string::npos ? 0.0 : std::atof(page.c_str() + at + series.size() + 2);
}

Sample sample(const LocalSwarm& sw, Client& c, uint64_t job) {
  const http::Response r = http::get(sw.http_url() + "/metrics");
  Sample s;
  s.t = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  const std::string proc = "/proc/" + std::to_string(sw.router_pid());
  s.cpu_s = cpu_seconds(proc + "/stat");
  s.loop_s = cpu_seconds(proc + "/task/" + std::to_string(sw.router_pid()) + "/stat");   // the main thread: the loop
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(proc + "/task", ec)) {
    std::string comm;
    std::getline(std::ifstream(task.path() / "comm"), comm);
    if (comm.rfind("ZMQbg/IO", 0) == 0) s.io_s += cpu_seconds(task.path() / "stat");   // the router runs one
  }
  s.core_s = metric(r.body, "swarm_router_core_seconds_total");
  s.in = metric(r.body, "swarm_router_messages_total{direction=\"in\"}");
  s.out = metric(r.body, "swarm_router_messages_total{direction=\"out\"}");
  if (job) s.completed = double(c.request_body(wire::MsgType::kStatus, json{{"job_id", job}})["microbatches"].value("completed", uint64_t(0)));
  return s;
}

// What one window says: per second, and the router's CPU per message.
json window(const Sample& a, const Sample& b) {
  const double dt = b.t - a.t, msgs = (b.in - a.in) + (b.out - a.out), cpu = b.cpu_s - a.cpu_s, core = b.core_s - a.core_s,
               loop = b.loop_s - a.loop_s, io = b.io_s - a.io_s;
  return {{"seconds", dt},
          {"messages_per_s", dt > 0 ? msgs / dt : 0.0},
          {"in_per_s", dt > 0 ? (b.in - a.in) / dt : 0.0},
          {"cpu_share", dt > 0 ? cpu / dt : 0.0},
          {"us_per_message", msgs > 0 ? 1e6 * cpu / msgs : 0.0},
          {"core_us_per_message", msgs > 0 ? 1e6 * core / msgs : 0.0},
          {"loop_us_per_message", msgs > 0 ? 1e6 * loop / msgs : 0.0},           // the main thread, the core included
          {"io_us_per_message", msgs > 0 ? 1e6 * io / msgs : 0.0},               // ZeroMQ's I/O thread
          // What the loop and the I/O thread would carry with a core each: the busier one's limit.
          {"capacity_messages_per_s", msgs > 0 ? msgs / std::max({loop, io, 1e-9}) : 0.0},
          {"core_share", cpu > 0 ? core / cpu : 0.0},
          {"microbatches_per_s", dt > 0 ? (b.completed - a.completed) / dt : 0.0}};
}

json run_size(int n, double ms_per_unit, double window_s, bool as_json) {
  LocalSwarm sw(temp_dir("router"));
  sw.set_secure(false);
  sw.start_router({"--http", "127.0.0.1:0"});
  Swarm peers(sw.router_endpoint(), n, ms_per_unit);
  Client c(sw.router_endpoint());
  for (int i = 0; i < 600 && c.peers()["total"].get<size_t>() < size_t(n); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const Sample i0 = sample(sw, c, 0);
  std::this_thread::sleep_for(std::chrono::duration<double>(window_s));
  const Sample i1 = sample(sw, c, 0);

  json spec = example_job();
  spec["name"] = "router-bench";
  spec["steps"] = 1000000;
  spec["model"] = {{"d_model", 32}, {"n_head", 2}, {"n_layer", 4}, {"seq_len", 16}};
  spec["partition"] = {{"stages", 4}};
  spec["batch"] = {{"batch_size", 8}, {"microbatch_size", 1}};
  spec["max_inflight"] = std::min(4096, n);   // about one microbatch per peer: every peer busy
  spec["routing"]["hops"] = "hub";
  // Every peer ready before the first step: otherwise the first ready peer of each stage takes
  // hundreds of the first microbatches (a queue of 337 units each on two stage-0 peers, 17 s of
  // work at 50 ms a unit, in a run without it) and the window measures that queue draining.
  spec["routing"]["start_peers"] = n / 4;
  spec["routing"]["start_wait_s"] = 60;
  // For the record of what a job that does not wait gets (docs/scale.md): the first step's
  // ready peers and the dispatcher's queue bound, from the environment.
  if (const char* v = std::getenv("SWARM_ROUTER_BENCH_START_PEERS")) spec["routing"]["start_peers"] = std::atoi(v);
  if (const char* v = std::getenv("SWARM_ROUTER_BENCH_MAX_QUEUED_S")) spec["routing"]["max_queued_s"] = std::atof(v);
  spec["diloco"] = {{"inner_steps", 1000000}, {"warm_start_steps", 0}};
  spec["eval"] = {{"every_steps", 0}};
  spec["checkpoint"] = {{"snapshot_every_steps", 1000000}};
  const uint64_t id = c.request_body(wire::MsgType::kSubmit, json{{"spec", spec}}).at("job_id").get<uint64_t>();
  // Running, then a few seconds for the pipeline to fill.
  for (int i = 0; i < 600; ++i) {
    if (c.request_body(wire::MsgType::kStatus, json{{"job_id", id}}).value("state", "") == "running") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const Sample t0 = sample(sw, c, id);
  std::this_thread::sleep_for(std::chrono::duration<double>(window_s));
  const Sample t1 = sample(sw, c, id);
  const json st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
  json out{{"peers", n},
           {"ms_per_unit", ms_per_unit},
           {"idle", window(i0, i1)},
           {"training", window(t0, t1)},
           {"state", st.value("state", "")},
           {"microbatches", st.value("microbatches", json::object())},
           {"router_rss_mb", 0}};
  if (std::ifstream f("/proc/" + std::to_string(sw.router_pid()) + "/statm"); f) {
    long pages = 0, resident = 0;
    f >> pages >> resident;
    out["router_rss_mb"] = double(resident) * double(sysconf(_SC_PAGESIZE)) / 1048576.0;
  }
  peers.stop();
  const json& w = out["training"];
  char text[400];
  std::snprintf(text, sizeof text,
                "%5d peers: idle %.0f msgs/s at %.1f%% of a core; training %.0f msgs/s at %.1f%% of a core, %.1f us/msg (loop %.1f, of it core %.1f; I/O %.1f), %.0f microbatches/s; capacity %.0f msgs/s",
                n, out["idle"]["messages_per_s"].get<double>(), 100 * out["idle"]["cpu_share"].get<double>(), w["messages_per_s"].get<double>(),
                100 * w["cpu_share"].get<double>(), w["us_per_message"].get<double>(), w["loop_us_per_message"].get<double>(),
                w["core_us_per_message"].get<double>(), w["io_us_per_message"].get<double>(), w["microbatches_per_s"].get<double>(),
                w["capacity_messages_per_s"].get<double>());
  json line{{"case", "router_" + std::to_string(n)}};
  line.update(out);
  emit(as_json, line, text);
  return out;
}

}  // namespace

int run_router_bench(bool as_json) {
  // A thousand peers are a thousand sockets here and a thousand connections in the router.
  // Each peer's socket takes two descriptors here (its connection and its mailbox).
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < 3000) {
    std::cerr << "swarm bench router: 1,000 peers need about 2,100 open files, and this process may open "
              << nofile.rlim_cur << "; raise the limit (ulimit -n 4096, or the hard limit as root)\n";
    return 1;
  }
  const double window_s = std::getenv("SWARM_ROUTER_BENCH_S") ? std::atof(std::getenv("SWARM_ROUTER_BENCH_S")) : 10.0;
  const double ms_per_unit = std::getenv("SWARM_ROUTER_BENCH_MS") ? std::atof(std::getenv("SWARM_ROUTER_BENCH_MS")) : 10.0;
  const json r100 = run_size(100, ms_per_unit, window_s, as_json);
  const json r1000 = run_size(1000, ms_per_unit, window_s, as_json);
  auto fig = [](double v, const char* target) { return json{{"value", v}, {"target", target}}; };
  const json& t = r1000["training"];
  const double core_us = t["core_us_per_message"].get<double>();
  json figures{{"router_us_per_message_1000", fig(t["us_per_message"].get<double>(), "report")},
               {"router_vs_core_1000", fig(core_us > 0 ? t["us_per_message"].get<double>() / core_us : 0.0, "report")},
               {"router_loop_us_per_message_1000", fig(t["loop_us_per_message"].get<double>(), "report")},
               {"router_io_us_per_message_1000", fig(t["io_us_per_message"].get<double>(), "report")},
               {"router_messages_per_s_1000", fig(t["messages_per_s"].get<double>(), "report")},
               {"router_idle_cpu_share_1000", fig(r1000["idle"]["cpu_share"].get<double>(), "report")},
               {"router_us_per_message_100", fig(r100["training"]["us_per_message"].get<double>(), "report")},
               {"router_capacity_1000", fig(t["capacity_messages_per_s"].get<double>(), "report")}};
  if (as_json) {
    std::cout << json{{"bench", "router"}, {"figures", figures}, {"raw", {{"100", r100}, {"1000", r1000}}}}.dump() << std::endl;
  } else {
    std::cout << "router CPU per message at 1,000 peers: " << t["us_per_message"].get<double>() << " us, "
              << figures["router_vs_core_1000"]["value"].get<double>() << " times the core's\n";
  }
  return 0;
}

}  // namespace swarm
