// hosts.cpp: namespaced test hosts (see hosts.h).
//
// Layout of one set, tag T = "<pid>.<seq>", short id S = base36(pid) + base36(seq):
//   root namespace:  bridge swS-br (10.A.B.254/24), links swS-h<i> (the bridge's end of host i)
//   host i:          namespace swarm-T-<i>, eth0 = 10.A.B.<i+1>/24, lo up
// The /24 is picked from 10.128.0.0/10 starting at a point the pid chooses, skipping any that
// overlaps an address or route of the root namespace (another set's bridge among them), under
// a file lock so that two processes never pick the same one. The bridge and its links carry
// the alias "swarm-hosts:<pid>", which is how a later set finds what a dead process left.
#include "tools/hosts.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <sstream>

#include "runtime/errors.h"

namespace swarm {

namespace {

constexpr int kMaxHosts = 250;           // .1 … .250 of one /24; .254 is the root's
constexpr const char* kAlias = "swarm-hosts:";

std::string find_tool(const char* name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string p = std::string(dir) + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

const std::string& ip_tool() {
  static const std::string p = find_tool("ip");
  return p;
}
const std::string& tc_tool() {
  static const std::string p = find_tool("tc");
  return p;
}

// Runs argv (argv[0] a path) and waits; returns (exit status or -1, stdout + stderr).
std::pair<int, std::string> run_argv(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return {-1, "pipe: " + std::string(strerror(errno))};
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return {-1, "fork: " + std::string(strerror(errno))};
  }
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  std::array<char, 4096> buf;
  for (;;) {
    const ssize_t n = read(fds[0], buf.data(), buf.size());
    if (n > 0) out.append(buf.data(), size_t(n));
    else if (n == 0 || errno != EINTR) break;
  }
  close(fds[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string joined(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Runs a setup command; a failure means this machine cannot make hosts.
void must(const std::vector<std::string>& argv) {
  auto [rc, out] = run_argv(argv);
  if (rc != 0) {
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    throw HostsUnavailable("cannot make hosts: `" + joined(argv) + "` failed (" + std::to_string(rc) + "): " + out);
  }
}

bool process_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

std::string base36(uint64_t v) {
  const char* digits = "0123456789abcdefghijklmnopqrstuvwxyz";
  std::string s;
  do {
    s.insert(s.begin(), digits[v % 36]);
    v /= 36;
  } while (v);
  return s;
}

// A whole-machine lock around picking subnets and sweeping: held for the life of the object.
class FileLock {
 public:
  FileLock() {
    for (const char* p : {"/run/lock/swarm-hosts.lock", "/tmp/swarm-hosts.lock"}) {
      fd_ = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (fd_ >= 0) break;
    }
    if (fd_ >= 0)
      while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {}
  }
  ~FileLock() {
    if (fd_ >= 0) close(fd_);  // releases the lock
  }

 private:
  int fd_ = -1;
};

// An IPv4 prefix: network address (host order) and length.
struct Prefix {
  uint32_t net = 0;
  int len = 0;
};
bool parse_prefix(const std::string& text, Prefix& p) {
  unsigned a, b, c, d;
  int len = 32;
  char slash = 0;
  const int n = std::sscanf(text.c_str(), "%u.%u.%u.%u%c%d", &a, &b, &c, &d, &slash, &len);
  if (n < 4 || a > 255 || b > 255 || c > 255 || d > 255 || (n == 6 && (slash != '/' || len < 0 || len > 32))) return false;
  const uint32_t mask = len == 0 ? 0 : ~uint32_t(0) << (32 - len);
  p.net = ((a << 24) | (b << 16) | (c << 8) | d) & mask;
  p.len = len;
  return true;
}
bool overlaps(const Prefix& x, const Prefix& y) {
  const int len = std::min(x.len, y.len);
  const uint32_t mask = len == 0 ? 0 : ~uint32_t(0) << (32 - len);
  return (x.net & mask) == (y.net & mask);
}

// Every IPv4 prefix the root namespace has an address or a route in (the default route aside).
std::vector<Prefix> root_prefixes() {
  std::vector<Prefix> out;
  auto [rc1, addrs] = run_argv({ip_tool(), "-o", "-4", "addr", "show"});
  std::istringstream a(addrs);
  for (std::string line; std::getline(a, line);) {
    std::istringstream w(line);
    std::string tok, prev;
    while (w >> tok) {
      Prefix p;
      if (prev == "inet" && parse_prefix(tok, p)) out.push_back(p);
      prev = tok;
    }
  }
  auto [rc2, routes] = run_argv({ip_tool(), "-o", "-4", "route", "show", "table", "all"});
  std::istringstream r(routes);
  for (std::string line; std::getline(r, line);) {
    std::istringstream w(line);
    std::string tok;
    w >> tok;
    if (tok == "broadcast" || tok == "local" || tok == "unicast" || tok == "multicast") w >> tok;
    Prefix p;
    if (tok != "default" && parse_prefix(tok, p)) out.push_back(p);
  }
  return out;
}

// 10.A.B.0/24 with A in 128..191: 16384 candidates, tried from a point the pid picks.
std::string pick_subnet(uint64_t start) {
  const std::vector<Prefix> used = root_prefixes();
  for (uint64_t k = 0; k < 16384; ++k) {
    const uint64_t c = (start + k) % 16384;
    const std::string base = "10." + std::to_string(128 + c / 256) + "." + std::to_string(c % 256);
    Prefix cand;
    parse_prefix(base + ".0/24", cand);
    bool free = true;
    for (const Prefix& u : used) free &= !overlaps(cand, u);
    if (free) return base;
  }
  throw HostsUnavailable("cannot make hosts: every /24 of 10.128.0.0/10 overlaps an address or route of this machine");
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::atomic<int> g_sets{0};

}  // namespace

int Hosts::sweep_stale() {
  if (ip_tool().empty()) return 0;
  int removed = 0;
  // Links first (a veth's removal takes its namespace end with it), then namespaces, then bridges.
  std::vector<std::string> bridges;
  if (DIR* d = opendir("/sys/class/net")) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      const std::string alias = read_line("/sys/class/net/" + name + "/ifalias");
      if (alias.rfind(kAlias, 0) != 0) continue;
      const pid_t owner = pid_t(std::atol(alias.c_str() + std::strlen(kAlias)));
      if (process_alive(owner)) continue;
      if (access(("/sys/class/net/" + name + "/bridge").c_str(), F_OK) == 0) bridges.push_back(name);
      else removed += run_argv({ip_tool(), "link", "del", name}).first == 0;
    }
    closedir(d);
  }
  auto [rc, list] = run_argv({ip_tool(), "netns", "list"});
  std::istringstream in(list);
  for (std::string line; std::getline(in, line);) {
    const std::string ns = line.substr(0, line.find(' '));
    if (ns.rfind("swarm-", 0) != 0 || ns.size() < 7 || !std::isdigit(static_cast<unsigned char>(ns[6]))) continue;
    const pid_t owner = pid_t(std::atol(ns.c_str() + 6));
    if (process_alive(owner)) continue;
    removed += run_argv({ip_tool(), "netns", "del", ns}).first == 0;
  }
  for (const auto& b : bridges) removed += run_argv({ip_tool(), "link", "del", b}).first == 0;
  return removed;
}

std::string Hosts::probe() {
  if (geteuid() != 0) return "not root: network namespaces, veth links and tc need CAP_NET_ADMIN (run as root)";
  if (ip_tool().empty()) return "no `ip` command (install iproute2: tools/install-deps.sh)";
  if (tc_tool().empty()) return "no `tc` command (install iproute2: tools/install-deps.sh)";
  try {
    HostsOptions o;
    o.count = 1;
    o.rate_mbit = 100;
    Hosts h(o);
  } catch (const HostsUnavailable& e) {
    return e.what();
  }
  return "";
}

Hosts::Hosts(const HostsOptions& opt) {
  if (opt.count < 1 || opt.count > kMaxHosts)
    throw InputError("hosts: count " + std::to_string(opt.count) + " is out of range; give 1 to " + std::to_string(kMaxHosts));
  if (!(opt.rate_mbit >= 0) || !std::isfinite(opt.rate_mbit))
    throw InputError("hosts: rate_mbit must be a finite number >= 0 (0: unshaped)");
  if (opt.rate_mbit > 0 && !(opt.latency_ms > 0 && opt.latency_ms <= 10000))
    throw InputError("hosts: latency_ms must be in (0, 10000]");
  if (geteuid() != 0) throw HostsUnavailable("not root: network namespaces, veth links and tc need CAP_NET_ADMIN (run as root)");
  if (ip_tool().empty()) throw HostsUnavailable("no `ip` command (install iproute2: tools/install-deps.sh)");
  if (opt.rate_mbit > 0 && tc_tool().empty()) throw HostsUnavailable("no `tc` command (install iproute2: tools/install-deps.sh)");

  const pid_t pid = getpid();
  const int seq = g_sets.fetch_add(1);
  tag_ = std::to_string(pid) + "." + std::to_string(seq);
  const std::string short_id = base36(uint64_t(pid)) + base36(uint64_t(seq % 1296));  // <= 5 + 2 characters
  bridge_ = "sw" + short_id + "-br";                                                   // <= 12 of IFNAMSIZ's 15
  for (int i = 0; i < opt.count; ++i) {
    Host h;
    h.ns = "swarm-" + tag_ + "-" + std::to_string(i);
    h.link = "sw" + short_id + "-h" + std::to_string(i);
    hosts_.push_back(h);
  }

  // The janitor: a shell in its own session that ignores signals and waits on a pipe; EOF
  // without "done" (this process died without its destructor) makes it remove everything.
  std::string script = "trap '' INT TERM HUP; read -r line; [ \"$line\" = done ] && exit 0\n";
  for (const auto& h : hosts_) script += ip_tool() + " link del " + h.link + " 2>/dev/null\n";
  for (const auto& h : hosts_) script += ip_tool() + " netns del " + h.ns + " 2>/dev/null\n";
  script += ip_tool() + " link del " + bridge_ + " 2>/dev/null\nexit 0\n";
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw HostsUnavailable("cannot make hosts: pipe: " + std::string(strerror(errno)));
  const char* sh_argv[] = {"/bin/sh", "-c", script.c_str(), nullptr};
  janitor_ = fork();
  if (janitor_ < 0) {
    close(fds[0]);
    close(fds[1]);
    throw HostsUnavailable("cannot make hosts: fork: " + std::string(strerror(errno)));
  }
  if (janitor_ == 0) {
    setsid();  // a terminal's Ctrl-C reaches the process group it left
    dup2(fds[0], 0);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
      dup2(null, 1);
      dup2(null, 2);
    }
    execv(sh_argv[0], const_cast<char**>(sh_argv));
    _exit(127);
  }
  close(fds[0]);
  janitor_fd_ = fds[1];

  try {
    FileLock lock;
    sweep_stale();
    const std::string base = pick_subnet(uint64_t(pid) * 7 + uint64_t(seq) * 131);
    root_address_ = base + ".254";
    const std::string alias = kAlias + std::to_string(pid);
    must({ip_tool(), "link", "add", bridge_, "type", "bridge", "forward_delay", "0"});
    must({ip_tool(), "link", "set", bridge_, "alias", alias});
    must({ip_tool(), "addr", "add", root_address_ + "/24", "dev", bridge_});
    must({ip_tool(), "link", "set", bridge_, "up"});
    // tbf: `burst` bytes of tokens (10 ms at the rate, at least 32 KiB so that one GSO packet
    // of a veth fits without splitting); a packet waits at most `latency` for tokens.
    const uint64_t rate_bit = uint64_t(std::llround(opt.rate_mbit * 1e6));
    const uint64_t burst = std::max<uint64_t>(32768, rate_bit / 8 / 100);
    const std::vector<std::string> tbf = {"root", "tbf", "rate", std::to_string(rate_bit) + "bit", "burst", std::to_string(burst),
                                          "latency", std::to_string(opt.latency_ms) + "ms"};
    for (size_t i = 0; i < hosts_.size(); ++i) {
      Host& h = hosts_[i];
      h.address = base + "." + std::to_string(i + 1);
      must({ip_tool(), "netns", "add", h.ns});
      must({ip_tool(), "link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.ns});
      must({ip_tool(), "link", "set", h.link, "alias", alias});
      must({ip_tool(), "link", "set", h.link, "master", bridge_, "up"});
      must({ip_tool(), "-n", h.ns, "addr", "add", h.address + "/24", "dev", "eth0"});
      must({ip_tool(), "-n", h.ns, "link", "set", "eth0", "up"});
      must({ip_tool(), "-n", h.ns, "link", "set", "lo", "up"});
      if (rate_bit > 0) {
        std::vector<std::string> in = {tc_tool(), "qdisc", "add", "dev", h.link};  // into the host
        in.insert(in.end(), tbf.begin(), tbf.end());
        must(in);
        std::vector<std::string> out = {tc_tool(), "-n", h.ns, "qdisc", "add", "dev", "eth0"};  // out of it
        out.insert(out.end(), tbf.begin(), tbf.end());
        must(out);
      }
    }
  } catch (...) {
    remove_all();
    throw;
  }
}

Hosts::~Hosts() { remove_all(); }

void Hosts::remove_all() noexcept {
  try {
    for (const auto& h : hosts_) run_argv({ip_tool(), "link", "del", h.link});
    for (const auto& h : hosts_) run_argv({ip_tool(), "netns", "del", h.ns});
    if (!bridge_.empty()) run_argv({ip_tool(), "link", "del", bridge_});
  } catch (...) {
  }
  hosts_.clear();
  bridge_.clear();
  if (janitor_fd_ >= 0) {
    const char done[] = "done\n";
    (void)!write(janitor_fd_, done, sizeof(done) - 1);
    close(janitor_fd_);
    janitor_fd_ = -1;
  }
  if (janitor_ > 0) {
    while (waitpid(janitor_, nullptr, 0) < 0 && errno == EINTR) {}
    janitor_ = -1;
  }
}

std::vector<std::string> Hosts::exec_prefix(size_t i) const { return {ip_tool(), "netns", "exec", ns(i)}; }

std::pair<int, std::string> Hosts::run(size_t i, const std::vector<std::string>& argv) const {
  std::vector<std::string> full = exec_prefix(i);
  full.insert(full.end(), argv.begin(), argv.end());
  return run_argv(full);
}

void Hosts::cut(size_t i) {
  Host& h = hosts_.at(i);
  auto [rc, out] = run_argv({ip_tool(), "link", "set", h.link, "down"});
  if (rc != 0) throw std::runtime_error("hosts: cannot cut " + h.ns + "'s link: " + out);
  h.cut = true;
}

void Hosts::restore(size_t i) {
  Host& h = hosts_.at(i);
  auto [rc, out] = run_argv({ip_tool(), "link", "set", h.link, "up"});
  if (rc != 0) throw std::runtime_error("hosts: cannot restore " + h.ns + "'s link: " + out);
  h.cut = false;
}

LinkBytes Hosts::bytes(size_t i) const {
  const std::string dir = "/sys/class/net/" + hosts_.at(i).link + "/statistics/";
  LinkBytes b;
  // The bridge's end: what it receives the host sent, what it transmits the host received.
  b.sent = std::strtoull(read_line(dir + "rx_bytes").c_str(), nullptr, 10);
  b.received = std::strtoull(read_line(dir + "tx_bytes").c_str(), nullptr, 10);
  return b;
}

LinkBytes Hosts::root_bytes() const {
  const std::string dir = "/sys/class/net/" + bridge_ + "/statistics/";
  LinkBytes b;
  b.sent = std::strtoull(read_line(dir + "tx_bytes").c_str(), nullptr, 10);
  b.received = std::strtoull(read_line(dir + "rx_bytes").c_str(), nullptr, 10);
  return b;
}

}  // namespace swarm
