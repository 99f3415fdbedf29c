// http_pages.cpp: the router's pages for its HTTP routes (http_pages.h).
#include "router/http_pages.h"

#include "runtime/limits.h"

namespace swarm::router {

http::Pages http_pages(const RouterCore& core, double now, const ServerCounters& server) {
  // Bytes from the network quoted in a status (a peer's name, an error) may not be UTF-8.
  auto dump = [](const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); };
  http::Pages p;
  RouterMetrics m = core.metrics(now);
  m.server = server;
  p.metrics = exposition(m);
  p.status = dump(core.status_json(std::nullopt, now));
  nlohmann::json all = nlohmann::json::array();
  const size_t total = core.registry().size();
  while (all.size() < total) {
    nlohmann::json page = core.peers_json(all.size(), limits::kMaxPeersPerReply, now);
    if (page["peers"].empty()) break;
    for (auto& e : page["peers"]) all.push_back(std::move(e));
  }
  p.peers = dump({{"peers", std::move(all)}, {"total", total}});
  p.targets = dump(http_targets(m.peers));
  for (const Event& e : core.events_since(0, Events::kKeep)) p.events.push_back({e.seq, event_kind_name(e.kind), dump(to_json(e))});
  return p;
}

}  // namespace swarm::router
