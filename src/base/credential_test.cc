#include "membox/base/credential.h"

#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>
#include <unistd.h>

namespace membox {
namespace {

Principal Job(const std::string& name, uint32_t pct, uint64_t serial = 1) {
  Principal p;
  p.cluster = false;
  p.name = name;
  p.rights = kRightWorker;
  p.quota_percent = pct;
  p.serial = serial;
  return p;
}

TEST(CredentialTest, IssueEncodeParseRoundTrips) {
  auto c = Credential::Issue("cluster-secret", Job("job-a", 25));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::string line = c->Encode();
  EXPECT_TRUE(Credential::Looks(line));
  EXPECT_EQ(line.rfind("mbxcred1:job-a:worker:25%:1:", 0), 0u) << line;
  auto back = Credential::Parse(line);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->principal.name, "job-a");
  EXPECT_EQ(back->principal.quota_percent, 25u);
  EXPECT_FALSE(back->principal.cluster);
  EXPECT_EQ(back->key, c->key);
  EXPECT_EQ(back->key.size(), 32u);
  EXPECT_EQ(back->principal.QuotaOf(1000, 7), 250u);
  EXPECT_EQ(Principal().QuotaOf(1000, 7), 7u);
}

TEST(CredentialTest, TheKeyDependsOnEveryFieldAndTheClusterSecret) {
  auto base = Credential::Issue("s", Job("job-a", 25))->key;
  EXPECT_NE(Credential::Issue("t", Job("job-a", 25))->key, base);
  EXPECT_NE(Credential::Issue("s", Job("job-b", 25))->key, base);
  EXPECT_NE(Credential::Issue("s", Job("job-a", 50))->key, base);
  EXPECT_NE(Credential::Issue("s", Job("job-a", 25, 2))->key, base);
  Principal more = Job("job-a", 25);
  more.rights |= kRightNode;
  EXPECT_NE(Credential::Issue("s", more)->key, base);
  EXPECT_EQ(DeriveCredentialKey("s", Job("job-a", 25).public_id()), base);
}

TEST(CredentialTest, MalformedTextIsRefused) {
  auto good = Credential::Issue("s", Job("job-a", 25))->Encode();
  for (const std::string& bad :
       {std::string("mbxcred1:"), std::string("mbxcred1:a:worker:1:1"),
        std::string("mbxcred1:cluster:worker:0:1:") + std::string(64, '0'),
        std::string("mbxcred1:a b:worker:0:1:") + std::string(64, '0'),
        std::string("mbxcred1:a:root:0:1:") + std::string(64, '0'),
        std::string("mbxcred1:a:worker:101%:1:") + std::string(64, '0'),
        std::string("mbxcred1:a:worker:0:1:") + std::string(63, '0'),
        std::string("mbxcred1:a:worker:0:1:") + std::string(64, 'g'),
        std::string("mbxcred1:a:worker:007:1:") + std::string(64, '0'),
        std::string("mbxcred1:a:worker:0:-1:") + std::string(64, '0'),
        std::string("mbxcred1:a:worker:0:1:x:") + std::string(64, '0'),
        good.substr(0, good.size() - 1)}) {
    EXPECT_FALSE(Credential::Parse(bad).ok()) << bad;
  }
  EXPECT_FALSE(Credential::Looks("just-a-secret"));
  EXPECT_FALSE(ValidatePrincipalName(std::string(65, 'a')).ok());
  EXPECT_FALSE(ValidatePrincipalName("").ok());
  EXPECT_FALSE(ValidatePrincipalName(std::string("a\0b", 3)).ok());
  EXPECT_FALSE(ParseRights("").ok());
}

TEST(RevocationListTest, RevokesByNameOrBelowASerialAndReloads) {
  std::string path =
      ::testing::TempDir() + "/membox-revoked-" + std::to_string(::getpid());
  std::remove(path.c_str());
  RevocationList rl(path);
  ASSERT_TRUE(rl.Load().ok());  // missing: nothing revoked
  EXPECT_TRUE(rl.Admit(Job("job-a", 25, 1)).ok());
  ASSERT_TRUE(RevocationList::Append(path, "job-a", 2).ok());
  ASSERT_TRUE(RevocationList::Append(path, "job-b", 0).ok());
  ASSERT_TRUE(rl.Load().ok());
  EXPECT_EQ(rl.Admit(Job("job-a", 25, 1)).code(),
            StatusCode::kPermissionDenied);
  EXPECT_TRUE(rl.Admit(Job("job-a", 25, 2)).ok());  // the rotated one
  EXPECT_EQ(rl.Admit(Job("job-b", 25, 9)).code(),
            StatusCode::kPermissionDenied);
  EXPECT_TRUE(rl.Admit(Principal()).ok());  // the cluster
  // A malformed file is an error at load.
  { std::ofstream(path, std::ios::app) << "job-c sometimes\n"; }
  EXPECT_EQ(rl.Load().code(), StatusCode::kInvalidArgument);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace membox
