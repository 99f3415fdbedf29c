// http.cpp: the published pages and the HTTP server that serves them (http.h), on cpp-httplib.
#include "runtime/http.h"

#include <httplib.h>

#include <chrono>
#include <thread>

#include "runtime/errors.h"
#include "runtime/log.h"

namespace swarm::http {

namespace {

using Clock = std::chrono::steady_clock;

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr int kThreads = 8;             // requests served at once
constexpr int kMaxStreams = 4;          // /api/events streams at once: the other threads stay for scrapes
constexpr double kStreamPeriodS = 0.25; // an event stream looks for new events this often

const char* kRoutes =
    "swarm: these routes are served here\n"
    "  /metrics       Prometheus text exposition\n"
    "  /api/status    swarm status --json (router)\n"
    "  /api/peers     swarm peers --json (router)\n"
    "  /api/targets   the stage servers' /metrics as Prometheus http_sd targets (router)\n"
    "  /api/events    server-sent events (router)\n";

}  // namespace

void Publisher::publish(Pages p) {
  p.at_s = now_s();
  auto next = std::make_shared<const Pages>(std::move(p));
  {
    std::lock_guard<std::mutex> l(mu_);
    cur_ = std::move(next);
    wanted_ = false;
  }
  cv_.notify_all();
}

std::shared_ptr<const Pages> Publisher::get(double max_age_s, double wait_s) {
  std::unique_lock<std::mutex> l(mu_);
  auto fresh = [&] { return stopped_ || (cur_ && now_s() - cur_->at_s <= max_age_s); };
  if (fresh()) return cur_;
  wanted_ = true;
  cv_.wait_for(l, std::chrono::duration<double>(wait_s), fresh);
  return cur_;
}

void Publisher::stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

std::pair<std::string, int> parse_bind(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  const std::string hint = " (give HOST:PORT, e.g. 127.0.0.1:9100, 0.0.0.0:9100, or 127.0.0.1:0 for a free port)";
  if (colon == std::string::npos) throw InputError("HTTP address '" + addr + "' has no port" + hint);
  std::string host = addr.substr(0, colon);
  const std::string port_text = addr.substr(colon + 1);
  if (host.empty()) host = "0.0.0.0";
  if (host.find_first_of(" /[]") != std::string::npos) throw InputError("HTTP address '" + addr + "': bad host" + hint);
  int port = -1;
  try {
    size_t used = 0;
    port = std::stoi(port_text, &used);
    if (used != port_text.size()) port = -1;
  } catch (const std::exception&) {
    port = -1;
  }
  if (port < 0 || port > 65535) throw InputError("HTTP address '" + addr + "': port must be 0..65535" + hint);
  return {host, port};
}

struct Server::Impl {
  Publisher& pages;
  std::string index_html;
  std::string host;
  int port = 0;
  httplib::Server svr;
  std::thread thread;
  std::atomic<int> streams{0};
  std::atomic<bool> stopping{false};
  std::mutex stop_mu;
  std::condition_variable stop_cv;

  Impl(Publisher& p, std::string html) : pages(p), index_html(std::move(html)) {}

  // Pages no older than a scrape interval's worth; a loop that does not answer within 0.5 s
  // gets its last pages served (or 503 before it published any).
  std::shared_ptr<const Pages> current(httplib::Response& res) {
    auto p = pages.get(0.1, 0.5);
    if (!p) {
      res.status = 503;
      res.set_content("not ready yet: the event loop has not published its first pages\n", "text/plain");
    }
    return p;
  }

  void json_route(const char* path, std::string Pages::*doc) {
    svr.Get(path, [this, doc](const httplib::Request&, httplib::Response& res) {
      auto p = current(res);
      if (!p) return;
      if (((*p).*doc).empty()) {
        res.status = 404;
        res.set_content(kRoutes, "text/plain");
        return;
      }
      res.set_content((*p).*doc, "application/json");
    });
  }

  void routes() {
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      if (auto p = current(res)) res.set_content(p->metrics, "text/plain; version=0.0.4; charset=utf-8");
    });
    json_route("/api/status", &Pages::status);
    json_route("/api/peers", &Pages::peers);
    json_route("/api/targets", &Pages::targets);
    svr.Get("/api/events", [this](const httplib::Request& req, httplib::Response& res) { events(req, res); });
    svr.Get("/", [this](const httplib::Request&, httplib::Response& res) {
      if (index_html.empty()) res.set_content(kRoutes, "text/plain");
      else res.set_content(index_html, "text/html; charset=utf-8");
    });
    svr.set_error_handler([](const httplib::Request&, httplib::Response& res) {
      if (res.status == 404) res.set_content(kRoutes, "text/plain");
    });
  }

  // Server-sent events: every event after the client's Last-Event-ID (all kept ones for a new
  // client), then new ones as they come, with a comment line to keep idle connections open.
  void events(const httplib::Request& req, httplib::Response& res) {
    auto p = current(res);
    if (!p) return;
    if (p->status.empty()) {
      res.status = 404;
      res.set_content(kRoutes, "text/plain");
      return;
    }
    if (streams.fetch_add(1) >= kMaxStreams) {
      streams--;
      res.status = 503;
      res.set_content("too many event streams open (" + std::to_string(kMaxStreams) + "); close one and retry\n", "text/plain");
      return;
    }
    uint64_t cursor = 0;
    if (req.has_header("Last-Event-ID")) {
      try {
        cursor = std::stoull(req.get_header_value("Last-Event-ID"));
      } catch (const std::exception&) {
        cursor = 0;
      }
    }
    res.set_header("Cache-Control", "no-cache");
    auto first = std::make_shared<bool>(true);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, cursor, first](size_t, httplib::DataSink& sink) mutable {
          if (stopping) return false;
          std::string out = *first ? "retry: 1000\n\n" : "";
          *first = false;
          if (auto pg = pages.get(kStreamPeriodS, 0.5))
            for (const Event& e : pg->events)
              if (e.seq > cursor) {
                out += "id: " + std::to_string(e.seq) + "\nevent: " + e.kind + "\ndata: " + e.json + "\n\n";
                cursor = e.seq;
              }
          if (out.empty()) out = ": idle\n\n";
          if (!sink.write(out.data(), out.size())) return false;
          std::unique_lock<std::mutex> l(stop_mu);
          stop_cv.wait_for(l, std::chrono::duration<double>(kStreamPeriodS), [this] { return stopping.load(); });
          return !stopping;
        },
        [this](bool) { streams--; });
  }
};

Server::Server(const std::string& bind, Publisher& pages, std::string index_html)
    : impl_(std::make_unique<Impl>(pages, std::move(index_html))) {
  Impl& I = *impl_;
  auto [host, port] = parse_bind(bind);
  I.host = host;
  I.svr.new_task_queue = [] { return new httplib::ThreadPool(kThreads); };
  I.svr.set_read_timeout(5);
  I.svr.set_write_timeout(5);  // a client that stops reading loses its connection, not a thread
  I.svr.set_keep_alive_timeout(5);
  I.routes();
  if (port == 0) {
    I.port = I.svr.bind_to_any_port(host);
  } else {
    I.port = I.svr.bind_to_port(host, port) ? port : -1;
  }
  if (I.port <= 0) throw InputError("cannot serve HTTP on " + bind + ": the address is not this host's or the port is taken");
  I.thread = std::thread([&I] { I.svr.listen_after_bind(); });
  // stop() only stops a server that is running: wait for it, so that destroying this one at once
  // cannot leave the thread listening.
  for (int i = 0; i < 5000 && !I.svr.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

Server::~Server() {
  Impl& I = *impl_;
  {
    std::lock_guard<std::mutex> l(I.stop_mu);
    I.stopping = true;
  }
  I.stop_cv.notify_all();
  I.svr.stop();
  if (I.thread.joinable()) I.thread.join();
}

Response get(const std::string& url, double timeout_s) {
  Response out;
  const size_t scheme = url.find("://");
  const size_t slash = url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  if (scheme == std::string::npos || url.compare(0, scheme, "http") != 0) {
    out.body = "not an http:// URL: " + url;
    return out;
  }
  httplib::Client cli(url.substr(0, slash));
  const auto sec = time_t(timeout_s);
  const auto usec = time_t((timeout_s - double(sec)) * 1e6);
  cli.set_connection_timeout(sec, usec);
  cli.set_read_timeout(sec, usec);
  cli.set_write_timeout(sec, usec);
  auto res = cli.Get(slash == std::string::npos ? "/" : url.substr(slash));
  if (!res) {
    out.body = "no answer from " + url + ": " + httplib::to_string(res.error());
    return out;
  }
  out.status = res->status;
  out.body = std::move(res->body);
  return out;
}

std::string Server::url() const {
  const std::string h = impl_->host == "0.0.0.0" ? "127.0.0.1" : impl_->host;
  return "http://" + h + ":" + std::to_string(impl_->port);
}
const std::string& Server::host() const { return impl_->host; }
int Server::port() const { return impl_->port; }

}  // namespace swarm::http
