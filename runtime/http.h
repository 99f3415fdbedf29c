// http.h: the HTTP side of swarm-router and swarm-stage (`--http ADDR`): pages that an event
// loop publishes, served by threads of their own (cpp-httplib).
//
// Defines swarm::http::Event, Pages, Publisher, Server, parse_bind and `get` (a small client for
// the tools and tests). The event loop never
// waits for HTTP: it checks `Publisher::wanted()` (one atomic load) each time round, and only
// when a request asked for fresher pages does it build them and `publish` them (a pointer swap
// under a mutex). A request takes the newest pages when they are recent enough (`max_age_s`),
// else asks for new ones and waits a bounded time, then serves the newest it has: a busy loop
// makes pages a little stale, never a request hang, and a slow client only holds its own
// thread. Routes:
//   GET /metrics       Prometheus text exposition (version 0.0.4)
//   GET /api/status    `swarm status --json`            (router only)
//   GET /api/peers     `swarm peers --json`             (router only)
//   GET /api/targets   the stage servers' /metrics, as Prometheus http_sd targets (router only)
//   GET /api/events    server-sent events: every event after Last-Event-ID (router only)
//   GET /              the dashboard (router) or a list of these routes
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace swarm::http {

struct Event {
  uint64_t seq = 0;      // increasing; the SSE id
  std::string kind;      // the SSE event name
  std::string json;      // the SSE data, one line
};

// Every page as the loop saw it at one moment. An empty document is not served (404).
struct Pages {
  double at_s = 0;                      // set by publish [s, steady clock]
  std::string metrics;                  // text exposition
  std::string status, peers, targets;   // JSON
  std::vector<Event> events;            // the newest events, oldest first
};

class Publisher {
 public:
  // Whether a request waits for fresher pages; the loop then builds and publishes them.
  bool wanted() const { return wanted_.load(std::memory_order_relaxed); }
  void publish(Pages p);
  // The newest pages when built within `max_age_s`; otherwise asks for fresh ones and waits at
  // most `wait_s`, then returns the newest there are (null before the first publish).
  std::shared_ptr<const Pages> get(double max_age_s, double wait_s);
  // Wakes every waiter; get() returns at once from then on.
  void stop();

 private:
  std::atomic<bool> wanted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const Pages> cur_;
  bool stopped_ = false;
};

// "HOST:PORT" (HOST empty: every interface; PORT 0: a free port) -> (host, port). Throws
// InputError saying what to write instead.
std::pair<std::string, int> parse_bind(const std::string& addr);

class Server {
 public:
  // Binds `bind` (parse_bind) and serves `pages` from a thread pool until destroyed; `index_html`
  // is the page at / ("" for a list of the routes). Throws InputError when the address is
  // malformed or cannot be bound.
  Server(const std::string& bind, Publisher& pages, std::string index_html = "");
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  // http://HOST:PORT with the bound port; a wildcard host reads 127.0.0.1.
  std::string url() const;
  const std::string& host() const;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// GET `url` (http://HOST:PORT/PATH): {status, body}; status 0 when no answer came within
// `timeout_s` (the body then says why).
struct Response {
  int status = 0;
  std::string body;
};
Response get(const std::string& url, double timeout_s = 5);

}  // namespace swarm::http
