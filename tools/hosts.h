// hosts.h: test hosts on this one machine, made of Linux network namespaces.
//
// Defines swarm::Hosts: N hosts, each a network namespace `swarm-<tag>-<i>` with its own
// address in a private /24 and one veth link into a bridge in the root namespace; every link
// optionally rate-limited by `tc ... tbf` in both directions (egress of the host's end and of
// the bridge's end, so traffic into a host is shaped too). It runs commands inside a host,
// cuts and restores a host's link, reads a host's link byte counters, and removes everything
// it made in its destructor, or, when the process dies any other way (SIGINT, SIGTERM,
// SIGKILL, a crash), from a small janitor process that outlives it. Creating a set also sweeps
// namespaces and links left by dead processes. `HostsUnavailable` says why hosts cannot be
// made here (not root, no `ip`, no tbf); callers skip. docs/hosts.md has the layout.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace swarm {

// Hosts cannot be made on this machine; what() says why and what would fix it.
class HostsUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct HostsOptions {
  int count = 1;          // hosts, 1..250
  double rate_mbit = 0;   // tbf rate of every link, each direction [Mbit/s]; 0: unshaped
  double latency_ms = 50; // tbf queue: at most this long a packet waits for tokens (then dropped)
};

// Bytes through a host's link since it was made, from the host's side (Ethernet frames).
struct LinkBytes {
  uint64_t sent = 0;
  uint64_t received = 0;
  uint64_t total() const { return sent + received; }
};

class Hosts {
 public:
  // Throws InputError for bad options, HostsUnavailable when this machine cannot make hosts.
  explicit Hosts(const HostsOptions& opt);
  ~Hosts();
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  // "" when hosts can be made here (root, `ip`, namespaces, veth, bridge and tbf work, checked
  // by making one shaped host and removing it), else why not.
  static std::string probe();
  // Removes `swarm-*` namespaces and links whose owner process is dead; returns how many.
  static int sweep_stale();

  size_t size() const { return hosts_.size(); }
  const std::string& tag() const { return tag_; }
  const std::string& ns(size_t i) const { return hosts_.at(i).ns; }
  const std::string& address(size_t i) const { return hosts_.at(i).address; }  // e.g. 10.163.12.3
  // The root namespace's own address on the bridge: how this process reaches the hosts.
  const std::string& root_address() const { return root_address_; }
  const std::string& link(size_t i) const { return hosts_.at(i).link; }        // the bridge-side veth
  // The argv prefix that runs a program inside host i: {"/usr/sbin/ip", "netns", "exec", ns}.
  std::vector<std::string> exec_prefix(size_t i) const;
  // Runs argv inside host i and waits; returns (exit status, stdout and stderr).
  std::pair<int, std::string> run(size_t i, const std::vector<std::string>& argv) const;

  void cut(size_t i);      // the host's link down: nothing in or out, its processes keep running
  void restore(size_t i);  // the link up again
  bool is_cut(size_t i) const { return hosts_.at(i).cut; }
  LinkBytes bytes(size_t i) const;
  // The root namespace's own traffic with the hosts (the bridge's counters): `sent` is what
  // this machine's processes outside the hosts sent them.
  LinkBytes root_bytes() const;

 private:
  struct Host {
    std::string ns, address, link;
    bool cut = false;
  };
  void remove_all() noexcept;
  std::string tag_, bridge_, root_address_;
  std::vector<Host> hosts_;
  pid_t janitor_ = -1;
  int janitor_fd_ = -1;    // write end of the janitor's pipe: "done" or EOF
};

}  // namespace swarm
