// fs.h: durable file writes, shared by every file the project writes for later (checkpoints,
// the router's job records and progress): write, fsync, rename into place, fsync the directory.
//
// Defines swarm::fs_util::write_file_synced, fsync_dir, make_dirs and write_file_atomic. Each
// failure is an InputError "cannot write WHAT: STEP PATH: errno text", so a full disk or a
// read-only directory reads as what it is.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace swarm::fs_util {

// An open file descriptor, closed when it goes out of scope.
class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Throws InputError "cannot write WHAT: STEP PATH: strerror(err)".
[[noreturn]] void fail_write(const std::string& what, const std::string& step, const std::string& path, int err);

// Writes the pieces into `path` (created or truncated, mode 0644) and fsyncs it.
void write_file_synced(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces,
                       const std::string& what);
// fsyncs a directory, so that a rename or a new entry in it survives a crash.
void fsync_dir(const std::string& path, const std::string& what);
// Creates `dir` and its parents when missing; fails when it exists and is not a directory.
void make_dirs(const std::string& dir, const std::string& what);
// `content` into `path` atomically: a temp file beside it, fsynced, renamed over `path`, then the
// directory fsynced. Readers see the old file or the new one, never a part. Creates the directory.
void write_file_atomic(const std::string& path, const std::string& content, const std::string& what);

}  // namespace swarm::fs_util
