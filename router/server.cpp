// server.cpp: implements router/server.h: the socket loop, the clock, the disk thread, and the
// pages published for the HTTP server.
#include "router/server.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <variant>

#include "router/dashboard.h"
#include "router/http_pages.h"
#include <sys/stat.h>

#include "runtime/fs.h"
#include "runtime/http.h"
#include "runtime/limits.h"
#include "runtime/parts.h"
#include "runtime/text.h"

namespace swarm::router {

namespace {

using Clock = std::chrono::steady_clock;

// Reads <state dir>/jobs/*/job.json; a file that does not parse is logged and skipped.
std::vector<StoredJob> read_state_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<StoredJob> out;
  if (dir.empty()) return out;
  std::error_code ec;
  fs::create_directories(dir + "/jobs", ec);
  for (const auto& e : fs::directory_iterator(dir + "/jobs", ec)) {
    const std::string path = (e.path() / "job.json").string();
    if (!fs::is_regular_file(path, ec)) continue;
    try {
      const nlohmann::json j = read_json_file("job record", path);
      StoredJob s;
      s.id = j.at("id").get<uint64_t>();
      s.state = j.at("state").get<std::string>();
      s.spec = j.at("spec");
      s.checkpoint_dir = j.value("checkpoint_dir", std::string());
      out.push_back(std::move(s));
    } catch (const std::exception& ex) {
      log_warn("router", "ignoring " + path + ": " + ex.what());
    }
  }
  return out;
}

std::string canonical(const std::string& p) {
  std::error_code ec;
  std::filesystem::path c = std::filesystem::weakly_canonical(std::filesystem::absolute(p, ec), ec);
  return ec ? std::string() : c.lexically_normal().string();
}

}  // namespace

std::string outside_roots(const std::string& path, const std::vector<std::string>& roots, const std::string& what) {
  const std::string c = canonical(path);
  for (const std::string& r : roots) {
    std::string root = canonical(r);
    if (root.empty() || c.empty()) continue;
    if (root.back() != '/') root += '/';
    if (c == root.substr(0, root.size() - 1) || c.rfind(root, 0) == 0) return "";
  }
  if (roots.empty())
    return what + " \"" + path + "\": this router reads no files for jobs from other hosts; start it with --data-root DIR and put the files there";
  std::string list;
  for (const std::string& r : roots) list += (list.empty() ? "" : ", ") + r;
  return what + " \"" + path + "\" is outside the router's allowed directories (" + list + "); move the file there or ask the router's operator";
}

bool loopback_bind(const std::string& bind) {
  if (bind.rfind("ipc://", 0) == 0 || bind.rfind("inproc://", 0) == 0) return true;
  for (const char* host : {"tcp://127.", "tcp://localhost:", "tcp://[::1]:"})
    if (bind.rfind(host, 0) == 0) return true;
  return false;
}

struct Server::Impl {
  ServerOptions opt;
  zmq::context_t ctx{1};
  // CURVE: the keys allowed in (by Z85 key) and the handler that admits them; null without keys.
  std::map<std::string, Authorized> authorized;   // guarded by auth_mu: the ZAP thread reads it
  mutable std::mutex auth_mu;
  std::mutex reload_mu;                           // held by whichever thread reloads the file (it alone writes authorized)
  std::string auth_stamp;                         // the authorized file's mtime and size when read; guarded by reload_mu
  double auth_checked_s = 0;
  std::unique_ptr<ZapHandler> zap;
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  std::string endpoint;
  wire::PartJoiner parts;   // messages that come in PARTs, by sender
  double parts_expired_s = 0;
  RouterCore core;
  const Clock::time_point t0 = Clock::now();

  // The disk thread: loads, records and checkpoints, in order; a record replaced before it was
  // written is written once, with its newest content.
  using DiskWork = std::variant<LoadJob, WriteFile, WriteCheckpoint>;
  using DiskResult = std::variant<JobLoaded, CheckpointWritten>;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<DiskWork> work;
  std::map<std::string, std::string> latest;   // WriteFile: path -> newest content not yet written
  std::deque<DiskResult> results;
  bool disk_stop = false;
  std::thread disk;

  // --http: the pages the loop publishes, and the server that serves them (destroyed first).
  http::Publisher pages;
  ServerCounters counters;   // messages in and out, time in the core: /metrics
  std::unique_ptr<http::Server> http_server;

  explicit Impl(ServerOptions o) : opt(std::move(o)), core(opt.core) {
    if (opt.key_file.empty() != opt.authorized_file.empty())
      throw InputError("give --key and --authorized together (the router's keypair and the keys it lets in), or neither");
    if (opt.key_file.empty() && !opt.insecure && !loopback_bind(opt.bind))
      throw InputError("refusing to listen on " + opt.bind + " without keys: anyone who reaches it could join, read the training data "
                       "and run jobs. Make keys with `swarm keygen --out router` (and one per stage server and user), list the "
                       "public ones in an authorized file, and pass --key router.key --authorized FILE; or pass --insecure on a "
                       "network you trust (docs/security.md)");
    sock.set(zmq::sockopt::router_mandatory, 1);
    if (!opt.key_file.empty()) {
      const KeyPair own = read_keypair(opt.key_file);
      reload_authorized();
      zap = std::make_unique<ZapHandler>(ctx, [this](const std::string& key, const std::string&) -> std::optional<Identity> {
        // A key not let in may have been added since the last check: a stage server started
        // right after its key was added would otherwise be refused, its HELLO lost with the
        // connection, and it would say HELLO again only once the router had been silent for its
        // liveness window.
        if (std::optional<Identity> who = identity_of(key)) return who;
        try {
          reload_authorized();
        } catch (const InputError& e) {
          log_warn("router", e.what());   // the loop's own check says so too, and stops the router
        }
        return identity_of(key);
      });
      curve_server(sock, own, "swarm");
      // No handover: a routing id in use stays with its connection (stage servers' ids derive
      // from their keys); ZeroMQ's own heartbeats close a connection whose process stopped
      // answering, so a restarted peer gets its id back within seconds. ZeroMQ counts only whole
      // messages as signs of life, so a message that takes longer to arrive than its timeout
      // (a megabyte of outer gradients on a shared 16 Mbit/s link) closed a live peer's
      // connection, and the router's next send to it declared it dead: the timeout is never
      // shorter than the silence the router's own liveness rule allows.
      sock.set(zmq::sockopt::heartbeat_ivl, 1000);
      sock.set(zmq::sockopt::heartbeat_timeout, std::max(4000, opt.core.heartbeat_ms * opt.core.liveness));
      log_info("router", "CURVE on: " + std::to_string(authorized_count()) + " authorized key(s) from " + opt.authorized_file);
    } else {
      sock.set(zmq::sockopt::router_handover, 1);
      if (!loopback_bind(opt.bind)) log_warn("router", "--insecure: no keys; anyone who reaches " + opt.bind + " can join and submit jobs");
    }
    sock.set(zmq::sockopt::linger, 0);
    sock.set(zmq::sockopt::sndhwm, 100000);
    sock.set(zmq::sockopt::rcvhwm, 100000);
    // libzmq drops a connection that sends a frame larger than this before buffering it.
    sock.set(zmq::sockopt::maxmsgsize, int64_t(limits::kMaxTensorBytes) + int64_t(limits::kMaxBodyBytes));
    sock.bind(opt.bind);
    endpoint = sock.get(zmq::sockopt::last_endpoint);
    if (endpoint.rfind("tcp://0.0.0.0:", 0) == 0) endpoint = "tcp://127.0.0.1:" + endpoint.substr(14);
    if (!opt.http.empty()) {
      http_server = std::make_unique<http::Server>(opt.http, pages, dashboard_html());
      log_info("router", "dashboard at " + http_server->url() + "/, metrics at " + http_server->url() + "/metrics");
    }
    if (!opt.ready_file.empty())
      fs_util::write_file_atomic(opt.ready_file, endpoint + "\n" + (http_server ? http_server->url() + "\n" : ""), "the ready file");
    log_info("router", "listening on " + endpoint);
    disk = std::thread([this] { disk_loop(); });
  }

  ~Impl() {
    pages.stop();
    http_server.reset();
    {
      std::lock_guard<std::mutex> l(mu);
      disk_stop = true;
    }
    cv.notify_all();
    disk.join();
  }

  double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  static std::string stamp_of(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return "";
    return std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + ":" + std::to_string(st.st_size);
  }

  std::optional<Identity> identity_of(const std::string& key) const {
    std::lock_guard<std::mutex> l(auth_mu);
    auto it = authorized.find(key);
    if (it == authorized.end()) return std::nullopt;
    return Identity{true, key, it->second.name, it->second.role};
  }
  size_t authorized_count() const {
    std::lock_guard<std::mutex> l(auth_mu);
    return authorized.size();
  }

  // The authorized file is read again when it changes (checked every second, and by the ZAP
  // thread when a key it does not know connects): keys added are let in, and the messages of keys
  // removed are dropped from then on. A file that no longer parses keeps the keys read before,
  // and says why.
  void reload_authorized() {
    std::lock_guard<std::mutex> reading(reload_mu);
    const std::string stamp = stamp_of(opt.authorized_file);
    if (!authorized.empty() && stamp == auth_stamp) return;
    std::map<std::string, Authorized> fresh;
    try {
      for (Authorized& a : read_authorized(opt.authorized_file)) fresh[a.key] = std::move(a);
    } catch (const InputError& e) {
      if (authorized.empty()) throw;
      auth_stamp = stamp;
      log_warn("router", std::string(e.what()) + "; keeping the keys read before");
      return;
    }
    const bool first = authorized.empty();
    {
      std::lock_guard<std::mutex> l(auth_mu);
      authorized.swap(fresh);
    }
    auth_stamp = stamp;
    if (!first) log_info("router", opt.authorized_file + " changed: " + std::to_string(authorized.size()) + " authorized key(s)");
  }

  void disk_loop() {
    for (;;) {
      DiskWork w;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return disk_stop || !work.empty(); });
        if (work.empty()) return;  // stopping, and everything asked for is done
        w = std::move(work.front());
        work.pop_front();
        if (auto* f = std::get_if<WriteFile>(&w)) {
          auto it = latest.find(f->path);
          if (it == latest.end()) continue;  // an older copy of a record already written
          f->content = std::move(it->second);
          latest.erase(it);
        }
      }
      std::optional<DiskResult> r;
      if (auto* l = std::get_if<LoadJob>(&w)) r = load(std::move(*l));
      else if (auto* f = std::get_if<WriteFile>(&w)) write(*f);
      else r = checkpoint(std::get<WriteCheckpoint>(w));
      if (r) {
        std::lock_guard<std::mutex> lk(mu);
        results.push_back(std::move(*r));
      }
    }
  }

  // A job from another host (or any job when --data-root is given) reads data and --resume
  // checkpoints only under the data roots, and writes checkpoints only under the state dir.
  std::string confined(LoadJob& l) const {
    if (!l.remote && opt.data_roots.empty()) return "";
    for (size_t i = 0; i < l.spec->data.paths.size(); ++i) {
      std::string& p = l.spec->data.paths[i];
      if (std::string e = outside_roots(p, opt.data_roots, "data.path"); !e.empty()) return e;
      p = canonical(p);   // read what was checked, not what a symlink points to later
    }
    std::vector<std::string> readable = opt.data_roots;
    if (!opt.core.state_dir.empty()) readable.push_back(opt.core.state_dir);
    if (!l.resume.empty())
      if (std::string e = outside_roots(l.resume, readable, "--resume"); !e.empty()) return e;
    if (!l.spec->checkpoint.dir.empty()) {
      if (opt.core.state_dir.empty())
        return "checkpoint.dir \"" + l.spec->checkpoint.dir + "\": this router writes no checkpoints where a job asks; leave checkpoint.dir out "
               "(the router keeps checkpoints in its --state-dir)";
      if (std::string e = outside_roots(l.spec->checkpoint.dir, {opt.core.state_dir}, "checkpoint.dir"); !e.empty()) return e;
    }
    return "";
  }

  JobLoaded load(LoadJob l) const {
    JobLoaded r;
    r.job = l.job;
    try {
      if (std::string e = confined(l); !e.empty()) throw InputError(e);
      parse_job_spec(to_json(*l.spec), /*check_files=*/true);  // what is wrong with the files, said for a person
      r.data = std::make_shared<TokenData>(TokenData::load(l.spec->data, l.spec->model.seq_len, l.spec->model.vocab_size, opt.max_data_bytes));
      if (!l.resume.empty()) r.checkpoint = resolve_checkpoint(l.resume);
      else if (!l.checkpoint_dir.empty()) r.checkpoint = load_latest_checkpoint(l.checkpoint_dir, &r.skipped);
      if (r.checkpoint) {
        // Microbatches taken after the checkpoint are done again: progress.json says how many.
        std::ifstream pf(std::filesystem::path(r.checkpoint->path).parent_path() / "progress.json");
        nlohmann::json pj = nlohmann::json::parse(pf, nullptr, false);
        if (pj.is_object() && pj.contains("taken") && pj["taken"].is_number_integer())
          r.redone = std::max<int64_t>(0, pj["taken"].get<int64_t>() - int64_t(r.checkpoint->ckpt.next_microbatch));
      }
    } catch (const std::exception& e) {
      r.error = e.what();
      r.data.reset();
    }
    return r;
  }

  void write(const WriteFile& f) const {
    try {
      fs_util::write_file_atomic(f.path, f.content, "a router record");
    } catch (const std::exception& e) {
      log_warn("router", std::string(e.what()) + "; the job will not survive a router restart as it is now");
    }
  }

  CheckpointWritten checkpoint(const WriteCheckpoint& w) const {
    CheckpointWritten r;
    r.job = w.job;
    r.step = w.checkpoint->step;
    const auto t = Clock::now();
    try {
      r.path = write_checkpoint(w.dir, *w.checkpoint, w.keep);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    r.write_s = std::chrono::duration<double>(Clock::now() - t).count();
    return r;
  }

  // A call into the core, timed for /metrics (swarm_router_core_seconds_total).
  template <class F>
  Actions decide(F&& f) {
    const auto t = Clock::now();
    Actions a = f();
    counters.core_s += std::chrono::duration<double>(Clock::now() - t).count();
    return a;
  }

  // Carries out the core's actions in order. A send to a peer that is gone is reported back.
  void execute(Actions actions) {
    std::set<PeerId> unreachable;
    bool queued = false;
    for (Action& a : actions) {
      if (auto* s = std::get_if<Send>(&a)) {
        counters.messages_out++;
        std::vector<zmq::message_t> frames = wire::encode(s->msg);
        const bool parted = wire::frame_bytes(frames) > limits::kMaxPartBytes && core.takes_parts(s->to);
        if (!(parted ? wire::send_parted(sock, std::move(frames), &s->to) : wire::send_frames(sock, frames, &s->to))) unreachable.insert(s->to);
      } else if (auto* lg = std::get_if<Log>(&a)) {
        log_line(lg->level, "router", lg->text, LogFields{lg->job ? lg->job : core.active_job(), lg->peer});
      } else {
        std::lock_guard<std::mutex> l(mu);
        if (auto* f = std::get_if<WriteFile>(&a)) {
          const bool pending = latest.count(f->path);
          latest[f->path] = std::move(f->content);
          if (pending) continue;
          work.push_back(WriteFile{f->path, {}});
        } else if (auto* lj = std::get_if<LoadJob>(&a)) {
          work.push_back(std::move(*lj));
        } else {
          work.push_back(std::move(std::get<WriteCheckpoint>(a)));
        }
        queued = true;
      }
    }
    if (queued) cv.notify_one();
    for (const PeerId& p : unreachable)
      if (core.registry().find(p)) execute(decide([&] { return core.on_unreachable(p, now()); }));
  }

  // One message: whatever goes wrong with it costs that message, never the router. A broken
  // invariant of our own is logged loudly (it is a bug) and the loop carries on.
  void on_frames(wire::Received& r) {
    counters.messages_in++;
    try {
      handle(r);
    } catch (const std::exception& e) {
      log_error("router", std::string("handling a ") + (r.frames.empty() ? "message" : "message from " + r.route) + " failed: " + e.what());
    }
  }

  // Who sent it: the key CURVE authenticated (and its role), and whether from another host.
  // nullopt: a key no longer authorized (it cannot happen while the file is not reloaded).
  std::optional<Identity> identity_of(const wire::Received& r) {
    Identity who;
    if (r.frames.empty()) return who;
    who.remote = from_remote_host(r.frames[0]);
    if (!zap) return who;
    std::lock_guard<std::mutex> l(auth_mu);
    auto it = authorized.find(authenticated_key(r.frames[0]));
    if (it == authorized.end()) return std::nullopt;
    who.authenticated = true;
    who.key = it->first;
    who.name = it->second.name;
    who.role = it->second.role;
    return who;
  }

  void handle(wire::Received& r) {
    const std::optional<Identity> who = identity_of(r);
    if (!who) return;
    wire::Envelope env;
    try {
      env = wire::peek_envelope(r.frames);
    } catch (const WireError& e) {
      return execute(decide([&] { return core.on_undecodable(r.route, e, std::nullopt, now()); }));
    }
    // A PART from a peer or a client: a sign of life until the message it belongs to is whole.
    if (env.type == wire::MsgType::kPart && core.accepts(r.route, env.type)) {
      std::optional<std::vector<zmq::message_t>> whole;
      try {
        whole = parts.take(r.route, std::move(r.frames), now());
        if (whole) env = wire::peek_envelope(*whole);
      } catch (const WireError& e) {
        return execute(decide([&] { return core.on_undecodable(r.route, e, std::nullopt, now()); }));
      }
      if (!whole) return execute(decide([&] { return core.on_message(r.route, wire::Message(wire::MsgType::kPart), now(), *who); }));
      r.frames = std::move(*whole);
    }
    // Nothing but HELLO from a stranger: its body and tensors are not even parsed.
    if (!core.accepts(r.route, env.type)) return execute(decide([&] { return core.on_message(r.route, wire::Message(env.type, env.id, env.attempt), now(), *who); }));
    wire::Message m;
    try {
      m = wire::decode(r.frames);
    } catch (const WireError& e) {
      return execute(decide([&] { return core.on_undecodable(r.route, e, env.id, now()); }));
    }
    execute(decide([&] { return core.on_message(r.route, std::move(m), now(), *who); }));
  }

  void drain_disk() {
    std::deque<DiskResult> done;
    {
      std::lock_guard<std::mutex> l(mu);
      done.swap(results);
    }
    for (auto& d : done) {
      if (auto* l = std::get_if<JobLoaded>(&d)) execute(decide([&] { return core.on_job_loaded(std::move(*l), now()); }));
      else execute(decide([&] { return core.on_checkpoint_written(std::move(std::get<CheckpointWritten>(d)), now()); }));
    }
  }

  void run(std::atomic<bool>& stop) {
    std::vector<StoredJob> stored = read_state_dir(opt.core.state_dir);
    execute(decide([&] { return core.restore(std::move(stored), now()); }));
    while (!stop) {
      zmq::pollitem_t items[] = {{sock.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 1, std::chrono::milliseconds(5));
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;  // a signal: the loop condition decides
        throw;
      }
      if (items[0].revents & ZMQ_POLLIN) {
        for (int i = 0; i < 256; ++i) {
          auto r = wire::recv_frames(sock, true, zmq::recv_flags::dontwait);
          if (!r) break;
          on_frames(*r);
        }
      }
      drain_disk();
      if (now() - parts_expired_s >= 1.0) {
        // A message left unfinished longer than the liveness window: its sender is gone, or came back on a new connection.
        parts_expired_s = now();
        parts.expire(parts_expired_s, 2.0 * opt.core.heartbeat_ms * opt.core.liveness / 1000.0);
      }
      if (zap && now() - auth_checked_s >= 1.0) {
        auth_checked_s = now();
        reload_authorized();
      }
      execute(decide([&] { return core.tick(now()); }));
      if (http_server && pages.wanted()) pages.publish(http_pages(core, now(), counters));   // only when a request asked
    }
    execute(decide([&] { return core.shutdown(now()); }));
  }
};

Server::Server(ServerOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
Server::~Server() = default;
std::string Server::endpoint() const { return impl_->endpoint; }
std::string Server::http_url() const { return impl_->http_server ? impl_->http_server->url() : ""; }
void Server::run(std::atomic<bool>& stop) { impl_->run(stop); }

}  // namespace swarm::router
