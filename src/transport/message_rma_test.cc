// MessageRma alone: a requester and an owner exchange the headers the
// channels would carry, with the owner's export table behind a fake host.
#include "src/transport/message_rma.h"

#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "membox/base/wire.h"

namespace membox::transport {
namespace {

class FakeHost final : public ChannelHost {
 public:
  EventCount* events() override { return &events_; }
  Status CheckAccess(uint64_t region_id, const Token128& token, uint64_t addr,
                     uint64_t len, bool host_memory) override {
    return table.Check(region_id, token, addr, len, host_memory);
  }
  Result<ExportTable::Lease> AcquireAccess(uint64_t region_id,
                                           const Token128& token, uint64_t addr,
                                           uint64_t len, bool host_memory,
                                           ExportTable::Fence fence) override {
    return table.Acquire(region_id, token, addr, len, host_memory,
                         std::move(fence));
  }
  bool CheckRkeyCrc(uint64_t region_id, uint32_t crc) override {
    return table.CheckRkeyCrc(region_id, crc);
  }
  ExportTable table;

 private:
  EventCount events_;
};

class MessageRmaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    memory_.assign(4096, 0);
    for (size_t i = 0; i < memory_.size(); ++i) {
      memory_[i] = static_cast<uint8_t>(i * 7);
    }
    desc_.address = reinterpret_cast<uint64_t>(memory_.data());
    desc_.length = memory_.size();
    desc_.region_id = 5;
    desc_.token = Token128::Random();
    desc_.packed_rkey = {1, 2, 3, 4};
    ExportTable::Entry e;
    e.address = desc_.address;
    e.length = desc_.length;
    e.token = desc_.token;
    e.rkey_crc = wire::Crc32(desc_.packed_rkey.data(), 4);
    owner_host_.table.Register(desc_.region_id, e);
  }
  std::shared_ptr<OpState> NewState() {
    return std::make_shared<OpState>(requester_host_.events());
  }
  static ExportTable::Fence NoFence() {
    return [] {};
  }

  FakeHost requester_host_;
  FakeHost owner_host_;
  MessageRma requester_{&requester_host_, true};
  MessageRma owner_{&owner_host_, true};
  std::vector<uint8_t> memory_;  // the owner's exported region
  RegionDescriptor desc_;
};

TEST_F(MessageRmaTest, ValidateChecksTokenRangeAndKeyBytes) {
  auto ok = NewState();
  auto req = requester_.Validate(desc_, ok);
  ASSERT_TRUE(req.ok());
  EXPECT_EQ(requester_.pending(), 1u);
  auto answer = owner_.AnswerValidate(req->header);
  ASSERT_TRUE(answer.ok());
  ASSERT_TRUE(requester_.OnValidateAnswer(*answer).ok());
  EXPECT_TRUE(ok->done());
  EXPECT_TRUE(ok->status().ok());
  EXPECT_EQ(requester_.pending(), 0u);

  RegionDescriptor forged = desc_;
  forged.token.lo ^= 1;
  auto bad_token = NewState();
  req = requester_.Validate(forged, bad_token);
  ASSERT_TRUE(
      requester_.OnValidateAnswer(*owner_.AnswerValidate(req->header)).ok());
  EXPECT_EQ(bad_token->status().code(), StatusCode::kPermissionDenied);

  RegionDescriptor other_key = desc_;
  other_key.packed_rkey = {9};
  auto bad_key = NewState();
  req = requester_.Validate(other_key, bad_key);
  ASSERT_TRUE(
      requester_.OnValidateAnswer(*owner_.AnswerValidate(req->header)).ok());
  EXPECT_EQ(bad_key->status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(bad_key->status().message().find("remote key bytes"),
            std::string::npos);

  // An answer is taken once: the same answer again names no request.
  EXPECT_FALSE(requester_.OnValidateAnswer(*answer).ok());
}

TEST_F(MessageRmaTest, AnImportCheckSendsWaitsAndGivesUpAtItsDeadline) {
  using namespace std::chrono_literals;
  // Answered while waiting: the owner's verdict is the result.
  std::thread owner;
  Status s = requester_.CheckWithOwner(
      desc_, NewState(), 10s, [&](const MessageRma::Request& r) {
        owner = std::thread([this, header = r.header] {
          auto a = owner_.AnswerValidate(header);
          ASSERT_TRUE(a.ok());
          ASSERT_TRUE(requester_.OnValidateAnswer(*a).ok());
        });
        return Status::Ok();
      });
  owner.join();
  EXPECT_TRUE(s.ok()) << s.ToString();

  // Not sent: withdrawn, the error names the region.
  s = requester_.CheckWithOwner(
      desc_, NewState(), 10s,
      [](const MessageRma::Request&) { return UnavailableError("gone"); });
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("import of region 5"), std::string::npos);
  EXPECT_EQ(requester_.pending(), 0u);

  // No answer in time: given up, but a late answer is still taken.
  std::vector<uint8_t> sent;
  s = requester_.CheckWithOwner(desc_, NewState(), 20ms,
                                [&](const MessageRma::Request& r) {
                                  sent = r.header;
                                  return Status::Ok();
                                });
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(requester_.pending(), 1u);
  EXPECT_TRUE(requester_.OnValidateAnswer(*owner_.AnswerValidate(sent)).ok());
  EXPECT_EQ(requester_.pending(), 0u);
}

TEST_F(MessageRmaTest, ReadIsAnsweredFromTheRegionUnderALease) {
  std::vector<uint8_t> local(100, 0);
  auto st = NewState();
  auto req = requester_.Read(local.data(), local.size(), desc_.address + 10,
                             desc_, st);
  ASSERT_TRUE(req.ok());
  auto a = owner_.AnswerRead(req->header, NoFence());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->src, memory_.data() + 10);
  EXPECT_EQ(a->len, 100u);
  EXPECT_EQ(owner_host_.table.leases(), 1u);  // held until sent
  auto target = requester_.OnReadAnswer(a->header, a->len);
  ASSERT_TRUE(target.ok());
  ASSERT_EQ(target->local, local.data());
  std::memcpy(target->local, a->src, a->len);  // what the channel does
  a->lease.reset();
  target->state->Complete(Status::Ok());
  EXPECT_EQ(owner_host_.table.leases(), 0u);
  EXPECT_TRUE(st->status().ok());
  EXPECT_EQ(0, std::memcmp(local.data(), memory_.data() + 10, 100));
}

TEST_F(MessageRmaTest, RefusedAndMisshapenReadAnswers) {
  std::vector<uint8_t> local(100, 0);
  // Past the region's end: refused at the owner, no payload, no lease.
  auto out_of_range = NewState();
  auto req = requester_.Read(local.data(), local.size(), desc_.address + 4000,
                             desc_, out_of_range);
  auto a = owner_.AnswerRead(req->header, NoFence());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->src, nullptr);
  EXPECT_EQ(a->len, 0u);
  EXPECT_EQ(owner_host_.table.leases(), 0u);
  auto target = requester_.OnReadAnswer(a->header, 0);
  ASSERT_TRUE(target.ok());
  EXPECT_EQ(target->local, nullptr);
  EXPECT_EQ(out_of_range->status().code(), StatusCode::kOutOfRange);

  // A failed answer that carries data anyway: a protocol error.
  auto with_data = NewState();
  req = requester_.Read(local.data(), local.size(), desc_.address + 4000, desc_,
                        with_data);
  a = owner_.AnswerRead(req->header, NoFence());
  EXPECT_FALSE(requester_.OnReadAnswer(a->header, 100).ok());
  EXPECT_FALSE(with_data->status().ok());

  // An answer of the wrong length: the read fails with kDataLoss.
  auto short_answer = NewState();
  req = requester_.Read(local.data(), local.size(), desc_.address, desc_,
                        short_answer);
  a = owner_.AnswerRead(req->header, NoFence());
  EXPECT_FALSE(requester_.OnReadAnswer(a->header, 99).ok());
  EXPECT_EQ(short_answer->status().code(), StatusCode::kDataLoss);
  a->lease.reset();

  // An answer to no request, and garbage.
  EXPECT_FALSE(requester_.OnReadAnswer(a->header, 100).ok());
  std::vector<uint8_t> junk = {1, 2, 3};
  EXPECT_FALSE(requester_.OnReadAnswer(junk, 0).ok());
  EXPECT_FALSE(owner_.AnswerRead(junk, NoFence()).ok());
  EXPECT_FALSE(owner_.AnswerValidate(junk).ok());
  EXPECT_FALSE(owner_.AdmitWrite(junk, 0, NoFence()).ok());
  EXPECT_FALSE(owner_.OnFlushRequest(junk).ok());
  EXPECT_FALSE(requester_.OnFlushAnswer(junk).ok());
  EXPECT_FALSE(requester_.OnError(junk, "peer").ok());
  EXPECT_EQ(requester_.pending(), 0u);
}

TEST_F(MessageRmaTest, WritesAreAdmittedIntoTheRangeOrReportedBack) {
  auto header = MessageRma::WriteHeader(desc_.address + 64, desc_, 32);
  auto w = owner_.AdmitWrite(header, 32, NoFence());
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->refused.ok());
  EXPECT_EQ(w->dst, memory_.data() + 64);
  EXPECT_EQ(owner_host_.table.leases(), 1u);
  w->lease.reset();

  // A payload that does not match the header's length.
  w = owner_.AdmitWrite(header, 31, NoFence());
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->refused.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w->dst, nullptr);
  EXPECT_EQ(owner_host_.table.leases(), 0u);

  // A forged token: refused, and the error travels back to the writer,
  // which reports it once, at its next Flush.
  RegionDescriptor forged = desc_;
  forged.token.hi ^= 1;
  w = owner_.AdmitWrite(MessageRma::WriteHeader(desc_.address, forged, 8), 8,
                        NoFence());
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->refused.code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(requester_.OnError(w->error_header, "owner").ok());
  Status kept = requester_.TakeAsyncError();
  EXPECT_EQ(kept.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(kept.message().find("write rejected"), std::string::npos);
  EXPECT_TRUE(requester_.TakeAsyncError().ok());
}

TEST_F(MessageRmaTest, AFlushIsAnsweredOnlyOnceEarlierWritesAreInPlace) {
  auto st = NewState();
  auto req = requester_.Flush(st);
  ASSERT_TRUE(req.ok());
  // No write arriving: answered at once.
  auto now = owner_.OnFlushRequest(req->header);
  ASSERT_TRUE(now.ok() && now->has_value());
  ASSERT_TRUE(requester_.OnFlushAnswer(**now).ok());
  EXPECT_TRUE(st->status().ok());

  // Two writes still arriving: the flush waits for the second to land.
  owner_.BeginWrite();
  owner_.BeginWrite();
  auto later = NewState();
  req = requester_.Flush(later);
  auto held = owner_.OnFlushRequest(req->header);
  ASSERT_TRUE(held.ok());
  EXPECT_FALSE(held->has_value());
  EXPECT_TRUE(owner_.EndWrite().empty());
  auto due = owner_.EndWrite();
  ASSERT_EQ(due.size(), 1u);
  EXPECT_FALSE(later->done());
  ASSERT_TRUE(requester_.OnFlushAnswer(due[0]).ok());
  EXPECT_TRUE(later->status().ok());
}

TEST_F(MessageRmaTest, CloseFailsWhatIsPendingAndEveryLaterRequest) {
  std::vector<uint8_t> local(8);
  auto read = NewState();
  auto flush = NewState();
  auto withdrawn = NewState();
  ASSERT_TRUE(
      requester_.Read(local.data(), 8, desc_.address, desc_, read).ok());
  ASSERT_TRUE(requester_.Flush(flush).ok());
  auto w = requester_.Validate(desc_, withdrawn);
  requester_.Withdraw(w->id);  // could not be sent: forgotten, not completed
  EXPECT_EQ(requester_.pending(), 2u);

  requester_.Close(UnavailableError("peer: connection lost"));
  EXPECT_EQ(read->status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(flush->status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(withdrawn->done());
  EXPECT_EQ(requester_.pending(), 0u);
  auto after = requester_.Flush(NewState());
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable);
  // The first failure stays.
  requester_.Close(AbortedError("channel closed"));
  EXPECT_EQ(requester_.Read(local.data(), 8, desc_.address, desc_, NewState())
                .status()
                .code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace membox::transport
