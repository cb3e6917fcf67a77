#include "membox/base/durable_file.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

namespace membox {
namespace {

namespace fs = std::filesystem;

std::string Read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class DurableFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("durable-file-test-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  size_t Files() const {
    return std::distance(fs::directory_iterator(dir_), {});
  }
  fs::path dir_;
};

TEST_F(DurableFileTest, ReplacesTheFileWhole) {
  const std::string path = (dir_ / "STATE").string();
  const std::string a = "first", b = "second, longer";
  ASSERT_TRUE(
      ReplaceFileDurably(
          path, std::span(reinterpret_cast<const uint8_t*>(a.data()), a.size()))
          .ok());
  EXPECT_EQ(Read(path), a);
  // Written in pieces through the sink.
  ASSERT_TRUE(ReplaceFileDurably(path, [&](const FileSink& sink) {
                Status st = sink(b.data(), 6);
                return st.ok() ? sink(b.data() + 6, b.size() - 6) : st;
              }).ok());
  EXPECT_EQ(Read(path), b);
  EXPECT_EQ(Files(), 1u) << "no temporary file left";
}

TEST_F(DurableFileTest, AFailedFillLeavesTheOldFileAndNoTemporary) {
  const std::string path = (dir_ / "STATE").string();
  const std::string a = "kept";
  ASSERT_TRUE(
      ReplaceFileDurably(
          path, std::span(reinterpret_cast<const uint8_t*>(a.data()), a.size()))
          .ok());
  Status st = ReplaceFileDurably(path, [](const FileSink& sink) {
    Status s = sink("partial", 7);
    return s.ok() ? DataLossError("the encoder gave up") : s;
  });
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_EQ(Read(path), a);
  EXPECT_EQ(Files(), 1u);
}

TEST_F(DurableFileTest, ErrorsNameTheFile) {
  const std::string missing = (dir_ / "no-such-dir" / "STATE").string();
  Status st = ReplaceFileDurably(missing, std::span<const uint8_t>());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find(missing), std::string::npos) << st.ToString();
  st = SyncDirectory((dir_ / "no-such-dir").string());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("no-such-dir"), std::string::npos);
  EXPECT_TRUE(SyncDirectory(dir_.string()).ok());
}

}  // namespace
}  // namespace membox
