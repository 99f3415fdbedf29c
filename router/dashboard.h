// dashboard.h: the router's dashboard page (router/dashboard.html, compiled in by CMake): one
// HTML page with its script and style, no CDN, charts drawn as inline SVG. It reads
// /api/status and /api/peers every second and /api/events as a stream (docs/observability.md).
//
// Defines swarm::router::dashboard_html.
#pragma once

namespace swarm::router {

const char* dashboard_html();

}  // namespace swarm::router
