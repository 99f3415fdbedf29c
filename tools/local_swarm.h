// local_swarm.h: a whole swarm on this machine, as real processes on loopback or on
// namespaced hosts (tools/hosts.h).
//
// Defines swarm::Place (where a process runs: a command prefix that enters its host, the
// address it binds), swarm::LocalSwarm (starts swarm-router and swarm-stage processes from the
// same build directory as the running binary, logs each to a file, and stops every one of them,
// SIGTERM then SIGKILL, when destroyed; children also die with their parent; runs a chaos
// plan against them on a background thread, recording each action in ChaosRecord) and
// `follow_job` (polls a job's status, prints progress, returns the final status).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chaos_plan.h"
#include "runtime/client.h"

namespace swarm {

// Where a process runs. The default is this machine's loopback; on a namespaced host
// (tools/hosts.h) `prefix` is its Hosts::exec_prefix and `address` its Hosts::address: the
// router binds that address, a stage server listens for other peers' fetches on it.
struct Place {
  std::vector<std::string> prefix;  // prepended to the command line, e.g. {"/usr/sbin/ip", "netns", "exec", NS}
  std::string address = "127.0.0.1";
};

struct StageProc {
  pid_t pid = -1;
  int stage = -1;
  std::string name;
  int threads = 1;
  std::vector<std::string> extra_args;
  std::vector<std::string> command;  // a peer that is not swarm-stage: its argv, "{router}" replaced
  Place place;
  bool stopped = false;  // SIGSTOPped (by kill_stage or the chaos runner) and not resumed yet
};

// One thing the chaos runner did (or skipped), for logs and benchmarks.
struct ChaosRecord {
  double t_s = 0;                            // seconds after run_chaos started
  std::chrono::steady_clock::time_point at;  // when, on the steady clock
  std::string action;                        // "kill", "stop", "cont", "restart"
  std::string peer;                          // the peer's name ("" when skipped with no candidate)
  size_t index = 0;                          // the peer's index in stages()
  pid_t pid = -1;                            // the process signalled; for restart, the new one
  std::string note;                          // "event 0 #3", "resume after stop", "skipped: ..."
};
// {"event":"chaos","t_s":…,"action":…,"peer":…,"pid":…,"note":…}, for `--json` progress.
nlohmann::json to_json(const ChaosRecord& r);

class LocalSwarm {
 public:
  // log_dir: where router.log and <name>.log go (created if missing); bin_dir: where
  // swarm-router and swarm-stage are (default: beside the running executable).
  explicit LocalSwarm(std::string log_dir, std::string bin_dir = "");
  ~LocalSwarm();
  LocalSwarm(const LocalSwarm&) = delete;
  LocalSwarm& operator=(const LocalSwarm&) = delete;

  // Starts the router on a free loopback port and waits until it listens. With "--http ADDR" among
  // the arguments, http_url() is where it serves the dashboard and /metrics. Unless
  // set_secure(false) was called first, the swarm uses CURVE with throwaway keys (local_keys()):
  // the router's, one per stage server (made when it starts, listed in <log_dir>/keys/authorized)
  // and an admin key that this process's Clients use (SWARM_KEY and SWARM_ROUTER_KEY are set;
  // without CURVE they are unset: clients follow the router started last).
  // `where`: the host it runs on (tools/hosts.h; default: this one, on loopback).
  void start_router(const std::vector<std::string>& extra_args = {}, const Place& where = {});
  void set_secure(bool on) { secure_ = on; }
  bool secure() const { return secure_; }
  // A key of this swarm for a party of `role` (stage, client, admin) named `name`: made, listed
  // in the authorized file (the router picks it up within a second), and returned as the path of
  // its .key file.
  std::string add_key(const std::string& name, const std::string& role);
  // Starts one stage server at `where`, pointed at the router; unless extra_args say
  // otherwise (--listen, --no-listen, --echo) it takes other peers' fetches on a free port of
  // `where`'s address. Returns its index in stages().
  size_t start_stage(int stage, const std::string& name, int threads, const std::vector<std::string>& extra_args = {},
                     const Place& where = {});
  // Starts a stage server of another implementation (e.g. examples/python_peer): `argv` with
  // every "{router}" replaced by the router's endpoint; stopped and restarted like the others.
  size_t start_command(int stage, const std::string& name, std::vector<std::string> argv);
  void kill_stage(size_t i, int sig);      // SIGKILL, SIGSTOP, SIGCONT, SIGTERM
  void restart_stage(size_t i);            // start again with the same arguments
  void kill_router(int sig);
  void restart_router();                   // same endpoint, same arguments
  void stop_all();                         // stops the chaos runner first

  // Chaos (runtime/chaos_plan.h). Stage servers started after set_stage_faults whose name has
  // faults in the plan get its --fault/--fault-seed arguments (restarts too).
  void set_stage_faults(const ChaosPlan& plan);
  // Runs the plan's events on a background thread; time 0 is now. Throws InputError when the
  // plan names a peer that is not in stages(). `on_event`, if given, is called from that thread
  // after each action. A SIGSTOPped peer always gets SIGCONT before a SIGKILL.
  void run_chaos(const ChaosPlan& plan, std::function<void(const ChaosRecord&)> on_event = {});
  void stop_chaos();                       // stops and joins the runner; peers stay as they are
  std::vector<ChaosRecord> chaos_log() const;

  const std::string& router_endpoint() const { return endpoint_; }
  const std::string& http_url() const { return http_url_; }   // "" unless the router serves HTTP
  // --log-format for the router and the stage servers started from now on ("" leaves their default).
  void set_log_format(const std::string& format) { log_format_ = format; }
  pid_t router_pid() const { return router_pid_; }
  const std::string& log_dir() const { return log_dir_; }
  std::vector<StageProc>& stages() { return stages_; }

 private:
  pid_t spawn(const std::vector<std::string>& argv, const std::string& log_name);
  std::string bin_dir_, log_dir_, endpoint_, http_url_, log_format_;
  bool secure_ = true;
  std::string keys_dir_;                   // <log_dir>/keys: stage keys and the authorized file
  // Waits for the router's ready file: its endpoint, and its HTTP URL when it serves one.
  void wait_ready(const std::string& ready, const std::string& log_name);
  std::string router_bind_;                // tcp://ADDRESS:*, replaced by endpoint_ on a restart
  pid_t router_pid_ = -1;
  int router_restarts_ = 0;
  std::vector<std::string> router_args_;
  std::vector<StageProc> stages_;
  std::recursive_mutex mu_;                // stages_' processes: the chaos thread changes them too
  ChaosPlan stage_faults_;                 // per-peer --fault arguments (set_stage_faults)
  // The chaos runner (tools/local_chaos.cpp).
  void chaos_loop(ChaosPlan plan, std::function<void(const ChaosRecord&)> on_event);
  bool running_locked(size_t i);           // alive and not stopped; reaps a peer that exited
  // Firing k of event `event`: picks the peer and acts; fills rec's peer, index, pid, note.
  void chaos_fire(const ChaosPlan& plan, size_t event, uint64_t k, ChaosRecord& rec);
  // The SIGCONT of a timed stop (resume) or the restart of a kill, if the peer is as it was left.
  void chaos_follow_up(bool resume, size_t peer, pid_t pid, ChaosRecord& rec);
  std::thread chaos_;
  mutable std::mutex chaos_mu_;            // guards chaos_stop_ and chaos_log_
  std::condition_variable chaos_cv_;
  bool chaos_stop_ = false;
  std::vector<ChaosRecord> chaos_log_;
};

// The directory holding the running executable (where swarm-router and swarm-stage live).
std::string executable_dir();

// This process's throwaway router and admin keys for local swarms (a private folder under /tmp,
// made on first use; every LocalSwarm of the process shares them).
struct LocalKeys {
  std::string dir, router_key, router_pub, admin_key, admin_pub;
};
const LocalKeys& local_keys();

struct FollowOptions {
  bool json = false;     // one JSON object per line instead of readable lines
  bool quiet = false;    // print nothing but errors
  double poll_s = 0.5;
  double timeout_s = 0;  // 0: no limit
};

// Polls the job until it is done, failed or cancelled; prints progress; returns the last
// status (with "event":"done" fields added when json).
nlohmann::json follow_job(Client& client, uint64_t job_id, const FollowOptions& opt);

// The `{"event":"done", ...}` summary of a final status.
nlohmann::json done_event(const nlohmann::json& status);

}  // namespace swarm
