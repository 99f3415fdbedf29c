// test_observability.cpp: the ground floor of --http and --log-format: the exposition writer
// (escaping, cumulative buckets, values), JSON log lines, and the HTTP server serving published
// pages (fresh on request, stale rather than stuck, server-sent events, bad addresses refused).
#include <gtest/gtest.h>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include <nlohmann/json.hpp>

#include "runtime/errors.h"
#include "runtime/http.h"
#include "runtime/log.h"
#include "runtime/metrics.h"

namespace swarm {
namespace {

using metrics::Exposition;
using metrics::Type;

TEST(Exposition, WritesFamiliesLabelsAndValuesAsTheFormatSays) {
  Exposition out;
  out.family("swarm_things_total", Type::kCounter, "Things, with a \\ and a\nnewline.")
      .sample({{"peer", "a\"b\\c\nd"}}, 3)
      .sample({}, 1e20);
  out.family("swarm_empty", Type::kGauge, "No sample: not written.");
  out.family("swarm_ratio", Type::kGauge, "A gauge.").sample({{"x", "1"}, {"y", "2"}}, 0.25).sample({}, NAN);
  EXPECT_EQ(out.text(),
            "# HELP swarm_things_total Things, with a \\\\ and a\\nnewline.\n"
            "# TYPE swarm_things_total counter\n"
            "swarm_things_total{peer=\"a\\\"b\\\\c\\nd\"} 3\n"
            "swarm_things_total 1e+20\n"
            "# HELP swarm_ratio A gauge.\n"
            "# TYPE swarm_ratio gauge\n"
            "swarm_ratio{x=\"1\",y=\"2\"} 0.25\n"
            "swarm_ratio NaN\n");
  EXPECT_EQ(metrics::format_value(INFINITY), "+Inf");
  EXPECT_EQ(metrics::format_value(-INFINITY), "-Inf");
  EXPECT_EQ(metrics::format_value(123456789012.0), "123456789012");
  EXPECT_THROW(out.family("swarm_h", Type::kHistogram, "h").sample({}, 1), InternalError);
}

TEST(Exposition, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  metrics::Histogram h({0.1, 1});
  for (double v : {0.05, 0.1, 0.5, 2.0, 3.0}) h.observe(v);
  h.observe(NAN);  // ignored
  Exposition out;
  out.family("swarm_lat_seconds", Type::kHistogram, "Latency.").histogram({{"stage", "0"}}, h);
  EXPECT_EQ(out.text(),
            "# HELP swarm_lat_seconds Latency.\n"
            "# TYPE swarm_lat_seconds histogram\n"
            "swarm_lat_seconds_bucket{stage=\"0\",le=\"0.1\"} 2\n"
            "swarm_lat_seconds_bucket{stage=\"0\",le=\"1\"} 3\n"
            "swarm_lat_seconds_bucket{stage=\"0\",le=\"+Inf\"} 5\n"
            "swarm_lat_seconds_sum{stage=\"0\"} 5.65\n"
            "swarm_lat_seconds_count{stage=\"0\"} 5\n");
}

TEST(Exposition, TheProcessReportsItsMemoryCpuAndStart) {
  Exposition out;
  metrics::process_metrics(out);
  for (const char* name : {"process_resident_memory_bytes ", "process_cpu_seconds_total ", "process_start_time_seconds "})
    EXPECT_NE(out.text().find(std::string("\n") + name), std::string::npos) << name << " in\n" << out.text();
}

TEST(Log, JsonLinesCarryTimeLevelComponentJobPeerAndMessage) {
  const std::string line =
      format_log_line(LogFormat::kJson, 1714564800.123, LogLevel::kWarn, "router", "peer \"x\" is gone:\nmissed 3", LogFields{7, "stage1-0"});
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["time"], "2024-05-01T12:00:00.123Z");
  EXPECT_EQ(j["level"], "warn");
  EXPECT_EQ(j["component"], "router");
  EXPECT_EQ(j["job"], 7);
  EXPECT_EQ(j["peer"], "stage1-0");
  EXPECT_EQ(j["message"], "peer \"x\" is gone:\nmissed 3");
  EXPECT_EQ(line.find('\n'), std::string::npos);  // one line
  EXPECT_EQ(line.rfind("{\"time\":", 0), 0u);     // keys in the documented order

  // No job or peer: null; bytes that are not UTF-8 do not lose the line.
  const auto k = nlohmann::json::parse(format_log_line(LogFormat::kJson, 0, LogLevel::kInfo, "stage", "bad \xff byte", {}));
  EXPECT_TRUE(k["job"].is_null());
  EXPECT_TRUE(k["peer"].is_null());
  EXPECT_NE(k["message"].get<std::string>().find("bad "), std::string::npos);

  const std::string text = format_log_line(LogFormat::kText, 0, LogLevel::kError, "stage", "boom", {});
  EXPECT_NE(text.find(" ERROR stage: boom"), std::string::npos);
  EXPECT_EQ(parse_log_format("json"), LogFormat::kJson);
  try {
    parse_log_format("yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("text or json"), std::string::npos);
  }
}

TEST(Http, AddressesAreCheckedWithAMessageThatSaysWhatToWrite) {
  EXPECT_EQ(http::parse_bind("127.0.0.1:9100"), std::make_pair(std::string("127.0.0.1"), 9100));
  EXPECT_EQ(http::parse_bind(":0"), std::make_pair(std::string("0.0.0.0"), 0));
  for (const char* bad : {"9100", "127.0.0.1:http", "127.0.0.1:70000", "127.0.0.1:-1", "[::1]:80"}) {
    try {
      http::parse_bind(bad);
      FAIL() << bad;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("HOST:PORT"), std::string::npos) << e.what();
    }
  }
  http::Publisher pages;
  EXPECT_THROW(http::Server("192.0.2.1:0", pages), InputError);  // not an address of this host
}

// A loop that publishes only when asked, as the router's does.
struct Loop {
  http::Publisher pages;
  std::atomic<bool> stop{false};
  std::atomic<int> built{0};
  std::atomic<bool> stalled{false};
  std::thread t;
  Loop() {
    t = std::thread([this] {
      while (!stop) {
        if (!stalled && pages.wanted()) {
          http::Pages p;
          p.metrics = "# TYPE swarm_x gauge\nswarm_x " + std::to_string(++built) + "\n";
          p.status = "{\"state\":\"running\"}";
          p.events.push_back({1, "job", "{\"seq\":1}"});
          p.events.push_back({2, "fault", "{\"seq\":2}"});
          pages.publish(std::move(p));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }
  ~Loop() {
    stop = true;
    pages.stop();
    t.join();
  }
};

TEST(Http, ServesFreshPagesOnRequestAndStalePagesWhenTheLoopIsBusy) {
  Loop loop;
  http::Server server("127.0.0.1:0", loop.pages);
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(loop.built, 0);  // nothing is built until someone asks
  http::Response r = http::get(server.url() + "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "# TYPE swarm_x gauge\nswarm_x 1\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(http::get(server.url() + "/metrics").body, "# TYPE swarm_x gauge\nswarm_x 2\n");
  EXPECT_EQ(http::get(server.url() + "/api/status").body, "{\"state\":\"running\"}");
  EXPECT_EQ(http::get(server.url() + "/api/peers").status, 404);   // not published: not served
  EXPECT_EQ(http::get(server.url() + "/nowhere").status, 404);
  EXPECT_NE(http::get(server.url() + "/").body.find("/metrics"), std::string::npos);

  // A loop that does not answer: the request gets the last pages after a bounded wait.
  loop.stalled = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const auto t0 = std::chrono::steady_clock::now();
  r = http::get(server.url() + "/metrics");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "# TYPE swarm_x gauge\nswarm_x 2\n");
  EXPECT_LT(waited, 2.0);
}

TEST(Http, EventStreamsSendEveryEventAfterTheLastOneSeen) {
  Loop loop;
  http::Server server("127.0.0.1:0", loop.pages);
  // A raw HTTP/1.1 client on a socket with a read deadline (the stream never ends by itself):
  // read until the event after Last-Event-ID arrived, then hang up.
  std::string got;
  int fd = -1;
  {
    struct addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    ASSERT_EQ(getaddrinfo("127.0.0.1", std::to_string(server.port()).c_str(), &hints, &res), 0);
    fd = socket(res->ai_family, res->ai_socktype, 0);
    ASSERT_EQ(connect(fd, res->ai_addr, res->ai_addrlen), 0);
    freeaddrinfo(res);
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  const std::string req = "GET /api/events HTTP/1.1\r\nHost: x\r\nLast-Event-ID: 1\r\n\r\n";
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  char buf[4096];
  while (got.find("id: 2\nevent: fault\ndata: {\"seq\":2}\n\n") == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << "stream ended or stalled; got:\n" << got;
    got.append(buf, size_t(n));
  }
  close(fd);
  EXPECT_NE(got.find("text/event-stream"), std::string::npos) << got;
  EXPECT_EQ(got.find("id: 1\n"), std::string::npos) << "an event before Last-Event-ID was sent again:\n" << got;
}

}  // namespace
}  // namespace swarm
