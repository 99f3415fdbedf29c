// test_observability.cpp: what a person sees of a running swarm, on real processes over
// loopback: `promtool check metrics` on the router's and a stage server's live /metrics during
// a job, /api/status and /api/peers against `swarm status --json` and `swarm peers --json`, a
// real Prometheus server scraping `swarm local` (the router, and the stage servers it finds
// through /api/targets) whose query matches `swarm status`, and the dashboard in headless
// Chromium (tests/integration/dashboard_check.py): DOM checks, screenshots under
// build/test-output/, and a killed peer leaving the page. Each test skips with a message when
// its tool (Debian's prometheus, chromium) is missing; tools/install-deps.sh installs them.
// Then the router's own counters under a thousand peers (`swarm bench router`).
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "runtime/client.h"
#include "runtime/http.h"
#include "tests/integration/swarm_test_util.h"
#include "tools/local_swarm.h"

using namespace swarm;
using namespace swarm::testing;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool have(const std::string& tool) { return run("command -v " + tool).first == 0; }

// Where a test leaves what a person may want to look at (screenshots, pages), kept after the run.
std::string output_dir(const std::string& test) {
  const std::string d = kBuild + "/test-output/" + test;
  std::filesystem::create_directories(d);
  return d;
}

// Runs `promtool check metrics` on `page`; returns (exit code, its output).
std::pair<int, std::string> promtool(const std::string& page, const std::string& file) {
  std::ofstream(file) << page;
  return run("promtool check metrics < " + file);
}

// The value of the sample `series` (name and labels exactly as written) on a page; NaN when absent.
double sample(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  if (at == std::string::npos) return NAN;
  return std::stod(page.substr(at + series.size() + 2));
}

// A free loopback TCP port for a server that cannot be told to pick one and say which
// (Prometheus): bound at port 0, read back, released.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

// A child process with its own process group, killed (the group) and reaped on destruction.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log) {
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      FILE* f = std::fopen(log.c_str(), "w");
      if (f) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~Child() { stop(); }
  void stop() {
    if (pid_ <= 0) return;
    kill(-pid_, SIGTERM);
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (waitpid(pid_, nullptr, WNOHANG) == 0) {
      kill(-pid_, SIGKILL);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

// `swarm status --json` and /api/status of one moment: the same document but for the router's
// own clock (router.uptime_s) and the figures that run on the clock while a job is open.
json without_clock(json st) {
  if (st.contains("router")) st["router"].erase("uptime_s");
  return st;
}

}  // namespace

TEST(Observability, PromtoolAcceptsLiveMetricsAndTheApiMatchesTheCli) {
  if (!have("promtool")) GTEST_SKIP() << "promtool not found: install Debian's prometheus package (tools/install-deps.sh)";
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  LocalSwarm swarm(dir, kBuild);
  swarm.set_log_format("json");
  swarm.start_router({"--http", "127.0.0.1:0"});
  ASSERT_FALSE(swarm.http_url().empty());
  for (int s = 0; s < 2; ++s) swarm.start_stage(s, "s" + std::to_string(s), 1, {"--http", "127.0.0.1:0"});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 2);
  const uint64_t id = submit(c, tiny_job(data, 2, 30, "sync"));

  // During the job: the router's page and each stage server's (found through /api/targets).
  const auto t0 = Clock::now();
  json st;
  for (;;) {
    st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    if (st["state"] == "running" && st.value("step", 0) >= 3) break;
    ASSERT_LT(since(t0), 120) << st.dump();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const http::Response router_page = http::get(swarm.http_url() + "/metrics");
  ASSERT_EQ(router_page.status, 200) << router_page.body;
  auto [rc, out] = promtool(router_page.body, dir + "/router.prom");
  EXPECT_EQ(rc, 0) << "promtool on the router's /metrics:\n" << out;
  EXPECT_NE(router_page.body.find("swarm_hop_latency_seconds_bucket{job_id=\"" + std::to_string(id) + "\",stage=\"1\",le=\"+Inf\"}"),
            std::string::npos);
  EXPECT_EQ(sample(router_page.body, "swarm_job_state{job_id=\"" + std::to_string(id) + "\",state=\"running\"}"), 1);
  // The loop's own counters: three steps of two stages took hops' requests out and results in,
  // and deciding them took some of the process's CPU time.
  EXPECT_GE(sample(router_page.body, "swarm_router_messages_total{direction=\"in\"}"), 12);
  EXPECT_GE(sample(router_page.body, "swarm_router_messages_total{direction=\"out\"}"), 12);
  EXPECT_GT(sample(router_page.body, "swarm_router_core_seconds_total"), 0);
  EXPECT_GT(sample(router_page.body, "process_cpu_seconds_total"), 0);

  const http::Response targets = http::get(swarm.http_url() + "/api/targets");
  ASSERT_EQ(targets.status, 200);
  const json tg = json::parse(targets.body);
  ASSERT_EQ(tg.size(), 2u) << tg.dump();
  for (const json& t : tg) {
    const std::string url = t["labels"]["__scheme__"].get<std::string>() + "://" + t["targets"][0].get<std::string>() +
                            t["labels"]["__metrics_path__"].get<std::string>();
    const http::Response page = http::get(url);
    ASSERT_EQ(page.status, 200) << url << ": " << page.body;
    auto [src, sout] = promtool(page.body, dir + "/stage.prom");
    EXPECT_EQ(src, 0) << "promtool on " << url << ":\n" << sout;
    EXPECT_GT(sample(page.body, "swarm_stage_hops_total{kind=\"forward\"}") + sample(page.body, "swarm_stage_hops_total{kind=\"backward\"}"), 0)
        << page.body;
    EXPECT_GT(sample(page.body, "process_resident_memory_bytes"), 0);
  }

  // After the job: /api/status and /api/peers are what the CLI prints.
  for (;;) {
    st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    if (st["state"] == "done" || st["state"] == "failed") break;
    ASSERT_LT(since(t0), 240) << st.dump();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(st["state"], "done") << st.dump();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));   // pages are at most 100 ms old
  auto [src, cli_status] = run(kBuild + "/swarm status --router " + swarm.router_endpoint() + " --json");
  ASSERT_EQ(src, 0) << cli_status;
  const http::Response api_status = http::get(swarm.http_url() + "/api/status");
  ASSERT_EQ(api_status.status, 200);
  EXPECT_EQ(without_clock(json::parse(api_status.body)), without_clock(json::parse(cli_status)));
  auto [prc, cli_peers] = run(kBuild + "/swarm peers --router " + swarm.router_endpoint() + " --json");
  ASSERT_EQ(prc, 0) << cli_peers;
  const http::Response api_peers = http::get(swarm.http_url() + "/api/peers");
  ASSERT_EQ(api_peers.status, 200);
  const json a = json::parse(api_peers.body), b = json::parse(cli_peers);
  ASSERT_EQ(a["peers"].size(), b["peers"].size());
  for (size_t i = 0; i < a["peers"].size(); ++i) {
    for (const char* k : {"id", "name", "stage", "state", "metrics", "results"}) EXPECT_EQ(a["peers"][i][k], b["peers"][i][k]) << k;
  }
  // The stage servers' logs are JSON lines naming their peer and, once loaded, their job.
  std::ifstream log(swarm.log_dir() + "/s1.log");
  bool saw_job = false;
  for (std::string line; std::getline(log, line);) {
    if (line.empty() || line[0] != '{') continue;
    const json j = json::parse(line);
    EXPECT_EQ(j["peer"], "s1") << line;
    saw_job |= j["job"] == id;
  }
  EXPECT_TRUE(saw_job);
}

TEST(Observability, PrometheusScrapesSwarmLocalAndItsQueryMatchesTheStatus) {
  if (!have("prometheus")) GTEST_SKIP() << "prometheus not found: install Debian's prometheus package (tools/install-deps.sh)";
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  const std::string job = dir + "/job.json";
  std::ofstream(job) << tiny_job(data, 2, 20, "sync").dump();
  // `swarm local` runs the job and, with --keep-running, stays up for Prometheus to scrape.
  Child local({kBuild + "/swarm", "local", job, "--log-dir", dir + "/logs", "--peers-per-stage", "1", "--threads", "1", "--json", "--keep-running"},
              dir + "/local.out");
  std::string router, dashboard;
  const auto t0 = Clock::now();
  for (bool done = false; !done;) {
    ASSERT_LT(since(t0), 180) << "swarm local did not finish its job; see " << dir << "/local.out";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::ifstream f(dir + "/local.out");
    for (std::string line; std::getline(f, line);) {
      if (line.empty() || line[0] != '{') continue;
      const json j = json::parse(line, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.value("event", "") == "started") {
        router = j["router"];
        dashboard = j["dashboard"];
      }
      done |= j.value("event", "") == "staying_up";
    }
  }
  ASSERT_FALSE(dashboard.empty());
  const std::string http_host = dashboard.substr(7, dashboard.size() - 8);   // http://HOST:PORT/ -> HOST:PORT

  const int port = free_port();
  ASSERT_GT(port, 0);
  const std::string cfg = dir + "/prometheus.yml";
  std::ofstream(cfg) << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                     << "scrape_configs:\n"
                     << "  - job_name: swarm-router\n    static_configs:\n      - targets: ['" << http_host << "']\n"
                     << "  - job_name: swarm-stages\n    http_sd_configs:\n      - url: 'http://" << http_host
                     << "/api/targets'\n        refresh_interval: 1s\n";
  Child prom({"/usr/bin/prometheus", "--config.file=" + cfg, "--storage.tsdb.path=" + dir + "/tsdb",
              "--web.listen-address=127.0.0.1:" + std::to_string(port)},
             dir + "/prometheus.log");
  auto query = [&](const std::string& q) {
    std::string enc;
    for (char ch : q) {
      if (isalnum(static_cast<unsigned char>(ch)) || ch == '_') enc += ch;
      else {
        char b[4];
        std::snprintf(b, sizeof(b), "%%%02X", static_cast<unsigned char>(ch));
        enc += b;
      }
    }
    const http::Response r = http::get("http://127.0.0.1:" + std::to_string(port) + "/api/v1/query?query=" + enc, 2);
    return r.status == 200 ? json::parse(r.body)["data"]["result"] : json::array();
  };
  const std::string keys = " --key " + dir + "/logs/keys/admin.key --router-key " + dir + "/logs/keys/router.pub";
  auto [src, cli] = run(kBuild + "/swarm" + keys + " status --router " + router + " --json");
  ASSERT_EQ(src, 0) << cli;
  const json st = json::parse(cli);
  ASSERT_EQ(st["state"], "done") << cli;
  const double completed = st["microbatches"]["completed"].get<double>();
  ASSERT_GT(completed, 0);

  // Prometheus scrapes every second; the router and both stage servers become targets.
  json mbs, stages_up;
  const auto t1 = Clock::now();
  while (since(t1) < 60) {
    mbs = query("swarm_microbatches_completed_total");
    stages_up = query("sum(up{job=\"swarm-stages\"})");
    if (!mbs.empty() && !stages_up.empty() && std::stod(stages_up[0]["value"][1].get<std::string>()) == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ASSERT_EQ(mbs.size(), 1u) << "no swarm_microbatches_completed_total in Prometheus; see " << dir << "/prometheus.log";
  EXPECT_EQ(mbs[0]["metric"]["job"], "swarm-router");
  EXPECT_EQ(mbs[0]["metric"]["job_id"], std::to_string(st["job_id"].get<uint64_t>()));
  EXPECT_EQ(std::stod(mbs[0]["value"][1].get<std::string>()), completed);
  ASSERT_FALSE(stages_up.empty()) << "the stage servers were not discovered through /api/targets";
  EXPECT_EQ(std::stod(stages_up[0]["value"][1].get<std::string>()), 2);
  const json fwd = query("sum(swarm_stage_hops_total)");
  ASSERT_FALSE(fwd.empty());
  EXPECT_GT(std::stod(fwd[0]["value"][1].get<std::string>()), 0);
  prom.stop();
  local.stop();
}

TEST(Observability, TheDashboardShowsTheSwarmInABrowserAndAKilledPeerLeavesIt) {
  if (!have("chromium")) GTEST_SKIP() << "chromium not found: install Debian's chromium package (tools/install-deps.sh)";
  if (!have("python3")) GTEST_SKIP() << "python3 not found (it drives Chromium over the DevTools protocol)";
  const std::string dir = temp_dir();
  const std::string data = write_text(dir);
  const std::string out = output_dir("Observability.Dashboard");
  LocalSwarm swarm(dir, kBuild);
  swarm.start_router({"--http", "127.0.0.1:0"});
  const char* names[] = {"s0-a", "s0-b", "s1-a", "s1-b"};
  for (int i = 0; i < 4; ++i) swarm.start_stage(i / 2, names[i], 1, i == 3 ? std::vector<std::string>{"--emulate", "2"} : std::vector<std::string>{});
  Client c(swarm.router_endpoint());
  wait_for_peers(c, 4);
  json spec = tiny_job(data, 2, 4000, "async");   // long enough to outlast the test; stopped with the swarm
  spec["diloco"]["inner_steps"] = 20;             // rounds and evaluations on the timeline, not a flood of them
  spec["eval"] = {{"every_steps", 20}, {"batches", 2}};
  submit(c, spec);
  // s0-b (index 1) is killed once the page shows every stage with its peers and two loss points.
  const auto [rc, report] = run("timeout 150 python3 " + kSource + "/tests/integration/dashboard_check.py --url " + swarm.http_url() +
                                "/ --out " + out + " --stages 2 --kill-pid " + std::to_string(swarm.stages()[1].pid) +
                                " --kill-name s0-b --timeout 120");
  EXPECT_EQ(rc, 0) << report;
  EXPECT_TRUE(std::filesystem::exists(out + "/dashboard.png")) << report;
  EXPECT_TRUE(std::filesystem::exists(out + "/dashboard-after-kill.png")) << report;
  std::cout << report;
}

// `swarm bench router` with short windows: the real router process with 100 and then 1,000
// peers (sockets of the bench's process answering as simulated stage servers), idle and then
// training. The router takes every peer, loses nothing, and its /metrics counters account for
// the traffic: heartbeats at the peers' pace while idle, more while training, part of its CPU in
// the core.
TEST(Observability, ARouterOfAThousandPeersCountsItsMessagesAndLosesNothing) {
  auto [rc, out] = run("SWARM_ROUTER_BENCH_S=2 " + kBuild + "/swarm bench router --json");
  ASSERT_EQ(rc, 0) << out;
  std::map<int, json> cases;
  json summary;
  std::istringstream lines(out);
  for (std::string l; std::getline(lines, l);) {
    const json j = json::parse(l, nullptr, false);
    if (j.is_object() && j.contains("peers")) cases[j["peers"].get<int>()] = j;
    if (j.is_object() && j.contains("figures")) summary = j;
  }
  ASSERT_EQ(cases.size(), 2u) << out;
  for (const auto& [n, c] : cases) {
    SCOPED_TRACE("peers " + std::to_string(n));
    EXPECT_EQ(c["state"], "running") << c.dump();
    EXPECT_EQ(c["microbatches"]["lost"], 0) << c.dump();
    // Idle: every peer heartbeats every 500 ms (about 2 N a second in), the router as many out.
    const json& idle = c["idle"];
    EXPECT_GT(idle["in_per_s"].get<double>(), 1.0 * n) << idle.dump();
    EXPECT_LT(idle["in_per_s"].get<double>(), 3.0 * n) << idle.dump();
    const json& tr = c["training"];
    EXPECT_GT(tr["microbatches_per_s"].get<double>(), 0) << tr.dump();
    EXPECT_GT(tr["messages_per_s"].get<double>(), idle["messages_per_s"].get<double>()) << tr.dump();
    EXPECT_GT(tr["core_share"].get<double>(), 0) << tr.dump();
    EXPECT_LT(tr["core_share"].get<double>(), 1) << tr.dump();
  }
  ASSERT_TRUE(summary.contains("figures")) << out;
  EXPECT_GT(summary["figures"]["router_us_per_message_1000"]["value"].get<double>(), 0);
  EXPECT_GT(summary["figures"]["router_vs_core_1000"]["value"].get<double>(), 1);
}
