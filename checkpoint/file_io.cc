// checkpoint/file_io.cc — POSIX file helpers with errors naming the path.
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace troupe::checkpoint {

Status errno_status(std::string_view op, const std::string& path, int err) {
  if (err == ENOENT) return not_found("{} {}: {}", op, path, std::strerror(err));
  return io_error("{} {}: {}", op, path, std::strerror(err));
}

FileHandle::~FileHandle() {
  if (fd_ >= 0) ::close(fd_);
}

FileHandle& FileHandle::operator=(FileHandle&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Result<FileHandle> open_file(const std::string& path, int flags, int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return errno_status("open", path, errno);
  return FileHandle(fd);
}

Status pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno_status("write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return ok_status();
}

Status pread_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  const uint64_t want_end = offset + n;
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status("read", path, errno);
    }
    if (r == 0) {
      return data_loss("{} is truncated: it ends at byte {} but bytes up to {} are needed", path, offset, want_end);
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return ok_status();
}

Status fsync_fd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return errno_status("fsync", path, errno);
  return ok_status();
}

Status fsync_dir(const std::string& dir) {
  TROUPE_ASSIGN_OR_RETURN(FileHandle h, open_file(dir, O_RDONLY | O_DIRECTORY));
  return fsync_fd(h.fd(), dir);
}

Result<uint64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno_status("stat", path, errno);
  return static_cast<uint64_t>(st.st_size);
}

Result<std::string> read_whole_file(const std::string& path) {
  TROUPE_ASSIGN_OR_RETURN(FileHandle h, open_file(path, O_RDONLY));
  struct stat st {};
  if (::fstat(h.fd(), &st) != 0) return errno_status("stat", path, errno);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  TROUPE_RETURN_IF_ERROR(pread_all(h.fd(), out.data(), out.size(), 0, path));
  return out;
}

Status write_file(const std::string& path, std::string_view bytes, bool fsync) {
  TROUPE_ASSIGN_OR_RETURN(FileHandle h, open_file(path, O_WRONLY | O_CREAT | O_TRUNC));
  TROUPE_RETURN_IF_ERROR(pwrite_all(h.fd(), bytes.data(), bytes.size(), 0, path));
  return fsync ? fsync_fd(h.fd(), path) : ok_status();
}

Status write_file_durably(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  TROUPE_RETURN_IF_ERROR(write_file(tmp, bytes, /*fsync=*/true));
  if (::rename(tmp.c_str(), path.c_str()) != 0) return errno_status("rename to " + path, tmp, errno);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return fsync_dir(dir.empty() ? "." : dir);
}

Status make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return io_error("mkdir -p {}: {}", path, ec.message());
  return ok_status();
}

}  // namespace troupe::checkpoint
