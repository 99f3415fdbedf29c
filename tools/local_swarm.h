// local_swarm.h: a whole swarm on this machine, as real processes on loopback.
//
// Defines swarm::LocalSwarm (starts swarm-router and swarm-stage processes from the same
// build directory as the running binary, logs each to a file, and stops every one of them,
// SIGTERM then SIGKILL, when destroyed; children also die with their parent) and
// `follow_job` (polls a job's status, prints progress, returns the final status).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/client.h"

namespace swarm {

struct StageProc {
  pid_t pid = -1;
  int stage = -1;
  std::string name;
  int threads = 1;
  std::vector<std::string> extra_args;
};

class LocalSwarm {
 public:
  // log_dir: where router.log and <name>.log go (created if missing); bin_dir: where
  // swarm-router and swarm-stage are (default: beside the running executable).
  explicit LocalSwarm(std::string log_dir, std::string bin_dir = "");
  ~LocalSwarm();
  LocalSwarm(const LocalSwarm&) = delete;
  LocalSwarm& operator=(const LocalSwarm&) = delete;

  // Starts the router on a free loopback port and waits until it listens.
  void start_router(const std::vector<std::string>& extra_args = {});
  // Starts one stage server; returns its index in stages().
  size_t start_stage(int stage, const std::string& name, int threads, const std::vector<std::string>& extra_args = {});
  void kill_stage(size_t i, int sig);      // SIGKILL, SIGSTOP, SIGCONT, SIGTERM
  void restart_stage(size_t i);            // start again with the same arguments
  void kill_router(int sig);
  void stop_all();

  const std::string& router_endpoint() const { return endpoint_; }
  const std::string& log_dir() const { return log_dir_; }
  std::vector<StageProc>& stages() { return stages_; }

 private:
  pid_t spawn(const std::vector<std::string>& argv, const std::string& log_name);
  std::string bin_dir_, log_dir_, endpoint_;
  pid_t router_pid_ = -1;
  std::vector<std::string> router_args_;
  std::vector<StageProc> stages_;
};

// The directory holding the running executable (where swarm-router and swarm-stage live).
std::string executable_dir();

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
