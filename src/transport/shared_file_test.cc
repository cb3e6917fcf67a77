// Mapping a peer's shared-memory file (shared_file.h), and a device's shared
// registration reaching a same-host peer as mapped memory.
#include "src/transport/shared_file.h"

#include <cstdio>
#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include "membox/transport/channel.h"
#include "membox/transport/device.h"

namespace membox::transport {
namespace {

using namespace std::chrono_literals;

// A memfd of `bytes`, mapped shared here: what torch's share_memory_()
// makes of a tensor (an unlinked file in /dev/shm).
struct SharedBuffer {
  explicit SharedBuffer(size_t bytes) : size(bytes) {
    fd = memfd_create("membox-test", MFD_CLOEXEC);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    data = static_cast<uint8_t*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(data, MAP_FAILED);
  }
  ~SharedBuffer() {
    munmap(data, size);
    close(fd);
  }
  size_t size;
  int fd;
  uint8_t* data;
};

// A proof file holding `value`, as a device keeps one.
int ProofFile(const std::array<uint8_t, 16>& value) {
  int fd = memfd_create("membox-test-proof", MFD_CLOEXEC);
  EXPECT_EQ(pwrite(fd, value.data(), value.size(), 0), 16);
  return fd;
}

RegionDescriptor Describe(const SharedBuffer& b, uint64_t offset, size_t len,
                          int proof_fd, const std::array<uint8_t, 16>& proof) {
  RegionDescriptor d;
  d.address = reinterpret_cast<uint64_t>(b.data + offset);
  d.length = len;
  SharedFile f;
  f.pid = static_cast<uint32_t>(getpid());
  f.fd = b.fd;
  f.offset = offset;
  f.proof_fd = proof_fd;
  f.proof = proof;
  d.shared_file = f;
  return d;
}

TEST(SharedFileTest, MapsTheRangeBothWays) {
  SharedBuffer b(3 * 4096);
  std::array<uint8_t, 16> proof{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  int pf = ProofFile(proof);
  // An offset that is not page-aligned: the mapping starts at its page.
  auto m = MapSharedFile(Describe(b, 4096 + 100, 8000, pf, proof));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto* seen = static_cast<uint8_t*>(m->data());
  b.data[4096 + 100] = 42;
  EXPECT_EQ(seen[0], 42);
  seen[7999] = 7;  // a store through the mapping lands in the owner's memory
  EXPECT_EQ(b.data[4096 + 100 + 7999], 7);
  m->Reset();
  EXPECT_EQ(m->data(), nullptr);
  close(pf);
}

TEST(SharedFileTest, RefusesAnotherProcessOrAWrongFile) {
  SharedBuffer b(4096);
  std::array<uint8_t, 16> proof{9, 9, 9};
  int pf = ProofFile(proof);
  auto wrong = proof;
  wrong[0] ^= 1;
  EXPECT_EQ(MapSharedFile(Describe(b, 0, 4096, pf, wrong)).status().code(),
            StatusCode::kPermissionDenied);
  // A process that does not hold the proof at that descriptor (pid 1).
  RegionDescriptor other = Describe(b, 0, 4096, pf, proof);
  other.shared_file->pid = 1;
  EXPECT_FALSE(MapSharedFile(other).ok());
  // Too short for the range.
  EXPECT_EQ(MapSharedFile(Describe(b, 100, 4096, pf, proof)).status().code(),
            StatusCode::kOutOfRange);
  // A file with a name on disk is never mapped, even with the right proof.
  char path[] = "/tmp/membox-shared-XXXXXX";
  int named = mkstemp(path);
  ASSERT_GE(named, 0);
  ASSERT_EQ(ftruncate(named, 4096), 0);
  RegionDescriptor disk = Describe(b, 0, 4096, pf, proof);
  disk.shared_file->fd = named;
  EXPECT_EQ(MapSharedFile(disk).status().code(), StatusCode::kPermissionDenied);
  unlink(path);
  close(named);
  // A descriptor that is not a file (a pipe) is refused without opening it.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  RegionDescriptor fifo = Describe(b, 0, 4096, pf, proof);
  fifo.shared_file->fd = pipe_fds[0];
  EXPECT_EQ(MapSharedFile(fifo).status().code(), StatusCode::kPermissionDenied);
  RegionDescriptor fifo_proof = Describe(b, 0, 4096, pipe_fds[0], proof);
  EXPECT_EQ(MapSharedFile(fifo_proof).status().code(),
            StatusCode::kPermissionDenied);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  // No such descriptor in this process.
  RegionDescriptor gone = Describe(b, 0, 4096, pf, proof);
  gone.shared_file->fd = 1 << 20;
  EXPECT_EQ(MapSharedFile(gone).status().code(), StatusCode::kUnavailable);
  RegionDescriptor none;
  none.length = 1;
  EXPECT_EQ(MapSharedFile(none).status().code(), StatusCode::kInvalidArgument);
  close(pf);
}

// Two devices in one process share a host: a shared registration is mapped
// by the importer (user memory registered without a file is not).
TEST(SharedFileTest, SharedRegistrationIsMappedBySameHostPeer) {
  DeviceOptions so;
  so.listen_address = "127.0.0.1:0";
  so.name = "server";
  auto server = Device::Create(so);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  DeviceOptions co = so;
  co.listen_address = "";
  co.name = "client";
  auto client = Device::Create(co);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto ch = (*client)->GetChannel((*server)->listen_endpoint(), 0);
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  auto sch = (*server)->Accept(10s);
  ASSERT_TRUE(sch.ok()) << sch.status().ToString();
  if ((*sch)->protocol() != Protocol::kMapped) {
    GTEST_SKIP() << "no shared-memory transport here";
  }
  SharedBuffer b(2 * 4096);
  auto reg = (*client)->RegisterSharedMemRegion(b.data + 64, 5000, b.fd, 64);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  auto imp = (*sch)->Import((*reg)->Export());
  ASSERT_TRUE(imp.ok()) << imp.status().ToString();
  auto* seen = static_cast<uint8_t*>((*imp)->mapped());
  ASSERT_NE(seen, nullptr);
  b.data[64 + 4999] = 5;
  EXPECT_EQ(seen[4999], 5);
  seen[0] = 3;
  EXPECT_EQ(b.data[64], 3);
  // Memory-to-memory copies through the channel use the mapping too.
  auto local = (*server)->AllocateMemRegion(4096);
  ASSERT_TRUE(local.ok());
  std::memset((*local)->data(), 11, 100);
  auto h = (*sch)->Memcpy((*local)->data(), **local, (*imp)->address() + 10,
                          **imp, 100, Direction::kWrite);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(h->Wait(10s).ok());
  EXPECT_EQ(b.data[64 + 10], 11);
  EXPECT_EQ(b.data[64 + 109], 11);

  // Registering a file that is too short, or no file, is refused.
  EXPECT_EQ((*client)
                ->RegisterSharedMemRegion(b.data, 4096, b.fd, 8192)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      (*client)->RegisterSharedMemRegion(b.data, 4096, -1, 0).status().code(),
      StatusCode::kInvalidArgument);
  imp->reset();
  ch->reset();
  sch->reset();
}

}  // namespace
}  // namespace membox::transport
