#include "membox/base/environment.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

#include "membox/base/copy.h"
#include "membox/base/logging.h"
#include "membox/base/secret.h"

namespace membox {
namespace {

// Sets variables for one test and restores the environment after it.
class EnvironmentTest : public ::testing::Test {
 protected:
  void SetUp() override { threshold_ = StreamingCopyThreshold(); }
  void TearDown() override {
    for (const char* n :
         {"MEMBOX_SECRET", "MEMBOX_SECRET_FILE", "MEMBOX_LOG_LEVEL",
          "MEMBOX_STREAMING_COPY_THRESHOLD"}) {
      ::unsetenv(n);
    }
    (void)SetLogLevel("info");
    (void)SetStreamingCopyThreshold(std::to_string(threshold_));
    if (!file_.empty()) std::remove(file_.c_str());
  }
  std::string SecretFile(const std::string& text) {
    file_ = ::testing::TempDir() + "environment_test_secret_" +
            std::to_string(::getpid());
    std::ofstream(file_) << text;
    return file_;
  }
  std::string file_;
  size_t threshold_ = 0;
};

TEST_F(EnvironmentTest, GetEnvTreatsEmptyAsUnset) {
  ::setenv("MEMBOX_SECRET", "", 1);
  EXPECT_FALSE(GetEnv("MEMBOX_SECRET").has_value());
  ::setenv("MEMBOX_SECRET", "x", 1);
  EXPECT_EQ(GetEnv("MEMBOX_SECRET"), "x");
}

TEST_F(EnvironmentTest, TheSecretRuleIsFlagThenFileThenEnvironment) {
  std::string path = SecretFile("from-file \n");
  ::setenv("MEMBOX_SECRET", "from-env\r", 1);
  ::setenv("MEMBOX_SECRET_FILE", path.c_str(), 1);
  // A flag wins; the inline secret has no file to check.
  auto a = ResolveSecretOrEnvironment("flag", "");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->secret, "flag");
  EXPECT_EQ(a->file, "");
  auto b = ResolveSecretOrEnvironment("", path);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->secret, "from-file");
  EXPECT_EQ(b->file, path);
  // No flag: MEMBOX_SECRET, then MEMBOX_SECRET_FILE (whose file is named).
  auto c = ResolveSecretOrEnvironment("", "");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->secret, "from-env");
  EXPECT_EQ(c->file, "");
  ::unsetenv("MEMBOX_SECRET");
  auto d = ResolveSecretOrEnvironment("", "");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->secret, "from-file");
  EXPECT_EQ(d->file, path);
}

TEST_F(EnvironmentTest, NoSecretAnywhereNamesEverySource) {
  auto r = ResolveSecretOrEnvironment("", "");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  for (const char* what :
       {"--secret-file", "--secret", "MEMBOX_SECRET", "MEMBOX_SECRET_FILE"}) {
    EXPECT_NE(r.status().message().find(what), std::string::npos) << what;
  }
  // An unreadable MEMBOX_SECRET_FILE is an error, not "no secret".
  ::setenv("MEMBOX_SECRET_FILE", "/nonexistent/secret", 1);
  EXPECT_EQ(ResolveSecretOrEnvironment("", "").status().code(),
            StatusCode::kNotFound);
}

TEST_F(EnvironmentTest, BaseAloneReadsNoEnvironment) {
  ::setenv("MEMBOX_SECRET", "from-env", 1);
  ::setenv("MEMBOX_LOG_LEVEL", "error", 1);
  EXPECT_FALSE(ResolveSecret("", "").ok());
  InitLogging("environment-test");
  EXPECT_EQ(spdlog::get_level(), spdlog::level::info);
}

TEST_F(EnvironmentTest, ProcessSettingsApplyAndBadValuesChangeNothing) {
  ::setenv("MEMBOX_LOG_LEVEL", "error", 1);
  ::setenv("MEMBOX_STREAMING_COPY_THRESHOLD", "4MiB", 1);
  ApplyProcessEnvironment();
  EXPECT_EQ(spdlog::get_level(), spdlog::level::err);
  EXPECT_EQ(StreamingCopyThreshold(), 4u << 20);
  ::setenv("MEMBOX_LOG_LEVEL", "loud", 1);
  ::setenv("MEMBOX_STREAMING_COPY_THRESHOLD", "lots", 1);
  ApplyProcessEnvironment();
  EXPECT_EQ(spdlog::get_level(), spdlog::level::err);
  EXPECT_EQ(StreamingCopyThreshold(), 4u << 20);
  EXPECT_FALSE(SetLogLevel("loud").ok());
}

}  // namespace
}  // namespace membox
