// checkpoint/file_io.h — defines the durable-file helpers the checkpoint code is built on:
// whole writes and reads at an offset, fsync of files and directories, write-to-temp +
// fsync + rename, and errors that name the path and the OS reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace troupe::checkpoint {

// IoError "<op> <path>: <strerror(errno)>" (NotFound for ENOENT).
Status errno_status(std::string_view op, const std::string& path, int err);

// An open file descriptor, closed on destruction.
class FileHandle {
 public:
  FileHandle() = default;
  explicit FileHandle(int fd) : fd_(fd) {}
  ~FileHandle();
  FileHandle(FileHandle&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  FileHandle& operator=(FileHandle&& o) noexcept;
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

Result<FileHandle> open_file(const std::string& path, int flags, int mode = 0644);
// Writes all `n` bytes at `offset` (retries short writes and EINTR).
Status pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path);
// Reads exactly `n` bytes at `offset`; DataLoss naming the path when the file is shorter.
Status pread_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path);
Status fsync_fd(int fd, const std::string& path);
Status fsync_dir(const std::string& dir);
Result<uint64_t> file_size(const std::string& path);
Result<std::string> read_whole_file(const std::string& path);
// Writes `bytes` as the whole of `path` (created or truncated), fsynced when `fsync`. No
// rename: for a file inside a directory that is itself renamed into place afterwards.
Status write_file(const std::string& path, std::string_view bytes, bool fsync);
// Writes `bytes` to `path.tmp`, fsyncs it, renames it to `path` and fsyncs the directory:
// readers see the old file or the whole new one, never a part.
Status write_file_durably(const std::string& path, std::string_view bytes);
// mkdir -p; OK when it exists.
Status make_dirs(const std::string& path);

}  // namespace troupe::checkpoint
