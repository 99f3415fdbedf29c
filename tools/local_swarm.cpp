// local_swarm.cpp: processes of a local swarm, and following a job (see local_swarm.h).
#include "tools/local_swarm.h"

#include <algorithm>
#include <cstdlib>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "runtime/keys.h"

namespace swarm {

using nlohmann::json;

std::string executable_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string p(buf, size_t(n));
  return p.substr(0, p.rfind('/'));
}

const LocalKeys& local_keys() {
  static LocalKeys k;
  static std::once_flag once;
  std::call_once(once, [] {
    char tmpl[] = "/tmp/swarm-keys-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("cannot make a folder for the local swarm's keys under /tmp");
    k.dir = tmpl;
    write_keypair(k.dir + "/router", generate_keypair());
    write_keypair(k.dir + "/admin", generate_keypair());
    k.router_key = k.dir + "/router.key";
    k.router_pub = k.dir + "/router.pub";
    k.admin_key = k.dir + "/admin.key";
    k.admin_pub = k.dir + "/admin.pub";
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(k.dir, ec);
    });
  });
  return k;
}

std::string LocalSwarm::add_key(const std::string& name, const std::string& role) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  std::string base = keys_dir_ + "/" + name;
  for (int n = 2; std::ifstream(base + ".key"); ++n) base = keys_dir_ + "/" + name + "." + std::to_string(n);
  const KeyPair k = generate_keypair();
  write_keypair(base, k);
  std::ofstream(keys_dir_ + "/authorized", std::ios::app) << k.public_key << " " << role << " " << name << "\n";
  return base + ".key";
}

LocalSwarm::LocalSwarm(std::string log_dir, std::string bin_dir)
    : bin_dir_(bin_dir.empty() ? executable_dir() : std::move(bin_dir)), log_dir_(std::move(log_dir)) {
  mkdir(log_dir_.c_str(), 0755);
}

LocalSwarm::~LocalSwarm() { stop_all(); }

pid_t LocalSwarm::spawn(const std::vector<std::string>& argv, const std::string& log_name) {
  const std::string log = log_dir_ + "/" + log_name;
  const pid_t parent = getpid();
  // Built before fork: the child of a multi-threaded parent (the chaos runner) should not allocate.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the swarm that started us
    if (getppid() != parent) _exit(1);
    setpgid(0, 0);                     // a terminal's Ctrl-C goes to `swarm local`, which stops us in order
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(args[0], args.data());
    std::fprintf(stderr, "cannot run %s\n", args[0]);
    _exit(127);
  }
  return pid;
}

void LocalSwarm::wait_ready(const std::string& ready, const std::string& log_name) {
  for (int i = 0; i < 200; ++i) {
    std::ifstream f(ready);
    std::string ep, url;
    if (f && std::getline(f, ep) && !ep.empty()) {
      endpoint_ = ep;
      http_url_ = std::getline(f, url) ? url : "";
      return;
    }
    int status = 0;
    if (waitpid(router_pid_, &status, WNOHANG) == router_pid_) {
      router_pid_ = -1;
      throw std::runtime_error("swarm-router exited at start; see " + log_dir_ + "/" + log_name);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error("swarm-router did not start listening within 10 s; see " + log_dir_ + "/" + log_name);
}

void LocalSwarm::start_router(const std::vector<std::string>& extra_args, const Place& where) {
  const std::string ready = log_dir_ + "/router.addr";
  unlink(ready.c_str());
  router_bind_ = "tcp://" + where.address + ":*";
  router_args_ = where.prefix;
  for (const std::string& a : {bin_dir_ + "/swarm-router", std::string("--bind"), router_bind_, std::string("--ready-file"), ready})
    router_args_.push_back(a);
  // This process's clients (tests, `swarm local` itself) talk to the router started last: as
  // its admin, or without keys.
  if (!secure_) {
    unsetenv("SWARM_KEY");
    unsetenv("SWARM_ROUTER_KEY");
  }
  if (secure_) {
    const LocalKeys& k = local_keys();
    setenv("SWARM_KEY", k.admin_key.c_str(), 1);
    setenv("SWARM_ROUTER_KEY", k.router_pub.c_str(), 1);
    keys_dir_ = log_dir_ + "/keys";
    mkdir(keys_dir_.c_str(), 0700);
    std::ofstream(keys_dir_ + "/authorized") << "# this local swarm's keys: KEY ROLE NAME\n"
                                             << read_public_key(k.admin_pub) << " admin local-admin\n";
    // What another terminal needs to talk to this swarm: `swarm --key <log_dir>/keys/admin.key
    // --router-key <log_dir>/keys/router.pub status ...`.
    std::error_code ec;
    std::filesystem::copy_file(k.admin_key, keys_dir_ + "/admin.key", std::filesystem::copy_options::overwrite_existing, ec);
    std::filesystem::copy_file(k.router_pub, keys_dir_ + "/router.pub", std::filesystem::copy_options::overwrite_existing, ec);
    chmod((keys_dir_ + "/admin.key").c_str(), 0600);
    router_args_.insert(router_args_.end(), {"--key", k.router_key, "--authorized", keys_dir_ + "/authorized"});
  }
  if (!log_format_.empty()) router_args_.insert(router_args_.end(), {"--log-format", log_format_});
  router_args_.insert(router_args_.end(), extra_args.begin(), extra_args.end());
  router_pid_ = spawn(router_args_, "router.log");
  wait_ready(ready, "router.log");
}

// The router again, on the same endpoint (peers reconnect to it on their own) and with the
// same arguments (a --state-dir among them lets it continue its jobs).
void LocalSwarm::restart_router() {
  if (router_pid_ > 0) kill_router(SIGKILL);
  std::vector<std::string> args = router_args_;
  for (auto& a : args)
    if (a == router_bind_) a = endpoint_;
  const std::string ready = log_dir_ + "/router.addr";
  unlink(ready.c_str());
  const std::string log_name = "router." + std::to_string(++router_restarts_) + ".log";
  router_pid_ = spawn(args, log_name);
  wait_ready(ready, log_name);
}

size_t LocalSwarm::start_stage(int stage, const std::string& name, int threads, const std::vector<std::string>& extra_args,
                               const Place& where) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  StageProc p;
  p.place = where;
  p.stage = stage;
  p.name = name;
  p.threads = threads;
  p.extra_args = extra_args;
  // Its own key, kept across restarts: a restarted peer is the same party.
  if (secure_ && std::find(extra_args.begin(), extra_args.end(), "--key") == extra_args.end())
    p.extra_args.insert(p.extra_args.end(), {"--key", add_key(name, "stage"), "--router-key", local_keys().router_pub});
  stages_.push_back(p);
  restart_stage(stages_.size() - 1);
  return stages_.size() - 1;
}

size_t LocalSwarm::start_command(int stage, const std::string& name, std::vector<std::string> argv) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  StageProc p;
  p.stage = stage;
  p.name = name;
  p.command = std::move(argv);
  stages_.push_back(p);
  restart_stage(stages_.size() - 1);
  return stages_.size() - 1;
}

void LocalSwarm::restart_stage(size_t i) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  StageProc& p = stages_.at(i);
  if (p.pid > 0) {
    kill(p.pid, SIGCONT);
    kill(p.pid, SIGKILL);
    waitpid(p.pid, nullptr, 0);
  }
  p.stopped = false;
  std::vector<std::string> argv = p.place.prefix;
  for (const std::string& a : {bin_dir_ + "/swarm-stage", std::string("--router"), endpoint_, std::string("--name"), p.name,
                               std::string("--threads"), std::to_string(p.threads)})
    argv.push_back(a);
  if (p.stage >= 0) {
    argv.push_back("--stage");
    argv.push_back(std::to_string(p.stage));
  }
  if (!log_format_.empty()) argv.insert(argv.end(), {"--log-format", log_format_});
  argv.insert(argv.end(), p.extra_args.begin(), p.extra_args.end());
  if (!p.command.empty()) {  // another implementation: its own arguments, nothing added
    argv = p.command;
    for (auto& a : argv)
      for (size_t at; (at = a.find("{router}")) != std::string::npos;) a.replace(at, 8, endpoint_);
    p.pid = spawn(argv, p.name + ".log");
    return;
  }
  // Peer to peer on loopback: each stage server takes other peers' fetches on a port of its own
  // (SWARM_LOCAL_HOPS=hub: none does, so every tensor goes through the router, as under
  // routing.hops "hub"; the tests run the fault scenarios both ways).
  const char* hops_env = std::getenv("SWARM_LOCAL_HOPS");
  const bool hub = hops_env && std::string(hops_env) == "hub";
  const bool own_listen = std::find(p.extra_args.begin(), p.extra_args.end(), "--listen") != p.extra_args.end() ||
                          std::find(p.extra_args.begin(), p.extra_args.end(), "--no-listen") != p.extra_args.end();
  const bool echo = std::find(p.extra_args.begin(), p.extra_args.end(), "--echo") != p.extra_args.end();
  if (!own_listen && !echo && !hub) {
    argv.push_back("--listen");
    argv.push_back("tcp://" + p.place.address + ":*");
  }
  // One host: the stage servers read the job's data where the router does, and the router
  // sends no tokens (docs/protocol.md, "Tokens at the peers").
  if (!echo && std::find(p.extra_args.begin(), p.extra_args.end(), "--data-root") == p.extra_args.end()) {
    argv.push_back("--data-root");
    argv.push_back("/");
  }
  const std::vector<std::string> faults = stage_faults_.stage_args(p.name);
  argv.insert(argv.end(), faults.begin(), faults.end());
  p.pid = spawn(argv, p.name + ".log");
}

void LocalSwarm::kill_stage(size_t i, int sig) {
  std::lock_guard<std::recursive_mutex> l(mu_);
  StageProc& p = stages_.at(i);
  if (p.pid <= 0) return;
  if (sig == SIGKILL || sig == SIGTERM) kill(p.pid, SIGCONT);  // never leave a stopped process behind
  kill(p.pid, sig);
  if (sig == SIGSTOP) p.stopped = true;
  if (sig == SIGCONT) p.stopped = false;
  if (sig == SIGKILL || sig == SIGTERM) {
    waitpid(p.pid, nullptr, 0);
    p.pid = -1;
    p.stopped = false;
  }
}

void LocalSwarm::kill_router(int sig) {
  if (router_pid_ <= 0) return;
  kill(router_pid_, sig);
  waitpid(router_pid_, nullptr, 0);
  router_pid_ = -1;
}

void LocalSwarm::stop_all() {
  stop_chaos();
  std::lock_guard<std::recursive_mutex> l(mu_);
  std::vector<pid_t> pids;
  for (auto& s : stages_)
    if (s.pid > 0) pids.push_back(s.pid);
  if (router_pid_ > 0) pids.push_back(router_pid_);
  for (pid_t p : pids) {
    kill(p, SIGCONT);  // a stopped process cannot act on SIGTERM
    kill(p, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (pid_t p : pids) {
    while (waitpid(p, nullptr, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  for (auto& s : stages_) {
    s.pid = -1;
    s.stopped = false;
  }
  router_pid_ = -1;
}

json done_event(const json& st) {
  return json{{"event", "done"},
              {"job_id", st.value("job_id", 0)},
              {"state", st.value("state", std::string())},
              {"reason", st.value("reason", std::string())},
              {"steps", st.value("step", 0)},
              {"train_loss", st.value("train_loss", json(nullptr))},
              {"val_loss", st.value("val_loss", json(nullptr))},
              {"unigram_loss", st.value("unigram_loss", json(nullptr))},
              {"tokens_per_s", st.value("tokens_per_s", 0.0)},
              {"elapsed_s", st.value("elapsed_s", 0.0)},
              {"microbatches", st.value("microbatches", json::object())},
              {"backward", st.value("backward", json::object())},
              {"wire_bytes", st.value("wire_bytes", json::object())},
              {"wire_bytes_per_sample", st.value("wire_bytes_per_sample", json::object())},
              {"codec_ms", st.value("codec_ms", json::object())},
              {"rounds", st.value("rounds", 0)},
              {"sync_bytes_per_sample", st.value("sync_bytes_per_sample", 0.0)},
              {"history", st.value("history", json::array())}};
}

namespace {
std::string fmt(const json& v, const char* f) {
  if (!v.is_number()) return "-";
  char b[64];
  std::snprintf(b, sizeof(b), f, v.get<double>());
  return b;
}
}  // namespace

json follow_job(Client& client, uint64_t job_id, const FollowOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  int last_step = -1;
  json last_val = nullptr;
  std::string last_reason;
  for (;;) {
    json st = client.request_body(wire::MsgType::kStatus, json{{"job_id", job_id}});
    const std::string state = st.value("state", std::string());
    const int step = st.value("step", 0);
    const bool final = state == "done" || state == "failed" || state == "cancelled";
    const std::string reason = st.value("reason", std::string());
    if (!opt.quiet && (step != last_step || st["val_loss"] != last_val || reason != last_reason || final)) {
      if (opt.json) {
        json ev{{"event", "progress"}, {"state", state}, {"step", step}, {"steps", st["steps"]},
                {"train_loss", st["train_loss"]}, {"val_loss", st["val_loss"]}, {"tokens_per_s", st["tokens_per_s"]},
                {"peers_per_stage", st["peers_per_stage"]}, {"reason", reason}};
        std::cout << ev.dump() << std::endl;
      } else {
        std::string peers;
        for (const auto& n : st.value("peers_per_stage", json::array())) peers += (peers.empty() ? "" : ",") + n.dump();
        std::cout << "[" << state << "] step " << step << "/" << st.value("steps", 0) << "  loss "
                  << fmt(st["train_loss"], "%.4f") << "  val " << fmt(st["val_loss"], "%.4f") << "  tok/s "
                  << fmt(st["tokens_per_s"], "%.0f") << "  peers/stage [" << peers << "]"
                  << (reason.empty() ? "" : "  (" + reason + ")") << std::endl;
      }
      last_step = step;
      last_val = st["val_loss"];
      last_reason = reason;
    }
    if (final) return st;
    if (opt.timeout_s > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > opt.timeout_s)
      throw std::runtime_error("job " + std::to_string(job_id) + " did not finish within " + std::to_string(opt.timeout_s) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(int(opt.poll_s * 1000)));
  }
}

}  // namespace swarm
