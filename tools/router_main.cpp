// router_main.cpp: swarm-router, one per swarm (see router/server.h and README's CLI section).
#include <csignal>
#include <cstdio>

#include <CLI/CLI.hpp>

#include "router/server.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }
}  // namespace

int main(int argc, char** argv) {
  swarm::router::ServerOptions opt;
  CLI::App app{"swarm-router: registers stage servers and drives training jobs through them"};
  app.add_option("--bind", opt.bind, "ZeroMQ endpoint to listen on (tcp://127.0.0.1:* picks a free port)")->capture_default_str();
  app.add_option("--heartbeat-ms", opt.core.heartbeat_ms, "peer heartbeat interval")->capture_default_str()->check(CLI::Range(10, 60000));
  app.add_option("--liveness", opt.core.liveness, "heartbeats missed before a peer is declared dead")->capture_default_str()->check(CLI::Range(1, 100));
  app.add_option("--ready-file", opt.ready_file,
                 "write the bound endpoint to this file once listening (with --http, the HTTP URL on a second line)");
  app.add_option("--http", opt.http,
                 "serve /metrics (Prometheus), /api/status, /api/peers, /api/events and the dashboard on HOST:PORT, e.g. "
                 "0.0.0.0:9090 or 127.0.0.1:0 for a free port (default: off)");
  std::string log_format = "text";
  app.add_option("--log-format", log_format, "text (for people) or json (one object per line, for log collectors)")
      ->capture_default_str();
  app.add_option("--state-dir", opt.core.state_dir,
                 "keep jobs and their checkpoints here; a restarted router continues unfinished jobs from it");
  app.add_option("--quarantine-after", opt.core.quarantine_after,
                 "integrity failures (corrupt, misshapen or non-finite outputs) before a peer is quarantined")
      ->capture_default_str()->check(CLI::Range(1, 1000000));
  app.add_option("--max-data-bytes", opt.max_data_bytes, "the most bytes of data files one job may load")
      ->capture_default_str()->check(CLI::Range(uint64_t(1), uint64_t(1) << 40));
  app.add_option("--max-peers", opt.core.max_peers, "stage servers registered at once")
      ->capture_default_str()->check(CLI::Range(size_t(1), size_t(1) << 20));
  app.add_option("--key", opt.key_file, "the router's keypair (`swarm keygen --out router` makes router.key); turns CURVE on");
  app.add_option("--authorized", opt.authorized_file,
                 "the keys allowed in, a line each: PUBLIC_KEY ROLE NAME (ROLE: stage, client or admin); see docs/security.md");
  app.add_flag("--insecure", opt.insecure, "listen on a non-loopback address without keys (a network you trust completely)");
  app.add_option("--data-root", opt.data_roots,
                 "a directory jobs may read data and --resume checkpoints from (repeatable); without one, jobs from other hosts read nothing");
  CLI11_PARSE(app, argc, argv);
  try {
    swarm::set_log_format(swarm::parse_log_format(log_format));
  } catch (const swarm::InputError& e) {
    std::fprintf(stderr, "--log-format: %s\n", e.what());
    return 2;
  }
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  try {
    swarm::router::Server server(opt);
    server.run(g_stop);
  } catch (const swarm::InputError& e) {
    swarm::log_error("router", e.what());   // a bad --http or --bind: say so, exit 2
    return 2;
  } catch (const std::exception& e) {
    swarm::log_error("router", e.what());
    return 1;
  }
  return 0;
}
