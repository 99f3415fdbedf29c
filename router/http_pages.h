// http_pages.h: what the router's HTTP routes serve at one moment, built from the core.
//
// Defines swarm::router::http_pages: /metrics (router/metrics.h's exposition), /api/status and
// /api/peers (the JSON of `swarm status --json` and `swarm peers --json`, every page of peers
// joined as the client joins them), /api/targets (the stage servers' own /metrics) and the kept
// events for /api/events. The server calls it on its loop when an HTTP thread asks for fresher
// pages (runtime/http.h); it only reads the core.
#pragma once

#include "router/core.h"
#include "runtime/http.h"

namespace swarm::router {

// `server`: the loop's own counters, shown on /metrics.
http::Pages http_pages(const RouterCore& core, double now, const ServerCounters& server = {});

}  // namespace swarm::router
