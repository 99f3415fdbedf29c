// keys.cpp: implements runtime/keys.h.
#include "runtime/keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <xxhash.h>

#include "runtime/errors.h"
#include "runtime/fs.h"

namespace swarm {

namespace {

[[noreturn]] void fail(const std::string& what) { throw InputError(what); }

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::string read_text(const std::string& path, const char* what) {
  std::ifstream f(path);
  if (!f) fail(std::string("cannot read ") + what + " " + path + "; make one with `swarm keygen --out NAME`");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

bool valid_z85_key(const std::string& k) {
  if (k.size() != 40) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, k.c_str()) != nullptr;
}

KeyPair generate_keypair() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) fail("this libzmq cannot make CURVE keys (built without libsodium?)");
  return KeyPair{pub, sec};
}

void write_keypair(const std::string& base, const KeyPair& k) {
  for (const char* ext : {".key", ".pub"}) {
    struct stat st;
    if (::stat((base + ext).c_str(), &st) == 0) fail(base + ext + " exists; choose another --out or remove it first");
  }
  const std::string secret = "# swarm keypair: keep this file private\npublic " + k.public_key + "\nsecret " + k.secret_key + "\n";
  // Created private (0600) and exclusive: the secret is never readable by others, not even briefly.
  const int fd = ::open((base + ".key").c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) fail("cannot create " + base + ".key: " + std::strerror(errno));
  const bool ok = ::write(fd, secret.data(), secret.size()) == ssize_t(secret.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) fail("cannot write " + base + ".key");
  fs_util::write_file_atomic(base + ".pub", k.public_key + "\n", "the public key file");
}

KeyPair read_keypair(const std::string& path_in) {
  std::string path = path_in;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 && ::stat((path + ".key").c_str(), &st) == 0) path += ".key";
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 0077))
    fail(path + " can be read by other users; chmod 600 " + path);
  std::istringstream in(read_text(path, "key file"));
  KeyPair k;
  for (std::string line; std::getline(in, line);) {
    line = trim(line);
    if (line.rfind("public ", 0) == 0) k.public_key = trim(line.substr(7));
    if (line.rfind("secret ", 0) == 0) k.secret_key = trim(line.substr(7));
  }
  if (!valid_z85_key(k.public_key) || !valid_z85_key(k.secret_key))
    fail(path + " is not a swarm key file (lines `public KEY` and `secret KEY`, 40 characters of Z85 each)");
  return k;
}

std::string read_public_key(const std::string& text_or_path) {
  if (valid_z85_key(text_or_path)) return text_or_path;
  std::istringstream in(read_text(text_or_path, "public key file"));
  for (std::string line; std::getline(in, line);) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("public ", 0) == 0) line = trim(line.substr(7));
    if (valid_z85_key(line)) return line;
    if (line.rfind("secret ", 0) != 0) break;
  }
  fail(text_or_path + " is neither a public key (40 characters of Z85) nor a file holding one");
}

const char* role_name(Role r) {
  switch (r) {
    case Role::kStage: return "stage";
    case Role::kClient: return "client";
    case Role::kAdmin: return "admin";
  }
  return "?";
}

std::vector<Authorized> read_authorized(const std::string& path) {
  std::istringstream in(read_text(path, "authorized keys file"));
  std::vector<Authorized> out;
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    std::istringstream f(line);
    std::string key, role, name;
    f >> key >> role;
    std::getline(f, name);
    name = trim(name);
    const std::string where = path + ":" + std::to_string(n) + ": ";
    if (!valid_z85_key(key)) fail(where + "expected `KEY ROLE NAME` with KEY the 40 characters of a .pub file");
    Authorized a;
    a.key = key;
    if (role == "stage") a.role = Role::kStage;
    else if (role == "client") a.role = Role::kClient;
    else if (role == "admin") a.role = Role::kAdmin;
    else fail(where + "role \"" + role + "\" is not one of stage, client, admin");
    a.name = name.empty() ? key.substr(0, 8) : name.substr(0, 64);
    for (const auto& b : out)
      if (b.key == a.key) fail(where + "key listed twice (first as " + b.name + ")");
    out.push_back(std::move(a));
  }
  return out;
}

std::string routing_id_of(const std::string& public_key) {
  const uint64_t h1 = XXH3_64bits_withSeed(public_key.data(), public_key.size(), 1);
  const uint64_t h2 = XXH3_64bits_withSeed(public_key.data(), public_key.size(), 2);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "k-%016llx%08llx", static_cast<unsigned long long>(h1), static_cast<unsigned long long>(h2 >> 32));
  return buf;
}

void curve_server(zmq::socket_t& s, const KeyPair& own, const std::string& domain) {
  s.set(zmq::sockopt::curve_server, 1);
  s.set(zmq::sockopt::curve_secretkey, own.secret_key);
  s.set(zmq::sockopt::zap_domain, domain);
}

void curve_client(zmq::socket_t& s, const KeyPair& own, const std::string& server_key) {
  s.set(zmq::sockopt::curve_serverkey, server_key);
  s.set(zmq::sockopt::curve_publickey, own.public_key);
  s.set(zmq::sockopt::curve_secretkey, own.secret_key);
}

struct ZapHandler::Impl {
  zmq::socket_t sock;
  Allow allow;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> refused{0};
  std::thread thread;

  Impl(zmq::context_t& ctx, Allow a) : sock(ctx, zmq::socket_type::rep), allow(std::move(a)) {
    sock.set(zmq::sockopt::linger, 0);
    sock.bind("inproc://zeromq.zap.01");
    thread = std::thread([this] { run(); });
  }

  void run() {
    while (!stop) {
      zmq::pollitem_t items[] = {{sock.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 1, std::chrono::milliseconds(100));
      } catch (const zmq::error_t&) {
        return;  // the context is going away
      }
      if (!(items[0].revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> req;
      for (;;) {
        zmq::message_t part;
        if (!sock.recv(part, zmq::recv_flags::none)) break;
        const bool more = part.more();
        req.push_back(std::move(part));
        if (!more) break;
      }
      // [version, request id, domain, address, routing id, mechanism, credentials...]
      std::string key, address, status = "400", text = "not authorized";
      std::optional<Identity> who;
      if (req.size() >= 7 && req[5].to_string() == "CURVE" && req[6].size() == 32) {
        char z85[41];
        zmq_z85_encode(z85, static_cast<const uint8_t*>(req[6].data()), 32);
        key = z85;
        address = req[3].to_string();
        who = allow(key, address);
      }
      if (who) {
        status = "200";
        text = "OK";
      } else {
        refused++;
      }
      const std::string version = req.empty() ? "1.0" : req[0].to_string();
      const std::string id = req.size() > 1 ? req[1].to_string() : "";
      sock.send(zmq::buffer(version), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(id), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(status), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(text), zmq::send_flags::sndmore);
      sock.send(zmq::buffer(who ? key : std::string()), zmq::send_flags::sndmore);  // User-Id: the key
      sock.send(zmq::message_t(), zmq::send_flags::none);                           // no metadata
    }
  }
};

ZapHandler::ZapHandler(zmq::context_t& ctx, Allow allow) : impl_(std::make_unique<Impl>(ctx, std::move(allow))) {}
ZapHandler::~ZapHandler() {
  impl_->stop = true;
  impl_->thread.join();
}
uint64_t ZapHandler::refused() const { return impl_->refused.load(); }

std::string authenticated_key(const zmq::message_t& frame) {
  const char* v = zmq_msg_gets(frame.handle(), "User-Id");
  return v ? std::string(v) : std::string();
}

bool from_remote_host(const zmq::message_t& frame) {
  const char* v = zmq_msg_gets(frame.handle(), "Peer-Address");
  if (!v || !*v) return false;
  const std::string a(v);
  return !(a.rfind("127.", 0) == 0 || a == "::1" || a.rfind("::ffff:127.", 0) == 0);
}

}  // namespace swarm
