// codec_spec.cpp: implements runtime/codec_spec.h: the codec text form (parse_codec, name,
// validate) and the exact encoded sizes.
#include "runtime/codec_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

#include "runtime/errors.h"

namespace swarm::compression {
namespace {

constexpr int kMinBlock = 64;
constexpr int kMaxBlock = 4096;
constexpr int kDefaultBlock = 64;
constexpr int kDefaultTopkBlock = 1024;
constexpr double kDefaultTopkFraction = 0.01;
// n above this is surely a bug or an attack (2^48 floats is 1 PiB); keeps size math in range.
constexpr int64_t kMaxElements = int64_t(1) << 48;
const char* const kAccepted =
    "accepted: fp32, fp16, bf16, int8[:block=B][,scale=fp32|fp16], "
    "int4[:block=B][,scale=fp32|fp16], topk[:block=B][,fraction=F] with B an integer in "
    "64..4096 (default 64; topk 1024) and 0 < F <= 1 (default 0.01), any of them with "
    "entropy=zstd (the codes zstd-compressed on the wire); e.g. "
    "\"int8:block=256,scale=fp16\", \"topk:block=1024,fraction=0.01\", \"int8:block=1024,entropy=zstd\"";

[[noreturn]] void fail(const std::string& what) { throw CodecError(what); }

// Text from the network, made safe to put in an error message.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 64; ++i) {
    char c = s[i];
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  if (s.size() > 64) out += "...";
  return out;
}

// ---- text form ------------------------------------------------------------------------------

bool parse_int(const std::string& v, int* out) {
  if (v.empty() || v.size() > 6) return false;
  for (char c : v)
    if (c < '0' || c > '9') return false;
  *out = std::stoi(v);
  return true;
}

std::string format_double(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest text that round-trips
  return std::string(buf, r.ptr);
}

}  // namespace

namespace layout {

// Values kept from a block of len values: ceil(fraction * len) in IEEE double, in [1, len].
int topk_keep(double fraction, int len) {
  const double k = std::ceil(fraction * double(len));
  return int(std::min<double>(len, std::max(1.0, k)));
}

int64_t topk_total(const CodecSpec& spec, int64_t n) {
  const int64_t full = n / spec.block;
  const int tail = int(n % spec.block);
  return full * topk_keep(spec.fraction, spec.block) + (tail ? topk_keep(spec.fraction, tail) : 0);
}

void check_count(int64_t n) {
  if (n < 0) fail("codec: element count " + std::to_string(n) + " is negative");
  if (n > kMaxElements)
    fail("codec: element count " + std::to_string(n) + " is above the limit 2^48");
}

}  // namespace layout

// ---- public API -----------------------------------------------------------------------------

bool CodecSpec::operator==(const CodecSpec& o) const {
  return codec == o.codec && block == o.block && fp16_scales == o.fp16_scales &&
         fraction == o.fraction && zstd == o.zstd;
}

std::string CodecSpec::name() const {
  std::string text;
  switch (codec) {
    case Codec::kFp32: text = "fp32"; break;
    case Codec::kFp16: text = "fp16"; break;
    case Codec::kBf16: text = "bf16"; break;
    case Codec::kInt8:
    case Codec::kInt4:
      text = std::string(codec == Codec::kInt8 ? "int8" : "int4") + ":block=" + std::to_string(block) +
             (fp16_scales ? ",scale=fp16" : "");
      break;
    case Codec::kTopk: text = "topk:block=" + std::to_string(block) + ",fraction=" + format_double(fraction); break;
  }
  if (text.empty()) return "codec(" + std::to_string(int(codec)) + ")";
  if (zstd) text += (text.find(':') == std::string::npos ? ":" : ",") + std::string("entropy=zstd");
  return text;
}

void validate(const CodecSpec& s) {
  const std::string what = "codec spec " + s.name() + ": ";
  switch (s.codec) {
    case Codec::kFp32:
    case Codec::kFp16:
    case Codec::kBf16:
      if (s.block != 0 || s.fp16_scales || s.fraction != 0.0)
        fail(what + "float codecs take no block, scale or fraction (leave them 0/false)");
      return;
    case Codec::kInt8:
    case Codec::kInt4:
    case Codec::kTopk:
      if (s.block < kMinBlock || s.block > kMaxBlock)
        fail(what + "block " + std::to_string(s.block) + " is outside 64..4096");
      if (s.codec == Codec::kTopk) {
        if (s.fp16_scales) fail(what + "topk stores fp32 values; scale=fp16 does not apply");
        if (!(s.fraction > 0.0 && s.fraction <= 1.0))
          fail(what + "fraction " + format_double(s.fraction) + " is outside (0, 1]");
      } else if (s.fraction != 0.0) {
        fail(what + "fraction applies to topk only");
      }
      return;
  }
  fail("codec spec: unknown codec id " + std::to_string(int(s.codec)) + "; " + kAccepted);
}

CodecSpec parse_codec(const std::string& text) {
  if (text.size() > kMaxCodecTextBytes)
    fail("codec text is " + std::to_string(text.size()) + " bytes, over the limit of " +
         std::to_string(kMaxCodecTextBytes) + " (\"" + printable(text) + "\"); " + kAccepted);
  const std::string bad = "bad codec \"" + printable(text) + "\": ";
  const size_t colon = text.find(':');
  const std::string base = text.substr(0, colon);
  CodecSpec s;
  if (base == "fp32") s.codec = Codec::kFp32;
  else if (base == "fp16") s.codec = Codec::kFp16;
  else if (base == "bf16") s.codec = Codec::kBf16;
  else if (base == "int8") s.codec = Codec::kInt8;
  else if (base == "int4") s.codec = Codec::kInt4;
  else if (base == "topk") s.codec = Codec::kTopk;
  else fail(bad + "unknown codec \"" + printable(base) + "\"; " + kAccepted);

  const bool quant = s.codec == Codec::kInt8 || s.codec == Codec::kInt4;
  const bool topk = s.codec == Codec::kTopk;
  if (quant) s.block = kDefaultBlock;
  if (topk) {
    s.block = kDefaultTopkBlock;
    s.fraction = kDefaultTopkFraction;
  }
  if (colon == std::string::npos) return s;

  bool seen_block = false, seen_scale = false, seen_fraction = false, seen_entropy = false;
  size_t at = colon + 1;
  while (true) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      fail(bad + "parameter \"" + printable(item) + "\" is not key=value; " + kAccepted);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "entropy") {
      if (seen_entropy) fail(bad + "entropy given twice");
      seen_entropy = true;
      if (value == "zstd") s.zstd = true;
      else if (value != "none") fail(bad + "entropy must be zstd or none, not \"" + printable(value) + "\"");
    } else if (!quant && !topk) {
      fail(bad + base + " takes no parameters but entropy; " + kAccepted);
    } else if (key == "block") {
      if (seen_block) fail(bad + "block given twice");
      seen_block = true;
      int b = 0;
      if (!parse_int(value, &b) || b < kMinBlock || b > kMaxBlock)
        fail(bad + "block \"" + printable(value) + "\" is not an integer in 64..4096");
      s.block = b;
    } else if (key == "scale" && quant) {
      if (seen_scale) fail(bad + "scale given twice");
      seen_scale = true;
      if (value == "fp16") s.fp16_scales = true;
      else if (value != "fp32") fail(bad + "scale must be fp32 or fp16, not \"" + printable(value) + "\"");
    } else if (key == "fraction" && topk) {
      if (seen_fraction) fail(bad + "fraction given twice");
      seen_fraction = true;
      double f = 0;
      const auto r = std::from_chars(value.data(), value.data() + value.size(), f);
      if (r.ec != std::errc() || r.ptr != value.data() + value.size() || !(f > 0.0 && f <= 1.0))
        fail(bad + "fraction \"" + printable(value) + "\" is not a number in (0, 1]");
      s.fraction = f;
    } else {
      fail(bad + "unknown parameter \"" + printable(key) + "\" for " + base + "; " + kAccepted);
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return s;
}

size_t encoded_bytes(const CodecSpec& spec, int64_t n) {
  validate(spec);
  layout::check_count(n);
  const size_t un = size_t(n);
  switch (spec.codec) {
    case Codec::kFp32: return 4 * un;
    case Codec::kFp16:
    case Codec::kBf16: return 2 * un;
    case Codec::kInt8: return size_t(layout::blocks(n, spec.block)) * layout::scale_bytes(spec) + un;
    case Codec::kInt4: return size_t(layout::blocks(n, spec.block)) * layout::scale_bytes(spec) + (un + 1) / 2;
    case Codec::kTopk: return 6 * size_t(layout::topk_total(spec, n));
  }
  return 0;  // unreachable: validate() rejects unknown codecs
}

}  // namespace swarm::compression
