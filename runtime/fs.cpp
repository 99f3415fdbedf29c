// fs.cpp: implements runtime/fs.h on POSIX files.
#include "runtime/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "runtime/errors.h"

namespace swarm::fs_util {

namespace {

void write_all(int fd, const void* data, size_t n, const std::string& path, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_write(what, "write", path, errno);
    }
    p += w;
    n -= size_t(w);
  }
}

std::atomic<uint64_t> g_counter{0};

}  // namespace

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

void fail_write(const std::string& what, const std::string& step, const std::string& path, int err) {
  throw InputError("cannot write " + what + ": " + step + " " + path + ": " + std::strerror(err));
}

void write_file_synced(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces,
                       const std::string& what) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail_write(what, "create", path, errno);
  for (const auto& [data, n] : pieces) write_all(fd.get(), data, n, path, what);
  if (::fsync(fd.get()) != 0) fail_write(what, "fsync", path, errno);
  if (::close(fd.release()) != 0) fail_write(what, "close", path, errno);
}

void fsync_dir(const std::string& path, const std::string& what) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail_write(what, "open directory", path, errno);
  if (::fsync(fd.get()) != 0 && errno != EINVAL) fail_write(what, "fsync directory", path, errno);
}

void make_dirs(const std::string& dir, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError("cannot write " + what + ": create directory " + dir + ": " + ec.message());
  if (!fs::is_directory(dir, ec)) throw InputError("cannot write " + what + ": " + dir + " exists and is not a directory");
}

void write_file_atomic(const std::string& path, const std::string& content, const std::string& what) {
  const std::filesystem::path p(path);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  make_dirs(dir, what);
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(g_counter++);
  try {
    write_file_synced(tmp, {{content.data(), content.size()}}, what);
    if (::rename(tmp.c_str(), path.c_str()) != 0) fail_write(what, "rename to", path, errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir, what);
}

}  // namespace swarm::fs_util
