// tests/checkpoint/shard_write_test.cc — write_rank_shard, the write of a rank's shard from
// memory laid out as its slices say (what a worker does with its committed snapshot): from
// page-aligned memory it goes around the page cache (direct I/O) with its unaligned tail
// buffered, and the checkpoint reads back whole; a full disk fails the write by its name
// and leaves no part that could pass for a finished one, and the same write succeeds once
// space is freed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr uint64_t kPage = 4096;

// `bytes` of page-aligned memory (as a snapshot segment's data is) with a pattern in it,
// and the one-rank part describing them as one u8 tensor.
struct AlignedShard {
  explicit AlignedShard(uint64_t n) : bytes(n) {
    const uint64_t alloc = (n + kPage - 1) / kPage * kPage;
    data.reset(static_cast<std::byte*>(std::aligned_alloc(kPage, alloc)));
    for (uint64_t i = 0; i < n; ++i) data.get()[i] = static_cast<std::byte>((i * 131 + i / 4096) & 0xff);
    part.step = 7;
    StoredSlice s;
    s.file = shard_file_name(0);
    s.length = n;
    s.box = {Range{0, static_cast<int64_t>(n)}};
    s.xxh64 = XXH64(data.get(), n, 0);
    part.tensors.push_back(TensorRecord{"w", DType::kU8, {static_cast<int64_t>(n)}, {s}});
  }
  ShardWrite write(const std::string& run_dir) const {
    ShardWrite w;
    w.run_dir = run_dir;
    w.part = &part;
    w.data = data.get();
    w.bytes = bytes;
    w.verify = true;
    w.chunk_bytes = 1u << 20;
    return w;
  }
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  uint64_t bytes;
  std::unique_ptr<std::byte, Free> data;
  ManifestPart part;
};

// Pages of `path`'s first `bytes` held in the page cache.
int64_t cached_pages(const std::string& path, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return -1;
  std::vector<unsigned char> v((bytes + kPage - 1) / kPage);
  int64_t n = -1;
  if (::mincore(m, bytes, v.data()) == 0) {
    n = 0;
    for (unsigned char c : v) n += c & 1;
  }
  ::munmap(m, bytes);
  return n;
}

TEST(ShardWrite, AlignedMemoryGoesAroundThePageCacheAndReadsBackWhole) {
  TempDir dir;
  const AlignedShard s((3u << 20) + 1000);  // an unaligned tail
  ASSERT_TRUE(write_rank_shard(s.write(dir.path())).ok());
  const std::string shard = (fs::path(dir.path()) / tmp_dir_name(7) / shard_file_name(0)).string();
  struct statfs sf {};
  ASSERT_EQ(::statfs(dir.path().c_str(), &sf), 0);
  // Where the file system takes direct I/O for real (ext4, xfs), the aligned part of the
  // shard was never in the page cache: nothing read it since.
  if (sf.f_type == 0xEF53 || sf.f_type == 0x58465342) {
    EXPECT_EQ(cached_pages(shard, s.bytes / kPage * kPage), 0) << "the shard went through the page cache";
  }
  FinalizeOptions fo;
  fo.world_size = 1;
  ASSERT_TRUE(finalize_checkpoint(dir.path(), 7, fo).ok());
  auto rd =
      CheckpointReader::open((fs::path(dir.path()) / step_dir_name(7)).string(), VerifyMode::kChecksums);
  ASSERT_TRUE(rd.ok()) << rd.status();
  Result<Tensor> back = (*rd)->read_full("w");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->nbytes(), s.bytes);
  EXPECT_EQ(std::memcmp(back->data_ptr(), s.data.get(), s.bytes), 0);
}

// A full disk: a small ext4 file system of its own (a loop device; root), most of it taken
// by a filler file. The write fails naming the reason, and the rank's part (its "done"
// marker) is not there; with the filler gone the same write succeeds.
TEST(ShardWrite, FullDiskFailsByNameWithoutAPartAndSucceedsOnceFreed) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a file system needs root (euid " << ::geteuid() << ")";
  TempDir dir;
  const std::string img = dir.sub("fs.img"), mnt = dir.sub("mnt");
  fs::create_directories(mnt);
  {
    std::ofstream f(img, std::ios::binary);
    f.seekp((8 << 20) - 1);
    f.put('\0');
  }
  const std::string mkfs = "mkfs.ext4 -q -F '" + img + "' >/dev/null 2>&1";
  if (std::system(mkfs.c_str()) != 0)
    GTEST_SKIP() << "`" << mkfs << "` failed (mkfs.ext4 is Debian's e2fsprogs)";
  const std::string mount = "mount -o loop '" + img + "' '" + mnt + "' >/dev/null 2>&1";
  if (std::system(mount.c_str()) != 0)
    GTEST_SKIP() << "`" << mount << "` failed (no free loop device, or a container without mount rights)";
  struct Unmount {
    std::string d;
    ~Unmount() { ::umount2(d.c_str(), MNT_DETACH); }
  } unmount{mnt};
  struct statfs sf {};
  ASSERT_EQ(::statfs(mnt.c_str(), &sf), 0);
  const uint64_t avail = static_cast<uint64_t>(sf.f_bavail) * static_cast<uint64_t>(sf.f_bsize);
  const std::string filler = mnt + "/filler";
  {
    std::ofstream f(filler, std::ios::binary);
    const std::string block(64 * 1024, 'x');
    for (uint64_t left = avail - (1u << 20); left >= block.size(); left -= block.size()) f << block;
    ASSERT_TRUE(f.good());
  }
  const AlignedShard s((3u << 20) + 1000);  // more than the ~1 MiB left
  const std::string run = mnt + "/ckpt";
  const Status st = write_rank_shard(s.write(run));
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.to_string().find("No space left on device"), std::string::npos) << st;
  EXPECT_FALSE(fs::exists(fs::path(run) / tmp_dir_name(7) / part_file_name(0)));
  fs::remove(filler);
  ASSERT_TRUE(write_rank_shard(s.write(run)).ok());
  FinalizeOptions fo;
  fo.world_size = 1;
  ASSERT_TRUE(finalize_checkpoint(run, 7, fo).ok());
  auto rd = CheckpointReader::open((fs::path(run) / step_dir_name(7)).string(), VerifyMode::kChecksums);
  ASSERT_TRUE(rd.ok()) << rd.status();
}

}  // namespace
}  // namespace troupe::checkpoint
