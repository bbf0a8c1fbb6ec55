// The TRELLIS_* switches: "0" and "1" only; a typo is said (once a variable) and taken as unset,
// not silently as on.
#include <gtest/gtest.h>

#include "core/env.hpp"
#include "scoped_env.hpp"

using trellis::env_switch;
using trellis::env_switch_on;

TEST(EnvSwitch, ZeroOneUnsetAndTyposSaidOnce) {
  const char* name = "TRELLIS_TEST_ENV_SWITCH";
  {
    ScopedEnv unset(name, nullptr);
    EXPECT_EQ(env_switch(name), -1);
    EXPECT_TRUE(env_switch_on(name, true));
    EXPECT_FALSE(env_switch_on(name, false));
  }
  {
    ScopedEnv empty(name, "");
    EXPECT_EQ(env_switch(name), -1);
  }
  {
    ScopedEnv off(name, "0");
    EXPECT_EQ(env_switch(name), 0);
    EXPECT_FALSE(env_switch_on(name, true));
  }
  {
    ScopedEnv on(name, "1");
    EXPECT_EQ(env_switch(name), 1);
    EXPECT_TRUE(env_switch_on(name, false));
  }
  ScopedEnv typo(name, "yes");
  testing::internal::CaptureStderr();
  EXPECT_EQ(env_switch(name), -1);
  EXPECT_FALSE(env_switch_on(name, false));  // (as unset: not on)
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(said, "trellis: warning: TRELLIS_TEST_ENV_SWITCH=yes is neither 0 nor 1: taken as unset\n");
}
