// text.h: small helpers the parsers of user input share: numbers, lists and values in messages,
// "did you mean" for a mistyped key, and JSON files read with errors that name the file.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm {

// The shortest text that reads back as exactly `v` ("0.001", not "0.0010000000000000000208").
std::string shortest_number(double v);

// "a, b, c": the allowed values in a message.
std::string join(const std::vector<std::string>& items);

// `s` cut to at most `max_chars` bytes for a message ("..." ends a cut one), at a UTF-8
// character boundary so the message stays UTF-8: one error stays one readable line.
std::string clip(const std::string& s, size_t max_chars = 80);

// A JSON value for an error message: never throws (invalid UTF-8 is replaced, as a value from
// the network may hold), at most `max_chars` characters. Containers below the second level show
// as [...] and {...}, so a deeply nested value costs no more than a flat one.
std::string shown_json(const nlohmann::json& v, size_t max_chars = 80);

// The one of `allowed` that `key` is most likely a typo of, or "" when none is close: at most a
// third of the shorter word away in edits (a swap of two adjacent characters is one edit, so
// "stpes" is one edit from "steps"), and at least one.
std::string did_you_mean(const std::string& key, const std::vector<std::string>& allowed);
// ": did you mean "X"?" for a message when did_you_mean finds X, else "".
std::string suggestion(const std::string& key, const std::vector<std::string>& allowed);

// Parses the JSON file at `path`; throws InputError "WHAT PATH: cannot read the file (...)" or
// "WHAT PATH: not valid JSON: ...".
nlohmann::json read_json_file(const std::string& what, const std::string& path);

}  // namespace swarm
