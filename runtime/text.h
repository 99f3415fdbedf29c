// text.h: small helpers the parsers of user input share: numbers and lists in messages, and
// JSON files read with errors that name the file.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm {

// The shortest text that reads back as exactly `v` ("0.001", not "0.0010000000000000000208").
std::string shortest_number(double v);

// "a, b, c": the allowed values in a message.
std::string join(const std::vector<std::string>& items);

// A JSON value for an error message: never throws (invalid UTF-8 is replaced, as a value from
// the network may hold), at most `max_chars` characters.
std::string shown_json(const nlohmann::json& v, size_t max_chars = 80);

// Parses the JSON file at `path`; throws InputError "WHAT PATH: cannot read the file (...)" or
// "WHAT PATH: not valid JSON: ...".
nlohmann::json read_json_file(const std::string& what, const std::string& path);

}  // namespace swarm
