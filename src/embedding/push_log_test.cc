// The push log's format alone: what is appended reads back, a torn or
// corrupt tail is cut (what came before is kept), a file that is not a
// push log is refused, and Truncate empties it.
#include "src/embedding/push_log.h"

#include <filesystem>

#include <gtest/gtest.h>
#include <unistd.h>

#include "tests/support/testing.h"

namespace membox::embedding {
namespace {

PushLogRecord Record(uint64_t first_key, uint8_t fill) {
  PushLogRecord r;
  for (int t = 0; t < 2; ++t) {
    PushLogSection s;
    s.table = t ? "ads" : "users";
    s.row_bytes = 8;
    s.keys = {first_key, first_key + 1, first_key + 7};
    s.rows.assign(s.keys.size() * s.row_bytes, static_cast<uint8_t>(fill + t));
    r.sections.push_back(std::move(s));
  }
  r.applied = {{first_key * 3, first_key - 1, first_key}, {7, 0, fill}};
  return r;
}

class PushLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_support::FreshTestDir("pushlog");
    path_ = (dir_ / "PUSHLOG").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string path_;
};

TEST_F(PushLogTest, WhatIsAppendedReadsBackInOrder) {
  {
    auto log = PushLog::Open(path_);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    ASSERT_TRUE((*log)->Append(Record(10, 1)).ok());
    ASSERT_TRUE((*log)->Append(Record(20, 5)).ok());
    EXPECT_EQ((*log)->appends(), 2u);
  }
  // Reopened (a restart): appends go after what is there.
  auto log = PushLog::Open(path_);
  ASSERT_TRUE(log.ok());
  ASSERT_TRUE((*log)->Append(Record(30, 9)).ok());
  std::vector<PushLogRecord> recs;
  uint64_t cut = 1;
  ASSERT_TRUE(PushLog::Read(path_, &recs, &cut).ok());
  EXPECT_EQ(cut, 0u);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[1].sections[0].table, "users");
  EXPECT_EQ(recs[1].sections[1].table, "ads");
  EXPECT_EQ(recs[2].sections[1].keys, (std::vector<uint64_t>{30, 31, 37}));
  EXPECT_EQ(recs[2].sections[1].rows, std::vector<uint8_t>(24, 10));
  EXPECT_EQ(recs[2].applied, Record(30, 9).applied);
  ASSERT_TRUE((*log)->Truncate().ok());
  ASSERT_TRUE(PushLog::Read(path_, &recs, &cut).ok());
  EXPECT_TRUE(recs.empty());
  EXPECT_EQ((*log)->bytes(), 8u);
  // Truncated with a first record: what a flush leaves (who applied what).
  PushLogRecord clients;
  clients.applied = {{11, 4, 0}, {12, 9, 11}};
  ASSERT_TRUE((*log)->Truncate(&clients).ok());
  ASSERT_TRUE(PushLog::Read(path_, &recs, &cut).ok());
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_TRUE(recs[0].sections.empty());
  EXPECT_EQ(recs[0].applied, clients.applied);
}

TEST_F(PushLogTest, AFormatOneLogStillReads) {
  std::vector<uint8_t> file = {'M', 'B', 'X', 'P', 'L', 'O', 'G', '1'};
  auto a = PushLog::Encode(Record(1, 1), 1);
  file.insert(file.end(), a.begin(), a.end());
  std::vector<PushLogRecord> recs;
  uint64_t cut = 1;
  int version = 0;
  ASSERT_TRUE(PushLog::Parse(file, &recs, &cut, &version).ok());
  EXPECT_EQ(version, 1);
  EXPECT_EQ(cut, 0u);
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].sections.size(), 2u);
  EXPECT_TRUE(recs[0].applied.empty());
  // Format 2 bytes under a format 1 header do not parse exactly: cut.
  auto b = PushLog::Encode(Record(2, 2));
  file.insert(file.end(), b.begin(), b.end());
  ASSERT_TRUE(PushLog::Parse(file, &recs, &cut).ok());
  EXPECT_EQ(recs.size(), 1u);
  EXPECT_EQ(cut, b.size());
}

TEST_F(PushLogTest, ATornOrCorruptTailIsCutAndTheRestKept) {
  std::vector<uint8_t> file = {'M', 'B', 'X', 'P', 'L', 'O', 'G', '2'};
  auto a = PushLog::Encode(Record(1, 1));
  auto b = PushLog::Encode(Record(2, 2));
  file.insert(file.end(), a.begin(), a.end());
  file.insert(file.end(), b.begin(), b.end());
  std::vector<PushLogRecord> recs;
  uint64_t cut = 0;
  // Torn anywhere inside the second record: the first survives.
  for (size_t keep = a.size() + 8; keep < file.size(); keep += 7) {
    std::vector<uint8_t> torn(file.begin(), file.begin() + keep);
    ASSERT_TRUE(PushLog::Parse(torn, &recs, &cut).ok());
    ASSERT_EQ(recs.size(), 1u) << keep;
    EXPECT_EQ(cut, keep - 8 - a.size());
  }
  // A flipped byte in the first record's payload: nothing is trusted after.
  std::vector<uint8_t> bad = file;
  bad[8 + 8 + 5] ^= 0x40;
  ASSERT_TRUE(PushLog::Parse(bad, &recs, &cut).ok());
  EXPECT_TRUE(recs.empty());
  EXPECT_EQ(cut, file.size() - 8);
  // Not a push log at all.
  std::vector<uint8_t> other = file;
  other[0] = 'X';
  EXPECT_EQ(PushLog::Parse(other, &recs, &cut).code(), StatusCode::kDataLoss);
  // A missing file has no records.
  ASSERT_TRUE(PushLog::Read((dir_ / "none").string(), &recs, &cut).ok());
  EXPECT_TRUE(recs.empty());
}

}  // namespace
}  // namespace membox::embedding
